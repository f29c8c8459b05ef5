"""Sparse weight streaming: a cstorch user's sparsity script on "CSX" (MemoryX holds the masks, links move only
the kept values and a bitmask, only the kept gradients come back) trains exactly as the dense reference with the
same masks on "CPU" (resident, masks by hooks), for every algorithm, with one system and with two."""

from __future__ import annotations

import json

import pytest
import torch

from test_cstorch_user_models import _script, assert_same_run
from user_models import train
from waferscale.runtime.links import LocalLink
from waferscale.runtime.memoryx import MemoryX
from waferscale.runtime.optim import OptimizerSpec
from waferscale.runtime.sparse_stream import expand, kept_only
from waferscale.sparse import configure
from waferscale.sparse.masks import pack_bits, unpack_bits

BLOCKS = "blocks.*"  # the blocks' matrices and vectors (the tutorial LM's embedding, positions, head stay dense)
CONFIGS = {
    "static": {"sparsity": 0.75, "param_filter": BLOCKS},
    "gmp": {"algorithm": "gmp", "sparsity": {"type": "linear", "init": 0.3, "slope": 0.1}, "update": {"freq": 2},
            "param_filter": BLOCKS},
    "set": {"algorithm": "set", "sparsity": 0.6, "update": {"freq": 2}, "drop_fraction": 0.3,
            "param_filter": BLOCKS},
    "rigl": {"algorithm": "rigl", "sparsity": 0.6, "update": {"freq": 2},
             "drop_fraction": {"type": "cosine", "init": 0.4, "half_period": 4}, "param_filter": BLOCKS},
}


def _masks(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in weights.items() if k.endswith("_mask")}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_sparse_streaming_equals_the_dense_reference_with_the_same_masks(name, tmp_path):
    cpu_losses, cpu_w, _ = train("tutorial", "CPU", artifact_dir=str(tmp_path), dropout=0.0, steps=6,
                                 sparsity=CONFIGS[name])
    csx_losses, csx_w, opt = train("tutorial", "CSX", artifact_dir=str(tmp_path), dropout=0.0, steps=6,
                                   sparsity=CONFIGS[name])
    assert_same_run((csx_losses, csx_w), (cpu_losses, cpu_w))
    masks = _masks(csx_w)
    assert masks and all(torch.equal(masks[k], cpu_w[k]) for k in masks)
    stats = opt._stream.stats  # moved by the link vs the dense payloads the device computed with
    assert 0 < stats["bytes_streamed"] < stats["bytes_in"] and 0 < stats["bytes_reduced"] < stats["bytes_out"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["static", "rigl"])
def test_sparse_streaming_on_two_systems_equals_the_dense_reference(name, tmp_path):
    cfg = json.dumps(CONFIGS[name])
    cpu = _script(tmp_path / "cpu", "--backend", "CPU", "--dropout", "0", "--steps", "6", "--sparsity", cfg)
    two = _script(tmp_path / "two", "--backend", "CSX", "--num_csx", "2", "--dropout", "0", "--steps", "6",
                  "--sparsity", cfg)
    assert_same_run(two, cpu)
    masks = _masks(cpu[1])
    assert masks and all(torch.equal(two[1][k], cpu[1][k]) for k in masks)


