"""compile_model: capture -> strategy -> placement -> projection -> Plan.

This file checks the request, captures the model, builds the wafers, hands the planning to the mode's module
and assembles the `Plan`:

    inference.py         weights + KV cache on-wafer, a layer pipeline (multi-wafer when needed), replicas, users
    training.py          resident training (layer pipeline with the optimizer state in SRAM), or
    weight_streaming.py  weights streamed from MemoryX one layer at a time
    pipeline.py          placing pipeline copies on wafers, hand-offs and decode latency (shared)
    data_parallel.py     SwarmX gradient all-reduce and weak scaling over systems
    strategy.py          region sizing, placement of one copy, routing colors
    sparsity.py          weight and activation sparsity on the graph, and the speedup sweep that explains it
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from waferscale.compiler import project as pj
from waferscale.compiler import sparsity as sp
from waferscale.compiler import speculative as spec_dec
from waferscale.compiler._fabric import wafer_map
from waferscale.compiler.context import CompileContext
from waferscale.compiler.encode import plan_encode
from waferscale.compiler.layouts import plan_decoder
from waferscale.compiler.ir import Graph
from waferscale.compiler.placement import Rect, grid_boxes
from waferscale.compiler.plan import Plan, Region
from waferscale.compiler.seq2seq import plan_seq2seq
from waferscale.compiler.strategy import data_bytes_per_pe
from waferscale.compiler.training import plan_training
from waferscale.errors import ConfigError
from waferscale.fabric import assumptions as hw
from waferscale.fabric.presets import fabric_from_name

MODES = {"inference": "inference", "infer": "inference", "train": "train", "training": "train"}


def compile_model(*, model: str | None = None, graph: Graph | None = None, module=None, target: str = "wse3",
                  systems: int = 1, pes: tuple[int, int] | None = None, mode: str = "inference",
                  batch_size: int | None = None, seq_len: int | None = None, prompt_len: int | None = None,
                  context_len: int | None = None, users: int | None = None, defects: float = 0.0, seed: int = 0,
                  clock_hz: float | None = None, sparsity: float | Mapping[str, float] | None = None,
                  activation_sparsity: Any = None, assume: Mapping[str, float] | None = None,
                  layout: str = "auto", speculative: spec_dec.Speculation | None = None) -> Plan:
    """Compile a zoo model (`model`), a captured graph (`graph`: a params file's comes from
    `waferscale.zoo.wafer.params_graph`) or an nn.Module (`module`, or `(module, sample_input_shape)`) for
    `systems` x `target` wafers. Raises ConfigError on bad input or an impossible request (the message has the
    numbers).

    sparsity: the fraction of zero weights in the matrices Cerebras' default filter takes, or per matrix
    ("unit.matmul" -> fraction: `capture.section_sparsity` for a params file's section). activation_sparsity:
    the fraction of zeros entering the FFN down-projections (`sparsity.activation_sparsity` lists the forms).
    Without either the plan is the dense one, byte for byte. assume: new values of the target's unpublished
    hardware assumptions (`fabric.assumptions`, name -> value). layout: a decoder's inference layout
    (`layouts.LAYOUTS`: auto compares them; `--pes` is then the mesh a layer runs on). speculative: project
    speculative decoding (`speculative.py`; a draft model takes a band of the mesh, the target is placed on the
    rest)."""
    if sum(x is not None for x in (model, graph, module)) != 1:
        raise ConfigError("give exactly one of --model NAME, --params P.yaml (or a module)")
    mode_key = MODES.get(str(mode).lower())
    if mode_key is None:
        raise ConfigError(f"--mode must be 'inference' or 'train', got {mode!r}")
    for name, v in (("systems", systems), ("batch_size", batch_size), ("seq_len", seq_len),
                    ("prompt_len", prompt_len), ("context_len", context_len), ("users", users)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
            raise ConfigError(f"--{name} must be a positive integer, got {v!r}")
    if not isinstance(defects, (int, float)) or not 0.0 <= defects < 1.0:
        raise ConfigError(f"--defects must be a rate in [0, 1), got {defects!r}")
    spec = fabric_from_name(target, pes=tuple(pes) if pes else None, clock_hz=clock_hz)
    if assume:
        if clock_hz is not None and "clock_hz" in assume:
            raise ConfigError("the clock is given twice (--clock_hz and --assume clock_hz=...); give one")
        spec = hw.apply(spec, target, assume)

    from waferscale.compiler import capture  # the only torch import, deferred

    if model is not None:
        g = capture.capture_zoo(model)
    elif graph is not None:
        g = graph
    else:
        mod, example = module if isinstance(module, tuple) else (module, None)
        g = capture.capture_module(mod, example)

    weight = sp.weight_sparsity(g, sparsity) if sparsity is not None else {}
    act = sp.activation_sparsity(g, activation_sparsity) if activation_sparsity is not None else {}
    if (weight or act) and g.arch == "encoder_decoder":
        raise ConfigError(f"{g.name}: the sparsity projection covers single-stack models; an encoder-decoder "
                          f"compiles dense (drop --sparsity / --activation_sparsity)")
    if weight or act:
        g = sp.apply(g, weight, act)
    draft = None
    if speculative is not None:  # before the target is placed: the draft's band of rows comes off its mesh
        draft, spec, users = spec_dec.place_draft(speculative, g, spec, dict(
            target=target, pes=pes, mode=mode_key, systems=systems, users=users, prompt_len=prompt_len,
            context_len=context_len, defects=defects, clock_hz=clock_hz, assume=assume), compile_model)
        if layout == "model_parallel":
            raise ConfigError("--speculative verifies drafts as a chunk through a pipeline; use --layout pipelined")
        layout = "pipelined"
    wafers = [wafer_map(spec, defects, seed + s) for s in range(systems)]
    full = fabric_from_name(target)  # the program rectangle a model-parallel layout's windows spread over
    ctx = CompileContext(g, spec, wafers, systems, [],
                         full_spec=dataclasses.replace(spec, name=full.name, rows=full.rows, cols=full.cols)
                         if pes else None)
    usable = min(w.usable_pes for w in wafers)
    if usable < len(g.units):
        raise ConfigError(f"the {wafers[0].rows}x{wafers[0].cols} mesh has {usable} usable PEs, fewer than the "
                          f"{len(g.units)} units of {g.name} (one PE per unit at least); use a larger --pes")
    if activation_sparsity is not None and not act:
        ctx.say("activation sparsity: no exact zeros given (GELU/SwiGLU FFNs produce few), so no multiply is "
                "skipped; the projection is the dense one")
    if defects:
        m = wafers[0].mesh
        ctx.say(f"defects: rate {defects:g}, seed {seed}: wafer 0 has {m.n_dead_cores} dead cores and "
                f"{m.n_dead_links} dead links; spare rows/columns remapped by fabric.mesh, so the compiler sees a "
                f"perfect {m.logical_rows}x{m.logical_cols} logical mesh; no tile is mapped onto a dead core, "
                f"{usable:,} usable PEs per wafer (min over systems)")
    if layout != "auto" and (mode_key == "train" or g.arch != "decoder"):
        raise ConfigError(f"--layout chooses a decoder's inference layout; {g.name} [{mode_key}] has one plan: "
                          f"drop --layout")
    if mode_key == "train":
        out = plan_training(ctx, batch_size, seq_len)
    elif g.arch == "encoder":  # nothing to decode: inference is encoding whole sequences
        given = [f"--{n}" for n, v in (("prompt_len", prompt_len), ("context_len", context_len), ("users", users),
                                       ("sparsity", sparsity), ("activation_sparsity", activation_sparsity))
                 if v is not None]
        if given:
            raise ConfigError(f"{g.name} is an encoder: --mode inference projects encoding whole sequences of "
                              f"--seq_len tokens (no decode, no KV cache, no users); {', '.join(given)} "
                              f"do(es) not apply")
        out = plan_encode(ctx, seq_len)
    elif g.arch == "encoder_decoder":  # encode the input once, then decode with the cross-attention's keys kept
        out = plan_seq2seq(ctx, prompt_len, context_len, users)
    else:
        out = plan_decoder(ctx, prompt_len, context_len, users, layout, tuple(pes) if pes else None)
    regions: list[Region] = out.pop("regions")
    proj = out.pop("projection")
    if speculative is not None:
        proj["speculative"] = spec_dec.project(ctx, speculative, draft, regions, proj)
    extra = {"sparsity": sp.explain(ctx, out["reproject"], _probe(g, regions, proj, wafers[0]),
                                    "decode token" if mode_key == "inference" else "training step")} if g.sparse else {}
    if "memory" in out:  # training: the memory answer `wsc estimate` also prints (memory.training_memory)
        extra["memory"] = out.pop("memory")
    spread = out["strategy"] == "model_parallel"  # its windows lie anywhere on the full wafer (not only --pes)
    assumptions = pj.assumptions(ctx.wafer_spec if spread else spec, systems, g.dtype)
    if defects:
        assumptions["defect_detours"] = ("charged per placed region on its own routes (fabric.mesh: exact routes for "
                                         "regions up to 4,096 PEs, Manhattan + 2 hops per blocked segment above); "
                                         "placement searches shapes on the defect-free logical mesh")
    assumptions.update(program_reserve_bytes_per_pe=spec.program_reserve_bytes_per_pe,
                       data_bytes_per_pe=data_bytes_per_pe(spec), unpublished=hw.describe(spec, target),
                       **out.pop("assumptions", {}))
    return Plan(model=g.name, source=g.source, target=ctx.wafer_spec.name if spread else spec.name, systems=systems,
                mode=mode_key,
                strategy=out["strategy"], replicas=out["replicas"], wafers_per_pipeline=out["wafers_per_pipeline"],
                fits_in_sram=out["fits_in_sram"], fabric=dataclasses.asdict(ctx.wafer_spec if spread else spec),
                wafers=[{"system": i, "logical_rows": rows, "logical_cols": cols, "usable_pes": rows * cols,
                         "dead_pes": w.mesh.n_dead_cores, "defect_rate": defects, "seed": seed + i}
                        for i, w in enumerate(wafers)
                        for rows, cols in [(ctx.full_box.rows, ctx.full_box.cols) if spread else (w.rows, w.cols)]],
                workload=out["workload"], graph=g.to_dict(), regions=regions, decisions=ctx.decisions,
                projection=proj, assumptions=assumptions, bottleneck=proj["bottleneck"],
                pes_used=out.get("pes_used", sum(r.live_pes for r in regions)), extra=extra)


def _probe(g: Graph, regions: list[Region], proj: dict, wafer) -> tuple[int, int]:
    """(rows, cols) of the first sparse unit's region: its own rectangle, or a streamed layer's share of the
    wafer (its g-way copy)."""
    i = next(i for i, u in enumerate(g.units) if u.sparse)
    own = [r for r in regions if r.unit == i]
    if own:
        return own[0].rows, own[0].cols
    box = grid_boxes(Rect(0, 0, wafer.rows, wafer.cols), proj.get("layer_copies", [1] * len(g.units))[i])[0]
    return box.rows, box.cols
