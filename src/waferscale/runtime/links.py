"""Links: where a streaming engine's weights come from and where its gradients go. One protocol:

    fetch(u) -> (matrices, vectors)     unit u's payload on the engine's device (called on the prefetch lane,
                                        in the schedule's fetch order)
    push(u, matrices, vectors) -> Future   unit u's fp32 gradients, taken asynchronously

`LocalLink` serves MemoryX in this process, `SwarmLink` SwarmX's broadcast and reduce. A unit with masked
matrices travels packed (its kept values and a bitmask, `sparse_stream.py`) and is expanded on the device; its
gradients travel as the kept values (dense on the steps the sparsity algorithm asks for them). A CPU device
beside MemoryX computes from its masters instead, sparse or dense (no copy). `stats` counts the bytes each
link's protocol carries, copied or not: `bytes_streamed` (weights and index) and `bytes_reduced` (gradients).
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from waferscale.runtime.cluster import Cluster, LinkError
from waferscale.runtime.lane import Lane
from waferscale.runtime.layout import UnitLayout
from waferscale.runtime.memoryx import MemoryX
from waferscale.runtime.sparse_stream import PackedUnit, expand
from waferscale.sparse.masks import unpack_bits

__all__ = ["LocalLink", "SwarmLink"]


class _Counted:
    def __init__(self) -> None:
        self.stats = {"bytes_streamed": 0, "bytes_reduced": 0}

    def take_stats(self) -> dict[str, int]:
        s, self.stats = self.stats, {"bytes_streamed": 0, "bytes_reduced": 0}
        return s


class LocalLink(_Counted):
    """MemoryX in this process. On a CPU device the payload is MemoryX's fp32 masters themselves where they are
    the payload (no copy), for a masked unit too (the masters are zero where masked: `memoryx.py`), and the
    gradients go to MemoryX as computed (it zeroes the masked ones as it writes them); on CUDA, pinned staging
    buffers and one copy stream per direction, a masked unit packed. The counters count what the link's
    protocol carries for each unit whether or not anything is copied: the dense or packed payload, the dense
    or kept gradients."""

    def __init__(self, memoryx: MemoryX, device: torch.device) -> None:
        super().__init__()
        self.mx, self.device = memoryx, device
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.h2d = torch.cuda.Stream(device)
            self.d2h = torch.cuda.Stream(device)
            self._writer = Lane("grad-writeback")

    def fetch(self, u: int) -> tuple[Tensor, Tensor]:
        lay, sparse = self.mx.layouts[u], u in self.mx.unit_masks
        if sparse:
            self.stats["bytes_streamed"] += self.mx.unit_masks.packed_nbytes(u, self.mx.stream_dtype.itemsize)
        else:
            self.stats["bytes_streamed"] += lay.payload_bytes(self.mx.stream_dtype.itemsize)
        if not self.cuda:  # the device is host memory: the masters themselves where they are the payload,
            return self.mx.fetch_view(u) or self.mx.fetch(u)  # else a copy (and cast) out of them
        if sparse:
            return self._fetch_packed(u)
        hm = torch.empty(lay.n_matrices, dtype=self.mx.stream_dtype, pin_memory=True)
        hv = torch.empty(lay.n_vectors, dtype=torch.float32, pin_memory=True)
        self.mx.fetch(u, hm, hv)
        with torch.cuda.stream(self.h2d):
            matrices = hm.to(self.device, non_blocking=True)
            vectors = hv.to(self.device, non_blocking=True)
        self.h2d.synchronize()  # this runs on the prefetch thread; the pinned buffers may now go
        return matrices, vectors

    def _fetch_packed(self, u: int) -> tuple[Tensor, Tensor]:
        p = self.mx.fetch_packed(u)
        staged = [t.pin_memory() for t in (p.values, p.bits, p.vectors)]
        with torch.cuda.stream(self.h2d):
            values, bits, vectors = (t.to(self.device, non_blocking=True) for t in staged)
            matrices = expand(values, unpack_bits(bits, self.mx.layouts[u].n_matrices))
        self.h2d.synchronize()
        return matrices, vectors

    def push(self, u: int, matrices: Tensor, vectors: Tensor, absent: frozenset[int] = frozenset()) -> Future:
        """Unit u's gradients to MemoryX; `absent`: its entries that got no gradient (zeros in the payload)."""
        index = self.mx.unit_masks.index.get(u) if not self.mx.dense_grads() else None
        if not self.cuda:  # MemoryX takes the device's gradients as they are and zeroes the masked ones
            self.stats["bytes_reduced"] += (self.mx.unit_masks.grad_nbytes(u) if index is not None
                                            else matrices.nbytes + vectors.nbytes)
            return self.mx.push_grads(u, matrices, vectors, absent)
        if index is not None:  # the kept gradients only
            matrices = matrices.index_select(0, index.to(matrices.device, non_blocking=True))
        self.stats["bytes_reduced"] += matrices.nbytes + vectors.nbytes
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        hm = torch.empty(matrices.shape, dtype=matrices.dtype, pin_memory=True)
        hv = torch.empty(vectors.shape, dtype=vectors.dtype, pin_memory=True)
        with torch.cuda.stream(self.d2h):
            self.d2h.wait_event(ev)
            hm.copy_(matrices, non_blocking=True)
            hv.copy_(vectors, non_blocking=True)
            matrices.record_stream(self.d2h)
            vectors.record_stream(self.d2h)
            done = torch.cuda.Event()
            done.record(self.d2h)

        def hand_over() -> None:
            done.synchronize()
            self.mx.push_grads(u, hm, hv, absent).result()

        return self._writer.submit(hand_over)

    def close(self) -> None:
        if self.cuda:
            self._writer.close()


