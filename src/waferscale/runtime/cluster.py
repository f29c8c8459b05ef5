"""The cluster under SwarmX: N processes joined over torch.distributed (gloo), started here or by torchrun.

    launch     the processes of one run: under torchrun (RANK and WORLD_SIZE set) this process joins the ones
               that already exist, on any number of machines; otherwise it is rank 0 and starts ranks
               1..world-1 on this machine with the environment torchrun would give them
    groups     the default group (commands, scatter, step figures, on the main threads) and one group per link
               direction (`g_weights` for broadcasts, `g_grads` for reduces), so collectives on different threads
               stay ordered without locks
    health     each rank's heartbeat (step and phase) on the store; `diagnose` turns a failed collective into one
               `SwarmXFailure` naming the rank that caused it: a process that died (its exit code, when this
               process started it), or the one whose heartbeat fell behind (hung)
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import torch.distributed as dist

from waferscale.errors import ConfigError

__all__ = ["Cluster", "LinkError", "SwarmXFailure", "launch", "fault_hook", "free_port", "FAULT_ENV"]

FAULT_ENV = "WSC_SWARMX_FAULT"
PHASES = ("idle", "start", "scatter", "compute", "done")


class SwarmXFailure(RuntimeError):
    """A system died or stopped answering; the message names it."""


class LinkError(RuntimeError):
    """A collective of a weight link failed (what it was moving, and the transport's error)."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def fault_hook(rank: int, step: int) -> None:
    """The one fault-injection hook for tests: WSC_SWARMX_FAULT="RANK:STEP:die|hang" makes that rank exit with
    code 17, or hang, as that step starts."""
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    r, s, kind = spec.split(":")
    if int(r) == rank and int(s) == step:
        if kind == "die":
            os._exit(17)
        time.sleep(10 ** 6)


class Cluster:
    """This process's place in a run of `world` processes, with the groups the links use."""

    def __init__(self, rank: int, world: int, store: Any, timeout_s: float, procs: dict[int, subprocess.Popen],
                 label: str, advice: str) -> None:
        self.rank, self.world, self.store, self.timeout_s, self.procs = rank, world, store, timeout_s, procs
        self.label = label  # what a rank is called in messages: "system" or "worker"
        self.advice = advice  # what a person does after a failure
        timeout = timedelta(seconds=timeout_s)
        self.g_weights = dist.new_group(backend="gloo", timeout=timeout)
        self.g_grads = dist.new_group(backend="gloo", timeout=timeout)
        self.failure: SwarmXFailure | None = None

    # ---- health ----
    def beat(self, step: int, phase: str) -> None:
        self.store.set(f"hb/{self.rank}", f"{step}:{phase}")

    def _beats(self, ranks: Sequence[int]) -> dict[int, tuple[int, int, str]]:
        beats: dict[int, tuple[int, int, str]] = {}
        for r in ranks:
            try:
                if self.store.check([f"hb/{r}"]):
                    seq, phase = self.store.get(f"hb/{r}").decode().split(":")
                    beats[r] = (int(seq), PHASES.index(phase), phase)
            except Exception:  # noqa: BLE001 - the store may be gone with the failure
                pass
        return beats

    def name(self, r: int) -> str:
        return f"{self.label} {r} (rank {r})"

    def diagnose(self, what: str, err: Exception, *, step: int | None = None) -> SwarmXFailure:
        """The failure of a collective, naming the rank that caused it where this process can tell; stops the
        processes this one started."""
        if self.failure is not None:
            return self.failure
        time.sleep(0.5)  # let a dying process finish dying
        dead = {r: p.poll() for r, p in self.procs.items() if p.poll() is not None}
        others = [r for r in range(self.world) if r != self.rank]
        beats = self._beats(others)
        # the rank that fell behind is the cause; the others stopped waiting for it
        progress = {r: beats.get(r, (-1, 0))[:2] for r in others} if beats else {}
        behind = sorted((v, r) for r, v in progress.items() if v < max(progress.values()))
        if behind:
            r = behind[0][1]
            seq, _, phase = beats.get(r, (0, 0, "never reported"))
            state = f"died (exit code {dead[r]})" if r in dead else "hung"
            who = f"{self.name(r)} {state} (last heartbeat: step {seq}, {phase})"
        elif dead:
            r, code = sorted(dead.items())[0]
            who = f"{self.name(r)} died (exit code {code})"
        elif self.rank == 0 and len(others) == 1:
            seq, _, phase = beats.get(others[0], (0, 0, "never reported"))
            who = f"{self.name(others[0])} stopped answering (last heartbeat: step {seq}, {phase})"
        elif self.rank == 0:
            who = f"{self.label}s {', '.join(map(str, others))} stopped answering"
        else:
            who = "rank 0 (MemoryX) stopped answering"
        self.stop_started()
        when = f"during step {step}, " if step is not None else ""
        self.failure = SwarmXFailure(f"SwarmX: {who} {when}while {what} (timeout {self.timeout_s:.0f} s; "
                             f"{str(err).splitlines()[0][:100]}). The run stopped; {self.advice}")
        return self.failure

    def guard(self, what: str, fn: Any, *, step: int | None = None,
              only: tuple[type[BaseException], ...] = (RuntimeError, OSError)) -> Any:
        """Run `fn`; a failure of one of its collectives (`only`: any RuntimeError for a collective called
        directly, LinkError for work that also runs the user's code) becomes a SwarmXFailure naming the cause."""
        try:
            return fn()
        except SwarmXFailure:
            raise
        except only as e:
            raise self.diagnose(what, e, step=step) from None

    # ---- shutdown ----
    def stop_started(self) -> None:
        """Kill the processes this one started (after a failure)."""
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                pass

    def close(self) -> None:
        """Wait for the processes this one started to exit, then leave the process group. The groups and the
        store are released here, not in interpreter teardown, where destroying their threads can abort."""
        if self.failure is not None:
            self.stop_started()
        else:
            for p in self.procs.values():
                try:
                    p.wait(self.timeout_s)
                except subprocess.TimeoutExpired:
                    p.kill()
        self.g_weights = self.g_grads = self.store = None
        if dist.is_initialized() and self.failure is None:  # (after a failure, link threads may still be inside
            #  a collective: destroying the group under them can abort the process)
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - shutting down after a failure; nothing left to release
                pass


def launch(world: int, argv: list[str], *, timeout_s: float, label: str, advice: str, threads: int | None = None,
           log_dir: Path | None = None, needed_by: str = "this run", what: str = "processes",
           local_rank_base: int = 0) -> Cluster:
    """Join (under torchrun) or start (locally) the `world` processes of a run; see the module docstring.
    `argv` is what ranks >= 1 run after the interpreter; their output goes to `log_dir/swarmx_rank{r}.log`
    (or nowhere). A started rank r gets LOCAL_RANK r - `local_rank_base` (its GPU on a multi-GPU host)."""
    env = os.environ
    procs: dict[int, subprocess.Popen] = {}
    if under_torchrun():
        if int(env["WORLD_SIZE"]) != world:
            raise ConfigError(f"{needed_by} needs {world} {what}, but torchrun started WORLD_SIZE="
                              f"{env['WORLD_SIZE']}; use --nproc_per_node/--nnodes totalling {world}")
        rank = int(env["RANK"])
        url = "env://"
    else:
        rank = 0
        port = free_port()
        url = f"tcp://127.0.0.1:{port}"
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
        for r in range(1, world):
            child_env = {**env, "RANK": str(r), "WORLD_SIZE": str(world), "LOCAL_RANK": str(r - local_rank_base),
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
            if threads:
                child_env["OMP_NUM_THREADS"] = str(threads)
            if log_dir is not None:
                with open(log_dir / f"swarmx_rank{r}.log", "w") as log:
                    procs[r] = subprocess.Popen([sys.executable, *argv], env=child_env, stdout=log, stderr=log)
            else:  # their own messages (why a worker stopped) reach this terminal's stderr
                procs[r] = subprocess.Popen([sys.executable, *argv], env=child_env, stdout=subprocess.DEVNULL)
    try:
        return connect(url, rank, world, timeout_s, procs, label, advice)
    except Exception as e:  # noqa: BLE001 - a process that never arrived
        for p in procs.values():
            p.kill()
        raise SwarmXFailure(f"SwarmX: the {world} {what} did not all connect within {timeout_s:.0f} s "
                            f"({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None


def connect(url: str, rank: int, world: int, timeout_s: float, procs: dict[int, subprocess.Popen] | None = None,
            label: str = "system", advice: str = "the checkpoints already written are complete") -> Cluster:
    """Rendezvous at `url`, the default gloo group and the two link groups."""
    timeout = timedelta(seconds=timeout_s)
    store, rank, world = next(dist.rendezvous(url, rank=rank, world_size=world, timeout=timeout))
    dist.init_process_group("gloo", store=dist.PrefixStore("swarmx", store), rank=rank, world_size=world,
                            timeout=timeout)
    return Cluster(rank, world, store, timeout_s, procs or {}, label, advice)
