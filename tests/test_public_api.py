"""The public API, declared and held still: every name in the `__all__` of the modules users import (cstorch,
`LLM` / `SamplingParams`, the appliance `Client`, `models`, `compile_model`, the model resolver) with its
signature, and every `wsc` command with its flags, equal a snapshot (tests/data/public_api.json). A change to
any of them fails here until the snapshot is rewritten on purpose:

    python tests/test_public_api.py --update
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import sys
from pathlib import Path

SNAPSHOT = Path(__file__).parent / "data" / "public_api.json"
MODULES = ["waferscale.pytorch", "waferscale.pytorch.amp", "waferscale.pytorch.optim", "waferscale.pytorch.utils.data",
           "waferscale.pytorch.distributed", "waferscale.pytorch.sparse", "waferscale.serve.llm",
           "waferscale.appliance.client", "waferscale.models", "waferscale.compiler", "waferscale.runtime.source"]


def _describe(obj: object) -> str:
    if inspect.ismodule(obj):
        return "module"
    if inspect.isclass(obj):
        try:
            return f"class{inspect.signature(obj)}"
        except (TypeError, ValueError):
            return "class"
    if callable(obj):
        try:
            return f"def{inspect.signature(obj)}"
        except (TypeError, ValueError):
            return "callable"
    return type(obj).__name__


def current() -> dict:
    api: dict[str, dict[str, str]] = {}
    for name in MODULES:
        mod = importlib.import_module(name)
        api[name] = {n: _describe(getattr(mod, n)) for n in sorted(mod.__all__)}
    from waferscale.cli.main import build_parser

    cli: dict[str, dict[str, list[str]]] = {}

    def walk(parser: argparse.ArgumentParser, prefix: str) -> None:  # every command, subcommands included
        for a in parser._actions:
            if isinstance(a, argparse._SubParsersAction):
                for cmd, p in sorted(a.choices.items()):
                    name = f"{prefix} {cmd}".strip()
                    cli[name] = {"flags": sorted(s for b in p._actions for s in b.option_strings
                                                 if s not in ("-h", "--help")),
                                 "positional": [b.dest for b in p._actions if not b.option_strings
                                                and not isinstance(b, argparse._SubParsersAction)]}
                    walk(p, name)

    walk(build_parser(), "")
    return {"modules": api, "wsc": cli}


def test_the_public_api_is_the_snapshot() -> None:
    want = json.loads(SNAPSHOT.read_text())
    got = json.loads(json.dumps(current()))
    changed = []
    for part in ("modules", "wsc"):
        for k in sorted(set(want[part]) | set(got[part])):
            if want[part].get(k) != got[part].get(k):
                changed.append(f"{part} {k}:\n  snapshot {want[part].get(k)}\n  now      {got[part].get(k)}")
    assert not changed, ("the public API changed (rewrite the snapshot on purpose: python tests/test_public_api.py "
                         "--update):\n" + "\n".join(changed))


if __name__ == "__main__":
    if sys.argv[1:] != ["--update"]:
        raise SystemExit("usage: python tests/test_public_api.py --update")
    SNAPSHOT.write_text(json.dumps(current(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {SNAPSHOT}")
