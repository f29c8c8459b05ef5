"""Model Zoo's learning-rate adjustment groups (muP) on the zoo models' parameter names.

A params file's `optimizer.adjust_learning_rate: {group: scale}` multiplies the scheduled learning rate of the
group's parameters by `scale` (Model Zoo puts them in their own optimizer param groups, and cstorch's
ScalePerParamLR scales each group's rate). Model Zoo matches its own module names by glob; the same groups here:

    embedding            *embedding*weight                          embed.tok / embed.pos (and a tied head)
    decoder_kernel       *decoder*dense*weight, *decoder*linear*weight
                                                                    every projection matrix of every block
    decoder_attention    *decoder*attn*dense*weight                 q/k/v/o projections
    decoder_input_ffn    *decoder*ffn.ffn.[!1]*weight               the MLP's (or expert's) input projections
    decoder_output_ffn   *decoder*ffn.ffn.[1]*weight                the MLP's (or expert's) output projection

The Cerebras-GPT muP configs scale `decoder_kernel` by base width / width: the hidden matrices' Adam updates then
change their outputs by the same amount at every width. Norms, biases and a mixture of experts' router are in no
group (Model Zoo's patterns do not match them either).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from waferscale.errors import ConfigError


def _block_matrix(name: str) -> bool:
    return name.startswith("blocks.") and name.endswith("_proj.weight")


# a parameter of each kind the groups tell apart
_ONE_OF_EACH = ("embed.tok.weight", "blocks.0.attn.q_proj.weight", "blocks.0.mlp.up_proj.weight",
                "blocks.0.mlp.down_proj.weight")

LR_ADJUSTMENT_GROUPS: dict[str, Callable[[str], bool]] = {
    "embedding": lambda n: n.startswith("embed.") and n.endswith("weight"),
    "decoder_kernel": _block_matrix,
    "decoder_attention": lambda n: _block_matrix(n) and ".attn." in n,
    "decoder_input_ffn": lambda n: _block_matrix(n) and n.endswith(("up_proj.weight", "gate_proj.weight")),
    "decoder_output_ffn": lambda n: _block_matrix(n) and n.endswith("down_proj.weight"),
}


def check_lr_adjustment(scales: Mapping[str, float]) -> None:
    """ConfigError unless every group is Model Zoo's and every scale a positive number."""
    for group, scale in scales.items():
        if group not in LR_ADJUSTMENT_GROUPS:
            raise ConfigError(f"adjust_learning_rate: unknown group {group!r}; the groups are "
                              f"{', '.join(LR_ADJUSTMENT_GROUPS)}")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not scale > 0:
            raise ConfigError(f"adjust_learning_rate.{group}: must be a positive number, got {scale!r}")
    for name in _ONE_OF_EACH:  # overlapping groups must agree on the parameters they share
        lr_adjustment(name, scales)


def lr_adjustment(name: str, scales: Mapping[str, float]) -> float:
    """The learning-rate scale of parameter `name`: its group's (1 in none). A parameter in two groups given
    different scales is an error (Model Zoo would put it in two optimizer groups, which torch refuses)."""
    found = {scales[g] for g, member in LR_ADJUSTMENT_GROUPS.items() if g in scales and member(name)}
    if len(found) > 1:
        groups = [g for g, member in LR_ADJUSTMENT_GROUPS.items() if g in scales and member(name)]
        raise ConfigError(f"adjust_learning_rate: parameter {name!r} is in groups {', '.join(groups)} with different "
                          f"scales; give it one")
    return float(found.pop()) if found else 1.0


__all__ = ["LR_ADJUSTMENT_GROUPS", "check_lr_adjustment", "lr_adjustment"]
