"""Tests for danube_ingest.config: defaults, the example file, interpolation, errors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel

from danube_ingest.config import (
    BrokerConfig,
    load_config,
    parse_config,
    parse_duration,
    parse_size,
)
from danube_ingest.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[1] / "config" / "danube_broker.yml"
MiB = 1024 * 1024


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "broker.yml"
    path.write_text(text, encoding="utf-8")
    return path


def config_error(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return str(info.value)


# ------------------------------------------------------------------------------ defaults


def test_defaults() -> None:
    config = load_config()
    assert config == parse_config({}) == BrokerConfig()
    assert config.broker.broker_id == "broker-1"
    assert config.broker.listen == "127.0.0.1:6650"
    assert config.broker.advertised_url is None
    assert config.broker.data_dir == Path("data")
    wal = config.storage.wal
    assert config.storage.mode == "wal_cloud"
    assert (wal.fsync, wal.fsync_interval_ms, wal.linger_us) == ("always", 0, 1000)
    assert (wal.max_batch_bytes, wal.segment_bytes) == (4 * MiB, 8 * MiB)
    assert (wal.segment_seconds, wal.index_interval_bytes, wal.regions) == (10.0, 65536, 1)
    assert wal.snapshot_on_seal is True
    assert wal.retention.max_bytes == 1024 * MiB
    assert wal.retention.max_minutes is None
    assert config.storage.cache.max_bytes == 256 * MiB
    assert config.storage.cloud.backend == "fs"
    assert config.storage.cloud.compression == "zstd"
    assert config.limits.max_payload_bytes == 4_000_000
    assert config.etcd.endpoints == ["http://127.0.0.1:2379"]
    assert config.etcd.prefix == "/danube"
    assert config.wal_dir() == Path("data/wal")
    assert config.objects_root() == str(Path("data/objects"))


def test_every_field_has_a_description_and_a_default() -> None:
    def check(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            assert field.description, f"{prefix}{name} has no description"
            assert not field.is_required(), f"{prefix}{name} has no default"
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                check(field.annotation, f"{prefix}{name}.")

    check(BrokerConfig, "")


def test_wal_dir_and_objects_root_follow_settings() -> None:
    config = parse_config(
        {
            "broker": {"data_dir": "/srv/danube"},
            "storage": {"wal": {"dir": "/fast/wal"}, "cloud": {"root": "/shared/objects"}},
        }
    )
    assert config.wal_dir() == Path("/fast/wal")
    assert config.objects_root() == "/shared/objects"
    s3 = parse_config(
        {"storage": {"cloud": {"backend": "s3", "bucket": "b", "region": "us-east-1"}}}
    )
    assert s3.objects_root() == ""


# ---------------------------------------------------------------------- the example file


def example_env_names() -> set[str]:
    return set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", EXAMPLE.read_text(encoding="utf-8")))


def test_example_file_loads_and_equals_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in example_env_names():
        monkeypatch.delenv(name, raising=False)
    assert load_config(EXAMPLE) == load_config()


def test_example_file_lists_every_key() -> None:
    raw = yaml.safe_load(EXAMPLE.read_text(encoding="utf-8"))

    def check(model: type[BaseModel], section: dict[str, Any], prefix: str) -> None:
        assert set(section) == set(model.model_fields), prefix or "top level"
        for name, field in model.model_fields.items():
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
                check(field.annotation, section[name], f"{prefix}{name}.")

    check(BrokerConfig, raw, "")


def test_example_file_uses_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("DANUBE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t")
    config = load_config(EXAMPLE)
    assert config.broker.data_dir == tmp_path
    assert config.wal_dir() == tmp_path / "wal"
    secret = config.storage.cloud.secret_access_key
    assert secret is not None and secret.get_secret_value() == "s3cr3t"
    assert "s3cr3t" not in repr(config)


# ------------------------------------------------------------------ loading and overrides


def test_load_file_with_human_values(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
storage:
  wal:
    fsync: never
    fsync_interval_ms: 2s
    segment_bytes: 16MiB
    segment_seconds: 500ms
    retention: {max_minutes: 48h, max_bytes: 20GB}
etcd:
  lease_ttl_seconds: 1m
""",
    )
    config = load_config(path)
    wal = config.storage.wal
    assert wal.fsync == "never"
    assert wal.fsync_interval_ms == 2000
    assert wal.segment_bytes == 16 * MiB
    assert wal.segment_seconds == 0.5
    assert wal.retention.max_minutes == 48 * 60
    assert wal.retention.max_bytes == 20 * 10**9
    assert config.etcd.lease_ttl_seconds == 60
    assert wal.max_batch_bytes == 4 * MiB  # untouched keys keep their defaults


