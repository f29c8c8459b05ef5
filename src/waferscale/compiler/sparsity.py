"""Sparsity as a pass over the compiler's graph, and what it buys on the wafer.

Weight sparsity sets a `density` on the sparse matrices (`ir.MatMul`): `--sparsity S` takes Cerebras' default
filter (every matrix of the blocks; not the embedding, the norms or the LM head), a params file's `sparsity:`
section its own filters (resolved by `capture.section_sparsity`). Activation sparsity sets an `act_density` on
the matrices that read an FFN activation: the fraction of exact zeros entering each block's down-projection,
given or measured by `wsc sparsity-report`. The cores skip exact zeros only.

`fabric.cost_matmul.sparse_gemm_cycles` charges one multiply-add per non-zero weight (and per non-zero input when
zeros are filtered) plus what does not shrink: fills and hops, one task per arriving wavelet, the dense partial
sums and their reduction, the dense units (attention, norms, embedding, head), the I/O, and the busiest PE of a
random pattern. `explain` sweeps the density on the chosen placement: with F the time left at vanishing
density, T(d) ~ F + d (T(1) - F), so the speedup is near-linear while d (T(1) - F) >> F and stops being so
around d* = F / (T(1) - F), where it is half the ideal 1/d.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from waferscale.compiler import project as pj
from waferscale.compiler.context import CompileContext
from waferscale.compiler.ir import FFN_DOWN, Graph, MatMul, Unit
from waferscale.errors import ConfigError
from waferscale.fabric import cost_matmul

DENSITY_GRID = (1.0, 0.5, 0.25, 0.1, 0.05, 0.02, 0.01)
FLOOR_DENSITY = 1e-4  # "vanishing density": the fixed costs F


def _fraction(v: Any, what: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0.0 <= v < 1.0:
        raise ConfigError(f"{what} must be a fraction of zeros in [0, 1), got {v!r}")
    return float(v)


def _keys(g: Graph) -> list[str]:
    return [f"{u.name}.{m.name}" for u in g.units for m in u.matmuls]


def weight_sparsity(g: Graph, sparsity: float | Mapping[str, float]) -> dict[str, float]:
    """Fraction of zero weights per sparse matrix, keyed "unit.matmul". A float: every matrix the default
    filter takes (the blocks' and a captured module's, not the embedding or the LM head). A mapping: those
    keys (what `capture.section_sparsity` returns for a params file)."""
    if isinstance(sparsity, Mapping):
        bad = sorted(set(sparsity) - set(_keys(g)))
        if bad:
            raise ConfigError(f"sparsity: {', '.join(bad[:3])} is not a matrix of {g.name}; "
                              f"the matrices are named like {', '.join(_keys(g)[:4])}")
        out = {k: _fraction(v, f"sparsity of {k}") for k, v in sparsity.items()}
    else:
        s = _fraction(sparsity, "--sparsity")
        out = {f"{u.name}.{m.name}": s for u in g.units if u.kind in ("block", "module") for m in u.matmuls
               if not any(w in m.name.lower() for w in ("lm_head", "embed"))}
    return {k: v for k, v in out.items() if v > 0}


def _ffn_inputs(g: Graph) -> dict[str, list[str]]:
    """Per unit, the matrices reading an FFN activation: a block's down-projection; for a captured module
    (units are its top-level layers) every matrix of the units after the first."""
    blocks = {u.name: [m.name for m in u.matmuls if m.name in FFN_DOWN] for u in g.units if u.kind == "block"}
    if blocks:
        return {k: v for k, v in blocks.items() if v}
    return {u.name: [m.name for m in u.matmuls] for u in g.units[1:] if u.kind == "module" and u.matmuls}


def activation_sparsity(g: Graph, spec: Any) -> dict[str, float]:
    """Fraction of zero inputs per matrix, keyed "unit.matmul", for the matrices reading an FFN activation.
    `spec`: a float (every layer); a list (one per layer, in order); a mapping of unit name -> fraction; the
    JSON of `wsc sparsity-report` (its exact-zero fractions: what the cores can skip); a path to a JSON file
    holding any of these; or the command line's text for one of them ("0.6", "0.5,0.7,...", a path)."""
    if isinstance(spec, str):  # "0.6" or "0.5,0.6,..." (one per layer), else a path
        try:
            values = [float(v) for v in spec.split(",")]
            spec = values[0] if len(values) == 1 else values
        except ValueError:
            pass
    if isinstance(spec, (str, os.PathLike)):
        try:
            spec = json.loads(Path(spec).read_text())
        except OSError as e:
            raise ConfigError(f"--activation_sparsity {spec}: cannot read it ({e.strerror})") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"--activation_sparsity {spec}: not valid JSON ({e})") from None
    if isinstance(spec, Mapping) and "layers" in spec:  # the report's JSON
        spec = {r["layer"]: r["activation_exact_zero"] for r in spec["layers"]
                if r.get("activation_exact_zero") is not None}
    targets = _ffn_inputs(g)
    if not targets:
        raise ConfigError(f"{g.name} has no matrix reading an FFN activation; activation sparsity does not apply")
    if isinstance(spec, Mapping):
        bad = sorted(set(spec) - set(targets))
        if bad:
            raise ConfigError(f"activation sparsity: {', '.join(map(str, bad[:3]))} is not a layer of {g.name} with "
                              f"an FFN; its layers are {', '.join(list(targets)[:4])}, ...")
        per_unit = dict(spec)
    elif isinstance(spec, Sequence) and not isinstance(spec, (str, bytes)):
        if len(spec) != len(targets):
            raise ConfigError(f"activation sparsity: {len(spec)} values for the {len(targets)} layers of {g.name}")
        per_unit = dict(zip(targets, spec))
    else:
        per_unit = dict.fromkeys(targets, spec)
    out = {f"{u}.{m}": _fraction(v, f"activation sparsity of {u}") for u, v in per_unit.items() for m in targets[u]}
    return {k: v for k, v in out.items() if v > 0}


