"""Turning stored entries into Arrow record batches, decoding Avro and JSON Schema payloads.

:func:`entries_to_batch` builds one ``pyarrow.RecordBatch`` of :func:`table_schema` from WAL
entries. The fixed columns are built column-wise from Python lists (offsets and times as int64
arrays cast to timestamps, attributes as one flat key/value array); only the payload decoding
loops per record.

A topic whose subject is Avro or JSON Schema has a :class:`SchemaDecoder`: its columns are
those of one version of the subject (the *decode version*, the latest when planned, unless
pinned). A payload is decoded with the version its message names and read into the decode
version's columns:

* Avro: one schemaless datum written with the message's version, resolved to the decode version
  (Avro schema resolution: added fields get their defaults, removed ones are skipped); bytes
  left after the datum are an error.
* JSON Schema: a UTF-8 JSON document that satisfies the message's version; fields are then
  taken by name from the decode version's columns (absent ones are null, unknown ones ignored).

A message without a schema id is decoded with the decode version; a message whose schema id
is not the topic's subject's, or names a version this decoder does not have, is not decoded.
A payload that does not decode keeps its raw bytes, gets nulls in the decoded columns and the
reason in ``decode_error``: no message is ever dropped.
"""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Sequence
from typing import Any

import fastavro
import jsonschema.exceptions
import pyarrow as pa

from danube_ingest.analytics.columns import (
    FIXED_SCHEMA,
    Column,
    avro_columns,
    json_schema_columns,
    table_schema,
)
from danube_ingest.schema import SchemaNotFoundError, SchemaRegistry, SchemaType
from danube_ingest.schema.formats import avro_schema, json_schema_validator
from danube_ingest.wal.framing import Entry

__all__ = ["SchemaDecoder", "entries_to_batch", "load_decoder"]

log = logging.getLogger(__name__)

#: Longest ``decode_error`` text: the reason, not a whole document.
_MAX_ERROR = 500

_TIMESTAMP = FIXED_SCHEMA.field("ingest_time").type


