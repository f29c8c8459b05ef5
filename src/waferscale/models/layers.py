"""Building blocks shared by every decoder family: norms, rotary embeddings, ALiBi, attention, MLPs, the block.

Every block is pre-norm: x = x + attn(norm(x)); x = x + mlp(norm(x)), or with parallel attention and MLP
(`cfg.block`) x = x + attn(norm1(x)) + mlp(norm2(x)). Shapes: B batch, T time, C d_model, nh query heads,
nkv key/value heads, hd head_dim, S key positions.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from waferscale.models.config import INITIALIZER_FIELDS, ModelConfig, RopeScaling
from waferscale.models.init import Initializer

# the families Model Zoo runs as its GPT-J model (the others of ours: as its GPT-2 model); see CausalLM.init_for
_GPTJ_MODEL = ("gptj", "gpt_neox", "falcon")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def make_norm(cfg: ModelConfig) -> nn.Module:
    if cfg.norm == "rmsnorm":
        return RMSNorm(cfg.d_model, cfg.norm_eps)
    return nn.LayerNorm(cfg.d_model, eps=cfg.norm_eps, bias=cfg.norm_bias)


# ---- rotary position embeddings (Hugging Face "rotate_half" layout, or GPT-J's interleaved pairs) -----------

def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None, device=None) -> Tensor:
    """(hd/2,) inverse frequencies; with Llama-3.1 scaling, low frequencies are divided by `factor`."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    if scaling is None:
        return inv.float()
    low_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv
    smooth = (scaling.original_max_position_embeddings / wavelen - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor)
    scaled = torch.where(wavelen > low_wavelen, inv / scaling.factor, inv)
    mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    scaled = torch.where(mid, (1 - smooth) * inv / scaling.factor + smooth * inv, scaled)
    return scaled.float()