def apply(g: Graph, weight: Mapping[str, float], act: Mapping[str, float]) -> Graph:
    """The graph with weight densities 1 - weight[key] and input densities 1 - act[key] set on its matrices."""
    return dataclasses.replace(g, units=tuple(_with(g.units, lambda k, m: 1.0 - weight.get(k, 0.0),
                                                    lambda k, m: 1.0 - act.get(k, 0.0))))


def _with(units: Sequence[Unit], density: Callable[[str, MatMul], float],
          act: Callable[[str, MatMul], float]) -> list[Unit]:
    """`units` with each matrix's (key "unit.matmul", matrix) weight and input densities set."""
    return [dataclasses.replace(u, matmuls=tuple(
        dataclasses.replace(m, density=density(f"{u.name}.{m.name}", m), act_density=act(f"{u.name}.{m.name}", m))
        for m in u.matmuls)) if u.matmuls else u for u in units]


# ---- what it buys: the sweep on the chosen placement ------------------------------------------------------

def _at(units: Sequence[Unit], keys: set[str], d: float | None, act: bool) -> list[Unit]:
    """`units` with density d on the matrices in `keys` (None: as they are) and 1 elsewhere, inputs as given
    (act) or dense."""
    return _with(units, lambda k, m: (m.density if d is None else d) if k in keys else 1.0,
                 lambda k, m: m.act_density if act else 1.0)


def _without(units: Sequence[Unit], keys: set[str]) -> list[Unit]:
    """`units` without the matrices in `keys` (nor their parameters)."""
    out = []
    for u in units:
        gone = [m for m in u.matmuls if f"{u.name}.{m.name}" in keys]
        out.append(dataclasses.replace(u, matmuls=tuple(m for m in u.matmuls if m not in gone),
                                       params=max(0, u.params - sum(m.m * m.k for m in gone))) if gone else u)
    return out


