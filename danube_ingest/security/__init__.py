"""Who may call the broker and what each caller may do (``auth`` in the configuration).

* :mod:`~danube_ingest.security.authn`: JWT bearer tokens (HMAC, RSA, EC) and API keys ->
  :class:`Principal`; ``UNAUTHENTICATED`` otherwise.
* :mod:`~danube_ingest.security.authz`: ``auth.permissions`` -> produce / consume / admin per
  namespace or topic pattern; ``PERMISSION_DENIED`` otherwise.
* :mod:`~danube_ingest.security.guard`: the :class:`Caller` of a gRPC call, the interceptor that
  authenticates every RPC.
* :mod:`~danube_ingest.security.binding`: producer and consumer ids belong to the principal
  that created them.

Dependencies point one way: the broker imports this package; it imports only ``config`` and
``errors``.
"""

from danube_ingest.security.authn import ANONYMOUS, Authenticator, Principal, hash_api_key
from danube_ingest.security.authz import Authorizer, resource_matches
from danube_ingest.security.binding import check_owner
from danube_ingest.security.errors import (
    TOKEN_EXPIRED,
    PermissionDeniedError,
    SecurityError,
    TokenExpiredError,
    UnauthenticatedError,
)
from danube_ingest.security.guard import AuthInterceptor, Caller, Guard

__all__ = [
    "ANONYMOUS",
    "TOKEN_EXPIRED",
    "AuthInterceptor",
    "Authenticator",
    "Authorizer",
    "Caller",
    "Guard",
    "PermissionDeniedError",
    "Principal",
    "SecurityError",
    "TokenExpiredError",
    "UnauthenticatedError",
    "check_owner",
    "hash_api_key",
    "resource_matches",
]
