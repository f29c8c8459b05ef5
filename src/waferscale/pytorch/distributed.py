"""`cstorch.distributed`: N data-parallel systems (SwarmX) fed by one MemoryX, for a user's own script.

The script runs on every system (SPMD), as under torchrun. Rank 0 holds MemoryX (fp32 masters, optimizer state,
the update), is system 0, and alone runs the step and checkpoint closures (with the losses averaged over the
systems); ranks 1..N-1 hold no weights and no optimizer state. Per unit, weights are broadcast from rank 0 and
gradients reduced (sum) back to it; each system trains on its 1/N of every batch and rank 0 divides the sum by
N, so the update is the whole batch's, as on one system. Transport: gloo (MemoryX is a host role). How the
copies of the script start, and what stops a run when one dies or hangs, is docs/cstorch.md's "Several systems".
"""

from __future__ import annotations

import atexit
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from waferscale.errors import ConfigError
from waferscale.runtime import cluster as _cluster
from waferscale.runtime.cluster import Cluster, LinkError, SwarmXFailure

if TYPE_CHECKING:
    from waferscale.pytorch.backend import Backend

__all__ = ["ClusterConfig", "SwarmXFailure", "rank", "world_size", "is_master", "launch"]


def _env_num_csx() -> int:
    v = os.environ.get("WSC_NUM_CSX", "").strip()
    if not v:
        return 1
    try:
        return int(v)
    except ValueError:
        raise ConfigError(f"WSC_NUM_CSX={v!r} is not a number of systems: unset it or give a positive integer") \
            from None


@dataclass
class ClusterConfig:
    """Cerebras' cluster description; here `num_csx` is the number of data-parallel systems (by default the
    appliance job's, $WSC_NUM_CSX, else 1)."""

    num_csx: int = field(default_factory=_env_num_csx)
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


# this process's place in a multi-system run, once launched: process-wide, as torch.distributed's process group
# is (a cstorch run context does not scope it; one cluster per script)
_cluster_here: Cluster | None = None


def cluster() -> Cluster | None:
    return _cluster_here


def rank() -> int:
    return _cluster_here.rank if _cluster_here is not None else 0


def world_size() -> int:
    return _cluster_here.world if _cluster_here is not None else 1


def is_master() -> bool:
    return rank() == 0


def script_argv() -> list[str]:
    """How this script was started, for its copies on the other systems (after the interpreter): `FILE ARGS`, or
    `-m MODULE ARGS` when it ran as `python -m MODULE`. Under `torchrun` nothing is started. A ConfigError where
    there is no script to run again: `python -c`, a notebook, an interactive session."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name and spec.name != "__main__":  # python -m MODULE (a package: its __main__)
        return ["-m", spec.name.removesuffix(".__main__"), *sys.argv[1:]]
    if getattr(main, "__file__", None) and sys.argv and os.path.isfile(sys.argv[0]):
        return list(sys.argv)
    raise ConfigError("ClusterConfig(num_csx > 1) runs this script once more per system, and this process has no "
                      "script to run again (python -c, a notebook or an interactive session): put the training in a "
                      "file and run `python FILE` (or `python -m MODULE`), or start the systems with torchrun")


def launch(backend: "Backend") -> None:
    """Join (under torchrun) or start (locally) the N processes of `backend.cluster_config`."""
    global _cluster_here
    n = backend.num_csx
    if _cluster_here is not None:
        if _cluster_here.world != n:
            raise ConfigError(f"this process already runs with num_csx={_cluster_here.world}; one cluster per script")
        return
    threads, argv = None, []
    if not _cluster.under_torchrun():  # the copies of this script share this machine's cores
        argv = script_argv()
        threads = max(1, (os.cpu_count() or 1) // n)
        torch.set_num_threads(threads)
    _cluster_here = _cluster.launch(n, argv, timeout_s=backend.cluster_config.timeout_s, label="system",
                                    advice="the checkpoints already written are complete", threads=threads,
                                    log_dir=backend.artifact_dir, needed_by=f"ClusterConfig(num_csx={n})")
    atexit.register(_shutdown)


def _shutdown() -> None:
    global _cluster_here
    c, _cluster_here = _cluster_here, None
    if c is None:
        return
    if c.failure is None:
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - a system already gone; nothing left to synchronise
            pass
    c.close()


def step_started(step: int) -> None:
    """Each step's start: this system's heartbeat (so a hung one can be named) and the cluster's test hook
    (WSC_SWARMX_FAULT="RANK:STEP:die|hang")."""
    if _cluster_here is not None and _cluster_here.world > 1:
        _cluster_here.beat(step, "start")
        _cluster.fault_hook(_cluster_here.rank, step)


def guard(what: str, fn):  # noqa: ANN001, ANN201 - passes fn's result through
    """Run `fn` (streaming work that also runs the user's code): a failed link collective becomes a
    SwarmXFailure naming its cause; any other error (the user's) passes through as it is."""
    if _cluster_here is None:
        return fn()
    return _cluster_here.guard(what, fn, only=(LinkError,))


def all_mean(values: list[float]) -> list[float]:
    """Element-wise mean over the systems (main thread, default group)."""
    c = _cluster_here
    if c is None or c.world == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64)
    c.guard("averaging the step's results", lambda: dist.all_reduce(t))
    return (t / c.world).tolist()