def _floor_parts(units: Sequence[Unit], total: float, per: list[float], rest: list[float],
                 wkeys: set[str]) -> dict[str, float]:
    """What remains at vanishing density (`total` s), by where it is spent: `per` (seconds per unit at that
    density) and `rest` (per unit without the sparse matrices) split each sparse layer into its matrices'
    fixed costs and everything else it does; the remainder is hand-offs and I/O between layers."""
    fixed, other = "sparse matrices' fixed costs", "attention, norms and other work of the sparse layers"
    out = dict.fromkeys((fixed, other, "embedding", "head", "dense layers"), 0.0)
    for u, t, r in zip(units, per, rest):
        if any(f"{u.name}.{m.name}" in wkeys for m in u.matmuls):
            out[fixed] += max(0.0, t - r)
            out[other] += min(t, r)
        else:
            out[{"embed": "embedding", "head": "head"}.get(u.kind, "dense layers")] += t
    out["hand-offs and I/O"] = max(0.0, total - sum(per))
    return out


def explain(ctx: CompileContext, reproject: Callable[[list[Unit]], tuple[pj.Time, list[float]]],
            region: tuple[int, int], what: str) -> dict[str, Any]:
    """Sweep weight density on the placed plan (`reproject(units)` -> the time of `what`, a decode token or a
    training step, and seconds per unit), find where the speedup stops being near-linear and say why; the
    same for the activation sparsity. Returns the plan's `extra["sparsity"]`. `region`: (rows, cols) of a
    sparse unit's region, where the load imbalance of random patterns is measured."""
    g, spec = ctx.g, ctx.spec
    units = list(g.units)
    b = g.dtype_bytes
    wkeys = {f"{u.name}.{m.name}" for u in units for m in u.matmuls if m.density < 1.0}
    akeys = {f"{u.name}.{m.name}" for u in units for m in u.matmuls if m.act_density < 1.0}
    dense = reproject(_at(units, set(), None, act=False))[0]
    out: dict[str, Any] = {"measure": what, "dense_s": dense.s}
    if wkeys:
        mats = [m for u in units for m in u.matmuls if f"{u.name}.{m.name}" in wkeys]
        n_sparse = sum(m.m * m.k for m in mats)
        mean_d = sum(m.m * m.k * m.density for m in mats) / n_sparse
        biggest = max(mats, key=lambda m: m.m * m.k)
        sweep = []
        for d in DENSITY_GRID:
            t = reproject(_at(units, wkeys, d, act=False))[0].s
            sweep.append({"density": d, "time_s": t, "speedup": dense.s / t, "ideal": 1 / d})
        floor, per = reproject(_at(units, wkeys, FLOOR_DENSITY, act=False))
        parts = _floor_parts(units, floor.s, per, reproject(_without(units, wkeys))[1], wkeys)
        work = dense.s - floor.s
        knee = floor.s / work if work > 0 else math.inf
        at = knee if knee < 0.5 else 0.1
        imb = cost_matmul.sparse_imbalance(spec, biggest.m, biggest.k, *region, max(at, 0.01), g.dtype)
        this = reproject(_at(units, wkeys, None, act=False))[0].s
        out["weight"] = {"matrices": len(mats), "sparse_params": n_sparse, "params": g.params,
                         "mean_density": mean_d, "time_s": this, "speedup": dense.s / this, "sweep": sweep,
                         "floor_s": floor.s, "floor_parts_s": parts, "max_speedup": dense.s / floor.s,
                         "knee_density": knee if knee < 0.5 else None,
                         "imbalance": {"density": max(at, 0.01), "busiest_over_mean": imb, "region": list(region),
                                       "matrix": [biggest.m, biggest.k]},
                         "streamed_bytes": sum(u.streamed_weight_bytes(b) for u in units),
                         "dense_bytes": sum(u.params * b for u in units),
                         "stored_bytes": sum(u.stored_weight_bytes(b) for u in units)}
        ctx.say(f"weight sparsity: {len(mats)} matrices ({n_sparse / g.params:.0%} of the parameters) at mean "
                f"density {mean_d:.3g}, one multiply-add per non-zero weight: {what} {dense.s * 1e3:.4g} -> "
                f"{this * 1e3:.4g} ms ({dense.s / this:.2f}x). On this placement, speedup vs density: "
                + ", ".join(f"{r['density']:g}: {r['speedup']:.2f}x" for r in sweep[1:]))
        where = (f"near-linear down to density ~{knee:.2g} and not below it" if knee < 0.5 else
                 f"not near-linear at any density here (already {sweep[1]['speedup']:.2f}x at 0.5, not 2x)")
        spent = ", ".join(f"{k} {v / dense.s:.0%}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])
                          if v >= 0.005 * dense.s)
        ctx.say(f"speedup {where}: what does not shrink with the non-zeros is F = {floor.s / dense.s:.0%} of the "
                f"dense time (so at most {dense.s / floor.s:.2f}x): {spent}. The matrices' fixed costs are the "
                f"fills and hops, one task of >= 1 cycle per arriving wavelet, and the dense partial sums and their "
                f"reduction along the rows. T(d) ~ F + d (T(1) - F) flattens at d* = F / (T(1) - F), where the "
                f"speedup is half the ideal 1/d; and a random pattern's busiest PE, which sets the pace, does "
                f"{imb:.2f}x the mean work at density {max(at, 0.01):g} ({biggest.m}x{biggest.k} on a "
                f"{region[0]}x{region[1]} region)")
    if akeys:
        this = reproject(_at(units, akeys | wkeys, None, act=True))[0].s
        only = reproject(_at(units, set(), None, act=True))[0].s
        mats = [(u, m) for u in units for m in u.matmuls if f"{u.name}.{m.name}" in akeys]
        skipped = sum(m.m * m.k * m.density * (1 - m.act_density) for _, m in mats)
        total = sum(mm.m * mm.k * mm.density for u in units for mm in u.matmuls)
        mean_a = sum(1 - m.act_density for _, m in mats) / len(mats)
        out["activation"] = {"matrices": len(mats), "mean_sparsity": mean_a,
                             "per_matrix": {f"{u.name}.{m.name}": 1 - m.act_density for u, m in mats},
                             "skipped_multiply_adds": skipped / total, "time_s_activations_only": only,
                             "speedup_activations_only": dense.s / only, "time_s": this,
                             "speedup": dense.s / this}
        ctx.say(f"activation sparsity: {mean_a:.0%} zeros (mean) entering {len(mats)} FFN down-projections; the "
                f"cores skip the multiply of an exact zero ({skipped / total:.0%} of the matrix multiply-adds); "
                f"not skipped: the x values still travel (a filtered stream sends each non-zero with its index, "
                f"so filtering is used only where it is faster), every arriving value still fires a task (>= 1 "
                f"cycle), the partial sums stay dense, and the backward's input gradient W^T dy is dense; "
                f"{what} {dense.s * 1e3:.4g} -> {only * 1e3:.4g} ms from activations alone "
                f"({dense.s / only:.2f}x). ReLU FFNs produce exact zeros; GELU/SwiGLU produce few (measure them "
                f"with `wsc sparsity-report`), so for those such a value holds only if small activations are "
                f"thresholded to zero")
    return out


