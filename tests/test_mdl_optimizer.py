"""A Model Zoo checkpoint's optimizer state carries into the resumed run: a `.mdl` whose Adam moments and beta
powers are numbered as Model Zoo numbers them (an optimizer built, as Model Zoo's `configure_param_groups` builds
it, on a module tree registered as its GPT2LMHeadModel is, then `state_dict()`), written by the independent h5py
writer, resumes to the same weights as the run that produced those moments continues to (GPT-2, Llama with GQA and
rotary q/k, weight streaming, muP learning-rate groups); and a run of ours written back as a Model Zoo checkpoint
(`wsc checkpoint convert --src-fmt wsc`) holds its state in that numbering and resumes the same way."""

from __future__ import annotations

import io
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

from test_mdl_checkpoint import GPT, GPT_MUP, LLAMA, _params, read_mdl, write_mdl, zoo_names
from waferscale.cli.main import main
from waferscale.errors import CheckpointError
from waferscale.models import ModelConfig, build
from waferscale.params import params_from_dict
from waferscale.runtime import checkpoint as ckpt
from waferscale.runtime.optimizers import AdamW
from waferscale.zoo.runner import RunOptions, run


class _RMSNorm(nn.Module):  # Model Zoo's RMSNorm: a plain module with a weight (so not exempt from weight decay)
    def __init__(self, n: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))


def _linear(n_in: int, n_out: int, bias: bool) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=bias)


def zoo_model(cfg: ModelConfig) -> nn.Module:
    """Modules registered in the order of Model Zoo's Gpt2Model / GPT2LMHeadModel / TransformerDecoderLayer /
    MultiheadAttention / FeedForwardNetwork constructors (shapes from cfg; values are copied in later)."""
    norm = (lambda: nn.LayerNorm(cfg.d_model, bias=cfg.norm_bias)) if cfg.norm == "layernorm" \
        else (lambda: _RMSNorm(cfg.d_model))
    kv = cfg.kv_heads * cfg.head_dim

    def layer() -> nn.Module:
        m = nn.Module()
        m.self_attn = nn.Module()
        for name, n_out in (("q", cfg.n_head * cfg.head_dim), ("k", kv), ("v", kv)):
            setattr(m.self_attn, f"proj_{name}_dense_layer", _linear(cfg.d_model, n_out, cfg.attn_bias))
        m.self_attn.proj_output_dense_layer = _linear(cfg.n_head * cfg.head_dim, cfg.d_model, cfg.attn_bias)
        m.norm1, m.norm3 = norm(), norm()
        m.ffn = nn.Module()
        first, second = nn.Module(), nn.Module()
        first.linear_layer = _linear(cfg.d_model, cfg.ffn_dim, cfg.mlp_bias)
        if cfg.activation in ("swiglu", "geglu"):
            first.linear_layer_for_glu = _linear(cfg.d_model, cfg.ffn_dim, cfg.mlp_bias)
        second.linear_layer = _linear(cfg.ffn_dim, cfg.d_model, cfg.mlp_bias)
        m.ffn.ffn = nn.ModuleList([first, second])
        return m

    lm = nn.Module()
    lm.embedding_layer = nn.Module()
    lm.embedding_layer.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.d_model)
    if cfg.position == "learned":
        lm.embedding_layer.position_embeddings = nn.Embedding(cfg.max_seq_len, cfg.d_model)
    lm.ln_f = norm()  # registered before the decoder, which holds it as its norm
    lm.transformer_decoder = nn.Module()
    lm.transformer_decoder.layers = nn.ModuleList([layer() for _ in range(cfg.n_layer)])
    lm.transformer_decoder.norm = lm.ln_f
    lm.lm_head = _linear(cfg.d_model, cfg.vocab_size, cfg.lm_head_bias)
    if cfg.tie_embeddings:
        lm.lm_head.weight = lm.embedding_layer.word_embeddings.weight
    wrapper = nn.Module()
    wrapper.model = lm
    return wrapper


# Model Zoo's default lr_adjustment_groups (GPT2LMHeadModelConfig.create_default_lr_adjustment_groups), in order
ZOO_LR_GROUPS = {"embedding": ["*embedding*weight"],
                 "decoder_kernel": ["*decoder*dense*weight", "*decoder*linear*weight"],
                 "decoder_attention": ["*decoder*attn*dense*weight"],
                 "decoder_input_ffn": ["*decoder*ffn.ffn.[!1]*weight"],
                 "decoder_output_ffn": ["*decoder*ffn.ffn.[1]*weight"]}


