"""Errors of the security layer and the gRPC status each one is answered with.

::

    SecurityError                    status
     ├── UnauthenticatedError         UNAUTHENTICATED    no, malformed, expired or unverifiable
     │                                                   credentials (the message says which)
     └── PermissionDeniedError        PERMISSION_DENIED  the caller may not do this: a missing
                                                         permission (names principal, action,
                                                         resource) or another caller's producer
                                                         or consumer id, name or message

Neither is retriable: the same call fails again until the credentials or the configuration
change.
"""

from __future__ import annotations

from danube_ingest.errors import DanubeIngestError


class SecurityError(DanubeIngestError):
    """Root of the security layer's errors."""


class UnauthenticatedError(SecurityError):
    """The caller did not prove who it is."""


class PermissionDeniedError(SecurityError):
    """The caller is known but may not do what it asked."""
