"""A Model Zoo checkpoint's optimizer state <-> ours: Model Zoo keys the state by the position of each parameter in
its optimizer's param groups, so the order of those groups is the map from its integers to parameter names.

Model Zoo 2.x builds the groups with `configure_param_groups(model, optimizer_params)`
(`cerebras/modelzoo/common/optim_utils.py`) on the wrapper module the trainer holds (`Gpt2Model`, whose `model` is
the `GPT2LMHeadModel` of its gpt2 / gpt3 / llama / mistral configs):

1. The parameters requiring grad in `named_parameters()` order. `GPT2LMHeadModel.__init__` registers
   `embedding_layer` (word_embeddings, then the learned position_embeddings), then `ln_f`, the final norm, *before*
   `transformer_decoder` (built with `norm=self.ln_f`: named_parameters lists that module once, as `ln_f`), then
   `lm_head` (its weight left out when tied: the same tensor as the word embeddings). Each
   `TransformerDecoderLayer` registers `self_attn` (proj_q, proj_k, proj_v, proj_output: `AttentionLayer.py`;
   `MultiQueryAttention` re-assigns k and v in place, which keeps their position), `norm1`, `norm3`, `ffn`
   (`ffn.ffn.0.linear_layer`, `.linear_layer_for_glu`, `ffn.ffn.1.linear_layer`); every Linear: weight, bias.
2. `_partition_params_groups_with_weight_decay`: two groups, [decayed, not decayed], each in that order; not
   decayed is a name containing "bias" or a parameter of a torch norm module (`nn.LayerNorm`, also the
   biasless one). Model Zoo's `RMSNorm` is a plain `nn.Module`, so a Llama's norm gains are in the decayed group.
   Both groups stay, an empty one too, when no param `tags` are used. `weight_decay_exempt` is this rule for
   every family; a params file's run groups its own optimizer by it too (`zoo.lm.zoo_group_rules`).
3. `_partition_params_groups_with_adjusted_lr` (muP): each of the two is split into one group per distinct
   `adjust_learning_rate` scale other than 1 (`process_lr_adjustment_params`: in the order the model's
   `lr_adjustment_groups` first give that scale: embedding, decoder_kernel, decoder_attention, decoder_input_ffn,
   decoder_output_ffn, `models/mup.py`), then the rest (scale 1); empty ones are dropped.
4. `torch.optim.Optimizer.state_dict` numbers the parameters 0, 1, ... through the groups in order.

Not confirmed from the source: optimizer param `tags` (`params:` filters in the optimizer section) regroup the
parameters before step 2; a checkpoint trained with them is refused (its group sizes differ) rather than guessed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from waferscale.errors import CheckpointError
from waferscale.models.config import ModelConfig
from waferscale.models.modelzoo import halves_from_pairs, pairs_from_halves, tensor_renames, rotary_rows
from waferscale.models.mup import LR_ADJUSTMENT_GROUPS, lr_adjustment
from waferscale.models.registry import build
from waferscale.models.t5 import RelativeBias

# a decoder layer's modules in the order TransformerDecoderLayer registers them
_LAYER = ("self_attn.proj_q_dense_layer", "self_attn.proj_k_dense_layer", "self_attn.proj_v_dense_layer",
          "self_attn.proj_output_dense_layer", "norm1", "norm3", "ffn.ffn.0.linear_layer",
          "ffn.ffn.0.linear_layer_for_glu", "ffn.ffn.1.linear_layer")


def zoo_parameter_order(cfg: ModelConfig, names: Iterable[str]) -> list[str]:
    """Our parameter `names` in the order Model Zoo's GPT2LMHeadModel lists them (step 1 above). A name Model Zoo's
    model does not have is an error."""
    ours_of = {theirs: ours for ours, theirs in tensor_renames(cfg)}
    ours_of.update({f"ln_f.{p}": ours_of[f"transformer_decoder.norm.{p}"] for p in ("weight", "bias")})
    modules = ["embedding_layer.word_embeddings", "embedding_layer.position_embeddings", "ln_f",
               *(f"transformer_decoder.layers.{i}.{m}" for i in range(cfg.n_layer) for m in _LAYER), "lm_head"]
    present = set(names)
    order = [ours_of[f"{m}.{p}"] for m in modules for p in ("weight", "bias") if ours_of[f"{m}.{p}"] in present]
    missing = sorted(present - set(order))
    if missing:
        raise CheckpointError(f"parameter {missing[0]!r} has no place in Model Zoo's {cfg.family} model, so its "
                              f"optimizer state cannot be ordered as Model Zoo orders it")
    return order


def weight_decay_exempt(model: nn.Module) -> frozenset[str]:
    """The names of `model`'s parameters that Model Zoo's `_should_apply_weight_decay` keeps out of weight decay
    (step 2 above), for every family: a name with "bias" in Model Zoo's naming, which is each of our biases and
    T5's relative-position table (Model Zoo's `relative_attention_bias`, our `RelativeBias`), and the parameters of
    a torch norm module. Model Zoo builds a family's norms with `get_norm(norm_type)`: "layernorm" (GPT-2/3,
    GPT-J, NeoX, Falcon, BERT/RoBERTa) and "biasless-layernorm" (MPT) are `nn.LayerNorm`, as ours are
    (`layers.make_norm`); "rmsnorm" (Llama, Mistral, Mixtral, T5) is its own plain module, as our `RMSNorm` is, so
    those gains are decayed. The rule therefore reads our module types."""
    exempt = set()
    for prefix, module in model.named_modules():
        for name, _ in module.named_parameters(prefix=prefix, recurse=False):
            if name.rsplit(".", 1)[-1] == "bias" or isinstance(module, (nn.LayerNorm, RelativeBias)):
                exempt.add(name)
    return frozenset(exempt)


def zoo_param_groups(cfg: ModelConfig, names: Iterable[str],
                     scales: Mapping[str, float]) -> list[tuple[bool, float, list[str]]]:
    """Model Zoo's optimizer groups for our parameter `names`: (decayed, learning-rate scale, names) each, in its
    order (steps 2 and 3 above); `scales` is the params file's `optimizer.adjust_learning_rate` as the params layer
    completes it (muP's base widths included)."""
    distinct: list[float] = []
    for group in LR_ADJUSTMENT_GROUPS:  # process_lr_adjustment_params: scales other than 1, first-given order
        s = float(scales.get(group, 1.0))
        if s != 1.0 and s not in distinct:
            distinct.append(s)
    order = zoo_parameter_order(cfg, names)
    exempt = weight_decay_exempt(build(cfg, device="meta"))
    out: list[tuple[bool, float, list[str]]] = []
    for decayed in (True, False):
        members = [n for n in order if (n not in exempt) == decayed]
        if not distinct:
            out.append((decayed, 1.0, members))
            continue
        for s in [*distinct, 1.0]:
            group = [n for n in members if lr_adjustment(n, scales) == s]
            if group:
                out.append((decayed, s, group))
    return out


def _to_ours(cfg: ModelConfig, name: str, v: Any) -> Any:
    heads = rotary_rows(cfg, name)
    if heads and torch.is_tensor(v) and v.ndim:
        return halves_from_pairs(v, heads, cfg.rotary_dim or cfg.head_dim)
    return v


def _to_zoo(cfg: ModelConfig, name: str, v: Any) -> Any:
    heads = rotary_rows(cfg, name)
    if heads and torch.is_tensor(v) and v.ndim:
        return pairs_from_halves(v, heads, cfg.rotary_dim or cfg.head_dim)
    return v


def optimizer_state_from_zoo(zoo: Any, cfg: ModelConfig, index: Mapping[str, int], shapes: Mapping[str, tuple],
                             scales: Mapping[str, float], where: str) -> dict[int, dict[str, Any]]:
    """A Model Zoo optimizer state dict's per-parameter state under our optimizer's indices (`index`: name ->
    index, as the resident optimizer numbers them). The state keeps its names (Cerebras' and ours agree:
    exp_avg, exp_avg_sq, beta1_power, ...); q and k rows are moved to our rotary layout as the weights are."""
    if not isinstance(zoo, Mapping) or not isinstance(zoo.get("param_groups"), list) \
            or not isinstance(zoo.get("state"), Mapping):
        raise CheckpointError(f"{where}: its 'optimizer' entry is not an optimizer state dict ('state' and "
                              f"'param_groups')")
    expected = zoo_param_groups(cfg, index, scales)
    given = [list(g.get("params", [])) for g in zoo["param_groups"]]
    if [len(g) for g in given] != [len(g) for _, _, g in expected]:
        raise CheckpointError(
            f"{where}: its optimizer has param groups of {[len(g) for g in given]} parameters; Model Zoo groups "
            f"this model's as {[len(g) for _, _, g in expected]} (weight decay, then optimizer.adjust_learning_rate "
            f"{dict(scales) or '{}'}); was it trained with other adjust_learning_rate scales or param tags?")
    state = {int(k) if not isinstance(k, int) else k: v for k, v in zoo["state"].items()}
    out: dict[int, dict[str, Any]] = {}
    for (_, _, names), indices in zip(expected, given):
        for name, i in zip(names, indices):
            st = state.get(int(i))
            if not st:
                continue
            for k, v in st.items():
                if torch.is_tensor(v) and v.ndim and tuple(v.shape) != tuple(shapes[name]):
                    raise CheckpointError(f"{where}: optimizer state {k} of parameter {i} ({name}) has shape "
                                          f"{tuple(v.shape)}, the parameter {tuple(shapes[name])}")
            out[index[name]] = {k: _to_ours(cfg, name, v) for k, v in st.items()}
    return out


def optimizer_state_to_zoo(ours: Mapping[str, Any], cfg: ModelConfig, index: Mapping[str, int],
                           scales: Mapping[str, float]) -> dict[str, Any]:
    """Our optimizer state dict (`index`: name -> its index there) as Model Zoo's optimizer saves it: parameters
    numbered in Model Zoo's groups, each group with our hyper-parameters, Model Zoo's weight decay (the decayed
    groups take the rate of our decayed parameters: a params file's run splits them as Model Zoo does) and its
    `adjust_learning_rate` under muP."""
    state = {int(k): v for k, v in ours["state"].items()}
    group_of: dict[int, dict[str, Any]] = {}
    for g in ours["param_groups"]:
        group_of.update({int(i): g for i in g["params"]})
    # the rates of our decayed parameters (AdamW's weight_decay; Adam's, as Cerebras' Adam, l2_regularization_rate)
    rates = {k: max(float(g.get(k, 0.0)) for g in ours["param_groups"])
             for k in ("weight_decay", "l2_regularization_rate")}
    zoo_state: dict[int, dict[str, Any]] = {}
    param_groups: list[dict[str, Any]] = []
    position = 0
    for decayed, scale, names in zoo_param_groups(cfg, index, scales):
        first = group_of[index[names[0]]] if names else ours["param_groups"][0]
        group = {k: v for k, v in first.items() if k not in ("params", "name", "adjust_learning_rate")}
        group.update({k: rate if decayed else 0.0 for k, rate in rates.items() if k in group or k == "weight_decay"})
        if scale != 1.0 or any("adjust_learning_rate" in g for g in ours["param_groups"]):
            group["adjust_learning_rate"] = scale
        group["params"] = list(range(position, position + len(names)))
        for name in names:
            if state.get(index[name]):
                zoo_state[position] = {k: _to_zoo(cfg, name, v) for k, v in state[index[name]].items()}
            position += 1
        param_groups.append(group)
    return {"state": zoo_state, "param_groups": param_groups}


__all__ = ["weight_decay_exempt", "zoo_parameter_order", "zoo_param_groups", "optimizer_state_from_zoo",
           "optimizer_state_to_zoo"]
