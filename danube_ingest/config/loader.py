"""Loading: YAML, ``${ENV}`` interpolation, overrides, and errors that name the key."""

from __future__ import annotations

import difflib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    ValidationError,
)
from pydantic_core import ErrorDetails

from danube_ingest.config.models import (
    BrokerConfig,
)
from danube_ingest.config.values import (
    _FieldError,
)
from danube_ingest.errors import ConfigError

_REFERENCE = re.compile(r"\$\$\{|\$\{(?P<body>[^}]*)\}|\$\{")
_REFERENCE_BODY = re.compile(r"(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?::-(?P<default>.*))?", re.DOTALL)

_Loc = tuple[str | int, ...]


def _dotted(loc: _Loc) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "(top level)"


def _interpolate_str(text: str, loc: _Loc) -> str:
    def substitute(match: re.Match[str]) -> str:
        if match[0] == "$${":
            return "${"
        body = match["body"]
        parsed = _REFERENCE_BODY.fullmatch(body) if body is not None else None
        if parsed is None or "${" in (parsed["default"] or ""):
            raise ConfigError(
                f"{_dotted(loc)}: malformed reference in {text!r}; "
                f"use ${{NAME}} or ${{NAME:-default}} (and $${{ for a literal ${{)"
            )
        name, default = parsed["name"], parsed["default"]
        value = os.environ.get(name)
        if default is not None:
            return value if value else default
        if value is None:
            raise ConfigError(
                f"{_dotted(loc)}: environment variable {name} is not set "
                f"(set it, or give a default: ${{{name}:-default}})"
            )
        return value

    return _REFERENCE.sub(substitute, text)


def _interpolate(value: object, loc: _Loc) -> object:
    if isinstance(value, str):
        return _interpolate_str(value, loc)
    if isinstance(value, Mapping):
        return {key: _interpolate(item, (*loc, key)) for key, item in value.items()}
    if isinstance(value, list):
        return [_interpolate(item, (*loc, index)) for index, item in enumerate(value)]
    return value


