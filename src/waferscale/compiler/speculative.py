"""Speculative decoding in the projection (`wsc compile --speculative draft|ngram`).

A round drafts K tokens, then the target verifies them in one pass over K + 1 tokens (the last verified token
and the K drafts): each draft is accepted with probability a, independently, until the first rejection, and
the pass yields one more token of its own, so a round gives (1 - a^(K+1)) / (1 - a) tokens on average.

- draft: a smaller model of the same vocabulary drafts on the same wafer: it gets a band of rows of its own,
  sized by its bytes (weights + the users' KV caches + activations) and placed as any model is
  (`compile_model` on that band); the target is placed on the rest of the mesh. Its per-token decode latency
  is the draft's cost; its K ids cross to the target's embedding region and the verified ids come back.
- ngram (prompt lookup): the drafts are copied from earlier text by the host, so they cost nothing on the
  wafer; the K ids enter and the verified ids leave through the system I/O.

The verification pass takes K + 1 tokens through the target's pipeline with every query attending over the
whole context, so the target takes the pipelined layout: streamed (the tokens back to back through the stages,
one decode's latency plus K intervals of the slowest stage) or as one chunk through each stage as a prefill
chunk goes (`pipeline.chain`), whichever is faster (`_verify`). The plan compares the rate with the target
decoding plainly on the same placement, and alone on the whole mesh in its best layout (what speculation has to
beat). Times in seconds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from waferscale.compiler import moe
from waferscale.compiler import project as pj
from waferscale.compiler.context import CompileContext
from waferscale.compiler.inference import context_and_prompt, Footprint
from waferscale.compiler.ir import Graph
from waferscale.compiler.pipeline import chain, handoff
from waferscale.compiler.plan import Plan, Region
from waferscale.compiler.strategy import data_bytes_per_pe, gb
from waferscale.errors import ConfigError
from waferscale.fabric.presets import preset_key
from waferscale.fabric.spec import FabricSpec

METHODS = ("draft", "ngram")
ID_BYTES = 4  # a token id


@dataclass(frozen=True)
class Speculation:
    method: str  # "draft" | "ngram"
    k: int  # tokens drafted per round
    acceptance: float  # probability that a draft token is accepted, i.i.d.
    draft_model: str | None = None  # a zoo name (method "draft")

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"--speculative must be one of {', '.join(METHODS)}, got {self.method!r}")
        if isinstance(self.k, bool) or not isinstance(self.k, int) or self.k < 1:
            raise ConfigError(f"--num_speculative_tokens must be an integer >= 1, got {self.k!r}")
        if isinstance(self.acceptance, bool) or not isinstance(self.acceptance, (int, float)) \
                or not 0 <= self.acceptance < 1:
            raise ConfigError(f"--acceptance is the probability a draft token is accepted, in [0, 1), got "
                              f"{self.acceptance!r}")
        if self.method == "draft" and not self.draft_model:
            raise ConfigError("--speculative draft needs --draft_model NAME (a smaller model of the same vocabulary)")
        if self.method == "ngram" and self.draft_model:
            raise ConfigError("--speculative ngram drafts by prompt lookup, with no draft model; drop --draft_model")

    @property
    def tokens_per_round(self) -> float:
        """Expected tokens a round yields: accepted drafts until the first rejection, + the target's own."""
        a = self.acceptance
        return (1 - a ** (self.k + 1)) / (1 - a)


def speculation(method: str | None, draft_model: str | None, k: int | None, acceptance: float | None) \
        -> Speculation | None:
    """The CLI's flags as a Speculation (None without --speculative); ConfigError on a flag without it or a
    missing one."""
    if method is None:
        given = [f for f, v in (("--draft_model", draft_model), ("--num_speculative_tokens", k),
                                ("--acceptance", acceptance)) if v is not None]
        if given:
            raise ConfigError(f"{', '.join(given)} need(s) --speculative draft|ngram")
        return None
    missing = [f for f, v in (("--num_speculative_tokens K", k), ("--acceptance A", acceptance)) if v is None]
    if missing:
        raise ConfigError(f"--speculative needs {' and '.join(missing)}")
    return Speculation(method, k, acceptance, draft_model)


@dataclass(frozen=True)
class Draft:
    """The draft model's own plan on a band of `rows` rows below the target's mesh (system 0; None and 0 rows
    for ngram), and the target's plain decode rate alone on the whole mesh in its best layout (what speculation
    has to beat)."""

    plan: Plan | None
    rows: int
    row0: int  # its first row on the wafer
    alone_tokens_per_s: float


