"""Cerebras `.mdl` checkpoints: a file written here straight with h5py + hdf5plugin, following the layout of the
published cerebras-pytorch 2.10.0 (`storage/save.py`) and cerebras-appliance (`storage/h5_storage.py`), loads with
`cstorch.load`, as does one in the older (0.4) layout; `cstorch.save(format="mdl")` round-trips and is read by the
same independent reader; a tiny Model Zoo-named GPT checkpoint trains on through the runner; `wsc checkpoint
convert` gives a Hugging Face directory that transformers loads with our logits (muP folded in), and back a .mdl
under Model Zoo's names; bad files are one `error:` line and exit 2."""

from __future__ import annotations

import io
import json
import pickle
from collections import OrderedDict
from pathlib import Path

import h5py
import hdf5plugin
import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree
import transformers
import yaml

import waferscale.pytorch as cstorch
from conftest import tiny_params
from hf_helpers import ids, max_diff, perturbed
from waferscale.cli.main import main
from waferscale.errors import CheckpointError
from waferscale.models import ModelConfig, build
from waferscale.models.hf import save_hf_dir
from waferscale.params import params_from_dict
from waferscale.runtime import checkpoint as ckpt
from waferscale.zoo.runner import RunOptions, run

LZ4_FILTER = "32004"  # hdf5plugin's registered HDF5 filter id for LZ4


# ---- an independent writer and reader, from the documented layout ---------------------------------------

def _keys(spec: pytree.TreeSpec, scope: tuple = ()) -> list[str]:
    """Cerebras' recurse_spec over dicts and sequences: dict keys, else child positions, joined by '.'."""
    if spec.num_leaves == 0:
        return []
    kids = spec.children()
    if not kids:
        return [".".join(scope)]
    names = spec.context if spec.context else range(len(kids))
    return [k for name, kid in zip(names, kids) for k in _keys(kid, (*scope, str(name)))]


def write_mdl(path: Path, state: object) -> None:
    leaves, spec = pytree.tree_flatten(state)
    root = {"__spec__": json.dumps([None, pytree.treespec_dumps(spec)]), "__version__": 0.5,
            "__cstorch_version__": "2.10.0"}
    seen: dict[int, str] = {}
    with h5py.File(path, "w") as f:
        f.attrs.update(root)
        for key, v in zip(_keys(spec), leaves):
            if isinstance(v, torch.Tensor) and id(v) in seen:
                meta = {"key": seen[id(v)], "__LINKED__": True, "__TYPE__": "LinkedObject", "__NONE__": True}
            elif isinstance(v, torch.Tensor):
                seen[id(v)] = key
                data = v.view(torch.int16).numpy() if v.dtype == torch.bfloat16 else v.numpy()
                meta = {"__TORCH__": True, "shapes": [list(v.shape)], "dtypes": [str(v.dtype)],
                        "rtfx_dtypes": [{torch.float32: 11, torch.bfloat16: 15, torch.int64: 5}[v.dtype]],
                        "__TYPE__": "TorchTensorSerializer", "__NUMPY__": True, "compressed": False}
                f.create_dataset(key, data=data, **(hdf5plugin.LZ4() if data.shape else {})).attrs.update(meta)
            elif isinstance(v, str):
                meta = {"string_value": v, "__TYPE__": "StringSerializer", "__NONE__": True}
            else:
                meta = {"scalar_value": v, "__TYPE__": "ScalarSerializer", "__NONE__": True}
            leaf_spec = pytree.treespec_dumps(pytree.tree_flatten({key: 0})[1])
            f.attrs[f"{key}.__metadata__"] = json.dumps({"__spec__": [{key: "*"}, leaf_spec], "__objects__": [key],
                                                         f"{key}.__metadata__": meta})
        f.attrs["__SUCCESS__"] = True


