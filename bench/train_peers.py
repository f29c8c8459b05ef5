"""Benchmark: weight-streaming training against DeepSpeed ZeRO-3 and FSDP2, both with CPU offload, on the CPU.

    ours       MemoryX (fp32 masters + AdamW state in host RAM, optimizer on its own lane) feeding the
               StreamingExecutor, one unit (embedding, each block, head) at a time
    deepspeed  DeepSpeed ZeRO stage 3, offload_param and offload_optimizer to the CPU (DeepSpeedCPUAdam), fp32,
               DS_ACCELERATOR=cpu, world size 1
    fsdp2      torch FSDP2: fully_shard on every block and on the root, CPUOffloadPolicy, torch AdamW
               (fused where torch allows it, else foreach), world size 1

The peers train the project's own CausalLM (same module code, same initial weights from one state_dict, same
random token batches, same AdamW hyper-parameters and decay / no-decay groups), so only the execution system
differs; first-step losses must agree to ~1e-3 and a warning is printed if not. Every system runs in its own
subprocess (gloo on 127.0.0.1 and a free port for the peers; CUDA hidden; the same torch / OpenMP thread count),
the runs alternate over `--repeats`, and the median step time over all timed steps (after warm-up) is reported.
A step is forward + backward + optimizer update, timed from the end of one step to the end of the next (the last
one includes waiting for MemoryX's pending updates). A peer that cannot run is reported with its exception.
On a busy machine OpenMP's spin-waiting skews the figures (`--omp_wait_policy passive` evens it out); quote
figures from a quiet one. `--systems ...,resident` adds plain torch without offload as a reference row.

    python bench/train_peers.py [--layers 6] [--hidden 384] [--seq_len 128] [--batch_size 8] [--steps 10]
                                [--warmup 3] [--repeats 3] [--threads 2] [--systems ours,deepspeed,fsdp2]

Needs `pip install deepspeed` for the DeepSpeed peer (its CPUAdam is JIT-built with ninja + g++ on first use).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

SRC = Path(__file__).resolve().parents[1] / "src"
sys.path.insert(0, str(SRC))  # bench this checkout, wherever the editable install points (as pytest's pythonpath)

SYSTEMS = ("ours", "deepspeed", "fsdp2")  # the default set; "resident" is an optional reference
LABELS = {"ours": "ours (MemoryX + weight streaming)", "deepspeed": "DeepSpeed ZeRO-3 + CPU offload",
          "fsdp2": "FSDP2 + CPUOffloadPolicy", "resident": "resident (plain torch, no offload)"}


# ---- shared set-up: the model, its initial weights, the batches (written once, read by every worker) ------

def model_overrides(a: argparse.Namespace) -> dict[str, Any]:
    return {"vocab_size": a.vocab, "max_seq_len": a.seq_len, "d_model": a.hidden, "n_layer": a.layers,
            "n_head": a.heads, "dropout": 0.0}


def build_model(a: argparse.Namespace):  # -> CausalLM on the CPU, fp32
    from waferscale.models import from_name

    return from_name(a.model, device="cpu", **model_overrides(a))


def optimizer_params(a: argparse.Namespace):
    from waferscale.params import OptimizerParams

    return OptimizerParams(optimizer_type="AdamW", learning_rate=a.lr, betas=(0.9, 0.95), eps=1e-8,
                           weight_decay=a.weight_decay, max_gradient_norm=a.max_gradient_norm)


def write_inputs(a: argparse.Namespace, work: Path) -> int:
    """Initial weights and (warmup + steps) batches of random token ids; returns the parameter count."""
    import torch

    torch.manual_seed(a.seed)
    model = build_model(a)
    torch.save(model.state_dict(), work / "init.pt")
    g = torch.Generator().manual_seed(a.seed + 1)
    tokens = torch.randint(0, a.vocab, (a.warmup + a.steps, a.batch_size, a.seq_len + 1), generator=g)
    torch.save(tokens, work / "batches.pt")  # (steps, B, T + 1): x = [..., :-1], y = [..., 1:]
    return model.num_params()


# ---- each system, a `step(x, y) -> loss` built inside its own worker process ---------------------------------

# step(x, y) -> loss; finish() after the last step (waits for asynchronous work); info for the table; close()
Setup = tuple[Callable[[Any, Any], float], Callable[[], None], dict[str, Any], Callable[[], None]]


def setup_ours(a: argparse.Namespace, work: Path) -> Setup:
    import torch

    from waferscale.runtime.memoryx import MemoryX
    from waferscale.runtime.streaming import StreamingExecutor, build_skeleton

    model = build_model(a)
    model.load_state_dict(torch.load(work / "init.pt"))
    opt = optimizer_params(a)
    mx = MemoryX(model, opt, max_gradient_norm=opt.max_gradient_norm)  # copies the weights in
    cfg = model.config
    del model
    recompute = {"auto": "auto", "always": True, "never": False}[a.recompute]
    ex = StreamingExecutor(build_skeleton(cfg), mx, device=torch.device("cpu"), recompute=recompute)

    stats: list[dict[str, Any]] = []
    info = {"optimizer": f"MemoryX per-unit {type(mx.optimizers[0]).__name__} "
                         f"({'fused' if mx.optimizers[0].defaults.get('fused') else 'foreach'}), "
                         f"update policy {mx.policy}"}

    def step(x, y) -> float:
        r = ex.train_step(x, y, a.lr)
        stats.append(r.stats or {})
        return r.loss

    def finish() -> None:
        mx.synchronize()  # updates still pending at the end of the last step belong to that step
        timed = stats[a.warmup:]
        med = {k: statistics.median(float(s.get(k) or 0.0) for s in timed)
               for k in ("wait_weights_s", "compute_s", "grad_writeback_s", "optimizer_s")}
        info["breakdown"] = (f"per step (median): wait for weights {med['wait_weights_s'] * 1e3:.0f} ms, compute "
                             f"{med['compute_s'] * 1e3:.0f} ms, gradient write-back {med['grad_writeback_s'] * 1e3:.0f}"
                             f" ms, optimizer {med['optimizer_s'] * 1e3:.0f} ms (on the MemoryX lane, overlapping), "
                             f"recompute {bool(ex.engine and ex.engine.recompute)}")

    return step, finish, info, ex.close


def setup_deepspeed(a: argparse.Namespace, work: Path) -> Setup:
    import deepspeed
    import torch

    from waferscale.models import lm_loss
    from waferscale.runtime.optim import param_groups

    deepspeed.init_distributed()  # the accelerator's backend: gloo on the CPU (ccl if oneCCL is installed)
    model = build_model(a)
    model.load_state_dict(torch.load(work / "init.pt"))
    config = {
        "train_micro_batch_size_per_gpu": a.batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": a.max_gradient_norm or 0.0,
        "optimizer": {"type": "AdamW", "params": {"lr": a.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": a.weight_decay}},
        "zero_optimization": {"stage": 3,
                              "offload_param": {"device": "cpu", "pin_memory": False},
                              "offload_optimizer": {"device": "cpu", "pin_memory": False}},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    groups = param_groups(model.named_parameters(), a.weight_decay)  # same decay / no-decay split as ours
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)

    def step(x, y) -> float:
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        return loss.item()

    from deepspeed.accelerator import get_accelerator

    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    info = {"optimizer": f"{type(engine.optimizer).__name__} -> {type(inner).__name__}",
            "backend": f"deepspeed {deepspeed.__version__}, accelerator {get_accelerator().device_name()}, "
                       f"comm {get_accelerator().communication_backend_name()}"}
    return step, lambda: None, info, lambda: None


def setup_fsdp2(a: argparse.Namespace, work: Path) -> Setup:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    from waferscale.models import lm_loss
    from waferscale.runtime.optim import param_groups

    dist.init_process_group("gloo", rank=0, world_size=1)
    model = build_model(a)
    model.load_state_dict(torch.load(work / "init.pt"))
    mesh = init_device_mesh("cpu", (1,))
    policy = CPUOffloadPolicy(pin_memory=False)  # pinned host memory needs an accelerator
    for block in model.blocks:
        fully_shard(block, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)  # root: embedding, tied head, final norm
    kind = "fused"
    try:
        opt = torch.optim.AdamW(param_groups(model.named_parameters(), a.weight_decay), lr=a.lr, betas=(0.9, 0.95),
                                eps=1e-8, fused=True)
    except (RuntimeError, TypeError) as e:  # no fused kernel for these (DTensor) parameters
        kind = f"foreach (fused refused: {str(e).splitlines()[0]})"
        opt = torch.optim.AdamW(param_groups(model.named_parameters(), a.weight_decay), lr=a.lr, betas=(0.9, 0.95),
                                eps=1e-8, foreach=True)
    params = list(model.parameters())

    def step(x, y) -> float:
        loss = lm_loss(model(x), y)
        loss.backward()
        if a.max_gradient_norm:
            torch.nn.utils.clip_grad_norm_(params, a.max_gradient_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    info = {"optimizer": f"torch AdamW {kind}", "backend": f"torch {torch.__version__}, gloo"}
    return step, lambda: None, info, lambda: None


def setup_resident(a: argparse.Namespace, work: Path) -> Setup:
    """A reference, not a peer: the whole model and torch's AdamW in one process, no offload (`--systems`)."""
    import torch

    from waferscale.runtime.executor import ResidentExecutor
    from waferscale.runtime.optim import build_optimizer

    model = build_model(a)
    model.load_state_dict(torch.load(work / "init.pt"))
    opt = build_optimizer(model.parameters(), optimizer_params(a))
    ex = ResidentExecutor(model, opt, device=torch.device("cpu"), max_gradient_norm=a.max_gradient_norm)

    def step(x, y) -> float:
        return ex.train_step(x, y, a.lr).loss

    info = {"optimizer": f"torch AdamW {'fused' if opt.defaults.get('fused') else 'foreach'}"}
    return step, lambda: None, info, ex.close


