"""Credentials the batch client sends: ``authorization: Bearer <token>`` on each stream, as
danube-client does (a JWT or an API key; see docs/security.md).

A token is a fixed string, or a *token provider*: a function called for a token each time a
stream is opened (as danube-client's ``with_token_supplier``). The daemon ends a stream with
UNAUTHENTICATED when the JWT it was opened with expires (the message starts with
``TOKEN_EXPIRED``); with a provider that then hands out another token the client opens the
stream again with it (re-authentication, as Kafka's KIP-368), else the expiry is final.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc

from danube_ingest.security.errors import TOKEN_EXPIRED

#: A function returning the token to send on a new stream (called once per stream opened).
TokenProvider = Callable[[], str]


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The metadata of a call made with ``token`` (``None``: no credentials)."""
    return (("authorization", f"Bearer {token}"),) if token else None


class Credentials:
    """What a client's streams send: a fixed token, a :data:`TokenProvider`, or nothing."""

    def __init__(self, token: str | TokenProvider | None) -> None:
        self._provider = token if callable(token) else None
        self._fixed = None if callable(token) else token
        self._sent: str | None = None
        self._next: str | None = None

    def metadata(self) -> tuple[tuple[str, str], ...] | None:
        """The metadata of a new stream: the provider's token (asked now) or the fixed one."""
        token = self._fixed
        if self._provider is not None:
            token, self._next = self._next or self._provider(), None
        self._sent = token
        return call_metadata(token)

    def renewable(self, code: grpc.StatusCode, details: str) -> bool:
        """Whether a stream that ended with ``code`` / ``details`` ended because its token
        expired and the provider now has another token (which the next :meth:`metadata`
        sends): then opening the stream again can succeed. False for a fixed token, any other
        refusal, or a provider still handing out the expired token."""
        if (
            self._provider is None
            or code != grpc.StatusCode.UNAUTHENTICATED
            or not details.startswith(TOKEN_EXPIRED)
        ):
            return False
        fresh = self._provider()
        if fresh == self._sent:
            return False
        self._next = fresh
        return True
