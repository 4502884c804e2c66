"""The public API is what ``danube_ingest.dispatch.__all__`` names."""

from __future__ import annotations

import danube_ingest.dispatch as dispatch
from danube_ingest.dispatch import (
    NonReliableSubscription,
    ReliableSubscription,
    Subscription,
)
from danube_ingest.errors import DanubeIngestError


def test_all_names_exist_and_are_sorted() -> None:
    assert dispatch.__all__ == sorted(dispatch.__all__)
    for name in dispatch.__all__:
        assert hasattr(dispatch, name), name


def test_errors_share_the_root() -> None:
    for name in ("ConsumerClosedError", "SubscriptionBusyError", "SubscriptionTypeMismatchError"):
        error = getattr(dispatch, name)
        assert issubclass(error, dispatch.DispatchError)
        assert issubclass(error, DanubeIngestError)


def test_both_subscriptions_meet_the_contract() -> None:
    # Checked by mypy: both classes are assignable to the protocol.
    kinds: list[type[Subscription]] = [ReliableSubscription, NonReliableSubscription]
    assert len(kinds) == 2
