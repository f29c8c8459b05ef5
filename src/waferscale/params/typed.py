"""Typed dataclasses from parsed YAML mappings, with key paths in every error.

`build_dataclass(cls, mapping, path, ctx)` walks a mapping against a dataclass's annotations (bool, int, float,
str, Literal choices, lists, tuples, nested dataclasses, unions, Any) and turns every user mistake into a
`ConfigError` with the file, line and key path (the package docstring shows one).

A dataclass may declare `ALIASES` (legacy spelling -> field) and `IGNORED_KEYS` (accepted, unused: key -> reason);
a field may name its own converter with `field(metadata={"convert": fn})`, `fn(value, path, ctx, line)`. Value
checks live in each dataclass's `__post_init__`, raising `FieldError`, which the builder turns into a ConfigError
with the file, line and key path, so objects built in code are validated the same way (`check_fields`).
Line numbers come from the mappings `yaml_lines.make_loader` produces (`key_lines`); plain dicts have none.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from waferscale.errors import ConfigError


class FieldError(ConfigError):
    """A bad value in one field, raised by a `__post_init__`; `build_dataclass` adds the file, line and key path."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key
        self.message = message


@dataclass
class Ctx:
    source: str
    note: str = ""
    ignored: dict[str, str] = field(default_factory=dict)  # key path -> why it is accepted and unused

    def error(self, path: str, message: str, line: int | None = None) -> ConfigError:
        where = f"{self.source}:{line}" if line else self.source
        return ConfigError(f"{where}: {path}: {message}{self.note}" if path else f"{where}: {message}{self.note}")


def join_path(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)


def build_dataclass(cls: type, data: Any, path: str, ctx: Ctx, line: int | None = None) -> Any:
    """Build dataclass `cls` from mapping `data` found at key path `path`, checking keys and types."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init and f.name not in ("source", "ignored")}
    if not isinstance(data, Mapping):
        names = ", ".join(list(fields)[:8]) + (", ..." if len(fields) > 8 else "")
        raise ctx.error(path, f"expected a mapping of {cls.__name__} keys ({names}), got {show(data)}", line)
    hints = get_type_hints(cls)
    aliases: dict[str, str] = getattr(cls, "ALIASES", {})
    ignored: dict[str, str] = getattr(cls, "IGNORED_KEYS", {})
    lines: dict[Any, int] = getattr(data, "key_lines", {})
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        key_path, key_line = join_path(path, key), lines.get(key, line)
        name = aliases.get(key, key)
        if name in fields:
            if name in kwargs:
                raise ctx.error(key_path, f"gives {name!r} a second time (as {key!r}); keep one", key_line)
            kwargs[name] = convert_value(value, hints[name], key_path, ctx, key_line, fields[name])
        elif key in ignored:
            ctx.ignored[key_path] = ignored[key]
        else:
            raise unknown_key(ctx, path, key, sorted(set(fields) | set(aliases) | set(ignored)), key_line)
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        where = f"under {path}" if path else "at the top level"
        also = f" (also missing: {', '.join(missing[1:])})" if missing[1:] else ""
        raise ctx.error(path, f"missing required key {missing[0]!r}{also}; add `{missing[0]}: ...` {where}", line)
    try:
        return cls(**kwargs)
    except FieldError as e:
        first = e.key.split(".")[0]
        raise ctx.error(join_path(path, e.key) if e.key else path, e.message, lines.get(first, line)) from None


def convert_value(value: Any, tp: Any, path: str, ctx: Ctx, line: int | None, f: dataclasses.Field | None = None
             ) -> Any:
    """Check `value` against the annotation `tp` and return it in canonical form."""
    if f is not None and "convert" in f.metadata:
        return f.metadata["convert"](value, path, ctx, line)
    origin, args = get_origin(tp), get_args(tp)
    if tp is Any:
        return to_plain(value)
    if origin in (Union, types.UnionType):
        options = [a for a in args if a is not type(None)]
        if value is None and len(options) < len(args):
            return None
        if len(options) == 1:
            return convert_value(value, options[0], path, ctx, line)
        for option in options:
            try:
                return convert_value(value, option, path, ctx, line)
            except ConfigError:
                continue
        raise ctx.error(path, f"expected {_type_name(tp)}, got {show(value)}", line)
    if value is None:
        raise ctx.error(path, f"expected {_type_name(tp)}, got nothing (null); give a value or leave the key out",
                        line)
    if origin is Literal:
        if isinstance(value, str):
            for choice in args:
                if value.strip().lower() == str(choice).lower():
                    return choice
        raise ctx.error(path, f"expected one of {', '.join(repr(a) for a in args)}, got {show(value)}", line)
    if origin is list:
        (item_tp,) = args
        if isinstance(value, str) and item_tp is str:
            value = [value]
        if not isinstance(value, list):
            raise ctx.error(path, f"expected {_type_name(tp)}, got {show(value)}", line)
        return [convert_value(v, item_tp, f"{path}[{i}]", ctx, line) for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ctx.error(path, f"expected {_type_name(tp)}, got {show(value)}", line)
        return tuple(convert_value(v, a, f"{path}[{i}]", ctx, line) for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ctx.error(path, f"expected a mapping, got {show(value)}", line)
        return to_plain(value)
    if dataclasses.is_dataclass(tp):
        return build_dataclass(tp, value, path, ctx, line)
    ok = {bool: isinstance(value, bool),
          int: isinstance(value, int) and not isinstance(value, bool),
          float: isinstance(value, (int, float)) and not isinstance(value, bool),
          str: isinstance(value, str)}.get(tp)
    if ok is None:
        raise TypeError(f"config helper: unsupported annotation {tp!r} at {path}")
    if not ok:
        raise ctx.error(path, f"expected {_type_name(tp)}, got {show(value)}", line)
    return float(value) if tp is float else value


def check_fields(obj: Any) -> None:
    """For objects built in code (`build_dataclass` already did this for YAML): build nested dataclass fields given as
    mappings, and check every choice (Literal-typed) field's value, case-insensitively as in YAML: 'adamw' -> 'AdamW'.
    Fields mixing choices and other types (float | 'dynamic') are checked by hand."""
    hints = get_type_hints(type(obj))
    ctx = Ctx(f"<{type(obj).__name__}>")
    for f in dataclasses.fields(obj):
        tp, value = hints[f.name], getattr(obj, f.name)
        options = [a for a in (get_args(tp) if get_origin(tp) in (Union, types.UnionType) else (tp,))
                   if a is not type(None)]
        nested = [a for a in options if dataclasses.is_dataclass(a)]
        if nested and isinstance(value, Mapping):
            setattr(obj, f.name, build_dataclass(nested[0], value, f.name, ctx))
        elif value is not None and all(get_origin(a) is Literal for a in options):
            setattr(obj, f.name, convert_value(value, tp, f.name, ctx, None))


def positive(obj: Any, *keys: str, what: str = "a positive integer") -> None:
    for key in keys:
        value = getattr(obj, key)
        if value is not None and value <= 0:
            raise FieldError(key, f"must be {what}, got {value}")


def non_negative(obj: Any, *keys: str) -> None:
    for key in keys:
        value = getattr(obj, key)
        if value is not None and value < 0:
            raise FieldError(key, f"must be >= 0, got {value}")


def to_plain(value: Any) -> Any:
    """Dataclasses -> dicts without None-valued fields (every optional field defaults to None); YAML containers
    -> plain dicts/lists (drops line bookkeeping)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        out = {}
        for f in dataclasses.fields(value):
            v = getattr(value, f.name)
            if f.compare and v is not None:
                out[f.name] = to_plain(v)
        return out
    if isinstance(value, (list, tuple)):
        return [to_plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: to_plain(v) for k, v in value.items()}
    return value