class SchemaDecoder:
    """The schema of a topic's subject: every version's definition, and the decode version.

    Picklable (only the definitions are pickled; parsed schemas are rebuilt on first use), so
    a Spark driver builds it once and ships it to every task. Raises
    :class:`danube_ingest.schema.InvalidSchemaError` if a definition does not parse.
    """

    def __init__(
        self,
        topic: str,
        subject: str,
        schema_id: int,
        schema_type: SchemaType,
        versions: dict[int, bytes],
        decode_version: int,
    ) -> None:
        if decode_version not in versions:
            raise ValueError(f"decode version {decode_version} is not among {sorted(versions)}")
        self.topic = topic
        self.subject = subject
        self.schema_id = schema_id
        self.schema_type = schema_type
        self.versions = dict(versions)
        self.decode_version = decode_version
        self._columns: list[Column] | None = None
        self._parsed: dict[int, Any] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_columns"] = None
        state["_parsed"] = {}
        return state

    def __repr__(self) -> str:
        return (
            f"SchemaDecoder({self.topic}, subject={self.subject!r}, id={self.schema_id}, "
            f"{self.schema_type.value} v{self.decode_version})"
        )

    @property
    def decodes(self) -> bool:
        """True when payloads become typed columns (Avro and JSON Schema subjects)."""
        return self.schema_type in (SchemaType.AVRO, SchemaType.JSON_SCHEMA)

    @property
    def columns(self) -> list[Column]:
        """The decoded columns (empty for subjects of other types)."""
        if self._columns is None:
            if self.schema_type is SchemaType.AVRO:
                self._columns = avro_columns(self._schema(self.decode_version))
            elif self.schema_type is SchemaType.JSON_SCHEMA:
                document = json.loads(self.versions[self.decode_version])
                self._columns = json_schema_columns(document)
            else:
                self._columns = []
        return self._columns

    def _schema(self, version: int) -> Any:
        """The parsed Avro schema or compiled JSON Schema validator of ``version``."""
        parsed = self._parsed.get(version)
        if parsed is None:
            document = json.loads(self.versions[version])
            if self.schema_type is SchemaType.AVRO:
                parsed = avro_schema(document, {})
            else:
                parsed = json_schema_validator(document)
            self._parsed[version] = parsed
        return parsed

    def decode(self, payload: bytes, schema_id: int | None, version: int) -> list[Any]:
        """The payload's values for :attr:`columns`, in order (before conversion); raises
        ``ValueError`` with the reason if it does not decode."""
        if schema_id is not None and schema_id != self.schema_id:
            raise ValueError(
                f"schema id {schema_id} is not the id of subject {self.subject!r} "
                f"({self.schema_id})"
            )
        if schema_id is None or version == 0:
            version = self.decode_version
        if version not in self.versions:
            raise ValueError(
                f"subject {self.subject!r} version {version} is unknown to this read "
                f"(it knows versions {sorted(self.versions)}; plan the read again)"
            )
        columns = self.columns
        if self.schema_type is SchemaType.AVRO:
            value = self._avro(payload, version)
        else:
            value = self._json(payload, version)
        if len(columns) == 1 and not columns[0].source:
            return [value]
        if not isinstance(value, dict):
            raise ValueError(f"payload is a {type(value).__name__}, not an object")
        return [value.get(column.source) for column in columns]

    def _avro(self, payload: bytes, version: int) -> Any:
        buffer = io.BytesIO(payload)
        writer = self._schema(version)
        reader = None if version == self.decode_version else self._schema(self.decode_version)
        try:
            value = fastavro.schemaless_reader(buffer, writer, reader)
        except Exception as exc:  # fastavro raises many unrelated types on bad input
            raise ValueError(f"not an Avro datum of version {version}: {exc}") from exc
        if buffer.tell() != len(payload):
            raise ValueError(
                f"{len(payload) - buffer.tell()} bytes left after the Avro datum of version "
                f"{version}"
            )
        return value

    def _json(self, payload: bytes, version: int) -> Any:
        try:
            value = json.loads(payload)
        except (UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"not a JSON document: {exc}") from exc
        error = jsonschema.exceptions.best_match(self._schema(version).iter_errors(value))
        if error is not None:
            where = "/".join(str(p) for p in error.absolute_path) or "(root)"
            raise ValueError(f"does not satisfy version {version} at {where}: {error.message}")
        return value


async def load_decoder(
    registry: SchemaRegistry, topic: str, *, version: int | None = None
) -> SchemaDecoder | None:
    """The decoder of ``topic``'s subject, or None when the topic has no subject.

    Reads the topic's schema configuration and every live version of its subject; the decode
    version is ``version`` (the latest when None). Raises :class:`SchemaNotFoundError` when
    ``version`` is not a live version of the subject.
    """
    try:
        config = await registry.get_topic_schema_config(topic)
    except SchemaNotFoundError:
        return None
    if config.subject is None:
        return None
    infos = await registry.list_versions(config.subject)
    if not infos:
        return None
    definitions = {
        info.version: (await registry.get_version(config.subject, info.version)).definition
        for info in infos
    }
    chosen = infos[-1].version if version is None else version
    if chosen not in definitions:
        raise SchemaNotFoundError(
            f"subject {config.subject!r} of {topic} has no version {chosen}; "
            f"live versions: {sorted(definitions)}"
        )
    schema_type = next(i.schema_type for i in infos if i.version == chosen)
    decoder = SchemaDecoder(
        topic, config.subject, infos[-1].schema_id, schema_type, definitions, chosen
    )
    log.info(
        "schema decoder topic=%s subject=%s schema_id=%s type=%s version=%s columns=%s",
        topic,
        config.subject,
        decoder.schema_id,
        schema_type.value,
        chosen,
        len(decoder.columns),
    )
    return decoder


