"""The compiler's view of a wafer's defect map (`fabric.mesh`): the logical mesh placement works on.

The cycle model the compiler composes is `waferscale.fabric.cost`, imported where it is used (`project.py`,
`training.py`, `weight_streaming.py`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from waferscale.errors import ConfigError
from waferscale.fabric.mesh import Mesh
from waferscale.fabric.spec import FabricSpec


@dataclass(frozen=True)
class WaferMap:
    """One wafer as the compiler sees it: a logical rows x cols rectangle, and the logical coordinates of any
    core inside it that is dead (placement counts only live PEs and maps no tile onto a dead one)."""

    rows: int
    cols: int
    dead: np.ndarray  # (n, 2) int32 logical (row, col) of dead cores inside the rectangle
    dead_physical: np.ndarray  # (n, 2) physical coordinates of every dead core (for pictures)
    physical_rows: int
    physical_cols: int
    spare_note: str = ""
    mesh: object = None  # fabric.mesh.Mesh when available: physical(r, c), phys_rows, phys_cols

    @property
    def usable_pes(self) -> int:
        return self.rows * self.cols - len(self.dead)

    def dead_prefix(self) -> np.ndarray:
        """2D inclusive prefix sum of the dead bitmap, shape (rows+1, cols+1): O(1) dead count per rectangle."""
        bm = np.zeros((self.rows + 1, self.cols + 1), dtype=np.int32)
        if len(self.dead):
            np.add.at(bm, (self.dead[:, 0] + 1, self.dead[:, 1] + 1), 1)
        return bm.cumsum(0).cumsum(1)


def wafer_map(spec: FabricSpec, defect_rate: float, seed: int) -> WaferMap:
    if not 0.0 <= defect_rate < 1.0:
        raise ConfigError(f"--defects must be a rate in [0, 1), got {defect_rate}")
    m = Mesh.build(spec, defect_rate, seed)
    dead_phys = np.argwhere(np.asarray(m.dead_cores)).astype(np.int32).reshape(-1, 2)
    note = (f"{m.n_dead_cores} dead cores and {m.n_dead_links} dead links; spare rows/columns remapped by "
            f"fabric.mesh, so the compiler sees a perfect {m.logical_rows}x{m.logical_cols} logical mesh")
    return WaferMap(int(m.logical_rows), int(m.logical_cols), np.zeros((0, 2), np.int32), dead_phys,
                    spec.rows, spec.cols, note, m)
