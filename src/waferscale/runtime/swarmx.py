"""SwarmX: `--num_csx N` data-parallel systems fed by one MemoryX, over torch.distributed.

    rank 0        MemoryX + the training loop (data, schedule, checkpoints, metrics): it owns every weight
    ranks 1..N    workers, one per system: a StreamingEngine whose weights arrive by broadcast and whose
                  gradients leave by reduce; they hold no weights, no optimizer state and no data

Per step: rank 0 publishes the command on the store, scatters each worker its rows of the global batch (the
rows `BatchLoader(rank=r, world_size=N)` would give), then per unit broadcasts the weights (forward order, then
backward order, as the single-system executor fetches them) and receives the gradient sum by reduce. Each
worker's loss is divided by N, so the reduced gradient is the global batch's: MemoryX then clips and updates
exactly as with one system, and checkpoints are the same files whatever N is.

Three process groups keep collectives ordered without locks: the default group (scatter, step figures) on the
main threads, one for weight broadcasts (the prefetch thread on workers, a broadcast thread on rank 0) and one for
gradient reduces (a write-back thread on each side). Transport: gloo. MemoryX is a host role, so its links carry
host tensors; CUDA workers copy to and from their GPU (NCCL would only help worker-to-worker collectives, which
this topology does not have).

Launch: locally `wsc run ... --num_csx N` spawns N worker processes rendezvousing over TCP on 127.0.0.1; across
machines run the same command under torchrun with N + 1 processes (rank 0 is MemoryX). Faults: collectives time
out after `timeout_s`; rank 0 then names the worker (a dead process, or the one whose heartbeat fell behind),
stops the others and raises WorkerFailure; checkpoints are written atomically, so the last one loads and a rerun
resumes from it.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import subprocess
import sys
import time
from concurrent.futures import Future
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from waferscale.errors import ConfigError
from waferscale.runtime.executor import HALF_DTYPES, StepResult
from waferscale.runtime.memoryx import Lane, MemoryX, build_layouts
from waferscale.runtime.streaming import (MemoryXExecutor, StreamingEngine, StreamingExecutor, build_skeleton,
                                         step_observability)

__all__ = ["SwarmXExecutor", "WorkerFailure", "worker_main", "is_worker_rank"]

_FIGURES = ("loss", "wait_weights_s", "compute_s", "fetch_busy_s", "push_s", "bytes_in", "bytes_out")
_WAIT_FOR_COMMAND = timedelta(days=7)  # workers idle while rank 0 evaluates or checkpoints


class WorkerFailure(RuntimeError):
    """A SwarmX worker died or stopped answering; the message names it."""


def is_worker_rank() -> bool:
    """Under torchrun (RANK/WORLD_SIZE set), ranks >= 1 are workers."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and int(os.environ["RANK"]) > 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _connect(url: str, rank: int, world: int, timeout_s: float) -> tuple[Any, int, int, Any, Any]:
    """Rendezvous, the default gloo group and the two link groups (weights, gradients)."""
    timeout = timedelta(seconds=timeout_s)
    store, rank, world = next(dist.rendezvous(url, rank=rank, world_size=world, timeout=timeout))
    dist.init_process_group("gloo", store=dist.PrefixStore("swarmx", store), rank=rank, world_size=world,
                            timeout=timeout)
    weights = dist.new_group(backend="gloo", timeout=timeout)
    grads = dist.new_group(backend="gloo", timeout=timeout)
    return store, rank, world, weights, grads


# ---- rank 0: MemoryX and the training loop ---------------------------------------------------------------

