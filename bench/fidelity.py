"""Fidelity suite: published wafer-scale measurements run through the compiler under the same conditions.

    python bench/fidelity.py [--out DIR] [--json | --markdown] [--only ID,ID..]

Every row of `fidelity_table.ROWS` (a published value, its source and its conditions) is projected by the
compiler (`compile_model`) or, for a kernel measurement, by the fabric cost model the compiler composes
(`fabric/cost_*.py`); the suite prints projected vs published, the signed error (projected / published - 1),
where the projected time goes (the plan's time shares by bottleneck: compute, SRAM, fabric latency, routing,
I/O; or a kernel's cycle parts) and the layout and window the compiler chose; then the median and worst
|error| and how many rows are within +-25%. A row the compiler refuses prints the ConfigError's reason and
counts as not reached. Nothing here is fitted to the published values: the suite only runs the compiler.

With --out DIR: fidelity.json (every row, its conditions, projection and error) and fidelity.png (log-log
projected vs published with the +-25% band, one marker per source, calibration rows blue and validation rows
orange), each written to a temporary file and
renamed into place. Exit status 2 with a message on bad arguments (an --out that cannot be a directory).
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))  # fidelity_table, when imported from elsewhere

from fidelity_table import ROWS, SOURCES, Row  # noqa: E402

from waferscale.errors import ConfigError  # noqa: E402

BAND = 0.25  # the target: every row within +-25%

# WaferLLM's four models: (d_model, d_ff, n_layers, vocab). Llama3-8B has the zoo's llama3.1-8b shapes and
# Llama2-13B is the zoo's llama2-13b (`_zoo_shape`); CodeLlama-34B as huggingface.co/codellama/CodeLlama-34b-hf's
# config.json; Qwen2-72B's dims and layers as WaferLLM's own qwen72B_32k_1_square.json (MeshInfra/WaferLLM
# Decode/WSE-3/test_config), its vocabulary as Qwen/Qwen2-72B's config.json (embedding and head are not timed).
WAFERLLM_MODELS = {
    "llama3-8b": "llama3.1-8b",
    "llama2-13b": "llama2-13b",
    "codellama-34b": (8192, 22016, 48, 32000),
    "qwen2-72b": (8192, 29568, 80, 152064),
}
WAFERLLM_CONTEXT = 4096  # their "4k" configs: the KV context, padded to a multiple of P
WAFERLLM_PROMPT = 4096  # Table 3's prompt
MAX_SYSTEMS_TRIED = 8  # beyond the first count that can hold the weights, when the row leaves systems open
GEMV_SIDES = tuple(range(30, 751, 30))  # square meshes tried for the GEMV rows (WSE-2's program is 750 wide)


@dataclass
class Projection:
    value: float
    parts: dict[str, float]  # time shares by bottleneck (a plan), or cycles by part (a kernel)
    parts_unit: str  # "share" or "cycles"
    layout: str  # the layout and window (or mesh and algorithm) chosen
    detail: str  # what else the projection rests on


# ---- WaferLLM's benchmark models ---------------------------------------------------------------------------

def _zoo_shape(m: str | tuple[int, int, int, int]) -> tuple[int, int, int, int]:
    from waferscale.models import config_from_name

    if isinstance(m, tuple):
        return m
    c = config_from_name(m)
    return c.d_model, c.ffn_dim, c.n_layer, c.vocab_size


WAFERLLM_PARAMS = Path(__file__).resolve().parent / "waferllm"  # their benchmark layers as Model Zoo params files


def waferllm_context(side: int) -> int:
    """Their 4K KV context padded up to a multiple of the mesh side (4200 at P=420)."""
    return -(-WAFERLLM_CONTEXT // side) * side


def waferllm_params_path(model: str, side: int) -> Path:
    return WAFERLLM_PARAMS / f"{model}-p{side}.yaml"


def waferllm_params_yaml(model: str, side: int, layers: int | None) -> str:
    """WaferLLM's benchmark layer for a side x side mesh as a Model Zoo params file: dims and the 4K context
    padded up to multiples of the side, one head with one KV head of head_dim = dim (their llama8B_4k_1_<P>.json),
    no biases, fp16; `layers` of them (all of the model's when None). `wsc compile --params` reads it."""
    d, ffn, n_layers, vocab = _zoo_shape(WAFERLLM_MODELS[model])
    pad = lambda x: -(-x // side) * side  # noqa: E731
    ctx = waferllm_context(side)
    scaled = (f"# {layers} of its {n_layers} layers (the paper measured a subset and scaled it to all layers)\n"
              if layers else "")
    return (f"# WaferLLM (OSDI'25) benchmark layer of {model} for a {side}x{side} mesh: written by bench/fidelity.py\n"
            f"# (waferllm_params_yaml); dims and the 4K context padded to multiples of {side}, one head, one KV head,\n"
            f"# head_dim = dim, no biases, fp16, as their llama8B_4k_1_<P>.json configs\n{scaled}"
            "model:\n"
            f"    vocab_size: {vocab}\n    hidden_size: {pad(d)}\n    num_hidden_layers: {layers or n_layers}\n"
            f"    num_heads: 1\n    extra_attention_params:\n        num_kv_groups: 1\n    filter_size: {pad(ffn)}\n"
            f"    max_position_embeddings: {ctx}\n    position_embedding_type: rotary\n    rotary_dim: {pad(d)}\n"
            "    share_embedding_weights: false\n    nonlinearity: swiglu\n    norm_type: rmsnorm\n"
            "    use_bias_in_output: false\n    use_ffn_bias: false\n    use_projection_bias_in_attention: false\n"
            "    attention_type: scaled_dot_product\n    mixed_precision: true\n    fp16_type: float16\n"
            "train_input:\n    data_processor: GptHDF5MapDataProcessor\n    data_dir: [shakespeare]\n"
            f"    max_sequence_length: {ctx}\n    batch_size: 1\n"
            "optimizer:\n    optimizer_type: adamw\n    learning_rate: 1.0e-4\n"
            "runconfig:\n    max_steps: 1\n")


def waferllm_graph(model: str, side: int, layers: int | None):
    """WaferLLM's benchmark layer for a side x side mesh as a Graph, read from its params file as `wsc compile
    --params` reads it (`waferllm_params_yaml`; the rows' files are kept in bench/waferllm/, tests check they
    are current). Returns (graph, context, layers of the model)."""
    import tempfile

    from waferscale.params import load_params
    from waferscale.zoo.wafer import params_graph

    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / waferllm_params_path(model, side).name
        path.write_text(waferllm_params_yaml(model, side, layers))
        g = params_graph(load_params(path))
    return g, waferllm_context(side), _zoo_shape(WAFERLLM_MODELS[model])[2]


def _waferllm_command(model: str, side: int, systems: int, prompt_len: int | None) -> str:
    """The `wsc compile` that reproduces a WaferLLM row: its per-layer time is the blocks' unit_times_s (decode)
    or unit_prefill_s (prefill) in plan.json."""
    ctx = waferllm_context(side)
    path = waferllm_params_path(model, side).relative_to(WAFERLLM_PARAMS.parent.parent)
    return (f"wsc compile --params {path} --target wse2 --pes {side}x{side} --layout model_parallel --users 1 "
            f"--context_len {ctx} --systems {systems}" + (f" --prompt_len {prompt_len}" if prompt_len else "")
            + " --out DIR")


def _compile_fewest(counts, **request):
    """compile_model on the first system count of `counts` that it accepts; the last refusal otherwise."""
    from waferscale.compiler.compile import compile_model

    err = None
    for n in counts:
        try:
            return compile_model(systems=n, **request)
        except ConfigError as e:
            err = e
    raise err


def _waferllm_plan(model: str, side: int, layers: int | None, prompt_len: int | None, assume=None):
    g, ctx, n_layers = waferllm_graph(model, side, layers)
    plan = _compile_fewest(range(1, MAX_SYSTEMS_TRIED + 1), graph=g, target="wse2", pes=(side, side),
                           layout="model_parallel", users=1, context_len=ctx, prompt_len=prompt_len, assume=assume)
    blocks = [i for i, u in enumerate(g.units) if u.kind == "block"]
    return plan, g, blocks, n_layers / len(blocks), ctx


def _layer_shares(plan, g, blocks: list[int], time_of) -> dict[str, float]:
    """Where the layers' time goes (the plan's shares cover the whole step: embedding, head, hops, I/O):
    `time_of(cc, unit)` is the model-parallel module's own per-unit time on the plan's window."""
    from waferscale.compiler.context import CompileContext
    from waferscale.compiler.project import Time
    from waferscale.fabric.spec import FabricSpec

    cc = CompileContext(g, FabricSpec(**plan.fabric), [], plan.systems, [])
    t = Time()
    for i in blocks:
        t += time_of(cc, g.units[i])
    return t.shares()


def _where(plan, blocks: list[int], scale: float, ctx: int) -> str:
    scaled = f", {len(blocks)} layers compiled x {scale:g}" if scale != 1 else ""
    return (f"{plan.systems} x {plan.target}, KV context {ctx}{scaled}; the most loaded PE holds "
            f"{plan.projection['peak_bytes_per_pe'] / 1024:.1f} KiB (weights, KV cache, activations)")


def waferllm_decode(model: str, side: int, layers: int | None = None, assume=None) -> Projection:
    """Their method: the block units' decode times summed (no embedding, head or hops between windows) and
    scaled to all layers; tokens/s = 1 / that. The shares are those layers'."""
    from waferscale.compiler.model_parallel import unit_time

    plan, g, blocks, scale, ctx = _waferllm_plan(model, side, layers, None, assume)
    p = plan.projection
    t = sum(p["unit_times_s"][i] for i in blocks) * scale
    shares = _layer_shares(plan, g, blocks, lambda cc, u: unit_time(cc, u, side, side, 1, ctx))
    whole = f"; whole step (embedding, head, hops) {p['decode_tokens_per_s_per_user']:,.0f} tok/s" if scale == 1 else ""
    cmd = _waferllm_command(model, side, plan.systems, None)
    return Projection(1 / t, shares, "share", f"{p['layout']} {p['window']}",
                      _where(plan, blocks, scale, ctx) + f"; GEMV all-reduce {p.get('gemv_allreduce')}" + whole
                      + f"; reproduce: {cmd} (1 / the blocks' unit_times_s summed" + (f", x {scale:g}" if scale != 1
                                                                                   else "") + ")")


def waferllm_prefill(model: str, side: int, layers: int | None = None, assume=None) -> Projection:
    """Their method: TPR = 4096 / the block units' prefill times summed and scaled to all layers."""
    from waferscale.compiler.model_parallel import unit_prefill

    plan, g, blocks, scale, ctx = _waferllm_plan(model, side, layers, WAFERLLM_PROMPT, assume)
    p = plan.projection
    t = sum(p["unit_prefill_s"][i] for i in blocks) * scale
    shares = _layer_shares(plan, g, blocks, lambda cc, u: unit_prefill(cc, u, side, side, WAFERLLM_PROMPT))
    whole = f"; whole prompt incl. embedding/head {p['time_to_first_token_s'] * 1e3:.1f} ms" if scale == 1 else ""
    cmd = _waferllm_command(model, side, plan.systems, WAFERLLM_PROMPT)
    return Projection(WAFERLLM_PROMPT / t, shares, "share", f"{p['layout']} {p['window']}",
                      _where(plan, blocks, scale, ctx) + whole + f"; reproduce: {cmd} ({WAFERLLM_PROMPT} / the blocks' "
                      "unit_prefill_s summed" + (f", x {scale:g}" if scale != 1 else "") + ")")


# ---- the Cerebras inference service -----------------------------------------------------------------------

def _zoo_plan(model: str, systems: int | None, prompt_len: int | None, assume=None, **extra):
    from waferscale.compiler.api import estimate_memory

    if systems:
        counts = [systems]
    else:  # not published: the fewest the compiler accepts, from the first that holds the weights
        first = int(estimate_memory(model=model, target="wse3")["inference_systems_needed"])
        counts = range(first, first + MAX_SYSTEMS_TRIED)
    return _compile_fewest(counts, model=model, target="wse3", prompt_len=prompt_len, assume=assume, **extra)


def _plan_layout(p: dict) -> str:
    return p.get("layout", "pipelined") + (f" {p['window']}" if p.get("window") else "")


def _plan_detail(plan) -> str:
    p = plan.projection
    cands = "; ".join(f"{k}: " + (f"refused ({v['refused'][:80]})" if "refused" in v else
                                  f"{v['decode_tokens_per_s_per_user']:,.0f} tok/s/user x {v['users']}, "
                                  f"TTFT {v['time_to_first_token_s'] * 1e3:.1f} ms")
                      for k, v in p.get("layouts", {}).items())
    return (f"{plan.systems} x {plan.target}, {p['users_in_flight']} user(s) in flight, context {p['context_len']}, "
            f"prompt {p['prompt_len']}" + (f"; layouts compared: {cands}" if cands else ""))


def zoo(model: str, systems: int | None, quantity: str, prompt_len: int | None = None, assume=None) -> Projection:
    """A zoo model on WSE-3 with the compiler's own choices (layout, users, context) where the source is silent."""
    plan = _zoo_plan(model, systems, prompt_len, assume)
    p = plan.projection
    if quantity == "ttft":
        return Projection(p["time_to_first_token_s"], dict(p.get("prefill_time_shares", {})), "share",
                          _plan_layout(p), _plan_detail(plan))
    return Projection(p["decode_tokens_per_s_per_user"], dict(p["decode_time_shares"]), "share", _plan_layout(p),
                      _plan_detail(plan))


def speculative(model: str, systems_from: int, draft: str, k: int, acceptance: float, assume=None) -> Projection:
    """Speculative decoding (`compiler/speculative.py`): `draft` on a band of the wafer drafts k tokens a round,
    each accepted with probability `acceptance`; the target verifies them as a chunk (pipelined layout). On the
    fewest systems from `systems_from` up that hold both."""
    from waferscale.compiler.speculative import Speculation

    plan = _compile_fewest(range(systems_from, systems_from + MAX_SYSTEMS_TRIED), model=model, target="wse3",
                           layout="pipelined", speculative=Speculation("draft", k, acceptance, draft_model=draft),
                           assume=assume)
    s = plan.projection["speculative"]
    return Projection(s["tokens_per_s_per_user"], dict(s["verify_time_shares"]), "share",
                      _plan_layout(plan.projection),
                      _plan_detail(plan) + f"; {s['expected_tokens_per_round']:.2f} tokens per round of "
                      f"{s['round_s'] * 1e6:.0f} us (draft {s['draft_s_per_token'] * 1e6:.1f} us/token, verify "
                      f"{s['verify_s'] * 1e6:.1f} us); x{s['speedup_vs_plain']:.2f} over plain decode on the same "
                      f"placement, x{s['speedup_vs_alone']:.2f} over the target alone; shares are the verify pass's")


# ---- kernels ----------------------------------------------------------------------------------------------

def _spec(target: str, assume):
    """The target's preset with `assume` (new values of its unpublished or calibrated constants) applied."""
    from waferscale.fabric import assumptions
    from waferscale.fabric.presets import fabric_from_name

    return assumptions.apply(fabric_from_name(target), target, assume or {})


def _cycle_parts(c) -> dict[str, float]:
    return {"compute": c.compute, "SRAM": c.sram, "fabric": c.fabric, "fill/drain": c.fill_drain, "total": c.total}


def gemv(n: int, assume=None) -> Projection:
    """y = W x, W n x n fp16, as the model-parallel layout runs it (`gemv_allreduce_cycles`) on WSE-2: the
    fastest of every square mesh of GEMV_SIDES and every all-reduce the compiler tries."""
    from waferscale.compiler.model_parallel import GEMV_ALGOS
    from waferscale.fabric.cost_matmul import gemv_allreduce_cycles
    from waferscale.fabric.presets import fabric_from_name

    spec = _spec("wse2", assume)
    best = None
    for side in GEMV_SIDES:
        for algo, fan_in in GEMV_ALGOS:
            c = gemv_allreduce_cycles(spec, n, n, side, side, "fp16", algo=algo, fan_in=fan_in)
            if best is None or c.total < best[0].total:
                best = (c, side, f"{algo} (fan_in {fan_in})")  # the cost model's own names
    c, side, algo = best
    name, fan_in = algo.split(" (fan_in ")
    cmd = (f"wsc kernel gemv --m {n} --k {n} --target wse2 --pes {side}x{side} --algo {name} "
           f"--fan_in {fan_in.rstrip(')')}")
    return Projection(c.total / spec.clock_hz * 1e6, _cycle_parts(c), "cycles", f"{side}x{side} {algo}",
                      f"bottleneck {c.bottleneck}, {c.passes} pass(es), at {spec.clock_hz / 1e9:g} GHz; "
                      f"{len(GEMV_SIDES)} meshes x {len(GEMV_ALGOS)} all-reduces tried; reproduce: {cmd}")


def allreduce(rows: int, cols: int, assume=None) -> Projection:
    """One fp32 value all-reduced over WSE-1's rows x cols PEs: the fastest algorithm of the cost model."""
    from waferscale.fabric.cost_collectives import allreduce_cycles
    from waferscale.fabric.presets import fabric_from_name

    spec = _spec("wse1", assume)
    runs = {a: allreduce_cycles(spec, 1, rows, cols, a) for a in ("chain", "tree", "2d")}  # rooted at PE (0, 0)
    for phases in (1, 2):  # rooted at the centre PE, as the paper describes
        runs[f"center/{phases}"] = allreduce_cycles(spec, 1, rows, cols, "center", fan_in=phases)
    algo = min(runs, key=lambda a: runs[a].total)
    c = runs[algo]
    name, _, k = algo.partition("/")
    cmd = f"wsc kernel allreduce --m 1 --k 1 --target wse1 --pes {rows}x{cols} --algo {name}" + \
        (f" --fan_in {k}" if k else "")
    return Projection(c.total, _cycle_parts(c), "cycles", f"{rows}x{cols} {algo}",
                      ", ".join(f"{a} {r.total:,.0f}" for a, r in runs.items()) +
                      f" cycles (center/K: K phases per axis); diameter {rows + cols - 2}; reproduce: {cmd}")


def sgemm(n: int, side: int, assume=None) -> Projection:
    """An n^3 fp32 GEMM on WSE-2's side x side PEs: the fastest schedule the cost model accepts (SUMMA, Cannon,
    folded Cannon on 2D-distributed operands; the weight-stationary streamed GEMM); TFLOP/s at 1.1 GHz."""
    from waferscale.fabric.cost_gemm2d import gemm2d_cycles
    from waferscale.fabric.cost_matmul import gemm_cycles
    from waferscale.fabric.presets import fabric_from_name

    spec = _spec("wse2", assume)
    runs, refused = {}, {}
    for algo in ("summa", "cannon", "cannon_folded"):
        try:
            runs[algo] = gemm2d_cycles(spec, n, n, n, side, side, "fp32", algo=algo)
        except ConfigError as e:
            refused[algo] = str(e).split(";")[0]
    runs["weight-stationary"] = gemm_cycles(spec, n, n, n, side, side, "fp32")
    algo = min(runs, key=lambda a: runs[a].total)
    c = runs[algo]
    cmd = (f"wsc kernel gemm --m {n} --k {n} --n {n} --target wse2 --pes {side}x{side} --dtype fp32"
           + (f" --algo {algo}" if algo != "weight-stationary" else ""))
    return Projection(2 * n ** 3 / (c.total / spec.clock_hz) / 1e12, _cycle_parts(c), "cycles",
                      f"{side}x{side} {algo}",
                      ", ".join(f"{a} {r.total:,.0f}" for a, r in runs.items()) + " cycles"
                      + "".join(f"; {a} refused: {r}" for a, r in refused.items()) + f"; reproduce: {cmd}")


PROJECTORS: dict[str, Callable[..., Projection]] = {
    "waferllm_decode": waferllm_decode, "waferllm_prefill": waferllm_prefill, "zoo": zoo,
    "speculative": speculative, "gemv": gemv, "allreduce": allreduce, "sgemm": sgemm}


# ---- the suite ---------------------------------------------------------------------------------------------

def run_row(row: Row, assume: dict[str, float] | None = None) -> dict[str, Any]:
    """The row, its projection (or why it is not reached) and the signed error; `assume`: new values of the
    targets' unpublished or calibrated constants (bench/calibrate.py's trial values)."""
    out: dict[str, Any] = {"id": row.id, "source": dataclasses.asdict(SOURCES[row.source]) | {"key": row.source},
                           **{k: v for k, v in dataclasses.asdict(row).items() if k != "source"}}
    t0 = time.perf_counter()
    try:
        p = PROJECTORS[row.projection](**row.args, assume=assume)
    except ConfigError as e:
        return out | {"projected": None, "error": None, "not_reached": str(e),
                      "wall_s": round(time.perf_counter() - t0, 2)}
    if row.role == "bound":  # a service's figure includes more than the wafer's work: a time no shorter, a rate
        within = p.value <= row.value if row.unit == "s" else p.value >= row.value  # no higher than projected
        return out | {"projected": p.value, "error": None, "bound_ok": within, "parts": p.parts,
                      "parts_unit": p.parts_unit, "layout_chosen": p.layout, "detail": p.detail,
                      "wall_s": round(time.perf_counter() - t0, 2)}
    return out | {"projected": p.value, "error": p.value / row.value - 1, "parts": p.parts,
                  "parts_unit": p.parts_unit, "layout_chosen": p.layout, "detail": p.detail,
                  "wall_s": round(time.perf_counter() - t0, 2)}


def _stats(results: list[dict]) -> dict[str, Any]:
    signed = [r["error"] for r in results if r["error"] is not None]
    errs = [abs(e) for e in signed]
    reached = [r for r in results if r["projected"] is not None]
    return {"rows": len(results), "reached": len(errs), "not_reached": len(results) - len(reached),
            "median_abs_error": statistics.median(errs) if errs else None,
            "worst_abs_error": max(errs) if errs else None,
            "within_band": sum(e <= BAND for e in errs), "within_2x": sum(0.5 <= 1 + e <= 2 for e in signed),
            "band": BAND}


def summarize(results: list[dict]) -> dict[str, Any]:
    """Calibration residuals and validation errors apart (and over all of them), per role and source, and per
    (source, quantity): a group shares its mechanism, so its errors say which part of the model they come from.
    Bound rows are outside the statistics: how many the projection keeps."""
    groups: dict[str, list[dict]] = {}
    for r in results:
        if r["role"] != "bound":
            groups.setdefault(f"{r['source']['key']}: {r['quantity']}", []).append(r)
    by_role = {role: [r for r in results if r["role"] == role] for role in ("calibrate", "validate")}
    per_source = {f"{role} {k}": _stats([r for r in rs if r["source"]["key"] == k])
                  for role, rs in by_role.items() for k in dict.fromkeys(r["source"]["key"] for r in rs)}
    bounds = [r for r in results if r["role"] == "bound"]
    return _stats([r for r in results if r["role"] != "bound"]) | {
        "calibrate": _stats(by_role["calibrate"]), "validate": _stats(by_role["validate"]), "per_source": per_source,
        "bounds": {"rows": len(bounds), "kept": sum(bool(r.get("bound_ok")) for r in bounds)},
        "groups": {k: _stats(v) for k, v in groups.items()}}


def _stats_line(s: dict) -> str:
    if not s["reached"]:
        return f"{s['rows']} row(s), none projected"
    return (f"{s['reached']} of {s['rows']} projected; median |error| {s['median_abs_error']:.1%}, worst "
            f"{s['worst_abs_error']:.1%}; {s['within_band']} within +-{BAND:.0%}, {s['within_2x']} within 2x")


def _summary_lines(summary: dict) -> list[str]:
    b = summary["bounds"]
    return [f"calibration rows (the fit's residuals): {_stats_line(summary['calibrate'])}",
            f"validation rows (never fitted on): {_stats_line(summary['validate'])}",
            *[f"  {k}: {_stats_line(g)}" for k, g in summary["per_source"].items()],
            f"bounds (a public service's figure the projection must not exceed): {b['kept']} of {b['rows']} kept"]


def _num(x: float) -> str:
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def _parts(r: dict) -> str:
    if not r["parts"]:
        return "(the plan gives no breakdown of this time)"
    if r["parts_unit"] == "share":
        return ", ".join(f"{k} {v:.0%}" for k, v in r["parts"].items())
    return ", ".join(f"{k} {v:,.0f}" for k, v in r["parts"].items()) + " cycles"


def table(results: list[dict], summary: dict) -> str:
    lines = [f"{'id':<16} {'role':<9} {'published':>12} {'projected':>12} {'unit':<9} {'error':>8}  layout / window",
             "-" * 110]
    for r in results:
        if r["role"] == "bound" and r["projected"] is not None:
            lines.append(f"{r['id']:<16} {'bound':<9} {_num(r['value']):>12} {_num(r['projected']):>12} "
                         f"{r['unit']:<9} {'kept' if r['bound_ok'] else 'EXCEEDED':>8}  {r['layout_chosen']}")
            lines.append(f"{'':<16} {r['detail']}")
            continue
        if r["error"] is None:
            lines.append(f"{r['id']:<16} {r['role']:<9} {_num(r['value']):>12} {'-':>12} {r['unit']:<9} {'n/a':>8}  "
                         f"not reached: {r['not_reached']}")
            continue
        lines.append(f"{r['id']:<16} {r['role']:<9} {_num(r['value']):>12} {_num(r['projected']):>12} "
                     f"{r['unit']:<9} {r['error']:>+8.1%}  {r['layout_chosen']}")
        lines.append(f"{'':<16} breakdown: {_parts(r)}")
        lines.append(f"{'':<16} {r['detail']}")
    lines.append("-" * 110)
    lines += [f"  {k}: {_stats_line(g)}" for k, g in summary["groups"].items()]
    lines += _summary_lines(summary)
    return "\n".join(lines)


def markdown(results: list[dict], summary: dict) -> str:
    """docs/fidelity.md's table: every row, its source and conditions in brief, published, projected, error."""
    lines = ["| row | role | source | quantity (conditions) | published | projected | error | layout / window |",
             "|---|---|---|---|---|---|---|---|"]
    for r in results:
        cond = f"{r['model']}, {r['target']}, mesh {r['mesh']}, systems {r['systems']}"
        if r["projected"] is None:
            got = "- | - | not reached: " + r["not_reached"].replace("|", "/")
        elif r["error"] is None:
            got = f"{_num(r['projected'])} | {'kept' if r['bound_ok'] else 'exceeded'} | {r['layout_chosen']}"
        else:
            got = f"{_num(r['projected'])} | {r['error']:+.1%} | {r['layout_chosen']}"
        lines.append(f"| {r['id']} | {r['role']} | [{r['source']['key']}]({r['source']['url']}), {r['where']} | "
                     f"{r['quantity']} ({cond}) | {_num(r['value'])} {r['unit']} | {got} |")
    lines.append("")
    lines += [f"- {k}: {_stats_line(g)}" for k, g in summary["groups"].items()]
    lines += [f"- {line.strip()}" for line in _summary_lines(summary)]
    return "\n".join(lines)


ZOOM = (250.0, 6000.0)  # the right panel: the decode rates (tokens/s), crowded on the full range


def _panel(ax, got: list[dict], lo: float, hi: float, label) -> None:
    """One log-log panel over [lo, hi]: the +-25% band, the diagonal, one marker per source, labelled points."""
    xs = [lo * (hi / lo) ** (i / 100) for i in range(101)]
    ax.fill_between(xs, [x * (1 - BAND) for x in xs], [x * (1 + BAND) for x in xs], color="tab:green", alpha=0.15,
                    label=f"+-{BAND:.0%}")
    ax.plot(xs, xs, color="tab:green", lw=1)
    markers = dict(zip(SOURCES, "osD^vP*Xh"))
    colours = {"calibrate": "tab:blue", "validate": "tab:orange"}
    for key in SOURCES:
        for role, colour in colours.items():
            pts = [r for r in got if r["source"]["key"] == key and r["role"] == role]
            if pts:
                ax.scatter([r["value"] for r in pts], [r["projected"] for r in pts], marker=markers[key], s=40,
                           color=colour, label=f"{key} ({SOURCES[key].venue}): {role}")
        for r in (r for r in got if r["source"]["key"] == key):
            if label(r):
                ax.annotate(f"{r['id']} [{r['unit']}]", (r["value"], r["projected"]), fontsize=6,
                            xytext=(4, 2), textcoords="offset points")
    ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="published", ylabel="projected")
    ax.grid(True, which="both", alpha=0.2)


def figure_png(results: list[dict]) -> bytes:
    """Log-log projected vs published with the +-25% band, one marker per source, each point labelled: every
    row on the left (units per label), the decode rates enlarged on the right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    got = [r for r in results if r["error"] is not None]
    zoomed = lambda r: r["unit"] == "tokens/s" and ZOOM[0] <= r["value"] <= ZOOM[1]  # noqa: E731
    fig, (left, right) = plt.subplots(1, 2, figsize=(16, 8))
    vals = [v for r in got for v in (r["value"], r["projected"])] or [1.0]
    _panel(left, got, min(vals) / 3, max(vals) * 3, lambda r: not zoomed(r))
    left.set_title(f"Projected vs published: {len(got)} of {len(results)} rows projected")
    fig.legend(*left.get_legend_handles_labels(), fontsize=8, loc="lower center", ncol=3,
               bbox_to_anchor=(0.5, -0.08))  # below the panels: no point hidden
    _panel(right, [r for r in got if zoomed(r)], ZOOM[0], ZOOM[1], lambda r: True)
    right.set_title(f"decode tokens/s, published {ZOOM[0]:g}..{ZOOM[1]:g}")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=130, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _out_dir(path: str) -> Path:
    out = Path(path)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot create the directory ({e.strerror}); give a writable directory") \
            from None
    return out


def write_outputs(out: Path, results: list[dict], summary: dict) -> list[Path]:
    from waferscale.util.files import atomic_write_bytes

    blobs = {"fidelity.json": (json.dumps({"summary": summary, "rows": results}, indent=1, default=str) + "\n")
             .encode(), "fidelity.png": figure_png(results)}
    try:
        return [atomic_write_bytes(out / name, blob) for name, blob in blobs.items()]
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot write ({e.strerror}); give a writable directory") from None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write fidelity.json and fidelity.png into this directory")
    form = ap.add_mutually_exclusive_group()
    form.add_argument("--json", action="store_true", help="print the rows and summary as JSON instead of the table")
    form.add_argument("--markdown", action="store_true", help="print the markdown table (docs/fidelity.md) instead")
    ap.add_argument("--only", help="comma-separated row ids to run (default: all)")
    ap.add_argument("--write-waferllm-params", action="store_true",
                    help="(re)write bench/waferllm/*.yaml, the WaferLLM rows' params files, and exit")
    a = ap.parse_args(argv)
    if a.write_waferllm_params:
        from waferscale.util.files import atomic_write_bytes

        WAFERLLM_PARAMS.mkdir(exist_ok=True)
        for r in ROWS:
            if r.projection.startswith("waferllm_"):
                m, side, layers = r.args["model"], r.args["side"], r.args.get("layers")
                atomic_write_bytes(waferllm_params_path(m, side), waferllm_params_yaml(m, side, layers).encode())
        return 0
    try:
        out = _out_dir(a.out) if a.out else None  # before the rows run: a bad path fails fast
        rows = ROWS
        if a.only:
            want = a.only.split(",")
            unknown = sorted(set(want) - {r.id for r in ROWS})
            if unknown:
                raise ConfigError(f"--only: unknown row id(s) {', '.join(unknown)}; known: "
                                  f"{', '.join(r.id for r in ROWS)}")
            rows = [r for r in ROWS if r.id in want]
        results = [run_row(r) for r in rows]
        summary = summarize(results)
        if out is not None:
            write_outputs(out, results, summary)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps({"summary": summary, "rows": results}, indent=1, default=str))
    else:
        print(markdown(results, summary) if a.markdown else table(results, summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
