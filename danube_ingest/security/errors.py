"""Errors of the security layer and the gRPC status each one is answered with.

::

    SecurityError                    status
     ├── UnauthenticatedError         UNAUTHENTICATED    no, malformed, expired or unverifiable
     │    │                                              credentials (the message says which)
     │    └── TokenExpiredError                          the JWT expired: refused, or a stream
     │                                                   opened with it ends (re-authenticate)
     └── PermissionDeniedError        PERMISSION_DENIED  the caller may not do this: a missing
                                                         permission (names principal, action,
                                                         resource) or another caller's producer
                                                         or consumer id, name or message

Neither is retriable: the same call fails again until the credentials or the configuration
change. A :class:`TokenExpiredError`'s message starts with :data:`TOKEN_EXPIRED`, which is how
a client (``danube_ingest.client``) tells an expiry, mended by a fresh token from its token
provider, from a refusal.
"""

from __future__ import annotations

from danube_ingest.errors import DanubeIngestError


class SecurityError(DanubeIngestError):
    """Root of the security layer's errors."""


class UnauthenticatedError(SecurityError):
    """The caller did not prove who it is."""


class PermissionDeniedError(SecurityError):
    """The caller is known but may not do what it asked."""


#: How the message of every :class:`TokenExpiredError` starts (clients match it: it is part of
#: the protocol).
TOKEN_EXPIRED = "token expired"


class TokenExpiredError(UnauthenticatedError):
    """The caller's JWT expired (``exp`` passed, with ``auth.jwt.clock_skew_seconds`` of
    leeway): a call with it is refused, and a stream opened with it ends."""
