"""Sparse payloads: what a link moves for a unit whose weights are masked.

A unit's matrices payload (layout.py) becomes its kept values (in the stream dtype, payload order) plus a
bitmask over the whole payload, one bit per element (`sparse.masks.pack_bits`). The bitmask, not CSR: at
half precision a value is 16 bits, so the bitmask's overhead is 1/16 of the dense bytes at any density, where
CSR's 16-bit column indices cost 16 bits per kept value and are larger than the bitmask above a density of
1/16; and a bitmask is expanded with one masked scatter on any device. Vectors (biases, norms) stay dense.

Gradients come back as the kept values only, in the same order: both ends know the mask of the step (the
device got it with the weights), so no index travels back. On the steps where an algorithm needs the dense
gradient (RigL's update steps) the gradient comes back dense.

A CPU device in MemoryX's process computes from MemoryX's masters, which are zero where masked
(`memoryx.py`), as a dense unit does. Through `LocalLink` nothing is packed: the gradients go over as
computed and MemoryX zeroes the masked ones as it writes them (`kept_only`), and the link's byte counters
still count what its protocol carries for the unit (the packed bytes in, the kept gradients out), as the
dense path counts its payload bytes although nothing is copied on a CPU device. SwarmX's rank 0 packs for
the other systems and reduces the kept gradients with them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from waferscale.runtime.layout import UnitLayout
from waferscale.sparse.masks import pack_bits

__all__ = ["PackedUnit", "UnitMasks", "expand", "kept_only"]


@dataclass
class PackedUnit:
    """A sparse unit's weights in transit: kept matrix values, the bitmask, the dense vectors, and whether the
    gradients of this step must come back dense."""

    values: Tensor
    bits: Tensor  # uint8, ceil(n_matrices / 8)
    vectors: Tensor
    dense_grads: bool = False

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + self.bits.nbytes + self.vectors.nbytes


class UnitMasks:
    """The kept elements of each unit's matrices payload, from the masks of the sparse parameters (by name).
    Units with no masked matrix are dense and absent."""

    def __init__(self, layouts: list[UnitLayout]) -> None:
        self.layouts = layouts
        self.keep: dict[int, Tensor] = {}  # unit -> bool (n_matrices,)
        self.index: dict[int, Tensor] = {}  # unit -> int64 positions of the kept elements, increasing
        self.bits: dict[int, Tensor] = {}

    def refresh(self, masks: dict[str, Tensor]) -> None:
        self.keep, self.index, self.bits = {}, {}, {}
        for lay in self.layouts:
            entries = [e for e in lay.entries if e.matrix and e.name in masks]
            if not entries:
                continue
            keep = torch.ones(lay.n_matrices, dtype=torch.bool)
            for e in entries:
                keep[e.payload_offset:e.payload_offset + e.numel] = masks[e.name].reshape(-1)
            self.keep[lay.index] = keep
            self.index[lay.index] = keep.nonzero().squeeze(1)
            self.bits[lay.index] = pack_bits(keep)

    def __contains__(self, u: int) -> bool:
        return u in self.keep

    def packed_nbytes(self, u: int, itemsize: int) -> int:
        """The bytes unit u's packed payload takes on a link (`PackedUnit.nbytes`), without packing it."""
        return self.index[u].numel() * itemsize + self.bits[u].nbytes + 4 * self.layouts[u].n_vectors

    def grad_nbytes(self, u: int) -> int:
        """The bytes of unit u's kept fp32 gradients (matrices' kept values, dense vectors) on a link."""
        return 4 * (self.index[u].numel() + self.layouts[u].n_vectors)


def expand(values: Tensor, keep: Tensor, index: Tensor | None = None) -> Tensor:
    """The dense payload (zeros where not kept) on values' device and dtype; `index`: the kept positions, where
    known (faster than the mask)."""
    out = torch.zeros(keep.numel(), dtype=values.dtype, device=values.device)
    if index is not None:
        return out.index_copy_(0, index.to(values.device), values)
    return out.masked_scatter_(keep.to(values.device), values)


def kept_only(src: Tensor, keep: Tensor, out: Tensor | None = None) -> Tensor:
    """fp32 `src` where `keep`, +0 elsewhere, bit for bit `torch.where(keep, src, 0)` (an overflow where not
    kept is dropped too), into `out` if given: an AND of src's bits with keep widened to all-ones or all-zero
    words, which vectorizes where torch.where on a bool mask takes a branch per element (~10x slower on a
    CPU at half density)."""
    assert src.dtype == torch.float32, src.dtype
    words = keep.reshape(src.shape).to(torch.int32).neg_()  # True -> 0xffffffff, False -> 0
    if out is None:
        return torch.bitwise_and(src.view(torch.int32), words).view(torch.float32)
    torch.bitwise_and(src.view(torch.int32), words, out=out.view(torch.int32))
    return out
