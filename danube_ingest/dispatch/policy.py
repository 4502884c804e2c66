"""Subscription types and the reliable dispatch policy.

Defaults follow the Danube broker (``SubscriptionFailurePolicy::default``) except
``max_unacked``: Danube's window is 10 messages; ours is 1000 per consumer, so a consumer on a
high-latency link is not throttled to ten messages per round trip. Memory stays bounded by
``max_unacked`` times the number of consumers (see :class:`ReliableSubscription`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from danube_ingest.errors import ConfigError


class SubscriptionType(enum.IntEnum):
    """How a subscription spreads messages over its consumers (Danube's proto numbers)."""

    EXCLUSIVE = 0
    """One consumer name at a time; every message goes to it."""
    SHARED = 1
    """Round robin over the consumers that have window room; no ordering."""
    FAILOVER = 2
    """The first attached consumer is active, the others stand by in attach order."""
    KEY_SHARED = 3
    """Each key (routing key, else producer name) goes to one consumer; per-key ordering."""


class PoisonPolicy(enum.Enum):
    """What happens to a message whose last allowed delivery failed.

    A message is delivered at most ``1 + max_redeliveries`` times; when that last delivery is
    nacked or times out, the policy applies.
    """

    BLOCK = "block"
    """Keep the message unsettled and redeliver it every ``redelivery_max_s`` until it is
    acknowledged. Meanwhile the subscription gives no consumer an entry it has not delivered
    before and reads nothing new from the topic (a read already under way completes, and its
    entries wait); entries already out keep being acked and redelivered. Nothing is lost, and
    the subscription stalls visibly (``ReliableSubscription.blocked``) instead of running ahead.
    Danube parks the message without redelivering it; we keep retrying at the capped delay so
    a transient failure heals without an operator."""
    DROP = "drop"
    """Treat the message as acknowledged (logged at warning level); the cursor moves past it."""
    DEAD_LETTER = "dead_letter"
    """Hand the message to the subscription's ``dead_letter`` callback (which republishes it
    to the dead-letter topic); once that succeeds, treat it as acknowledged."""


@dataclass(frozen=True, slots=True)
class DispatchPolicy:
    """Flow control and redelivery knobs of a reliable subscription.

    Redelivery delay after delivery number ``n`` of a message failed::

        backoff(n)  = min(redelivery_max_s, redelivery_base_s * 2 ** (n - 1))
        ack timeout : backoff(n)
        nack(d)     : min(redelivery_max_s, max(nack_base_delay_s, d, backoff(n)))
    """

    max_unacked: int = 1000
    """Messages a consumer may hold unacknowledged (its window). Messages waiting for their
    redelivery delay count against the subscription's budget (``max_unacked`` per consumer
    that can receive), not against a consumer's window."""
    ack_timeout_s: float = 30.0
    """A delivered message not acknowledged (nor nacked) within this many seconds fails and is
    redelivered. Danube's default."""
    nack_base_delay_s: float = 1.0
    """Minimum delay before a nacked message is redelivered, whatever delay the client asked."""
    redelivery_base_s: float = 1.0
    """Backoff after the first failed delivery; it doubles with each further failure."""
    redelivery_max_s: float = 60.0
    """Cap on any redelivery delay, including the delay a client asks for in a nack."""
    max_redeliveries: int = 5
    """Redeliveries after the first delivery before the poison policy applies (Danube's
    ``max_redelivery_count``)."""
    poison: PoisonPolicy = PoisonPolicy.BLOCK
    """Danube's default. Block is the only policy that neither loses a message nor moves it
    elsewhere without an operator having chosen so; Drop and DeadLetter must be asked for."""
    dead_letter_topic: str = "{topic}-dlq"
    """Where DeadLetter republishes; ``{topic}`` is replaced by the subscription's topic."""
    read_batch: int = 256
    """Entries fetched from the topic store per read. The subscription holds at most one
    batch beyond its consumers' windows."""

    def __post_init__(self) -> None:
        if self.max_unacked < 1:
            raise ConfigError(f"dispatch max_unacked must be >= 1, got {self.max_unacked}")
        if self.read_batch < 1:
            raise ConfigError(f"dispatch read_batch must be >= 1, got {self.read_batch}")
        if self.max_redeliveries < 0:
            raise ConfigError(
                f"dispatch max_redeliveries must be >= 0, got {self.max_redeliveries}"
            )
        if self.ack_timeout_s <= 0:
            raise ConfigError(f"dispatch ack_timeout_s must be > 0, got {self.ack_timeout_s}")
        for key in ("nack_base_delay_s", "redelivery_base_s", "redelivery_max_s"):
            if getattr(self, key) < 0:
                raise ConfigError(f"dispatch {key} must be >= 0, got {getattr(self, key)}")
        if "{topic}" not in self.dead_letter_topic and not self.dead_letter_topic.startswith("/"):
            raise ConfigError(
                f"dispatch dead_letter_topic must contain '{{topic}}' or be a topic name "
                f"'/namespace/topic', got {self.dead_letter_topic!r}"
            )

    def backoff(self, attempt: int) -> float:
        """Delay (s) after delivery number ``attempt`` (1-based) failed by ack timeout."""
        exponent = min(max(attempt, 1) - 1, 62)  # 2**62 s is already far past any cap
        return min(self.redelivery_max_s, self.redelivery_base_s * 2.0**exponent)

    def nack_delay(self, attempt: int, requested_s: float) -> float:
        """Delay (s) after delivery number ``attempt`` was nacked asking for ``requested_s``."""
        wanted = max(self.nack_base_delay_s, requested_s, self.backoff(attempt))
        return min(self.redelivery_max_s, wanted)

    def dead_letter_topic_for(self, topic: str) -> str:
        """The dead-letter topic of ``topic``."""
        return self.dead_letter_topic.replace("{topic}", topic)
