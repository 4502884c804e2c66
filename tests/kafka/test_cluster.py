"""``LocalKafkaCluster``: three KRaft nodes on loopback replicate; losing one loses nothing
acknowledged and producing goes on."""

from __future__ import annotations

import pytest
from confluent_kafka.admin import AdminClient, NewTopic

from danube_ingest.testing import LocalKafkaCluster
from tests.kafka.support import Acks, durable_producer, read_all

pytestmark = [pytest.mark.slow, pytest.mark.kafka]


def _leader(admin: AdminClient, topic: str) -> int:
    leader: int = admin.list_topics(topic, timeout=10).topics[topic].partitions[0].leader
    return leader


def test_killing_a_node_loses_no_acknowledged_record() -> None:
    with LocalKafkaCluster(3) as cluster:
        admin = AdminClient({"bootstrap.servers": cluster.bootstrap_servers, "log_level": 0})
        topic = NewTopic(
            "replicated",
            num_partitions=1,
            replication_factor=3,
            config={"min.insync.replicas": "2"},
        )
        admin.create_topics([topic])["replicated"].result(30)
        producer = durable_producer(cluster.bootstrap_servers, **{"message.timeout.ms": 60_000})
        acks = Acks()

        for i in range(200):
            producer.produce("replicated", b"before-%d" % i, on_delivery=acks)
        assert producer.flush(30) == 0
        assert len(acks.values) == 200 and acks.errors == []

        killed = _leader(admin, "replicated")  # the node the producer writes to
        cluster.kill(killed)
        assert not cluster.nodes[killed].running
        for i in range(200):
            producer.produce("replicated", b"after-%d" % i, on_delivery=acks)
            producer.poll(0)
        assert producer.flush(60) == 0
        assert acks.errors == []
        assert len(acks.values) == 400
        assert _leader(admin, "replicated") != killed

        expected = [b"before-%d" % i for i in range(200)] + [b"after-%d" % i for i in range(200)]
        assert acks.values == expected  # idempotent producer: in order, once each
        assert read_all(cluster.bootstrap_servers, "replicated", 400) == expected

        cluster.restart(killed)  # same ports and storage
        assert cluster.nodes[killed].running
        producer.produce("replicated", b"restarted", on_delivery=acks)
        assert producer.flush(30) == 0
        assert acks.errors == [] and acks.values[-1] == b"restarted"