def test_empty_file_is_all_defaults(tmp_path: Path) -> None:
    assert load_config(write(tmp_path, "# nothing set\n")) == load_config()


def test_overrides_merge_over_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "storage:\n  wal:\n    regions: 2\n    fsync: never\n")
    config = load_config(
        path, overrides={"storage": {"wal": {"fsync": "always"}}, "broker.broker_id": "b-7"}
    )
    assert config.storage.wal.regions == 2
    assert config.storage.wal.fsync == "always"
    assert config.broker.broker_id == "b-7"


def test_missing_file_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"cannot read config file .*missing\.yml"):
        load_config(tmp_path / "missing.yml")


def test_invalid_yaml_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "storage: [unclosed\n")
    with pytest.raises(ConfigError, match=r"broker\.yml: invalid YAML"):
        load_config(path)


def test_duplicate_key_is_an_error(tmp_path: Path) -> None:
    path = write(tmp_path, "storage:\n  mode: memory\n  mode: wal_cloud\n")
    with pytest.raises(ConfigError, match="duplicate key 'mode'"):
        load_config(path)


def test_file_errors_name_the_file_and_key(tmp_path: Path) -> None:
    path = write(tmp_path, "storage:\n  wal:\n    fsync: sometimes\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (
        f"{path}: storage.wal.fsync: must be 'always' or 'never' (got 'sometimes')"
    )


def test_a_home_of_an_unknown_user_is_a_config_error(tmp_path: Path) -> None:
    """``~name`` of a user the machine does not have (the config fuzzer's ``~0``) is the
    key's error, not pathlib's RuntimeError."""
    path = write(tmp_path, "broker:\n  data_dir: ~0/data\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert (
        str(info.value) == f"{path}: broker.data_dir: cannot expand '~0/data': no such user (~name)"
    )


# ---------------------------------------------------------------------- env interpolation


def test_env_interpolation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DANUBE_TEST_BUCKET", "my-bucket")
    monkeypatch.setenv("DANUBE_TEST_SEGMENT", "16MiB")
    monkeypatch.setenv("DANUBE_TEST_ENDPOINTS", "http://e1:2379, http://e2:2379")
    monkeypatch.delenv("DANUBE_TEST_UNSET", raising=False)
    config = parse_config(
        {
            "storage": {
                "wal": {"segment_bytes": "${DANUBE_TEST_SEGMENT}"},
                "cloud": {
                    "backend": "s3",
                    "bucket": "${DANUBE_TEST_BUCKET}",
                    "region": "${DANUBE_TEST_UNSET:-eu-west-1}",
                    "root": "brokers/${DANUBE_TEST_BUCKET}/$${literal}",
                    "endpoint": "${DANUBE_TEST_UNSET:-}",
                },
            },
            "etcd": {"endpoints": "${DANUBE_TEST_ENDPOINTS}"},
        }
    )
    cloud = config.storage.cloud
    assert config.storage.wal.segment_bytes == 16 * MiB
    assert (cloud.bucket, cloud.region) == ("my-bucket", "eu-west-1")
    assert cloud.root == "brokers/my-bucket/${literal}"
    assert cloud.endpoint is None
    assert config.etcd.endpoints == ["http://e1:2379", "http://e2:2379"]


def test_empty_env_value_takes_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DANUBE_TEST_EMPTY", "")
    config = parse_config({"broker": {"broker_id": "${DANUBE_TEST_EMPTY:-broker-9}"}})
    assert config.broker.broker_id == "broker-9"


def test_missing_env_var_names_variable_and_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DANUBE_TEST_MISSING", raising=False)
    message = config_error({"storage": {"cloud": {"bucket": "${DANUBE_TEST_MISSING}"}}})
    assert message.startswith("storage.cloud.bucket: environment variable DANUBE_TEST_MISSING")
    message = config_error({"etcd": {"endpoints": ["http://a:2379", "${DANUBE_TEST_MISSING}"]}})
    assert message.startswith("etcd.endpoints[1]: environment variable DANUBE_TEST_MISSING")


def test_malformed_reference_is_an_error() -> None:
    message = config_error({"broker": {"broker_id": "${not closed"}})
    assert message.startswith("broker.broker_id: malformed reference")