def place_draft(sp: Speculation, g: Graph, spec: FabricSpec, request: dict,
                compile_model: Callable[..., Any]) -> tuple[Draft, FabricSpec, int]:
    """Before the target is placed: the draft's band of rows (the fewest, from its bytes up, on which it
    compiles) and the target's spec on the rows left. Returns (the draft, the target's spec, the users both
    serve: --users or 1). `request`: compile_model's target, pes, mode, systems, users,
    prompt_len, context_len, defects, clock_hz and assume; `compile_model`: compiler/compile.py's, which calls
    this (the target alone and the draft in its band are compiled as any model is). ConfigError when the draft
    does not suit the target or the two do not fit together."""
    from waferscale.compiler.capture import capture_zoo

    if request["mode"] != "inference" or g.arch != "decoder":
        raise ConfigError(f"--speculative projects a decoder's inference ({g.name}, --mode {request['mode']}); drop it")
    if request["defects"]:
        raise ConfigError("--speculative places the draft and the target on a defect-free wafer; drop --defects")
    users = request["users"] or 1
    C, P = context_and_prompt(g, request["prompt_len"], request["context_len"])
    hw = dict(target=request["target"], users=users, context_len=C, prompt_len=P, clock_hz=request["clock_hz"],
              assume=request["assume"])
    alone = compile_model(graph=g, pes=request["pes"], systems=request["systems"], **hw)
    alone_tps = alone.projection["decode_tokens_per_s_per_user"]
    if sp.method == "ngram":
        return Draft(None, 0, spec.rows, alone_tps), spec, users
    d = capture_zoo(sp.draft_model)
    if d.arch != "decoder" or d.units[-1].d_out != g.units[-1].d_out:
        raise ConfigError(f"--draft_model {d.name} must be a decoder with {g.name}'s vocabulary "
                          f"({g.units[-1].d_out:,} tokens; it has {d.units[-1].d_out:,})")
    if d.params >= g.params:
        raise ConfigError(f"--draft_model {d.name} ({d.params / 1e9:.3g} B parameters) is not smaller than "
                          f"{g.name} ({g.params / 1e9:.3g} B): it would draft slower than the target decodes")
    if C > d.max_seq_len:
        raise ConfigError(f"--draft_model {d.name} reads at most {d.max_seq_len} tokens, less than the context {C}; "
                          f"lower --context_len")
    need = sum(Footprint.of(d.units, d.dtype_bytes, C).mem(users))
    per_row = spec.cols * data_bytes_per_pe(spec)
    rows = max(1, math.ceil(need / per_row))
    target_need = sum(Footprint.of(g.units, g.dtype_bytes, C).mem(users))
    if target_need > request["systems"] * (spec.rows - rows) * per_row:
        raise ConfigError(f"{g.name} ({gb(target_need)}) and the draft {d.name} ({gb(need)}), each with {users} "
                          f"user(s) at context {C}, do not fit together: the draft takes {rows} of the {spec.rows} "
                          f"rows ({spec.cols} PEs x {data_bytes_per_pe(spec):,} B each), and the target is placed on "
                          f"the rows left of each of the {request['systems']} system(s): "
                          f"{gb(request['systems'] * (spec.rows - rows) * per_row)}; use more --systems, a smaller "
                          f"draft, or fewer --users / a shorter --context_len")
    last = None
    while rows < spec.rows:  # placement needs some slack beyond the bytes: grow the band until it places
        try:
            plan = compile_model(graph=d, pes=(rows, spec.cols), layout="pipelined", **hw)  # within its band
        except ConfigError as e:
            last = e
            rows = max(rows + 1, math.ceil(rows * 1.05))
            continue
        left = spec.rows - rows
        name = f"{preset_key(request['target'])}[{left}x{spec.cols}]"
        return Draft(plan, rows, left, alone_tps), dataclasses.replace(spec, name=name, rows=left), users
    raise ConfigError(f"the draft {d.name} needs {gb(need)} ({users} user(s) at context {C}) and does not place on "
                      f"fewer than the mesh's {spec.rows} rows ({last}); the target would have no room")


def _verify(ctx: CompileContext, regs: list[Region], n: int, context: int) -> pj.Time:
    """One pass of n tokens of one user through the target's pipeline, every query attending over `context`
    keys: the faster of two schedules. Streamed: the tokens go through the stages back to back, each stage
    decoding one token after another while the next stage takes the previous one, so the pass costs one token's
    latency through every stage and hand-off plus n - 1 intervals of the slowest stage (with its hand-off).
    Chunked: the n tokens go through each stage together, as a prefill chunk goes (an MoE expert gets the
    expected most loaded expert's share; with experts the pass is chunked)."""
    g, units = ctx.g, ctx.g.units
    b = g.dtype_bytes

    def times_for(n_tok: int) -> tuple[list[pj.Time], int]:
        routed, times = 1, []
        for r in regs:
            u = units[r.unit]
            tokens = n_tok
            if u.expert_of:
                tokens = routed = math.ceil(moe.expected_max_load(n_tok, u.n_experts, u.experts_per_token))
            times.append(pj.unit_time(ctx.spec, u, r.rows, r.cols, n_tokens=tokens, attn_ctx=context, dtype=g.dtype,
                                      mesh=ctx.region_mesh(r.system, r.row, r.col, r.rows, r.cols)))
        return times, routed

    times, routed = times_for(n)
    chunked = chain(ctx, units, regs, times, b, tokens=n, routed=routed)
    if n == 1 or any(units[r.unit].expert_of for r in regs):
        return chunked
    one, _ = times_for(1)
    streamed = chain(ctx, units, regs, one, b)
    stage = []  # each stage's interval: its time and its hand-off to the next
    for i, (r, t) in enumerate(zip(regs, one)):
        st = pj.Time()
        st += t
        if i + 1 < len(regs):
            st += handoff(ctx, r, regs[i + 1], units[r.unit].d_out, b)
        stage.append(st)
    slowest = max(stage, key=lambda t: t.s)
    streamed += slowest.scaled(n - 1)
    return streamed if streamed.s < chunked.s else chunked


