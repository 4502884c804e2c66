"""Compatibility rules between versions of a subject.

A *reader* schema can read data written with a *writer* schema when every datum valid under the
writer is accepted by the reader. BACKWARD checks reader = new, writer = each older version;
FORWARD checks reader = older, writer = new; FULL checks both.

Avro — the schema resolution rules of the Avro specification, evaluated on the parsed schemas:

* primitives must be equal or promotable (int → long, float, double; long → float, double;
  float → double; string ↔ bytes); logical types resolve as their underlying type;
* records, enums and fixed types must have the same unqualified name (or the reader lists the
  writer's name among its aliases); fixed sizes must be equal;
* every reader field must exist in the writer (by name or alias) with a resolvable type, or
  have a default; writer fields the reader lacks are skipped;
* writer enum symbols unknown to the reader need a reader enum default;
* arrays and maps resolve their items and values; every branch of a writer union must resolve
  against the reader; a non-union writer must match some branch of a reader union.

So adding a field without a default breaks BACKWARD, removing a field without a default breaks
FORWARD, and ``int`` → ``long`` is BACKWARD but not FORWARD compatible.

JSON Schema — a conservative subset, applied recursively to object properties and array items:

* a property the reader requires must be required by the writer (adding a required property
  breaks BACKWARD, removing or relaxing one breaks FORWARD);
* where both declare ``type``, every writer type must be accepted by the reader
  (``integer`` is accepted by ``number``);
* where both declare ``enum``, the writer's values must all be in the reader's;
* a reader with ``additionalProperties: false`` rejects writer properties it does not declare,
  and a writer that leaves additional properties open;
* sub-schemas using ``$ref``, ``allOf``, ``anyOf``, ``oneOf``, ``not`` or ``if`` are not
  analysed (treated as compatible); a schema that omits ``type`` constrains nothing.

Other types (bytes, string, number) are compatible with themselves. Changing a subject's schema
type is incompatible in every mode but NONE.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from danube_ingest.schema.formats import AVRO_PRIMITIVES, ParsedSchema, avro_deref, avro_schema
from danube_ingest.schema.model import CompatibilityMode, SchemaType

# (writer type, reader type) pairs the Avro specification allows besides equality.
_AVRO_PROMOTIONS = frozenset(
    {
        ("int", "long"),
        ("int", "float"),
        ("int", "double"),
        ("long", "float"),
        ("long", "double"),
        ("float", "double"),
        ("string", "bytes"),
        ("bytes", "string"),
    }
)
_JSON_UNANALYSED = ("$ref", "allOf", "anyOf", "oneOf", "not", "if")


def compatibility_errors(
    new: ParsedSchema,
    existing: Sequence[tuple[int, ParsedSchema]],
    mode: CompatibilityMode,
) -> list[str]:
    """Why ``new`` breaks ``mode`` against the ``(version, schema)`` pairs in ``existing``.

    The caller passes the latest version, or every live version for a transitive mode.
    Empty when compatible.
    """
    if mode is CompatibilityMode.NONE:
        return []
    errors: list[str] = []
    for version, old in existing:
        if old.schema_type is not new.schema_type:
            errors.append(
                f"version {version}: schema type changes from {old.schema_type.value} "
                f"to {new.schema_type.value}"
            )
            continue
        if mode.backward:
            errors.extend(
                f"backward (new schema reading version {version} data): {e}"
                for e in _reader_errors(new, old, reader_label="new", writer_label="old")
            )
        if mode.forward:
            errors.extend(
                f"forward (version {version} reading new data): {e}"
                for e in _reader_errors(old, new, reader_label="old", writer_label="new")
            )
    return errors


def _reader_errors(
    reader: ParsedSchema, writer: ParsedSchema, *, reader_label: str, writer_label: str
) -> list[str]:
    if reader.schema_type is SchemaType.AVRO:
        return _AvroResolution(reader.document, writer.document).errors()
    if reader.schema_type is SchemaType.JSON_SCHEMA:
        errors: list[str] = []
        _json_reads(reader.document, writer.document, "", errors, reader_label, writer_label)
        return errors
    return []


def _where(path: str) -> str:
    return f"field '{path}'" if path else "top level"


class _AvroResolution:
    """Checks that ``reader`` can resolve every datum written with ``writer``."""

    def __init__(self, reader: Any, writer: Any) -> None:
        self._reader_named: dict[str, Any] = {}
        self._writer_named: dict[str, Any] = {}
        self._reader = avro_schema(reader, self._reader_named)
        self._writer = avro_schema(writer, self._writer_named)
        # Named-type pairs already being checked: recursive types terminate here.
        self._visiting: set[tuple[str, str]] = set()
        self._errors: list[str] = []

    def errors(self) -> list[str]:
        self._match(self._reader, self._writer, "", self._errors)
        return self._errors

    def _match(self, reader: Any, writer: Any, path: str, errors: list[str]) -> None:
        r = avro_deref(reader, self._reader_named)
        w = avro_deref(writer, self._writer_named)
        if isinstance(w, list):
            for branch in w:
                self._match(r, branch, path, errors)
            return
        if isinstance(r, list):
            if not any(self._matches(branch, w, path) for branch in r):
                branches = [_avro_describe(avro_deref(b, self._reader_named)) for b in r]
                errors.append(
                    f"{_where(path)}: writer type {_avro_describe(w)} matches no branch of "
                    f"reader union {branches}"
                )
            return
        rkind, wkind = _avro_kind(r), _avro_kind(w)
        if rkind in AVRO_PRIMITIVES or wkind in AVRO_PRIMITIVES:
            if rkind != wkind and (wkind, rkind) not in _AVRO_PROMOTIONS:
                errors.append(f"{_where(path)}: writer type {wkind} cannot be read as {rkind}")
            return
        if rkind != wkind:
            errors.append(f"{_where(path)}: writer type {wkind} cannot be read as {rkind}")
            return
        if rkind == "array":
            self._match(r["items"], w["items"], f"{path}[]", errors)
        elif rkind == "map":
            self._match(r["values"], w["values"], f"{path}{{}}", errors)
        elif not _avro_same_name(r, w):
            errors.append(
                f"{_where(path)}: writer {wkind} {w['name']} cannot be read as {r['name']}"
            )
        elif rkind == "fixed":
            if r["size"] != w["size"]:
                errors.append(
                    f"{_where(path)}: fixed {r['name']} changes size from {w['size']} "
                    f"(writer) to {r['size']} (reader)"
                )
        elif rkind == "enum":
            unknown = [s for s in w["symbols"] if s not in r["symbols"]]
            if unknown and "default" not in r:
                errors.append(
                    f"{_where(path)}: enum {r['name']} of the reader lacks symbols {unknown} "
                    f"and has no default"
                )
        else:
            self._match_record(r, w, path, errors)

    def _matches(self, reader: Any, writer: Any, path: str) -> bool:
        probe: list[str] = []
        self._match(reader, writer, path, probe)
        return not probe

    def _match_record(self, r: Any, w: Any, path: str, errors: list[str]) -> None:
        key = (r["name"], w["name"])
        if key in self._visiting:
            return
        self._visiting.add(key)
        try:
            writer_fields = {f["name"]: f for f in w["fields"]}
            for field in r["fields"]:
                field_path = f"{path}.{field['name']}" if path else field["name"]
                names = [field["name"], *field.get("aliases", [])]
                found = next((writer_fields[n] for n in names if n in writer_fields), None)
                if found is not None:
                    self._match(field["type"], found["type"], field_path, errors)
                elif "default" not in field:
                    errors.append(
                        f"{_where(field_path)}: missing from the writer's schema and the "
                        f"reader gives it no default"
                    )
        finally:
            self._visiting.discard(key)


def _avro_kind(schema: Any) -> str:
    if isinstance(schema, str):
        return schema
    kind: str = schema["type"]
    return "record" if kind == "error" else kind


def _avro_describe(schema: Any) -> str:
    if isinstance(schema, dict) and "name" in schema:
        return str(schema["name"])
    return _avro_kind(schema) if not isinstance(schema, list) else "union"


def _avro_same_name(reader: Any, writer: Any) -> bool:
    def short(name: str) -> str:
        return name.rsplit(".", 1)[-1]

    wanted = short(writer["name"])
    return short(reader["name"]) == wanted or any(
        short(alias) == wanted for alias in reader.get("aliases", [])
    )


def _json_types(schema: dict[str, Any]) -> set[str] | None:
    declared = schema.get("type")
    if isinstance(declared, str):
        return {declared}
    if isinstance(declared, list):
        return {t for t in declared if isinstance(t, str)}
    return None


def _json_accepts(reader_types: set[str], writer_type: str) -> bool:
    return writer_type in reader_types or (writer_type == "integer" and "number" in reader_types)


def _json_reads(
    reader: Any,
    writer: Any,
    path: str,
    errors: list[str],
    reader_label: str,
    writer_label: str,
) -> None:
    """Append to ``errors`` why some document valid under ``writer`` may fail ``reader``."""
    if reader is True or writer is False:
        return
    if reader is False:
        errors.append(f"{_where(path)}: the {reader_label} schema rejects every value")
        return
    if not isinstance(reader, dict) or not isinstance(writer, dict):
        return
    if any(k in reader or k in writer for k in _JSON_UNANALYSED):
        return
    rtypes, wtypes = _json_types(reader), _json_types(writer)
    if rtypes is not None and wtypes is not None:
        lost = sorted(t for t in wtypes if not _json_accepts(rtypes, t))
        if lost:
            errors.append(
                f"{_where(path)}: type {'/'.join(sorted(wtypes))} ({writer_label}) is not "
                f"accepted by type {'/'.join(sorted(rtypes))} ({reader_label})"
            )
            return
    if isinstance(reader.get("enum"), list) and isinstance(writer.get("enum"), list):
        extra = [v for v in writer["enum"] if v not in reader["enum"]]
        if extra:
            errors.append(
                f"{_where(path)}: enum values {extra} of the {writer_label} schema are not "
                f"allowed by the {reader_label} schema"
            )
    if (rtypes is None or "object" in rtypes) and (wtypes is None or "object" in wtypes):
        _json_object_reads(reader, writer, path, errors, reader_label, writer_label)
    if (
        (rtypes is None or "array" in rtypes)
        and (wtypes is None or "array" in wtypes)
        and isinstance(reader.get("items"), dict | bool)
        and isinstance(writer.get("items"), dict | bool)
    ):
        _json_reads(
            reader["items"], writer["items"], f"{path}[]", errors, reader_label, writer_label
        )


def _json_object_reads(
    reader: dict[str, Any],
    writer: dict[str, Any],
    path: str,
    errors: list[str],
    reader_label: str,
    writer_label: str,
) -> None:
    def child(name: str) -> str:
        return f"{path}.{name}" if path else name

    rprops: dict[str, Any] = reader.get("properties") or {}
    wprops: dict[str, Any] = writer.get("properties") or {}
    rrequired = set(reader.get("required") or [])
    wrequired = set(writer.get("required") or [])
    for name in sorted(rrequired - wrequired):
        state = "optional" if name in wprops else "absent"
        errors.append(
            f"{_where(child(name))}: required by the {reader_label} schema but {state} in the "
            f"{writer_label} schema"
        )
    radditional = reader.get("additionalProperties", True)
    for name, wprop in wprops.items():
        if name in rprops:
            _json_reads(rprops[name], wprop, child(name), errors, reader_label, writer_label)
        elif radditional is False:
            errors.append(
                f"{_where(child(name))}: allowed by the {writer_label} schema but not by the "
                f"{reader_label} schema (additionalProperties is false)"
            )
        else:
            _json_reads(radditional, wprop, child(name), errors, reader_label, writer_label)
    if radditional is False and writer.get("additionalProperties", True) is not False:
        errors.append(
            f"{_where(path)}: the {reader_label} schema forbids properties the "
            f"{writer_label} schema leaves open (additionalProperties)"
        )
