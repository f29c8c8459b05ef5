"""What every planning step of one compilation shares: the captured graph, the target, its wafers, the decisions."""

from __future__ import annotations

from dataclasses import dataclass, field

from waferscale.compiler._fabric import WaferMap
from waferscale.compiler.ir import Graph
from waferscale.compiler.placement import Rect
from waferscale.fabric.mesh import Mesh
from waferscale.fabric.spec import FabricSpec


@dataclass
class CompileContext:
    """One compilation: graph `g` on `systems` wafers of `spec` (one `WaferMap` each, defects drawn per
    system); `decisions` collects one sentence per choice, in order (what `Plan.explain()` prints)."""

    g: Graph
    spec: FabricSpec
    wafers: list[WaferMap]
    systems: int
    decisions: list[str]
    full_spec: FabricSpec | None = None  # the target's whole program rectangle when --pes chose a smaller mesh
    _meshes: dict = field(default_factory=dict)

    def say(self, text: str) -> None:
        self.decisions.append(text)

    @property
    def common_box(self) -> Rect:
        """The logical mesh every system has: a pipeline copy placed in it fits on any of the wafers (spare
        remapping leaves each wafer its own logical size)."""
        return Rect(0, 0, min(w.rows for w in self.wafers), min(w.cols for w in self.wafers))

    @property
    def wafer_spec(self) -> FabricSpec:
        """The target with its whole program rectangle (the same PE as `spec`)."""
        return self.full_spec or self.spec

    @property
    def full_box(self) -> Rect:
        """The whole wafer a layout may spread over: the target's program rectangle (`--pes` narrows only the
        mesh a layer runs on, `common_box`)."""
        if self.full_spec is None:
            return self.common_box
        return Rect(0, 0, self.full_spec.rows, self.full_spec.cols)

    @property
    def defective(self) -> bool:
        return any(w.mesh.has_defects for w in self.wafers)

    def region_mesh(self, system: int, row: int, col: int, rows: int, cols: int) -> Mesh | None:
        """The placed rectangle's own defect map (`Mesh.subregion`), or None on a perfect wafer."""
        mesh = self.wafers[system].mesh
        if not mesh.has_defects:
            return None
        key = (system, row, col, rows, cols)
        if key not in self._meshes:
            self._meshes[key] = mesh.subregion(row, col, rows, cols)
        return self._meshes[key]
