"""Capture a model into the compiler IR on the meta device. The only torch import in `compiler/`.

Three inputs: a zoo model name, a ModelConfig (what a params file describes: the caller reads the file, see
`waferscale.zoo.wafer`), or any `nn.Module` with a sample input. Nothing is materialized: zoo models are built on
the meta device and walked unit by unit; arbitrary modules run once on meta tensors
(`torch.func.functional_call`) with forward hooks recording the shape every leaf module saw.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Sequence

import torch
from torch import nn

from waferscale.compiler.ir import FFN_DOWN, Graph, MatMul, Unit
from waferscale.errors import ConfigError

if TYPE_CHECKING:
    from waferscale.models import ModelConfig

_FUSE = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
_HALF = {"bfloat16": "bf16", "float16": "fp16", None: "fp32"}


# the families whose units (embedding, blocks with their experts, head) the compiler captures and projects
COMPILED_FAMILIES = ("gpt", "llama", "gptj", "gpt_neox", "falcon", "mpt", "mistral", "mixtral", "bert", "roberta",
                     "t5")

def capture_zoo(name: str, dtype: str = "fp16") -> Graph:
    """A zoo preset by name (e.g. "llama3.1-70b"), walked unit by unit on the meta device."""
    from waferscale.models import config_from_name

    cfg = config_from_name(name)
    return capture_config(cfg, source=f"zoo:{cfg.name}", dtype=dtype)


def dtype_label(half_dtype: str | None) -> str:
    """The graph's dtype for a model's mixed-precision setting: 'bfloat16' -> 'bf16', 'float16' -> 'fp16', None
    (fp32 training) -> 'fp32'."""
    return _HALF.get(half_dtype, "fp16")


def capture_config(cfg: ModelConfig, *, source: str, dtype: str = "fp16",
                   defaults: Mapping[str, Any] | None = None) -> Graph:
    """A model config (a zoo model's shape), walked unit by unit on the meta device. `defaults` are the
    workload's own sizes, used where the request gives none (batch_size, seq_len, num_csx, micro_batch_size).
    ConfigError for a family the compiler does not project."""
    from waferscale.models import build

    if cfg.family not in COMPILED_FAMILIES:
        raise ConfigError(f"the wafer compiler cannot place or project family {cfg.family!r} ({cfg.name}); it "
                          f"compiles {', '.join(COMPILED_FAMILIES)}")

    model = build(cfg, device="meta")
    capture = _capture_t5 if cfg.is_encoder_decoder else _capture_causal_lm
    g = capture(model, source=source, dtype=dtype)
    return dataclasses.replace(g, defaults=dict(defaults)) if defaults else g


def _capture_causal_lm(model: nn.Module, *, source: str, dtype: str) -> Graph:
    cfg = model.config
    units = list(model.units())
    owner: dict[int, int] = {}  # id(param) -> index of the unit that owns it (the last unit using it)
    for i in reversed(range(len(units))):
        for p in units[i].parameters():
            owner.setdefault(id(p), i)
    d, ffn = cfg.d_model, cfg.ffn_dim
    kinds = ["embed"] + ["block"] * cfg.n_layer + ["head"]
    names = unit_names(cfg.n_layer)
    act = ffn * (2 if cfg.activation == "swiglu" else 1)
    out: list[Unit] = []
    for i, (mod, kind, name) in enumerate(zip(units, kinds, names)):
        experts = list(mod.mlp.experts) if kind == "block" and cfg.n_experts else []
        own = {id(p) for e in experts for p in e.parameters()}  # an expert's weights are its own unit's
        params = sum(p.numel() for p in mod.parameters() if owner[id(p)] == i and id(p) not in own)
        shared = [p for p in mod.parameters() if owner[id(p)] != i]
        tied = names[owner[id(shared[0])]] if shared else None
        tied_params = sum(p.numel() for p in shared)
        mms = tuple(mm for mm, _ in _matmul_members(mod, skip="mlp.experts." if experts else None))
        if kind == "embed":
            out.append(Unit(name, kind, params, (), d_in=1, d_out=d, tied_to=tied, tied_params=tied_params,
                            elementwise_flops_per_token=d if cfg.position == "learned" else 0))
        elif kind == "block":
            moe = dict(n_experts=cfg.n_experts, experts_per_token=cfg.experts_per_token) if experts else {}
            out.append(Unit(name, kind, params, mms, d_in=d, d_out=d, n_heads=cfg.n_head, head_dim=cfg.head_dim,
                            kv_heads=cfg.kv_heads, norm_width=d, n_norms=2,
                            # an MoE block's FFN activation is its experts' (the block adds the k weighted outputs)
                            elementwise_flops_per_token=2 * d + (cfg.experts_per_token * d if experts else act),
                            # kept for backward: norm inputs, attention output, residual (4d), every matmul
                            # output, the activation output; attention scores recomputed (flash-style)
                            train_act_elems_per_token=4 * d + sum(m.m for m in mms) + (0 if experts else ffn),
                            **moe))
            for e, expert in enumerate(experts):  # each expert a unit: its own region, the tokens routed to it
                emms = tuple(mm for mm, _ in _matmul_members(expert))
                out.append(Unit(f"{name}.expert{e}", "expert", sum(p.numel() for p in expert.parameters()), emms,
                                d_in=d, d_out=d, elementwise_flops_per_token=act,
                                train_act_elems_per_token=d + sum(m.m for m in emms) + ffn, expert_of=name, **moe))
        else:
            out.append(Unit(name, kind, params, mms, d_in=d, d_out=cfg.vocab_size, norm_width=d, n_norms=1,
                            train_act_elems_per_token=2 * d + cfg.vocab_size))
    return Graph(name=cfg.name, source=source, units=tuple(out), dtype=dtype, max_seq_len=cfg.max_seq_len,
                 arch="encoder" if cfg.is_encoder else "decoder")


def _owners(units: list[nn.Module]) -> dict[int, int]:
    """id(param) -> index of the unit that owns it (the last unit using it)."""
    owner: dict[int, int] = {}
    for i in reversed(range(len(units))):
        for p in units[i].parameters():
            owner.setdefault(id(p), i)
    return owner


def _capture_t5(model: nn.Module, *, source: str, dtype: str) -> Graph:
    """An encoder-decoder (`models.t5.T5`): embedding, encoder layers, the encoder's final norm, decoder layers,
    head. Each decoder layer's cross-attention key and value projections become a unit of their own
    ("decN.cross_kv", of the encoder's stack: they run once per input, over the encoder's output), all placed
    after the encoder's norm so that the decoder's layers stay neighbours in the pipeline; layer N keeps the keys
    and values unit N hands it and attends over them (`cross_ctx` = the encoder's length)."""
    cfg = model.config
    units = list(model.units())
    owner = _owners(units)
    d, ffn, L = cfg.d_model, cfg.ffn_dim, cfg.max_seq_len
    inner = cfg.n_head * cfg.head_dim
    act = ffn * (2 if cfg.gated_mlp else 1)
    n_enc = cfg.n_layer
    names = ["embed"] + [f"enc{i}" for i in range(n_enc)] + ["enc_norm"] + \
        [f"dec{i}" for i in range(cfg.decoder_layers)] + ["head"]
    out: list[Unit] = []
    cross_units: list[Unit] = []  # joined after the encoder's norm
    for i, (mod, name) in enumerate(zip(units, names)):
        cross = [mod.cross.k_proj, mod.cross.v_proj] if name.startswith("dec") else []
        split = {id(p) for lin in cross for p in lin.parameters()}
        params = sum(p.numel() for p in mod.parameters() if owner[id(p)] == i and id(p) not in split)
        shared = [p for p in mod.parameters() if owner[id(p)] != i]
        tied = names[owner[id(shared[0])]] if shared else None
        tied_params = sum(p.numel() for p in shared)
        mms = tuple(mm for mm, _ in _matmul_members(mod, skip=("cross.k_proj", "cross.v_proj")))
        heads = dict(n_heads=cfg.n_head, head_dim=cfg.head_dim, kv_heads=cfg.n_head, norm_width=d, d_in=d, d_out=d,
                     tied_to=tied, tied_params=tied_params)
        if name == "embed":
            out.append(Unit(name, "embed", params, (), d_in=1, d_out=d, tied_to=tied, tied_params=tied_params))
        elif name.startswith("enc") and name != "enc_norm":
            out.append(Unit(name, "block", params, mms, n_norms=2, elementwise_flops_per_token=2 * d + act,
                            train_act_elems_per_token=4 * d + sum(m.m for m in mms) + ffn, stack="encoder", **heads))
        elif name == "enc_norm":
            out.append(Unit(name, "module", params, (), d_in=d, d_out=d, norm_width=d, n_norms=1,
                            train_act_elems_per_token=d, stack="encoder"))
        elif name.startswith("dec"):
            cross_units.append(Unit(f"{name}.cross_kv", "module", sum(p.numel() for lin in cross for p in lin.parameters()),
                            (MatMul("cross_kv", 2 * inner, d),), d_in=d, d_out=2 * inner,
                            train_act_elems_per_token=d + 2 * inner, stack="encoder"))
            out.append(Unit(name, "block", params, mms, n_norms=3, elementwise_flops_per_token=3 * d + act,
                            train_act_elems_per_token=6 * d + sum(m.m for m in mms) + ffn, stack="decoder",
                            cross_heads=cfg.n_head, cross_ctx=L, **heads))
        else:
            out.append(Unit(name, "head", params, mms, d_in=d, d_out=cfg.vocab_size, norm_width=d, n_norms=1,
                            train_act_elems_per_token=2 * d + cfg.vocab_size, stack="decoder", tied_to=tied,
                            tied_params=tied_params))
    at = n_enc + 2  # after the embedding, the encoder's layers and its norm
    return Graph(name=cfg.name, source=source, units=tuple(out[:at] + cross_units + out[at:]), dtype=dtype,
                 max_seq_len=L, arch="encoder_decoder")


def unit_names(n_layer: int) -> list[str]:
    """The units of a zoo model (`model.units()`), as the graph names them."""
    return ["embed"] + [f"block{i}" for i in range(n_layer)] + ["head"]


def _matmul_members(mod: nn.Module, skip: str | tuple[str, ...] | None = None) -> list[tuple[MatMul, list[nn.Linear]]]:
    """nn.Linear layers of a unit (but those under the prefix `skip`); q/k/v and gate/up (same input) fused
    into one GEMV as a compiler would: each matrix with the layers it fuses."""
    groups: "OrderedDict[str, list[nn.Linear]]" = OrderedDict()
    leaves: dict[str, str] = {}  # the leaf name of a group's first layer (a group of one keeps its own name)
    for qual, m in mod.named_modules():
        if isinstance(m, nn.Linear) and not (skip and qual.startswith(skip)):
            parent, _, leaf = qual.rpartition(".")
            key = f"{parent}.{_FUSE.get(leaf, leaf)}" if parent else _FUSE.get(leaf, leaf)
            groups.setdefault(key, []).append(m)
            leaves.setdefault(key, leaf)
    out = []
    for key, ms in groups.items():
        if len({m.in_features for m in ms}) != 1:  # not a shared input: keep them apart
            out += [(MatMul(f"{key}.{j}", m.out_features, m.in_features), [m]) for j, m in enumerate(ms)]
        else:
            leaf = key.rpartition(".")[2] if len(ms) > 1 else leaves[key]
            out.append((MatMul(leaf, sum(m.out_features for m in ms), ms[0].in_features), ms))
    return out


# ---- sparsity: a params file's section, and what a real model's weights and activations hold ---------------

def section_sparsity(cfg: ModelConfig, section: Any, step: int | None = None) -> dict[str, float]:
    """Fraction of zero weights per matrix ("unit.matmul") that a params file's `sparsity:` section sets: the
    parameters its groups select (`waferscale.sparse.configure`, `Group.select`) at each algorithm's target
    at `step` (the run's last step; 0 when unknown). A fused matrix (q/k/v, gate/up) takes its members'
    size-weighted mean. Under the default filter embeddings and the LM head stay dense, tied or not, as in
    Cerebras' (which names them `*embedding*` and `lm_head`; the zoo's embedding is `embed.tok`)."""
    from waferscale.models import build
    from waferscale.sparse import configure

    with warnings.catch_warnings():  # the params loader has already said that `type` is `algorithm`'s old name
        warnings.simplefilter("ignore", DeprecationWarning)
        group = configure(section)
    model = build(cfg, device="meta")
    embeds = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    default = {id(a) for f, a in zip(group.filters, group.algorithms) if f is None}
    picked = {id(p): algo.sparsity_at(step or 0) for name, p, algo in group.select(model.named_parameters())
              if not (id(algo) in default and (id(p) in embeds or "lm_head" in name))}
    out = {}
    for uname, mod in zip(unit_names(cfg.n_layer), model.units()):
        for mm, members in _matmul_members(mod):
            zeros = sum(picked.get(id(m.weight), 0.0) * m.weight.numel() for m in members)
            if zeros:
                out[f"{uname}.{mm.name}"] = zeros / sum(m.weight.numel() for m in members)
    return out


@torch.no_grad()
def measure_sparsity(model: nn.Module, ids: torch.Tensor, threshold: float) -> list[dict[str, Any]]:
    """Per unit of a zoo model (embedding, blocks, head): its matrices' weight sparsity (exact zeros, tables
    included; and their `<name>_mask` buffers' when present), and for a block the activation entering its FFN
    down-projection on the batch `ids` (B, T), taken by forward pre-hooks: the fraction of exact zeros (what
    the wafer's cores skip) and of |a| < threshold (what thresholding would add)."""
    acts: dict[str, list[int]] = {}
    hooks = []
    names = unit_names(model.config.n_layer)
    for uname, mod in zip(names, model.units()):
        for qual, m in mod.named_modules():
            if isinstance(m, nn.Linear) and qual.rpartition(".")[2] in FFN_DOWN:
                def hook(_m, args, uname=uname):
                    a = args[0]
                    n = acts.setdefault(uname, [0, 0, 0])
                    n[0] += int((a == 0).sum())
                    n[1] += int((a.abs() < threshold).sum())
                    n[2] += a.numel()
                hooks.append(m.register_forward_pre_hook(hook))
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    rows = []
    for uname, mod in zip(names, model.units()):
        mats = [(n, p) for n, p in mod.named_parameters() if p.ndim > 1]
        masks = [b for n, b in mod.named_buffers() if n.endswith("_mask")]
        size = sum(p.numel() for _, p in mats)
        a = acts.get(uname)
        rows.append({"layer": uname, "matrix_params": size,
                     "weight_sparsity": sum(int((p == 0).sum()) for _, p in mats) / size if size else None,
                     "mask_sparsity": 1 - sum(int(b.sum()) for b in masks) / sum(b.numel() for b in masks)
                     if masks else None,
                     "activation_exact_zero": a[0] / a[2] if a else None,
                     "activation_near_zero": a[1] / a[2] if a else None, "activation_values": a[2] if a else 0})
    return rows


# ---- arbitrary nn.Module ---------------------------------------------------------------------------------

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


def capture_module(module: nn.Module, example: "torch.Tensor | Sequence[int] | None" = None, *,
                   dtype: str = "fp16", name: str | None = None) -> Graph:
    """Any nn.Module, run once on the meta device with a sample input (a tensor or a shape; integer token ids
    when the first layer is an nn.Embedding). A token is one row of the input (all but its last dimension),
    or one id for integer input. Units are the module's top-level layers (containers are opened)."""
    if not isinstance(module, nn.Module):
        raise ConfigError(f"module must be a torch.nn.Module, got {type(module).__name__}")
    name = name or type(module).__name__
    x = _example_input(module, example)
    tokens = x.numel() if not x.is_floating_point() else max(1, x.numel() // max(1, x.shape[-1]))
    records: list[tuple[str, nn.Module, tuple, tuple]] = []  # (qualified name, leaf, input shape, output shape)
    hooks = []
    for qual, m in module.named_modules():
        if next(m.children(), None) is None or isinstance(m, nn.MultiheadAttention):
            def hook(mod, args, output, qual=qual):
                ins = next((a for a in args if isinstance(a, torch.Tensor)), None)
                outs = output[0] if isinstance(output, (tuple, list)) else output
                records.append((qual, mod, tuple(ins.shape) if ins is not None else (),
                                tuple(outs.shape) if isinstance(outs, torch.Tensor) else ()))
            hooks.append(m.register_forward_hook(hook))
    # tied parameters appear once; functional_call(tie_weights=True) feeds every alias from that one entry
    meta_state = {k: torch.empty_like(v, device="meta")
                  for k, v in [*module.named_parameters(), *module.named_buffers()]}
    try:
        with torch.no_grad():
            torch.func.functional_call(module, meta_state, (x,), strict=False, tie_weights=True)
    except Exception as e:  # a user module failing on meta tensors is a user-facing input problem
        raise ConfigError(f"could not trace {name} on the meta device with input {tuple(x.shape)} "
                          f"({type(e).__name__}: {e}); pass a sample input shape that its forward accepts") from None
    finally:
        for h in hooks:
            h.remove()
    if not records:
        raise ConfigError(f"{name}: the forward pass called no modules; nothing to place")
    return _group_records(module, records, tokens, name, dtype)


def _example_input(module: nn.Module, example: Any) -> torch.Tensor:
    first = next((m for m in module.modules() if next(m.children(), None) is None and any(True for _ in m.parameters())),
                 None)
    if isinstance(example, torch.Tensor):
        return torch.empty_like(example, device="meta")
    if example is None:
        if isinstance(first, nn.Embedding):
            example = (1, 128)
        elif isinstance(first, nn.Linear):
            example = (1, first.in_features)
        else:
            raise ConfigError(f"{type(module).__name__}: cannot guess a sample input for a first layer of type "
                              f"{type(first).__name__}; pass module=(module, input_shape)")
    shape = tuple(int(s) for s in example)
    if not shape or any(s <= 0 for s in shape):
        raise ConfigError(f"sample input shape must be positive sizes, got {shape}")
    if isinstance(first, nn.Embedding):
        return torch.zeros(shape, dtype=torch.long, device="meta")
    return torch.empty(shape, device="meta")


def _unit_key(module: nn.Module, qual: str) -> str:
    """The first non-container ancestor below the root ('' for the root when it is a leaf)."""
    if not qual:
        return ""
    parts, mod, key = qual.split("."), module, []
    for p in parts:
        mod = getattr(mod, p) if not p.isdigit() or not isinstance(mod, _CONTAINERS) else mod[int(p)]
        key.append(p)
        if not isinstance(mod, _CONTAINERS):
            break
    return ".".join(key)


def _group_records(module: nn.Module, records: list, tokens: int, name: str, dtype: str) -> Graph:
    seen: set[int] = set()
    groups: "OrderedDict[str, dict]" = OrderedDict()
    for qual, mod, ishape, oshape in records:
        g = groups.setdefault(_unit_key(module, qual) or name,
                              {"params": 0, "mm": [], "heads": 0, "hd": 0, "ew": 0, "d_in": None, "d_out": 0, "norm": 0})
        for p in mod.parameters(recurse=True):
            if id(p) not in seen:
                seen.add(id(p))
                g["params"] += p.numel()
        last = oshape[-1] if oshape else 0
        if g["d_in"] is None:
            g["d_in"] = ishape[-1] if ishape else 0
        g["d_out"] = last
        out_numel = math.prod(oshape)
        if isinstance(mod, nn.Linear):
            g["mm"].append(MatMul(qual or "linear", mod.out_features, mod.in_features))
        elif isinstance(mod, nn.modules.conv._ConvNd):
            per_tok = out_numel // max(1, tokens)  # outputs per token, each a k-long dot product
            k = (mod.in_channels // mod.groups) * math.prod(mod.kernel_size)
            g["mm"].append(MatMul(qual or "conv", max(1, per_tok), k))
        elif isinstance(mod, nn.MultiheadAttention):
            e = mod.embed_dim
            g["mm"] += [MatMul(f"{qual}.in_proj", 3 * e, e), MatMul(f"{qual}.out_proj", e, e)]
            g["heads"], g["hd"] = mod.num_heads, e // mod.num_heads
        elif isinstance(mod, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)) or "norm" in type(mod).__name__.lower():
            g["norm"] = last
        elif not isinstance(mod, nn.Embedding):
            g["ew"] += max(1, out_numel // max(1, tokens))
    units = []
    for key, g in groups.items():
        if not g["params"] and units:  # a parameter-free layer (activation, dropout) joins the previous unit
            prev = units[-1]
            units[-1] = dataclasses.replace(prev, d_out=g["d_out"],
                                            elementwise_flops_per_token=prev.elementwise_flops_per_token + g["ew"],
                                            train_act_elems_per_token=prev.train_act_elems_per_token + g["d_out"])
            continue
        mms = tuple(g["mm"])
        units.append(Unit(key, "module", g["params"], mms, d_in=g["d_in"] or 0, d_out=g["d_out"],
                          n_heads=g["heads"], head_dim=g["hd"], kv_heads=g["heads"],
                          norm_width=g["norm"], n_norms=1 if g["norm"] else 0, elementwise_flops_per_token=g["ew"],
                          train_act_elems_per_token=(g["d_in"] or 0) + sum(m.m for m in mms)))
    seq = tokens if records and records[0][2] and len(records[0][2]) >= 2 else 1
    return Graph(name=name, source=f"module:{type(module).__name__}", units=tuple(units), dtype=dtype,
                 max_seq_len=max(1, seq))
