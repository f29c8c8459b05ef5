"""The compiler's IR: a model as an ordered list of units (embedding, blocks, head, or captured modules).

Every quantity is per token unless its name says otherwise; bytes follow the dtype the graph was captured at
(`dtype_bytes`). A unit is the granule of placement: one pipeline stage, or one streamed layer.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from waferscale.fabric.pe import DTYPE_BYTES

ARCHS = ("decoder", "encoder", "encoder_decoder")
FFN_DOWN = ("down_proj", "fc2", "c_proj", "w2")  # names of the matrix whose input is the FFN activation


@dataclass(frozen=True)
class MatMul:
    """y (m) = W (m x k) @ x (k), once per token. `m` outputs, `k` inputs (weight-stationary GEMV/GEMM).
    `density`: the fraction of W's weights that are non-zero (1 = dense); `act_density`: the fraction of x's
    values that are non-zero (activation sparsity; the wafer skips the multiply of a zero)."""

    name: str
    m: int
    k: int
    density: float = 1.0
    act_density: float = 1.0

    def __post_init__(self) -> None:
        for name in ("density", "act_density"):
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                raise ValueError(f"matmul {self.name!r}: {name} must be in (0, 1], got {v!r}")

    @property
    def flops_per_token(self) -> int:
        return 2 * self.m * self.k

    @property
    def sparse(self) -> bool:
        return self.density < 1.0 or self.act_density < 1.0

    @property
    def nonzero_flops_per_token(self) -> float:
        """FLOPs of the multiply-adds not skipped: non-zero weights times non-zero inputs."""
        return self.flops_per_token * self.density * self.act_density

    def stored_bytes(self, b: int) -> int:
        """SRAM bytes of W at `b` bytes per value: dense, or per non-zero its value + a 16-bit index (row within
        the PE's tile column), whichever is smaller (a compiler keeps a barely sparse matrix dense)."""
        dense = self.m * self.k * b
        return dense if self.density >= 1.0 else min(dense, math.ceil(self.m * self.k * self.density) * (b + 2))

    def streamed_bytes(self, b: int) -> int:
        """Bytes of W streamed from MemoryX: the non-zero values plus the mask as a bitmask (1 bit per weight,
        `sparse.masks.pack_bits`); dense: every value."""
        if self.density >= 1.0:
            return self.m * self.k * b
        return math.ceil(self.m * self.k * self.density) * b + math.ceil(self.m * self.k / 8)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for name in ("density", "act_density"):  # dense graphs serialize as they always have
            if d[name] == 1.0:
                del d[name]
        return d


@dataclass(frozen=True)
class Unit:
    """One placeable unit. `params` counts the weights this unit owns (a tied matrix is owned by one unit,
    `tied_to` names the owner on the other). FLOPs exclude attention over the context, which is
    `attn_flops_per_token(context)`."""

    name: str
    kind: str  # "embed" | "block" | "head" | "module"
    params: int
    matmuls: tuple[MatMul, ...] = ()
    d_in: int = 0  # activation elements entering per token
    d_out: int = 0  # activation elements leaving per token
    n_heads: int = 0  # attention heads (0 = no attention)
    head_dim: int = 0
    kv_heads: int = 0
    norm_width: int = 0  # elements normalized per token (0 = none)
    n_norms: int = 0
    elementwise_flops_per_token: int = 0  # activations, residual adds, bias
    train_act_elems_per_token: int = 0  # activations a layer keeps for backward (elements per token)
    tied_to: str | None = None  # the unit owning a matrix this unit also uses (tied embeddings)
    tied_params: int = 0  # size of that shared matrix
    # mixture of experts: a block whose router picks `experts_per_token` of its `n_experts` experts for every
    # token carries both counts; each expert is a unit of its own (kind "expert", `expert_of` = the block's name,
    # the same counts), placed in its own region. Per-token figures of an expert are for a token routed to it.
    n_experts: int = 0
    experts_per_token: int = 0
    expert_of: str | None = None
    # encoder-decoder (T5): which stack a unit serves ("encoder": runs once per input over its tokens;
    # "decoder": once per output token; "": both, or a single-stack model), and a decoder block's
    # cross-attention: `cross_heads` heads over `cross_ctx` encoder positions (keys and values computed once per
    # input by the block's "cross_kv" unit and kept in the block's region)
    stack: str = ""
    cross_heads: int = 0
    cross_ctx: int = 0

    def __post_init__(self) -> None:
        if self.params < 0:
            raise ValueError(f"unit {self.name!r}: params must be >= 0, got {self.params}")
        object.__setattr__(self, "matmuls", tuple(m if isinstance(m, MatMul) else MatMul(**m) for m in self.matmuls))
        if self.n_experts and not 1 <= self.experts_per_token <= self.n_experts:
            raise ValueError(f"unit {self.name!r}: experts_per_token must be in 1..{self.n_experts}, "
                             f"got {self.experts_per_token}")

    @property
    def token_share(self) -> float:
        """The fraction of tokens this unit computes: k/E for an expert under uniform routing, else 1."""
        return self.experts_per_token / self.n_experts if self.expert_of else 1.0

    @property
    def matmul_flops_per_token(self) -> int:
        return sum(m.flops_per_token for m in self.matmuls)

    @property
    def sparse(self) -> bool:
        return any(m.sparse for m in self.matmuls)

    @property
    def act_sparse(self) -> bool:
        return any(m.act_density < 1.0 for m in self.matmuls)

    @property
    def nonzero_matmul_flops_per_token(self) -> float:
        return sum(m.nonzero_flops_per_token for m in self.matmuls)

    @property
    def nonzero_params(self) -> int:
        """Weights that are not pruned (all of them in a dense unit)."""
        return self.params - sum(m.m * m.k - math.ceil(m.m * m.k * m.density) for m in self.matmuls
                                 if m.density < 1.0)

    def _matrix_bytes_saved(self, b: int, streamed: bool) -> int:
        return sum(m.m * m.k * b - (m.streamed_bytes(b) if streamed else m.stored_bytes(b))
                   for m in self.matmuls if m.density < 1.0)

    def stored_weight_bytes(self, b: int) -> int:
        """On-wafer bytes of the weights this unit holds (its own + a tied copy), sparse matrices compressed."""
        return max(0, (self.params + self.tied_params) * b - self._matrix_bytes_saved(b, streamed=False))

    def streamed_weight_bytes(self, b: int) -> int:
        """Bytes of this unit's own weights streamed from MemoryX per pass (non-zeros + bitmask when sparse)."""
        return max(0, self.params * b - self._matrix_bytes_saved(b, streamed=True))

    def attn_flops_per_token(self, context: int) -> int:
        """QK^T and AV for one query over `context` keys: 2 x 2 x heads x head_dim x context (and, with
        cross-attention, over the `cross_ctx` encoder positions)."""
        return 4 * self.n_heads * self.head_dim * context + 4 * self.cross_heads * self.head_dim * self.cross_ctx

    def fwd_flops_per_token(self, context: int = 0, nonzero: bool = False) -> float:
        """FLOPs of one token: the matmuls' (`nonzero`: only non-zero weights times non-zero inputs), attention
        over `context` keys, element-wise work."""
        mm = self.nonzero_matmul_flops_per_token if nonzero else self.matmul_flops_per_token
        return mm + self.attn_flops_per_token(context) + self.elementwise_flops_per_token

    def kv_elems_per_token(self) -> int:
        """Self-attention KV cache per token (an encoder's units keep none: they do not decode)."""
        return 2 * self.kv_heads * self.head_dim if self.n_heads and self.stack != "encoder" else 0

    def cross_kv_elems_per_token(self) -> int:
        """Cross-attention keys and values kept per encoder position."""
        return 2 * self.cross_heads * self.head_dim

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["matmuls"] = [m.to_dict() for m in self.matmuls]
        for name in ("n_experts", "experts_per_token", "expert_of", "stack", "cross_heads", "cross_ctx"):
            # a decoder-only dense graph serializes as it always has
            if not d[name]:
                del d[name]
        return d

@dataclass(frozen=True)
class Graph:
    """A captured model. `dtype` is the on-wafer weight/activation type (fp16/bf16 for mixed precision)."""

    name: str
    source: str  # "zoo:NAME" | "params:PATH" | "module:CLASS"
    units: tuple[Unit, ...]
    dtype: str = "fp16"
    max_seq_len: int = 2048
    defaults: dict[str, Any] = field(default_factory=dict)  # batch_size, seq_len, num_csx from a params YAML
    arch: str = "decoder"  # "decoder" (causal, KV cache) | "encoder" (bidirectional, no decode) | "encoder_decoder"

    def __post_init__(self) -> None:
        if not self.units:
            raise ValueError(f"graph {self.name!r} has no units")
        if self.arch not in ARCHS:
            raise ValueError(f"graph arch must be one of {ARCHS}, got {self.arch!r}")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"graph dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        object.__setattr__(self, "units", tuple(u if isinstance(u, Unit) else Unit(**u) for u in self.units))

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def params(self) -> int:
        return sum(u.params for u in self.units)

    @property
    def kv_elems_per_token(self) -> int:
        return sum(u.kv_elems_per_token() for u in self.units)

    @property
    def n_blocks(self) -> int:
        return sum(u.kind == "block" for u in self.units)

    def model_flops_per_token(self, seq_len: int, training: bool, nonzero: bool = False) -> float:
        """Model FLOPs per token as PaLM counts them (matmuls + attention over the full window; element-wise
        work excluded), x3 for training (forward + backward). `nonzero`: only the multiply-adds of non-zero
        weights and activations (what a sparse model's MFU counts)."""
        fwd = sum(((u.nonzero_matmul_flops_per_token if nonzero else u.matmul_flops_per_token) * u.token_share
                   if u.expert_of else (u.nonzero_matmul_flops_per_token if nonzero else u.matmul_flops_per_token))
                  + u.attn_flops_per_token(seq_len) for u in self.units)  # an expert: the tokens routed to it
        return 3 * fwd if training else fwd

    @property
    def moe(self) -> bool:
        return any(u.expert_of for u in self.units)

    @property
    def active_params(self) -> int:
        """Parameters one token computes with: every unit's, of the experts only the k its router picks (the
        embedding table counts whole, as `params` does)."""
        return self.params - sum(u.params for u in self.units if u.expert_of) + \
            sum(u.params * u.experts_per_token // u.n_experts for u in self.units if u.expert_of)

    def expert_groups(self) -> dict[int, list[int]]:
        """Index of each MoE block -> the indices of its experts (they follow it in `units`)."""
        index = {u.name: i for i, u in enumerate(self.units)}
        out: dict[int, list[int]] = {}
        for i, u in enumerate(self.units):
            if u.expert_of:
                out.setdefault(index[u.expert_of], []).append(i)
        return out

    @property
    def sparse(self) -> bool:
        return any(u.sparse for u in self.units)

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "source": self.source, "dtype": self.dtype, "max_seq_len": self.max_seq_len,
             "defaults": dict(self.defaults), "units": [u.to_dict() for u in self.units]}
        return d if self.arch == "decoder" else {**d, "arch": self.arch}  # a decoder's as it always was