class SwarmLink(_Counted):
    """Weights by broadcast from rank 0's MemoryX, gradients by reduce (sum) to it, per unit, over the cluster's
    link groups; the same class on every rank (only rank 0 holds MemoryX). `mean`: rank 0 divides the sum by the
    number of ranks (each rank's loss was its own batch's mean) before MemoryX takes it. A failed collective raises
    LinkError (from `fetch`, or through the push's future); the caller's `cluster.guard` names the rank that caused
    it. `sparse_units`: the units with masked matrices, the same set on every rank (packed units carry a small
    header first: the number of kept values and whether gradients come back dense). Rank 0 on a CPU device
    computes a packed unit from MemoryX's masters; the others expand it, unpacking its bitmask again only when
    it changed."""

    def __init__(self, cluster: Cluster, layouts: list[UnitLayout], stream_dtype: torch.dtype, device: torch.device,
                 memoryx: MemoryX | None = None, *, mean: bool = False, sparse_units: set[int] | None = None) -> None:
        super().__init__()
        self.cluster, self.layouts, self.stream_dtype, self.device = cluster, layouts, stream_dtype, device
        self.mx, self.mean = memoryx, mean
        self.sparse_units = set(sparse_units or ())
        self._index: dict[int, Tensor | None] = {}  # per sparse unit, from its last fetch: the kept gradients
        self._unpacked: dict[int, tuple[Tensor, Tensor, Tensor]] = {}  # unit -> (bits, keep, index), ranks > 0
        self._lane = Lane("swarmx-grads")

    def _bcast(self, u: int, *ts: Tensor) -> None:
        try:
            for t in ts:
                if t.numel():
                    dist.broadcast(t, 0, group=self.cluster.g_weights)
        except RuntimeError as e:
            raise LinkError(f"broadcasting the weights of unit {u}: {e}") from e
        self.stats["bytes_streamed"] += sum(t.nbytes for t in ts)

    def _fetch_packed(self, u: int) -> tuple[Tensor, Tensor]:
        lay = self.layouts[u]
        if self.mx is not None:
            p = self.mx.fetch_packed(u)
            header = torch.tensor([p.values.numel(), int(p.dense_grads)])
        else:
            header = torch.empty(2, dtype=torch.int64)
        self._bcast(u, header)
        if self.mx is None:
            p = PackedUnit(torch.empty(int(header[0]), dtype=self.stream_dtype),
                           torch.empty((lay.n_matrices + 7) // 8, dtype=torch.uint8),
                           torch.empty(lay.n_vectors, dtype=torch.float32), bool(header[1]))
        self._bcast(u, p.bits, p.values, p.vectors)
        if self.mx is None:
            keep, index = self._unpack(u, p.bits)
            self._index[u] = None if p.dense_grads else index
        else:
            keep, index = self.mx.unit_masks.keep[u], self.mx.unit_masks.index[u]
            view = self.mx.fetch_view(u) if self.device.type == "cpu" else None
            if view is not None:  # rank 0 computes from the masters, zero where masked (memoryx.py)
                return view
        if self.device.type == "cpu":
            return expand(p.values, keep, index), p.vectors
        return expand(p.values.to(self.device), keep), p.vectors.to(self.device)

    def _unpack(self, u: int, bits: Tensor) -> tuple[Tensor, Tensor]:
        """Unit u's mask and kept positions from its bitmask, unpacked again only when the mask changed."""
        last = self._unpacked.get(u)
        if last is None or not torch.equal(last[0], bits):
            keep = unpack_bits(bits, self.layouts[u].n_matrices)
            last = self._unpacked[u] = (bits, keep, keep.nonzero().squeeze(1))
        return last[1], last[2]

    def _grad_index(self, u: int) -> Tensor | None:
        """The kept positions of unit u's gradients this step (None: dense). Rank 0 knows them before its fetch
        of u (its zeros may go into the reduce first); the others from their fetch, which comes before their
        push."""
        if u not in self.sparse_units:
            return None
        if self.mx is not None:
            return None if self.mx.dense_grads() else self.mx.unit_masks.index[u]
        return self._index[u]

    def fetch(self, u: int) -> tuple[Tensor, Tensor]:
        if u in self.sparse_units:
            return self._fetch_packed(u)
        if self.mx is not None:
            matrices, vectors = self.mx.fetch(u)
        else:
            lay = self.layouts[u]
            matrices = torch.empty(lay.n_matrices, dtype=self.stream_dtype)
            vectors = torch.empty(lay.n_vectors, dtype=torch.float32)
        self._bcast(u, matrices, vectors)
        if self.device.type == "cuda":
            return matrices.to(self.device), vectors.to(self.device)
        return matrices, vectors

    def push(self, u: int, matrices: Tensor, vectors: Tensor, absent: frozenset[int] = frozenset()) -> Future:
        """Unit u's gradients into the reduce; `absent`: its entries that got no gradient on this rank."""
        index = self._grad_index(u)
        if index is not None:
            matrices = matrices.index_select(0, index.to(matrices.device))
        got = torch.tensor([i not in absent for i in range(len(self.layouts[u].entries))], dtype=torch.float32)
        return self._lane.submit(self._send, u, lambda: (matrices.cpu(), vectors.cpu(), got))

    def push_zeros(self, u: int) -> Future:
        """Rank 0's share of unit u's reduce when it computes no gradients itself (the zoo's MemoryX rank); the
        zeros are made when the reduce runs, one unit at a time."""
        lay, index = self.layouts[u], self._grad_index(u)
        n = index.numel() if index is not None else lay.n_matrices
        return self._lane.submit(self._send, u, lambda: (torch.zeros(n), torch.zeros(lay.n_vectors),
                                                         torch.zeros(len(lay.entries))))

    def _send(self, u: int, make: Any) -> None:
        """Unit u's reduce (on this link's lane, in push order); rank 0 hands the sum to MemoryX, whose own lane
        accumulates it while the next unit's reduce runs (MemoryX.end_backward waits for it). Beside the
        gradients, per entry the number of ranks that computed one: an entry none did is absent."""
        m, v, got = make()
        try:
            for t in (m, v, got):
                if t.numel():
                    dist.reduce(t, 0, op=dist.ReduceOp.SUM, group=self.cluster.g_grads)
        except RuntimeError as e:
            raise LinkError(f"reducing the gradients of unit {u}: {e}") from e
        self.stats["bytes_reduced"] += m.nbytes + v.nbytes
        if self.mx is not None:
            if self.mean:
                m.div_(self.cluster.world)
                v.div_(self.cluster.world)
            self.mx.push_grads(u, m, v, frozenset(torch.nonzero(got == 0).flatten().tolist()))

    def close(self) -> None:
        self._lane.close(0 if self.cluster.failure is not None else 10.0)
