"""`cstorch.distributed`: N data-parallel systems (SwarmX) fed by one MemoryX, for a user's own script.

The script runs on every system (SPMD), as under torchrun:

    rank 0       MemoryX (fp32 masters, optimizer state, the update) and system 0; runs the step closures
                 and checkpoint closures (once per step, with the losses averaged over the systems)
    ranks 1..N-1 systems 1..N-1: they hold no weights and no optimizer state

Per unit, the weights are broadcast from rank 0 and the gradients reduced (sum) back to it; each system
trains on its 1/N of every batch the DataExecutor yields, and rank 0 divides the gradient sum by N, so the
update is the whole batch's: the same as one system. Transport: gloo (MemoryX is a host role).

`ClusterConfig(num_csx=N)` in a plain `python script.py` starts N - 1 more copies of the script on this
machine (their output goes to `artifact_dir/swarmx_rank{r}.log`); under torchrun (WORLD_SIZE set) the
processes already exist, across machines too. A system that dies or hangs stops the run after `timeout_s`
with a message naming it.
"""

from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
from concurrent.futures import Future
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor

from waferscale.errors import ConfigError
from waferscale.runtime.memoryx import Lane

if TYPE_CHECKING:
    from waferscale.pytorch.backend import Backend

__all__ = ["ClusterConfig", "SwarmXFailure", "rank", "world_size", "is_master", "launch"]


@dataclass
class ClusterConfig:
    """Cerebras' cluster description; here `num_csx` is the number of data-parallel systems."""

    num_csx: int = 1
    max_wgt_servers: int | None = None  # accepted for compatibility: MemoryX is one host role here
    max_act_per_csx: int | None = None
    num_workers_per_csx: int | None = None
    mount_dirs: list[str] | None = None
    python_paths: list[str] | None = None
    timeout_s: float = 300.0  # a system silent this long is declared dead or hung

    def __post_init__(self) -> None:
        if not isinstance(self.num_csx, int) or isinstance(self.num_csx, bool) or self.num_csx < 1:
            raise ConfigError(f"ClusterConfig(num_csx=...) must be a positive integer, got {self.num_csx!r}")
        if self.timeout_s <= 0:
            raise ConfigError(f"ClusterConfig(timeout_s=...) must be positive, got {self.timeout_s}")


class SwarmXFailure(RuntimeError):
    """A system died or stopped answering; the message names it."""


@dataclass
class _State:
    rank: int = 0
    world: int = 1
    g_weights: Any = None
    g_grads: Any = None
    timeout_s: float = 300.0
    procs: dict[int, subprocess.Popen] | None = None


_state = _State()


def rank() -> int:
    return _state.rank


def world_size() -> int:
    return _state.world


