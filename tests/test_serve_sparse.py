"""Sparse panels (serve/csrc/spanels.c): the same bits as the dense panels of the same matrix, for any density,
shape, number of rows and threads; a pruned model served sparse decodes the same greedy tokens as served dense
with its zeros (WSC_SPARSE_KERNELS=0); a sparse training checkpoint (with `<name>_mask` keys) loads and serves
sparse; and the C under AddressSanitizer and UBSan, with and without AVX-512."""

from __future__ import annotations

import importlib.resources
import platform
import subprocess
from pathlib import Path

import pytest
import torch

from test_serve_csrc import FLAGS, sanitizer_build  # noqa: F401 (a fixture)
from waferscale.models import from_name
from waferscale.runtime import checkpoint as ckpt
from waferscale.runtime.generation import load_for_generation
from waferscale.serve import kernels
from waferscale.serve.engine import Engine, SamplingParams
from waferscale.serve.model_runner import BatchSpec, ModelRunner
from waferscale.sparse.masks import default_filter, mask_for_sparsity

pytestmark = pytest.mark.skipif(not kernels.available(), reason=f"C kernels: {kernels.unavailable_reason()}")
CHECK = Path(__file__).parent / "csrc" / "serve_sparse_check.c"


@pytest.fixture(autouse=True)
def _one_thread_after():
    yield
    kernels.set_threads(1)


def _sparse(out: int, n: int, density: float) -> torch.Tensor:
    """(out, n) with about `density` of it non-zero; pruned weights are +0 or -0, as w * mask leaves them."""
    w = torch.randn(out, n)
    return w * (torch.rand(out, n) < density)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize("out,n", [(5, 37), (33, 17), (50, 64), (131, 77), (960, 576)])
@pytest.mark.parametrize("density", [0.0, 0.05, 0.25, 0.5, 0.9, 1.0])
def test_sparse_linear_is_the_dense_kernel_bit_for_bit(out: int, n: int, density: float) -> None:
    torch.manual_seed(int(density * 100) + out)
    w = _sparse(out, n, density)
    plan = kernels.sparse_plan(w)
    sp, wp = kernels.pack_sparse(w, plan), kernels.pack(w)
    assert sp.blob.numel() == plan.numel and int(sp.off[-1]) == plan.S
    b = torch.randn(out)
    for rows in (1, 2, 3, 8, 13, 17, 40, 64):  # the window kernel's row groups of 8, 4, 2 and 1, alone and mixed
        x, r = torch.randn(rows, n), torch.randn(rows, out)
        assert torch.equal(_bits(kernels.linear(x, sp, out)), _bits(kernels.linear(x, wp, out)))
        assert torch.equal(_bits(kernels.linear(x, sp, out, b, r)), _bits(kernels.linear(x, wp, out, b, r)))


def test_sparse_linear_same_bits_on_two_threads() -> None:
    torch.manual_seed(1)
    w, b = _sparse(700, 96, 0.2), torch.randn(700)
    sp = kernels.pack_sparse(w, kernels.sparse_plan(w))
    for rows in (1, 4, 40):
        x, r = torch.randn(rows, 96), torch.randn(rows, 700)
        kernels.set_threads(1)
        one = kernels.linear(x, sp, 700, b, r)
        assert kernels.set_threads(2) == 2
        assert all(torch.equal(kernels.linear(x, sp, 700, b, r), one) for _ in range(20))  # shared or not
        assert torch.equal(one, kernels.linear(x, kernels.pack(w), 700, b, r))


def test_sparse_pays_only_when_fewer_bytes_and_steps() -> None:
    torch.manual_seed(2)
    shape = (576, 576)
    dense_bytes = 4 * kernels.packed_numel(shape)
    for density, pays in [(1.0, False), (0.7, False), (0.5, True), (0.25, True), (0.1, True)]:
        plan = kernels.sparse_plan(_sparse(*shape, density))
        assert kernels.sparse_pays(shape, plan) == pays, (density, plan)
        if pays:
            assert 4 * plan.numel < 0.75 * dense_bytes
    zeros = torch.zeros(shape)  # nothing to read at all
    plan = kernels.sparse_plan(zeros)
    assert plan.steps == 0 and plan.numel == kernels.PANEL
    assert torch.equal(kernels.linear(torch.randn(2, 576), kernels.pack_sparse(zeros, plan), 576), torch.zeros(2, 576))


def _pruned_llama(sparsity: float) -> torch.nn.Module:
    """A tiny Llama (head_dim 16: the C attention and the one-call decode stack) whose block matrices are pruned
    by magnitude, Cerebras' default filter (the embedding / tied head and the norms stay dense)."""
    torch.manual_seed(0)
    m = from_name("llama-tiny", d_model=64, d_ff=160, max_seq_len=256, attn_bias=True).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if default_filter(name, p) and name.startswith("blocks."):
                p.mul_(mask_for_sparsity(p.abs(), sparsity))
    return m


