"""Masks: which weights are kept. A mask is a bool tensor of the weight's shape (True = kept). Scores compete
over the whole tensor, or within groups of rows/columns (`balance_out_groups` / `balance_in_groups`, so each
attention head keeps the same count); ties go to the lower index (a stable sort), so every backend and every
system computes the same mask from the same numbers.

Also here: the default parameter filter, glob filters, the init methods, and the packed form a mask streams
in (a bitmask: one bit per weight, little-endian within a byte).
"""

from __future__ import annotations

import fnmatch
from typing import Callable, Iterable

import torch
from torch import Tensor

from waferscale.errors import ConfigError

__all__ = ["default_filter", "make_filter", "Shaper", "topk_mask", "mask_for_sparsity", "drop_minimum",
           "grow_maximum", "make_init_method", "pack_bits", "unpack_bits"]

# ---- which parameters are sparse --------------------------------------------------------------------------


def default_filter(name: str, param: Tensor) -> bool:
    """Cerebras' default: matrices (ndim > 1) except embeddings, norms, the LM head and position helpers, by
    name ("embed" where Cerebras has "embedding": the zoo's embeddings are `embed.tok` / `embed.pos`)."""
    low = name.lower()
    return param.ndim > 1 and not any(w in low for w in ("embed", "norm", "lm_head", "pe_helper"))


def make_filter(param_filter: str | Iterable[str] | Callable[[str, Tensor], bool] | None,
                ) -> Callable[[str, Tensor], bool]:
    """A predicate (name, param) -> bool: None = the default; a glob or list of globs on the dotted name."""
    if param_filter is None:
        return default_filter
    if callable(param_filter):
        return param_filter
    globs = [param_filter] if isinstance(param_filter, str) else list(param_filter)
    if not globs or not all(isinstance(g, str) for g in globs):
        raise ConfigError(f"param_filter: a glob or a list of globs on parameter names, got {param_filter!r}")
    return lambda name, p: any(fnmatch.fnmatchcase(name, g) for g in globs)


# ---- scoring ----------------------------------------------------------------------------------------------


class Shaper:
    """Views a score as (groups, members): members of one group compete for that group's share of the kept
    weights. groups=None: one group (the whole tensor); out: rows split into `groups` blocks; in: columns."""

    def __init__(self, groups: int | None = None, along: str = "out") -> None:
        self.groups, self.along = groups, along

    def check(self, name: str, shape: tuple[int, ...]) -> None:
        if self.groups is None:
            return
        dim = shape[0] if self.along == "out" else shape[1]
        if len(shape) != 2 or dim % self.groups:
            raise ConfigError(f"balance_{self.along}_groups={self.groups} does not divide the "
                              f"{'rows' if self.along == 'out' else 'columns'} of {name} {tuple(shape)}")

    def shape(self, t: Tensor) -> Tensor:
        if self.groups is None:
            return t.reshape(1, -1)
        if self.along == "out":
            return t.reshape(self.groups, -1)
        return t.t().reshape(self.groups, -1)

    def unshape(self, g: Tensor, like: Tensor) -> Tensor:
        if self.groups is None or self.along == "out":
            return g.reshape(like.shape)
        return g.reshape(like.shape[1], like.shape[0]).t().contiguous()


FLAT = Shaper()


def topk_mask(score: Tensor, k: int, shaper: Shaper = FLAT) -> Tensor:
    """True at the k highest scores of each group (ties: lower index first)."""
    g = shaper.shape(score)
    k = max(0, min(int(k), g.shape[1]))
    order = torch.sort(g, dim=1, descending=True, stable=True).indices[:, :k]
    out = torch.zeros_like(g, dtype=torch.bool).scatter_(1, order, True)
    return shaper.unshape(out, score)


def _keep_count(sparsity: float, members: int) -> int:
    return round((1.0 - min(max(sparsity, 0.0), 1.0)) * members)


def mask_for_sparsity(score: Tensor, sparsity: float, shaper: Shaper = FLAT) -> Tensor:
    """Keep the top (1 - sparsity) of each group by score."""
    return topk_mask(score, _keep_count(sparsity, shaper.shape(score).shape[1]), shaper)


def drop_minimum(score: Tensor, mask: Tensor, drop_fraction: float, shaper: Shaper = FLAT) -> tuple[Tensor, int]:
    """Drop `drop_fraction` of the kept weights, those of lowest score: (new mask, kept per group)."""
    groups = shaper.shape(mask).shape[0]
    keep = int((1.0 - drop_fraction) * (int(mask.sum()) / groups))
    return topk_mask(torch.where(mask, score, float("-inf")), keep, shaper), keep


def grow_maximum(score: Tensor, mask: Tensor, sparsity: float, kept: int, shaper: Shaper = FLAT) -> Tensor:
    """Regrow pruned weights of highest score until each group reaches the target sparsity."""
    target = _keep_count(sparsity, shaper.shape(mask).shape[1])
    grow = topk_mask(torch.where(mask, float("-inf"), score), max(target - kept, 0), shaper)
    return mask | grow


# ---- init methods: (param, sparsity, shaper, generator) -> mask --------------------------------------------

InitMethod = Callable[[Tensor, float, Shaper, torch.Generator], Tensor]


def _random(p: Tensor, sparsity: float, shaper: Shaper, gen: torch.Generator) -> Tensor:
    return mask_for_sparsity(torch.rand(p.shape, generator=gen), sparsity, shaper)


def _topk(p: Tensor, sparsity: float, shaper: Shaper, gen: torch.Generator) -> Tensor:
    return mask_for_sparsity(p.detach().abs().float().cpu(), sparsity, shaper)


def _from_zeros(p: Tensor, sparsity: float, shaper: Shaper, gen: torch.Generator) -> Tensor:
    return (p.detach() != 0).cpu()


def _checkerboard(p: Tensor, sparsity: float, shaper: Shaper, gen: torch.Generator) -> Tensor:
    """Evenly spaced kept weights (a deterministic pattern): keep index i when floor(i * d) changes."""
    n = p.numel()
    d = 1.0 - sparsity
    i = torch.arange(n, dtype=torch.float64)
    return (torch.floor((i + 1) * d) > torch.floor(i * d)).reshape(p.shape)


INIT_METHODS: dict[str, InitMethod] = {"random": _random, "topk": _topk, "from_zeros": _from_zeros,
                                       "checkerboard": _checkerboard}


def make_init_method(spec: str | Callable) -> InitMethod:
    """A named init method, or the user's callable (param, sparsity, score_shaper=None, device=None) -> mask."""
    if callable(spec):
        return lambda p, s, shaper, gen: spec(p, s, score_shaper=shaper, device=None).to(torch.bool).cpu()
    if spec not in INIT_METHODS:
        raise ConfigError(f"init_method: {spec!r}; choose one of {', '.join(INIT_METHODS)} (or pass a callable)")
    return INIT_METHODS[spec]


# ---- the streamed index: a bitmask -------------------------------------------------------------------------

_BITS = 1 << torch.arange(8, dtype=torch.uint8)


def pack_bits(keep: Tensor) -> Tensor:
    """A flat bool tensor as uint8 bytes, 8 weights a byte (bit b of byte i is weight 8i + b)."""
    n = keep.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=keep.device)
    padded[:n] = keep.reshape(-1)
    return (padded.view(-1, 8) * _BITS.to(keep.device)).sum(1, dtype=torch.uint8)


def unpack_bits(bits: Tensor, n: int) -> Tensor:
    """The inverse of pack_bits: n bools."""
    return ((bits.unsqueeze(1) & _BITS.to(bits.device)) != 0).reshape(-1)[:n]
