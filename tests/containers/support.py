"""The danube-ingest image for the tests: ``make image``'s script (cached by its inputs, so a
second build of the same tree reuses it).

A run that collects container tests starts the builds in the background as soon as collection
ends (``tests/conftest.py``), so they overlap the tests before them (the build is mostly
downloads, disk and pip): first the image, then the same tree rebuilt from the base for the
reproducibility check, then the PostgreSQL and moto images of the fixtures' container mode.
``background_builds`` waits for all and gives the two tags.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from danube_ingest.containers import (
    POSTGRES_PACKAGES,
    SERVICES_ENV,
    PodmanService,
    debian_image,
    imported_image,
    moto_image,
)

ROOT = Path(__file__).resolve().parents[2]


def pytest_with_services_in_containers(*args: str, timeout: float) -> str:
    """A child pytest of ``args`` with ``DANUBE_INGEST_SERVICES=containers`` (the suite's
    fixtures start their services in containers); its output, once it passed with no test
    failed."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env={**os.environ, SERVICES_ENV: "containers"},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "failed" not in run.stdout, run.stdout[-2000:]
    return run.stdout


def build(**env: str) -> str:
    """``tools/image/build.sh`` with ``env`` over ours; its tag."""
    run = subprocess.run(
        ["bash", "tools/image/build.sh"],
        cwd=ROOT,
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=840,
        check=False,
    )
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    return run.stdout.strip().splitlines()[-1]


def debian_base(service: PodmanService) -> str:
    """``make image``'s Debian base (bookworm; python3 and venv among its packages) imported
    from ``.deps/image`` (the newest when there are several), built first when this tree has
    none."""
    tars = sorted((ROOT / ".deps" / "image").glob("base-*.tar"), key=lambda t: t.stat().st_mtime)
    if not tars:
        build()
        return debian_base(service)
    return imported_image(service, tars[-1], "base")


def fixture_moto_image(service: PodmanService) -> str:
    """The moto image of the ``s3_server`` fixture's container mode, on :func:`debian_base`."""
    return moto_image(service, debian_base(service))


def fixture_postgres_image(service: PodmanService) -> str:
    """The PostgreSQL image of the ``postgres_server`` fixture's container mode: PostgreSQL
    installed on :func:`debian_base`."""
    return debian_image(service, "postgres", POSTGRES_PACKAGES, base=debian_base(service))


class _Builds:
    """The image, then a rebuild from scratch (``DANUBE_INGEST_IMAGE_REBUILD=1``), in a
    thread; one after the other, since both use ``.deps/image``."""

    def __init__(self) -> None:
        self.tags: list[str] = []
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="image-builds", daemon=True)

    def _run(self) -> None:
        try:
            self.tags.append(build())
            # (KEEP=2: a rebuild with another digest must not remove the first image.)
            self.tags.append(build(DANUBE_INGEST_IMAGE_REBUILD="1", DANUBE_INGEST_IMAGE_KEEP="2"))
            # The services' images too (each once per content), for the fixture tests.
            with PodmanService() as service:
                fixture_postgres_image(service)
                fixture_moto_image(service)
        except BaseException as exc:  # (re-raised in the test that waits)
            self.error = exc

    def start(self) -> None:
        self._thread.start()

    def wait(self) -> tuple[str, str]:
        self._thread.join(timeout=1800)
        assert not self._thread.is_alive(), "the image builds did not end in 30 min"
        if self.error is not None:
            raise self.error
        built, rebuilt = self.tags
        return built, rebuilt


_builds: _Builds | None = None


def start_background_builds() -> None:
    """Start the builds (once per process)."""
    global _builds
    if _builds is None:
        _builds = _Builds()
        _builds.start()


def background_builds() -> tuple[str, str]:
    """(the image's tag, the tag of the same tree rebuilt from the base), once both are
    built; starts them if collection did not."""
    start_background_builds()
    assert _builds is not None
    return _builds.wait()
