"""The compiler's view of a wafer's defect map (`fabric.mesh`): the logical mesh placement works on."""

from __future__ import annotations

from dataclasses import dataclass

from waferscale.fabric.mesh import Mesh
from waferscale.fabric.spec import FabricSpec


@dataclass(frozen=True)
class WaferMap:
    """One wafer as the compiler sees it: the perfect rows x cols logical mesh that spare remapping carves out
    of the physical one (no logical PE is dead; `mesh` routes around the dead cores and links)."""

    rows: int
    cols: int
    mesh: Mesh

    @property
    def usable_pes(self) -> int:
        return self.rows * self.cols


def wafer_map(spec: FabricSpec, defect_rate: float, seed: int) -> WaferMap:
    m = Mesh.build(spec, defect_rate, seed)
    return WaferMap(m.logical_rows, m.logical_cols, m)
