"""What the Hugging Face parity tests share: our model with perturbed weights, fixed token ids, the largest
logit difference, and the config round trip through transformers' own config class."""

from __future__ import annotations

import torch
import transformers

from waferscale.models import ModelConfig, build, hf
from waferscale.models.layers import CausalLM


def perturbed(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    """`cfg` built on the CPU, each weight moved off its initialisation (so that no zero hides a mismatch)."""
    torch.manual_seed(seed)
    model = build(cfg, device="cpu").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return model


def ids(cfg: ModelConfig, T: int = 40) -> torch.Tensor:
    return torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(1))


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def assert_config_round_trips(cfg: ModelConfig) -> None:
    """cfg -> config.json -> cfg, directly and through transformers' config class (what a checkpoint holds)."""
    hf_dict = hf.config_to_hf(cfg)
    assert hf.config_from_hf(hf_dict) == cfg
    assert hf.config_from_hf(transformers.AutoConfig.for_model(**hf_dict).to_dict()) == cfg
