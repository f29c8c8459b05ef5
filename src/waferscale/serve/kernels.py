"""Small C kernels for CPU serving (decode and prefill), built once per machine with the system C compiler.

Why: a decode step reads every weight once, so a step of a few sequences is bound by memory bandwidth and one
of many by the FMA units; both bounds are within reach only if the weights stream while the FMA units stay busy
(figures, and why not `torch.compile`: docs/serving.md; bench/serve_decode.py).

- Weights are packed in panels of 16 outputs (`pack`; the microkernel is in csrc/panels.c): one sequential
  stream that serves one row (decode) and prefill-sized batches alike, so on CPU float32 every projection runs
  here. Each output is one FMA chain over k in order, so results depend neither on the batch nor on the thread
  count; the two decode attentions share their arithmetic, so a sequence decodes to the same bits alone or in
  a batch. `rms_norm` and `silu_mul` agree with torch to float32 rounding (~1e-6 relative), not bit for bit.
- A weight with enough exact zeros (a pruned model) can go in sparse panels instead (`sparse_plan`,
  `pack_sparse`, `sparse_pays`; csrc/spanels.c): masks and non-zero values only, fewer bytes a decode token, the
  same bits as its dense panels.
- The weights live in one 2 MiB-aligned arena on transparent huge pages (`hugepage_tensor`).
- `set_threads` starts a work-stealing pool that shares a product while its workers keep up (csrc/pool.c).

csrc/serve_kernels.c is the one translation unit; it includes the other csrc/ files. It is built for this
machine (-march=native), so the compiler takes the vector path of this CPU (csrc/kernels.h: AVX-512 with or
without VNNI, AVX2 + FMA + F16C with or without AVX-VNNI, ARM NEON with dot-product / i8mm, else the portable
code); WSC_KERNEL_MARCH=LEVEL builds for another -march level instead (x86-64-v3: the AVX2 path on an AVX-512
machine, for benchmarks and tests), and `path()` names the path the loaded build runs. Not available
(`available()` is False) without a C compiler, when the build fails, or with WSC_NO_C_KERNELS=1: serving then
uses the torch path, and says so (`unavailable_reason()`). The shared object is cached under $WSC_CACHE_DIR
(default ~/.cache/waferscale), keyed by the csrc/ files, the compiler, the flags and this CPU's flags, and built
aside then renamed, so concurrent builds (pipeline stages) never see half a file.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

from waferscale.errors import ConfigError
from waferscale.util.paths import cache_dir

__all__ = ["DecodeStack", "PANEL", "argmax", "argmax_rows", "available", "decode_attention", "decode_attention_batch",
           "hugepage_tensor", "linear", "pack", "pack_sparse", "packed_numel", "path", "rms_norm", "set_threads", "silu_mul",
           "sparse_pays", "sparse_plan"]

_CSRC = Path(__file__).resolve().parent / "csrc"  # the C source, shipped as package data
_MAIN = "serve_kernels.c"  # the one translation unit: it includes the other csrc/ files

_FLAGS = ["-O3", "-fPIC", "-shared", "-fno-fast-math", "-pthread"]
MARCH_ENV = "WSC_KERNEL_MARCH"  # -march level of the build (default: native)


def march_flags() -> list[str]:
    """The target flags of the build: -march=native, or -march=$WSC_KERNEL_MARCH; "portable" builds the
    portable code (no vector path: the reference the paths are tested against), for this machine's -march."""
    level = os.environ.get(MARCH_ENV, "").strip() or "native"
    if level == "portable":
        return ["-march=native", "-DWSC_PORTABLE"]
    if not all(c.isalnum() or c in "-_.+" for c in level):
        raise ConfigError(f"{MARCH_ENV}={level!r} is not a -march level (e.g. native, x86-64-v3, armv8.2-a+dotprod)")
    return [f"-march={level}"]
_lib: ctypes.CDLL | None = None
_tried = False
_error: str | None = None
_named_level_failed = False  # the level $WSC_KERNEL_MARCH names does not build: an error, not a fallback