def _unknown_key_hint(loc: _Loc) -> str:
    model: type[BaseModel] = BrokerConfig
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        annotation = field.annotation if field is not None else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        model = annotation
    allowed = list(model.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    if close:
        return f" (did you mean {close[0]!r}?)"
    return f" (allowed: {', '.join(allowed)})"


def _shown(loc: _Loc, value: object) -> str:
    if any(isinstance(part, str) and ("secret" in part or part == "options") for part in loc):
        return "<hidden>"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _describe(error: ErrorDetails) -> str:
    loc: _Loc = tuple(error["loc"])
    kind = error["type"]
    if kind == "value_error":
        cause = error.get("ctx", {}).get("error")
        if isinstance(cause, _FieldError):
            return f"{_dotted((*loc, *cause.key.split('.')))}: {cause.message}"
        return f"{_dotted(loc)}: {cause if cause is not None else error['msg']}"
    if kind == "extra_forbidden":
        return f"{_dotted(loc)}: unknown key{_unknown_key_hint(loc)}"
    message = error["msg"]
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        message = "must be a mapping of keys"
    elif kind == "too_short":
        message = "must not be empty"
    elif message.startswith("Input should be "):
        message = "must be " + message.removeprefix("Input should be ")
    return f"{_dotted(loc)}: {message} (got {_shown(loc, error['input'])})"


def _describe_all(exc: ValidationError) -> str:
    lines = [_describe(error) for error in exc.errors()]
    if len(lines) == 1:
        return lines[0]
    return f"{len(lines)} invalid settings:\n  " + "\n  ".join(lines)


def parse_config(data: Mapping[str, Any]) -> BrokerConfig:
    """Validate raw configuration data (as loaded from YAML) into a BrokerConfig.

    Environment references in string values are substituted first. Missing keys take their
    defaults. Raises ConfigError naming the dotted key of every invalid or unknown setting.
    """
    if not isinstance(data, Mapping):
        raise ConfigError(f"config must be a mapping of sections (got {type(data).__name__})")
    interpolated = _interpolate(data, ())
    try:
        return BrokerConfig.model_validate(interpolated)
    except ValidationError as exc:
        raise ConfigError(_describe_all(exc)) from None


class _StrictLoader(yaml.SafeLoader):
    """A SafeLoader that rejects a key repeated in one mapping instead of keeping the last."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> dict[Any, Any]:
    seen: set[str] = set()
    for key_node, _ in node.value:
        if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
            if key_node.value in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key_node.value!r}", key_node.start_mark
                )
            seen.add(key_node.value)
    return loader.construct_mapping(node, deep=True)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


#: Most values (scalars, lists and mappings, counted as YAML aliases expand them) a config file
#: may hold: ours has about a hundred, and an alias "bomb" (a few lines whose aliases expand to
#: billions of values) must be refused before anything walks it.
MAX_CONFIG_VALUES = 100_000


def _count_values(value: object, budget: int) -> int:
    """``budget`` less the values in ``value`` (aliases expanded); stops once below zero."""
    budget -= 1
    if isinstance(value, Mapping):
        items: Any = value.values()
    elif isinstance(value, list):
        items = value
    else:
        return budget
    for item in items:
        if budget < 0:
            break
        budget = _count_values(item, budget)
    return budget


def _read_yaml(path: Path) -> Mapping[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{path}: not UTF-8 text (byte {exc.start} is {exc.object[exc.start]:#04x}); "
            f"save it as UTF-8"
        ) from None
    try:
        data = yaml.load(text, Loader=_StrictLoader)  # a SafeLoader: plain data only
        if _count_values(data, MAX_CONFIG_VALUES) < 0:
            raise ConfigError(
                f"{path}: more than {MAX_CONFIG_VALUES} values (counting what aliases expand "
                f"to); a configuration holds far fewer"
            )
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: invalid YAML: {exc}") from None
    except RecursionError:
        raise ConfigError(f"{path}: invalid YAML: nested too deeply") from None
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: must be a mapping of sections (got {type(data).__name__})")
    return data


def _nest_dotted(overrides: Mapping[Any, Any]) -> dict[Any, Any]:
    nested: dict[Any, Any] = {}
    for key, value in overrides.items():
        if isinstance(key, str) and "." in key:
            *parents, leaf = key.split(".")
            value = {leaf: value}
            for parent in reversed(parents):
                value = {parent: value}
            nested = _merge(nested, value)
        else:
            nested = _merge(nested, {key: value})
    return nested


def _merge(base: Mapping[Any, Any], override: Mapping[Any, Any]) -> dict[Any, Any]:
    merged = dict(base)
    for key, value in override.items():
        current = merged.get(key)
        if isinstance(current, Mapping) and isinstance(value, Mapping):
            merged[key] = _merge(current, value)
        else:
            merged[key] = value
    return merged


def load_config(
    path: str | os.PathLike[str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> BrokerConfig:
    """Load the configuration from a YAML file, with ``overrides`` merged on top.

    ``path`` None means no file: every key at its default. ``overrides`` is a mapping shaped like
    the file, merged section by section; a top-level key with dots is a path
    (``{"storage.wal.fsync": "never"}``). Raises ConfigError, naming the file and the dotted key,
    for an unreadable file, invalid YAML (including a repeated key), or an invalid setting.
    """
    data: Mapping[str, Any] = {} if path is None else _read_yaml(Path(path))
    if overrides:
        data = _merge(data, _nest_dotted(overrides))
    try:
        return parse_config(data)
    except ConfigError as exc:
        if path is None:
            raise
        raise ConfigError(f"{os.fspath(path)}: {exc}") from None


#: The broker YAML that tools started beside the brokers read (the Spark job, Dagster, the
#: readers' helpers); unset: every key at its default (``./data/objects`` on fs, the dev
#: layout).
CONFIG_ENV = "DANUBE_INGEST_CONFIG"
#: Overrides that file's ``broker.data_dir`` (``danube-ingest dev --data-dir`` sets it), which
#: places the fs objects at ``{data_dir}/objects`` unless ``storage.cloud.root`` says otherwise.
DATA_DIR_ENV = "DANUBE_INGEST_DATA_DIR"


def config_from_env() -> BrokerConfig:
    """The configuration named by ``DANUBE_INGEST_CONFIG`` (none: the defaults), with
    ``broker.data_dir`` from ``DANUBE_INGEST_DATA_DIR`` when that is set."""
    data_dir = os.environ.get(DATA_DIR_ENV)
    overrides = {"broker.data_dir": data_dir} if data_dir else None
    return load_config(os.environ.get(CONFIG_ENV) or None, overrides)
