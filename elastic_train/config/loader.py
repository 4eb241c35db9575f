"""Fill dataclasses from plain data, strictly.

YAML only fills dataclasses: an unknown key, a wrong type or a value the dataclass rejects in its
``__post_init__`` becomes a :class:`~elastic_train.errors.ConfigError` whose one-line message names the key
path, the bad value and what is allowed, e.g.
``checkpoint.keep_lastt: unknown key (did you mean keep_last?)``.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

import yaml

from elastic_train.errors import ConfigError

T = TypeVar("T")

_TYPE_NAMES = {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _describe(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _convert(value: Any, hint: Any, path: str) -> Any:
    """Check ``value`` against the type ``hint`` and return it (nested dataclasses are built)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _convert(value, arg, path)
            except ConfigError as exc:
                errors.append(exc)
        raise errors[0] if len(errors) == 1 else ConfigError(f"{path}: unexpected value {_describe(value)}")
    if origin is typing.Literal:
        if value not in args:
            allowed = ", ".join(repr(a) for a in args)
            raise ConfigError(f"{path}: {value!r} is not one of {allowed}")
        return value
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return from_dict(hint, value, path)
    if origin in (list, tuple):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{path}: expected a list, got {_describe(value)}")
        item = args[0] if args else Any
        items = [_convert(v, item, f"{path}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict or hint is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{path}: expected a mapping, got {_describe(value)}")
        return dict(value)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{path}: expected a number, got {_describe(value)}")
        return float(value)
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{path}: expected an integer, got {_describe(value)}")
        return value
    if hint in (bool, str):
        if not isinstance(value, hint):
            raise ConfigError(f"{path}: expected {_TYPE_NAMES[hint]}, got {_describe(value)}")
        return value
    raise AssertionError(f"unsupported config type {hint!r} at {path}")


def from_dict(cls: type[T], data: Any, path: str = "") -> T:
    """Build dataclass ``cls`` from a mapping, rejecting unknown keys and wrong types.

    Args:
        cls: a dataclass whose fields have type annotations.
        data: the mapping (``None`` means "all defaults").
        path: dotted key path of ``data`` inside the whole document, used in error messages.

    Raises:
        ConfigError: with a one-line message naming the key path, the bad value and what is allowed.
    """
    assert dataclasses.is_dataclass(cls)
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path or 'config'}: expected a mapping, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        key_path = _join(path, str(key))
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean {close[0]}?)" if close else f" (allowed: {', '.join(sorted(fields))})"
            raise ConfigError(f"{key_path}: unknown key{hint}")
        kwargs[key] = _convert(value, hints[key], key_path)
    try:
        return cls(**kwargs)
    except (ValueError, TypeError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{_join(path, str(exc))}" if path else str(exc)) from exc


#: Largest config file read (a job.yaml is a few KiB).
MAX_CONFIG_BYTES = 1 << 20
#: Most YAML nodes a document may expand to once aliases are followed (a job.yaml has a few hundred).
MAX_CONFIG_NODES = 100_000


def safe_load_bounded(text: str, source: str = "config") -> Any:
    """``yaml.safe_load`` that refuses a document whose aliases expand it beyond :data:`MAX_CONFIG_NODES`.

    PyYAML builds an aliased node once and shares it, but everything downstream (overrides, validation)
    walks the expanded tree: a few hundred bytes of nested aliases (a "billion laughs") expand to billions of
    nodes. The expanded size is counted on the composed node graph, each distinct node once, before any
    value is constructed: time and memory stay linear in the file.

    Raises:
        ConfigError: the document expands too far or refers to itself.
        yaml.YAMLError: the text is not YAML.
    """
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _expanded_size(node, {}, set(), source)
        if size > MAX_CONFIG_NODES:
            raise ConfigError(_too_big(source))
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _too_big(source: str) -> str:
    return (
        f"{source}: refused, its aliases expand to more than {MAX_CONFIG_NODES} values (a YAML alias bomb?)"
    )


def _expanded_size(node: yaml.Node, sizes: dict[int, int], active: set[int], source: str) -> int:
    """Nodes in the tree ``node`` expands to (aliases followed), memoized per node; stops past the bound."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in active:
        raise ConfigError(f"{source}: refused, an alias refers to a value that contains it")
    total = 1
    if isinstance(node, yaml.SequenceNode | yaml.MappingNode):
        active.add(key)
        children = node.value if isinstance(node, yaml.SequenceNode) else [n for kv in node.value for n in kv]
        for child in children:
            total += _expanded_size(child, sizes, active, source)
            if total > MAX_CONFIG_NODES:
                raise ConfigError(_too_big(source))
        active.discard(key)
    sizes[key] = total
    return total


def parse_override(text: str) -> tuple[str, Any]:
    """Parse ``a.b.c=value`` (value in YAML syntax) into ``("a.b.c", value)``.

    Raises:
        ConfigError: when there is no ``=`` or the value is not valid YAML.
    """
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected KEY.PATH=VALUE")
    try:
        value = safe_load_bounded(raw, f"--set {key.strip()}") if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {text!r}: value is not valid YAML") from exc
    return key.strip(), value


def apply_overrides(data: dict[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Return a copy of ``data`` with dotted-path ``overrides`` applied (validated later by from_dict).

    Raises:
        ConfigError: when a path walks through a value that is not a mapping.
    """
    result: dict[str, Any] = _deep_copy(data)
    for dotted, value in overrides.items():
        node = result
        parts = dotted.split(".")
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"{'.'.join(parts[: i + 1])}: cannot set {dotted}, not a mapping")
            node = child
        node[parts[-1]] = value
    return result


def _deep_copy(data: Any) -> Any:
    if isinstance(data, Mapping):
        return {k: _deep_copy(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_deep_copy(v) for v in data]
    return data