def _buckets(scales: dict) -> list[tuple[float, list[str]]]:
    """process_lr_adjustment_params: a bucket per distinct scale other than 1, patterns of equal scales merged."""
    out: list[tuple[float, list[str]]] = []
    for group, patterns in ZOO_LR_GROUPS.items():
        s = scales.get(group, 1.0)
        if s != 1.0:
            hit = [b for b in out if b[0] == s]
            hit[0][1].extend(patterns) if hit else out.append((s, list(patterns)))
    return out


def _scale(name: str, scales: dict) -> float:
    return next((s for s, pats in _buckets(scales) if any(fnmatchcase(name, p) for p in pats)), 1.0)


def zoo_groups(model: nn.Module, weight_decay: float, scales: dict) -> list[dict]:
    """optim_utils' `_partition_params_groups_with_weight_decay`, then `_partition_params_groups_with_adjusted_lr`
    (no param tags: a weight-decay group stays when empty unless muP splits it)."""
    norms = [n for n, m in model.named_modules() if isinstance(m, nn.LayerNorm)]
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if "bias" in name or any(n in name for n in norms) else decay).append((name, p))
    buckets = _buckets(scales)
    groups = []
    for rate, members in ((weight_decay, decay), (0.0, no_decay)):
        if not buckets:
            groups.append({"params": [p for _, p in members], "weight_decay": rate})
            continue
        for s in [*(b[0] for b in buckets), 1.0]:
            ps = [p for n, p in members if _scale(n, scales) == s]
            if ps:
                groups.append({"params": ps, "weight_decay": rate, "adjust_learning_rate": s})
    return groups


def _zoo_state(c: ckpt.Checkpoint, cfg: ModelConfig, weight_decay: float, scales: dict) -> dict:
    """Our checkpoint's weights and Adam state as a Model Zoo run holds them, numbered by its optimizer."""
    ours_model = build(cfg, device="meta")
    names = [n for n, _ in ours_model.named_parameters()]  # (the tied head once)
    weights = zoo_names({n: c.model[n] for n in names}, cfg)
    zoo_of = dict(zip(names, weights))  # (zoo_names keeps the order)
    theirs = {zoo: ours for ours, zoo in zoo_of.items()}
    # our resident optimizer's order, split as Model Zoo splits: [decayed], [biases and torch LayerNorm
    # parameters], then each one's muP-scaled parameters by scale
    exempt = {f"{m}.{p}" for m, mod in ours_model.named_modules() for p, _ in mod.named_parameters(recurse=False)
              if p == "bias" or isinstance(mod, nn.LayerNorm)}
    ours, scaled = [], []
    for group in ([n for n in names if n not in exempt], [n for n in names if n in exempt]):
        by_scale: dict[float, list[str]] = {}
        for n in group:
            by_scale.setdefault(_scale(zoo_of[n], scales), []).append(n)
        ours += by_scale.pop(1.0, [])
        scaled += [n for ns in by_scale.values() for n in ns]
    state = c.optimizer_state()
    by_name = {n: state["state"][i] for i, n in enumerate(ours + scaled)}
    model = zoo_model(cfg)
    moments = {k: zoo_names({n: by_name[n][k] for n in names}, cfg) for k in ("exp_avg", "exp_avg_sq")}
    opt = AdamW(zoo_groups(model, weight_decay, scales), lr=1e-3)
    with torch.no_grad():
        for name, p in model.model.named_parameters():
            key = name.replace("ln_f.", "transformer_decoder.norm.")
            p.copy_(weights[key])
            opt.state[p] = {"exp_avg": moments["exp_avg"][key], "exp_avg_sq": moments["exp_avg_sq"][key],
                            "beta1_power": by_name[theirs[key]]["beta1_power"],
                            "beta2_power": by_name[theirs[key]]["beta2_power"]}
    return {"model": {f"model.{k}": v for k, v in weights.items()}, "optimizer": opt.state_dict(),
            "lr_scheduler": {"last_epoch": torch.tensor(c.step)}, "global_step": c.step}


MUP = {"embedding": 0.5, "decoder_kernel": 0.25}  # legacy Cerebras-GPT muP: adjust_learning_rate per group


