"""Benchmark: training tokens/s of each model family, ours (resident and weight streaming) against a plain
`transformers` training loop of the same model.

    ours resident    the step `wsc run` compiles for the CPU backend (zoo.lm.compile_lm_step -> ResidentExecutor)
    ours streaming   the same for the CSX backend: MemoryX holds the weights and AdamW state, units stream through
                     the StreamingExecutor (as `wsc run --execution streaming`)
    transformers     the family's transformers class (XForCausalLM, BertForMaskedLM, T5ForConditionalGeneration)
                     from our model exported as a Hugging Face directory (save_hf_dir, from_pretrained), its
                     default attention; forward -> cross-entropy -> backward -> clip -> torch AdamW (fused, as
                     transformers' Trainer picks on this torch) -> zero_grad

All three start from the same weights (the parameter counts are printed and must agree) and read the same
batches: next-token targets for decoders, dynamically masked inputs and labels for the encoders
(data.masking.Masker), span corruption for T5 (data.span_corruption, packed as our units run it; transformers
gets the encoder's and the decoder's ids apart), plus the router's load-balancing loss for Mixtral. tokens/s
count every input token (T5: the encoder's and the decoder's). AdamW hyper-parameters, decay / no-decay groups,
gradient clipping, fp32 and the thread count are the same. The first step's losses must agree (a warning is
printed otherwise: the comparison would not be like for like).

Timing: every system does `--warmup` untimed steps, then `--rounds` rounds in which each system in turn (order
rotated per round) runs `--steps` steps; a round's time for streaming includes waiting for MemoryX's pending
updates. tokens/s are medians over rounds; a ratio is the median over rounds of ours / transformers within the
round, so load that varies between rounds on a shared machine cancels out. Targets: >= 1.0 resident, >= 0.9
streaming. On a machine busy with other work, elapsed time measures the neighbours too: `--clock cpu --threads 1`
times this process's own CPU time instead (which gives streaming no credit for overlapping its optimizer).

    python bench/train_families.py [--families gptj,mixtral,t5,...] [--layers 4] [--hidden 256] [--heads 4]
                                   [--vocab 512] [--seq_len 128] [--batch_size 8] [--steps 3] [--rounds 5]
                                   [--warmup 2] [--threads 2] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))  # bench this checkout, wherever the editable install points (as pytest's pythonpath)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from waferscale.models import ModelConfig, build, hf  # noqa: E402
from waferscale.models.registry import config_from_name  # noqa: E402

LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 1e-4, (0.9, 0.95), 1e-8, 0.1, 1.0


# ---- the families: a tiny preset of each, grown to the benchmark's shape, its own knobs kept -------------------

def _quarter_rotary(a: argparse.Namespace) -> dict[str, Any]:  # GPT-J and Pythia rotate a quarter of each head
    return {"rotary_dim": a.hidden // a.heads // 4}


def _ffn(a: argparse.Namespace, mult: float) -> dict[str, Any]:
    return {"d_ff": int(mult * a.hidden)}


FAMILIES: dict[str, tuple[str, Callable[[argparse.Namespace], dict[str, Any]]]] = {
    "gptj": ("gptj-tiny", _quarter_rotary),
    "gpt_neox": ("gpt-neox-tiny", lambda a: {**_quarter_rotary(a), **_ffn(a, 4)}),
    "falcon": ("falcon-tiny", lambda a: {**_ffn(a, 4), "n_kv_head": 1, "block": "parallel_shared_norm"}),  # 7B's
    "mpt": ("mpt-tiny", lambda a: _ffn(a, 4)),
    "mistral": ("mistral-tiny", lambda a: {**_ffn(a, 8 / 3), "sliding_window": a.seq_len // 2}),
    "mixtral": ("mixtral-tiny", lambda a: {**_ffn(a, 2), "n_experts": 8, "experts_per_token": 2}),
    "bert": ("bert-tiny", lambda a: {}),
    "roberta": ("roberta-tiny", lambda a: {}),
    "t5": ("flan-t5-tiny", lambda a: {**_ffn(a, 2), "d_kv": a.hidden // a.heads}),  # v1.1 / FLAN: gated GELU
}


def family_config(family: str, a: argparse.Namespace) -> ModelConfig:
    preset, extra = FAMILIES[family]
    base = config_from_name(preset)
    kv = {"n_kv_head": a.heads // (base.n_head // base.kv_heads)} if base.n_kv_head else {}
    return config_from_name(preset, **{"vocab_size": a.vocab, "n_layer": a.layers, "d_model": a.hidden,
                                       "n_head": a.heads, "max_seq_len": a.seq_len, "dropout": 0.0, **kv, **extra(a)})


# ---- the batches --------------------------------------------------------------------------------------------

SENTINELS = 100  # T5's <extra_id_N>, counting down from the top of the vocabulary


def batches(cfg: ModelConfig, a: argparse.Namespace, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """n (inputs, targets) pairs of int64 (B, ...): next tokens for a decoder, masked-LM labels for an encoder,
    span corruption packed as the units run it for T5 (seq_len encoder tokens, then the decoder's)."""
    from waferscale.data import Masker
    from waferscale.data.span_corruption import SpanCorruptor

    g = torch.Generator().manual_seed(a.seed)
    if cfg.family == "t5":
        corruptor = SpanCorruptor(tuple(range(cfg.vocab_size - 1, cfg.vocab_size - 1 - SENTINELS, -1)), 1,
                                  cfg.pad_token_id, cfg.max_seq_len, seed=a.seed)
        tokens = torch.randint(2, cfg.vocab_size - SENTINELS, (n, a.batch_size, corruptor.tokens_length), generator=g)
        return [corruptor.corrupt(t, k) for k, t in enumerate(tokens)]
    tokens = torch.randint(0, cfg.vocab_size - 1, (n, a.batch_size, a.seq_len + 1), generator=g)
    if not cfg.is_encoder:
        return [(t[:, :-1].contiguous(), t[:, 1:].contiguous()) for t in tokens]
    masker = Masker(mask_id=cfg.vocab_size - 1, vocab_size=cfg.vocab_size, seed=a.seed)
    return [masker.mask(t[:, :-1].contiguous(), k) for k, t in enumerate(tokens)]


# ---- the three systems: each a step(x, y) -> loss and a sync() that ends a timed round ---------------------------

@dataclass
class System:
    name: str
    step: Callable[[torch.Tensor, torch.Tensor], float]
    sync: Callable[[], None]
    params: int
    note: str = ""
    close: Callable[[], None] = lambda: None


def optimizer_params():
    from waferscale.params import OptimizerParams

    return OptimizerParams(optimizer_type="AdamW", learning_rate=LR, betas=BETAS, eps=EPS,
                           weight_decay=WEIGHT_DECAY, max_gradient_norm=CLIP)


def ours(cfg: ModelConfig, init: dict[str, torch.Tensor], kind: str, work: Path) -> System:
    """The training step `wsc run` builds: compile_lm_step on the CPU backend (resident) or CSX (streaming)."""
    import waferscale.pytorch as cstorch
    from waferscale.zoo.lm import compile_lm_step

    model = build(cfg, device="cpu")
    model.load_state_dict(init)
    backend = cstorch.backend("CSX" if kind == "streaming" else "CPU", artifact_dir=work / kind, device="cpu")
    model, ex = compile_lm_step(model, cfg, backend, optimizer_params())
    params = sum(lay.numel for lay in ex.mx.layouts) if kind == "streaming" else model.num_params()
    sync = ex.mx.synchronize if kind == "streaming" else (lambda: None)
    return System(f"ours {kind}", lambda x, y: ex.train_step(x, y, LR).loss, sync, params, close=ex.close)


def transformers_loop(cfg: ModelConfig, init: dict[str, torch.Tensor], work: Path) -> System:
    """A plain transformers training loop of the same architecture and weights (ours exported as a Hugging Face
    directory, loaded with from_pretrained, which reads each release's weight names)."""
    import transformers

    from waferscale.runtime.optim import param_groups

    src = build(cfg, device="cpu")
    src.load_state_dict(init)
    where = work / f"hf-{cfg.name}"
    hf.save_hf_dir(src, where)
    conf = transformers.AutoConfig.from_pretrained(where)
    model = getattr(transformers, conf.architectures[0]).from_pretrained(where, dtype=torch.float32)
    model.train()
    opt = torch.optim.AdamW(param_groups(model.named_parameters(), WEIGHT_DECAY), lr=LR, betas=BETAS, eps=EPS,
                            fused=True)
    params = list(model.parameters())
    moe, L = cfg.n_experts > 0, cfg.max_seq_len

    def step(x: torch.Tensor, y: torch.Tensor) -> float:
        if cfg.family == "t5":  # the packed row: the encoder's input ids, then the decoder's
            out = model(input_ids=x[:, :L], decoder_input_ids=x[:, L:])
            y = y[:, L:]
        else:
            out = model(input_ids=x, output_router_logits=True) if moe else model(input_ids=x)
        logits = out.logits
        loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), ignore_index=-100)
        if moe:
            loss = loss + conf.router_aux_loss_coef * out.aux_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    n = sum(p.numel() for p in params)  # parameters() lists a tied weight once
    return System("transformers", step, lambda: None, n,
                  note=f"{type(model).__name__}, attention {model.config._attn_implementation}")