def rope_cos_sin(inv_freq: Tensor, start: int, length: int, interleaved: bool = False) -> tuple[Tensor, Tensor]:
    """cos, sin of shape (T, hd) for positions start .. start+T-1 (hd = 2 * len(inv_freq), the rotated dims)."""
    pos = torch.arange(start, start + length, device=inv_freq.device, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)  # (T, hd/2)
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)  # (T, hd)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """x: (B, n, T, hd); cos/sin: (T, hd). Pairs (i, i + hd/2) rotate together, or (2i, 2i+1) if interleaved."""
    if interleaved:
        rotated = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    else:
        x1, x2 = x.chunk(2, dim=-1)
        rotated = torch.cat((-x2, x1), dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


def alibi_slopes(n_head: int) -> Tensor:
    """(nh,) ALiBi slopes (Press et al. 2022): 2^(-8i/n), i = 1..n, for n = 2^k heads; other head counts take the
    slopes of the power of two below, then the ones between them from the power above (as MPT and BLOOM)."""
    n = 2 ** math.ceil(math.log2(n_head))
    slopes = 2.0 ** (-8.0 * torch.arange(1, n + 1, dtype=torch.float64) / n)
    if n != n_head:
        slopes = torch.cat((slopes[1::2], slopes[::2]))[:n_head]
    return slopes.float()


# ---- KV cache ------------------------------------------------------------------------------------------

class KVCache(nn.Module):
    """A contiguous per-layer cache: k, v of shape (B, nkv, max_T, hd). Positions are written in order."""

    def __init__(self, batch: int, n_kv_head: int, max_len: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        shape = (batch, n_kv_head, max_len, head_dim)
        self.register_buffer("k", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, start: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        end = start + k.shape[2]
        if end > self.k.shape[2]:
            raise ValueError(f"KV cache holds {self.k.shape[2]} positions; asked to write up to {end}")
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        return self.k[:, :, :end], self.v[:, :, :end]


# ---- attention and MLP ---------------------------------------------------------------------------------

class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.n_head, self.n_kv, self.hd = cfg.n_head, cfg.kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.d_model, self.n_head * self.hd, bias=cfg.attn_bias)
        self.k_proj = nn.Linear(cfg.d_model, self.n_kv * self.hd, bias=cfg.attn_bias)
        self.v_proj = nn.Linear(cfg.d_model, self.n_kv * self.hd, bias=cfg.attn_bias)
        self.o_proj = nn.Linear(self.n_head * self.hd, cfg.d_model, bias=cfg.attn_bias)
        self.dropout = cfg.dropout
        self.rotary, self.rot_dim, self.interleaved = cfg.position == "rotary", cfg.rotary_dims, cfg.rotary_interleaved
        self.alibi, self.window = cfg.position == "alibi", cfg.sliding_window
        # None: SDPA's own 1 / sqrt(hd); muP's alpha / hd (or alpha / sqrt(hd)) otherwise
        self.scale = cfg.attention_scale if (cfg.scale_qk_dot_by_d or cfg.attention_logits_alpha != 1.0) else None
        self.init_buffers()

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """The non-persistent buffers (rotary frequencies, ALiBi slopes), computed on the CPU, moved to `device`."""
        cfg = self.cfg
        if self.rotary:
            inv = rope_inv_freq(self.rot_dim, cfg.rope_theta, cfg.rope_scaling)
            self.register_buffer("inv_freq", inv.to(device) if device is not None else inv, persistent=False)
        if self.alibi:
            slopes = alibi_slopes(self.n_head)
            self.register_buffer("slopes", slopes.to(device) if device is not None else slopes, persistent=False)

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if self.rot_dim == self.hd:
            return apply_rope(x, cos, sin, self.interleaved)
        rot, keep = x.split((self.rot_dim, self.hd - self.rot_dim), dim=-1)  # partial rotary: the rest pass through
        return torch.cat((apply_rope(rot, cos, sin, self.interleaved), keep), dim=-1)

    def _mask(self, start_pos: int, T: int, S: int, k_start: int, dtype: torch.dtype,
              device: torch.device) -> tuple[Tensor | None, bool]:
        """(attn_mask, is_causal) for T queries at start_pos.. over S keys at k_start.."""
        if not (self.alibi or self.window):
            if S == T:
                return None, True
            qpos = torch.arange(start_pos, start_pos + T, device=device)[:, None]  # queries sit later in the keys
            return qpos >= torch.arange(S, device=device)[None, :], False  # (T, S)
        rel = (torch.arange(k_start, k_start + S, device=device)[None, :]
               - torch.arange(start_pos, start_pos + T, device=device)[:, None])  # (T, S) key - query position
        allowed = rel <= 0
        if self.window:
            allowed &= rel > -self.window
        if not self.alibi:
            return allowed, False
        bias = self.slopes[:, None, None] * rel.float()  # (nh, T, S): linear in distance, 0 on the diagonal
        return bias.masked_fill(~allowed, float("-inf")).to(dtype), False

    def forward(self, x: Tensor, start_pos: int = 0, kv_cache: KVCache | None = None) -> Tensor:
        B, T, C = x.shape
        q = self.q_proj(x).view(B, T, self.n_head, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        if self.rotary:
            cos, sin = rope_cos_sin(self.inv_freq, start_pos, T, self.interleaved)
            q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        if kv_cache is not None:
            k, v = kv_cache.update(start_pos, k, v)  # (B, nkv, start_pos+T, hd)
        first = start_pos + T - k.shape[2]  # position of key 0: 0 with a cache, start_pos without
        if self.window:  # keys older than the first query's window are seen by no query: leave them out
            drop = max(0, start_pos + 1 - self.window - first)
            k, v, first = k[:, :, drop:], v[:, :, drop:], first + drop  # (B, nkv, S, hd)
        mask, causal = self._mask(start_pos, T, k.shape[2], first, q.dtype, x.device)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, dropout_p=self.dropout if self.training else 0.0,
            scale=self.scale, enable_gqa=self.n_kv != self.n_head)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, self.n_head * self.hd)  # (B, T, C)
        return self.o_proj(y)


class MLP(nn.Module):
    """Two-matrix MLP (GPT): down(act(up(x)))."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.mlp_bias)
        self.act = {"gelu": nn.GELU(), "gelu_tanh": nn.GELU(approximate="tanh"), "relu": nn.ReLU()}[cfg.activation]

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class SwiGLU(nn.Module):
    """Gated MLP (Llama): down(silu(gate(x)) * up(x)); activation geglu (T5 v1.1) gates with tanh-GELU."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.act = partial(F.gelu, approximate="tanh") if cfg.activation == "geglu" else F.silu
        self.gate_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.d_model, cfg.ffn_dim, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.ffn_dim, cfg.d_model, bias=cfg.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """A mixture of experts (Mixtral): a router (linear, no bias) scores the E experts for every token, the top k
    run on it and their outputs are summed with the softmax of their scores renormalized over the k. Each expert
    computes only the tokens routed to it (gathered, then added back).

    (B, T, C) -> ((B, T, C), statistics (2, E)): per expert, the mean router probability (with its gradient) and
    the fraction of tokens routed to it (no gradient), what `load_balancing_loss` reads.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.n_experts, cfg.experts_per_token
        self.router = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        self.experts = nn.ModuleList(SwiGLU(cfg) if cfg.gated_mlp else MLP(cfg)
                                     for _ in range(cfg.n_experts))

    def _slot_counts(self, chosen: Tensor) -> Tensor:
        """(E,) how many (token, choice) slots each expert got. A meta tensor has no values: an even split (the
        memory planner's dry run needs sizes only, and the experts' rows sum to N * k whatever the routing)."""
        if chosen.is_meta:
            q, r = divmod(chosen.numel(), self.n_experts)
            return torch.tensor([q + (e < r) for e in range(self.n_experts)])
        return torch.bincount(chosen.reshape(-1), minlength=self.n_experts)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        B, T, C = x.shape
        h = x.reshape(-1, C)  # (N, C)
        probs = F.softmax(self.router(h), dim=-1, dtype=torch.float32)  # (N, E), fp32 under any autocast
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (N, k)
        weights = weights / weights.sum(-1, keepdim=True)
        counts = self._slot_counts(chosen)
        sizes = counts.tolist()
        slots = chosen.reshape(-1).argsort(stable=True)  # (N * k,) slot ids grouped by expert
        out = torch.zeros_like(h)
        for expert, n, idx in zip(self.experts, sizes, slots.split(sizes)):
            if n:
                rows = idx // self.top_k  # the tokens of these slots
                y = expert(h.index_select(0, rows)) * weights.view(-1)[idx, None]  # (n, C)
                out.index_add_(0, rows, y.to(out.dtype))
        load = counts.to(probs.device, probs.dtype) / h.shape[0]
        return out.view(B, T, C), torch.stack((probs.mean(0), load))  # (B, T, C), (2, E)


def load_balancing_loss(stats: list[Tensor]) -> Tensor:
    """The router's load-balancing loss (Switch Transformer, eqs. 4-6) as Mixtral trains with it, transformers'
    `load_balancing_loss_func`: over every MoE layer's tokens together, E * sum_e f_e * P_e with f_e the fraction
    of routed (token, choice) slots that went to expert e and P_e its mean router probability. `stats`: each MoE
    layer's (2, E) statistics (`MoE.forward`); every layer sees the same tokens, so the means over all of them
    are the means of the layers' means."""
    p, f = torch.stack(stats).mean(0)  # (E,), (E,)
    return p.shape[0] * (p * f).sum()


class Block(nn.Module):
    """One transformer layer, a streamable unit: (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.parallel = cfg.block != "sequential"
        self.attn_norm = make_norm(cfg)
        self.attn = Attention(cfg)
        self.mlp_norm = None if cfg.block == "parallel_shared_norm" else make_norm(cfg)
        self.moe = cfg.n_experts > 0
        self.mlp = MoE(cfg) if self.moe else SwiGLU(cfg) if cfg.gated_mlp else MLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor, start_pos: int = 0, kv_cache: KVCache | None = None) -> Tensor:
        if self.parallel:  # attention and MLP both read the block's input
            h = self.attn_norm(x)
            m = h if self.mlp_norm is None else self.mlp_norm(x)
            return x + self.drop(self.attn(h, start_pos, kv_cache)) + self.drop(self.mlp(m))
        x = x + self.drop(self.attn(self.attn_norm(x), start_pos, kv_cache))
        if self.moe:  # the router's statistics leave beside the activations (see CausalLM.forward_aux)
            y, stats = self.mlp(self.mlp_norm(x))
            return x + self.drop(y), stats
        return x + self.drop(self.mlp(self.mlp_norm(x)))


# ---- the three kinds of streamable unit and the model that chains them ---------------------------------

class Embedding(nn.Module):
    """Unit 0: token ids (B, T) -> activations (B, T, C); learned positions where the config has them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.position == "learned" else None
        self.drop = nn.Dropout(cfg.dropout)
        self.max_seq_len = cfg.max_seq_len
        self.scale = cfg.embeddings_scale  # muP's embedding multiplier (1: none)

    def forward(self, idx: Tensor, start_pos: int = 0) -> Tensor:
        T = idx.shape[1]
        if start_pos + T > self.max_seq_len:
            raise ValueError(f"sequence of {start_pos + T} tokens exceeds max_seq_len {self.max_seq_len}")
        x = self.tok(idx)  # (B, T, C)
        if self.pos is not None:
            x = x + self.pos(torch.arange(start_pos, start_pos + T, device=idx.device))
        if self.scale != 1.0:
            x = x * self.scale
        return self.drop(x)


class Head(nn.Module):
    """Last unit: final norm and the LM head, (B, T, C) -> logits (B, T, V)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=cfg.lm_head_bias)
        self.scale = cfg.output_logits_scale  # muP's output multiplier (1: none)

    def forward(self, x: Tensor) -> Tensor:
        logits = self.lm_head(self.norm(x))
        return logits * self.scale if self.scale != 1.0 else logits


class CausalLM(nn.Module):
    """embedding -> blocks -> head. `units()` lists them in order for runtimes that run unit by unit."""

    # the modules of the three kinds of unit (an encoder family builds its own)
    embedding_cls, block_cls, head_cls = Embedding, Block, Head

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = self.embedding_cls(cfg)
        self.blocks = nn.ModuleList(self.block_cls(cfg) for _ in range(cfg.n_layer))
        self.head = self.head_cls(cfg)
        if cfg.tie_embeddings:
            self.head.lm_head.weight = self.embed.tok.weight
        if not self.head.lm_head.weight.is_meta:
            self.reset_parameters()

    def units(self) -> list[nn.Module]:
        return [self.embed, *self.blocks, self.head]

    def forward(self, idx: Tensor, start_pos: int = 0, kv_caches: list[KVCache] | None = None,
                with_aux: bool = False) -> Tensor | tuple[Tensor, Tensor | None]:
        """idx (B, T) int64 -> logits (B, T, V); `with_aux`: (logits, the auxiliary term of the training loss:
        `aux_loss` of the statistics the units return beside their output, a mixture of experts' router
        statistics; None when no unit returns any)."""
        x = self.embed(idx, start_pos)
        stats = []
        for i, block in enumerate(self.blocks):
            x = block(x, start_pos, kv_caches[i] if kv_caches is not None else None)
            if isinstance(x, tuple):
                x, s = x
                stats.append(s)
        logits = self.head(x)
        return (logits, self.aux_loss(stats) if stats else None) if with_aux else logits

    def forward_aux(self, idx: Tensor, start_pos: int = 0, kv_caches: list[KVCache] | None = None
                    ) -> tuple[Tensor, Tensor | None]:
        """(logits, auxiliary loss) through the module's call, so its forward hooks (a sparsity algorithm's
        pruning) run as they do for `model(idx)`."""
        return self(idx, start_pos, kv_caches, with_aux=True)

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """The training loss of the model's output against the executors' (B, T) targets (the executors and the
        streaming engine's fused head call it): mean cross-entropy over the targets that are not -100."""
        return lm_loss(logits, targets)

    def aux_loss(self, stats: list[Tensor]) -> Tensor:
        """The auxiliary training loss from the statistics the units returned, in unit order (the streaming
        engine calls it with each micro-batch's): the router's weighted load-balancing loss."""
        return self.config.router_aux_loss_coef * load_balancing_loss(stats)

    def make_kv_caches(self, batch: int, max_len: int, dtype: torch.dtype | None = None,
                       device: torch.device | str | None = None) -> list[KVCache]:
        cfg = self.config
        p = self.head.lm_head.weight
        return [KVCache(batch, cfg.kv_heads, max_len, cfg.head_dim, dtype or p.dtype, device or p.device)
                for _ in range(cfg.n_layer)]

    @torch.no_grad()
    def init_parameter(self, name: str, t: Tensor) -> None:
        """The initialisation of parameter `name` (its values `t`): `reset_parameters` applies it to each, MemoryX
        to the weights of a model built on the meta device. Norms 1, biases 0; the matrices as `init_for` says."""
        if t.ndim == 1:
            t.fill_(1.0) if name.endswith("norm.weight") else t.zero_()
        else:
            self.init_for(name)(t)

    def init_for(self, name: str) -> Initializer:
        """The initializer of matrix `name`, as Model Zoo's models apply the config's (ModelConfig's comment says
        which covers what). Model Zoo's GPT-2 model (our gpt, llama, mistral, mixtral, mpt) falls back from a
        missing one to the next in its line; its GPT-J model (our gptj, gpt_neox, falcon) gives the MLP the output
        layer's initializer and nothing the input projections'. What is left once the file gives some: Model Zoo's
        default truncated_normal(0, init_std) within 2 stds (the GPT-2 model's output projections' over
        sqrt(2 n_layer) unless an initializer is given); when it gives none: GPT-2's N(0, init_std), output
        projections N(0, init_std / sqrt(2 n_layer)). An untied LM head is N(0, init_std) always (Model Zoo's too)."""
        cfg = self.config
        if any(getattr(cfg, k) is not None for k in INITIALIZER_FIELDS):
            default = Initializer("truncated_normal", mean=0.0, std=cfg.init_std)
            depth_scaled = default if cfg.family in _GPTJ_MODEL else default.scaled((2 * cfg.n_layer) ** -0.5)
        else:
            default = Initializer("normal", std=cfg.init_std)
            depth_scaled = Initializer("normal", std=cfg.init_std / math.sqrt(2 * cfg.n_layer))
        if name.startswith("embed."):
            return cfg.embedding_initializer or default
        if not name.startswith("blocks."):  # an untied head
            return Initializer("normal", std=cfg.init_std)
        out = name.endswith("o_proj.weight")
        mlp_in, mlp_out = name.endswith(("up_proj.weight", "gate_proj.weight")), name.endswith("down_proj.weight")
        if cfg.family in _GPTJ_MODEL:
            chain = ((cfg.output_layer_initializer, depth_scaled) if out else
                     (cfg.ffn_initializer, cfg.output_layer_initializer, default) if mlp_in else
                     (cfg.ffn_output_layer_initializer, cfg.output_layer_initializer, depth_scaled) if mlp_out else
                     (cfg.initializer, default))
        else:
            chain = ((cfg.output_layer_initializer, cfg.initializer, depth_scaled) if out else
                     (cfg.ffn_initializer, cfg.initializer, default) if mlp_in else
                     (cfg.ffn_output_layer_initializer, cfg.output_layer_initializer, cfg.ffn_initializer,
                      cfg.initializer, depth_scaled) if mlp_out else
                     (cfg.initializer, default))
        return next(i for i in chain if i is not None)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        for name, p in self.named_parameters():
            self.init_parameter(name, p)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def init_buffers(self, device: torch.device | str = "cpu") -> None:
        """Compute the non-persistent buffers (rotary frequencies, ALiBi slopes) on the CPU and move them to
        `device`: a model built on the meta device gets real ones."""
        for block in self.blocks:
            block.attn.init_buffers(device)


def lm_loss(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy over all target tokens (Model Zoo `loss_scaling: num_tokens`)."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=ignore_index)
