"""What the broker accepts from a client, checked before anything is stored or an offset used.

Every check raises :class:`InvalidRequestError` (``INVALID_ARGUMENT``) naming the field, its
size and the limit; sizes are UTF-8 bytes. Values echoed in a message are cut (``shown``): an
error text travels in a gRPC header, which a long name would overflow.

Limits:

* producer, consumer and subscription names: at most ``MAX_NAME_BYTES`` (255) bytes (they are
  etcd key segments or stored in etcd records) and no control characters (U+0000-U+001F,
  U+007F: a NUL would cut the name short in logs, metrics labels and C tools); a topic name is
  bounded in ``broker.names``.
* KeyShared key filters (``check_key_filters``): at most ``MAX_KEY_FILTERS`` (64) filters of at
  most ``MAX_KEY_FILTER_BYTES`` (1,024) bytes each, none empty: they are stored in the
  consumer's etcd record and compiled into one pattern matched against every routed key.
* Ack and Nack: a well-formed topic name (``broker.names``) and a subscription name that could
  exist (``check_subscription_name``: a key segment, 1-255 characters without '/', spaces or
  controls). A well-formed name of a topic or subscription that does not exist is no error
  there: such a settle is ignored.
* a published message (``check_message``): payload at most ``limits.max_payload_bytes``; at
  most ``limits.max_attributes`` attributes; a routing key or attribute key at most
  ``MAX_KEY_BYTES`` (65,535, what the WAL frame holds); the producer name at most
  ``MAX_NAME_BYTES``; the payload, every attribute key and value, the routing key and the
  producer name together at most ``limits.max_payload_bytes`` (so a delivered message always
  fits the broker's gRPC send limit); ``publish_time`` at most 2**63 - 1 (stored signed).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from danube_ingest.broker.errors import InvalidRequestError
from danube_ingest.config import LimitsConfig
from danube_ingest.dispatch import SubscriptionType
from danube_ingest.metadata.keys import check_segment
from danube_ingest.wal.framing import MAX_SHORT_FIELD

#: Longest producer, consumer or subscription name (UTF-8 bytes): the longest etcd key segment.
MAX_NAME_BYTES = 255
#: Longest routing key or attribute key (UTF-8 bytes): the WAL frame stores their lengths in 16
#: bits.
MAX_KEY_BYTES = MAX_SHORT_FIELD
#: Largest ``publish_time``: the WAL stores it as a signed 64-bit integer.
MAX_PUBLISH_TIME = (1 << 63) - 1
#: Most key filters one KeyShared consumer may give: each is matched (as one combined pattern)
#: against every key routed to the subscription, and all are stored in its etcd record.
#: Danube's own examples use one or two; 64 leaves room for a consumer per region or tenant.
MAX_KEY_FILTERS = 64
#: Longest key filter (UTF-8 bytes): a glob over routing keys, which are rarely longer than a
#: few dozen bytes; 1 KiB bounds the compiled pattern and the etcd record.
MAX_KEY_FILTER_BYTES = 1024
#: Characters of a value echoed in an error message.
SHOWN_CHARS = 64

_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def shown(value: str, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)``, cut to about ``limit`` characters (with its full length) if longer."""
    if len(value) <= limit:
        return repr(value)
    return f"{value[:limit]!r}... ({len(value)} characters)"


def _utf8(value: str) -> int:
    # (Strings parsed from protobuf are valid UTF-8: encoding cannot fail.)
    return len(value) if value.isascii() else len(value.encode())


def check_name(value: str, what: str) -> None:
    """Refuse a producer, consumer or subscription name over ``MAX_NAME_BYTES`` or holding a
    control character."""
    size = _utf8(value)
    if size > MAX_NAME_BYTES:
        raise InvalidRequestError(
            f"{what} {shown(value)} is {size} bytes long; at most {MAX_NAME_BYTES} bytes (UTF-8)"
        )
    control = _CONTROL.search(value)
    if control is not None:
        raise InvalidRequestError(
            f"{what} {shown(value)} holds the control character U+{ord(control.group()):04X} "
            f"at index {control.start()}; use printable characters"
        )