def read_mdl(path: Path) -> dict[str, object]:
    """{leaf key: value}, checking the layout: root attributes, LZ4 datasets, bf16 as int16, JSON metadata."""
    out: dict[str, object] = {}
    with h5py.File(path, "r") as f:
        assert f.attrs["__SUCCESS__"] and float(f.attrs["__version__"]) == 0.5
        spec = pytree.treespec_loads(json.loads(f.attrs["__spec__"])[1])
        for key in _keys(spec):
            entry = json.loads(f.attrs[f"{key}.__metadata__"])
            meta = entry[f"{key}.__metadata__"]
            assert entry["__objects__"] == [key]
            kind = meta["__TYPE__"]
            if kind == "TorchTensorSerializer":
                d = f[key]
                assert d.attrs["__NUMPY__"] and list(d.attrs["dtypes"]) == meta["dtypes"]
                if d.shape:
                    assert LZ4_FILTER in d._filters
                if meta["dtypes"] == ["torch.bfloat16"]:
                    assert d.dtype == np.int16
                    out[key] = torch.from_numpy(d[...]).view(torch.bfloat16)
                else:
                    out[key] = torch.from_numpy(d[...])
            elif kind == "LinkedObject":
                out[key] = ("link", meta["key"])
            else:
                out[key] = meta["scalar_value" if kind == "ScalarSerializer" else "string_value"]
    return out


def _state() -> dict:
    torch.manual_seed(0)
    w = torch.randn(5, 3)
    return {"model": OrderedDict([("embedding_layer.word_embeddings.weight", w), ("lm_head.weight", w),
                                  ("norm.weight", torch.randn(3).bfloat16()), ("step_scale", torch.tensor(0.5))]),
            "optimizer": {"state": {0: {"exp_avg": torch.randn(5, 3), "step": torch.tensor(4.0)}},
                          "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95), "params": [0], "adam": False,
                                            "name": "decay"}]},
            "lr_scheduler": {"last_epoch": 4, "base_lrs": [1e-3, 2e-3]}, "global_step": 4, "note": "tiny"}


def _assert_same(a: object, b: object) -> None:
    fa, sa = pytree.tree_flatten(a)
    fb, sb = pytree.tree_flatten(b)
    assert sa == sb
    for x, y in zip(fa, fb):
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and torch.equal(x, y)
        else:
            assert type(x) is type(y) and x == y


# ---- the format ----------------------------------------------------------------------------------------

def test_independently_written_file_loads(tmp_path: Path) -> None:
    state = _state()
    write_mdl(tmp_path / "a.mdl", state)
    got = cstorch.load(tmp_path / "a.mdl")
    _assert_same(got, state)
    m = got["model"]
    assert m["lm_head.weight"] is m["embedding_layer.word_embeddings.weight"]  # the tie survives


def test_save_round_trips_and_is_read_independently(tmp_path: Path) -> None:
    state = _state()
    cstorch.save(state, tmp_path / "b.mdl", format="mdl")
    _assert_same(cstorch.load(tmp_path / "b.mdl"), state)
    flat = read_mdl(tmp_path / "b.mdl")
    assert flat["model.lm_head.weight"] == ("link", "model.embedding_layer.word_embeddings.weight")
    model = build(ModelConfig(name="t", family="gpt", vocab_size=16, n_layer=1, n_head=2, d_model=8, max_seq_len=8),
                  device="cpu")
    cstorch.save({"model": model.state_dict()}, tmp_path / "tied.mdl", format="mdl")  # (new tensor per name)
    assert read_mdl(tmp_path / "tied.mdl")["model.head.lm_head.weight"] == ("link", "model.embed.tok.weight")
    # cstorch links any object met twice, CPython's shared small ints too (global_step 4 is last_epoch's 4)
    flat = {k: flat[v[1]] if isinstance(v, tuple) else v for k, v in flat.items()}
    assert torch.equal(flat["model.norm.weight"], state["model"]["norm.weight"])
    assert flat["optimizer.param_groups.0.betas.1"] == 0.95 and flat["optimizer.param_groups.0.name"] == "decay"
    assert flat["global_step"] == 4 and flat["lr_scheduler.base_lrs.1"] == 2e-3
    cstorch.save(state, tmp_path / "c.st")  # the default stays safetensors
    assert not h5py.is_hdf5(tmp_path / "c.st")


