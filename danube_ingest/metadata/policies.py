"""Retention policies, per namespace and per topic, stored in etcd.

``policies/{ns}`` and ``policies/{ns}/{topic}`` = ``RetentionPolicy`` as compact JSON. Every
field is optional; a topic's effective policy takes each field from the most specific scope
that sets it: the topic's policy, then its namespace's, then the default the caller passes
(the retention job's configuration). A field set nowhere means keep for ever.

Fields:

* ``max_age_ms``: a manifest range expires once its last entry's ingest time is older.
* ``max_bytes``: the topic's oldest ranges expire while the bytes of its ranges (the topic's
  bytes in each object, ``byte_length``) exceed it.
* ``table_max_age_ms``: the topic's Parquet tables keep partitions this recent (their
  ``since`` is moved forward).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from danube_ingest.metadata import values
from danube_ingest.metadata.errors import MetadataError
from danube_ingest.metadata.keys import Keys, split_topic
from danube_ingest.metadata.kv import KV

_FIELDS = ("max_age_ms", "max_bytes", "table_max_age_ms")


class InvalidPolicyError(MetadataError, ValueError):
    """A retention value that cannot be valid (not a positive whole number); nothing stored."""


@dataclass(frozen=True, slots=True)
class RetentionPolicy:
    """What a scope keeps; ``None`` fields are taken from the wider scope (or kept for ever)."""

    max_age_ms: int | None = None
    """Expire ranges whose last ingest time is older than this (ms)."""
    max_bytes: int | None = None
    """Expire the oldest ranges while the topic's bytes in objects exceed this."""
    table_max_age_ms: int | None = None
    """Parquet tables keep partitions this recent (ms)."""

    def __post_init__(self) -> None:
        for name in _FIELDS:
            value = getattr(self, name)
            if value is None:
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise InvalidPolicyError(
                    f"retention {name} must be a positive integer, got {value!r}"
                )

    @property
    def empty(self) -> bool:
        """Whether no field is set."""
        return all(getattr(self, name) is None for name in _FIELDS)

    def over(self, wider: RetentionPolicy) -> RetentionPolicy:
        """This policy, each unset field taken from ``wider``."""
        return RetentionPolicy(
            **{
                name: getattr(wider, name) if getattr(self, name) is None else getattr(self, name)
                for name in _FIELDS
            }
        )

    def encode(self) -> bytes:
        fields = {k: v for k, v in dataclasses.asdict(self).items() if v is not None}
        return json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def decode(cls, data: bytes, key: str) -> RetentionPolicy:
        """Parse a policy stored at ``key``; ``MetadataError`` naming ``key`` if malformed.
        Fields this version does not know are ignored."""
        try:
            raw = values.loads(data)
            if not isinstance(raw, dict):
                raise TypeError("not a JSON object")
            return cls(**{k: v for k, v in raw.items() if k in _FIELDS})
        except (ValueError, TypeError) as exc:
            raise MetadataError(f"malformed retention policy at {key}: {exc}") from exc


class Policies:
    """Reads and writes the retention policies."""

    def __init__(self, kv: KV, keys: Keys) -> None:
        self.kv = kv
        self.keys = keys

    async def get(self, scope: str) -> RetentionPolicy | None:
        """The policy stored for ``scope`` (``/ns`` or ``/ns/topic``), ``None`` if none."""
        key = self.keys.policy(scope)
        stored = await self.kv.get(key)
        return None if stored is None else RetentionPolicy.decode(stored.value, key)

    async def set(self, scope: str, policy: RetentionPolicy) -> RetentionPolicy:
        """Merge ``policy``'s set fields into the stored one of ``scope``; return the result."""
        merged = policy.over(await self.get(scope) or RetentionPolicy())
        await self.kv.put(self.keys.policy(scope), merged.encode())
        return merged

    async def clear(self, scope: str) -> bool:
        """Remove the policy of ``scope``; whether there was one."""
        return await self.kv.delete(self.keys.policy(scope)) > 0

    async def all(self) -> dict[str, RetentionPolicy]:
        """Every stored policy by scope (``/ns`` or ``/ns/topic``), from one prefix read."""
        head = self.keys.policies_prefix()
        return {
            "/" + stored.key[len(head) :]: RetentionPolicy.decode(stored.value, stored.key)
            for stored in await self.kv.get_prefix(head)
        }


def effective(
    topic: str, stored: dict[str, RetentionPolicy], default: RetentionPolicy
) -> RetentionPolicy:
    """``topic``'s policy from ``Policies.all()``: topic over namespace over ``default``."""
    ns, _ = split_topic(topic)
    policy = default
    for scope in (f"/{ns}", topic):
        found = stored.get(scope)
        if found is not None:
            policy = found.over(policy)
    return policy


__all__ = ["InvalidPolicyError", "Policies", "RetentionPolicy", "effective"]
