"""``danube-ingest cluster kube``: a small cluster's podman pods (``danube_ingest.cluster``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from danube_ingest.cluster import DEFAULT_IMAGE, ClusterSpec, broker_manifest, manifest


def register(commands: Any) -> None:
    cluster = commands.add_parser(
        "cluster", help="manifests of a local cluster in podman pods (podman kube play)"
    )
    actions = cluster.add_subparsers(dest="action", required=True, metavar="ACTION")
    kube = actions.add_parser(
        "kube",
        help="print the pods of etcd, Kafka, N brokers and the Dagster UI as Kubernetes YAML",
        description=(
            "Print a cluster for `podman kube play -`: etcd, a Kafka node holding the brokers' "
            "WAL, N brokers sharing one object store volume, the Dagster UI; every pod on the "
            "host's network, listening on 127.0.0.1. With --broker N, only broker N (its "
            "ConfigMap and pod), to add it to a running cluster. See docs/containers.md."
        ),
    )
    kube.add_argument("--image", default=DEFAULT_IMAGE, help=f"image (default {DEFAULT_IMAGE})")
    kube.add_argument(
        "--name", default="danube", help="prefix of the pods and volumes (default danube)"
    )
    kube.add_argument("--brokers", type=int, default=2, help="number of brokers (default 2)")
    kube.add_argument("--broker", type=int, help="print only broker N")
    kube.add_argument("--wal", choices=("kafka", "local"), default="kafka", help="WAL backend")
    kube.add_argument("--etcd-port", type=int, default=2379, help="etcd client port (2379)")
    kube.add_argument("--kafka-port", type=int, default=9092, help="Kafka client port (9092)")
    kube.add_argument(
        "--broker-port",
        type=int,
        default=6650,
        help="broker-1's port (6650); broker-N listens on it + N - 1, its metrics on that + 3000",
    )
    kube.add_argument("--dagster-port", type=int, default=3000, help="Dagster UI port (3000)")
    kube.set_defaults(handler=_kube)


def _kube(args: argparse.Namespace) -> int:
    try:
        spec = ClusterSpec(
            image=args.image,
            name=args.name,
            brokers=args.brokers,
            etcd_port=args.etcd_port,
            kafka_port=args.kafka_port,
            broker_port=args.broker_port,
            dagster_port=args.dagster_port,
            wal=args.wal,
        )
        text = manifest(spec) if args.broker is None else broker_manifest(spec, args.broker)
    except ValueError as exc:
        print(f"danube-ingest cluster kube: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(text)
    return 0
