"""Sparse weight streaming: a cstorch user's sparsity script on "CSX" (MemoryX holds the masks, links move only
the kept values and a bitmask, only the kept gradients come back) trains exactly as the dense reference with the
same masks on "CPU" (resident, masks by hooks), for every algorithm, with one system and with two."""

from __future__ import annotations

import json

import pytest
import torch

from test_cstorch_user_models import _script, assert_same_run
from user_models import train
from waferscale.runtime.layout import build_layouts
from waferscale.runtime.memoryx import MemoryX
from waferscale.runtime.optim import OptimizerSpec
from waferscale.runtime.sparse_stream import expand
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
    assert all(torch.equal(two[1][k], cpu[1][k]) for k in _masks(cpu[1]))


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