def check_key_filters(filters: Sequence[str]) -> None:
    """Refuse KeyShared key filters beyond ``MAX_KEY_FILTERS`` in count, an empty one, or one
    over ``MAX_KEY_FILTER_BYTES``."""
    if len(filters) > MAX_KEY_FILTERS:
        raise InvalidRequestError(
            f"{len(filters)} key filters; at most {MAX_KEY_FILTERS} (combine them into fewer "
            f"globs, or split the keys between more consumers)"
        )
    for index, pattern in enumerate(filters):
        size = _utf8(pattern)
        if size == 0:
            raise InvalidRequestError(
                f"key filter {index} is empty; give a glob such as 'eu-*' (no filters: every key)"
            )
        if size > MAX_KEY_FILTER_BYTES:
            raise InvalidRequestError(
                f"key filter {index} {shown(pattern)} is {size} bytes long; at most "
                f"{MAX_KEY_FILTER_BYTES} bytes (UTF-8)"
            )


def check_subscription_name(subscription: str, what: str) -> None:
    """Refuse a subscription name (in ``what``: the request naming it) that no subscription can
    have: empty, over ``MAX_NAME_BYTES``, or not one metadata key segment."""
    if not subscription:
        raise InvalidRequestError(f"{what} names no subscription: set its subscription name")
    check_name(subscription, f"{what} subscription name")
    check_segment(subscription, f"{what} subscription name")


def subscription_type(value: int) -> SubscriptionType:
    """The subscription type numbered ``value`` in Danube's protocol."""
    try:
        return SubscriptionType(value)
    except ValueError:
        known = ", ".join(f"{t.value} ({t.name})" for t in SubscriptionType)
        raise InvalidRequestError(
            f"unknown subscription_type {value}: expected one of {known}"
        ) from None


def check_message(msg: Any, limits: LimitsConfig) -> None:
    """Refuse a published ``StreamMessage`` that breaks a limit (see the module docstring).

    Shared by every publish path; it looks only at the message, so it runs before the topic's
    store sees anything.
    """
    payload = len(msg.payload)
    limit = limits.max_payload_bytes
    if payload > limit:
        raise InvalidRequestError(
            f"payload of {payload} bytes exceeds limits.max_payload_bytes ({limit})"
        )
    attributes = msg.attributes
    if len(attributes) > limits.max_attributes:
        raise InvalidRequestError(
            f"{len(attributes)} attributes exceed limits.max_attributes ({limits.max_attributes})"
        )
    attr_bytes = 0
    for key, value in attributes.items():
        size = _utf8(key)
        if size > MAX_KEY_BYTES:
            raise InvalidRequestError(
                f"attribute key {shown(key)} is {size} bytes long; at most {MAX_KEY_BYTES}"
            )
        attr_bytes += size + _utf8(value)
    key_bytes = _utf8(msg.routing_key)
    if key_bytes > MAX_KEY_BYTES:
        raise InvalidRequestError(
            f"routing key {shown(msg.routing_key)} is {key_bytes} bytes long; "
            f"at most {MAX_KEY_BYTES}"
        )
    check_name(msg.producer_name, "producer name")
    name_bytes = _utf8(msg.producer_name)
    total = payload + attr_bytes + key_bytes + name_bytes
    if total > limit:
        raise InvalidRequestError(
            f"message of {total} bytes (payload {payload}, attributes {attr_bytes}, routing key "
            f"{key_bytes}, producer name {name_bytes}) exceeds limits.max_payload_bytes ({limit}),"
            f" which bounds all of them together"
        )
    if msg.publish_time > MAX_PUBLISH_TIME:
        raise InvalidRequestError(
            f"publish_time {msg.publish_time} exceeds {MAX_PUBLISH_TIME} (milliseconds since "
            f"the epoch)"
        )