# -------------------------------------------------------------------------- invalid values


def test_unknown_key_is_named() -> None:
    assert config_error({"storage": {"wal": {"fsynk": "never"}}}) == (
        "storage.wal.fsynk: unknown key (did you mean 'fsync'?)"
    )
    assert config_error({"wal_cloud": {}}).startswith("wal_cloud: unknown key (allowed: broker,")


def test_invalid_fsync() -> None:
    assert config_error({"storage": {"wal": {"fsync": "sometimes"}}}) == (
        "storage.wal.fsync: must be 'always' or 'never' (got 'sometimes')"
    )


def test_invalid_mode() -> None:
    assert config_error({"storage": {"mode": "disk"}}).startswith("storage.mode: must be ")


@pytest.mark.parametrize(
    ("data", "key"),
    [
        ({"storage": {"wal": {"segment_bytes": -1}}}, "storage.wal.segment_bytes"),
        ({"storage": {"wal": {"segment_bytes": "1KiB"}}}, "storage.wal.segment_bytes"),
        ({"storage": {"cache": {"max_bytes": "-5MiB"}}}, "storage.cache.max_bytes"),
        ({"storage": {"wal": {"retention": {"min_bytes": -1}}}}, "storage.wal.retention.min_bytes"),
        ({"limits": {"max_payload_bytes": 0}}, "limits.max_payload_bytes"),
        ({"storage": {"wal": {"fsync_interval_ms": -1}}}, "storage.wal.fsync_interval_ms"),
        ({"storage": {"wal": {"fsync_interval_ms": "1.5ms"}}}, "storage.wal.fsync_interval_ms"),
        ({"storage": {"wal": {"linger_us": -1}}}, "storage.wal.linger_us"),
        ({"storage": {"wal": {"linger_us": 2_000_000}}}, "storage.wal.linger_us"),
        ({"storage": {"wal": {"segment_seconds": 0}}}, "storage.wal.segment_seconds"),
        ({"storage": {"wal": {"regions": 0}}}, "storage.wal.regions"),
        ({"storage": {"wal": {"regions": True}}}, "storage.wal.regions"),
        ({"storage": {"uploader": {"concurrency": "many"}}}, "storage.uploader.concurrency"),
        (
            {"storage": {"uploader": {"max_bytes_per_second": "fast"}}},
            "storage.uploader.max_bytes_per_second",
        ),
        ({"broker": {"listen": "6650"}}, "broker.listen"),
        ({"broker": {"broker_id": "a/b"}}, "broker.broker_id"),
        ({"etcd": {"prefix": "danube"}}, "etcd.prefix"),
        ({"etcd": {"endpoints": []}}, "etcd.endpoints"),
        ({"storage": "wal_cloud"}, "storage"),
    ],
)
def test_invalid_value_names_the_key(data: dict[str, Any], key: str) -> None:
    assert config_error(data).startswith(f"{key}: ")


def test_cross_field_checks_name_the_key() -> None:
    too_big = {"storage": {"cache": {"max_bytes": "8MiB", "topic_max_bytes": "16MiB"}}}
    assert config_error(too_big) == (
        "storage.cache.topic_max_bytes: must be <= max_bytes (8388608)"
    )
    small = {"storage": {"wal": {"retention": {"max_bytes": "1MiB"}}}}
    assert config_error(small).startswith("storage.wal.retention.max_bytes: must be >= segment")
    backoff = {"storage": {"uploader": {"retry_base_ms": 500, "retry_max_ms": 100}}}
    assert config_error(backoff).startswith("storage.uploader.retry_max_ms: ")


def test_several_errors_are_all_reported() -> None:
    message = config_error({"storage": {"wal": {"fsync": "x", "regions": 0}}})
    assert message.startswith("2 invalid settings:")
    assert "storage.wal.fsync: " in message
    assert "storage.wal.regions: " in message


def test_s3_needs_bucket_and_region() -> None:
    assert config_error({"storage": {"cloud": {"backend": "s3"}}}) == (
        "storage.cloud.bucket: is required when backend is 's3'"
    )
    assert config_error({"storage": {"cloud": {"backend": "gcs"}}}).startswith(
        "storage.cloud.bucket: "
    )
    assert config_error({"storage": {"cloud": {"backend": "s3", "bucket": "b"}}}) == (
        "storage.cloud.region: is required when backend is 's3'"
    )
    gcs = parse_config({"storage": {"cloud": {"backend": "gcs", "bucket": "b"}}})
    assert gcs.storage.cloud.region is None