class SwarmXExecutor(MemoryXExecutor):
    """The Executor the trainer drives for --num_csx N > 1 (rank 0). Evaluation runs here, streaming from the
    same MemoryX, while the workers wait for the next command."""

    name = "swarmx"

    def __init__(self, skeleton: nn.Module, memoryx: MemoryX, *, num_csx: int, device: torch.device,
                 half_dtype: str | None = None, micro_batch_size: int | None = None,
                 device_memory_bytes: int | None = None, recompute: bool | str = "auto",
                 timeout_s: float = 300.0, worker_threads: int | None = None) -> None:
        self.mx, self.n_workers, self.timeout_s = memoryx, num_csx, timeout_s
        self.half = HALF_DTYPES[half_dtype] if half_dtype else None
        self.micro_batch_size = micro_batch_size
        self._failed = False
        self._threads_before: int | None = None
        self._seq = 0
        self.n_workers = num_csx
        self._procs: dict[int, subprocess.Popen] = {}
        self._seq = 0
        self._peak = 0
        self._weight_params = sum(lay.numel for lay in memoryx.layouts)
        self.cfg = skeleton.config
        # evaluation (and the memory plan / budget check) on this process, from the same MemoryX
        self._local = StreamingExecutor(skeleton, memoryx, device=device, half_dtype=half_dtype,
                                        micro_batch_size=micro_batch_size, device_memory_bytes=device_memory_bytes,
                                        recompute=recompute)
        world = num_csx + 1
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun: N + 1 processes, rank 0 is us
            if int(os.environ["WORLD_SIZE"]) != world:
                raise ConfigError(f"--num_csx {num_csx} needs {world} processes (MemoryX + {num_csx} workers), "
                                  f"but torchrun started WORLD_SIZE={os.environ['WORLD_SIZE']}; use "
                                  f"--nproc_per_node/--nnodes totalling {world}")
            url = "env://"
        else:  # local: spawn the workers, rendezvous on a free port of 127.0.0.1
            port = _free_port()
            url = f"tcp://127.0.0.1:{port}"
            cpus = os.cpu_count() or 1
            threads = worker_threads or max(1, cpus // num_csx)
            self.systems_threads = (num_csx, threads)  # for MFU: the systems' own peak, not rank 0's
            self._threads_before = torch.get_num_threads()  # MemoryX's optimizer gets what the workers leave
            torch.set_num_threads(max(1, cpus - num_csx * threads))
            for r in range(1, world):
                self._procs[r] = subprocess.Popen(
                    [sys.executable, "-m", "waferscale.runtime.swarmx", "--rank", str(r), "--world_size", str(world),
                     "--url", url, "--timeout_s", str(timeout_s), "--threads", str(threads)],
                    stdout=subprocess.DEVNULL)
        try:
            self.store, _, _, self.g_weights, self.g_grads = _connect(url, 0, world, timeout_s)
        except Exception as e:  # noqa: BLE001 - a worker that never arrived
            self._stop_local_workers()
            raise WorkerFailure(f"SwarmX: the {num_csx} workers did not all connect within {timeout_s:.0f} s "
                                f"({type(e).__name__}: {e})") from None
        self.store.set("init", json.dumps({
            "model_config": self.cfg.to_dict(), "half_dtype": half_dtype, "micro_batch_size": micro_batch_size,
            "recompute": self._local.recompute_option, "device_type": device.type}))
        self._guard("start up", lambda: self.store.wait([f"ready/{r}" for r in range(1, world)]))
        self._bcast = Lane("swarmx-broadcast")
        self._reduce = Lane("swarmx-reduce")

    # ---- one step ----
    def train_step(self, x: Tensor, y: Tensor, lr: float) -> StepResult:
        B, T = x.shape
        N = self.n_workers
        if B % N:
            raise ConfigError(f"the batch of {B} does not split evenly over --num_csx {N}")
        b = B // N
        mb = self.micro_batch_size or b
        if b % mb:
            raise ConfigError(f"micro_batch_size {mb} does not divide the per-system batch {b}")
        recompute = self._local._ensure_engine(b, T).recompute  # budget check and plan for one system's share
        self._seq += 1
        self.mx.take_stats()
        t0 = time.perf_counter()
        self.mx.begin_step(lr)
        scale = self.mx.scaler.scale if self.mx.scaler else 1.0
        self.store.set(f"cmd/{self._seq}", json.dumps({"cmd": "step", "b": b, "t": T, "scale": scale,
                                                          "recompute": recompute}))
        rows = torch.stack([x, y]).view(2, N, b, T).transpose(0, 1).contiguous()  # (N, 2, b, T)
        recv = torch.empty(2, b, T, dtype=torch.long)
        figures = torch.zeros(len(_FIGURES), dtype=torch.float64)
        peak = torch.zeros(1, dtype=torch.float64)
        self._guard("scatter the batch", lambda: dist.scatter(recv, [recv, *rows.unbind(0)], src=0))
        fb = self._bcast.submit(self._broadcast_units)
        fr = self._reduce.submit(self._reduce_grads)
        self._guard("collect step figures", lambda: dist.reduce(figures, 0, op=dist.ReduceOp.SUM))
        self._guard("collect step figures", lambda: dist.reduce(peak, 0, op=dist.ReduceOp.MAX))
        self._guard("broadcast weights", fb.result)
        self._guard("reduce gradients", fr.result)
        grad_norm, skipped = self.mx.end_backward()
        step_s = time.perf_counter() - t0
        f = dict(zip(_FIGURES, figures.tolist()))
        loss = f.pop("loss")
        self._peak = max(self._peak, int(peak.item()))
        ms = self.mx.take_stats()
        stats = {k: v / N for k, v in f.items()}  # per worker
        stats.update({"grad_writeback_s": ms["grad_writeback_s"], "optimizer_s": ms["optimizer_s"],
                      "peak_device_bytes": self._peak, "num_csx": N})
        stats["compute_s"] = f["compute_s"] / N
        flops = self.cfg.flops_per_token(T, training=True) * b  # per worker
        out = step_observability(stats, step_s=step_s, tokens=b * T, flops=flops, weight_params=self._weight_params)
        if loss != loss and not skipped:  # NaN
            raise FloatingPointError(f"training loss became {loss}; lower the learning rate or enable "
                                     f"gradient clipping (optimizer.max_gradient_norm)")
        return StepResult(loss=loss, tokens=y.numel(), grad_norm=grad_norm, skipped=skipped, stats=out)

    def _broadcast_units(self) -> None:
        n = self.mx.n_units
        for u in list(range(n)) + list(range(n - 2, -1, -1)):
            big, small = self.mx.fetch(u)
            for t in (big, small):
                if t.numel():
                    dist.broadcast(t, 0, group=self.g_weights)

    def _reduce_grads(self) -> None:
        for u in range(self.mx.n_units - 1, -1, -1):
            lay = self.mx.layouts[u]
            big, small = torch.zeros(lay.n_big), torch.zeros(lay.n_small)
            for t in (big, small):
                if t.numel():
                    dist.reduce(t, 0, op=dist.ReduceOp.SUM, group=self.g_grads)
            self.mx.push_grads(u, big, small)

    # ---- faults ----
    def _guard(self, what: str, fn: Any) -> Any:
        try:
            return fn()
        except WorkerFailure:
            raise
        except (RuntimeError, OSError) as e:
            if self._failed:
                raise
            self._failed = True
            raise WorkerFailure(self._diagnose(what, e)) from None

    def _diagnose(self, what: str, err: Exception) -> str:
        time.sleep(0.5)  # let a dying process finish dying
        dead = {r: p.poll() for r, p in self._procs.items() if p.poll() is not None}
        beats: dict[int, tuple[int, int, str]] = {}
        for r in range(1, self.n_workers + 1):
            key = f"hb/{r}"
            try:
                if self.store.check([key]):
                    seq, phase = self.store.get(key).decode().split(":")
                    beats[r] = (int(seq), _PHASES.index(phase), phase)
            except Exception:  # noqa: BLE001 - the store may be gone with the failure
                pass
        progress = {r: beats.get(r, (-1, 0, "never reported"))[:2] for r in range(1, self.n_workers + 1)}
        front = max(progress.values())
        behind = sorted((v, r) for r, v in progress.items() if v < front)
        if behind:  # the worker that fell behind is the cause; the others stopped waiting for it
            r = behind[0][1]
            seq, _, phase = beats.get(r, (0, 0, "never reported"))
            state = f"died (exit code {dead[r]})" if r in dead else "hung"
            who = f"worker {r} (rank {r}) {state} (last heartbeat: step {seq}, {phase})"
        elif dead:
            r, code = sorted(dead.items())[0]
            who = f"worker {r} (rank {r}) died (exit code {code})"
        else:
            who = f"workers {', '.join(map(str, range(1, self.n_workers + 1)))} stopped answering"
        self._stop_local_workers()
        return (f"SwarmX: {who} during step {self._seq}, while MemoryX tried to {what} (timeout "
                f"{self.timeout_s:.0f} s; {str(err).splitlines()[0][:100]}). The run stopped; the checkpoints in the "
                f"model directory are complete, so rerunning the same command resumes from the last one")

    def _stop_local_workers(self) -> None:
        for p in self._procs.values():
            if p.poll() is None:
                p.kill()
        for p in self._procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass

    # ---- the rest of the Executor interface: MemoryX on this rank ----
    def eval_loss(self, x: Tensor, y: Tensor) -> float:
        return self._local.eval_loss(x, y)

    def peak_device_bytes(self) -> int:
        return self._peak

    def summary(self) -> dict[str, Any]:
        return {**self._local.summary(), "num_csx": self.n_workers, "transport": "gloo"}

    def close(self) -> None:
        if not self._failed:
            try:
                self.mx.synchronize()
                self.store.set(f"cmd/{self._seq + 1}", json.dumps({"cmd": "stop"}))
                for p in self._procs.values():
                    p.wait(self.timeout_s)
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - shutting down; nothing left to save
                self._stop_local_workers()
        else:
            self._stop_local_workers()
        self._bcast.close(0)
        self._reduce.close(0)
        self._local.close()
        # Release the gloo groups and the store now, not in interpreter teardown, where destroying their C++
        # threads can abort the process ("terminate called without an active exception").
        self.g_weights = self.g_grads = self.store = None
        gc.collect()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)


