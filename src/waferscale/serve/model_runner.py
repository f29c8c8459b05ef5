"""The paged forward pass: a pass over an unmodified `CausalLM` (DESIGN.md rule 5) that runs a flattened batch
of sequence chunks against a block-paged KV cache.

A step's batch is N tokens from B sequences laid end to end (prefill chunks and single decode tokens mixed).
Projections run once over all N rows (fused: q|k|v in one matrix, gate|up in one; each block's own norm and
activation modules); attention runs per prefill chunk (SDPA, causal with an offset) and for all decode rows
together; only the rows that sample go through the head. A runner covers a contiguous range of layers, so a
pipeline stage is a runner over its slice (`has_embed` on the first, `has_head` on the last).

On CPU float32 (`fast_linear`) the projections, norms and SwiGLU run in the C kernels of serve/kernels.py over
weights packed in one huge-page arena in the order they are read (a matrix with enough exact zeros, as a pruned
checkpoint has, in sparse panels: fewer bytes a token, the same bits; WSC_SPARSE_KERNELS=0 keeps it dense);
decode rows' rope, KV write and attention run in one C call over the paged cache, and with Llama-style blocks
decode and short prefill chunks run every layer in one C call (`kernels.DecodeStack`). The per-op torch path
(decode rows gathered into a padded (B, nkv, S_max, hd) tensor with a key mask) stays the reference; without a C
compiler the projections use MKL (its packed single-row GEMM for one row). How fast: docs/serving.md,
bench/serve_decode.py.

The decoder families run on the same path: partial and GPT-J's interleaved rotary become the full rotate-half
rotation by reordering each q and k head's dims once at load (`rotary_layout`); parallel blocks feed the
block's input (one norm or two) to attention and MLP; ALiBi and sliding windows are the attention's bias and
key range, in SDPA's mask and in the C decode attention (a window's older blocks are freed by the scheduler:
kv.FREED); a mixture of experts runs each expert once over the rows routed to it, so a step reads only the
chosen experts' weights (the runner counts the weight bytes decode reads: Engine.stats(),
bench/serve_moe_decode.py).

Matrices in a file's own precision (`qweights`: serve/file_weights.py's QWeights by parameter name, the model's
own tensors of those names left on the meta device) run through `quant.linear`, the embedding through
`quant.take`; attention computes in float32 either way. The KV cache (`kv_dtype`, the engine's --kv-cache-dtype)
is float32 or float16: K and V are rounded to it as they are written and widened as they are read.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from waferscale.errors import ConfigError
from waferscale.models.config import ModelConfig
from waferscale.models.layers import CausalLM, RMSNorm, rope_cos_sin
from waferscale.serve import kernels, quant
from waferscale.serve.kv import KVPool
from waferscale.serve.layer_weights import (FastLinear, ServedLayer, ServedMLP, mkl_packing_available, norm_fn,
                                            pack_arena, rotary_layout)


@dataclass
class BatchSpec:
    """A step's work, compact and picklable (it travels between pipeline stages).

    token_ids: the N tokens fed, chunk after chunk. chunks: (start position, num tokens, block table, logits:
    how many of the chunk's last rows go through the head: 0, 1 (the row that samples), or more (speculation:
    the rows that verify drafted tokens)).
    """

    token_ids: list[int]
    chunks: list[tuple[int, int, list[int], int]]


def window_lo(start: int, window: int) -> int:
    """The first key position a query at `start` attends to: the latest `window` positions (0: all)."""
    return max(0, start - window + 1) if window else 0


def attention_mask(qpos: Tensor, kpos: Tensor, window: int, slopes: Tensor | None) -> Tensor:
    """What SDPA adds for queries at positions qpos (T,) over keys at kpos (S,): a (T, S) boolean mask (causal,
    within `window` when set), or with ALiBi slopes (nh,) the (nh, T, S) bias slope * (key - query), -inf where
    masked (layers.Attention's mask)."""
    rel = kpos[None, :] - qpos[:, None]  # (T, S)
    allowed = rel <= 0
    if window:
        allowed &= rel > -window
    if slopes is None:
        return allowed
    return (slopes[:, None, None] * rel.float()).masked_fill(~allowed, float("-inf"))


class Prepared:
    """Index tensors for one BatchSpec, built once per step and shared by every layer of a runner.

    A sequence whose block table is a run of consecutive blocks (the allocator hands out the lowest free
    blocks, so a lone sequence usually gets one) keeps its KV in one contiguous stretch of slots: attention
    then reads a view of the cache (a `slice`) instead of gathering a copy every layer.
    """

    def __init__(self, spec: BatchSpec, block_size: int, cos_table: Tensor | None, sin_table: Tensor | None,
                 device: torch.device, window: int = 0, slopes: Tensor | None = None) -> None:
        pos: list[int] = []
        slots: list[int] = []
        samples: list[int] = []
        # (row0, row1, kv slots (tensor or slice), mask, causal)
        self.prefill: list[tuple[int, int, Tensor | slice, Tensor | None, bool]] = []
        dec_rows: list[int] = []
        # a decode row's KV slots of positions [lo, ctx): a run, or (block table, lo, ctx)
        dec_slots: list[slice | tuple[list[int], int, int]] = []
        dec_tables: list[list[int]] = []
        self._row_tables: list[tuple[list[int], int]] = []  # (block table, rows) per chunk, in order
        self.window, self.slopes = window, slopes
        row = 0
        bs = self.block_size = block_size
        for start, n, table, sample in spec.chunks:
            ctx = start + n
            lo = window_lo(start, window)  # the chunk's first key (blocks before it may be freed: kv.FREED)
            blo, nblk = lo // bs, -(-ctx // bs)
            b0 = table[blo]
            consecutive = all(table[i] == b0 + i - blo for i in range(blo + 1, nblk))
            base = (b0 - blo) * bs  # when consecutive, position p sits in slot base + p
            self._row_tables.append((table[:nblk], n))
            if n == 1:  # a decode token: its slot now, the rest of its sequence's slots only if asked for
                slots.append(table[start // bs] * bs + start % bs)
                pos.append(start)
                dec_rows.append(row)
                dec_slots.append(slice(base + lo, base + ctx) if consecutive else (table, lo, ctx))
                dec_tables.append(table[:nblk])
                row += 1
                if sample:
                    samples.append(row - 1)
                continue
            if consecutive:
                seq_kv: list[int] | slice = slice(base + lo, base + ctx)
                slots.extend(range(base + start, base + ctx))
            else:
                seq_kv = [table[p // bs] * bs + p % bs for p in range(lo, ctx)]
                slots.extend(seq_kv[start - lo:])
            pos.extend(range(start, ctx))
            kv = seq_kv if isinstance(seq_kv, slice) else torch.tensor(seq_kv, dtype=torch.long, device=device)
            if start == 0 and slopes is None and not (window and ctx > window):
                self.prefill.append((row, row + n, kv, None, True))
            else:  # queries at positions start.. over keys lo..: a later chunk, a window, or ALiBi's bias
                mask = attention_mask(torch.arange(start, ctx, device=device), torch.arange(lo, ctx, device=device),
                                      window, slopes)  # (T, S), or (nh, T, S) with ALiBi
                self.prefill.append((row, row + n, kv, mask, False))
            row += n
            samples.extend(range(row - sample, row))
        self.input_ids = torch.tensor(spec.token_ids, dtype=torch.long, device=device)
        self.positions = torch.tensor(pos, dtype=torch.long, device=device)
        self.slots = torch.tensor(slots, dtype=torch.long, device=device)
        self.sample_rows = torch.tensor(samples, dtype=torch.long, device=device)
        self.all_sample = samples == list(range(row))  # every row samples (pure decode)
        self._cos_t, self._sin_t = cos_table, sin_table
        self.dec_rows = None
        self.dec_all = False
        self.dec_slice: slice | None = None  # one decode sequence with contiguous KV: attend to a view
        self._dec_tables, self._dec_pos = dec_tables, [pos[r] for r in dec_rows]
        self._dec_gather: list[slice | tuple[list[int], int]] = dec_slots
        self._device = device
        if dec_rows:
            if len(dec_slots) == 1 and isinstance(dec_slots[0], slice):
                self.dec_slice = dec_slots[0]
            self.dec_all = dec_rows == list(range(row))
            self.dec_rows = torch.tensor(dec_rows, dtype=torch.long, device=device)

    # The cached properties below are built on first use, at most once per step.
    @functools.cached_property
    def cos(self) -> Tensor | None:
        """(N, 1, hd) rotary cos of every row's position (None without rotary positions), for the torch path
        (the C kernels index the tables themselves)."""
        return None if self._cos_t is None else self._cos_t.index_select(0, self.positions).unsqueeze(1)

    @functools.cached_property
    def sin(self) -> Tensor | None:
        """(N, 1, hd) rotary sin (first half negated) of every row's position, as `cos`."""
        return None if self._sin_t is None else self._sin_t.index_select(0, self.positions).unsqueeze(1)

    @functools.cached_property
    def dec_gather(self) -> tuple[Tensor, Tensor | None]:
        """For the torch attention path: the decode rows' KV slots (B, S_max), padded with a valid slot, and
        the key mask (B, 1, 1, S_max) (None when every row has S_max keys), or with ALiBi the bias
        (B, nh, 1, S_max)."""
        bs, dev = self.block_size, self._device
        lists = [list(range(s.start, s.stop)) if isinstance(s, slice) else
                 [s[0][p // bs] * bs + p % bs for p in range(s[1], s[2])] for s in self._dec_gather]
        smax = max(len(s) for s in lists)
        slots = torch.tensor([s + [s[0]] * (smax - len(s)) for s in lists], dtype=torch.long, device=dev)
        mask = None
        lens = torch.tensor([len(s) for s in lists], device=dev)
        if any(len(s) != smax for s in lists):
            mask = (torch.arange(smax, device=dev)[None, :] < lens[:, None])[:, None, None, :]
        if self.slopes is not None:  # row b's key j sits len[b] - 1 - j positions before its query
            rel = torch.arange(smax, device=dev)[None, :] - (lens - 1)[:, None]  # (B, S_max) key - query
            bias = self.slopes[None, :, None, None] * rel[:, None, None, :].float()  # (B, nh, 1, S_max)
            mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
        return slots, mask

    def dec_bias_one(self, S: int) -> Tensor | None:
        """ALiBi's bias (1, nh, 1, S) for one decode row over its S latest keys (None without ALiBi)."""
        if self.slopes is None:
            return None
        rel = torch.arange(1 - S, 1, device=self._device).float()
        return (self.slopes[:, None] * rel[None, :])[None, :, None, :]

    def rows_c(self) -> tuple[Tensor, Tensor]:
        """(positions (N,), block tables (N, max blocks)) of every row, int64, for the C stack: a prefill
        chunk's rows share its sequence's table and attend like decode tokens at their own positions."""
        if self.dec_all:
            return self.dec_c
        nb = max(len(t) for t, _ in self._row_tables)
        rows = [t + [t[0]] * (nb - len(t)) for t, n in self._row_tables for _ in range(n)]
        return self.positions, torch.tensor(rows, dtype=torch.long)

    @functools.cached_property
    def dec_c(self) -> tuple[Tensor, Tensor]:
        """(positions (B,), block tables (B, max blocks)) of the decode rows, int64, for the C attention."""
        nb = max(len(t) for t in self._dec_tables)
        return (torch.tensor(self._dec_pos, dtype=torch.long),
                torch.tensor([t + [t[0]] * (nb - len(t)) for t in self._dec_tables], dtype=torch.long))


# Threads (the torch path; the C kernels have their own pool, see kernels.set_threads). A decode step is hundreds
# of tiny ops (norms, rope, KV gathers, attention over a few hundred keys) and a few dozen matrix-vector products
# that one core already runs at memory speed, and an OpenMP parallel region costs microseconds on a quiet machine
# but milliseconds when another process holds the other cores. So the runner runs single-threaded and lends its
# thread budget (`threads`, default 1: on a shared machine even big multi-thread GEMMs collapse under load, see
# bench/serve_http.py --threads) only to GEMMs of layer_weights.PAR_MACS+ multiply-adds (about a millisecond on
# one core) and long prefill attention. The way to use more cores is stages=K, one process per stage.

def _rope_(x: Tensor, cos: Tensor, sin_signed: Tensor) -> None:
    """Rotate x (N, n, hd) in place (x may be a strided view). cos / sin_signed: (N, 1, hd), sin_signed being
    sin with its first half negated, so that x*cos + rotate_half(x)*sin == x*cos + flip_halves(x)*sin_signed:
    layers.apply_rope's arithmetic in three ops."""
    N, n, hd = x.shape
    flipped = x.view(N, n, 2, hd // 2).flip(2).view(N, n, hd)
    torch.addcmul(x * cos, flipped, sin_signed, out=x)


def check_servable(cfg: ModelConfig) -> None:
    """The serving engine runs the decoder families: pre-norm blocks, sequential or parallel, with learned,
    rotary (full, partial or interleaved) or ALiBi positions, full or sliding-window attention, dense MLPs or
    a mixture of experts. Anything else is refused by name, never served wrong."""
    missing = [what for what, has in (
        ("encoder (bidirectional attention, no next-token decoding)", cfg.is_encoder),
        ("encoder-decoder (wsc generate runs T5 sequence to sequence)", cfg.is_encoder_decoder),
        ("partial rotary over an odd head_dim", cfg.rotary_dims and cfg.head_dim % 2),
        ("muP scaling (the engine serves models.modelzoo.fold_mup_model's standard copy)", cfg.has_mup),
    ) if has]
    if missing:
        raise ConfigError(f"wsc serve / generate cannot serve {cfg.name!r} ({cfg.family}): the serving engine "
                          f"has no {', no '.join(missing)} (it serves the decoder families; train, evaluate and "
                          f"compile this model with wsc run / compile)")


class ModelRunner:
    """Runs layers [lo, hi) of `model` (plus its embedding / head when asked) over paged KV."""

    def __init__(self, model: CausalLM, lo: int, hi: int, *, num_blocks: int, block_size: int,
                 has_embed: bool, has_head: bool, device: torch.device | str = "cpu",
                 fast_linear: bool | None = None, threads: int | None = None,
                 decode_threads: int | None = None, qweights: dict[str, quant.QWeight] | None = None,
                 kv_dtype: torch.dtype | None = None) -> None:
        cfg = model.config
        q = qweights or {}
        check_servable(cfg)
        self.threads = max(1, threads or 1)
        self.cfg, self.lo, self.hi = cfg, lo, hi
        self.has_embed, self.has_head = has_embed, has_head
        self.device = torch.device(device)
        self.block_size = block_size
        p = model.head.lm_head.weight
        self.dtype = p.dtype
        if fast_linear is None:  # auto: worth it on CPU float32 for real model sizes
            fast_linear = self.device.type == "cpu" and self.dtype == torch.float32 and cfg.d_model >= 256
        cpu32 = bool(fast_linear) and self.device.type == "cpu" and self.dtype == torch.float32
        ckern = cpu32 and kernels.available()
        pack = cpu32 and not ckern and mkl_packing_available()  # (with the C kernels, MKL never sees one row)
        self.fast_linear = pack or ckern
        self.c_kernels = ckern  # C kernels for every projection, norm and SwiGLU (serve/kernels.py)
        self.kernel_path = kernels.path() if ckern else "off ({}: torch)".format(  # (said at start and in stats)
            f"device {self.device.type}" if self.device.type != "cpu" else
            f"weights in {str(self.dtype).removeprefix('torch.')}" if self.dtype != torch.float32 else
            "fast_linear off" if not fast_linear else kernels.unavailable_reason())
        # one decode token of one sequence with contiguous KV: rope + KV write + attention in one C call
        self.kv_dtype = kv_dtype or self.dtype  # the KV cache's elements (KVPool), float16 or the weights' dtype
        self.c_attention = ckern and cfg.head_dim % 16 == 0 and cfg.n_head % cfg.kv_heads == 0 and \
            self.kv_dtype in kernels.KV_DTYPES
        self.decode_threads = 1  # threads sharing each of those products (the kernels decide when it pays)
        if ckern:
            self.decode_threads = kernels.set_threads(
                torch.get_num_threads() if decode_threads is None else max(1, decode_threads))
        self.embed = model.embed
        self.embed_q = q.get("embed.tok.weight")  # the embedding in a file's precision: rows read by quant.take
        rope_perm = rotary_layout(cfg)
        self.layers = [ServedLayer(model.blocks[i], pack, ckern, rope_perm,
                                   {n.removeprefix(f"blocks.{i}."): w for n, w in q.items()
                                    if n.startswith(f"blocks.{i}.")}) for i in range(lo, hi)]
        self.head_norm = norm_fn(model.head.norm, ckern)
        self.lm_head = FastLinear(q.get("head.lm_head.weight", model.head.lm_head.weight), model.head.lm_head.bias,
                                  pack, ckern) if has_head else None
        lins = [lin for L in self.layers for lin in L.lins()] + ([self.lm_head] if self.lm_head is not None else [])
        for lin in lins:
            lin.threads = self.threads
        self.weight_bytes: tuple[int, int] | None = None  # weight bytes a decode step reads: (all dense, as packed)
        dense = [lin for lin in lins if lin.parts is None]  # (not those in a file's precision)
        if ckern and dense:  # the weights this runner streams, in the order it streams them, on huge pages
            sparse = os.environ.get("WSC_SPARSE_KERNELS", "1") != "0"
            enough, dense_b, read_b = pack_arena(dense, sparse)
            self.weight_bytes = (dense_b, read_b)
            if enough:
                how = "in sparse panels" if sparse else "kept dense (WSC_SPARSE_KERNELS=0)"
                print(f"serve: {enough} of {len(lins)} weight matrices (layers {lo}..{hi - 1}) sparse enough, {how}: "
                      f"{read_b / 1e6:.1f} MB of weights read per token ({dense_b / 1e6:.1f} MB dense)",
                      file=sys.stderr)
        # weight bytes: what every step reads, one expert of each MoE layer, and the decode steps' reads so far
        self.fixed_bytes = sum(L.fixed_bytes() for L in self.layers) + (
            self.lm_head.nbytes if self.lm_head is not None else 0)
        moes = [L.moe for L in self.layers if L.moe is not None]
        self.active_bytes = self.fixed_bytes + sum(m.top_k * m.expert_bytes(0) for m in moes)
        self.total_bytes = self.fixed_bytes + sum(m.expert_bytes(e) for m in moes for e in range(m.n))
        if moes:
            print(f"serve: {len(moes)} mixture-of-experts layers (layers {lo}..{hi - 1}), {moes[0].top_k} of "
                  f"{moes[0].n} experts per token: {self.active_bytes / 1e6:.1f} MB of weights read per decode token "
                  f"of one sequence, of {self.total_bytes / 1e6:.1f} MB", file=sys.stderr)
        self.decode_tokens = self.decode_bytes = 0
        self.cos_table = self.sin_table = None
        if cfg.position == "rotary":  # in the rotate-half layout over all hd dims (rotary_layout): the dims
            inv = model.blocks[0].attn.inv_freq.to(self.device)  # that do not rotate get frequency 0
            inv = torch.cat([inv, inv.new_zeros(cfg.head_dim // 2 - inv.shape[0])])
            cos, sin = rope_cos_sin(inv, 0, cfg.max_seq_len)  # (T, hd)
            half = cos.shape[-1] // 2
            sign = torch.cat([-torch.ones(half), torch.ones(half)]).to(self.device)
            self.cos_table, self.sin_table = cos.to(self.dtype), (sin * sign).to(self.dtype)
        self.window = cfg.sliding_window or 0
        self.slopes = model.blocks[0].attn.slopes.to(self.device, torch.float32).contiguous() \
            if cfg.position == "alibi" else None
        self.kv = KVPool(hi - lo, num_blocks, block_size, cfg.kv_heads, cfg.head_dim, self.kv_dtype, self.device)
        self.gqa = cfg.kv_heads != cfg.n_head
        self.stack = self._decode_stack(model) if self.c_attention else None
        self.stack_batch = self.stack is not None and not self.stack.moe  # (a mixture batches per layer)

    def _decode_stack(self, model: CausalLM) -> kernels.DecodeStack | None:
        """All of this runner's layers in one C call for single-stream decode, when every block is the
        Llama kind the kernels implement (sequential, RMSNorm, SwiGLU, or a mixture of bias-free SwiGLU experts;
        any positions, sliding window or not)."""
        blocks = [model.blocks[i] for i in range(self.lo, self.hi)]

        def mlps(L: ServedLayer) -> list[ServedMLP]:
            return [L.dense] if L.moe is None else L.moe.experts

        if not all(not L.parallel and all(m.swiglu for m in mlps(L)) for L in self.layers) or not all(
                isinstance(b.attn_norm, RMSNorm) and isinstance(b.mlp_norm, RMSNorm) for b in blocks) or any(
                L.moe is not None and (L.moe.top_k > 16 or any(e.up.bias is not None or e.down.bias is not None
                                                                for e in L.moe.experts)) for L in self.layers):
            return None
        stacked = [lin.stack_weight for L in self.layers for lin in (L.qkv, L.o, *(
            [L.dense.up, L.dense.down] if L.moe is None else [L.moe.router] + [x for e in L.moe.experts
                                                                               for x in (e.up, e.down)]))]
        if any(w is None or (isinstance(w, quant.QWeight) and any(L.moe is not None for L in self.layers))
               for w in stacked):  # parts of different types, or experts in a file's precision: layer by layer
            return None
        layers = []
        for i, (b, L) in enumerate(zip(blocks, self.layers)):
            d = dict(attn_norm=b.attn_norm.weight.detach().contiguous(), attn_eps=b.attn_norm.eps,
                     mlp_norm=b.mlp_norm.weight.detach().contiguous(), mlp_eps=b.mlp_norm.eps,
                     wqkv=L.qkv.stack_weight, bqkv=L.qkv.bias, wo=L.o.stack_weight, bo=L.o.bias, wgu=None, bgu=None,
                     wd=None, bd=None,
                     cache=self.kv.kv[i])
            if L.moe is None:
                d.update(wgu=L.dense.up.stack_weight, bgu=L.dense.up.bias, wd=L.dense.down.stack_weight,
                         bd=L.dense.down.bias)
            else:
                d.update(wr=L.moe.router.cw, top_k=L.moe.top_k, experts=[(e.up.cw, e.down.cw) for e in L.moe.experts])
            layers.append(d)
        L0 = self.layers[0]
        return kernels.DecodeStack(layers, L0.n_head, L0.n_kv, L0.hd, mlps(L0)[0].ffn, self.window, self.slopes)

    @torch.inference_mode()
    def run(self, spec: BatchSpec, x: Tensor | None = None) -> Tensor:
        """First stage: x is None (token ids come from the spec). Returns (N, C) activations, or (num samples,
        V) float32 logits from the last stage."""
        prev = torch.get_num_threads()
        if prev != 1:  # (in the engine's own process, already 1: serve/core.py)
            torch.set_num_threads(1)
        try:
            return self._run(spec, x)
        finally:
            if prev != 1:
                torch.set_num_threads(prev)

    def _run(self, spec: BatchSpec, x: Tensor | None) -> Tensor:
        moe_read = sum(L.moe.read for L in self.layers if L.moe is not None)
        if self.stack is not None and len(spec.token_ids) == 1:
            y = self._run_one(spec, x)
            if y is not None:
                self._count_decode(1, moe_read)
                return y
        P = Prepared(spec, self.block_size, self.cos_table, self.sin_table, self.device, self.window, self.slopes)
        if self.has_embed:
            x = self.embed.tok(P.input_ids) if self.embed_q is None else quant.take(self.embed_q, P.input_ids)
            if self.embed.pos is not None:
                x = x + self.embed.pos(P.positions)
        if self.stack_batch:  # every layer in one C call: decode rows and prefill chunks (serve/csrc/attention.c:
            # a short chunk's tokens attend one by one as decode tokens, a long one's in blocks)
            x = x.contiguous().clone() if not self.has_embed else x.contiguous()
            pos, tables = P.rows_c()
            x = self.stack.batch(x, pos, tables, self.block_size, self.cos_table, self.sin_table)
        else:
            for li, layer in enumerate(self.layers):
                x = self._layer(li, layer, x, P)
        if P.dec_all:
            self._count_decode(len(spec.token_ids), moe_read)
        if not self.has_head:
            return x
        if not P.all_sample:
            x = x[P.sample_rows]  # (num samples, C)
        return self.lm_head(self.head_norm(x)).float()

    def _count_decode(self, rows: int, moe_read_before: int) -> None:
        """A step of `rows` decode tokens ran: it read every fixed weight once and the experts its rows chose."""
        moe = sum(L.moe.read for L in self.layers if L.moe is not None) - moe_read_before
        self.decode_tokens += rows
        self.decode_bytes += self.fixed_bytes + moe

    def _run_one(self, spec: BatchSpec, x: Tensor | None) -> Tensor | None:
        """Single-stream decode (one token, one sequence, the KV of the positions it attends to in consecutive
        slots) through the C stack, without building a Prepared; None when the spec is not that."""
        start, n, table, sample = spec.chunks[0]
        bs = self.block_size
        blo = window_lo(start, self.window) // bs
        b0 = table[blo]
        if n != 1 or not sample or any(table[i] != b0 + i - blo for i in range(blo + 1, start // bs + 1)):
            return None
        if self.has_embed:
            tid = spec.token_ids[0]
            x = self.embed.tok.weight[tid:tid + 1].clone() if self.embed_q is None else \
                quant.take(self.embed_q, torch.tensor([tid]))  # (1, C)
            if self.embed.pos is not None:
                x += self.embed.pos.weight[start:start + 1]
        else:
            x = x.contiguous().clone()
        cos = sin = None
        if self.cos_table is not None:
            cos, sin = self.cos_table[start], self.sin_table[start]  # (hd,) views
        x = self.stack(x, cos, sin, (b0 - blo) * bs, start + 1)
        if self.stack.moe:  # the experts each layer ran
            for L, picked in zip(self.layers, self.stack.picked.tolist()):
                if L.moe is not None:
                    L.moe.read += sum(L.moe.expert_bytes(e) for e in picked[:L.moe.top_k])
        return self.lm_head(self.head_norm(x)).float() if self.has_head else x

    def _prefill_attention(self, q: Tensor, cache: Tensor, idx: Tensor | slice, mask: Tensor | None, causal: bool,
                           nkv: int) -> Tensor:
        """One prefill chunk's queries (T, nh, hd) against its sequence's cached KV -> (T, nh, hd)."""
        qi = q.transpose(0, 1).unsqueeze(0).contiguous()  # (1, nh, T, hd)
        kvi = (cache[:, idx] if isinstance(idx, slice) else cache.index_select(1, idx)).unsqueeze(0).to(q.dtype)
        if mask is not None and mask.is_floating_point():  # ALiBi's bias, made in float32
            mask = mask.to(q.dtype)
        par = self.threads > 1 and q.shape[0] >= 64  # (1, 2 nkv, S, hd) ^
        if par:
            torch.set_num_threads(self.threads)
        try:
            return F.scaled_dot_product_attention(qi, kvi[:, :nkv], kvi[:, nkv:], attn_mask=mask, is_causal=causal,
                                                  enable_gqa=self.gqa)[0].transpose(0, 1)
        finally:
            if par:
                torch.set_num_threads(1)

    def _layer(self, li: int, L: ServedLayer, x: Tensor, P: Prepared) -> Tensor:
        N = x.shape[0]
        nh, nkv, hd = L.n_head, L.n_kv, L.hd
        h = L.attn_norm(x)
        m = (h if L.mlp_norm is None else L.mlp_norm(x)) if L.parallel else None  # a parallel MLP's input
        qkv = L.qkv(h)  # (N, (nh + 2 nkv) hd): q | k | v
        if self.c_attention and P.dec_rows is not None:  # decode rows in C, prefill chunks through SDPA
            cache = self.kv.kv[li]
            y = x.new_empty(N, nh * hd)
            for r0, r1, idx, mask, causal in P.prefill:
                n = r1 - r0
                if P.cos is not None:
                    _rope_(qkv[r0:r1, :(nh + nkv) * hd].view(n, nh + nkv, hd), P.cos[r0:r1], P.sin[r0:r1])
                cache.index_copy_(1, P.slots[r0:r1],
                                  qkv[r0:r1, nh * hd:].view(n, 2 * nkv, hd).transpose(0, 1).to(cache.dtype))
                y[r0:r1] = self._prefill_attention(qkv[r0:r1, :nh * hd].view(n, nh, hd), cache, idx, mask, causal,
                                                   nkv).reshape(n, nh * hd)
            pos, tables = P.dec_c
            kernels.decode_attention_batch(qkv, P.dec_rows, pos, self.cos_table, self.sin_table, cache, tables,
                                           self.block_size, nh, nkv, y, self.window, self.slopes)
            return L.finish(x, y, m)
        if P.cos is not None:  # rotate q and k together, in place
            _rope_(qkv[:, :(nh + nkv) * hd].view(N, nh + nkv, hd), P.cos, P.sin)
        q = qkv[:, :nh * hd].view(N, nh, hd)
        cache = self.kv.kv[li]  # (2 nkv, slots, hd): k heads then v heads
        cache.index_copy_(1, P.slots, qkv[:, nh * hd:].view(N, 2 * nkv, hd).transpose(0, 1).to(cache.dtype))
        # (index_select, not advanced indexing: it stays on the calling thread's fast path)
        y = None if (P.dec_all or (len(P.prefill) == 1 and P.dec_rows is None)) else x.new_empty(N, nh, hd)
        for r0, r1, idx, mask, causal in P.prefill:
            yi = self._prefill_attention(q[r0:r1], cache, idx, mask, causal, nkv)
            if y is None:
                y = yi
            else:
                y[r0:r1] = yi
        if P.dec_rows is not None:
            qd = (q if P.dec_all else q[P.dec_rows]).unsqueeze(2)  # (B, nh, 1, hd)
            if P.dec_slice is not None:  # one sequence, contiguous KV: a view of the cache
                kvd = cache[:, P.dec_slice].unsqueeze(0).to(qd.dtype)  # (1, 2 nkv, S, hd)
                mask = P.dec_bias_one(kvd.shape[2])
            else:
                dec_slots, mask = P.dec_gather
                B, S = dec_slots.shape
                qd = qd.contiguous()
                kvd = cache.index_select(1, dec_slots.view(-1)).view(2 * nkv, B, S, hd).to(qd.dtype)
                kvd = kvd.transpose(0, 1).contiguous() if B > 1 else kvd.view(1, 2 * nkv, S, hd)  # (B, 2 nkv, S, hd)
            if mask is not None and mask.is_floating_point():
                mask = mask.to(qd.dtype)
            yd = F.scaled_dot_product_attention(qd, kvd[:, :nkv], kvd[:, nkv:], attn_mask=mask,
                                                enable_gqa=self.gqa).squeeze(2)  # (B, nh, hd)
            if P.dec_all:
                y = yd
            else:
                y[P.dec_rows] = yd
        return L.finish(x, y.reshape(N, nh * hd), m)