def _ids(ctx: CompileContext, a: tuple[int, int, int], z: tuple[int, int, int], n: int) -> pj.Time:
    """n token ids from (system, row, col) a to z: hops on one wafer, the system I/O between wafers."""
    if a[0] != z[0]:
        return pj.io_time(ctx.spec, ID_BYTES * n)
    return pj.handoff_time(ctx.spec, n, ID_BYTES, 1, abs(a[1] - z[1]) + abs(a[2] - z[2]))


def project(ctx: CompileContext, sp: Speculation, draft: Draft, regions: list[Region], proj: dict) -> dict:
    """The speculative figures of the placed target (`regions`, its plain projection `proj`), and a decision."""
    regs = [r for r in regions if r.replica == 0]
    C, K = proj["context_len"], sp.k
    verify = _verify(ctx, regs, K + 1, C)
    first, last = regs[0], regs[-1]
    head = (last.system, last.row, last.col)
    if draft.plan is None:  # the host looks the drafts up: ids in, verified ids out, through the system I/O
        draft_s = 0.0
        hand = pj.io_time(ctx.spec, ID_BYTES * K).s + pj.io_time(ctx.spec, ID_BYTES * (K + 1)).s
    else:
        dr = draft.plan.regions
        d_in, d_out = dr[0], [r for r in dr if r.replica == 0][-1]
        draft_s = draft.plan.projection["decode_latency_s_per_token"]
        hand = _ids(ctx, (0, draft.row0 + d_out.row, d_out.col), (first.system, first.row, first.col), K).s + \
            _ids(ctx, head, (0, draft.row0 + d_in.row, d_in.col), K + 1).s
    round_s = K * draft_s + verify.s + hand
    tps = sp.tokens_per_round / round_s
    plain = proj["decode_tokens_per_s_per_user"]
    out = {"method": sp.method, "draft_model": sp.draft_model, "num_speculative_tokens": K,
           "acceptance": sp.acceptance, "expected_tokens_per_round": sp.tokens_per_round, "round_s": round_s,
           "draft_s_per_token": draft_s, "verify_s": verify.s, "verify_time_shares": verify.shares(),
           "ids_handoff_s": hand, "tokens_per_s_per_user": tps, "plain_decode_tokens_per_s_per_user": plain,
           "speedup_vs_plain": tps / plain, "users": proj["users_in_flight"],
           "plain_decode_alone_tokens_per_s_per_user": draft.alone_tokens_per_s}
    out["speedup_vs_alone"] = tps / out["plain_decode_alone_tokens_per_s_per_user"]
    if draft.plan is not None:
        out.update(draft_rows=draft.rows, draft_pes=draft.rows * ctx.spec.cols,
                   draft_decode_tokens_per_s=draft.plan.projection["decode_tokens_per_s_per_user"],
                   draft_weight_bytes=draft.plan.projection["weight_bytes"])
    _explain(ctx, sp, draft, out)
    return out


def _explain(ctx: CompileContext, sp: Speculation, draft: Draft, s: dict) -> None:
    spec, K = ctx.spec, sp.k
    where = "drafts by prompt lookup on the host (nothing on the wafer; ids through the system I/O)" \
        if draft.plan is None else \
        (f"draft {sp.draft_model} on rows {draft.row0}-{draft.row0 + draft.rows - 1} of system 0 "
         f"({draft.rows} x {spec.cols} PEs, sized by its {gb(s['draft_weight_bytes'])} of weights and the users' KV "
         f"caches; {s['draft_s_per_token'] * 1e6:.1f} us per draft token), the target on the {spec.rows} x "
         f"{spec.cols} rows left of every system")
    ctx.say(f"speculative decoding: {where}; a round drafts K = {K} tokens and verifies them in one pass of "
            f"{K + 1} tokens through the target's pipelined layout over the context ({s['verify_s'] * 1e6:.1f} us, "
            f"as a prefill chunk), "
            f"{s['round_s'] * 1e6:.1f} us in all; at acceptance {sp.acceptance:g} a round yields "
            f"(1 - a^(K+1)) / (1 - a) = {s['expected_tokens_per_round']:.2f} tokens: "
            f"{s['tokens_per_s_per_user']:,.0f} tokens/s per user against "
            f"{s['plain_decode_tokens_per_s_per_user']:,.0f} decoding plainly on the same placement "
            f"(x{s['speedup_vs_plain']:.2f})"
            + f" and {s['plain_decode_alone_tokens_per_s_per_user']:,.0f} with the whole mesh, no draft and "
              f"its best layout (x{s['speedup_vs_alone']:.2f})"
            + f"; {s['users']} user(s) (--users; 1 when not given"
            + (": the draft holds each user's KV cache too)" if draft.plan else ")"))
