"""The functional core map of one wafer: dead cores, dead links, spare remapping and routes around defects.

Fabric row of WSE.md: "wafers are made with spare cores and redundant links; a post-fabrication test maps every
defective core and link; the compiler receives the functional core map and routes around defects" (A/V).

Redundancy scheme (simple and sound, not Cerebras' exact one, which is unpublished):

* Every physical row keeps `spare_cols` cores in reserve. Logical column c of a row is the c-th *live* core of
  that physical row, so dead cores are skipped and the row still offers `logical_cols = cols - spare_cols`
  PEs. A row with more dead cores than spares cannot be repaired and is skipped whole.
* `spare_rows` caps the logical rows at `rows - spare_rows`; the logical rows are the first repairable
  physical rows, in order.
* `spare_cols=None` picks the spare budget that maximises usable PEs for this defect map (what a vendor would
  fuse after wafer test); `spare_rows=None` reserves no rows.

The compiler therefore sees a perfect `logical_rows x logical_cols` mesh; `physical(r, c)` maps into the wafer
and never lands on a dead core. Logical neighbours can be more than one physical hop apart (a skipped dead core,
a skipped row, a dead link): `route()` returns the physical path and `hops()` its length, and the cost model and
the event simulation both charge those extra hops.

Routing: dimension-ordered XY; if that path touches a dead core or a dead link, YX; if that is blocked too, a
shortest detour found by breadth-first search in a growing window. A route never enters a dead core or crosses
a dead link. Routers of *live* cores in skipped rows/columns still forward traffic.

Defect file (JSON, written by `save_defects`):

    {"format": "waferscale-defects/1", "rows": 8, "cols": 8,
     "dead_cores": [[r, c], ...],                  # physical coordinates
     "dead_links": [[r, c, "E"], [r, c, "S"], ...]} # the link from (r, c) to its East / South / West / North
                                                     # neighbour; a dead link is dead in both directions
"""

from __future__ import annotations

import json
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from waferscale.errors import ConfigError
from waferscale.fabric.spec import FabricSpec
from waferscale.util.files import atomic_write_json

Coord = tuple[int, int]
DEFECT_FORMAT = "waferscale-defects/1"
_DIRS = {"E": (0, 1), "W": (0, -1), "S": (1, 0), "N": (-1, 0)}


