"""The Dagster UI and daemon of the local system (``danube-ingest dev``).

``dagster dev`` serves the UI and runs the schedules and sensors of the code location in
``workspace.yaml`` (``pipelines.definitions``). It runs in a child process of its own session,
so a Ctrl-C in the terminal reaches only ``danube-ingest dev``, which stops Dagster after the
broker and before etcd. Its output goes to ``{data_dir}/dagster/dagster.log``; its instance
(runs, schedule ticks) lives in ``{data_dir}/dagster`` (``DAGSTER_HOME``).

The code location finds the local system through its environment: etcd
(``DANUBE_INGEST_ETCD_ENDPOINTS``, ``DANUBE_INGEST_ETCD_PREFIX``) and the object store of the
broker's configuration (``DANUBE_INGEST_CONFIG``: the ``--config`` file, or else
``{data_dir}/dagster/broker.yaml`` written here with only ``broker.data_dir``;
``DANUBE_INGEST_DATA_DIR``: the data directory, which ``dev`` puts over the file's).

``start`` refuses a port another process listens on and returns once the process is launched
("dagster launched"); ``wait_ready`` logs "dagster started" only once the UI answers HTTP on its
port from a process that still runs, and raises ``DagsterUIError`` with the log's tail if the
process exits first.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import IO, Any

from danube_ingest.config import load_config
from danube_ingest.config.loader import CONFIG_ENV
from danube_ingest.errors import DanubeIngestError
from danube_ingest.metadata.server import log_tail, port_in_use

log = logging.getLogger(__name__)

#: The instance settings written when ``DAGSTER_HOME`` has none: no telemetry (the local system
#: must not reach out to the network) and no "join the community" dialog over the first page an
#: operator opens (it offers sign-ups on the network, and covers the asset graph).
_INSTANCE_YAML = "telemetry:\n  enabled: false\nnux:\n  enabled: false\n"


class DagsterUIError(DanubeIngestError):
    """The Dagster UI could not be started (port in use, process exited, never answered)."""


def _default_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


class DagsterUI:
    """``dagster dev`` for the local system: ``start()``, then ``stop()``."""

    def __init__(
        self,
        data_dir: Path,
        *,
        host: str,
        port: int,
        etcd_endpoint: str,
        etcd_prefix: str,
        config_path: Path | None = None,
    ) -> None:
        self.home = data_dir.resolve() / "dagster"
        self.data_dir = data_dir.resolve()
        self.config_path = (
            config_path.resolve() if config_path is not None else self.home / "broker.yaml"
        )
        self._write_config = config_path is None
        self.host = host
        self.port = port
        self.url = f"http://{host}:{port}"
        self._env = {
            "DAGSTER_HOME": str(self.home),
            "DANUBE_INGEST_ETCD_ENDPOINTS": etcd_endpoint,
            "DANUBE_INGEST_ETCD_PREFIX": etcd_prefix,
            "DANUBE_INGEST_CONFIG": str(self.config_path),
            "DANUBE_INGEST_DATA_DIR": str(self.data_dir),
        }
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def log_path(self) -> Path:
        return self.home / "dagster.log"

    def command(self) -> list[str]:
        """``dagster dev`` on ``workspace.yaml`` if the working directory has it, else on the
        installed ``pipelines.definitions`` module."""
        dagster = Path(sys.executable).with_name("dagster")
        target = (
            ["-w", "workspace.yaml"]
            if Path("workspace.yaml").is_file()
            else ["-m", "pipelines.definitions"]
        )
        return [str(dagster), "dev", *target, "-h", self.host, "-p", str(self.port)]

    def _prepare(self) -> None:
        self.home.mkdir(parents=True, exist_ok=True)
        instance = self.home / "dagster.yaml"
        if not instance.exists():
            instance.write_text(_INSTANCE_YAML)
        if self._write_config:
            # JSON string syntax is YAML: any path is quoted safely. No secrets: only the dir.
            self.config_path.write_text(f"broker:\n  data_dir: {json.dumps(str(self.data_dir))}\n")

    def exec(self) -> None:
        """Become ``dagster dev`` (``danube-ingest dagster``, an image's entry point): the same
        command and environment as ``start``, its output on ours. Does not return."""
        self._prepare()
        command = self.command()
        log.info("dagster exec url=%s home=%s", self.url, self.home)
        logging.shutdown()
        os.execve(command[0], command, {**os.environ, **self._env})

    def start(self) -> None:
        """Launch ``dagster dev`` (see ``wait_ready``). Raises ``DagsterUIError`` if the port
        is in use by another process, ``OSError`` if the command cannot be run."""
        if port_in_use(self._probe_host, self.port):
            raise DagsterUIError(
                f"the Dagster UI cannot start: port {self.host}:{self.port} is in use by another "
                "process (another `danube-ingest dev`?); stop it, or use --dagster-port N or "
                "--no-dagster"
            )
        self._prepare()
        self._log = self.log_path.open("ab")
        try:
            self._process = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **self._env},
                start_new_session=True,
                # Started from a background job, we inherit an ignored SIGINT; `dagster dev`
                # turns SIGTERM into SIGINT for itself, so it must not inherit that.
                preexec_fn=_default_signals,
            )
        except OSError:
            self._log.close()
            self._log = None
            raise
        log.info(
            "dagster launched pid=%s url=%s log=%s", self._process.pid, self.url, self.log_path
        )

    @property
    def _probe_host(self) -> str:
        return "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host

    def wait_ready(self, timeout: float = 300.0) -> None:
        """Block until the UI answers HTTP and its process still runs; then log "dagster
        started". Raises ``DagsterUIError`` (with the log's tail) if the process exits, is
        stopped, or does not answer within ``timeout`` seconds."""
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
        url = f"http://{self._probe_host}:{self.port}/server_info"
        deadline = time.monotonic() + timeout
        while True:
            process = self._process
            if process is None or process.poll() is not None:
                code = None if process is None else process.returncode
                raise DagsterUIError(
                    f"the Dagster UI did not start (exit code {code}); log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            try:
                with opener.open(url, timeout=1.0) as response:
                    response.read()
                answered = True
            except urllib.error.HTTPError:
                answered = True  # it answers; the status does not matter
            except OSError:
                answered = False
            if answered and process.poll() is None:
                log.info(
                    "dagster started pid=%s url=%s log=%s", process.pid, self.url, self.log_path
                )
                return
            if time.monotonic() >= deadline:
                raise DagsterUIError(
                    f"the Dagster UI does not answer on {self.url} after {timeout:.0f}s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the UI's log."""
        return log_tail(self.log_path, lines)

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (``dagster dev`` stops its webserver, daemon and code servers), then kill the
        whole process group after ``timeout`` seconds. Idempotent."""
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("dagster did not stop on SIGTERM pid=%s; killing it", process.pid)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # anything of it still there
            process.wait()
            log.info("dagster stopped pid=%s", process.pid)
        if self._log is not None:
            self._log.close()
            self._log = None


def register(commands: Any) -> None:
    dagster = commands.add_parser(
        "dagster",
        help="run the Dagster UI and daemon of the code location (schedules, sensors)",
        description=(
            "Run `dagster dev` on the code location (pipelines.definitions) against a running "
            "system: its etcd and object store are the broker configuration's. The instance "
            "(runs, ticks) lives in DATA_DIR/dagster. For a system started otherwise than by "
            "`danube-ingest dev`, e.g. the Dagster pod of `danube-ingest cluster kube`."
        ),
    )
    dagster.add_argument(
        "--config",
        type=Path,
        help="broker config file: its object store, etcd and data_dir (default: "
        "$DANUBE_INGEST_CONFIG, else the defaults)",
    )
    dagster.add_argument(
        "--etcd", help="etcd endpoint URL(s), comma separated (default: the config's)"
    )
    dagster.add_argument(
        "--data-dir",
        type=Path,
        help="the instance goes under DATA_DIR/dagster (default: the config's broker.data_dir)",
    )
    dagster.add_argument("--host", default="127.0.0.1", help="UI address (default 127.0.0.1)")
    dagster.add_argument("--port", type=int, default=3000, help="UI port (default 3000)")
    dagster.set_defaults(handler=_dagster)


def _dagster(args: argparse.Namespace) -> int:
    from_env = os.environ.get(CONFIG_ENV)
    config_path = args.config or (Path(from_env) if from_env else None)
    config = load_config(config_path)
    data_dir = args.data_dir or Path(config.broker.data_dir)
    ui = DagsterUI(
        data_dir,
        host=args.host,
        port=args.port,
        etcd_endpoint=args.etcd or ",".join(config.etcd.endpoints),
        etcd_prefix=config.etcd.prefix,
        config_path=config_path,
    )
    if port_in_use(ui._probe_host, ui.port):
        raise DagsterUIError(
            f"the Dagster UI cannot start: port {ui.host}:{ui.port} is in use by another process"
        )
    ui.exec()
    return 0  # (not reached)