class _Tok:
    vocab_size, eos_id = 256, None

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(65 + i % 26) for i in ids)


def test_runner_sparse_logits_are_the_dense_bits(monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    model = _pruned_llama(0.75)
    runners = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("WSC_SPARSE_KERNELS", flag)
        runners[flag] = ModelRunner(model, 0, 2, num_blocks=32, block_size=4, has_embed=True, has_head=True,
                                    fast_linear=True)
    err = capsys.readouterr().err
    assert "8 of 9 weight matrices (layers 0..1) sparse enough, in sparse panels" in err
    assert "kept dense (WSC_SPARSE_KERNELS=0)" in err
    dense, sparse = runners["0"], runners["1"]
    assert sparse.stack is not None and sparse.weight_bytes[1] < 0.5 * sparse.weight_bytes[0]
    assert dense.weight_bytes[0] == dense.weight_bytes[1] == sparse.weight_bytes[0]
    seq = [(7 * i) % 250 + 1 for i in range(84)]
    table = list(range(1, 32))
    specs = [BatchSpec(seq, [(0, len(seq), table, True)])]  # a long prompt: attended in blocks, 84 rows
    specs += [BatchSpec([p % 200 + 1], [(p, 1, table, True)]) for p in range(len(seq), len(seq) + 5)]  # the stack
    for spec in specs:
        assert torch.equal(_bits(sparse.run(spec)), _bits(dense.run(spec)))


def test_engine_greedy_tokens_sparse_equal_dense_with_zeros(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _pruned_llama(0.75)
    prompts = [[1, 2, 3, 4, 5], list(range(20, 45)), [9], [(5 * i) % 200 + 3 for i in range(73)]]
    sp = SamplingParams(temperature=0, max_tokens=24)
    got = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("WSC_SPARSE_KERNELS", flag)
        e = Engine(model, _Tok(), block_size=4, num_blocks=128, fast_linear=True, decode_threads=2)
        assert e.c_kernels
        got[flag] = ([e.generate([p], sp)[0] for p in prompts], e.generate(prompts, sp))
        e.close()
    assert got["1"] == got["0"]
    assert got["1"][0] == got["1"][1]  # alone and batched


def test_sparse_checkpoint_with_masks_serves_sparse(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from waferscale.sparse import Static
    from waferscale.sparse.algorithms import sparsify_module

    torch.manual_seed(0)
    m = from_name("llama-tiny", d_model=64, d_ff=160, max_seq_len=128)
    sparsify_module(Static(sparsity=0.8), m)
    m(torch.tensor([[1, 2, 3]]))  # the hooks prune the weights before a forward, as training does
    assert any(k.endswith("_mask") for k in m.state_dict())
    path = ckpt.save_checkpoint(tmp_path, 1, m, m.config.to_dict())
    model, _, _ = load_for_generation(str(path), tokenizer=None, need_tokenizer=False)
    e = Engine(model, _Tok(), block_size=4, num_blocks=64, fast_linear=True)
    assert "in sparse panels" in capsys.readouterr().err
    assert e.weight_bytes[1] < e.weight_bytes[0]
    e.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4))
    e.close()


@pytest.mark.parametrize("arch", ["native", "no-avx512", "no-vpopcntdq"])
@pytest.mark.slow
def test_sparse_kernels_clean_under_asan_and_ubsan(sanitizer_build: tuple[str, dict[str, str]],  # noqa: F811
                                                   tmp_path: Path, arch: str) -> None:
    cc, env = sanitizer_build
    if arch != "native" and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the AVX-512 variants are x86 flags")
    # (no-avx512: the AVX2 path on an AVX-512 machine, its gathers and looked-up expansions)
    extra = {"native": [], "no-avx512": ["-mno-avx512f", "-Wno-psabi"], "no-vpopcntdq": ["-mno-avx512vpopcntdq"]}
    csrc = importlib.resources.files("waferscale.serve").joinpath("csrc")
    exe = tmp_path / "serve_sparse_check"
    r = subprocess.run([cc, f"-I{csrc}", *FLAGS, *extra[arch], str(CHECK), "-o", str(exe), "-lm"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"the sanitizer build failed:\n{r.stderr[-4000:]}"
    r = subprocess.run([str(exe)], capture_output=True, text=True, env=env, timeout=120)
    report = r.stdout[-2000:] + r.stderr[-8000:]
    assert r.returncode == 0, f"serve_sparse_check exited {r.returncode}:\n{report}"
    assert "runtime error" not in r.stderr and "Sanitizer" not in r.stderr, report
    assert "all checks passed" in r.stdout, report
