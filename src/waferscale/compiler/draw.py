"""Pictures and traces of a Plan: wafer.png / wafer.svg (regions as rectangles, never per PE) and trace.json
(Chrome/Perfetto trace events of one token through the stages, or one training step)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from waferscale.compiler.plan import Plan
from waferscale.compiler.sparsity import unit_density


# labels stay readable over the dead-core markers: a light box behind the text
_LABEL_BOX = dict(boxstyle="round,pad=0.15", facecolor="white", alpha=0.75, linewidth=0)


def _short(name: str) -> str:
    if name.startswith("block"):  # block7 -> L7, block7.expert3 -> L7e3
        return "L" + name[5:].replace(".expert", "e")
    return {"embed": "emb", "head": "head"}.get(name, name[:10])


def figure(plan: Plan):
    """A matplotlib Figure: one panel per wafer, regions colored by layer, defects marked, I/O edges drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    n = plan.systems
    ncols = min(n, 4)
    nrows = math.ceil(n / ncols)
    rows, cols = plan.fabric["rows"], plan.fabric["cols"]
    aspect = rows / cols
    pw = 4.6 if ncols < 3 else 3.8
    fig, axes = plt.subplots(nrows, ncols, figsize=(max(7.5, pw * ncols + 0.8), pw * nrows * min(1.6, aspect) + 1.0),
                             squeeze=False)
    cmap = plt.get_cmap("turbo")
    n_units = max(1, len(plan.graph["units"]))
    by_sys: dict[int, list] = {}
    for r in plan.regions:
        by_sys.setdefault(r.system, []).append(r)
    dead = _dead_cores(plan)
    sparse = "sparsity" in plan.extra
    density = [unit_density(u) for u in plan.graph["units"]]
    index = {u["name"]: i for i, u in enumerate(plan.graph["units"])}
    # an expert takes its block's color, hatched: a region of its own, computing only the tokens routed to it
    hue = [index.get(u.get("expert_of"), i) for i, u in enumerate(plan.graph["units"])]
    experts = any(u.get("expert_of") for u in plan.graph["units"])
    for s in range(nrows * ncols):
        ax = axes[s // ncols][s % ncols]
        if s >= n:
            ax.axis("off")
            continue
        w = plan.wafers[s]
        ax.add_patch(Rectangle((0, 0), cols, rows, facecolor="#eeeeee", edgecolor="black", lw=1.2))
        ax.add_patch(Rectangle((0, 0), w["logical_cols"], w["logical_rows"], facecolor="white", edgecolor="none"))
        regs = by_sys.get(s, [])
        if plan.strategy == "model_parallel":
            _windows(fig, ax, regs, rows, cols)
            regs = []
        big = [r for r in regs if r.area >= 0.002 * rows * cols]
        for r in regs:
            color = "#9ecae1" if r.unit < 0 else cmap(0.08 + 0.84 * hue[r.unit] / max(1, n_units - 1))
            shade = 0.9 if r.unit < 0 or not sparse else 0.2 + 0.7 * density[r.unit]  # paler = sparser
            ax.add_patch(Rectangle((r.col, r.row), r.cols, r.rows, facecolor=color, edgecolor="black",
                                   lw=0.6 if len(regs) < 200 else 0.2, alpha=shade,
                                   hatch="////" if r.unit >= 0 and hue[r.unit] != r.unit else None))
        # label every region that has room; the rest are named by their neighbours' numbering
        for r in regs:
            fs = min(9.0, 0.9 * 72 * 4.6 * min(r.cols / cols, r.rows / rows * aspect) / max(2, len(_short(r.name))) * 1.6)
            if r.unit < 0:
                ax.text(r.col + r.cols / 2, r.row + r.rows / 2, f"{plan.model}\n{r.name}\n(whole wafer per layer)"
                        + (f"\n{_densities(density)}" if sparse else ""),
                        ha="center", va="center", fontsize=9, zorder=6, bbox=_LABEL_BOX)
            elif fs >= 3.5 or (r in big and len(regs) < 12):
                label = _short(r.name) + (f"\n{density[r.unit]:.2g}" if sparse and density[r.unit] < 1 else "")
                ax.text(r.col + r.cols / 2, r.row + r.rows / 2, label, ha="center", va="center",
                        fontsize=max(3.5, fs), color="black", zorder=6, bbox=_LABEL_BOX if len(dead) else None)
        # the pipeline path: stage centers joined in order (one hop between neighbours)
        pipe = sorted((r for r in regs if r.replica == (regs[0].replica if regs else 0) and r.unit >= 0),
                      key=lambda r: r.stage)
        if len(pipe) > 1:
            xs = [r.col + r.cols / 2 for r in pipe]
            ys = [r.row + r.rows / 2 for r in pipe]
            ax.plot(xs, ys, color="black", lw=0.7, alpha=0.55)
        if len(dead) and len(dead[s]):  # one array per wafer
            ds = dead[s]
            ax.scatter(ds[:, 1], ds[:, 0] + 0.5, s=10 if rows * cols <= 4096 else 0.6, c="red",
                       marker="x" if rows * cols <= 4096 else ".", linewidths=0.8, zorder=5,
                       label=f"dead cores ({len(ds)}): skipped, no tile, routed around")
            ax.legend(loc="lower right", fontsize=6, framealpha=0.8)
        _io_edges(ax, plan, s, regs, rows, cols)
        ax.set_xlim(-0.04 * cols, 1.04 * cols)
        ax.set_ylim(rows * 1.04, -0.04 * rows)
        ax.set_aspect("equal")
        ax.set_xticks([0, cols])
        ax.set_yticks([0, rows])
        ax.tick_params(labelsize=6)
        ax.set_title(f"system {s}: {w['logical_rows']}x{w['logical_cols']} logical PEs of {rows}x{cols} "
                     f"({w['dead_pes']} dead; grey = spares)", fontsize=7)
    p = plan.projection
    if "encode_latency_s" in p:
        line = (f"encode {p['encode_sequences_per_s']:,.0f} sequences/s of {p['seq_len']} tokens, "
                f"{_fmt_s(p['encode_latency_s'])} each; bottleneck: {plan.bottleneck}")
    elif plan.mode == "inference":
        line = (f"decode {p['decode_tokens_per_s_per_user']:,.0f} tok/s/user, {p['aggregate_decode_tokens_per_s']:,.0f} "
                f"tok/s with {p['users_in_flight']} users; bottleneck: {plan.bottleneck}")
    else:
        line = (f"step {p['step_time_s']:.3g} s, {p['tokens_per_s']:,.0f} tok/s, MFU {p['mfu']:.1%}; "
                f"bottleneck: {plan.bottleneck}")
    if sparse:
        line += "\nsparse regions: weight density under the name, paler = sparser"
    if plan.graph.get("arch") == "encoder_decoder":
        line += ("\nencN: encoder layers and decN.cross: cross-attention K/V projections (once per input); decN: "
                 "decoder layers (once per output token)")
    if experts:
        moe = p.get("moe", {})
        line += (f"\nhatched: expert regions (Liej = layer i's expert j; all resident, each token routed to "
                 f"{moe.get('experts_per_token', 'k')} of {moe.get('experts_per_layer', 'E')} per layer)")
    fig.suptitle(f"{plan.model} on {plan.systems} x {plan.target} — {plan.strategy.replace('_', ' ')}"
                 f" ({plan.replicas} cop{'y' if plan.replicas == 1 else 'ies'}, {plan.pes_used:,} PEs)\n{line}",
                 fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return fig


def _windows(fig, ax, regs: list, rows: int, cols: int) -> None:
    """A model-parallel plan's wafer: the bytes of weights each PE holds (windows overlap, so they add up), every
    window outlined and labelled with the units it holds, and the order a token visits them."""
    import numpy as np

    load = np.zeros((rows, cols))
    groups: dict = {}
    for r in regs:
        load[r.row:r.row + r.rows, r.col:r.col + r.cols] += r.bytes / r.area
        groups.setdefault((r.row, r.col, r.rows, r.cols), []).append(r)
    im = ax.imshow(load / 1024, cmap="YlOrRd", extent=(0, cols, rows, 0), interpolation="nearest", zorder=1)
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04).set_label("KiB of weights per PE", fontsize=7)
    from matplotlib.patches import Rectangle

    for (r0, c0, R, C), members in groups.items():
        ax.add_patch(Rectangle((c0, r0), C, R, facecolor="none", edgecolor="black", lw=0.8, zorder=3))
        names = [_short(m.name) for m in sorted(members, key=lambda m: m.unit)]
        label = names[0] if len(names) == 1 else f"{names[0]}..{names[-1]}\n({len(names)} units)"
        ax.text(c0 + C / 2, r0 + R / 2, f"{label}\n{R}x{C}", ha="center", va="center", fontsize=7, zorder=6,
                bbox=_LABEL_BOX)
    order = sorted(regs, key=lambda r: r.unit)
    ax.plot([r.col + r.cols / 2 for r in order], [r.row + r.rows / 2 for r in order], color="black", lw=0.7,
            alpha=0.5, zorder=4)


def _fmt_s(s: float) -> str:
    return f"{s * 1e6:.3g} us" if s < 1e-3 else f"{s * 1e3:.3g} ms"


def _densities(density: list[float]) -> str:
    """The streamed layers' weight densities in words (one region stands for all of them)."""
    sparse = [d for d in density if d < 1]
    if not sparse:
        return "dense weights"
    lo, hi = min(sparse), max(sparse)
    span = f"{lo:.2g}" if lo == hi else f"{lo:.2g}-{hi:.2g}"
    return f"weight density {span} in {len(sparse)} of {len(density)} layers"


def _io_edges(ax, plan: Plan, s: int, regs, rows: int, cols: int) -> None:
    """Arrows where data enters and leaves the wafer edge (and crosses to the next system)."""
    kw = dict(arrowprops=dict(arrowstyle="->", color="crimson", lw=1.6), fontsize=7, color="crimson")
    if plan.strategy == "weight_streaming":
        via = "\nvia SwarmX" if plan.systems > 1 else ""
        ax.annotate(f"weights in\n(MemoryX){via}", xy=(0, rows * 0.35), xytext=(-0.02 * cols, rows * 0.12),
                    ha="right", **kw)
        ax.annotate(f"gradients out\n(to MemoryX){via}", xy=(cols, rows * 0.65), xytext=(cols * 1.02, rows * 0.9),
                    ha="left", **kw)
        ax.plot([0, 0], [0, rows], color="crimson", lw=3)
        ax.plot([cols, cols], [0, rows], color="crimson", lw=3)
        return
    if not regs:
        return
    regs = [r for r in regs if r.replica == regs[0].replica]
    r = min(regs, key=lambda x: x.stage)
    src = "tokens in" if r.unit == 0 else f"from\nsystem {s - 1}"
    ax.plot([0, 0], [r.row, r.row + r.rows], color="crimson", lw=3)
    ax.annotate(src, xy=(r.col, r.row + r.rows / 2), xytext=(-0.03 * cols, r.row + r.rows / 2), ha="right", **kw)
    r = max(regs, key=lambda x: x.stage)
    dst = "tokens out" if s == plan.systems - 1 or plan.wafers_per_pipeline == 1 else f"to\nsystem {s + 1}"
    x_edge = 0 if r.col == 0 else cols
    ax.plot([x_edge, x_edge], [r.row, r.row + r.rows], color="crimson", lw=3)
    ax.annotate(dst, xy=(r.col + (0 if x_edge == 0 else r.cols), r.row + r.rows / 2),
                xytext=(x_edge + (-0.03 if x_edge == 0 else 0.03) * cols, r.row + r.rows * 0.9),
                ha="right" if x_edge == 0 else "left", **kw)


def _dead_cores(plan: Plan) -> list[np.ndarray]:
    """Dead cores per system in the picture's logical frame, regenerated from the recorded defect rate and
    seed: a dead core in a used row sits between the logical PEs it was skipped over; dead cores in rows the
    spare remap dropped are not shown (those rows are not in the logical mesh)."""
    from waferscale.compiler._fabric import wafer_map
    from waferscale.fabric.spec import FabricSpec

    if not any(w["dead_pes"] for w in plan.wafers):
        return []
    spec = FabricSpec(**plan.fabric)
    out = []
    for w in plan.wafers:
        m = wafer_map(spec, w["defect_rate"], w["seed"]).mesh
        row_of = {int(pr): i for i, pr in enumerate(np.asarray(m.phys_rows))}
        pts = [(row_of[pr], int(np.searchsorted(np.asarray(m.phys_cols[row_of[pr]]), pc)))
               for pr, pc in np.argwhere(m.dead_cores).tolist() if pr in row_of]
        out.append(np.asarray(pts, dtype=float).reshape(-1, 2))
    return out


def trace_events(plan: Plan) -> dict[str, Any]:
    """Chrome trace (Perfetto-compatible) of one decode token through every stage (inference) or one training
    micro-batch / step (training). Times in microseconds; one track per stage (pid = system)."""
    ev: list[dict[str, Any]] = []
    units = plan.graph["units"]
    p = plan.projection
    for s in range(plan.systems):
        ev.append({"name": "process_name", "ph": "M", "pid": s, "args": {"name": f"system {s} ({plan.target})"}})
    if plan.mode == "inference":  # one decoded token, or one encoded sequence
        regs = sorted((r for r in plan.regions if r.replica == 0), key=lambda r: r.stage)
        times = p["stage_times_s"] or p.get("unit_times_s", [])  # model-parallel: the units one after another
        expert = [bool(units[r.unit].get("expert_of")) for r in regs]
        # an MoE layer's experts run side by side (one track each, all from the same start): the token's path
        # takes the longest of them
        seq_times = [dt for dt, e in zip(times, expert) if not e]
        groups: dict[int, float] = {}
        for i, (dt, e) in enumerate(zip(times, expert)):
            if e:
                start = next(j for j in range(i, -1, -1) if not expert[j])
                groups[start] = max(groups.get(start, 0.0), dt)
        t = 0.0
        hop = (p.get("decode_latency_s_per_token", p.get("encode_latency_s", 0)) - sum(seq_times)
               - sum(groups.values())) / max(1, len(seq_times))
        group_start = 0.0
        for i, (r, dt) in enumerate(zip(regs, times)):
            ev.append({"name": "thread_name", "ph": "M", "pid": r.system, "tid": r.stage,
                       "args": {"name": f"stage {r.stage}: {r.name}"}})
            ts = group_start if expert[i] else t
            ev.append({"name": r.name, "cat": "decode", "ph": "X", "ts": ts * 1e6, "dur": dt * 1e6, "pid": r.system,
                       "tid": r.stage, "args": {"region": f"{r.rows}x{r.cols} at ({r.row},{r.col})",
                                                "pes": r.live_pes, "bytes": r.bytes}})
            if expert[i]:
                continue
            t += dt
            ev.append({"name": "hand-off", "cat": "fabric", "ph": "X", "ts": t * 1e6, "dur": hop * 1e6,
                       "pid": r.system, "tid": r.stage, "args": {}})
            t += hop
            group_start = t
            t += groups.get(i, 0.0)
    else:
        streamed = plan.strategy == "weight_streaming"
        per = p["step_time_s"] / max(1, p.get("micro_batches_per_step", 1))
        layers = [u for u in units if u["params"]] or units
        fb = [(u, "fwd", 1.0) for u in layers] + [(u, "bwd", 2.0) for u in reversed(layers)]
        tot_w = sum(w for _, _, w in fb) * max(1, sum(u["params"] for u in layers))
        t = 0.0
        ev.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "wafer compute"}})
        ev.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "args": {"name": "weights in / grads out"}})
        for u, kind, wgt in fb:
            dt = per * wgt * max(1, u["params"]) / tot_w
            ev.append({"name": f"{u['name']} {kind}", "cat": kind, "ph": "X", "ts": t * 1e6, "dur": dt * 1e6,
                       "pid": 0, "tid": 0, "args": {"params": u["params"]}})
            if streamed:
                io = u["params"] * p["streamed_bytes_per_weight"] / p["io_bytes_per_s"]
                ev.append({"name": f"{u['name']} {'weights' if kind == 'fwd' else 'weights+grads'}", "cat": "io",
                           "ph": "X", "ts": t * 1e6, "dur": min(io, dt) * 1e6, "pid": 0, "tid": 1, "args": {}})
            t += dt
    return {"traceEvents": ev, "displayTimeUnit": "ns",
            "otherData": {"model": plan.model, "target": plan.target, "strategy": plan.strategy,
                          "fingerprint": plan.fingerprint()}}