SETUP = {"ours": setup_ours, "deepspeed": setup_deepspeed, "fsdp2": setup_fsdp2, "resident": setup_resident}


def worker(a: argparse.Namespace) -> None:
    """Runs in a subprocess: set up one system, time its steps, write result-*.json (or the exception)."""
    work = Path(a.workdir)
    out = work / f"result-{a.worker}-{a.run_index}.json"
    res: dict[str, Any] = {"system": a.worker}
    close: Callable[[], None] = lambda: None  # noqa: E731
    try:
        import torch

        torch.set_num_threads(a.threads)
        t0 = time.perf_counter()
        step, finish, info, close = SETUP[a.worker](a, work)
        res["setup_s"] = time.perf_counter() - t0
        tokens = torch.load(work / "batches.pt")
        losses, ends = [], []
        start = time.perf_counter()
        for k in range(a.warmup + a.steps):
            x, y = tokens[k, :, :-1].contiguous(), tokens[k, :, 1:].contiguous()
            losses.append(float(step(x, y)))
            if k == a.warmup + a.steps - 1:
                finish()
            ends.append(time.perf_counter())
        times = [e - s for s, e in zip([start, *ends[:-1]], ends)]
        res.update(info)
        res.update(losses=losses, step_s=times[a.warmup:], warmup_s=times[:a.warmup],
                   threads=torch.get_num_threads())
    except Exception as e:  # reported as the peer's one-line reason; the traceback goes to the worker log
        traceback.print_exc()
        msg = str(e).strip().splitlines()
        res["error"] = f"{type(e).__name__}: {msg[0] if msg else ''}".strip()
        if isinstance(e, ModuleNotFoundError) and e.name == "deepspeed":
            res["error"] += " (pip install deepspeed)"
    res["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    from waferscale.util.files import atomic_write_json

    atomic_write_json(out, res)
    sys.stdout.flush()
    if a.worker in ("ours", "resident"):
        close()
    else:  # skip the process-group teardown (its hangs are no part of the measurement)
        os._exit(0)


# ---- the parent: launch the workers, alternate, summarize -------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_exception_line(log: str) -> str:
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^[\w.]+(Error|Exception|Interrupt)\b.*", ln):
            return ln
    return lines[-1] if lines else "(no output)"


def launch(a: argparse.Namespace, system: str, work: Path, run_index: int) -> dict[str, Any]:
    path = os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env = dict(os.environ, PYTHONPATH=path,
               OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads), CUDA_VISIBLE_DEVICES="",
               DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
               LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_SIZE="1", PYTHONWARNINGS="ignore")
    if a.omp_wait_policy:
        env["OMP_WAIT_POLICY"] = a.omp_wait_policy.upper()
    argv = [sys.executable, str(Path(__file__).resolve()), "--worker", system, "--workdir", str(work),
            "--run_index", str(run_index)] + [f"--{k}={v}" for k, v in shared_args(a).items()]
    log_path = work / f"log-{system}-{run_index}.txt"
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        p = subprocess.Popen(argv, env=env, stdout=None if a.verbose else log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        try:
            rc = p.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # the worker and anything it started (ninja, compilers)
            p.wait()
            rc = None
    wall = time.perf_counter() - t0
    out = work / f"result-{system}-{run_index}.json"
    if out.exists():
        res = json.loads(out.read_text())
    else:
        text = log_path.read_text(errors="replace")
        why = (f"timed out after {a.timeout:.0f} s (--timeout)" if rc is None else
               f"worker exited with code {rc}: {last_exception_line(text)}")
        res = {"system": system, "error": why}
    res["wall_s"] = wall
    return res


def shared_args(a: argparse.Namespace) -> dict[str, Any]:
    keys = ("model", "layers", "hidden", "heads", "vocab", "seq_len", "batch_size", "steps", "warmup", "threads",
            "lr", "weight_decay", "seed", "recompute")
    d = {k: getattr(a, k) for k in keys}
    if a.max_gradient_norm:
        d["max_gradient_norm"] = a.max_gradient_norm
    return d


def summarize(a: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> None:
    tokens = a.batch_size * a.seq_len
    med: dict[str, float] = {}
    ref_losses = next((r["losses"] for r in runs.get("ours", []) if "losses" in r), None)
    print()
    print(f"{'system':<36}{'median step s':>14}{'tokens/s':>10}{'first loss':>12}{'last loss':>11}"
          f"{'max|dloss|':>11}{'peak RSS MiB':>13}")
    for system in runs:
        ok = [r for r in runs[system] if "error" not in r]
        if not ok:
            print(f"{LABELS[system]:<36}  could not run: {runs[system][-1]['error']}")
            continue
        times = [t for r in ok for t in r["step_s"]]
        m = med[system] = statistics.median(times)
        losses = ok[0]["losses"]
        diff = ("" if system == "ours" or not ref_losses else  # the loss curve against ours, step by step
                f"{max(abs(u - v) for u, v in zip(losses, ref_losses)):.2e}")
        rss = max(r["peak_rss_bytes"] for r in ok) / 2**20
        print(f"{LABELS[system]:<36}{m:>14.3f}{tokens / m:>10,.0f}{losses[0]:>12.5f}{losses[-1]:>11.5f}"
              f"{diff or '-':>11}{rss:>13,.0f}")
        per = " | ".join(f"{statistics.median(r['step_s']):.3f}" for r in ok)
        print(f"{'':<4}per-repeat medians {per} s; warm-up {', '.join(f'{t:.2f}' for t in ok[0]['warmup_s'])} s; "
              f"set-up {ok[0]['setup_s']:.1f} s; {ok[0]['threads']} threads; {ok[0].get('optimizer', '')}"
              + (f"; {ok[0]['backend']}" if ok[0].get("backend") else ""))
        if ok[0].get("breakdown"):
            print(f"{'':<4}{ok[0]['breakdown']}")
        if len(ok) < len(runs[system]):
            print(f"{'':<4}{len(runs[system]) - len(ok)} of {len(runs[system])} runs failed: "
                  f"{next(r['error'] for r in runs[system] if 'error' in r)}")
    # every system saw the same weights and batches: the first losses must agree (and the curves stay close)
    curves = {s: next(r["losses"] for r in runs[s] if "losses" in r) for s in med}
    firsts = {s: c[0] for s, c in curves.items()}
    if len(firsts) > 1 and max(firsts.values()) - min(firsts.values()) > 1e-3:
        print("\n!!! WARNING: first-step losses differ by more than 1e-3 although weights and batches are identical: "
              + ", ".join(f"{s} {v:.6f}" for s, v in firsts.items()) + " -- the comparison is not like for like !!!")
    elif "ours" in curves:
        far = {s: max(abs(u - v) for u, v in zip(c, curves["ours"])) for s, c in curves.items() if s != "ours"}
        far = {s: d for s, d in far.items() if d > 1e-2}
        if far:
            print("\nnote: same first loss, but the loss curves drift apart later by up to "
                  + ", ".join(f"{d:.3f} ({s})" for s, d in far.items()) + ": the optimizer steps differ")
    print()
    if "ours" not in med:
        print("no ratios: " + ("our runs failed" if "ours" in runs else "ours was not among --systems"))
        return
    for system in med:
        if system != "ours":
            note = "reference without offload" if system == "resident" else "> 1: ours faster; target > 1"
            print(f"ratio {system:>9} / ours step time : {med[system] / med['ours']:6.2f}   ({note})")
    for system in runs:
        if system not in med:
            print(f"ratio {system:>9} / ours step time :    n/a   ({system} could not run, see above)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-mini", help="zoo preset whose shape the overrides below replace")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq_len", type=int, default=128)
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per run")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps before them")
    ap.add_argument("--repeats", type=int, default=3, help="runs per system, order rotated each time")
    ap.add_argument("--threads", type=int, default=2, help="torch and OpenMP threads in every worker")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight_decay", type=float, default=0.01)
    ap.add_argument("--max_gradient_norm", type=float, default=None, help="clip in all three (default: off)")
    ap.add_argument("--recompute", default="auto", choices=("auto", "always", "never"),
                    help="ours: recompute each unit's forward in backward (auto: off, no device budget)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--systems", default=",".join(SYSTEMS),
                    help=f"comma-separated, from {', '.join(LABELS)} (resident: plain torch, a reference)")
    ap.add_argument("--omp_wait_policy", choices=("active", "passive"), default=None,
                    help="OMP_WAIT_POLICY for every worker (default: unset). On a busy machine spinning OpenMP "
                         "threads lose their time slices, and systems running fewer other threads suffer more: "
                         "passive evens that out")
    ap.add_argument("--timeout", type=float, default=240.0, help="seconds before a worker is killed")
    ap.add_argument("--verbose", action="store_true", help="show the workers' own output")
    ap.add_argument("--worker", choices=LABELS, help=argparse.SUPPRESS)
    ap.add_argument("--workdir", help=argparse.SUPPRESS)
    ap.add_argument("--run_index", type=int, default=0, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return worker(a)
    systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    bad = [s for s in systems if s not in LABELS]
    if bad or not systems or len(set(systems)) < len(systems):
        ap.error(f"--systems: unknown or repeated {', '.join(bad) or a.systems!r}; choose from {', '.join(LABELS)}")
    if a.steps < 1 or a.warmup < 1 or a.repeats < 1:
        ap.error("--steps, --warmup and --repeats must be at least 1")
    import torch

    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="wsc-train-peers-") as d:
        work = Path(d)
        n = write_inputs(a, work)
        print(f"model {a.model} {a.layers}x{a.hidden}, vocab {a.vocab} ({n / 1e6:.1f}M params, fp32), batch "
              f"{a.batch_size}x{a.seq_len}, AdamW lr {a.lr:g} wd {a.weight_decay:g}"
              f"{f' clip {a.max_gradient_norm:g}' if a.max_gradient_norm else ''}; {a.steps} timed steps after "
              f"{a.warmup} warm-up, {a.repeats} alternating repeats, {a.threads} threads, torch {torch.__version__}")
        if load > 1.0:
            print(f"note: load average {load:.1f} on {os.cpu_count()} cores before the runs: other processes compete "
                  f"for the CPU, so these timings are noisy (compare per-repeat medians; re-run on a quiet machine"
                  f"{'' if a.omp_wait_policy else ' or with --omp_wait_policy passive'})")
        runs: dict[str, list[dict[str, Any]]] = {s: [] for s in systems}
        for r in range(a.repeats):
            order = systems[r % len(systems):] + systems[:r % len(systems)]
            for s in order:
                res = launch(a, s, work, r)
                runs[s].append(res)
                status = (f"median step {statistics.median(res['step_s']):.3f} s" if "error" not in res
                          else f"FAILED: {res['error']}")
                print(f"  repeat {r + 1}: {s:<9} {status}  ({res['wall_s']:.0f} s wall)", flush=True)
        summarize(a, runs)


if __name__ == "__main__":
    main()
