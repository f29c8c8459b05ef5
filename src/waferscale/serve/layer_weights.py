"""A block's weights as the serving runner runs them (serve/model_runner.py): products over fused, packed weights
(`FastLinear`: the C kernels' panel arena, or MKL), a dense MLP or SwiGLU, a mixture of experts that runs each
expert once over the rows routed to it, and a block's q|k|v, output projection and MLP in the order a step reads
them, with partial / interleaved rotary mapped onto the kernels' rotate-half order (`rotary_layout`).

A matrix may also be a `QWeight` (serve/quant.py: a file's own precision, serve/file_weights.py); its products
run through `quant.linear`. Fused matrices concatenate their rows when their types match; a fused product of
parts of different types (a Q4_K_M file's Q6_K v beside Q4_K q and k) runs part by part.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from waferscale.models.config import ModelConfig
from waferscale.models.layers import RMSNorm, SwiGLU
from waferscale.serve import kernels, quant
from waferscale.serve.quant import QWeight

# GEMMs of this many multiply-adds or more (about a millisecond on one core) get the runner's thread budget;
# smaller ones run on one thread (see the threads note in model_runner.py).
PAR_MACS = 1 << 23


class FastLinear:
    """y = residual + x W^T + b over a (fused) weight. On CPU float32 with the C kernels (`ckern`) the runner
    packs W into its arena (`cw`: dense or sparse panels, serve/kernels.py) and every call runs there; otherwise
    MKL, packed for one row when `pack`. A QWeight (or parts of different types, `fuse`) runs through
    quant.linear."""

    threads = 1  # set by the runner: threads lent to GEMMs of PAR_MACS+ multiply-adds

    def __init__(self, weight: Tensor | QWeight | list[QWeight], bias: Tensor | None, pack: bool,
                 ckern: bool = False) -> None:
        self.bias = None if bias is None else bias.contiguous()
        self.ckern = ckern
        self.cw: Tensor | kernels.SparsePanels | None = None  # the packed weight (the runner's arena, when ckern)
        self.packed = None
        self.parts: list[QWeight] | None = None
        if not isinstance(weight, Tensor):  # in a file's precision: nothing to pack
            self.parts = weight if isinstance(weight, list) else [weight]
            self.weight = None
            self.out, self.inp = sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]
            self.nbytes = sum(p.nbytes for p in self.parts)
            return
        self.weight: Tensor | None = weight.contiguous()
        self.out, self.inp = weight.shape
        self.nbytes = self.weight.numel() * self.weight.element_size()  # weight bytes a product reads (as packed)
        if pack:
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weight, 1)

    @property
    def stack_weight(self) -> Tensor | kernels.SparsePanels | QWeight | None:
        """The weight kernels.DecodeStack takes for this product: the packed panels, or its one QWeight; None when
        it runs in parts of different types."""
        if self.parts is None:
            return self.cw
        return self.parts[0] if len(self.parts) == 1 else None

    def __call__(self, x: Tensor, residual: Tensor | None = None) -> Tensor:
        if self.parts is not None:
            if len(self.parts) == 1:
                return quant.linear(x, self.parts[0], self.bias, residual)
            y = torch.cat([quant.linear(x, p) for p in self.parts], -1)
            if self.bias is not None:
                y += self.bias
            return y if residual is None else residual + y
        if self.cw is not None:
            return kernels.linear(x.contiguous(), self.cw, self.out, self.bias,
                                  None if residual is None else residual.contiguous())
        y = self._torch(x)
        return y if residual is None else residual + y

    def _torch(self, x: Tensor) -> Tensor:
        if self.packed is not None and x.shape[0] == 1:
            return torch.ops.mkl._mkl_linear(x, self.packed, self.weight, self.bias, 1)
        if self.threads > 1 and x.shape[0] * self.weight.numel() >= PAR_MACS:
            torch.set_num_threads(self.threads)
            try:
                return F.linear(x, self.weight, self.bias)
            finally:
                torch.set_num_threads(1)
        return F.linear(x, self.weight, self.bias)


def pack_arena(lins: list[FastLinear], sparse: bool) -> tuple[int, int, int]:
    """Pack the weights of `lins` into one huge-page-backed arena, back to back in this order (the order a step
    reads them), and drop the row-major ones. One packed copy of each weight, made once at load (the model keeps
    its own tensors). A weight with enough exact zeros goes in sparse panels when `sparse` (kernels.sparse_pays),
    else in dense ones (kernels.pack). Returns (weights sparse enough, bytes a step reads all dense, bytes it
    reads as packed)."""
    plans: list[kernels.SparsePlan | None] = []
    for lin in lins:
        plan = None
        zeros = int((lin.weight == 0).sum())
        if zeros >= (1 - kernels.SPARSE_MAX_FRACTION) * lin.weight.numel():  # (else sparse cannot pay)
            plan = kernels.sparse_plan(lin.weight)
            plan = plan if kernels.sparse_pays((lin.out, lin.inp), plan) else None
        plans.append(plan)
    dense = [kernels.packed_numel((lin.out, lin.inp)) for lin in lins]
    size = [p.numel if p is not None and sparse else n for p, n in zip(plans, dense)]
    arena = kernels.hugepage_tensor(sum(size))
    off = 0
    read = 0
    for lin, plan, n in zip(lins, plans, size):
        if plan is not None and sparse:
            lin.cw = kernels.pack_sparse(lin.weight, plan, arena[off:off + n])
            lin.nbytes = 4 * int(lin.cw.off[-2])
        else:
            lin.cw = kernels.pack(lin.weight, arena[off:off + n])
            lin.nbytes = 4 * n
        read += lin.nbytes // 4
        lin.weight = None  # (a fused weight was a copy: freed)
        off += n
    return sum(p is not None for p in plans), 4 * sum(dense), 4 * read


def mkl_packing_available() -> bool:
    try:
        w = torch.zeros(4, 4)
        p = torch.ops.mkl._mkl_reorder_linear_weight(w, 1)
        torch.ops.mkl._mkl_linear(torch.zeros(1, 4), p, w, None, 1)
        return True
    except (RuntimeError, AttributeError):
        return False


def _cat(*ts: Tensor | None) -> Tensor | None:
    return None if ts[0] is None else torch.cat(ts, 0)


def fuse(ws: list[Tensor | QWeight]) -> Tensor | QWeight | list[QWeight]:
    """Matrices stacked by rows into one product's weight: float tensors concatenated, QWeights of one type
    concatenated on their bytes (rows are independent blocks), QWeights of different types kept as parts."""
    if all(isinstance(w, Tensor) for w in ws):
        return torch.cat(ws)
    if not all(isinstance(w, QWeight) for w in ws):
        raise TypeError("a fused product takes float tensors or QWeights, not both")
    if len({w.qtype for w in ws}) > 1:
        return list(ws)
    return QWeight(ws[0].qtype, (sum(w.shape[0] for w in ws), ws[0].shape[1]), torch.cat([w.data for w in ws]))


def _rows(w: Tensor | QWeight, index: Tensor) -> Tensor | QWeight:
    return w.rows(index) if isinstance(w, QWeight) else w[index]


def _weight(q: dict[str, QWeight], name: str, mod: nn.Module) -> Tensor | QWeight:
    """The weight of `mod` (a block's module called `name`): its QWeight in `q` (the served weights, by name
    within the block), else its own tensor."""
    return q.get(f"{name}.weight", mod.weight)


class ServedMLP:
    """One dense MLP (a block's, or one expert's): down(act(up(h))), or SwiGLU over a fused gate|up."""

    def __init__(self, m: nn.Module, pack: bool, ckern: bool, q: dict[str, QWeight], prefix: str) -> None:
        self.ckern = ckern
        self.swiglu = isinstance(m, SwiGLU)
        if self.swiglu:
            self.ffn = m.gate_proj.weight.shape[0]
            self.up = FastLinear(fuse([_weight(q, prefix + "gate_proj", m.gate_proj),
                                       _weight(q, prefix + "up_proj", m.up_proj)]),
                                 _cat(m.gate_proj.bias, m.up_proj.bias), pack, ckern)
        else:
            self.up = FastLinear(_weight(q, prefix + "up_proj", m.up_proj), m.up_proj.bias, pack, ckern)
            self.act = m.act
        self.down = FastLinear(_weight(q, prefix + "down_proj", m.down_proj), m.down_proj.bias, pack, ckern)

    def __call__(self, h: Tensor, residual: Tensor | None = None) -> Tensor:
        """residual + MLP(h)."""
        u = self.up(h)
        if self.swiglu:
            if self.ckern:
                return self.down(kernels.silu_mul(u, self.ffn), residual)
            g, u = u.split(self.ffn, -1)
            return self.down(F.silu(g) * u, residual)
        return self.down(self.act(u), residual)


class ServedMoE:
    """A mixture of experts (layers.MoE's arithmetic): the router's softmax in float32, each row's top k
    renormalized, and every expert run once over the rows routed to it, so that a step reads only the experts
    its rows chose (`read`: their weight bytes, summed over steps)."""

    def __init__(self, m: nn.Module, pack: bool, ckern: bool, q: dict[str, QWeight]) -> None:
        self.top_k, self.n = m.top_k, m.n_experts
        self.ckern = ckern  # routing in C (kernels.route), as the C layer stack routes
        self.router = FastLinear(_weight(q, "mlp.router", m.router), None, pack, ckern)
        self.experts = [ServedMLP(e, pack, ckern, q, f"mlp.experts.{i}.") for i, e in enumerate(m.experts)]
        self.read = 0

    def expert_bytes(self, e: int) -> int:
        return self.experts[e].up.nbytes + self.experts[e].down.nbytes

    def __call__(self, h: Tensor, residual: Tensor) -> Tensor:
        if self.ckern:
            chosen, weights = kernels.route(self.router(h), self.top_k)  # (N, k) each
        else:
            probs = F.softmax(self.router(h), dim=-1, dtype=torch.float32)  # (N, E)
            weights, chosen = probs.topk(self.top_k, dim=-1)  # (N, k)
            weights = weights / weights.sum(-1, keepdim=True)
        weights = weights.to(h.dtype).view(-1)
        if h.shape[0] == 1:  # one decode row: its k experts in index order, the sums of the general case below
            out = torch.zeros_like(h)
            for e, j in sorted(zip(chosen[0].tolist(), range(self.top_k))):
                out += self.experts[e](h) * weights[j]
                self.read += self.expert_bytes(e)
            return residual + out
        flat = chosen.view(-1)
        sizes = torch.bincount(flat, minlength=self.n).tolist()
        order = flat.argsort(stable=True)  # the (row, choice) slots grouped by expert
        out = torch.zeros_like(h)
        for e, idx in enumerate(order.split(sizes)):
            if sizes[e]:
                rows = idx // self.top_k
                out.index_add_(0, rows, self.experts[e](h.index_select(0, rows)) * weights[idx, None])
                self.read += self.expert_bytes(e)
        return residual + out


class ServedLayer:
    """One block: fused q|k|v (q and k rows in the rotary order of `rope_perm`, see rotary_layout), output
    projection, and its MLP or mixture of experts; sequential or parallel (attention and MLP both read the
    block's input, through one norm or two). `q`: the block's served QWeights by name within the block
    ("attn.q_proj.weight", ...; serve/file_weights.py), each replacing the module's own weight."""

    def __init__(self, block: nn.Module, pack: bool, ckern: bool, rope_perm: Tensor | None,
                 q: dict[str, QWeight] | None = None) -> None:
        q = q or {}
        a = block.attn
        self.parallel = block.parallel
        self.attn_norm = norm_fn(block.attn_norm, ckern)
        self.mlp_norm = None if block.mlp_norm is None else norm_fn(block.mlp_norm, ckern)
        self.n_head, self.n_kv, self.hd = a.n_head, a.n_kv, a.hd
        qw, kw = _weight(q, "attn.q_proj", a.q_proj), _weight(q, "attn.k_proj", a.k_proj)
        qb, kb = a.q_proj.bias, a.k_proj.bias
        if rope_perm is not None:  # each head's dims reordered alike in q and k: the same scores
            qi = (torch.arange(self.n_head)[:, None] * self.hd + rope_perm).view(-1)
            ki = (torch.arange(self.n_kv)[:, None] * self.hd + rope_perm).view(-1)
            qw, kw = _rows(qw, qi), _rows(kw, ki)
            qb, kb = (None, None) if qb is None else (qb[qi], kb[ki])
        self.qkv = FastLinear(fuse([qw, kw, _weight(q, "attn.v_proj", a.v_proj)]), _cat(qb, kb, a.v_proj.bias),
                              pack, ckern)
        self.o = FastLinear(_weight(q, "attn.o_proj", a.o_proj), a.o_proj.bias, pack, ckern)
        self.moe = ServedMoE(block.mlp, pack, ckern, q) if block.moe else None
        self.dense = None if block.moe else ServedMLP(block.mlp, pack, ckern, q, "mlp.")

    def lins(self) -> list[FastLinear]:
        """The layer's products in the order a step runs them."""
        if self.moe is not None:
            return [self.qkv, self.o, self.moe.router] + [lin for e in self.moe.experts for lin in (e.up, e.down)]
        return [self.qkv, self.o, self.dense.up, self.dense.down]

    def fixed_bytes(self) -> int:
        """Weight bytes every step reads (every matrix but the experts)."""
        return self.qkv.nbytes + self.o.nbytes + (
            self.moe.router.nbytes if self.moe is not None else self.dense.up.nbytes + self.dense.down.nbytes)

    def mlp(self, h: Tensor, residual: Tensor) -> Tensor:
        """residual + MLP(h)."""
        return self.moe(h, residual) if self.moe is not None else self.dense(h, residual)

    def finish(self, x: Tensor, y: Tensor, m: Tensor | None) -> Tensor:
        """The block's output from its input x, the attention heads' output y (N, nh hd) and, in a parallel
        block, the MLP's normed input m: x + o(y) + mlp(m), or sequentially x' = x + o(y); x' + mlp(norm(x'))."""
        x1 = self.o(y, x)
        return self.mlp(m, x1) if self.parallel else self.mlp(self.mlp_norm(x1), x1)


def rotary_layout(cfg: ModelConfig) -> Tensor | None:
    """Partial (rotary_dim < head_dim) and GPT-J's interleaved rotary as the full rotate-half rotation the
    kernels run: the order (hd,) to put each q and k head's dims in so that the rotated pairs become
    (j, j + hd/2), j < rotary_dim/2, with the dims that do not rotate on the remaining j (whose frequency the
    runner's tables set to 0: cos 1, sin 0, the dims pass through unchanged). None: the model's own order
    already is."""
    hd, rd = cfg.head_dim, cfg.rotary_dims
    if not rd or (rd == hd and not cfg.rotary_interleaved):
        return None
    if cfg.rotary_interleaved:  # pairs (2i, 2i+1)
        first, second = list(range(0, rd, 2)), list(range(1, rd, 2))
    else:  # pairs (i, i + rd/2)
        first, second = list(range(rd // 2)), list(range(rd // 2, rd))
    rest = list(range(rd, hd))
    m = len(rest) // 2
    return torch.tensor(first + rest[:m] + second + rest[m:], dtype=torch.long)


def norm_fn(mod: nn.Module, ckern: bool = False):
    """The block's own norm module; an RMSNorm over float32 is inlined (RMSNorm.forward's arithmetic in four
    ops, without its dtype round trips, so faster per call than the module or F.rms_norm), and
    with `ckern` a few rows go through the C kernel (one call instead of six)."""
    if isinstance(mod, RMSNorm) and mod.weight.dtype == torch.float32:
        w, eps = mod.weight, mod.eps

        def rms(x: Tensor) -> Tensor:
            return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

        if not ckern:
            return rms
        wc = w.detach().contiguous()

        def rms_c(x: Tensor) -> Tensor:
            if x.is_contiguous():
                return kernels.rms_norm(x, wc, eps)
            return rms(x)

        return rms_c
    return mod
