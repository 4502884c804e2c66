"""DispatchPolicy defaults, delays and validation."""

from __future__ import annotations

import pytest

from danube_ingest.dispatch import DispatchPolicy, PoisonPolicy, SubscriptionType
from danube_ingest.errors import ConfigError


def test_defaults_follow_danube() -> None:
    policy = DispatchPolicy()
    assert policy.max_unacked == 1000
    assert policy.ack_timeout_s == 30
    assert (policy.nack_base_delay_s, policy.redelivery_base_s, policy.redelivery_max_s) == (
        1,
        1,
        60,
    )
    assert policy.max_redeliveries == 5
    assert policy.poison is PoisonPolicy.BLOCK
    assert policy.dead_letter_topic_for("/default/orders") == "/default/orders-dlq"


def test_subscription_type_numbers_match_the_proto() -> None:
    assert [t.value for t in SubscriptionType] == [0, 1, 2, 3]
    assert SubscriptionType(3) is SubscriptionType.KEY_SHARED


def test_backoff_doubles_per_attempt_up_to_the_cap() -> None:
    policy = DispatchPolicy()
    assert [policy.backoff(n) for n in range(1, 9)] == [1, 2, 4, 8, 16, 32, 60, 60]
    assert policy.backoff(10_000) == 60


def test_nack_delay_is_the_largest_of_floor_request_and_backoff_capped() -> None:
    policy = DispatchPolicy(nack_base_delay_s=0.5, redelivery_base_s=0.1, redelivery_max_s=10)
    assert policy.nack_delay(1, 0) == 0.5
    assert policy.nack_delay(1, 2) == 2
    assert policy.nack_delay(1, 99) == 10
    assert policy.nack_delay(5, 0) == pytest.approx(1.6)


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_unacked", 0),
        ("read_batch", 0),
        ("max_redeliveries", -1),
        ("ack_timeout_s", 0),
        ("redelivery_max_s", -1),
        ("dead_letter_topic", "dlq"),
    ],
)
def test_invalid_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError, match=field):
        DispatchPolicy(**{field: value})  # type: ignore[arg-type]


def test_fixed_dead_letter_topic() -> None:
    policy = DispatchPolicy(dead_letter_topic="/default/all-dlq")
    assert policy.dead_letter_topic_for("/default/orders") == "/default/all-dlq"