def test_memoryx_packs_kept_values_and_takes_kept_gradients():
    """The packed payload is the kept values plus a bitmask; gradients pushed as kept values land where the mask
    keeps them (zeros elsewhere); dense gradients are masked."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    units = [model[0], model[2]]
    mx = MemoryX(model, OptimizerSpec("SGD"), units=units)
    group = configure({"sparsity": 0.75})
    mx.attach_sparsity(group)
    lay = mx.layouts[0]
    dense_m, vectors = mx.fetch(0)
    packed = mx.fetch_packed(0)
    keep = unpack_bits(packed.bits, lay.n_matrices)
    assert torch.equal(packed.bits, pack_bits(keep)) and int(keep.sum()) == packed.values.numel() == 128
    assert torch.equal(expand(packed.values, keep), dense_m) and torch.equal(packed.vectors, vectors)
    assert torch.equal(keep.view(32, 16), group.params["0.weight"].mask)
    mx.begin_step(0.0)
    mx.push_grads(0, torch.ones(128), torch.ones(lay.n_vectors))
    mx.push_grads(1, torch.ones(mx.layouts[1].n_matrices), torch.ones(mx.layouts[1].n_vectors))
    mx.end_backward()
    grad = mx.stores[0].open("grad")[:lay.n_matrices]
    assert torch.equal(grad, keep.float())  # the kept values, in place
    keep1 = mx.unit_masks.keep[1]
    assert torch.equal(mx.stores[1].open("grad")[:keep1.numel()], keep1.float())  # dense, then masked


def test_kept_only_is_torch_where_bit_for_bit():
    torch.manual_seed(0)
    src = torch.randn(1000)
    src[::7], src[::11], src[::13] = float("inf"), float("nan"), -0.0
    keep = torch.rand(1000) < 0.4
    want = torch.where(keep, src, torch.zeros(()))
    out = torch.full((1000,), 5.0)
    for got in (kept_only(src, keep), kept_only(src, keep, out=out)):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert got is out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_masters_stay_zero_where_masked_so_a_cpu_device_computes_from_them(name):
    """A CPU device computes from MemoryX's masters (no gather, no scatter): they must equal the packed payload
    expanded at every step (the masks change at step 2, and 4, but for static) and after loading dense weights;
    the gradients of masked weights are zero in MemoryX; the counters count the packed bytes."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8))
    dense = {k: v.clone() for k, v in model.state_dict().items()}
    mx = MemoryX(model, OptimizerSpec("AdamW", learning_rate=0.1, weight_decay=0.1), units=[model[0], model[2]])
    group = configure({k: v for k, v in CONFIGS[name].items() if k != "param_filter"})
    mx.attach_sparsity(group)
    link = LocalLink(mx, torch.device("cpu"))

    def check_fetch() -> None:
        for u in (0, 1):
            m, v = link.fetch(u)
            p = mx.fetch_packed(u)
            assert torch.equal(m, expand(p.values, mx.unit_masks.keep[u])) and torch.equal(v, p.vectors)

    masks = set()
    for step in range(6):
        mx.begin_step(0.1)
        check_fetch()
        masks.add(tuple(mx.unit_masks.index[0].tolist()))
        assert link.take_stats()["bytes_streamed"] == sum(mx.fetch_packed(u).nbytes for u in (0, 1))
        for u in (1, 0):
            lay = mx.layouts[u]
            link.push(u, torch.randn(lay.n_matrices), torch.randn(lay.n_vectors)).result()
            grad = mx.stores[u].open("grad")[:lay.n_matrices]
            assert not grad[~mx.unit_masks.keep[u]].any() and grad[mx.unit_masks.keep[u]].all()
        mx.end_backward()
    assert (len(masks) == 1) == (name == "static")
    check_fetch()
    mx.load_weights(dense, "dense weights")  # starting from a dense run's weights: pruned by the masks
    mx.sync_masks()  # (as every step and evaluation begins)
    check_fetch()
    assert int((mx.checkpoint_state()["0.weight"] != 0).sum()) == int(group.params["0.weight"].mask.sum())


# ---- `wsc run` with a params file's sparsity section ----------------------------------------------------

ZOO_SPARSITY = {"algorithm": "rigl", "sparsity": 0.7, "update": {"freq": 2}, "drop_fraction": 0.3}