@dataclass(frozen=True, eq=False)
class Mesh:
    """A physical `spec.rows x spec.cols` fabric with its defect map and the logical mesh carved out of it.

    dead_cores:  bool (rows, cols) — True where the core failed test (never placed on, never routed through).
    dead_east:   bool (rows, cols-1) — link (r, c) <-> (r, c+1) is dead.
    dead_south:  bool (rows-1, cols) — link (r, c) <-> (r+1, c) is dead.
    phys_rows:   int (logical_rows,) — the physical row of each logical row.
    phys_cols:   int (logical_rows, logical_cols) — the physical column of each logical PE.
    """

    spec: FabricSpec
    dead_cores: np.ndarray
    dead_east: np.ndarray
    dead_south: np.ndarray
    phys_rows: np.ndarray
    phys_cols: np.ndarray
    spare_rows: int
    spare_cols: int
    _routes: dict = field(default_factory=dict, repr=False)
    _prefix: dict = field(default_factory=dict, repr=False)  # wafer-wide prefix sums, shared with subregions

    # ---- construction ----------------------------------------------------------------------------------
    @classmethod
    def build(cls, spec: FabricSpec, defect_rate: float = 0.0, seed: int = 0, clustered: bool = False,
              defect_file: str | os.PathLike | None = None, spare_rows: int | None = None,
              spare_cols: int | None = None, n_clusters: int = 3) -> "Mesh":
        """Make the core map: random defects at `defect_rate` (per core and per link), `clustered` blobs of
        the same total size (links still fail at random), or the defects in `defect_file`."""
        if not 0.0 <= defect_rate < 1.0:
            raise ConfigError(f"--defects must be in [0, 1), got {defect_rate}")
        R, C = spec.rows, spec.cols
        if defect_file is not None:
            dead, de, ds = _load_defects(Path(defect_file), R, C)
        else:
            rng = np.random.default_rng(seed)
            if clustered and defect_rate > 0:
                dead = _clustered(rng, R, C, round(defect_rate * R * C), n_clusters)
            else:
                dead = rng.random((R, C)) < defect_rate
            de = rng.random((R, max(C - 1, 0))) < defect_rate
            ds = rng.random((max(R - 1, 0), C)) < defect_rate
        return cls._carve(spec, dead, de, ds, spare_rows, spare_cols)

    @classmethod
    def perfect(cls, spec: FabricSpec) -> "Mesh":
        return cls.build(spec)

    @classmethod
    def _carve(cls, spec, dead, de, ds, spare_rows, spare_cols) -> "Mesh":
        unusable = dead | _unreachable(dead, de, ds)  # live cores cut off from the rest count as lost
        R, C = dead.shape
        for name, v, hi in (("spare_rows", spare_rows, R), ("spare_cols", spare_cols, C)):
            if v is not None and not 0 <= v < hi:
                raise ConfigError(f"{name} must be in [0, {hi}), got {v}")
        dead_per_row = unusable.sum(axis=1)
        max_rows = R - (spare_rows or 0)
        if spare_cols is None:  # the spare budget that maximises usable PEs: (C - s) * min(good_rows(s), max_rows)
            s = np.arange(C)
            good = np.searchsorted(np.sort(dead_per_row), s, side="right")
            spare_cols = int(np.argmax((C - s) * np.minimum(good, max_rows)))
        good_rows = np.flatnonzero(dead_per_row <= spare_cols)[:max_rows]
        if good_rows.size == 0:
            raise ConfigError(f"no repairable row: every row has more than {spare_cols} dead cores; "
                              f"lower --defects or allow more spare columns")
        lc = C - spare_cols
        order = np.argsort(unusable[good_rows], axis=1, kind="stable")  # usable columns first, in order
        phys_cols = order[:, :lc].astype(np.int32)
        for a in (dead, de, ds, good_rows, phys_cols):
            a.setflags(write=False)
        return cls(spec, dead, de, ds, good_rows.astype(np.int32), phys_cols, R - good_rows.size if spare_rows is None
                   else spare_rows, spare_cols)

    # ---- the logical mesh ------------------------------------------------------------------------------
    @property
    def logical_rows(self) -> int:
        return int(self.phys_cols.shape[0])

    @property
    def logical_cols(self) -> int:
        return int(self.phys_cols.shape[1])

    @property
    def usable_pes(self) -> int:
        return self.logical_rows * self.logical_cols

    @property
    def n_dead_cores(self) -> int:
        if "dead_cores" not in self._prefix:  # the wafer's arrays are read-only: count once, share with subregions
            self._prefix["dead_cores"] = int(self.dead_cores.sum())
        return self._prefix["dead_cores"]

    @property
    def n_dead_links(self) -> int:
        if "dead_links" not in self._prefix:
            self._prefix["dead_links"] = int(self.dead_east.sum() + self.dead_south.sum())
        return self._prefix["dead_links"]

    @property
    def has_defects(self) -> bool:
        return bool(self.n_dead_cores or self.n_dead_links)

    def physical(self, r: int, c: int) -> Coord:
        """Physical (row, col) of logical PE (r, c)."""
        if not (0 <= r < self.logical_rows and 0 <= c < self.logical_cols):
            raise ConfigError(f"logical PE ({r}, {c}) outside the {self.logical_rows}x{self.logical_cols} mesh")
        return int(self.phys_rows[r]), int(self.phys_cols[r, c])

    def physical_grid(self, rows: int | None = None, cols: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(prow, pcol) int arrays of shape (rows, cols): the physical coordinates of a logical region."""
        rows, cols = self.check_region(rows, cols)
        pr = np.broadcast_to(self.phys_rows[:rows, None], (rows, cols))
        return pr, self.phys_cols[:rows, :cols]

    def check_region(self, rows: int | None, cols: int | None) -> tuple[int, int]:
        rows = self.logical_rows if rows is None else rows
        cols = self.logical_cols if cols is None else cols
        if rows <= 0 or cols <= 0:
            raise ConfigError(f"a region needs at least 1x1 PEs, got {rows}x{cols}")
        if rows > self.logical_rows or cols > self.logical_cols:
            raise ConfigError(f"region {rows}x{cols} exceeds the usable {self.logical_rows}x{self.logical_cols} "
                              f"logical mesh ({self.n_dead_cores} dead cores); use a smaller region or --pes")
        return rows, cols

    # ---- links and routes ------------------------------------------------------------------------------
    def link_ok(self, a: Coord, b: Coord) -> bool:
        """Physical neighbours a -> b usable: both cores live and the link between them not dead."""
        (r0, c0), (r1, c1) = a, b
        R, C = self.dead_cores.shape
        if not (0 <= r1 < R and 0 <= c1 < C) or self.dead_cores[r1, c1] or self.dead_cores[r0, c0]:
            return False
        if r0 == r1 and abs(c0 - c1) == 1:
            return not self.dead_east[r0, min(c0, c1)]
        if c0 == c1 and abs(r0 - r1) == 1:
            return not self.dead_south[min(r0, r1), c0]
        return False

    def route(self, src: Coord, dst: Coord) -> list[Coord]:
        """Physical path (list of physical (row, col), both ends included) from logical `src` to logical `dst`."""
        key = (tuple(src), tuple(dst))
        if key not in self._routes:
            self._routes[key] = self.route_physical(self.physical(*src), self.physical(*dst))
        return self._routes[key]

    def hops(self, src: Coord, dst: Coord) -> int:
        """Physical hops of the route between two logical PEs (detours included)."""
        return len(self.route(src, dst)) - 1

    def route_physical(self, a: Coord, b: Coord) -> list[Coord]:
        for path in (_xy(a, b), _xy(a, b, y_first=True)):
            if all(self.link_ok(p, q) for p, q in zip(path, path[1:])):
                return path
        R, C = self.dead_cores.shape
        for margin in (2, 8, max(R, C)):
            box = (max(0, min(a[0], b[0]) - margin), min(R - 1, max(a[0], b[0]) + margin),
                   max(0, min(a[1], b[1]) - margin), min(C - 1, max(a[1], b[1]) + margin))
            path = self._bfs(a, b, box)
            if path:
                return path
        raise ConfigError(f"no live route from physical {a} to {b}: the defect map cuts the fabric; "
                          f"lower --defects or change --seed")

    def _bfs(self, a: Coord, b: Coord, box: tuple[int, int, int, int]) -> list[Coord] | None:
        r_lo, r_hi, c_lo, c_hi = box
        prev: dict[Coord, Coord | None] = {a: None}
        todo = deque([a])
        while todo:
            p = todo.popleft()
            if p == b:
                path = [p]
                while prev[path[-1]] is not None:
                    path.append(prev[path[-1]])
                return path[::-1]
            for dr, dc in _DIRS.values():
                q = (p[0] + dr, p[1] + dc)
                if q not in prev and r_lo <= q[0] <= r_hi and c_lo <= q[1] <= c_hi and self.link_ok(p, q):
                    prev[q] = p
                    todo.append(q)
        return None

    def chain_hops(self, rows: int, cols: int, axis: int) -> np.ndarray:
        """Physical hops of every link of the chains of logical neighbours: along rows (axis=1: shape
        (rows, cols-1), entry [i, j] = hops of the route (i, j+1) -> (i, j), West-bound) or down columns
        (axis=0: shape (rows-1, cols), entry [i, j] = hops of (i, j) -> (i+1, j)). Exact routes when this
        (logical) mesh has up to 64x64 PEs; bigger meshes: Manhattan distance plus the 2-hop detour a blocked
        straight segment costs (a dead core skipped between two logical neighbours, or a dead link on the way).
        A Mesh of one region is `Mesh.subregion`."""
        rows, cols = self.check_region(rows, cols)
        shape = (rows, cols - 1) if axis == 1 else (rows - 1, cols)
        if not self.has_defects:
            return np.ones(shape, dtype=np.int64)
        return self._whole_chain_hops(axis)[:shape[0], :shape[1]]

    def _whole_chain_hops(self, axis: int) -> np.ndarray:
        """`chain_hops` of the whole logical mesh, computed once: a region at the origin is a slice of it."""
        key = ("chain_hops", axis)
        if key not in self._routes:
            self._routes[key] = self._chain_hops(axis)
            self._routes[key].setflags(write=False)
        return self._routes[key]

    def chain_hops_cumulative(self, rows: int, cols: int, axis: int) -> np.ndarray:
        """(rows, cols): physical hops from logical PE (i, j) to the chain's start along the axis — to (i, 0)
        going West (axis=1) or up to (0, j) (axis=0): the cumulative sum of `chain_hops`."""
        rows, cols = self.check_region(rows, cols)
        key = ("chain_cum", axis)
        if key not in self._routes:
            self._routes[key] = _cumsum0(self._whole_chain_hops(axis), axis)
            self._routes[key].setflags(write=False)
        return self._routes[key][:rows, :cols]

    def _chain_hops(self, axis: int) -> np.ndarray:
        if self.usable_pes <= 4096:
            R, C = self.logical_rows, self.logical_cols
            out = np.empty((R, C - 1) if axis == 1 else (R - 1, C), dtype=np.int64)
            for i in range(out.shape[0]):
                for j in range(out.shape[1]):
                    out[i, j] = self.hops((i, j + 1), (i, j)) if axis == 1 else self.hops((i, j), (i + 1, j))
            return out
        pr, pc = self.physical_grid()
        pr, pc = pr.astype(np.int64), pc.astype(np.int64)
        core_r, link_e, core_c, link_s = self._prefix_sums()
        if axis == 1:  # same physical row: blocked if a dead core or a dead East link lies between the two PEs
            r = pr[:, 1:]
            lo, hi = pc[:, :-1], pc[:, 1:]
            blocked = (core_r[r, hi] - core_r[r, lo + 1] > 0) | (link_e[r, hi] - link_e[r, lo] > 0)
            return (hi - lo) + 2 * blocked
        # down a column: different physical rows (skipped rows between) and possibly shifted columns
        manhattan = np.abs(np.diff(pr, axis=0)) + np.abs(np.diff(pc, axis=0))
        top, bot, c = pr[:-1], pr[1:], pc[1:]  # XY route: along row `top` to column c, then down column c
        lo, hi = np.minimum(pc[:-1], c), np.maximum(pc[:-1], c)
        xy = ((core_r[top, hi + 1] - core_r[top, lo] > 0) | (link_e[top, hi] - link_e[top, lo] > 0)
              | (core_c[bot + 1, c] - core_c[top + 1, c] > 0) | (link_s[bot, c] - link_s[top, c] > 0))
        c0 = pc[:-1]  # YX route: down column c0 to row `bot`, then along row `bot` to column c
        yx = ((core_c[bot + 1, c0] - core_c[top + 1, c0] > 0) | (link_s[bot, c0] - link_s[top, c0] > 0)
              | (core_r[bot, hi + 1] - core_r[bot, lo] > 0) | (link_e[bot, hi] - link_e[bot, lo] > 0))
        return manhattan + 2 * (xy & yx)

    def _prefix_sums(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Exclusive prefix sums of dead cores along rows / columns and of dead East / South links."""
        if "sums" not in self._prefix:
            self._prefix["sums"] = (_cumsum0(self.dead_cores, 1), _cumsum0(self.dead_east, 1),
                                    _cumsum0(self.dead_cores, 0), _cumsum0(self.dead_south, 0))
        return self._prefix["sums"]

    def max_chain_hops(self, rows: int, cols: int, axis: int) -> int:
        """Longest physical path over a chain of logical neighbours: along rows (axis=1, one chain per row,
        West<-East) or down columns (axis=0, one chain per column). Equals cols-1 / rows-1 without defects."""
        rows, cols = self.check_region(rows, cols)
        if not self.has_defects:
            return cols - 1 if axis == 1 else rows - 1
        return int(self.chain_hops(rows, cols, axis).sum(axis=axis).max(initial=0))

    def subregion(self, row: int, col: int, rows: int, cols: int) -> "Mesh":
        """The logical rectangle at (row, col) of size rows x cols as a Mesh of its own (same wafer, same
        defects, logical (0, 0) = this mesh's (row, col)), so cost models charge that region's real routes."""
        if row < 0 or col < 0:
            raise ConfigError(f"region origin must be non-negative, got ({row}, {col})")
        self.check_region(row + rows, col + cols)
        if (row, col, rows, cols) == (0, 0, self.logical_rows, self.logical_cols):
            return self
        return Mesh(self.spec, self.dead_cores, self.dead_east, self.dead_south,
                    self.phys_rows[row:row + rows], self.phys_cols[row:row + rows, col:col + cols],
                    self.spare_rows, self.spare_cols, _prefix=self._prefix)

    def multicast_tree(self, pes: list[Coord], branches: list[list[Coord]] = ()) -> tuple[dict, dict]:
        """The router configuration of one multicast color: the routes through logical `pes` in order, plus
        branch chains starting at one of them, merged into a tree (a router reached twice keeps its first
        parent, so there is never a loop). Returns (children: physical node -> list of next physical nodes,
        deliver: physical node -> logical PE it delivers to), delivering at every listed PE but the first."""
        children: dict = {}
        deliver: dict = {}
        seen = {self.physical(*pes[0])}
        for chain in [pes, *branches]:
            for a, b in zip(chain, chain[1:]):
                path = self.route(a, b)
                for p, q in zip(path, path[1:]):
                    if q not in seen:
                        seen.add(q)
                        children.setdefault(p, []).append(q)
                deliver[self.physical(*b)] = b
        return children, deliver

    @staticmethod
    def tree_depths(tree: tuple[dict, dict], root: Coord) -> dict:
        """Hops from the physical `root` to every node of a multicast tree (physical node -> depth)."""
        children, _ = tree
        depth, todo = {root: 0}, [root]
        while todo:
            v = todo.pop()
            for q in children.get(v, ()):
                depth[q] = depth[v] + 1
                todo.append(q)
        return depth

    @staticmethod
    def tree_depth(tree: tuple[dict, dict], root: Coord) -> int:
        """Hops from the physical `root` to the farthest delivering node of a multicast tree."""
        depth = Mesh.tree_depths(tree, root)
        return max((depth[v] for v in tree[1] if v in depth), default=0)

    # ---- defect files ----------------------------------------------------------------------------------
    def save_defects(self, path: str | os.PathLike) -> Path:
        """Write the defect map (format in the module docstring) atomically."""
        R, C = self.dead_cores.shape
        return atomic_write_json(path, {
            "format": DEFECT_FORMAT, "rows": int(R), "cols": int(C),
            "dead_cores": np.argwhere(self.dead_cores).tolist(),
            "dead_links": [[int(r), int(c), "E"] for r, c in np.argwhere(self.dead_east)]
            + [[int(r), int(c), "S"] for r, c in np.argwhere(self.dead_south)]})

    def summary(self) -> str:
        R, C = self.dead_cores.shape
        return (f"{R}x{C} physical, {self.n_dead_cores} dead cores, {self.n_dead_links} dead links, "
                f"spares {self.spare_rows} rows / {self.spare_cols} cols -> "
                f"{self.logical_rows}x{self.logical_cols} logical = {self.usable_pes} usable PEs")


# ---- helpers --------------------------------------------------------------------------------------------
def _cumsum0(a: np.ndarray, axis: int) -> np.ndarray:
    """Exclusive prefix sum along `axis` (int64, one longer than `a` there): entry k sums the first k."""
    pad = [(0, 0)] * a.ndim
    pad[axis] = (1, 0)
    return np.cumsum(np.pad(a, pad), axis=axis, dtype=np.int64)


def _xy(a: Coord, b: Coord, y_first: bool = False) -> list[Coord]:
    (r0, c0), (r1, c1) = a, b
    dr, dc = (1 if r1 > r0 else -1), (1 if c1 > c0 else -1)
    if y_first:  # down column c0 to row r1, then along row r1
        return [(r, c0) for r in range(r0, r1 + dr, dr)] + [(r1, c) for c in range(c0 + dc, c1 + dc, dc)]
    return [(r0, c) for c in range(c0, c1 + dc, dc)] + [(r, c1) for r in range(r0 + dr, r1 + dr, dr)]


def _clustered(rng: np.random.Generator, R: int, C: int, n_dead: int, n_clusters: int) -> np.ndarray:
    """`n_dead` dead cores in a few irregular blobs: the cores nearest to random centres (with jitter) die."""
    centres = rng.random((max(1, n_clusters), 2)) * [R, C]
    rr, cc = np.mgrid[0:R, 0:C]
    d = np.min(np.hypot(rr[..., None] - centres[:, 0], cc[..., None] - centres[:, 1]), axis=-1)
    d = d + rng.random((R, C)) * 1.5  # ragged edges
    dead = np.zeros(R * C, dtype=bool)
    dead[np.argsort(d, axis=None)[:n_dead]] = True
    return dead.reshape(R, C)


def _unreachable(dead: np.ndarray, de: np.ndarray, ds: np.ndarray) -> np.ndarray:
    """Live cores that cannot reach the largest connected group of live cores. Exact (breadth-first search)
    up to 2^16 cores; on bigger fabrics only cores with no usable link at all are caught (an island of several
    cores is then reported by `route` when something is placed on it)."""
    iso = _isolated(dead, de, ds)
    R, C = dead.shape
    if R * C > 1 << 16 or not (dead.any() or de.any() or ds.any()):
        return iso
    alive = ~dead
    label = np.full((R, C), -1, dtype=np.int64)
    sizes = []
    for start in zip(*np.nonzero(alive)):
        if label[start] >= 0:
            continue
        lab, todo, n = len(sizes), [start], 0
        label[start] = lab
        while todo:
            r, c = todo.pop()
            n += 1
            for r1, c1, ok in ((r, c + 1, c + 1 < C and not de[r, c]), (r, c - 1, c > 0 and not de[r, c - 1]),
                               (r + 1, c, r + 1 < R and not ds[r, c]), (r - 1, c, r > 0 and not ds[r - 1, c])):
                if ok and alive[r1, c1] and label[r1, c1] < 0:
                    label[r1, c1] = lab
                    todo.append((r1, c1))
        sizes.append(n)
    return alive & (label != int(np.argmax(sizes))) if sizes else iso


def _isolated(dead: np.ndarray, de: np.ndarray, ds: np.ndarray) -> np.ndarray:
    """Live cores with no usable link to any live neighbour (they could never talk to the mesh)."""
    R, C = dead.shape
    ok = np.zeros((R, C), dtype=bool)
    if C > 1:
        e = ~de & ~dead[:, 1:] & ~dead[:, :-1]
        ok[:, :-1] |= e
        ok[:, 1:] |= e
    if R > 1:
        s = ~ds & ~dead[1:, :] & ~dead[:-1, :]
        ok[:-1, :] |= s
        ok[1:, :] |= s
    return ~dead & ~ok if R * C > 1 else np.zeros_like(dead)


def _load_defects(path: Path, R: int, C: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"defect file {path} not found") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"defect file {path} is not JSON ({e}); expected format {DEFECT_FORMAT}") from None
    if not isinstance(d, dict) or d.get("format") != DEFECT_FORMAT:
        raise ConfigError(f"defect file {path}: expected {{\"format\": \"{DEFECT_FORMAT}\", ...}}")
    if (d.get("rows"), d.get("cols")) != (R, C):
        raise ConfigError(f"defect file {path} is for a {d.get('rows')}x{d.get('cols')} fabric, target is {R}x{C}")
    dead = np.zeros((R, C), dtype=bool)
    de = np.zeros((R, max(C - 1, 0)), dtype=bool)
    ds = np.zeros((max(R - 1, 0), C), dtype=bool)
    for rc in d.get("dead_cores", []):
        r, c = _in(path, rc, R, C)
        dead[r, c] = True
    for link in d.get("dead_links", []):
        if not (isinstance(link, list) and len(link) == 3 and link[2] in _DIRS):
            raise ConfigError(f"defect file {path}: bad dead link {link!r}; use [row, col, \"E\"|\"S\"|\"W\"|\"N\"]")
        r, c = _in(path, link[:2], R, C)
        dr, dc = _DIRS[link[2]]
        r1, c1 = _in(path, [r + dr, c + dc], R, C)
        if dr == 0:
            de[r, min(c, c1)] = True
        else:
            ds[min(r, r1), c] = True
    return dead, de, ds


def _in(path: Path, rc, R: int, C: int) -> Coord:
    if not (isinstance(rc, list) and len(rc) == 2 and all(isinstance(v, int) for v in rc)
            and 0 <= rc[0] < R and 0 <= rc[1] < C):
        raise ConfigError(f"defect file {path}: coordinate {rc!r} is not [row, col] inside {R}x{C}")
    return rc[0], rc[1]