def write_legacy_mdl(path: Path, state: object, spec_bytes: bytes | None = None) -> None:
    """The format-0.4 layout (cstorch 2.0, `_legacy/pt_h5_saver.py`): the TreeSpec pickled (dill pickles these
    importable classes as pickle does, save dill's own `_load_type` for builtin types), one quoted dataset per leaf
    with its `__H5_TYPE__`."""
    from urllib.parse import quote

    leaves, spec = pytree.tree_flatten(state)
    with h5py.File(path, "w") as f:
        f.attrs["__spec__"] = (spec_bytes or pickle.dumps(spec)).hex()
        f.attrs["__version__"], f.attrs["__cstorch_version__"] = 0.4, "2.0"
        for key, v in zip(_keys(spec), leaves):
            name = quote(key, safe="")
            if isinstance(v, torch.Tensor):
                bf16 = v.dtype == torch.bfloat16
                d = f.create_dataset(name, data=v.view(torch.int16).numpy() if bf16 else v.numpy(),
                                     **(hdf5plugin.LZ4() if v.dim() else {}))
                d.attrs.update({"__H5_TYPE__": "TorchTensorH5Type", "is_bfloat16": bf16})
            elif isinstance(v, str):
                f.create_dataset(name, data=h5py.Empty("f")).attrs.update(
                    {"__H5_TYPE__": "StringH5Type", "string_value": v})
            elif v is None:
                f.create_dataset(name, data=h5py.Empty("f")).attrs["__H5_TYPE__"] = "NoneH5Type"
            else:
                f.create_dataset(name, data=v).attrs["__H5_TYPE__"] = "ScalarH5Type"


class _Evil:
    def __reduce__(self) -> tuple:
        return (print, ("unpickled",))


def test_legacy_format_loads_without_unpickling_anything_else(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture) -> None:
    state = _state()
    state["model"]["odd/name"] = torch.ones(2)  # (dataset names are URL-quoted)
    state["missing"] = None
    write_legacy_mdl(tmp_path / "old.mdl", state)
    got = cstorch.load(tmp_path / "old.mdl")
    state["model"]["lm_head.weight"] = state["model"]["lm_head.weight"].clone()  # (this layout stores ties twice)
    _assert_same(got, state)
    write_legacy_mdl(tmp_path / "evil.mdl", {"a": torch.ones(1)}, spec_bytes=pickle.dumps(_Evil()))
    with pytest.raises(CheckpointError, match="does not unpickle"):
        cstorch.load(tmp_path / "evil.mdl")
    assert "unpickled" not in capsys.readouterr().out


# ---- Model Zoo models ------------------------------------------------------------------------------------

