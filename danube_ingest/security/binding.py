"""Identity binding: producer and consumer registrations belong to the principal that created
them (``ClientRecord.principal``)."""

from __future__ import annotations

from danube_ingest.security.errors import PermissionDeniedError


def check_owner(caller: str | None, owner: str | None, what: str) -> None:
    """Raise :class:`PermissionDeniedError` if ``what`` (a producer or consumer id or name,
    named in the message) belongs to another principal than ``caller``.

    ``caller`` is ``None`` with auth off: nothing is checked then. A registration made with
    auth off (``owner`` ``None``) belongs to nobody: it is refused here, and claimed by the
    first principal that creates the producer or subscribes the consumer by name again.
    """
    if caller is not None and owner != caller:
        raise PermissionDeniedError(
            f"{what} belongs to another principal: principal {caller!r} may only use the "
            f"producers and consumers it created (create the producer or subscribe again, "
            f"with a name of its own)"
        )
