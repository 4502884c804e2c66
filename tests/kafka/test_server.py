"""``KafkaServer``'s storage formatting and its refusals, without starting a node."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from danube_ingest.kafka import KafkaServer, KafkaServerError, new_cluster_id


def test_a_new_cluster_id_has_kafkas_form() -> None:
    cluster_id = new_cluster_id()
    assert len(cluster_id) == 22
    assert set(cluster_id) <= set(
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    )
    assert new_cluster_id() != cluster_id


def test_a_new_cluster_id_never_starts_with_a_dash(monkeypatch: pytest.MonkeyPatch) -> None:
    """A dash first (one id in 64) would read as an option on Kafka's command line: the
    first UUID drawn here encodes to "-wAA...", so the next one is taken."""
    drawn = iter([uuid.UUID(bytes=b"\xfb" + bytes(15)), uuid.UUID(bytes=bytes(16))])
    monkeypatch.setattr(uuid, "uuid4", lambda: next(drawn))
    assert new_cluster_id() == "A" * 22


def test_storage_is_formatted_for_a_given_id_starting_with_a_dash(tmp_path: Path) -> None:
    """An id from elsewhere may start with "-": the format command still takes it as the id."""
    server = KafkaServer(tmp_path, 29092)
    assert server.format_storage("-" + "A" * 21) == "-" + "A" * 21
    assert server.cluster_id() == "-" + "A" * 21


def test_storage_of_another_cluster_is_refused_and_kept(tmp_path: Path) -> None:
    server = KafkaServer(tmp_path, 29092)
    server.storage_dir.mkdir(parents=True)
    meta = server.storage_dir / "meta.properties"
    meta.write_text("version=1\nnode.id=1\ncluster.id=AAAAAAAAAAAAAAAAAAAAAA\n")

    with pytest.raises(KafkaServerError, match="belongs to cluster AAAAAAAAAAAAAAAAAAAAAA"):
        server.format_storage("BBBBBBBBBBBBBBBBBBBBBB")
    assert server.format_storage() == "AAAAAAAAAAAAAAAAAAAAAA"  # formatted already: kept
    assert meta.read_text().endswith("cluster.id=AAAAAAAAAAAAAAAAAAAAAA\n")


def test_listeners_are_on_loopback_and_the_quorum_is_the_node_alone(tmp_path: Path) -> None:
    properties = KafkaServer(tmp_path, 29092).server_properties()
    assert properties["listeners"] == ("PLAINTEXT://127.0.0.1:29092,CONTROLLER://127.0.0.1:29093")
    assert properties["controller.quorum.voters"] == "1@127.0.0.1:29093"
    assert properties["process.roles"] == "broker,controller"
    assert properties["offsets.topic.replication.factor"] == "1"