# ---- ranks 1..N: workers ---------------------------------------------------------------------------------

_PHASES = ["idle", "start", "scatter", "compute", "done"]


class _WorkerLink:
    """Weights by broadcast from rank 0 (called on the engine's prefetch thread), gradients by reduce to rank 0
    (on this link's own thread)."""

    def __init__(self, layouts: list, stream_dtype: torch.dtype, g_weights: Any, g_grads: Any,
                 device: torch.device) -> None:
        self.layouts, self.stream_dtype, self.gw, self.gg, self.device = layouts, stream_dtype, g_weights, g_grads, device
        self._lane = Lane("swarmx-grads")
        self._pending: list[Future] = []

    def fetch(self, u: int) -> tuple[Tensor, Tensor]:
        lay = self.layouts[u]
        big = torch.empty(lay.n_big, dtype=self.stream_dtype)
        small = torch.empty(lay.n_small, dtype=torch.float32)
        for t in (big, small):
            if t.numel():
                dist.broadcast(t, 0, group=self.gw)
        if self.device.type == "cuda":
            return big.to(self.device), small.to(self.device)
        return big, small

    def push(self, u: int, big: Tensor, small: Tensor) -> Future:
        def send() -> None:
            for t in (big, small):
                if t.numel():
                    dist.reduce(t.cpu() if t.is_cuda else t, 0, op=dist.ReduceOp.SUM, group=self.gg)

        fut = self._lane.submit(send)
        self._pending.append(fut)
        return fut

    def flush(self) -> None:
        for f in self._pending:
            f.result()
        self._pending = []


