"""Credentials the batch client sends: ``authorization: Bearer <token>`` on each stream, as
danube-client does (a JWT or an API key; see docs/security.md)."""

from __future__ import annotations


def call_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    """The metadata of a call made with ``token`` (``None``: no credentials)."""
    return (("authorization", f"Bearer {token}"),) if token else None
