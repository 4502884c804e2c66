"""Fuzzing the configuration loader: YAML text, YAML documents shaped like ours with odd
values, dotted overrides, ``${ENV}`` references.

Property: ``load_config`` returns a valid ``BrokerConfig`` or raises :class:`ConfigError` (whose
message names the file), never another exception, for any file content and any overrides.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel

from danube_ingest.config import BrokerConfig, load_config
from danube_ingest.errors import ConfigError

from .support import budget, json_values, odd_text

pytestmark = [pytest.mark.fuzz, pytest.mark.timeout(120)]


def _paths(model: type[BaseModel], prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every setting's key path, sections included (they may be given a scalar too)."""
    out: list[tuple[str, ...]] = []
    for name, info in model.model_fields.items():
        path = (*prefix, info.alias or name)
        out.append(path)
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            out += _paths(kind, path)
    return out


PATHS = _paths(BrokerConfig)

#: Values a setting may be given: the right type or not, sizes and durations as text, env refs.
setting_values = (
    json_values
    | st.sampled_from(
        [
            "1MiB",
            "10 GB",
            "-1",
            "0",
            "5s",
            "1e309",
            "never",
            "always",
            "127.0.0.1:0",
            "[::1]:99999",
            "${HOME}",
            "${DANUBE_FUZZ_UNSET}",
            "${DANUBE_FUZZ_UNSET:-3}",
            "${",
            "$${x}",
            "${A:-${B}}",
            "s3://bucket/path",
        ]
    )
    | odd_text
)


@st.composite
def documents(draw: st.DrawFn) -> Any:
    """A document shaped like ours: some settings set (to odd values), maybe an unknown key."""
    doc: dict[Any, Any] = {}
    for path in draw(st.lists(st.sampled_from(PATHS), max_size=6)):
        node = doc
        for part in path[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = node[part] = {}
            node = child
        node[path[-1]] = draw(setting_values)
    if draw(st.booleans()):
        doc[draw(odd_text | st.integers() | st.none())] = draw(json_values)
    return doc


@pytest.fixture(scope="module")
def config_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("config") / "broker.yaml"


def load(path: Path, text: str | bytes, overrides: dict[str, Any] | None = None) -> Any:
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    try:
        config = load_config(path, overrides)
    except ConfigError as exc:
        assert str(path) in str(exc)
        return None
    assert isinstance(config, BrokerConfig)
    return config


@budget(300)
@given(text=st.text(max_size=400) | st.binary(max_size=400))
def test_arbitrary_files_load_or_raise_config_error(config_file: Path, text: str | bytes) -> None:
    load(config_file, text)


@budget(300)
@given(doc=documents(), style=st.sampled_from([False, True, None]))
def test_documents_like_ours_load_or_raise_config_error(
    config_file: Path, doc: Any, style: bool | None
) -> None:
    load(config_file, yaml.safe_dump(doc, default_flow_style=style, allow_unicode=True))


@budget(200)
@given(
    doc=documents(),
    overrides=st.dictionaries(
        st.sampled_from([".".join(p) for p in PATHS]) | odd_text, setting_values, max_size=4
    ),
)
def test_overrides_load_or_raise_config_error(
    config_file: Path, doc: Any, overrides: dict[str, Any]
) -> None:
    load(config_file, yaml.safe_dump(doc), overrides)


@budget(100)
@given(
    opener=st.sampled_from(["[", "{a: ", "- ", "&a [*a, ", "!!python/object:os.system "]),
    depth=st.sampled_from([1, 50, 2_000, 20_000]),
)
def test_deep_or_unsafe_yaml_raises_config_error(
    config_file: Path, opener: str, depth: int
) -> None:
    load(config_file, opener * depth)


def _alias_bomb(levels: int, width: int) -> str:
    lines = ["a0: &a0 [x]"]
    for level in range(1, levels + 1):
        refs = ", ".join([f"*a{level - 1}"] * width)
        lines.append(f"a{level}: &a{level} [{refs}]")
    return "\n".join(lines) + "\n"


@budget(20)
@given(levels=st.integers(1, 12), width=st.integers(1, 12))
def test_alias_bombs_raise_config_error_quickly(config_file: Path, levels: int, width: int) -> None:
    """YAML aliases that expand to up to 12**12 values: refused without walking them."""
    load(config_file, _alias_bomb(levels, width))
