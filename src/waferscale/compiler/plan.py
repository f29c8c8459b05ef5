"""Plan: the compiler's serializable contract — strategy, placement, projections, the reasons for each choice.

`to_json()`/`from_json()` round-trip exactly; `fingerprint()` is the sha256 of the canonical JSON (sorted
keys, no whitespace, the fingerprint field itself left out), so two compiles of the same request agree.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from waferscale.errors import ConfigError

PLAN_VERSION = 1


@dataclass(frozen=True)
class Region:
    """One unit placed on one wafer: a rectangle of the logical mesh (row, col = top-left corner)."""

    unit: int  # index into graph.units
    name: str
    system: int  # which wafer (0-based)
    replica: int  # data-parallel replica (0-based)
    stage: int  # pipeline stage within the replica (0-based)
    row: int
    col: int
    rows: int
    cols: int
    live_pes: int  # PEs of the rectangle that are alive (what tiles are mapped onto)
    bytes: int  # SRAM bytes the region holds (weights + KV cache / optimizer state + activations)

    @property
    def area(self) -> int:
        return self.rows * self.cols


@dataclass
class Plan:
    model: str
    source: str
    target: str
    systems: int
    mode: str  # "inference" | "train"
    strategy: str  # "pipelined" | "replicated" | "multi_wafer_pipelined" | "weight_streaming"
    replicas: int  # data-parallel copies in total (across wafers and systems)
    wafers_per_pipeline: int
    fits_in_sram: bool
    fabric: dict[str, Any]
    wafers: list[dict[str, Any]]  # per system: logical rows/cols, usable PEs, dead PEs, defect rate, seed
    workload: dict[str, Any]
    graph: dict[str, Any]
    regions: list[Region]
    decisions: list[str]
    projection: dict[str, Any]
    assumptions: dict[str, Any]
    bottleneck: str
    pes_used: int
    version: int = PLAN_VERSION
    fingerprint_sha256: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    # ---- serialization -----------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["fingerprint_sha256"] = self.fingerprint()
        return d

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), sort_keys=True, indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        version = d.get("version")
        if version != PLAN_VERSION:
            raise ConfigError(f"plan version {version!r} is not supported by this compiler (expects {PLAN_VERSION}); "
                              f"recompile with `wsc compile`")
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["regions"] = [Region(**r) for r in d["regions"]]
        plan = cls(**kw)
        stored = d.get("fingerprint_sha256")
        if stored and stored != plan.fingerprint():
            raise ConfigError("plan.json was modified after compilation (fingerprint mismatch); recompile it")
        return plan

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        try:
            d = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"plan is not valid JSON: {e}") from None
        return cls.from_dict(d)

    def fingerprint(self) -> str:
        d = dataclasses.asdict(self)
        d.pop("fingerprint_sha256", None)
        return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def explain(self) -> str:
        """Why each choice was made, one line per decision."""
        return "\n".join(f"- {d}" for d in self.decisions)