def _fault(rank: int, seq: int) -> None:
    """Test hook: WSC_SWARMX_FAULT="RANK:STEP:die|hang" makes that worker fail at the start of that step."""
    spec = os.environ.get("WSC_SWARMX_FAULT")
    if not spec:
        return
    r, s, kind = spec.split(":")
    if int(r) == rank and int(s) == seq:
        if kind == "die":
            os._exit(17)
        time.sleep(10 ** 6)


def worker_main(url: str = "env://", rank: int = -1, world: int = -1, timeout_s: float = 300.0,
                threads: int | None = None) -> int:
    """A SwarmX worker: stream-execute steps until rank 0 says stop."""
    import torch.func  # noqa: F401 - imported before the first step, not during it
    from waferscale.models import ModelConfig

    if threads:
        torch.set_num_threads(threads)
    store, rank, world, gw, gg = _connect(url, rank, world, timeout_s)
    n_workers = world - 1
    store.wait(["init"], _WAIT_FOR_COMMAND)
    init = json.loads(store.get("init"))
    cfg = ModelConfig.from_dict(init["model_config"])
    if init["device_type"] == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank - 1)) % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    half = HALF_DTYPES[init["half_dtype"]] if init["half_dtype"] else None
    skeleton = build_skeleton(cfg, device)
    layouts = build_layouts(skeleton)
    link = _WorkerLink(layouts, half or torch.float32, gw, gg, device)
    engine = StreamingEngine(skeleton, link, device=device, half=half, layouts=layouts, recompute=True)
    beat = lambda seq, phase: store.set(f"hb/{rank}", f"{seq}:{phase}")  # noqa: E731
    beat(0, "idle")
    store.set(f"ready/{rank}", "1")
    seq = 0
    while True:
        seq += 1
        store.wait([f"cmd/{seq}"], _WAIT_FOR_COMMAND)
        cmd = json.loads(store.get(f"cmd/{seq}"))
        if cmd["cmd"] == "stop":
            break
        _fault(rank, seq)
        beat(seq, "start")
        b, T = cmd["b"], cmd["t"]
        mb = init["micro_batch_size"] or b
        recv = torch.empty(2, b, T, dtype=torch.long)
        dist.scatter(recv, None, src=0)
        beat(seq, "compute")
        engine.reset_stats()
        engine.recompute = cmd["recompute"]
        t0 = time.perf_counter()
        loss = engine.step(recv[0], recv[1], micro_batch=mb, loss_divisor=(b // mb) * n_workers,
                           loss_scale=cmd["scale"])
        link.flush()
        s = engine.stats
        compute = time.perf_counter() - t0 - s["wait_weights_s"] - s["push_s"]
        values = {"loss": loss, "compute_s": compute, **{k: s[k] for k in _FIGURES if k in s}}
        dist.reduce(torch.tensor([values.get(k, 0.0) for k in _FIGURES], dtype=torch.float64), 0,
                    op=dist.ReduceOp.SUM)
        dist.reduce(torch.tensor([float(engine.ledger.peak if device.type == "cpu"
                                        else torch.cuda.max_memory_allocated(device))], dtype=torch.float64), 0,
                    op=dist.ReduceOp.MAX)
        beat(seq, "done")
    engine.close()
    dist.destroy_process_group()
    return 0


def _main() -> int:
    ap = argparse.ArgumentParser(description="a SwarmX worker (started by `wsc run --num_csx N`)")
    ap.add_argument("--rank", type=int, required=True)
    ap.add_argument("--world_size", type=int, required=True)
    ap.add_argument("--url", required=True)
    ap.add_argument("--timeout_s", type=float, default=300.0)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    try:
        code = worker_main(a.url, a.rank, a.world_size, a.timeout_s, a.threads)
    except Exception as e:  # noqa: BLE001 - rank 0 reports the fault; a worker only says why it stopped
        print(f"swarmx worker {a.rank}: stopped ({type(e).__name__}: {str(e).splitlines()[0][:160]})",
              file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: rank 0 waits for this exit


if __name__ == "__main__":
    raise SystemExit(_main())
