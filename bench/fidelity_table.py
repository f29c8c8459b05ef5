"""The published measurements `bench/fidelity.py` projects: every row with its source, where in the source, the
date, the quantity, the published value and unit, and every condition the source gives (or says it does not).

A condition the source does not state says so ("not stated"); what the suite then assumes is in `projection`'s
arguments and the row's `notes`. "secondary" in a source's `via` means the number was read from a quotation of
the source, not from the source itself. Values are copied from the sources, never adjusted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Source:
    title: str
    venue: str  # venue or company
    url: str
    via: str  # how the value was read: the source itself, or a quotation of it (secondary)


@dataclass(frozen=True)
class Row:
    id: str
    source: str  # a key of SOURCES
    where: str  # table / figure / paragraph
    date: str
    quantity: str
    value: float
    unit: str
    # conditions, as the source states them
    model: str
    precision: str
    target: str
    systems: str
    mesh: str
    context: str
    prompt_len: str
    users: str
    speculative: str  # "no", or "yes" with the draft model and acceptance rate
    method: str  # how the source measured (and converted) the value
    # how the suite projects it: a projector of bench/fidelity.py and its arguments
    projection: str
    args: dict[str, Any] = field(default_factory=dict)
    notes: str = ""
    # "calibrate": a kernel-level measurement (one kernel, one collective, one GEMM) the PE's calibrated
    # constants are fitted on (bench/calibrate.py); "validate": an end-to-end figure, never fitted on; "bound": a
    # figure through a public service that includes what the compiler does not model (the network, queueing):
    # the projection must not exceed it, outside the error statistics
    role: str = "validate"


ROLES = ("calibrate", "validate", "bound")
CONDITIONS = ("model", "precision", "target", "systems", "mesh", "context", "prompt_len", "users", "speculative",
              "method")

SOURCES = {
    "WaferLLM": Source(
        "WaferLLM: Large Language Model Inference at Wafer Scale (He et al.)", "OSDI 2025 (USENIX)",
        "https://www.usenix.org/system/files/osdi25-he.pdf",
        "the paper's text; model configs from github.com/junesookang/WaferLLM Decode/WSE-2/model_config"),
    "Cerebras": Source(
        "Introducing Cerebras Inference: AI at Instant Speed", "Cerebras Systems (blog)",
        "https://cerebras.ai/blog/introducing-cerebras-inference-ai-at-instant-speed",
        "the blog; 4 x CS-3 for 70B from The Register's Hot Chips 2024 coverage"),
    "Cerebras-405B": Source(
        "Cerebras video shows AI writing code 75x faster than world's fastest AI GPU cloud", "Tom's Hardware",
        "https://www.tomshardware.com/tech-industry/artificial-intelligence/cerebras-video-shows-ai-writing-code-"
        "75x-faster-than-worlds-fastest-ai-gpu-cloud-worlds-largest-chip-beats-awss-fastest-in-head-to-head-"
        "comparison",
        "secondary: Tom's Hardware quoting Cerebras (the Cerebras blog of 2024-11-18 was not read)"),
    "Cerebras-3x": Source(
        "Cerebras Inference now 3x faster", "Cerebras Systems (press release)",
        "https://hn.masterscheme.cn/item?id=41942582",
        "secondary: release text quoted on Hacker News; the ~2,100 tok/s figure from third-party copies"),
    "ArtificialAnalysis": Source(
        "Cerebras CS-3 low-latency inference API (quoting Artificial Analysis via Cerebras SVP H. Lupesko)",
        "Artificial Analysis (independent measurement), quoted by anintent.com",
        "https://anintent.com/blog/cerebras-cs-3-low-latency-inference-api/",
        "secondary: a tutorial quoting Cerebras quoting Artificial Analysis"),
    "SC20": Source(
        "Fast Stencil-Code Computation on a Wafer-Scale Processor (Rocki et al.)", "SC20 (IEEE/ACM)",
        "https://arxiv.org/abs/2010.03660",
        "secondary: the sentence as quoted verbatim in two third-party notes citing arXiv:2010.03660"),
    "Miyajima": Source(
        "Single-precision matrix multiplication on the CS-2 (Miyajima, Matsuzaki, Mukunoki)",
        "Journal of Information Processing vol. 34 p. 132", "https://doi.org/10.2197/ipsjjip.34.132",
        "the abstract (https://www.synapsesocial.com/papers/69a7611ec6e9836116a2ebaa)"),
}

# WaferLLM's benchmark: one layer on a P x P mesh, fp16, batch 1, one head with n_kv_heads 1 and head_dim = dim,
# dims and the 4K KV context padded up to multiples of P (their llama8B_4k_1_{420,660}.json); reported
# tokens/s = 1.1e9 / (one layer's cycles x n_layers) (their launcher: freq_ghz = 1.1; no embedding, no head).
_WL = dict(precision="fp16", target="WSE-2", systems="1 (one layer measured)", users="1 (batch 1)",
           speculative="no")
_WL_DEC = dict(_WL, context="4K KV cache (4096 padded to a multiple of P: 4200 at P=420)", prompt_len="n/a (decode)",
               method="one decoder layer's device cycles (TSC, 100 timed runs) x n_layers at 1.1 GHz; no "
                      "embedding or head; dims padded to multiples of P, 1 head, n_kv_heads 1, head_dim = dim")
_WL_PF = dict(_WL, context="the 4096-token prompt", prompt_len="4096",
              method="TPR = 4096 / prefill time at 1.1 GHz (cycles measured on device; layers only, as for decode "
                     "-- an assumption: the prefill launcher was not read)")
_SUBSET = "a subset of layers measured and scaled to all layers (paper: 'uniform layer structure')"
_PADDING = ("padding by the rule of their Llama3-8B configs (none published for this model and mesh): dims and "
            "context up to multiples of P")
# (tag, model key of fidelity.WAFERLLM_MODELS, as the paper names it, layers compiled (None: all), Table 4's decode
# TPR by mesh side, Table 3's prefill TPR by mesh side)
_WL_TABLES = (
    ("8B", "llama3-8b", "Llama3-8B (32 layers)", None,
     {420: 2699.9, 540: 2501.5, 660: 2243.3}, {480: 20320.6, 600: 25037.2, 720: 27686.5}),
    ("13B", "llama2-13b", "Llama2-13B (40 layers; 4K limit removed)", None,
     {420: 2039.2, 540: 1899.4, 660: 1739.8}, {480: 13685.1, 600: 16854.2, 720: 17498.3}),
    ("34B", "codellama-34b", f"CodeLlama-34B (48 layers; {_SUBSET})", 4,
     {420: 1450.8, 540: 1407.7, 660: 1359.2}, {480: 5471.4, 600: 7540.1, 720: 8526.0}),
    ("72B", "qwen2-72b", f"Qwen2-72B (80 layers; {_SUBSET})", 4,
     {420: 839.7, 540: 824.3, 660: 787.1}, {480: 2785.2, 600: 3775.5, 720: 4421.6}),
)


def _wl_notes(model: str, side: int, layers: int | None) -> str:
    padding = "padding as their published config" if model == "llama3-8b" and side in (420, 660) else _PADDING
    subset = f"; {layers} layers compiled and scaled to all, as the paper scaled its subset" if layers else ""
    bias = "; no q/k/v bias (their kernel has none)" if model == "qwen2-72b" else ""
    return padding + subset + bias


_CS = dict(precision="16-bit", target="WSE-3 (CS-3)", mesh="not stated", context="not stated (compiler default)",
           users="not stated (a public service: the compiler picks)")

ROWS: list[Row] = [
    # ---- WaferLLM decode (Table 4) and prefill (Table 3) ---------------------------------------------------
    *[Row(f"WL-DEC-{tag}-{p}", "WaferLLM", "Table 4 (decode TPR)", "2025-07", "decode tokens/s per request", v,
          "tokens/s", model=name, mesh=f"{p}x{p}", **_WL_DEC, projection="waferllm_decode",
          args=dict(model=key, side=p, layers=layers), notes=_wl_notes(key, p, layers))
      for tag, key, name, layers, dec, _ in _WL_TABLES for p, v in dec.items()],
    *[Row(f"WL-PF-{tag}-{p}", "WaferLLM", "Table 3 (prefill TPR, 4096-token prompt)", "2025-07",
          "prefill tokens/s per request", v, "tokens/s", model=name, mesh=f"{p}x{p}", **_WL_PF,
          projection="waferllm_prefill", args=dict(model=key, side=p, layers=layers),
          notes=_wl_notes(key, p, layers))
      for tag, key, name, layers, _, pf in _WL_TABLES for p, v in pf.items()],
    # ---- WaferLLM GEMV, Table 6 --------------------------------------------------------------------------
    *[Row(f"WL-GEMV-{n // 1024}K", "WaferLLM", "Table 6 (MeshGEMV, WSE-2 time)", "2025-07",
          f"GEMV [1,{n // 1024}K] x [{n // 1024}K,{n // 1024}K] time", v, "us", model="kernel", precision="fp16",
          target="WSE-2", systems="1", mesh="not stated (the paper autotunes core counts)", context="n/a",
          prompt_len="n/a", users="1 vector", speculative="no",
          method="MeshGEMV (K-tree all-reduce, K=2 phases) device cycles at 1.1 GHz",
          projection="gemv", args=dict(n=n), role="calibrate",
          notes="projected at the square mesh (sides 30..750) and all-reduce the cost model finds fastest")
      for n, v in ((16384, 1.2), (32768, 2.03))],
    # ---- Cerebras inference service ----------------------------------------------------------------------
    Row("CS-8B", "Cerebras", "opening paragraph", "2024-08-27", "decode tokens/s per user", 1800, "tokens/s",
        model="Llama-3.1-8B", systems="1 implied ('20B models fit on a single CS-3')", prompt_len="not stated",
        speculative="no (implemented only from the Oct-2024 release)", **_CS,
        method="vendor claim ('as benchmarked by Artificial Analysis' per the companion blog)",
        projection="zoo", args=dict(model="llama3.1-8b", systems=1, quantity="decode")),
    Row("CS-70B", "Cerebras", "opening paragraph; The Register (Hot Chips 2024)", "2024-08-27",
        "decode tokens/s per user", 450, "tokens/s", model="Llama-3.1-70B", systems="4 CS-3",
        prompt_len="not stated", speculative="no (implemented only from the Oct-2024 release)", **_CS,
        method="vendor claim, 'per user'", projection="zoo",
        args=dict(model="llama3.1-70b", systems=4, quantity="decode")),
    Row("CS-405B", "Cerebras-405B", "paragraph 'token rate of 969 per second'", "2024-11-20",
        "decode tokens/s per user", 969, "tokens/s", model="Llama-3.1-405B", systems="not stated",
        prompt_len="~1K (secondary, INF-14)", speculative="not stated", **_CS,
        method="vendor demo/claim", projection="zoo",
        args=dict(model="llama3.1-405b", systems=None, prompt_len=1024, quantity="decode"),
        notes="systems: the fewest the compiler needs; prompt 1,024 tokens"),
    Row("CS-405B-TTFT", "Cerebras-405B", "paragraph 'time-to-first-token of just 0.24 seconds'", "2024-11-20",
        "time to first token", 0.24, "s", model="Llama-3.1-405B", systems="not stated",
        prompt_len="~1K (secondary, INF-14)", speculative="not stated", **_CS, method="vendor demo/claim",
        projection="zoo", args=dict(model="llama3.1-405b", systems=None, prompt_len=1024, quantity="ttft"),
        notes="systems: the fewest the compiler needs; prompt 1,024 tokens; a bound: a demo of the public service "
              "(its request path and queueing are not modelled)", role="bound"),
    Row("CS-70B-SPEC", "Cerebras-3x", "release text ('implements speculative decoding')", "2024-10-24",
        "decode tokens/s per user", 2100, "tokens/s", model="Llama-3.1-70B", systems="4 (secondary)",
        prompt_len="not stated", speculative="yes; draft not disclosed; acceptance not disclosed", **_CS,
        method="vendor claim after a software release (kernels rewritten, speculative decoding)",
        projection="speculative", args=dict(model="llama3.1-70b", systems_from=4, draft="llama3.1-8b", k=8,
                                            acceptance=0.5868),
        notes="systems: the fewest from 4 up that hold target and draft; "
              "assumed: draft llama3.1-8b, K = 8, acceptance 0.5868: the best setting a third party measured for "
              "Llama-3-70B with a Llama-3-8B draft (llama.cpp, greedy; 'Accepted Rate: 58.68' at draft 8, https://"
              "devquasar.com/uncategorized/speculative-decoding-tradeoffs-gpu-with-large-models-llama-70b-8b/)"),
    # ---- Artificial Analysis (via Cerebras) --------------------------------------------------------------
    Row("AA-70B", "ArtificialAnalysis", "paragraph '2,314 tokens per second on Llama 3.3 70B'", "2025",
        "output tokens/s", 2314, "tokens/s", model="Llama-3.3-70B (same architecture as Llama-3.1-70B)",
        systems="not stated", prompt_len="Artificial Analysis' standard workload (not stated)",
        speculative="not stated (the service uses it since Oct 2024)", **_CS,
        method="independent measurement of the public API (Artificial Analysis)", projection="zoo",
        args=dict(model="llama3.1-70b", systems=4, quantity="decode"),
        notes="systems: 4 as at the 70B launch; no speculative decoding projected"),
    Row("AA-70B-TTFT", "ArtificialAnalysis", "paragraph 'time-to-first-token around 170 milliseconds'", "2025",
        "time to first token", 0.17, "s", model="Llama-3.3-70B (same architecture as Llama-3.1-70B)",
        systems="not stated", prompt_len="Artificial Analysis' standard workload (not stated)",
        speculative="not stated", **_CS, method="independent measurement of the public API (includes the network)",
        projection="zoo", args=dict(model="llama3.1-70b", systems=4, quantity="ttft"),
        notes="systems: 4 as at the 70B launch; prompt: the compiler default; a bound: measured over the network "
              "through the public API", role="bound"),
    # ---- kernels from independent papers -----------------------------------------------------------------
    Row("SC20-AR", "SC20", "text ('about 10% greater than the diameter')", "2020-11", "all-reduce of 1 value",
        1.1 * (600 + 595 - 2), "cycles", model="kernel", precision="fp32 (a solver's dot product; not in the quote)",
        target="WSE-1 (CS-1)", systems="1",
        mesh="~600x595 (the stencil's x-y plane)", context="n/a", prompt_len="n/a", users="n/a", speculative="no",
        method="cycle count relative to the mesh diameter (value = 1.1 x (600 + 595 - 2) cycles)",
        projection="allreduce", args=dict(rows=595, cols=600), role="calibrate",
        notes="a centre-rooted reduce then broadcast in the paper; every all-reduce of the cost model tried"),
    Row("JIP-SGEMM", "Miyajima", "abstract", "2026 (vol. 34)", "SGEMM throughput, 33,000^2", 349.0, "TFLOP/s",
        model="kernel", precision="fp32", target="WSE-2 (CS-2)", systems="1", mesh="750x750", context="n/a",
        prompt_len="n/a", users="n/a", speculative="no", method="measured FLOP/s (clock not stated)",
        projection="sgemm", args=dict(n=33000, side=750), role="calibrate",
        notes="the fastest GEMM schedule of the cost model (SUMMA, Cannon, weight-stationary) at WSE-2's 1.1 GHz"),
]