def zoo_names(sd: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Our state dict under Model Zoo's names (as its gpt2_hf_cs / llama converters name them), q and k rows in
    its interleaved rotary layout (the llama converter's interleave_helper)."""
    per_layer = {"attn_norm": "norm1", "mlp_norm": "norm3", "attn.q_proj": "self_attn.proj_q_dense_layer",
                 "attn.k_proj": "self_attn.proj_k_dense_layer", "attn.v_proj": "self_attn.proj_v_dense_layer",
                 "attn.o_proj": "self_attn.proj_output_dense_layer", "mlp.up_proj": "ffn.ffn.0.linear_layer",
                 "mlp.gate_proj": "ffn.ffn.0.linear_layer_for_glu", "mlp.down_proj": "ffn.ffn.1.linear_layer"}
    top = {"embed.tok": "embedding_layer.word_embeddings", "embed.pos": "embedding_layer.position_embeddings",
           "head.norm": "transformer_decoder.norm", "head.lm_head": "lm_head"}
    out = {}
    for name, t in sd.items():
        module, p = name.rsplit(".", 1)
        if module.startswith("blocks."):
            _, i, rest = module.split(".", 2)
            zoo = f"transformer_decoder.layers.{i}.{per_layer[rest]}"
            if cfg.position == "rotary" and rest in ("attn.q_proj", "attn.k_proj"):
                heads = cfg.n_head if rest == "attn.q_proj" else cfg.kv_heads
                h = t.reshape(heads, cfg.head_dim, -1)
                t = h.reshape(heads, 2, cfg.head_dim // 2, -1).permute(0, 2, 1, 3).reshape(t.shape)
        else:
            zoo = top[module]
        out[f"{zoo}.{p}"] = t.clone()
    if cfg.tie_embeddings:  # Model Zoo's state dict holds the tied head under both names
        out["lm_head.weight"] = out["embedding_layer.word_embeddings.weight"]
    return out


def _params(corpus: Path, model_dir: Path, model: dict) -> dict:
    d = tiny_params(corpus, model_dir)
    d["model"] = model
    return d


GPT = {"name": "gpt-tiny", "vocab_size": 64, "max_position_embeddings": 32, "mixed_precision": False}
LLAMA = {"name": "llama-tiny", "vocab_size": 64, "max_position_embeddings": 32, "mixed_precision": False}
# Cerebras-GPT muP's model keys (params_cerebras_gpt_111m_mup.yaml's values): folded into the weights for HF
GPT_MUP = {**GPT, "embeddings_scale": 10.0, "output_logits_scale": 1 / 3, "scale_qk_dot_by_d": True}


def test_model_zoo_gpt_checkpoint_trains_on_through_the_runner(corpus: Path, tmp_path: Path) -> None:
    d = _params(corpus, tmp_path / "run", GPT)
    cfg = params_from_dict(d, "t").model.to_model_config()
    ours = perturbed(cfg).state_dict()
    zoo = {f"model.{k}": v for k, v in zoo_names(ours, cfg).items()}  # as saved from Model Zoo's wrapper module
    write_mdl(tmp_path / "zoo.mdl", {"model": zoo, "global_step": 2})  # (tests/test_mdl_optimizer.py: with one)
    d["runconfig"]["max_steps"] = 3
    out = io.StringIO()
    run(params_from_dict(d, "t"), RunOptions(model_dir=tmp_path / "run", progress=False,
                                             checkpoint_path=str(tmp_path / "zoo.mdl")), out=out)
    assert "(step 2)" in out.getvalue()
    after = ckpt.load_checkpoint(tmp_path / "run").model
    assert ckpt.load_checkpoint(tmp_path / "run").step == 3
    moved = max(max_diff(after[k], ours[k]) for k in after)
    assert 0 < moved < 0.05  # one optimizer step from the loaded weights (a fresh model differs by ~1)


@pytest.mark.parametrize("model", [GPT, LLAMA, GPT_MUP], ids=["gpt2", "llama", "gpt2-mup"])
def test_convert_to_hugging_face_matches_transformers(model: dict, corpus: Path, tmp_path: Path) -> None:
    d = _params(corpus, tmp_path / "unused", model)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(d))
    cfg = params_from_dict(d, "t").model.to_model_config()
    ours = perturbed(cfg)
    write_mdl(tmp_path / "zoo.mdl", {"model": zoo_names(ours.state_dict(), cfg), "global_step": 5})
    kind = "gpt2" if cfg.family == "gpt" else "llama"
    assert main(["checkpoint", "convert", str(tmp_path / "zoo.mdl"), "--model", kind, "--src-fmt", "cs-2.4",
                 "--tgt-fmt", "hf", "--config", str(tmp_path / "params.yaml"), "--output-dir",
                 str(tmp_path / "hf")]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    x = ids(cfg, T=24)
    with torch.no_grad():
        assert max_diff(theirs(x).logits, ours(x)) < 1e-4


@pytest.mark.parametrize("model,config", [(GPT, "params.yaml"), (LLAMA, "config.json")], ids=["gpt2", "llama"])
def test_convert_from_hugging_face_writes_model_zoo_names(model: dict, config: str, corpus: Path,
                                                          tmp_path: Path) -> None:
    d = _params(corpus, tmp_path / "unused", model)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(d))
    cfg = params_from_dict(d, "t").model.to_model_config()
    ours = perturbed(cfg)
    save_hf_dir(ours, tmp_path / "hf")
    config_path = tmp_path / "hf" / "config.json" if config == "config.json" else tmp_path / "params.yaml"
    kind = "gpt2" if cfg.family == "gpt" else "llama"
    assert main(["checkpoint", "convert", str(tmp_path / "hf"), "--model", kind, "--src-fmt", "hf", "--tgt-fmt",
                 "cs-2.4", "--config", str(config_path)]) == 0
    flat = read_mdl(tmp_path / "hf_to_cs-2.4.mdl")
    expected = zoo_names(ours.state_dict(), cfg)
    assert sorted(flat) == sorted(f"model.model.{k}" for k in expected)  # {"model": Model Zoo 2.x's wrapper names}
    for k, t in expected.items():
        got = flat[f"model.model.{k}"]
        if isinstance(got, tuple):  # the tied head: a link to the embedding
            assert got == ("link", "model.model.embedding_layer.word_embeddings.weight") and cfg.tie_embeddings
        else:
            assert torch.equal(got, t), k


# ---- bad input -------------------------------------------------------------------------------------------

def test_bad_files_are_one_error_line_and_exit_2(corpus: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture) -> None:
    d = _params(corpus, tmp_path / "unused", GPT)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(d))
    cfg = params_from_dict(d, "t").model.to_model_config()
    good = zoo_names(build(cfg, device="cpu").state_dict(), cfg)
    write_mdl(tmp_path / "good.mdl", {"model": good})
    data = (tmp_path / "good.mdl").read_bytes()
    (tmp_path / "truncated.mdl").write_bytes(data[: len(data) // 2])
    write_mdl(tmp_path / "partial.mdl", {"model": good})
    with h5py.File(tmp_path / "partial.mdl", "a") as f:
        del f.attrs["__SUCCESS__"]
    write_mdl(tmp_path / "unknown.mdl", {"model": {**good, "transformer_decoder.layers.0.extra.weight": torch.ones(2)}})
    expected = {"truncated": "not a readable HDF5", "partial": "partially written", "unknown": "extra.weight"}
    for name, message in expected.items():
        rc = main(["checkpoint", "convert", str(tmp_path / f"{name}.mdl"), "--model", "gpt2", "--src-fmt", "cs-auto",
                   "--tgt-fmt", "hf", "--config", str(tmp_path / "params.yaml")])
        err = capsys.readouterr().err.strip().splitlines()
        assert rc == 2 and len(err) == 1 and err[0].startswith("error:") and message in err[0], (name, err)
    save_hf_dir(build(cfg.replace(norm_eps=1e-6), device="cpu"), tmp_path / "other_hf")  # (same shapes)
    rc = main(["checkpoint", "convert", str(tmp_path / "other_hf"), "--model", "gpt2", "--src-fmt", "hf",
               "--tgt-fmt", "cs-current", "--config", str(tmp_path / "params.yaml")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "describes another model" in err[0], err


def test_commands_take_a_model_zoo_checkpoint_with_its_params_file(corpus: Path, tmp_path: Path, capsys) -> None:
    """`wsc export` (and every command that resolves a model) takes a .mdl given the params file it was trained
    with; without it, a usage error says which flag gives it."""
    from waferscale.models.hf import load_hf_dir

    d = _params(corpus, tmp_path / "unused", LLAMA)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(d))
    cfg = params_from_dict(d, "t").model.to_model_config()
    ours = perturbed(cfg)
    write_mdl(tmp_path / "zoo.mdl", {"model": zoo_names(ours.state_dict(), cfg), "global_step": 5})
    assert main(["export", "--checkpoint", str(tmp_path / "zoo.mdl"), "--out", str(tmp_path / "hf")]) == 2
    assert "--config PARAMS.yaml" in capsys.readouterr().err
    assert main(["export", "--model", str(tmp_path / "zoo.mdl"), "--config", str(tmp_path / "params.yaml"),
                 "--out", str(tmp_path / "hf")]) == 0
    back = load_hf_dir(tmp_path / "hf").state_dict()
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items())