def summary_lines(sp: dict[str, Any]) -> list[str]:
    """Lines for `plan_summary`."""
    lines = []
    w, a = sp.get("weight"), sp.get("activation")
    if w:
        lines.append(f"  sparsity      weights: mean density {w['mean_density']:.3g} in {w['matrices']} matrices "
                     f"({w['sparse_params'] / w['params']:.0%} of params): {w['speedup']:.2f}x the dense "
                     f"{sp['measure']}; " + (f"near-linear down to d~{w['knee_density']:.2g}" if w["knee_density"]
                                             else f"never near-linear (at most {w['max_speedup']:.2f}x)"))
        lines.append("                speedup vs density: " + ", ".join(f"{r['density']:g} {r['speedup']:.2f}x"
                                                                      for r in w["sweep"][1:]))
        lines.append(f"                weights {w['stored_bytes'] / 1e9:.2f} GB on-wafer / streamed "
                     f"{w['streamed_bytes'] / 1e9:.2f} GB per pass (dense {w['dense_bytes'] / 1e9:.2f} GB)")
    if a:
        lines.append(f"  activations   {a['mean_sparsity']:.0%} zeros into {a['matrices']} FFN down-projections: "
                     f"{a['skipped_multiply_adds']:.0%} of multiply-adds skipped, "
                     f"{a['speedup_activations_only']:.2f}x alone" + (f", {a['speedup']:.2f}x with the weights"
                                                                        if w else ""))
    return lines