def is_master() -> bool:
    return _state.rank == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(backend: "Backend") -> None:
    """Join (under torchrun) or start (locally) the N processes of `backend.cluster_config`."""
    n = backend.num_csx
    cc = backend.cluster_config
    if _state.world > 1:
        if _state.world != n:
            raise ConfigError(f"this process already runs with num_csx={_state.world}; one cluster per script")
        return
    timeout = timedelta(seconds=cc.timeout_s)
    env = os.environ
    if "WORLD_SIZE" in env and "RANK" in env:  # torchrun, or a copy started below
        if int(env["WORLD_SIZE"]) != n:
            raise ConfigError(f"ClusterConfig(num_csx={n}) needs {n} processes but WORLD_SIZE={env['WORLD_SIZE']}; "
                              f"start torchrun with --nproc_per_node/--nnodes totalling {n}")
        r = int(env["RANK"])
        procs: dict[int, subprocess.Popen] = {}
    else:
        port = _free_port()
        r = 0
        backend.artifact_dir.mkdir(parents=True, exist_ok=True)
        threads = max(1, (os.cpu_count() or 1) // n)
        procs = {}
        for k in range(1, n):
            child_env = {**env, "RANK": str(k), "WORLD_SIZE": str(n), "LOCAL_RANK": str(k),
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": str(threads)}
            log = open(backend.artifact_dir / f"swarmx_rank{k}.log", "w")
            procs[k] = subprocess.Popen([sys.executable, *sys.argv], env=child_env, stdout=log, stderr=log)
            log.close()
        env["MASTER_ADDR"], env["MASTER_PORT"] = "127.0.0.1", str(port)
        torch.set_num_threads(threads)
    try:
        dist.init_process_group("gloo", init_method="env://", rank=r, world_size=n, timeout=timeout)
    except Exception as e:  # noqa: BLE001 - a process that never arrived
        for p in procs.values():
            p.kill()
        raise SwarmXFailure(f"SwarmX: the {n} systems did not all connect within {cc.timeout_s:.0f} s "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
    _state.rank, _state.world, _state.timeout_s, _state.procs = r, n, cc.timeout_s, procs
    _state.g_weights = dist.new_group(backend="gloo", timeout=timeout)
    _state.g_grads = dist.new_group(backend="gloo", timeout=timeout)
    atexit.register(_shutdown)


def _shutdown() -> None:
    procs = _state.procs or {}
    if _state.world > 1:
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - a system already gone; nothing left to synchronise
            pass
    for p in procs.values():
        try:
            p.wait(_state.timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
    _state.g_weights = _state.g_grads = None
    if dist.is_initialized():
        dist.destroy_process_group()


def fault_hook(step: int) -> None:
    """Test hook: WSC_SWARMX_FAULT="RANK:STEP:die|hang" makes that system fail as that step starts."""
    spec = os.environ.get("WSC_SWARMX_FAULT")
    if not spec or _state.world == 1:
        return
    r, s, kind = spec.split(":")
    if int(r) == _state.rank and int(s) == step:
        if kind == "die":
            os._exit(17)
        import time

        time.sleep(10 ** 6)


def diagnose(what: str, err: Exception) -> SwarmXFailure:
    """The failure of a collective, naming the system that caused it where this process can tell."""
    import time

    time.sleep(0.5)  # let a dying process finish dying
    dead = {k: p.poll() for k, p in (_state.procs or {}).items() if p.poll() is not None}
    if dead:
        k, code = sorted(dead.items())[0]
        who = f"system {k} (rank {k}) died (exit code {code})"
    elif _state.rank == 0:
        who = f"a system (ranks 1..{_state.world - 1}) stopped answering"
    else:
        who = "rank 0 (MemoryX) stopped answering"
    for p in (_state.procs or {}).values():
        if p.poll() is None:
            p.kill()
    return SwarmXFailure(f"SwarmX: {who} while {what} (timeout {_state.timeout_s:.0f} s; "
                         f"{str(err).splitlines()[0][:100]}); checkpoints already written are complete")


def all_mean(values: list[float]) -> list[float]:
    """Element-wise mean over the systems (main thread, default group)."""
    if _state.world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    try:
        dist.all_reduce(t)
    except RuntimeError as e:
        raise diagnose("averaging the step's results", e) from None
    return (t / _state.world).tolist()


class SwarmLink:
    """Weights by broadcast from rank 0's MemoryX, gradients by reduce to it (sum, then / N), per unit."""

    def __init__(self, memoryx: Any, layouts: list, stream_dtype: torch.dtype, device: torch.device) -> None:
        self.mx, self.layouts, self.stream_dtype, self.device = memoryx, layouts, stream_dtype, device
        self._lane = Lane("swarmx-grads")

    def fetch(self, u: int) -> tuple[Tensor, Tensor]:
        if self.mx is not None:
            big, small = self.mx.fetch(u)
        else:
            lay = self.layouts[u]
            big = torch.empty(lay.n_big, dtype=self.stream_dtype)
            small = torch.empty(lay.n_small, dtype=torch.float32)
        try:
            for t in (big, small):
                if t.numel():
                    dist.broadcast(t, 0, group=_state.g_weights)
        except RuntimeError as e:
            raise diagnose(f"broadcasting the weights of unit {u}", e) from None
        if self.device.type == "cuda":
            return big.to(self.device), small.to(self.device)
        return big, small

    def push(self, u: int, big: Tensor, small: Tensor) -> Future:
        def send() -> None:
            b, s = big.cpu(), small.cpu()
            try:
                for t in (b, s):
                    if t.numel():
                        dist.reduce(t, 0, op=dist.ReduceOp.SUM, group=_state.g_grads)
            except RuntimeError as e:
                raise diagnose(f"reducing the gradients of unit {u}", e) from None
            if self.mx is not None:
                b.div_(_state.world)
                s.div_(_state.world)
                self.mx.push_grads(u, b, s).result()

        return self._lane.submit(send)

    def close(self) -> None:
        self._lane.close()