def test_cloud_options_are_strings_and_do_not_shadow_fields() -> None:
    config = parse_config({"storage": {"cloud": {"options": {"virtual": True, "n": 3}}}})
    assert config.storage.cloud.options == {"virtual": "true", "n": "3"}
    message = config_error({"storage": {"cloud": {"options": {"region": "x"}}}})
    assert message == "storage.cloud.options.region: set storage.cloud.region instead"


def test_secrets_are_not_echoed_in_errors() -> None:
    message = config_error({"storage": {"cloud": {"secret_access_key": ["s3cr3t"]}}})
    assert message.startswith("storage.cloud.secret_access_key: ")
    assert "s3cr3t" not in message


def test_config_is_immutable() -> None:
    config = load_config()
    with pytest.raises(ValueError, match="frozen"):
        config.storage.wal.fsync = "never"


def test_non_mapping_is_an_error() -> None:
    with pytest.raises(ConfigError, match="mapping"):
        parse_config(["storage"])  # type: ignore[arg-type]


# ------------------------------------------------------------------ sizes and durations


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (4096, 4096),
        ("4096", 4096),
        ("100B", 100),
        ("64KiB", 64 * 1024),
        ("8MiB", 8 * MiB),
        ("8mib", 8 * MiB),
        ("1.5 GiB", 1536 * MiB),
        ("1GiB", 1024 * MiB),
        ("2TiB", 2 * 1024**4),
        ("500MB", 500_000_000),
        ("1KB", 1000),
        ("3GB", 3 * 10**9),
    ],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "MiB", "8 potatoes", "-1", "-1MiB", "0.5B", "8M", -1, True])
def test_parse_size_rejects(text: str | int) -> None:
    with pytest.raises(ConfigError, match="invalid size"):
        parse_size(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (10, 10.0),
        (0.25, 0.25),
        ("10", 10.0),
        ("500ms", 0.5),
        ("1.5s", 1.5),
        ("5m", 300.0),
        ("2min", 120.0),
        ("48h", 172800.0),
        ("7d", 604800.0),
    ],
)
def test_parse_duration(text: str | float, expected: float) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "s", "10 parsecs", "-1s", -1, False])
def test_parse_duration_rejects(text: str | float) -> None:
    with pytest.raises(ConfigError, match="invalid duration"):
        parse_duration(text)


def test_upload_bandwidth_limit() -> None:
    assert parse_config({}).storage.uploader.max_bytes_per_second is None
    uploader = {"storage": {"uploader": {"max_bytes_per_second": "50MiB"}}}
    assert parse_config(uploader).storage.uploader.max_bytes_per_second == 50 * MiB
    for value in (0, "512KiB"):
        message = config_error({"storage": {"uploader": {"max_bytes_per_second": value}}})
        assert message.startswith("storage.uploader.max_bytes_per_second: must be at least 1MiB")
        assert "null for no limit" in message


def test_secure_example_config_is_secure_and_loads() -> None:
    """config/danube_broker_secure.yml (docs/security.md's example) loads as written and turns
    on every protection: TLS on the gRPC port, authentication, etcd over TLS with a user."""
    config = load_config(EXAMPLE.with_name("danube_broker_secure.yml"))
    assert config.broker.tls is not None
    assert config.broker.tls.cert_file is not None and config.broker.tls.key_file is not None
    assert not config.broker.allow_insecure
    assert config.auth.enabled
    assert config.etcd.endpoints and all(e.startswith("https://") for e in config.etcd.endpoints)
    assert config.etcd.user and config.etcd.password_file is not None


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "content",
    [
        b"broker:\n  broker_id: \x80\n",  # read_text raised UnicodeDecodeError
        b"[" * 5_000,  # the YAML parser raised RecursionError
        # Aliases expanding to 10**10 values: interpolation walked them (a hang).
        b"a0: &a0 [x]\n"
        + b"".join(
            f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n".encode() for i in range(1, 11)
        ),
    ],
    ids=["not-utf8", "deep", "alias-bomb"],
)
def test_unreadable_files_raise_config_error_naming_the_file(
    tmp_path: Path, content: bytes
) -> None:
    """Found by tests/fuzz/test_config.py."""
    path = tmp_path / "broker.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=str(path)):
        load_config(path)