def unit_density(u: dict[str, Any]) -> float:
    """Weight density of a serialized unit's matrices (1 without any), weighted by their sizes."""
    mms = u.get("matmuls", [])
    n = sum(m["m"] * m["k"] for m in mms)
    return sum(m["m"] * m["k"] * m.get("density", 1.0) for m in mms) / n if n else 1.0



# ---- `wsc sparsity-report` ---------------------------------------------------------------------------------

def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.1%}"


def report_table(rep: dict[str, Any]) -> str:
    """The report as a table: per layer, weight sparsity (exact zeros, masks) and the activation entering the
    FFN down-projection (exact zeros, |a| < threshold)."""
    s = rep["sample"]
    lines = [f"{rep['model']} ({rep['activation']} FFN): sparsity per layer; activations measured on "
             f"{s['batch']} x {s['seq_len']} tokens ({s['source']})",
             f"  {'layer':<10}{'matrix params':>14}{'weights = 0':>13}{'mask off':>10}{'acts = 0':>11}"
             f"{'|a| < ' + format(rep['threshold'], 'g'):>13}"]
    for r in rep["layers"]:
        lines.append(f"  {r['layer']:<10}{r['matrix_params']:>14,}{_pct(r['weight_sparsity']):>13}"
                     f"{_pct(r['mask_sparsity']):>10}{_pct(r['activation_exact_zero']):>11}"
                     f"{_pct(r['activation_near_zero']):>13}")
    lines.append(f"  acts = 0: exact zeros entering each FFN down-projection (what the wafer's cores skip); "
                 f"|a| < {rep['threshold']:g}: near zero (skippable only if thresholded, which changes the numerics)")
    return "\n".join(lines)


def report_figure(rep: dict[str, Any]):
    """Two panels per layer: weight sparsity (bars), activation sparsity (exact and near zero)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = rep["layers"]
    x = list(range(len(rows)))
    fig, (top, bot) = plt.subplots(2, 1, figsize=(max(6.0, 0.3 * len(rows) + 2), 5.5), sharex=True)
    top.bar(x, [r["weight_sparsity"] or 0 for r in rows], color="#3182bd", label="weights = 0")
    if any(r["mask_sparsity"] is not None for r in rows):
        top.plot(x, [r["mask_sparsity"] or 0 for r in rows], "k_", markersize=12, label="masked off")
    top.set_ylabel("weight sparsity")
    top.set_ylim(0, 1)
    top.legend(fontsize=7, loc="upper right")
    acts = [i for i, r in enumerate(rows) if r["activation_exact_zero"] is not None]
    bot.bar([i - 0.2 for i in acts], [rows[i]["activation_exact_zero"] for i in acts], width=0.4, color="#e6550d",
            label="exact zeros (skipped by the cores)")
    bot.bar([i + 0.2 for i in acts], [rows[i]["activation_near_zero"] for i in acts], width=0.4, color="#fdae6b",
            label=f"|a| < {rep['threshold']:g}")
    bot.set_ylabel("FFN activation sparsity")
    bot.set_ylim(0, 1)
    bot.legend(fontsize=7, loc="upper right")
    bot.set_xticks(x)
    bot.set_xticklabels([r["layer"].replace("block", "L") for r in rows], rotation=90, fontsize=7)
    fig.suptitle(f"{rep['model']} ({rep['activation']}): sparsity per layer", fontsize=9)
    fig.tight_layout()
    return fig
