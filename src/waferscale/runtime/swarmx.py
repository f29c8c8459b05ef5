"""SwarmX: `--num_csx N` data-parallel systems fed by one MemoryX, over torch.distributed.

    rank 0        MemoryX + the training loop (data, schedule, checkpoints, metrics): it owns every weight
    ranks 1..N    workers, one per system: a StreamingEngine whose weights arrive by broadcast and whose
                  gradients leave by reduce; they hold no weights, no optimizer state and no data

Per step: rank 0 publishes the command on the store, scatters each worker its rows of the global batch (the
rows `BatchLoader(rank=r, world_size=N)` would give), then per unit broadcasts the weights (in the engine's fetch
order) and receives the gradient sum by reduce. Each worker's loss is divided by N, so the reduced gradient is the
global batch's: MemoryX then clips and updates exactly as with one system, and checkpoints are the same files
whatever N is.

Transport: gloo. MemoryX is a host role, so its links carry host tensors; CUDA workers copy to and from their GPU
(NCCL would only help worker-to-worker collectives, which this topology does not have). The processes, groups,
heartbeats and fault diagnosis are the cluster's (`runtime/cluster.py`); weights and gradients travel over its
`SwarmLink` (`runtime/links.py`). Locally `wsc run ... --num_csx N` starts N worker processes; across machines run
the same command under torchrun with N + 1 processes (rank 0 is MemoryX). A fault stops the run with a
SwarmXFailure naming the worker; rerunning resumes from the last (atomically written) checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from waferscale.errors import ConfigError
from waferscale.runtime.cluster import Cluster, connect, fault_hook, launch, under_torchrun
from waferscale.runtime.engine import fetch_order
from waferscale.runtime.executor import StepResult, check_loss
from waferscale.runtime.links import SwarmLink
from waferscale.runtime.lane import Lane
from waferscale.runtime.layout import build_layouts
from waferscale.runtime.memoryx import MemoryX
from waferscale.runtime.streaming import MemoryXExecutor, StreamingExecutor, build_skeleton, lm_engine, \
    step_observability
from waferscale.util.dtypes import half_dtype as torch_half_dtype

__all__ = ["SwarmXExecutor", "worker_main", "is_worker_rank"]

_FIGURES = ("loss", "wait_weights_s", "compute_s", "fetch_busy_s", "push_s", "bytes_in", "bytes_out")
_WAIT_FOR_COMMAND = timedelta(days=7)  # workers idle while rank 0 evaluates or checkpoints


def is_worker_rank() -> bool:
    """Under torchrun (RANK/WORLD_SIZE set), ranks >= 1 are workers."""
    return under_torchrun() and int(os.environ["RANK"]) > 0


# ---- rank 0: MemoryX and the training loop ---------------------------------------------------------------

class SwarmXExecutor(MemoryXExecutor):
    """The Executor the trainer drives for --num_csx N > 1 (rank 0). Evaluation runs here, streaming from the
    same MemoryX, while the workers wait for the next command."""

    name = "swarmx"

    def __init__(self, skeleton: nn.Module, memoryx: MemoryX, *, num_csx: int, device: torch.device,
                 half_dtype: str | None = None, micro_batch_size: int | None = None,
                 device_memory_bytes: int | None = None, recompute: bool | str = "auto",
                 timeout_s: float = 300.0, worker_threads: int | None = None) -> None:
        self.mx, self.n_workers, self.micro_batch_size = memoryx, num_csx, micro_batch_size
        self.half = torch_half_dtype(half_dtype)  # the zoo runner reads it (MFU dtype)
        self._threads_before: int | None = None
        self._seq = 0
        self._peak = 0
        self._weight_params = sum(lay.numel for lay in memoryx.layouts)
        self.cfg = skeleton.config
        # evaluation (and the memory plan / budget check) on this process, from the same MemoryX
        self._local = StreamingExecutor(skeleton, memoryx, device=device, half_dtype=half_dtype,
                                        micro_batch_size=micro_batch_size, device_memory_bytes=device_memory_bytes,
                                        recompute=recompute)
        world = num_csx + 1
        threads = None
        if not under_torchrun():  # local: the workers share this machine's cores; MemoryX gets what they leave
            cpus = os.cpu_count() or 1
            threads = worker_threads or max(1, cpus // num_csx)
            self.systems_threads = (num_csx, threads)  # for MFU: the systems' own peak, not rank 0's
            self._threads_before = torch.get_num_threads()
            torch.set_num_threads(max(1, cpus - num_csx * threads))
        argv = ["-m", "waferscale.runtime.swarmx", "--timeout_s", str(timeout_s)]
        if threads:
            argv += ["--threads", str(threads)]
        self.cluster: Cluster = launch(world, argv, timeout_s=timeout_s, label="worker", threads=threads,
                                       advice="the checkpoints in the model directory are complete, so rerunning "
                                              "the same command resumes from the last one", local_rank_base=1,
                                       needed_by=f"--num_csx {num_csx}",
                                       what=f"processes (MemoryX + {num_csx} workers)")
        sparse_units = sorted(memoryx.unit_masks.keep)  # (the masks are chosen before the executor is made)
        self.link = SwarmLink(self.cluster, memoryx.layouts, memoryx.stream_dtype, torch.device("cpu"), memoryx,
                              sparse_units=set(sparse_units))
        self.cluster.store.set("init", json.dumps({"model_config": self.cfg.to_dict(), "half_dtype": half_dtype,
                                                   "micro_batch_size": micro_batch_size, "device_type": device.type,
                                                   "sparse_units": sparse_units}))
        self._guard("start up", lambda: self.cluster.store.wait([f"ready/{r}" for r in range(1, world)]))
        self._bcast = Lane("swarmx-broadcast")

    def _guard(self, what: str, fn: Any) -> Any:
        return self.cluster.guard(f"MemoryX tried to {what}", fn, step=self._seq)

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
        self.link.take_stats()
        t0 = time.perf_counter()
        self.mx.begin_step(lr)
        scale = self.mx.scaler.scale if self.mx.scaler else 1.0
        self.cluster.store.set(f"cmd/{self._seq}", json.dumps({"cmd": "step", "b": b, "t": T, "scale": scale,
                                                                  "recompute": recompute}))
        # (N, 2, b, T) on the host: gloo carries host tensors, and the executor may have put the batch on a GPU
        rows = torch.stack([x, y]).view(2, N, b, T).transpose(0, 1).to("cpu", torch.long).contiguous()
        recv = torch.empty(2, b, T, dtype=torch.long)
        figures = torch.zeros(len(_FIGURES), dtype=torch.float64)
        peak = torch.zeros(1, dtype=torch.float64)
        self._guard("scatter the batch", lambda: dist.scatter(recv, [recv, *rows.unbind(0)], src=0))
        n = self.mx.n_units
        fb = self._bcast.submit(lambda: [self.link.fetch(u) for u in fetch_order(n)])
        pushes = [self.link.push_zeros(u) for u in range(n - 1, -1, -1)]  # rank 0's share of each reduce: zeros
        self._guard("collect step figures", lambda: dist.reduce(figures, 0, op=dist.ReduceOp.SUM))
        self._guard("collect step figures", lambda: dist.reduce(peak, 0, op=dist.ReduceOp.MAX))
        self._guard("broadcast weights", fb.result)
        self._guard("reduce gradients", lambda: [f.result() for f in pushes])
        grad_norm, skipped = self.mx.end_backward()
        step_s = time.perf_counter() - t0
        f = dict(zip(_FIGURES, figures.tolist()))
        loss = f.pop("loss")
        self._peak = max(self._peak, int(peak.item()))
        ms = self.mx.take_stats()
        stats = {k: v / N for k, v in f.items()}  # per worker
        stats.update({"grad_writeback_s": ms["grad_writeback_s"], "optimizer_s": ms["optimizer_s"],
                      "peak_device_bytes": self._peak, "num_csx": N, **self.link.take_stats()})
        flops = self.cfg.flops_per_token(T, training=True) * b  # per worker
        out = step_observability(stats, step_s=step_s, tokens=b * T, flops=flops, weight_params=self._weight_params)
        check_loss(loss, skipped)
        return StepResult(loss=loss, tokens=y.numel(), grad_norm=grad_norm, skipped=skipped, stats=out)

    # ---- the rest of the Executor interface: MemoryX on this rank ----
    def eval_loss(self, x: Tensor, y: Tensor) -> float:
        return self._local.eval_loss(x, y)

    def peak_device_bytes(self) -> int:
        return self._peak

    def summary(self) -> dict[str, Any]:
        return {**self._local.summary(), "num_csx": self.n_workers, "transport": "gloo"}

    def close(self) -> None:
        if self.cluster.failure is None:
            try:
                self.mx.synchronize()
                self.cluster.store.set(f"cmd/{self._seq + 1}", json.dumps({"cmd": "stop"}))
            except Exception:  # noqa: BLE001 - shutting down; nothing left to save
                self.cluster.stop_started()
        self._bcast.close(0)
        self.link.close()
        self._local.close()
        self.cluster.close()
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)


# ---- ranks 1..N: workers ---------------------------------------------------------------------------------

def worker_main(timeout_s: float = 300.0, threads: int | None = None) -> int:
    """A SwarmX worker (RANK/WORLD_SIZE/MASTER_* set, by torchrun or by rank 0): stream-execute steps until
    rank 0 says stop."""
    import torch.func  # noqa: F401 - imported before the first step, not during it
    from waferscale.models import ModelConfig

    if threads:
        torch.set_num_threads(threads)
    cluster = connect("env://", int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), timeout_s, label="worker")
    rank, store, n_workers = cluster.rank, cluster.store, cluster.world - 1
    store.wait(["init"], _WAIT_FOR_COMMAND)
    init = json.loads(store.get("init"))
    cfg = ModelConfig.from_dict(init["model_config"])
    if init["device_type"] == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank - 1)) % torch.cuda.device_count())
    else:
        device = torch.device("cpu")
    half = torch_half_dtype(init["half_dtype"])
    skeleton = build_skeleton(cfg, device)
    layouts = build_layouts(skeleton)
    link = SwarmLink(cluster, layouts, half or torch.float32, device, sparse_units=set(init["sparse_units"]))
    engine = lm_engine(skeleton, link, layouts, device=device, half=half, recompute=True)
    cluster.beat(0, "idle")
    store.set(f"ready/{rank}", "1")
    seq = 0
    while True:
        seq += 1
        store.wait([f"cmd/{seq}"], _WAIT_FOR_COMMAND)
        cmd = json.loads(store.get(f"cmd/{seq}"))
        if cmd["cmd"] == "stop":
            break
        fault_hook(rank, seq)
        cluster.beat(seq, "start")
        b, T = cmd["b"], cmd["t"]
        mb = init["micro_batch_size"] or b
        recv = torch.empty(2, b, T, dtype=torch.long)
        dist.scatter(recv, None, src=0)
        cluster.beat(seq, "compute")
        engine.reset_stats()
        engine.recompute = cmd["recompute"]
        t0 = time.perf_counter()
        loss = engine.step(recv[0], recv[1], micro_batch=mb, loss_divisor=(b // mb) * n_workers,
                           loss_scale=cmd["scale"])
        engine.wait_pushes()
        s = engine.stats
        compute = time.perf_counter() - t0 - s["wait_weights_s"] - s["push_s"]
        values = {"loss": loss, "compute_s": compute, **{k: s[k] for k in _FIGURES if k in s}}
        dist.reduce(torch.tensor([values.get(k, 0.0) for k in _FIGURES], dtype=torch.float64), 0,
                    op=dist.ReduceOp.SUM)
        dist.reduce(torch.tensor([float(engine.ledger.peak if device.type == "cpu"
                                        else torch.cuda.max_memory_allocated(device))], dtype=torch.float64), 0,
                    op=dist.ReduceOp.MAX)
        cluster.beat(seq, "done")
    engine.close()
    link.close()
    cluster.close()
    return 0


def _main() -> int:
    ap = argparse.ArgumentParser(description="a SwarmX worker (started by `wsc run --num_csx N`)")
    ap.add_argument("--timeout_s", type=float, default=300.0)
    ap.add_argument("--threads", type=int, default=None)
    a = ap.parse_args()
    try:
        code = worker_main(a.timeout_s, a.threads)
    except Exception as e:  # noqa: BLE001 - rank 0 reports the fault; a worker only says why it stopped
        print(f"swarmx worker {os.environ.get('RANK', '?')}: stopped ({type(e).__name__}: "
              f"{str(e).splitlines()[0][:160]})", file=sys.stderr)
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip interpreter teardown: rank 0 waits for this exit


if __name__ == "__main__":
    raise SystemExit(_main())
