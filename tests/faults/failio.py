"""The ``failio`` LD_PRELOAD shim (``failio.c`` beside this file): writes or syncs of the files
under a path prefix fail with a chosen errno while a trigger file exists.

``build_failio(directory)`` compiles it with gcc (``make`` installs gcc on Debian, as the other
fault tools); ``FailIO`` holds one configuration: ``env`` is what a child process needs in its
environment (``LD_PRELOAD`` and the ``FAILIO_*`` variables), ``on()``/``off()`` create and
remove the trigger. The shim looks at the trigger at most every 2 ms, so allow a few
milliseconds after either before relying on it.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

SOURCE = Path(__file__).with_name("failio.c")

#: Call kinds the shim can fail: "write" (write, writev, pwrite[v][64]) and "sync" (fsync,
#: fdatasync).
WRITE = "write"
SYNC = "sync"


def build_failio(directory: Path) -> Path:
    """Compile the shim into ``directory``; its path. Fails naming what is missing."""
    gcc = shutil.which("gcc")
    assert gcc is not None, "gcc is needed to build the failio shim: apt-get install gcc"
    directory.mkdir(parents=True, exist_ok=True)
    library = directory / "failio.so"
    command = [gcc, "-shared", "-fPIC", "-O2", "-Wall", "-Werror", "-o", str(library)]
    subprocess.run(
        [*command, str(SOURCE), "-ldl"],
        check=True,
        capture_output=True,
    )
    return library


@dataclass(frozen=True)
class FailIO:
    """Fail ``ops`` (``WRITE``, ``SYNC`` or both) on files under ``prefix`` with ``errno``
    while ``trigger`` exists."""

    library: Path
    prefix: Path
    trigger: Path
    errno: int
    ops: tuple[str, ...]

    @property
    def env(self) -> dict[str, str]:
        return {
            "LD_PRELOAD": str(self.library),
            "FAILIO_PREFIX": str(self.prefix),
            "FAILIO_TRIGGER": str(self.trigger),
            "FAILIO_ERRNO": str(self.errno),
            "FAILIO_OPS": ",".join(self.ops),
        }

    def on(self) -> None:
        self.trigger.touch()

    def off(self) -> None:
        self.trigger.unlink(missing_ok=True)
