"""Per-PE memory and route-following data movement for the functional (tile-level) kernel executions.

A `Tiles` object is a `rows x cols` logical region of a `Mesh`. Every buffer is one numpy array of shape
(rows, cols, *per_pe_shape): entry [i, j] *is* PE (i, j)'s SRAM copy, so the math is vectorized over PEs while
each PE only ever reads its own slice. Values reach another PE only through `move`, which follows the mesh's
physical route (around dead cores and links), checks it, and counts the 32-bit wavelets on every physical link.

Functional executions compute in fp32 and account 4 bytes per value against `sram_bytes_per_pe`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from waferscale.errors import ConfigError
from waferscale.fabric.mesh import Coord, Mesh
from waferscale.fabric.schedules import used

VALUE_BYTES = 4  # fp32 in the functional execution


@dataclass(frozen=True)
class TileRun:
    """What a functional kernel returns: the result and what it cost in memory and traffic."""

    out: np.ndarray
    rows: int  # logical region used
    cols: int
    sram_bytes_per_pe: int  # peak bytes allocated on one PE
    max_link_wavelets: int  # wavelets over the busiest physical link (one direction)
    link_wavelets: dict  # ((r, c), (r1, c1)) physical directed link -> wavelets
    touched: frozenset  # physical cores the data passed through (routers) or lived on


class Tiles:
    def __init__(self, mesh: Mesh, rows: int | None = None, cols: int | None = None) -> None:
        self.mesh = mesh
        self.rows, self.cols = mesh.check_region(rows, cols)
        self.buffers: dict[str, np.ndarray] = {}
        self.link_wavelets: dict[tuple[Coord, Coord], int] = {}
        self.touched: set[Coord] = {mesh.physical(i, j) for i in range(self.rows) for j in range(self.cols)}

    # ---- memory ----------------------------------------------------------------------------------------
    @property
    def bytes_per_pe(self) -> int:
        return sum(int(np.prod(b.shape[2:], dtype=np.int64)) * VALUE_BYTES for b in self.buffers.values())

    def alloc(self, name: str, *shape: int, fill: float = 0.0, dtype: type = np.float32) -> np.ndarray:
        """A (rows, cols, *shape) buffer of 4-byte values (fp32, or int32 for indices) on every PE.
        Raises ConfigError if the PE's SRAM would overflow."""
        need = self.bytes_per_pe + int(np.prod(shape, dtype=np.int64)) * VALUE_BYTES
        cap = self.mesh.spec.sram_bytes_per_pe
        if need > cap:
            raise ConfigError(
                f"mesh too small: buffer {name!r} of {shape} per PE brings each PE to {need:,} B, over its "
                f"{cap:,} B SRAM; use more PEs (a larger --pes) or a smaller problem")
        self.buffers[name] = np.full((self.rows, self.cols, *shape), fill, dtype=dtype)
        return self.buffers[name]

    # ---- movement --------------------------------------------------------------------------------------
    def move(self, data: np.ndarray, src: list[Coord], dst: list[Coord]) -> np.ndarray:
        """Send data[p] from logical PE src[p] to dst[p] along the mesh route; returns what arrives.

        `data` has the pairs on axis 0 and the values per PE after it. Counts wavelets per link (one value per
        32-bit wavelet in fp32) and refuses a route through a dead core or a dead link."""
        data = np.asarray(data, dtype=np.float32)
        n_wavelets = int(np.prod(data.shape[1:], dtype=np.int64))
        for s, d in zip(src, dst):
            path = self.mesh.route(s, d)
            for a, b in zip(path, path[1:]):
                if not self.mesh.link_ok(a, b):  # the router must never choose such a path; check anyway
                    raise AssertionError(f"route {s}->{d} crosses a dead core or link at {a}->{b}")
                self.link_wavelets[(a, b)] = self.link_wavelets.get((a, b), 0) + n_wavelets
            self.touched.update(path)
        return data.copy()

    def shift(self, buf: np.ndarray, axis: int, step: int, index: int) -> np.ndarray:
        """Move the slice at `index` along `axis` (0: down columns, 1: along rows) to `index + step`, for all
        PEs of the other axis at once. Returns the arriving slice (shape of buf's slice)."""
        if axis == 0:  # every column present in buf
            js = range(buf.shape[1])
            return self.move(buf[index], [(index, j) for j in js], [(index + step, j) for j in js])
        is_ = range(buf.shape[0])
        return self.move(buf[:, index], [(i, index) for i in is_], [(i, index + step) for i in is_])

    def result(self, out: np.ndarray) -> TileRun:
        return TileRun(out=out, rows=self.rows, cols=self.cols, sram_bytes_per_pe=self.bytes_per_pe,
                       max_link_wavelets=max(self.link_wavelets.values(), default=0),
                       link_wavelets=dict(self.link_wavelets), touched=frozenset(self.touched))


def to_tiles(a: np.ndarray, parts: int, tile: int) -> np.ndarray:
    """Pad the first axis of `a` to parts*tile and split it: shape (parts, tile, ...)."""
    pad = parts * tile - a.shape[0]
    if pad < 0:
        raise ValueError("tile too small")
    a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), dtype=a.dtype)]) if pad else a
    return a.reshape(parts, tile, *a.shape[1:])


def region_for(mesh: Mesh, rows: int | None, cols: int | None, m: int, k: int) -> tuple[int, int]:
    """The region a kernel uses for an (m along rows) x (k along cols) problem (m, k > 0, checked by the
    kernels): no PE gets an empty tile."""
    rows, cols = mesh.check_region(rows, cols)
    return used(m, rows), used(k, cols)