def entries_to_batch(
    entries: Sequence[Entry], decoder: SchemaDecoder | None = None
) -> pa.RecordBatch:
    """One record batch of ``table_schema(decoder)`` holding ``entries``, in their order.

    Every entry becomes exactly one row; a payload that does not decode has nulls in the
    decoded columns and the reason in ``decode_error``.
    """
    schema = table_schema(decoder)
    n = len(entries)
    offsets = pa.array([e.offset for e in entries], pa.int64())
    ingest = pa.array([e.ingest_ms for e in entries], pa.int64())
    publish = pa.array([e.publish_ms for e in entries], pa.int64())
    schema_ids = [e.schema_id for e in entries]
    versions = [
        None if e.schema_id is None or not e.schema_version else e.schema_version for e in entries
    ]
    if decoder is None:
        subjects: list[str | None] = [None] * n
    else:
        subjects = [decoder.subject if s == decoder.schema_id else None for s in schema_ids]
    arrays: list[pa.Array] = [
        offsets,
        _millis_to_timestamp(ingest),
        _millis_to_timestamp(publish),
        pa.array([e.producer_name for e in entries], pa.string()),
        pa.array([e.routing_key for e in entries], pa.string()),
        _attributes(entries),
        pa.array(subjects, pa.string()),
        pa.array(schema_ids, pa.int64()),
        pa.array(versions, pa.int32()),
        pa.array([e.payload for e in entries], pa.binary()),
    ]
    errors: list[str | None] = [None] * n
    if decoder is not None and decoder.decodes:
        arrays += _decoded(entries, decoder, errors)
    arrays.append(pa.array(errors, pa.string()))
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _millis_to_timestamp(millis: pa.Array) -> pa.Array:
    # Cast int64 microseconds to a timestamp: a zero-copy reinterpretation.
    return pa.compute.multiply(millis, 1000).cast(_TIMESTAMP)


def _attributes(entries: Sequence[Entry]) -> pa.Array:
    """``map<string, string>`` of every entry's attributes (an empty map when it has none),
    built from flat key and value arrays rather than one dict per row."""
    offsets = [0]
    keys: list[str] = []
    values: list[str] = []
    total = 0
    for entry in entries:
        attrs = entry.attributes
        if attrs:
            keys.extend(attrs)
            values.extend(attrs.values())
            total += len(attrs)
        offsets.append(total)
    return pa.MapArray.from_arrays(
        pa.array(offsets, pa.int32()),
        pa.array(keys, pa.string()),
        pa.array(values, pa.string()),
        type=FIXED_SCHEMA.field("attributes").type,
    )


def _decoded(
    entries: Sequence[Entry], decoder: SchemaDecoder, errors: list[str | None]
) -> list[pa.Array]:
    """The decoded columns; rows whose payload does not decode get nulls and their error."""
    columns = decoder.columns
    width = len(columns)
    rows: list[list[Any] | None] = []
    converters = [(i, c.convert) for i, c in enumerate(columns) if c.convert is not None]
    for i, entry in enumerate(entries):
        try:
            values = decoder.decode(entry.payload, entry.schema_id, entry.schema_version)
            for index, convert in converters:
                value = values[index]
                if value is not None:
                    values[index] = convert(value)
        except (ValueError, TypeError, OverflowError, KeyError) as exc:
            errors[i] = _error_text(exc)
            rows.append(None)
            continue
        rows.append(values)
    while True:
        cells = [[None if row is None else row[c] for row in rows] for c in range(width)]
        try:
            return [
                pa.array(values, column.field.type)
                for values, column in zip(cells, columns, strict=True)
            ]
        except (pa.ArrowException, ValueError, TypeError, OverflowError):
            _reject_unconvertible(rows, cells, columns, errors)


def _reject_unconvertible(
    rows: list[list[Any] | None],
    cells: list[list[Any]],
    columns: list[Column],
    errors: list[str | None],
) -> None:
    """Find the rows whose values Arrow refuses for their column (out of range, wrong type);
    make them errors. Slow, and only run when a batch's column does not convert."""
    for values, column in zip(cells, columns, strict=True):
        for i, value in enumerate(values):
            if value is None or rows[i] is None:
                continue
            try:
                pa.array([value], column.field.type)
            except (pa.ArrowException, ValueError, TypeError, OverflowError) as exc:
                errors[i] = _error_text(
                    ValueError(f"field {column.source!r} does not fit {column.field.type}: {exc}")
                )
                rows[i] = None


def _error_text(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text if len(text) <= _MAX_ERROR else text[: _MAX_ERROR - 3] + "..."