# ---- one family: set up, warm up, alternate rounds --------------------------------------------------------

@dataclass
class Result:
    family: str
    params: dict[str, int]
    tok_s: dict[str, float]
    ratio: dict[str, float]  # ours kind -> median over rounds of ours / transformers
    first_loss: dict[str, float]
    note: str


def bench_family(family: str, a: argparse.Namespace, work: Path) -> Result:
    cfg = family_config(family, a)
    torch.manual_seed(a.seed)
    init = build(cfg, device="cpu").state_dict()
    systems = [ours(cfg, init, "resident", work), ours(cfg, init, "streaming", work),
               transformers_loop(cfg, init, work)]
    data = batches(cfg, a, a.warmup + a.rounds * a.steps)
    clock = time.process_time if a.clock == "cpu" else time.perf_counter
    tokens = data[0][0].numel()  # per step: T5's counts the encoder's and the decoder's
    first: dict[str, float] = {}
    for s in systems:
        for k in range(a.warmup):
            loss = s.step(*data[k])
            first.setdefault(s.name, loss)
        s.sync()
    times: dict[str, list[float]] = {s.name: [] for s in systems}
    for r in range(a.rounds):
        batch = data[a.warmup + r * a.steps: a.warmup + (r + 1) * a.steps]
        for s in systems[r % 3:] + systems[:r % 3]:
            t0 = clock()
            for x, y in batch:
                s.step(x, y)
            s.sync()
            times[s.name].append(clock() - t0)
    for s in systems:
        s.close()
    peer = times["transformers"]
    return Result(family, {s.name: s.params for s in systems},
                  {n: statistics.median(a.steps * tokens / t for t in ts) for n, ts in times.items()},
                  {n: statistics.median(p / t for p, t in zip(peer, times[n])) for n in times if n != "transformers"},
                  first, systems[-1].note)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(FAMILIES), help=f"comma-separated, from {', '.join(FAMILIES)}")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--seq_len", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per system per round")
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (medians over them)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per system first")
    ap.add_argument("--threads", type=int, default=2, help="torch threads, the same for every system")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="wall: elapsed time; cpu: this process's CPU time over all its threads (on a machine shared "
                         "with other work, where elapsed time also measures the neighbours; counts the work of "
                         "every thread, so streaming's overlap of the optimizer with compute does not show)")
    a = ap.parse_args()
    families = [f.strip() for f in a.families.split(",") if f.strip()]
    bad = [f for f in families if f not in FAMILIES]
    if bad or not families:
        ap.error(f"--families: unknown {', '.join(bad) or repr(a.families)}; choose from {', '.join(FAMILIES)}")
    if min(a.steps, a.rounds, a.warmup) < 1:
        ap.error("--steps, --rounds and --warmup must be at least 1")
    if a.hidden % a.heads or (a.hidden // a.heads) % 8:
        ap.error("--hidden must be a multiple of --heads with a head dimension divisible by 8 (quarter rotary)")
    torch.set_num_threads(a.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()

    print(f"{a.layers} layers x {a.hidden} ({a.heads} heads), vocab {a.vocab}, batch {a.batch_size}x{a.seq_len}, "
          f"fp32, AdamW lr {LR:g} wd {WEIGHT_DECAY:g} clip {CLIP:g}; {a.warmup} warm-up steps, then {a.rounds} rounds "
          f"of {a.steps} steps per system; {torch.get_num_threads()} threads, {a.clock} clock; "
          f"torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    results = []
    with tempfile.TemporaryDirectory(prefix="wsc-train-families-") as d:
        for family in families:
            t0 = time.perf_counter()
            res = bench_family(family, a, Path(d))
            results.append(res)
            print(f"  {family}: {time.perf_counter() - t0:.0f} s; {res.note}; parameters "
                  + ", ".join(f"{n} {v:,}" for n, v in res.params.items()) + "; first-step losses "
                  + ", ".join(f"{n} {v:.5f}" for n, v in res.first_loss.items()), flush=True)
            if len(set(res.params.values())) > 1:
                print(f"  !!! {family}: parameter counts differ: {res.params}")
            if max(res.first_loss.values()) - min(res.first_loss.values()) > 1e-3:
                print(f"  !!! {family}: first-step losses differ by more than 1e-3: not like for like")
    print()
    print(f"{'family':<10}{'params':>9}{'ours resident':>15}{'ours streaming':>16}{'transformers':>14}"
          f"{'resident/tf':>13}{'streaming/tf':>14}")
    print(f"{'':<10}{'':>9}{'tok/s':>15}{'tok/s':>16}{'tok/s':>14}{'(>= 1.0)':>13}{'(>= 0.9)':>14}")
    for r in results:
        miss = lambda v, target: "" if v >= target else " *"  # noqa: E731
        res, st = r.ratio["ours resident"], r.ratio["ours streaming"]
        print(f"{r.family:<10}{r.params['transformers'] / 1e6:>8.2f}M{r.tok_s['ours resident']:>15,.0f}"
              f"{r.tok_s['ours streaming']:>16,.0f}{r.tok_s['transformers']:>14,.0f}"
              f"{res:>11.2f}{miss(res, 1.0):<2}{st:>12.2f}{miss(st, 0.9):<2}")
    print("(* below the target; ratios are medians over rounds of each round's ours / transformers)")


if __name__ == "__main__":
    main()