def _cpu_id() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features", "model name")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _sources() -> list[Path]:
    """Every file of the C source (csrc/*.c and *.h), sorted by name; the build's key hashes them all."""
    files = sorted(p for p in _CSRC.glob("*") if p.suffix in (".c", ".h")) if _CSRC.is_dir() else []
    if not any(p.name == _MAIN for p in files):
        raise RuntimeError(f"C kernel source {_CSRC / _MAIN} is missing: reinstall waferscale (the csrc/ files are "
                           "package data)")
    return files


def _build() -> ctypes.CDLL:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc/clang) on PATH")
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    h = hashlib.sha256()
    for f in _sources():
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    flags = [*_FLAGS, *march_flags()]
    h.update("\0".join([cc, version, " ".join(flags), _cpu_id()]).encode())
    key = h.hexdigest()[:16]
    root = cache_dir() / "kernels"
    root.mkdir(parents=True, exist_ok=True)
    so = root / f"serve_kernels-{key}.so"
    if not so.exists():
        # said on stderr: the first build takes a minute or more, and nothing else would say why it waits
        print(f"building the C serving kernels ({' '.join(march_flags())}; once for this source, compiler and "
              "CPU) ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory(dir=root) as tmp:  # built aside, then renamed into place
            out = Path(tmp) / so.name
            r = subprocess.run([cc, *flags, str(_CSRC / _MAIN), "-o", str(out), "-lm"], capture_output=True,
                               text=True, timeout=900)  # (a busy machine can take minutes)
            if r.returncode != 0:
                raise RuntimeError(f"{cc} failed: {r.stderr.strip()[-2000:]}")
            os.replace(out, so)
        print(f"built the C serving kernels in {time.perf_counter() - t0:.0f} s: {so}", file=sys.stderr, flush=True)
    lib = ctypes.CDLL(str(so))
    P, L, F, I = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int
    for name, args, res in [
            ("wsc_linear", [P, P, P, P, P, L, L, L], I),
            ("wsc_linear_sparse", [P, P, P, P, P, P, L, L, L], I),
            ("wsc_qlinear", [P, I, P, P, P, P, L, L, L], I),  # (quant.py)
            ("wsc_qpack", [P, I, L, L, P], I),
            ("wsc_qrows", [P, I, L, L, P, L, P], I),
            ("wsc_qset_int8", [I], I),
            ("wsc_rms_norm", [P, P, F, P, L, L], None),
            ("wsc_decode_attention_ex", [P, P, P, P, L, L, L, L, L, L, F, P, L, P, I], I),
            ("wsc_decode_attention_batch_ex", [P, L, P, L, P, P, P, P, L, P, L, L, L, L, L, F, P, L, L, P, I], I),
            ("wsc_silu_mul", [P, P, L, L], None),
            ("wsc_argmax", [P, L], L),
            ("wsc_argmax_rows", [P, L, L, L, P], None),
            ("wsc_route", [P, L, L, L, P, P], None),
            ("wsc_decode_layers", [P, P, L, L, L, L, L, L, P, P, L, L, L, P], I),
            ("wsc_decode_layers_batch", [P, P, L, L, L, L, L, L, L, P, P, L, P, P, L, L, P, P], I),
            ("wsc_sparse_plan", [P, L, L, P], I),
            ("wsc_sparse_pack", [P, L, L, I, P, P], I),
            ("wsc_set_threads", [I], I),
            ("wsc_kernel_path", [], ctypes.c_char_p)]:
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, res
    return lib


def available() -> bool:
    """Whether the kernels are built and loaded (builds them on the first call). Raises ConfigError when the
    level $WSC_KERNEL_MARCH names does not build: a level asked for by name is not quietly replaced by torch."""
    global _lib, _tried, _error, _named_level_failed
    if not _tried:
        _tried = True
        if os.environ.get("WSC_NO_C_KERNELS", "") not in ("", "0"):
            _error = "disabled by WSC_NO_C_KERNELS"
        else:
            try:
                _lib = _build()
            except ConfigError as e:
                _error, _named_level_failed = str(e), True
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                _error = str(e)
                level = os.environ.get(MARCH_ENV, "").strip()
                if level:
                    first = next((ln for ln in _error.splitlines() if "error" in ln), _error.splitlines()[0])
                    _error = (f"{MARCH_ENV}={level!r}: the C kernels do not build at that level ({first.strip()}); "
                              f"unset {MARCH_ENV} to build for this machine, or name a level the compiler accepts "
                              "(x86-64-v3, x86-64-v4, armv8.2-a+dotprod, portable)")
                    _named_level_failed = True
    if _named_level_failed:
        raise ConfigError(_error)
    return _lib is not None


def unavailable_reason() -> str | None:
    available()
    return _error


def path() -> str:
    """The vector path the C kernels run ("avx512-vnni", "avx2", "avx2-vnni", "neon-dotprod", "portable", ...),
    or "off (WHY)" when they are not available and serving takes the torch path."""
    if not available():
        return f"off ({_error})"
    return _lib.wsc_kernel_path().decode()


HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14  # linux/mman.h


def hugepage_tensor(numel: int) -> Tensor:
    """An uninitialised float32 (numel,) CPU tensor whose memory starts on a 2 MiB boundary and is marked for
    transparent huge pages before it is first touched (Linux; elsewhere, or if madvise fails, plain pages):
    through 4 KiB pages every 4 KiB of weights streamed is a TLB miss, and under virtualisation (nested page
    tables) a costly one (figures: docs/serving.md)."""
    pad = HUGE_PAGE // 4
    raw = torch.empty(numel + pad)
    off = (-raw.data_ptr() % HUGE_PAGE) // 4
    t = raw[off:off + numel]
    if sys.platform.startswith("linux") and numel * 4 >= HUGE_PAGE:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            libc.madvise(t.data_ptr(), (numel * 4 + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE, _MADV_HUGEPAGE)
        except (OSError, AttributeError):
            pass
    return t


def set_threads(threads: int) -> int:
    """Let `threads` threads (the caller's included) share each `linear` call of this process from now on;
    starts workers as needed (idle ones sleep). Returns the number sharing."""
    if not available():
        return 1
    return int(_lib.wsc_set_threads(max(1, int(threads))))


PANEL = 16  # outputs per weight panel (see pack)


def pack(w: Tensor, out: Tensor | None = None) -> Tensor:
    """(out, in) float32 weight -> the kernels' panel layout, (ceil(out / 16), in, 16): panel p holds rows
    16p .. 16p + 15 transposed (rows past `out` zero). Written into `out` when given (e.g. a huge-page arena
    view of numel packed_numel(w.shape))."""
    o, n = w.shape
    P = -(-o // PANEL)
    dst = torch.empty(P, n, PANEL) if out is None else out.view(P, n, PANEL)
    full = o // PANEL
    if full:
        dst[:full].copy_(w[:full * PANEL].view(full, PANEL, n).transpose(1, 2))
    if P > full:
        dst[full:].zero_()
        dst[full, :, :o - full * PANEL].copy_(w[full * PANEL:].t())
    return dst


def packed_numel(shape: tuple[int, int]) -> int:
    return -(-shape[0] // PANEL) * PANEL * shape[1]


# ---- sparse panels (csrc/spanels.c): windows of k with each output's non-zeros, values only --------------------
SPARSE_MAX_FRACTION = 0.75  # a matrix goes sparse when its sparse panels are at most this fraction of the dense
# ones' bytes and take at most this fraction of their steps (a sparse step costs about what a dense k step does):
# decode then reads fewer bytes without running out of arithmetic (docs/serving.md; bench/serve_sparse_decode.py)


class SparsePlan(NamedTuple):
    """How a weight packs in sparse panels: S non-zeros per output and window, `numel` floats, `steps` steps
    (S x windows; the dense panels take ceil(out / 16) x in)."""

    S: int
    numel: int
    steps: int


class SparsePanels(NamedTuple):
    """A weight in sparse panels (csrc/spanels.c): `blob` (float32, plan.numel), `off` ((P + 2,) int64: where
    each panel starts in blob, its end, S). off[P] * 4 bytes are read per product."""

    blob: Tensor
    off: Tensor


def sparse_plan(w: Tensor) -> SparsePlan:
    """The sparse panel layout of an (out, in) float32 weight that takes the fewest steps."""
    info = (ctypes.c_long * 3)()
    w = w.contiguous()
    if _lib.wsc_sparse_plan(w.data_ptr(), w.shape[0], w.shape[1], info) != 0:
        raise MemoryError("sparse_plan: out of memory")
    return SparsePlan(*info)


def sparse_pays(shape: tuple[int, int], plan: SparsePlan) -> bool:
    """Whether sparse panels beat dense ones (SPARSE_MAX_FRACTION of their bytes and of their steps)."""
    return (plan.numel <= SPARSE_MAX_FRACTION * packed_numel(shape)
            and plan.steps <= SPARSE_MAX_FRACTION * -(-shape[0] // PANEL) * shape[1])


def pack_sparse(w: Tensor, plan: SparsePlan, out: Tensor | None = None) -> SparsePanels:
    """(out, in) float32 weight -> its sparse panels as `plan` (sparse_plan(w)) lays them out, written into `out`
    when given (plan.numel floats, e.g. a huge-page arena view)."""
    w = w.contiguous()
    blob = torch.empty(plan.numel) if out is None else out
    off = torch.empty(-(-w.shape[0] // PANEL) + 2, dtype=torch.int64)
    if _lib.wsc_sparse_pack(w.data_ptr(), w.shape[0], w.shape[1], plan.S, blob.data_ptr(), off.data_ptr()) != 0:
        raise MemoryError("pack_sparse: out of memory")
    return SparsePanels(blob, off)


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# The kernels below take float32 contiguous CPU tensors.
def linear(x: Tensor, wp: Tensor | SparsePanels, out: int, bias: Tensor | None = None,
           residual: Tensor | None = None) -> Tensor:
    """(R, in) x, packed weight `wp` (see pack, or pack_sparse) of `out` outputs [, (out,) bias, (R, out)
    residual] -> (R, out) residual + x W^T + bias."""
    R, n = x.shape
    y = torch.empty(R, out)
    if isinstance(wp, SparsePanels):
        rc = _lib.wsc_linear_sparse(wp.blob.data_ptr(), wp.off.data_ptr(), x.data_ptr(), _ptr(bias), _ptr(residual),
                                    y.data_ptr(), R, out, n)
    else:
        rc = _lib.wsc_linear(wp.data_ptr(), x.data_ptr(), _ptr(bias), _ptr(residual), y.data_ptr(), R, out, n)
    if rc != 0:
        raise MemoryError(f"linear over {R} rows: out of memory for the packed input")
    return y


KV_DTYPES = (torch.float32, torch.float16)  # the KV cache dtypes the decode attention reads


def kv16(cache: Tensor) -> int:
    """1 for a float16 KV cache, 0 for float32 (the kernels' flag); anything else is refused."""
    if cache.dtype not in KV_DTYPES:
        raise ValueError(f"the C decode attention reads a float32 or float16 KV cache, not {cache.dtype}")
    return int(cache.dtype == torch.float16)


def decode_attention(qkv: Tensor, cos: Tensor | None, sin_signed: Tensor | None, cache: Tensor, slot0: int,
                     S: int, n_head: int, n_kv: int, window: int = 0, slopes: Tensor | None = None) -> Tensor:
    """One new token of one sequence whose KV is in consecutive slots [slot0, slot0 + S) of `cache`
    ((2 n_kv, slots, hd)): rotates q and k of `qkv` ((1, (n_head + 2 n_kv) hd); in place) by `cos` /
    `sin_signed` ((hd,) each, or None), writes k and v to slot slot0 + S - 1 and returns the (1, n_head * hd)
    attention output (scale 1/sqrt(hd)) over every position, or with `window` over the latest `window` ones (the
    slots before them are not read); `slopes` ((n_head,) float32): ALiBi's bias slope * (t - (S - 1)) on the
    score of position t. The cache is float32 or float16 (k and v are written rounded to nearest)."""
    hd = cache.shape[-1]
    y = torch.empty(1, n_head * hd)
    if _lib.wsc_decode_attention_ex(qkv.data_ptr(), _ptr(cos), _ptr(sin_signed), cache.data_ptr(), cache.shape[1],
                                    slot0, S, n_head, n_kv, hd, hd ** -0.5, y.data_ptr(), window,
                                    _ptr(slopes), kv16(cache)) != 0:
        raise MemoryError(f"decode attention over {S} positions: out of memory for the scores")
    return y


def decode_attention_batch(qkv: Tensor, rows: Tensor, pos: Tensor, cos_t: Tensor | None, sin_t: Tensor | None,
                           cache: Tensor, tables: Tensor, block_size: int, n_head: int, n_kv: int,
                           y: Tensor, window: int = 0, slopes: Tensor | None = None) -> None:
    """Decode tokens of several sequences over a block-paged cache, one C call: for each b, row rows[b] of
    `qkv` ((N, (n_head + 2 n_kv) hd); rotated in place at position pos[b] by the rotary tables `cos_t` /
    `sin_t` ((positions, hd), sin with its first half negated; None: no rotation)) writes its k and v to the
    slot of position pos[b] and attends over positions [0, pos[b]] of its block table tables[b] ((B, max
    blocks) int64), or over its latest `window` positions (table entries before them are not read); the
    result goes to row rows[b] of y ((N, n_head hd)). rows, pos: (B,) int64. slopes: ALiBi, as
    `decode_attention`, whose arithmetic this shares."""
    hd = cache.shape[-1]
    rc = _lib.wsc_decode_attention_batch_ex(
        qkv.data_ptr(), qkv.shape[1], rows.data_ptr(), rows.shape[0], pos.data_ptr(), _ptr(cos_t), _ptr(sin_t),
        cache.data_ptr(), cache.shape[1], tables.data_ptr(), tables.shape[1], block_size, n_head, n_kv, hd,
        hd ** -0.5, y.data_ptr(), y.shape[1], window, _ptr(slopes), kv16(cache))
    if rc != 0:
        raise MemoryError("batched decode attention: out of memory for the scores")


def qrows(data: Tensor, code: int, out: int, inp: int, idx: Tensor, y: Tensor) -> int:
    """Rows idx (int64) of a GGUF matrix of QT_* type `code` (data: its uint8 rows) into y (len(idx), inp) float32;
    0, -2 for an index out of range, or another error code (serve/quant.py's `take`)."""
    return _lib.wsc_qrows(data.data_ptr(), code, out, inp, idx.data_ptr(), idx.numel(), y.data_ptr())


def qpack(data: Tensor, code: int, out: int, inp: int, dst: Tensor) -> int:
    """A GGUF matrix's rows -> the kernels' quantized panels at dst (serve/quant.py's `pack`); 0 on success."""
    return _lib.wsc_qpack(data.data_ptr(), code, out, inp, dst.data_ptr())


def qlinear(packed: Tensor, code: int, x: Tensor, b: Tensor | None, res: Tensor | None, y: Tensor, rows: int,
            out: int, inp: int) -> int:
    """y = res + x W^T + b over quantized panels (serve/quant.py's `linear`); 0 on success."""
    return _lib.wsc_qlinear(packed.data_ptr(), code, x.data_ptr(), _ptr(b), _ptr(res), y.data_ptr(), rows, out, inp)


def qset_int8(on: bool | None) -> bool:
    """The integer path of the quantized products, set when `on` is given; returns the previous setting
    (serve/quant.py's `set_int8_activations`)."""
    return bool(_lib.wsc_qset_int8(-1 if on is None else int(bool(on))))


def silu_mul(gu: Tensor, n: int) -> Tensor:
    """(R, 2n) fused gate|up -> (R, n) silu(gate) * up."""
    R = gu.shape[0]
    y = torch.empty(R, n)
    _lib.wsc_silu_mul(gu.data_ptr(), y.data_ptr(), R, n)
    return y


def argmax(x: Tensor) -> int:
    """Index of the first maximum of a 1-D tensor (the first NaN if any, as torch)."""
    return int(_lib.wsc_argmax(x.data_ptr(), x.shape[0]))


def argmax_rows(x: Tensor, n: int | None = None) -> list[int]:
    """`argmax` of each row of a 2-D tensor with unit column stride, over its first n columns (None: all)."""
    R, V = x.shape
    n = V if n is None else min(n, V)
    if x.stride(1) != 1 or n < 1:
        raise ValueError("argmax_rows needs rows of unit stride and at least one column")
    out = torch.empty(R, dtype=torch.long)
    _lib.wsc_argmax_rows(x.data_ptr(), R, x.stride(0), n, out.data_ptr())
    return out.tolist()


def route(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """A mixture of experts' routing: (R, E) router logits -> (R, k) chosen experts (int64, largest first) and
    their softmax probabilities renormalized over the k (float32), as layers.MoE computes them."""
    R, E = logits.shape
    chosen, w = torch.empty(R, k, dtype=torch.long), torch.empty(R, k)
    _lib.wsc_route(logits.data_ptr(), R, E, k, chosen.data_ptr(), w.data_ptr())
    return chosen, w


def rms_norm(x: Tensor, w: Tensor, eps: float) -> Tensor:
    """(R, n) x, (n,) w -> (R, n) RMSNorm(x) * w."""
    R, n = x.shape
    y = torch.empty(R, n)
    _lib.wsc_rms_norm(x.data_ptr(), w.data_ptr(), eps, y.data_ptr(), R, n)
    return y


_LAYER_PTRS = ("attn_norm", "wqkv", "bqkv", "wo", "bo", "mlp_norm", "wgu", "bgu", "wd", "bd")


_SPARSE_OFFS = {"wqkv": "oqkv", "wo": "oo", "wgu": "ogu", "wd": "od"}  # a matrix's sparse panel offsets
_QUANT_TYPES = {"wqkv": "qqkv", "wo": "qo", "wgu": "qgu", "wd": "qd"}  # a matrix's quantization type (quant.py)


class _LayerT(ctypes.Structure):  # csrc/decode_layers.c's layer_t
    _fields_ = [(f, ctypes.c_void_p) for f in _LAYER_PTRS] + \
        [("attn_eps", ctypes.c_float), ("mlp_eps", ctypes.c_float), ("cache", ctypes.c_void_p)] + \
        [(f, ctypes.c_void_p) for f in _SPARSE_OFFS.values()] + [("window", ctypes.c_long), ("slopes", ctypes.c_void_p)] + \
        [("n_experts", ctypes.c_long), ("top_k", ctypes.c_long)] + \
        [(f, ctypes.c_void_p) for f in ("wr", "orr", "wgu_e", "ogu_e", "wd_e", "od_e", "picked")] + \
        [(f, ctypes.c_int) for f in _QUANT_TYPES.values()] + [("kv16", ctypes.c_int)]


def _blob_off(w: Tensor | SparsePanels) -> tuple[int, int | None]:
    """(weight pointer, sparse panel offsets pointer or None) of a packed weight."""
    return (w.blob.data_ptr(), w.off.data_ptr()) if isinstance(w, SparsePanels) else (w.data_ptr(), None)


class DecodeStack:
    """Layers of Llama-style blocks (RMSNorm, fused q|k|v, GQA attention, fused gate|up SwiGLU or a mixture of
    such experts) for decode tokens, every layer in one C call. Holds references to every tensor it points at."""

    def __init__(self, layers: list[dict], n_head: int, n_kv: int, head_dim: int, ffn: int, window: int = 0,
                 slopes: Tensor | None = None) -> None:
        """layers: per layer attn_norm, attn_eps, wqkv, bqkv, wo, bo, mlp_norm, mlp_eps, wgu, bgu, wd, bd (None
        for absent biases; weights packed by pack or pack_sparse, or wqkv / wo / wgu / wd as QWeights of
        serve/quant.py, packed here once) and cache ((2 n_kv, slots, hd), float32 or float16); a mixture of experts (single-sequence
        decode only: __call__) has instead of wgu / wd the packed router wr, its top_k and experts, [(wgu, wd)]
        without biases (float panels); `picked` ((layers, top_k) int64) then holds after each call the experts
        each layer ran, in index order. window, slopes: every layer's attention over the latest
        `window` positions (0: all), with ALiBi slopes ((n_head,) float32, or None), as `decode_attention`."""
        self._keep = [layers, slopes]
        self.n, self.nh, self.nkv, self.hd, self.ffn = len(layers), n_head, n_kv, head_dim, ffn
        self.C = layers[0]["attn_norm"].shape[0]
        self.slots = layers[0]["cache"].shape[1]
        self._arr = (_LayerT * len(layers))()
        for t, d in zip(self._arr, layers):
            for f in (*_LAYER_PTRS, "cache"):
                v = d[f]
                if f in _QUANT_TYPES and v is not None and hasattr(v, "kernel_panels"):  # a QWeight (serve/quant.py)
                    code, v = v.kernel_panels()
                    setattr(t, _QUANT_TYPES[f], code)
                if isinstance(v, SparsePanels):
                    setattr(t, _SPARSE_OFFS[f], v.off.data_ptr())
                    v = v.blob
                setattr(t, f, _ptr(v))
            t.attn_eps, t.mlp_eps = d["attn_eps"], d["mlp_eps"]
            t.window, t.slopes, t.kv16 = window, _ptr(slopes), kv16(d["cache"])
        experts = [d.get("experts") for d in layers]
        self.moe = any(experts)
        top_k = max((d["top_k"] for d in layers if d.get("experts")), default=0)
        self.picked = torch.zeros(len(layers), max(1, top_k), dtype=torch.long)
        E = 0
        for i, (t, d) in enumerate(zip(self._arr, layers)):
            if not d.get("experts"):
                continue
            E = max(E, len(d["experts"]))
            t.n_experts, t.top_k = len(d["experts"]), d["top_k"]
            t.wr, t.orr = _blob_off(d["wr"])
            for f, o, j in (("wgu_e", "ogu_e", 0), ("wd_e", "od_e", 1)):
                ptrs = [_blob_off(e[j]) for e in d["experts"]]
                arr, offs = (ctypes.c_void_p * len(ptrs))(*[w for w, _ in ptrs]), \
                    (ctypes.c_void_p * len(ptrs))(*[off for _, off in ptrs])
                self._keep += [arr, offs]
                setattr(t, f, ctypes.addressof(arr))
                setattr(t, o, ctypes.addressof(offs))
            t.picked = self.picked[i].data_ptr()
        self._scratch = torch.empty(self.C + (n_head + 2 * n_kv) * head_dim + n_head * head_dim + 3 * ffn
                                    + (E + 2 * self.C if self.moe else 0))

    def __call__(self, x: Tensor, cos: Tensor | None, sin_signed: Tensor | None, slot0: int, S: int) -> Tensor:
        """One token of one sequence: x (1, C) -> (1, C) after every layer, in place (pass a copy if it must
        survive); the token's k/v go to slot slot0 + S - 1, attention reads slots [slot0, slot0 + S) (with a
        window, the latest `window` of them: slot0 may then be negative)."""
        if _lib.wsc_decode_layers(x.data_ptr(), self._arr, self.n, self.C, self.nh, self.nkv, self.hd, self.ffn,
                                  _ptr(cos), _ptr(sin_signed), self.slots, slot0, S, self._scratch.data_ptr()) != 0:
            raise MemoryError(f"decode attention over {S} positions: out of memory for the scores")
        return x

    def batch(self, x: Tensor, pos: Tensor, tables: Tensor, block_size: int, cos_t: Tensor | None,
              sin_t: Tensor | None) -> Tensor:
        """Decode tokens of R sequences over a block-paged cache: x (R, C) -> (R, C) after every layer, in
        place. Token r sits at position pos[r] of its sequence (block table tables[r], (R, max blocks) int64,
        blocks of `block_size` slots); cos_t / sin_t: (positions, hd) rotary tables (sin with its first half
        negated) or None. Same arithmetic as one sequence at a time."""
        if self.moe:
            raise ValueError("DecodeStack.batch runs no mixture of experts (the runner's per-layer path does)")
        R = x.shape[0]
        nq = (self.nh + 2 * self.nkv) * self.hd
        scratch = torch.empty(R * (self.C + nq + self.nh * self.hd + 3 * self.ffn))
        rows = torch.arange(R)
        if _lib.wsc_decode_layers_batch(x.data_ptr(), self._arr, self.n, R, self.C, self.nh, self.nkv, self.hd,
                                        self.ffn, _ptr(cos_t), _ptr(sin_t), self.slots, pos.data_ptr(),
                                        tables.data_ptr(), tables.shape[1], block_size, rows.data_ptr(),
                                        scratch.data_ptr()) != 0:
            raise MemoryError(f"batched decode of {R} sequences: out of memory")
        return x