def _type_name(tp: Any) -> str:
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in args if a is not type(None))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is list:
        return f"a list of {_type_name(args[0]).removeprefix('a ').removeprefix('an ')}s"
    if origin is tuple:
        return f"a list of {len(args)} {_type_name(args[0]).removeprefix('a ')}s"
    if dataclasses.is_dataclass(tp):
        return "a mapping"
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string",
            dict: "a mapping"}.get(tp, getattr(tp, "__name__", str(tp)))


def show(value: Any) -> str:
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
            type(None): "null"}.get(type(value), "a mapping" if isinstance(value, Mapping) else type(value).__name__)
    text = repr(to_plain(value))
    return f"{text[:60] + '...' if len(text) > 60 else text} ({kind})"


def unknown_key(ctx: Ctx, path: str, key: Any, known: list[str] | tuple[str, ...], line: int | None) -> ConfigError:
    close = difflib.get_close_matches(str(key), known, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return ctx.error(join_path(path, key), f"unknown key {key!r}{hint}; known keys here: {', '.join(known)}", line)


def expect_keys(mapping: Any, path: str, known: tuple[str, ...], ctx: Ctx) -> None:
    if not isinstance(mapping, Mapping):
        raise ctx.error(path, f"expected a mapping, got {show(mapping)}")
    for key in mapping:
        if key not in known:
            raise unknown_key(ctx, path, key, known, getattr(mapping, "key_lines", {}).get(key))


__all__ = ["FieldError", "Ctx", "build_dataclass", "convert_value", "check_fields", "positive", "non_negative",
           "to_plain", "show", "join_path", "expect_keys", "unknown_key"]
