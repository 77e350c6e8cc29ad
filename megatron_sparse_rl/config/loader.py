"""Strict YAML -> frozen dataclass loader.

YAML files hold overrides only; defaults live in the dataclasses. Unknown keys fail with the dotted path
and a "did you mean" suggestion; wrong types fail naming the field, the expected type and the value.
`--set a.b=v` overrides are parsed as YAML scalars and applied on top of the file.

    run = load_config("configs/demo_tiny_moe.yaml", overrides=["learner.lr=1e-5"])
"""
from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

import yaml


class ConfigError(ValueError):
    """A config file, override or value is invalid; the message names the dotted field path."""


def _type_name(tp: Any) -> str:
    if tp is type(None):
        return "null"
    if typing.get_origin(tp) is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert_union(tp: Any, value: Any, path: str) -> Any:
    """`X | None` and other unions. A mapping given where one member is a dataclass is built as that
    dataclass, so its own errors (an unknown key inside `model.tiny`) surface instead of a type mismatch."""
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    members = [a for a in args if a is not type(None)]
    sections = [a for a in members if dataclasses.is_dataclass(a)]
    if isinstance(value, dict) and len(sections) == 1:
        return _convert(sections[0], value, path)
    for arg in members:
        try:
            return _convert(arg, value, path)
        except ConfigError:
            continue
    raise ConfigError(f"{path}: expected {' or '.join(_type_name(a) for a in args)}, got {value!r}")


def _convert(tp: Any, value: Any, path: str) -> Any:
    """Check `value` against the annotation `tp` and convert it (lists -> tuples, ints -> floats, dicts ->
    dataclasses). Raises ConfigError naming `path`."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        return _convert_union(tp, value, path)
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            hint = difflib.get_close_matches(str(value), [str(c) for c in choices], n=1)
            did = f" (did you mean {hint[0]!r}?)" if hint else ""
            raise ConfigError(f"{path}: {value!r} is not allowed; choose one of {', '.join(map(repr, choices))}{did}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise ConfigError(f"{path}: expected a list of {len(args)} items, got {value!r}")
        return tuple(_convert(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        kt, vt = typing.get_args(tp)
        return {_convert(kt, k, f"{path}.{k}"): _convert(vt, v, f"{path}.{k}") for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected bool (true/false), got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected int, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML 1.1 reads "1e-5" as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected float, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected str, got {value!r}")
    if tp is Any:
        return value
    raise TypeError(f"{path}: unsupported annotation {tp!r} in a config dataclass")


def _unknown_key(dotted: str, section: str, fields: dict) -> str:
    """The message for `dotted`, a key not among `fields` of `section`; the suggestion is a full dotted path:
    unknown key model.tiny.hiden (did you mean model.tiny.hidden?); allowed under model.tiny: arch, ..."""
    key = dotted.rsplit(".", 1)[-1]
    hint = difflib.get_close_matches(key, list(fields), n=1)
    did = f" (did you mean {section + '.' if section else ''}{hint[0]}?)" if hint else ""
    return f"unknown key {dotted}{did}; allowed under {section or 'the top level'}: {', '.join(sorted(fields))}"


def from_dict(cls: type, data: Any, path: str = "") -> Any:
    """Build dataclass `cls` from a nested mapping of overrides, strictly."""
    where = path or "<root>"
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of {cls.__name__} fields, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        dotted = f"{path}.{key}" if path else str(key)
        if key not in fields:
            raise ConfigError(_unknown_key(dotted, path, fields))
        kwargs[key] = _convert(hints[key], value, dotted)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from None


def parse_override(text: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], yaml-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like section.field=value")
    key, raw = text.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError(f"override {text!r}: empty name in the dotted path {key!r}")
    where = f"override {key.strip()}=..."
    try:
        value = _safe_load(raw, where) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {text!r}: value is not valid YAML ({e})") from None
    except RecursionError:
        raise ConfigError(f"{where}: {_TOO_DEEP}") from None
    return parts, value


def merge_overrides(data: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` overrides to the nested mapping `data` in place (and return it)."""
    for text in overrides:
        parts, value = parse_override(text)
        node = data
        for p in parts[:-1]:
            if node.get(p) is None:  # absent, or `tiny: null` in the file: --set model.tiny.x=v opens it
                node[p] = {}
            nxt = node[p]
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {text!r}: '{p}' is a value, not a section")
            node = nxt
        node[parts[-1]] = value
    return data


_TOO_DEEP = ("nested too deeply to read (the YAML parser recurses once per level and ran out of stack); a run "
             "config is a mapping of sections a few levels deep")

MAX_YAML_VALUES = 100_000
"""The most values (mappings, lists and scalars, every alias counted as the copy it stands for) one config file or
`--set` value may expand to. A run config has a few hundred; nested aliases (`&a [x, x]`, `&b [*a, *a]`, ...) double
the count at every level (the "billion laughs"), which would only show once Python objects or an error message
hold every copy."""


def _expanded_size(node: yaml.Node, sizes: dict[int, int], open_: set[int], where: str) -> int:
    """How many values `node` stands for with every alias written out (`sizes` memoises the nodes already counted,
    so this costs one visit per distinct node). An alias inside its own anchor is refused: a config is finite."""
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_:
        raise ConfigError(f"{where}: an alias refers to the anchor it is inside (a recursive value, line "
                          f"{node.start_mark.line + 1}); a run config holds no recursive values")
    open_.add(id(node))
    if isinstance(node, yaml.MappingNode):
        children = [n for pair in node.value for n in pair]
    elif isinstance(node, yaml.SequenceNode):
        children = node.value
    else:
        children = []
    size = 1 + sum(_expanded_size(child, sizes, open_, where) for child in children)
    open_.discard(id(node))
    sizes[id(node)] = size
    return size


def _safe_load(text: str, where: str) -> Any:
    """`yaml.safe_load(text)`, refusing before any Python object is built a document whose anchors and aliases expand
    to more than MAX_YAML_VALUES values, or refer to themselves; ConfigError naming `where`."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()  # the composed graph: an alias is the anchor's node, not a copy
        if node is None:
            return None
        size = _expanded_size(node, {}, set(), where)
        if size > MAX_YAML_VALUES:
            raise ConfigError(f"{where}: its anchors and aliases expand to {size:,} values; at most "
                              f"{MAX_YAML_VALUES:,} are allowed (a run config has a few hundred: write repeated "
                              "values out, or alias a value without nesting aliases inside aliases)")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def read_yaml(path: str | Path) -> dict:
    """The mapping in the YAML file `path`; ConfigError naming the file when it is missing, unreadable, not valid
    YAML, pathologically nested, expanding to more than MAX_YAML_VALUES values through its aliases, or not a
    mapping."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        data = _safe_load(path.read_text(encoding="utf-8"), str(path))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    except RecursionError:
        raise ConfigError(f"{path}: {_TOO_DEEP}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read as UTF-8 text ({e})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data


def to_dict(cfg: Any) -> Any:
    """Dataclass -> plain nested dict/list (for logging and saving the resolved config)."""
    if dataclasses.is_dataclass(cfg):
        return {f.name: to_dict(getattr(cfg, f.name)) for f in dataclasses.fields(cfg)}
    if isinstance(cfg, tuple):
        return [to_dict(v) for v in cfg]
    return cfg
