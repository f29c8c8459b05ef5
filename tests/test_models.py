"""The model zoo: presets build (big ones on meta), parameter counts, units, KV-cache decoding, names."""

from __future__ import annotations

import pytest
import torch

from waferscale.errors import ConfigError
from waferscale.models import registry
from waferscale.models.layers import CausalLM


@pytest.mark.parametrize("name", sorted(registry.PRESETS))
def test_every_preset_builds_on_meta_with_its_parameter_count(name: str) -> None:
    cfg = registry.PRESETS[name]
    model = registry.build(cfg, device="meta")
    assert isinstance(model, CausalLM)
    assert all(p.is_meta for p in model.parameters())
    assert model.num_params() == cfg.num_params
    if cfg.is_encoder_decoder:  # embedding, encoder layers, the encoder's norm, decoder layers, head
        assert len(model.units()) == cfg.n_layer + cfg.decoder_layers + 3
    else:
        assert [type(u) for u in model.units()] == [model.embedding_cls, *[model.block_cls] * cfg.n_layer,
                                                    model.head_cls]


@pytest.mark.parametrize("name", [n for n, c in sorted(registry.PRESETS.items())
                                  if c.num_params > registry.META_THRESHOLD_PARAMS])
def test_big_presets_default_to_meta(name: str) -> None:
    model = registry.from_name(name)  # device="auto": would need gigabytes if it materialized
    assert model.head.lm_head.weight.device.type == "meta"
    assert model.num_params() == model.config.num_params


@pytest.mark.parametrize("name", ["gpt-tiny", "gpt-mini", "llama-tiny"])
def test_tiny_presets_materialize(name: str) -> None:
    model = registry.from_name(name)
    assert model.head.lm_head.weight.device.type == "cpu"
    assert model.num_params() == model.config.num_params
    logits = model(torch.randint(0, model.config.vocab_size, (2, 5)))
    assert logits.shape == (2, 5, model.config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name, count", [
    ("gpt2-small", 124_439_808),     # HF GPT2LMHeadModel, tied head counted once
    ("llama2-7b", 6_738_415_616),    # meta-llama/Llama-2-7b-hf
    ("llama3.1-8b", 8_030_261_248),  # meta-llama/Llama-3.1-8B
    ("smollm2-135m", 134_515_008),   # HuggingFaceTB/SmolLM2-135M
])
def test_known_parameter_counts(name: str, count: int) -> None:
    assert registry.PRESETS[name].num_params == count
    assert registry.build(registry.PRESETS[name], device="meta").num_params() == count


def test_tied_embeddings_share_one_tensor() -> None:
    model = registry.from_name("gpt-tiny")
    assert model.head.lm_head.weight is model.embed.tok.weight
    untied = registry.from_name("llama-tiny")
    assert untied.head.lm_head.weight is not untied.embed.tok.weight


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_units_in_order_chain_to_forward(name: str) -> None:
    torch.manual_seed(0)
    model = registry.from_name(name).eval()
    units = model.units()
    assert units[0] is model.embed and units[-1] is model.head
    assert units[1:-1] == list(model.blocks)
    idx = torch.randint(0, model.config.vocab_size, (2, 7))
    with torch.no_grad():
        x = idx
        for u in units:
            x = u(x)
        torch.testing.assert_close(x, model(idx), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_kv_cache_decode_matches_full_forward(name: str) -> None:
    torch.manual_seed(0)
    model = registry.from_name(name).eval()
    B, T, prefill = 2, 12, 5
    idx = torch.randint(0, model.config.vocab_size, (B, T))
    with torch.no_grad():
        full = model(idx)  # (B, T, V)
        caches = model.make_kv_caches(B, T)
        steps = [model(idx[:, :prefill], 0, caches)]
        for t in range(prefill, T):
            steps.append(model(idx[:, t:t + 1], t, caches))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_kv_cache_overflow_is_an_error() -> None:
    model = registry.from_name("llama-tiny").eval()
    caches = model.make_kv_caches(1, 4)
    with torch.no_grad(), pytest.raises(ValueError, match="KV cache holds 4"):
        model(torch.zeros(1, 5, dtype=torch.long), 0, caches)


def test_unknown_name_suggests_the_closest() -> None:
    with pytest.raises(ConfigError, match=r"did you mean 'gpt2-small'"):
        registry.from_name("gpt2-smal")
    with pytest.raises(ConfigError, match="known models"):
        registry.canonical_name("no-such-model-at-all")


def test_aliases_resolve() -> None:
    assert registry.canonical_name("GPT2") == "gpt2-small"
    assert registry.config_from_name("smollm2-135m-instruct").n_layer == 30