def _zoo(corpus, model_dir, sparsity=ZOO_SPARSITY, **opts):
    import io

    from conftest import tiny_params
    from waferscale.params import params_from_dict
    from waferscale.zoo.runner import RunOptions, run

    d = tiny_params(corpus, model_dir)
    if sparsity is not None:
        d["sparsity"] = dict(sparsity)
    run(params_from_dict(d, source="test"), RunOptions(model_dir=model_dir, progress=False, **opts),
        out=io.StringIO())
    return [json.loads(ln) for ln in (model_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_params_sparsity_section_trains_alike_resident_and_streamed_and_resumes_exactly(corpus, tmp_path):
    resident = _zoo(corpus, tmp_path / "r", execution="resident")
    streamed = _zoo(corpus, tmp_path / "s", execution="streaming")
    assert [r["sparsity"] for r in resident] == [r["sparsity"] for r in streamed]
    assert all(abs(r["sparsity"] - 0.7) < 1e-3 and r["sparsity_target"] == 0.7 for r in streamed)
    for a, b in zip(resident, streamed):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"])
    s, u = streamed[4], streamed[5]  # the blocks travel as ~30% of their values plus a bitmask
    assert s["bytes_streamed"] < 0.8 * s["bytes_in"] and s["bytes_reduced"] < 0.8 * s["bytes_out"]
    assert u["bytes_reduced"] == u["bytes_out"]  # RigL's update step (6): the dense gradients come back
    split = tmp_path / "split"
    _zoo(corpus, split, execution="streaming", num_steps=3)  # stops after step 3 (masks were updated at 2)
    resumed = _zoo(corpus, split, execution="streaming")
    assert [r["loss"] for r in resumed] == [r["loss"] for r in streamed]


def test_a_sparse_run_from_a_dense_checkpoint_trains_alike_resident_and_streamed(corpus, tmp_path):
    """Masks drawn from the loaded dense weights (topk), which MemoryX prunes by those masks, not the ones it
    had before the load."""
    from waferscale.runtime.checkpoint import latest_checkpoint

    _zoo(corpus, tmp_path / "dense", sparsity=None, execution="resident", num_steps=3)
    start = str(latest_checkpoint(tmp_path / "dense"))
    topk = {**ZOO_SPARSITY, "init_method": "topk"}
    resident = _zoo(corpus, tmp_path / "r", topk, execution="resident", checkpoint_path=start)
    streamed = _zoo(corpus, tmp_path / "s", topk, execution="streaming", checkpoint_path=start)
    assert len(streamed) == 3
    for a, b in zip(resident, streamed, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]) and a["sparsity"] == b["sparsity"]


def test_export_writes_dense_weights_with_zeros_and_no_masks(corpus, tmp_path, capsys):
    from conftest import wsc_main
    from safetensors.torch import load_file

    md = tmp_path / "run"
    _zoo(corpus, md, execution="streaming", num_steps=2)
    r = wsc_main(capsys, "export", "--checkpoint", str(md), "--format", "hf", "--out", str(tmp_path / "hf"))
    assert r.returncode == 0, r.stderr
    tensors = {}
    for f in (tmp_path / "hf").glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    assert tensors and not any("mask" in k for k in tensors)
    zeros = [float((t == 0).float().mean()) for k, t in tensors.items() if t.ndim == 2 and ".h." in k
             and "ln" not in k]
    assert zeros and min(zeros) >= 0.69, zeros


@pytest.mark.slow
def test_a_params_sparsity_section_on_two_systems_equals_one(corpus, tmp_path):
    one = _zoo(corpus, tmp_path / "one", execution="streaming")
    two = _zoo(corpus, tmp_path / "two", execution="streaming", num_csx=2)
    for a, b in zip(one, two):
        assert abs(a["loss"] - b["loss"]) <= 1e-5 * abs(a["loss"]) and a["sparsity"] == b["sparsity"]


def test_a_filter_that_matches_nothing_names_its_line(corpus, tmp_path, capsys):
    import yaml

    from conftest import tiny_params, wsc_main

    d = tiny_params(corpus, tmp_path / "run")
    d["sparsity"] = {"sparsity": 0.5, "param_filter": ["blocks.*.nothing"]}
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(d, sort_keys=False))
    r = wsc_main(capsys, "run", "--params", str(path), "--execution", "streaming")
    line = next(i for i, ln in enumerate(path.read_text().splitlines(), 1) if ln.strip().startswith("param_filter"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{path}:{line}: sparsity param_filter" in r.stderr and "matches no parameter" in r.stderr, r.stderr
