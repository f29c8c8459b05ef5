"""Reading a params YAML with the line of every key, for error messages that point into the file."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from waferscale.errors import ConfigError


class LinedDict(dict):
    """A YAML mapping that remembers the (1-based) line of each key, for error messages."""

    key_lines: dict[Any, int]


def make_loader(source: str) -> type[yaml.SafeLoader]:
    class Loader(yaml.SafeLoader):
        pass

    def construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode) -> LinedDict:
        loader.flatten_mapping(node)
        out = LinedDict()
        out.key_lines = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if key in out:
                raise ConfigError(f"{source}:{line}: duplicate key {key!r} (first on line {out.key_lines[key]}); "
                                  f"keep one")
            out[key] = loader.construct_object(value_node, deep=True)
            out.key_lines[key] = line
        return out

    Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, construct_mapping)
    # YAML 1.1 reads `1e-3` (no dot) as a string; read it as the number everyone means.
    Loader.add_implicit_resolver("tag:yaml.org,2002:float",
                                 re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                                 list("-+0123456789"))
    return Loader


def read_yaml(path: str | Path, text: str | None = None) -> Any:
    """The parsed file (or `text`, read from it elsewhere), its mappings `LinedDict`s. Every problem is a
    ConfigError naming the file (and the line and column of malformed YAML)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8") if text is None else text
    except FileNotFoundError:
        raise ConfigError(f"{path}: no such params file; check the --params path") from None
    except IsADirectoryError:
        raise ConfigError(f"{path}: is a directory, not a params YAML file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read the params file ({e})") from None
    try:
        return yaml.load(text, Loader=make_loader(str(path)))  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e)
        context = getattr(e, "context", None)
        raise ConfigError(f"{where}: malformed YAML: {problem}" + (f" ({context})" if context else "")) from None


__all__ = ["LinedDict", "make_loader", "read_yaml"]
