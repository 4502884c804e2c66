"""``analytics.spark_session`` on a real local Spark: the driver binds to and advertises
127.0.0.1 unless the user chose an address, and Python workers run this interpreter."""

from __future__ import annotations

import os
import sys

import pytest

from danube_ingest.analytics.session import LOOPBACK, driver_settings, spark_session

pytestmark = [pytest.mark.spark, pytest.mark.slow, pytest.mark.timeout(300)]

QUIET = {"spark.ui.enabled": "false"}


def _driver(config: dict[str, str]) -> tuple[str | None, str | None, str]:
    """(driver host, bind address, worker interpreter) of a new local[1] session; stopped."""
    from pyspark import SparkContext

    assert SparkContext._active_spark_context is None, "another test left a SparkContext"
    spark = spark_session("danube-session-test", master="local[1]", config=config)
    try:
        conf = spark.sparkContext.getConf()
        return (
            conf.get("spark.driver.host"),
            conf.get("spark.driver.bindAddress"),
            spark.sparkContext.pythonExec,
        )
    finally:
        spark.stop()


def test_local_driver_on_loopback_and_explicit_address_kept(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SPARK_LOCAL_IP", raising=False)
    monkeypatch.delenv("PYSPARK_PYTHON", raising=False)
    host, bind, python = _driver(QUIET)
    assert (host, bind) == (LOOPBACK, LOOPBACK)
    assert python == sys.executable
    assert os.environ["PYSPARK_PYTHON"] == sys.executable

    # The user's own choice is kept, and the other key is not forced to loopback beside it.
    host, bind, _ = _driver({**QUIET, "spark.driver.host": "localhost"})
    assert (host, bind) == ("localhost", None)


def test_driver_settings_only_in_local_mode_without_spark_local_ip(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SPARK_LOCAL_IP", raising=False)
    both = {"spark.driver.bindAddress": LOOPBACK, "spark.driver.host": LOOPBACK}
    assert driver_settings({"spark.master": "local[2]"}) == both
    assert driver_settings({"spark.master": "local"}) == both
    assert driver_settings({"spark.master": "spark://cluster.example:7077"}) == {}
    assert driver_settings({"spark.master": "local", "spark.driver.bindAddress": "0.0.0.0"}) == {}
    monkeypatch.setenv("SPARK_LOCAL_IP", "192.0.2.7")
    assert driver_settings({"spark.master": "local[2]"}) == {}