@pytest.mark.parametrize("model,scales,execution", [(GPT, {}, "resident"), (LLAMA, {}, "resident"),
                                                    (GPT, {}, "streaming"), (GPT_MUP, MUP, "resident"),
                                                    (GPT_MUP, MUP, "streaming")],
                         ids=["gpt2", "llama", "gpt2-streaming", "gpt2-mup", "gpt2-mup-streaming"])
def test_model_zoo_optimizer_state_resumes_exactly(model: dict, scales: dict, execution: str, corpus: Path,
                                                   tmp_path: Path) -> None:
    d = _params(corpus, tmp_path / "a", model)
    d["runconfig"].update(max_steps=4, checkpoint_steps=2)
    if scales:
        d["optimizer"]["adjust_learning_rate"] = scales
    run(params_from_dict(d, "t"), RunOptions(model_dir=tmp_path / "a", progress=False, execution=execution),
        out=io.StringIO())
    params = params_from_dict(d, "t")
    cfg = params.model.to_model_config()
    c2 = ckpt.load_checkpoint(tmp_path / "a" / "checkpoint_2.safetensors")
    zoo = _zoo_state(c2, cfg, d["optimizer"]["weight_decay"], scales)
    write_mdl(tmp_path / "zoo.mdl", zoo)

    out = io.StringIO()
    run(params, RunOptions(model_dir=tmp_path / "b", progress=False, execution=execution,
                           checkpoint_path=str(tmp_path / "zoo.mdl")), out=out)
    assert "(step 2)" in out.getvalue() and "note:" not in out.getvalue(), out.getvalue()
    want = ckpt.load_checkpoint(tmp_path / "a").model
    got = ckpt.load_checkpoint(tmp_path / "b").model
    assert max((want[k] - got[k]).abs().max().item() for k in want) < 1e-6

    if execution == "resident" and model is GPT:  # a checkpoint grouped otherwise (tags, other muP scales) is refused
        one_group = [{**zoo["optimizer"]["param_groups"][0], "params": list(range(len(zoo["optimizer"]["state"])))}]
        write_mdl(tmp_path / "other.mdl", {**zoo, "optimizer": {**zoo["optimizer"], "param_groups": one_group}})
        with pytest.raises(CheckpointError, match=r"param groups of \[\d+\] parameters; Model Zoo groups"):
            run(params, RunOptions(model_dir=tmp_path / "c", progress=False,
                                   checkpoint_path=str(tmp_path / "other.mdl")), out=io.StringIO())

    # written back: the same numbering, moments and beta powers as Model Zoo's optimizer holds them
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(d))
    assert main(["checkpoint", "convert", str(c2.path), "--model", "gpt2" if cfg.family == "gpt" else "llama",
                 "--src-fmt", "wsc", "--tgt-fmt", "cs-2.4", "--config", str(tmp_path / "params.yaml"),
                 "--output-dir", str(tmp_path)]) == 0
    flat = read_mdl(tmp_path / "checkpoint_2_to_cs-2.4.mdl")
    flat = {k: flat[v[1]] if isinstance(v, tuple) else v for k, v in flat.items()}  # (values met twice are links)
    expected = zoo["optimizer"]
    for i, st in expected["state"].items():
        for k, v in st.items():
            assert torch.equal(flat[f"optimizer.state.{i}.{k}"], v), (i, k)
    sizes = [len(g["params"]) for g in expected["param_groups"]]
    assert [len([k for k in flat if k.startswith(f"optimizer.param_groups.{g}.params.")])
            for g in range(len(sizes))] == sizes
    assert flat["optimizer.param_groups.0.weight_decay"] == d["optimizer"]["weight_decay"]
    for g, group in enumerate(expected["param_groups"]):
        assert flat.get(f"optimizer.param_groups.{g}.adjust_learning_rate") == group.get("adjust_learning_rate")
    assert flat["global_step"] == 2
    run(params, RunOptions(model_dir=tmp_path / "d", progress=False, execution=execution,
                           checkpoint_path=str(tmp_path / "checkpoint_2_to_cs-2.4.mdl")), out=io.StringIO())
    got = ckpt.load_checkpoint(tmp_path / "d").model  # and it resumes as the run it came from continues
    assert max((want[k] - got[k]).abs().max().item() for k in want) < 1e-6
