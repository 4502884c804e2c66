"""``danube-ingest schemas register|list|show|check|attach``: the schema registry.

``register``, ``show``, ``check`` and ``attach`` go through the broker's
``danube_schema.SchemaRegistry`` gRPC service (``--service-url``, with the TLS and token
options of ``produce``), so the broker's permissions apply (registering and attaching are
``admin``). ``list`` reads the registry's records in etcd (``--etcd``), as ``topics`` does: the
service has no call that lists subjects.

Exit codes: 0 done (``check``: compatible); 1 the broker refused or could not be reached, the
subject or version does not exist, or (``check``) the definition is not compatible; 2 bad input
(an unreadable file, a definition that does not parse for its type, an unknown type, mode or
policy), refused before anything is sent.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from danube.proto import SchemaRegistry_pb2 as pb
from danube.proto import SchemaRegistry_pb2_grpc as pb_grpc

from danube_ingest.cli import danube_client
from danube_ingest.cli.admin import _table as table
from danube_ingest.cli.client import (
    BrokerUnreachableError,
    broker_options,
    check_reachable,
    topic_name,
)
from danube_ingest.cli.etcd_args import add_etcd_security, etcd_security
from danube_ingest.cli.helpfmt import DefaultsHelpFormatter
from danube_ingest.cli.tls_args import tls_options
from danube_ingest.cli.token import token_of
from danube_ingest.client import ClientError, call_metadata, open_channel
from danube_ingest.metadata.etcd import EtcdKV
from danube_ingest.metadata.keys import Keys
from danube_ingest.schema import (
    CompatibilityMode,
    InvalidSchemaError,
    SchemaNotFoundError,
    SchemaRegistry,
    SchemaType,
    ValidationPolicy,
)
from danube_ingest.schema.formats import parse_definition
from danube_ingest.schema.kvstore import KVSchemaStore

_TYPES = ("avro", "json_schema", "string", "number", "bytes")


class _BadInput(Exception):
    """Input refused before anything is sent (exit 2)."""


def register(commands: Any) -> None:
    schemas = commands.add_parser(
        "schemas",
        help="register, list, show and check schemas; attach a subject to a topic",
        description="The schema registry: subjects hold numbered versions of a definition "
        "(Avro, JSON Schema, string, number, bytes); a topic attached to a subject has its "
        "messages checked by its validation policy, and its Parquet tables get typed columns.",
        formatter_class=DefaultsHelpFormatter,
    )
    actions = schemas.add_subparsers(dest="action", required=True, metavar="ACTION")

    reg = actions.add_parser(
        "register",
        help="add a definition as the next version of a subject (creating it)",
        description="Register the definition in --file as the next version of SUBJECT. "
        "Registering a definition the subject already has returns that version. A new "
        "version must satisfy the subject's compatibility mode (default: backward); see "
        "'schemas check'.",
        formatter_class=DefaultsHelpFormatter,
    )
    reg.add_argument("subject", help="subject name, e.g. clicks-value")
    reg.add_argument("--type", required=True, choices=_TYPES, help="what the definition is")
    _file_option(reg, required=True)
    reg.add_argument("--description", default="", help="stored with the version")
    broker_options(reg)
    reg.set_defaults(handler=_run(_register))

    lst = actions.add_parser(
        "list",
        help="every subject with its latest version, type, id and compatibility mode (etcd)",
        formatter_class=DefaultsHelpFormatter,
    )
    lst.add_argument("--etcd", default="http://127.0.0.1:2379", help="etcd endpoint URL(s)")
    lst.add_argument("--prefix", default="/danube", help="metadata key prefix")
    add_etcd_security(lst)
    lst.set_defaults(handler=_list)

    show = actions.add_parser(
        "show",
        help="a subject's version (default: the latest) with its definition, and its versions",
        formatter_class=DefaultsHelpFormatter,
    )
    show.add_argument("subject", help="subject name")
    show.add_argument("--version", type=_positive, help="this version instead of the latest")
    broker_options(show)
    show.set_defaults(handler=_run(_show))

    check = actions.add_parser(
        "check",
        help="whether a definition could be registered as the subject's next version",
        description="Check the definition in --file against SUBJECT's versions under its "
        "compatibility mode (or --mode). Exit 0: compatible; 1: not (each violated rule is "
        "printed); nothing is registered either way.",
        formatter_class=DefaultsHelpFormatter,
    )
    check.add_argument("subject", help="subject name")
    _file_option(check, required=True)
    check.add_argument(
        "--type", choices=_TYPES, help="the definition's type (default: the subject's)"
    )
    check.add_argument(
        "--mode",
        choices=[m.value.lower() for m in CompatibilityMode],
        help="check under this mode instead of the subject's",
    )
    broker_options(check)
    check.set_defaults(handler=_run(_check))

    attach = actions.add_parser(
        "attach",
        help="attach a subject to a topic with a validation policy (replaces any earlier one)",
        description="Bind TOPIC to SUBJECT. Policy 'none' checks nothing; 'warn' logs "
        "messages that carry no schema id of the subject (or, with --payload-validation, do "
        "not decode) and stores them; 'enforce' refuses them (INVALID_ARGUMENT). The topic "
        "need not exist yet; each partition of a partitioned topic is attached.",
        formatter_class=DefaultsHelpFormatter,
    )
    attach.add_argument("topic", type=topic_name, help="topic name, /namespace/topic")
    attach.add_argument("subject", help="subject name (must be registered)")
    attach.add_argument(
        "--policy",
        choices=[p.value for p in ValidationPolicy],
        default="warn",
        help="what happens to messages that fail the check",
    )
    attach.add_argument(
        "--payload-validation",
        action="store_true",
        help="also decode every payload against the version its message names",
    )
    broker_options(attach)
    attach.set_defaults(handler=_run(_attach))


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"version {text!r}: expected a whole number >= 1")
    return int(text)


def _file_option(parser: argparse.ArgumentParser, *, required: bool) -> None:
    parser.add_argument(
        "--file", type=Path, required=required, help="the definition (an .avsc or .json file)"
    )


Call = Callable[[argparse.Namespace, Any, Any], Coroutine[Any, Any, int]]


def _run(call: Call) -> Callable[[argparse.Namespace], int]:
    """A handler that opens a channel to ``--service-url`` and runs ``call(args, stub,
    metadata)``, mapping failures to a message on stderr and an exit code."""

    async def session(args: argparse.Namespace) -> int:
        tls = tls_options(args)
        await check_reachable(args.service_url, args.connect_timeout, tls)
        async with open_channel(args.service_url, tls) as channel:
            stub = pb_grpc.SchemaRegistryStub(channel)
            return await call(args, stub, call_metadata(token_of(args)))

    def handler(args: argparse.Namespace) -> int:
        try:
            _read_file(args)
            return asyncio.run(session(args))
        except _BadInput as exc:
            print(f"danube-ingest: error: {exc}", file=sys.stderr)
            return 2
        except grpc.aio.AioRpcError as exc:
            print(f"danube-ingest: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 2 if exc.code() == grpc.StatusCode.INVALID_ARGUMENT else 1
        except (BrokerUnreachableError, ClientError) as exc:
            print(f"danube-ingest: error: {exc}", file=sys.stderr)
            return 1

    return handler


def _read_file(args: argparse.Namespace) -> None:
    """Read ``--file`` (if the command has one) into ``args.data`` before connecting, checked
    to parse as ``--type`` when given: bad input is refused before anything is sent."""
    path: Path | None = getattr(args, "file", None)
    if path is None:
        return
    try:
        args.data = path.read_bytes()
    except OSError as exc:
        raise _BadInput(f"--file {path}: cannot read it: {exc.strerror}") from None
    if args.type is not None:
        _definition(path, args.data, args.type)


def _definition(path: Path, data: bytes, schema_type: str) -> bytes:
    """``data`` (read from ``path``), checked to parse as ``schema_type`` (``_BadInput``
    naming the file otherwise)."""
    try:
        parse_definition(SchemaType.parse(schema_type), data)
    except InvalidSchemaError as exc:
        raise _BadInput(f"--file {path}: not a valid {schema_type} definition: {exc}") from None
    return data


async def _register(args: argparse.Namespace, stub: Any, metadata: Any) -> int:
    data = args.data
    answer = await stub.RegisterSchema(
        pb.RegisterSchemaRequest(
            subject=args.subject,
            schema_type=args.type,
            schema_definition=data,
            description=args.description,
            created_by="danube-ingest schemas register",
        ),
        metadata=metadata,
    )
    what = "registered as" if answer.is_new_version else "already registered as"
    print(
        f"subject {args.subject}: {what} version {answer.version} "
        f"(schema id {answer.schema_id}, {answer.fingerprint})"
    )
    return 0


async def _show(args: argparse.Namespace, stub: Any, metadata: Any) -> int:
    latest = await stub.GetLatestSchema(
        pb.GetLatestSchemaRequest(subject=args.subject), metadata=metadata
    )
    schema = latest
    if args.version is not None and args.version != latest.version:
        schema = await stub.GetSchema(
            pb.GetSchemaRequest(schema_id=latest.schema_id, version=args.version),
            metadata=metadata,
        )
    versions = await stub.ListVersions(
        pb.ListVersionsRequest(subject=args.subject), metadata=metadata
    )
    print(f"subject: {schema.subject}")
    print(f"schema id: {schema.schema_id}")
    print(f"version: {schema.version} (of {', '.join(str(v.version) for v in versions.versions)})")
    print(f"type: {schema.schema_type}")
    print(f"compatibility: {schema.compatibility_mode.lower()}")
    print(f"fingerprint: {schema.fingerprint}")
    print(f"created: {_time(schema.created_at)} by {schema.created_by or '-'}")
    if schema.description:
        print(f"description: {schema.description}")
    print("definition:")
    sys.stdout.write(schema.schema_definition.decode("utf-8", "replace").rstrip("\n") + "\n")
    return 0


async def _check(args: argparse.Namespace, stub: Any, metadata: Any) -> int:
    schema_type = args.type
    if schema_type is None:
        latest = await stub.GetLatestSchema(
            pb.GetLatestSchemaRequest(subject=args.subject), metadata=metadata
        )
        schema_type = latest.schema_type
    data = _definition(args.file, args.data, schema_type)
    request = pb.CheckCompatibilityRequest(
        subject=args.subject, new_schema_definition=data, schema_type=schema_type
    )
    if args.mode is not None:
        request.compatibility_mode = args.mode.upper()
    answer = await stub.CheckCompatibility(request, metadata=metadata)
    if answer.is_compatible:
        print(f"{args.file}: compatible with subject {args.subject}")
        return 0
    print(f"{args.file}: NOT compatible with subject {args.subject}:")
    for error in answer.errors:
        print(f"  {error}")
    return 1


async def _attach(args: argparse.Namespace, stub: Any, metadata: Any) -> int:
    # Each partition of a partitioned topic is a topic of its own, with its own binding.
    topics = await danube_client.partitions(
        args.service_url, args.topic, tls_options(args), token_of(args)
    )
    for topic in topics:
        answer = await stub.ConfigureTopicSchema(
            pb.ConfigureTopicSchemaRequest(
                topic_name=topic,
                schema_subject=args.subject,
                validation_policy=args.policy,
                enable_payload_validation=args.payload_validation,
            ),
            metadata=metadata,
        )
        print(answer.message)
    return 0


def _list(args: argparse.Namespace) -> int:
    async def run() -> None:
        kv = await EtcdKV.connect(args.etcd.split(","), timeout=5.0, security=etcd_security(args))
        try:
            registry = SchemaRegistry(KVSchemaStore(kv, Keys(args.prefix)))
            rows: list[tuple[str, ...]] = []
            for subject in await registry.list_subjects():
                try:
                    latest = await registry.get_latest(subject)
                except SchemaNotFoundError:
                    rows.append((subject, "-", "-", "-", "-"))
                    continue
                rows.append(
                    (
                        subject,
                        str(latest.version),
                        latest.schema_type.value,
                        str(latest.schema_id),
                        latest.compatibility_mode.value.lower(),
                    )
                )
        finally:
            await kv.close()
        table(("subject", "latest", "type", "schema id", "compatibility"), rows)

    asyncio.run(run())
    return 0


def _time(seconds: int) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat(timespec="seconds")
