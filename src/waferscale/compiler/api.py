"""Library entry points the CLI calls besides compile_model: plan_summary, plan_json, write_outputs,
estimate_memory, estimate_table."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from waferscale.compiler.ir import Graph
from waferscale.compiler.plan import Plan
from waferscale.compiler.sensitivity import summary_lines as sensitivity_lines
from waferscale.compiler.sparsity import summary_lines
from waferscale.compiler.strategy import ADAM_STATE_BYTES_PER_PARAM
from waferscale.errors import ConfigError
from waferscale.util.files import atomic_write_bytes

__all__ = ["plan_summary", "plan_json", "write_outputs", "estimate_memory", "estimate_table"]

INFERENCE_KEYS = ("decode_tokens_per_s_per_user", "aggregate_decode_tokens_per_s", "prefill_tokens_per_s",
                  "time_to_first_token_s", "decode_latency_s_per_token", "users_in_flight", "prompt_len",
                  "context_len", "aggregate_bottleneck", "kv_cache_bytes", "weight_bytes")
ENCODE_KEYS = ("encode_latency_s", "encode_sequences_per_s", "encode_tokens_per_s", "seq_len", "mfu", "weight_bytes")
TRAIN_KEYS = ("step_time_s", "tokens_per_s", "mfu", "no_stall_min_tokens_per_step", "no_stall_met",
              "weights_streamed", "tokens_per_micro_batch", "micro_batches_per_step", "scaling")


def plan_json(plan: Plan) -> dict[str, Any]:
    """The `--json` object: strategy, fits_in_sram, pes_used, bottleneck, the mode's projections, assumptions
    (and the sparsity analysis when the plan has one)."""
    p = plan.projection
    units = plan.graph["units"]
    d: dict[str, Any] = {"model": plan.model, "target": plan.target, "systems": plan.systems, "mode": plan.mode,
                         "params": sum(u["params"] for u in units),
                         "active_params": sum(u["params"] * u["experts_per_token"] // u["n_experts"]
                                              if u.get("expert_of") else u["params"] for u in units),
                         "strategy": plan.strategy, "replicas": plan.replicas,
                         "wafers_per_pipeline": plan.wafers_per_pipeline, "fits_in_sram": plan.fits_in_sram,
                         "pes_used": plan.pes_used, "pes_total": sum(w["usable_pes"] for w in plan.wafers),
                         "bottleneck": plan.bottleneck, "workload": plan.workload}
    keys = TRAIN_KEYS if plan.mode != "inference" else ENCODE_KEYS if "encode_latency_s" in p else INFERENCE_KEYS
    d.update({k: p[k] for k in keys if k in p},
             why=list(plan.decisions), assumptions=plan.assumptions, plan_version=plan.version,
             fingerprint=plan.fingerprint())
    if "memory" in plan.extra:
        d["memory"] = plan.extra["memory"]
    if "sparsity" in plan.extra:
        d["sparsity"] = plan.extra["sparsity"]
    if "sensitivity" in plan.extra:
        d["sensitivity"] = plan.extra["sensitivity"]
    if "moe" in p:
        d["moe"] = p["moe"]
    if "speculative" in p:
        d["speculative"] = p["speculative"]
    return d


def _si(x: float, unit: str) -> str:
    for f, pre in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= f:
            return f"{x / f:.3g} {pre}{unit}"
    return f"{x:.3g} {unit}"


def _t(s: float) -> str:
    if s < 1e-3:
        return f"{s * 1e6:.3g} us"
    if s < 1:
        return f"{s * 1e3:.3g} ms"
    return f"{s:.3g} s"


def _experts(graph: dict) -> bool:
    return any(u.get("expert_of") for u in graph["units"])


def _speculative_lines(p: dict) -> list[str]:
    if "speculative" not in p:
        return []
    s = p["speculative"]
    how = f"draft {s['draft_model']}" if s["draft_model"] else "ngram (prompt lookup)"
    return [f"  speculative   {s['tokens_per_s_per_user']:,.0f} tokens/s per user with {how}, K = "
            f"{s['num_speculative_tokens']}, acceptance {s['acceptance']:g}: {s['expected_tokens_per_round']:.2f} "
            f"tokens per {_t(s['round_s'])} round (x{s['speedup_vs_plain']:.2f} the plain decode on the same "
            f"placement, x{s['speedup_vs_alone']:.2f} the target alone on the whole mesh)"]


def plan_summary(plan: Plan) -> str:
    """One screen: what was placed where, the projection, the bottleneck, the assumptions, and why."""
    p, a = plan.projection, plan.assumptions
    g = plan.graph
    params = sum(u["params"] for u in g["units"])
    lines = [f"{plan.model} ({params / 1e9:.3g} B params, {g['dtype']}) on {plan.systems} x {plan.target} "
             f"[{plan.mode}]",
             f"  strategy      {plan.strategy.replace('_', ' ')}: {plan.replicas} cop{'y' if plan.replicas == 1 else 'ies'}, "
             f"{plan.wafers_per_pipeline} wafer(s) per pipeline, {len(plan.regions)} regions",
             f"  PEs used      {plan.pes_used:,} of {sum(w['usable_pes'] for w in plan.wafers):,} usable"
             f"  (fits in SRAM: {'yes' if plan.fits_in_sram else 'no, weights streamed'})"]
    if "memory" in plan.extra:
        lines.append(f"  memory        {plan.extra['memory']['why']}")
    if "encode_latency_s" in p:
        lines += [f"  encode        {p['encode_sequences_per_s']:,.0f} sequences/s = {p['encode_tokens_per_s']:,.0f} "
                  f"tokens/s ({p['seq_len']}-token sequences, MFU {p['mfu']:.1%}); latency {_t(p['encode_latency_s'])} "
                  f"per sequence",
                  f"  memory        weights {p['weight_bytes'] / 1e9:.2f} GB (an encoder has no KV cache)"]
        shares = p.get("time_shares", {})
    elif plan.mode == "inference":
        lines += [f"  decode        {p['decode_tokens_per_s_per_user']:,.0f} tokens/s per user "
                  f"({_t(p['decode_latency_s_per_token'])}/token, context {p['context_len']})",
                  *_speculative_lines(p),
                  f"  aggregate     {p['aggregate_decode_tokens_per_s']:,.0f} tokens/s with {p['users_in_flight']} users "
                  f"in flight (limit {p['pipeline_limit_tokens_per_s']:,.0f}; {p['aggregate_bottleneck']})",
                  f"  prefill       {p['prefill_tokens_per_s']:,.0f} tokens/s; time to first token "
                  f"{_t(p['time_to_first_token_s'])} for a {p['prompt_len']}-token prompt",
                  f"  memory        weights {p['weight_bytes'] / 1e9:.2f} GB, KV cache {p['kv_cache_bytes'] / 1e9:.2f} GB"
                  + (f" (fits up to {p['max_context_tokens']:,} tokens of context)" if "max_context_tokens" in p
                     else "")]
        if "window" in p:
            lines.append(f"  layout        each layer model-parallel on a {p['window']} window, layers in sequence "
                         f"(most loaded PE {p['peak_bytes_per_pe'] / 1024:.1f} KiB)")
        if "moe" in p:
            m = p["moe"]
            lines.append(f"  experts       {m['experts_per_token']} of {m['experts_per_layer']} per token in "
                         f"{m['moe_layers']} layers: {m['active_params'] / 1e9:.3g} B of {m['params'] / 1e9:.3g} B "
                         f"parameters active; routing {m['routing_bytes_per_token'] / 1e3:,.0f} kB/token, "
                         f"{m['routing_mean_hops']:.0f} hops/path; imbalance x{m['load_imbalance']:.2f} at "
                         f"{m['tokens_in_flight_per_copy']} tokens in flight")
        shares = p.get("decode_time_shares", {})
    else:
        lines += [f"  step          {_t(p['step_time_s'])}: {p['tokens_per_s']:,.0f} tokens/s, MFU {p['mfu']:.1%} "
                  f"(batch {plan.workload['batch_size']} x {plan.workload['seq_len']})",
                  f"  no-stall      T >= (b/3)F/BW{' x E/k' if _experts(g) else ''} = "
                  f"{p['no_stall_min_tokens_per_step']:,} tokens per system per "
                  f"micro-batch" + (f"; this plan: {p.get('tokens_per_micro_batch', 0):,}"
                                    f" ({'met' if p.get('no_stall_met') else 'NOT met: I/O stalls'})"
                                    if p.get("weights_streamed") else " (weights resident: not needed)")]
        if "optimizer_update" in p:
            o = p["optimizer_update"]
            lines.append(f"  optimizer     Adam in MemoryX: {_t(o['update_s'])} per step ({o['bytes_per_param']} B/param at "
                         f"{o['memoryx_bytes_per_s'] / 1e9:.0f} GB/s), {_t(o['exposed_s'])} of it not hidden")
        sc = p.get("scaling", [])
        if sc:
            lines.append(f"  scaling       weak: {sc[0]['per_system_batch']} sequences per system held fixed, global "
                         f"batch = N x {sc[0]['per_system_batch']}; lost: SwarmX time compute does not hide")
            lines.append("                " + "  ".join(
                f"{r['systems']}x: {r['tokens_per_s'] / 1e3:,.0f}k tok/s ({r['efficiency']:.2%})" for r in sc))
        shares = p.get("time_shares", {})
    lines.append(f"  bottleneck    {plan.bottleneck}  (" + ", ".join(f"{k} {v:.0%}" for k, v in shares.items()) + ")")
    lines += summary_lines(plan.extra["sparsity"]) if "sparsity" in plan.extra else []
    lines += sensitivity_lines(plan.extra["sensitivity"]) if "sensitivity" in plan.extra else []
    lines.append(f"  assumptions   clock {a['clock_hz'] / 1e9:.3g} GHz, {a['fp16_flops_per_cycle_per_pe']} fp16 "
                 f"FLOP/cycle/PE, link {a['link_bytes_per_cycle']} B/cycle, SRAM {a['sram_bytes_per_pe'] // 1024} KiB/PE "
                 f"({a['program_reserve_bytes_per_pe'] / 1024:g} KiB program reserve), I/O "
                 f"{a['io_bytes_per_s'] / 1e9:.0f} GB/s + {a['io_latency_s'] * 1e6:.0f} us/hop, "
                 f"peak {_si(a['peak_fp16_flops_per_wafer'], 'FLOP/s')} per wafer")
    lines.append("  why")
    lines += [f"    - {d}" for d in plan.decisions]
    lines.append(f"  plan v{plan.version} sha256 {plan.fingerprint()[:16]}")
    return "\n".join(lines)


def write_outputs(plan: Plan, out_dir: str | os.PathLike) -> list[Path]:
    """plan.json (versioned, fingerprinted), wafer.png, wafer.svg, trace.json — each written to a temp file
    in `out_dir` and renamed into place, so a failure leaves no half-written file."""
    from waferscale.compiler.draw import figure, trace_events

    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"--out {out}: cannot create the directory ({e.strerror})") from None
    import io

    import matplotlib.pyplot as plt

    fig = figure(plan)
    blobs = {"plan.json": (plan.to_json(indent=1) + "\n").encode()}
    for ext in ("png", "svg"):
        buf = io.BytesIO()
        fig.savefig(buf, format=ext, dpi=160)
        blobs[f"wafer.{ext}"] = buf.getvalue()
    plt.close(fig)
    blobs["trace.json"] = json.dumps(trace_events(plan)).encode()
    for name, blob in blobs.items():
        atomic_write_bytes(out / name, blob)
    return [out / name for name in blobs]


# ---- memory estimate (`wsc estimate`) ------------------------------------------------------------------------

def estimate_memory(*, model: str | None = None, graph: Graph | None = None, target: str = "wse3",
                    mixed_precision: bool = True, batch_size: int | None = None, seq_len: int | None = None,
                    systems: int = 1) -> dict[str, Any]:
    """Training and inference memory of a model against one target's SRAM (Adam optimizer): the training figures
    are `memory.training_memory`'s, the answer `compile_model(mode="train")` decides by, at the same batch,
    sequence length and systems (defaults as compile's: a params file's, else the no-stall minimum batch).

    Mixed precision: fp16/bf16 weights and gradients are what the wafer computes with; the fp32 master weights
    and the two fp32 Adam moments are optimizer state. fp32 training has no master copy. A captured `graph` (a
    params file's: `waferscale.zoo.wafer.params_graph`) brings its own precision."""
    from waferscale.compiler import capture
    from waferscale.compiler.memory import training_memory
    from waferscale.fabric.presets import fabric_from_name

    if (model is None) == (graph is None):
        raise ConfigError("give exactly one of --model NAME or --params P.yaml")
    spec = fabric_from_name(target)
    g = capture.capture_zoo(model) if model else graph
    if graph is not None:
        mixed_precision = g.dtype != "fp32"
    mem = training_memory(g, spec, spec.pes, systems, batch_size, seq_len, mixed=mixed_precision)
    w, n = mem.workload, mem.params
    per_param = ADAM_STATE_BYTES_PER_PARAM["mixed" if mixed_precision else "fp32"]
    half = "fp16/bf16" if mixed_precision else "fp32"
    items = [("weights", half, per_param[0]), ("gradients", half, per_param[1]),
             ("master weights", "fp32", per_param[2]), ("Adam 1st moment", "fp32", per_param[3]),
             ("Adam 2nd moment", "fp32", per_param[4])]
    rows = [{"item": item, "dtype": dt, "bytes_per_param": bp, "bytes": n * bp} for item, dt, bp in items if bp]
    rows.append({"item": "activations", "dtype": half, "bytes_per_param": None, "bytes": mem.activations})
    infer = g.params * (2 if mixed_precision else 4)
    return {"model": g.name, "params": g.params, "params_held": n, "target": spec.name,
            "mixed_precision": mixed_precision, "batch_size": w.batch_size, "seq_len": w.seq_len, "systems": systems,
            "batch_defaulted": w.batch_defaulted, "rows": rows, "weights_bytes": mem.weights,
            "gradients_bytes": mem.gradients, "optimizer_state_bytes": mem.optimizer_state,
            "activations_bytes": mem.activations, "training_bytes": mem.total,
            "training_bytes_per_param": mem.bytes_per_param, "inference_weight_bytes": infer,
            "sram_bytes": spec.sram_bytes, "usable_sram_bytes": mem.sram,
            "program_reserve_bytes_per_pe": spec.program_reserve_bytes_per_pe,
            "training_fits_in_sram": mem.fits, "inference_fits_in_sram": infer <= mem.sram,
            "training_verdict": mem.why(), "inference_systems_needed": max(1, -(-infer // mem.sram)),
            "active_params": g.active_params}


def estimate_table(d: dict[str, Any]) -> str:
    gbs = lambda b: f"{b / 1e9:10.2f} GB"  # noqa: E731
    batch = f"batch {d['batch_size']} x {d['seq_len']} tokens over {d['systems']} system(s)" + (
        " (no batch given: the weight-streaming no-stall minimum, as wsc compile)" if d["batch_defaulted"] else "")
    lines = [f"{d['model']}: {d['params']:,} parameters, Adam, "
             f"{'mixed precision' if d['mixed_precision'] else 'fp32'}; target {d['target']} "
             f"SRAM {d['sram_bytes'] / 1e9:.1f} GB ({d['usable_sram_bytes'] / 1e9:.1f} GB for data); {batch}"]
    if d["params_held"] != d["params"]:
        lines.append(f"  the tied embedding is held twice on the wafer (embedding and LM head): "
                     f"{d['params_held']:,} parameters held")
    lines.append(f"  {'item':<18}{'dtype':<11}{'B/param':>8}{'size':>14}")
    for r in d["rows"]:
        per = r["bytes_per_param"] if r["bytes_per_param"] is not None else "-"
        lines.append(f"  {r['item']:<18}{r['dtype']:<11}{per:>8}{gbs(r['bytes']):>14}")
    lines.append(f"  {'training total':<18}{'':<11}{'':>8}{gbs(d['training_bytes']):>14}")
    lines.append(f"  training:  {d['training_verdict']}")
    lines.append(f"  inference: {d['inference_weight_bytes'] / 1e9:.2f} GB of weights -> "
                 + ("fits in one wafer's SRAM" if d["inference_fits_in_sram"] else
                    f"needs {d['inference_systems_needed']} systems (layers split across wafers)"))
    if d["active_params"] != d["params"]:
        lines.append(f"  experts:   a token computes with {d['active_params']:,} of the {d['params']:,} parameters "
                     f"(its routed experts), but every expert's weights are held: memory counts all of them")
    return "\n".join(lines)
