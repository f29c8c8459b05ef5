"""The Ray backend of the appliance: `wsc appliance start --backend ray --address HEAD:PORT --systems N`.

The cluster. Every node advertises the systems it hosts as the custom resource "csx" and runs the same
installation of waferscale (same interpreter path) as the service:

    ray start --head --port 6379 --resources '{"csx": 0}'                  # a head that hosts no system
    ray start --address HEAD:6379 --resources '{"csx": 2}'                 # a node with two systems

The service connects as a Ray driver (namespace "waferscale") and refuses to start unless `--systems` equals the
cluster's "csx" total, so the pool it schedules against is the cluster's. The appliance's state directory must be
shared by every node at the same path (NFS or alike): each rank writes the job's log (STATE/jobs/ID/log, appended
by every rank and attempt), its exit record, and the run's checkpoints (the job's model_dir) there.

A job. Its systems are one placement group of `num_csx` bundles {"csx": 1}, strategy PACK: gang placement stays
all-or-nothing (a placement group is placed whole or not at all), and PACK puts the bundles on as few nodes as
it can, which keeps MemoryX's weight and gradient traffic on fewer links, makes fewer nodes the job's points of
failure, and leaves whole nodes free for the next large job; unlike STRICT_PACK it still spans nodes when no one
node has enough systems. The job's actors are detached and named (`wsc-JOB-ATTEMPT-aI`, 0 CPUs), each pinned
to a bundle, and every bundle has one, so a node that leaves takes one of the job's actors with it:
- a `run` with num_csx K > 1 is K + 1 ranks under torch.distributed, as torchrun would start them (RANK,
  WORLD_SIZE, MASTER_ADDR/MASTER_PORT of rank 0's node, LOCAL_RANK), actor I running rank I: rank 0 is MemoryX
  and the training loop and shares bundle 0 with rank 1 (MemoryX is a host role, not a system), rank r >= 1 is
  the worker of bundle r - 1;
- any other job (a run on one system, a cstorch script) is one process, run by the actor of bundle 0 (it starts
  whatever it starts on that node, as it would on one machine); the actors of the other bundles only hold them.
A rank's process gets its node's environment (less what Ray sets for its own workers) plus the job's variables,
runs in a process group of its own (cancel signals that group) and dies with its actor (PR_SET_PDEATHSIG), so an
actor killed or gone with its node leaves no process behind. Rank r writes ATTEMPT_DIR/exit-r.json when its
process ends. A deployment's server listens on its node's address, on a port free there (the handle says which,
for the service's proxy).

Finding an attempt again. The handle names the attempt's placement group and actors, so a service restarted
after a `kill -9` looks them up by name (ray.get_actor) and never starts an attempt twice: a new attempt has a
new name, and an attempt is only given up (lost) after its leftovers are killed and its placement group removed.
`poll`:
- every rank has its exit record: exited, with rank 0's code (the job's outcome: MemoryX runs the loop);
- an actor dead or missing (of a rank yet to end, or a holder): lost. Either its node left the cluster, or the
  service stopped while starting the attempt (an actor missing, or one never told what to do). A job one of
  whose nodes left is reported lost even when rank 0 then ended on its own (the SwarmX failure that node's loss
  caused): the service re-queues it to resume from its last checkpoint, rather than failing it;
- otherwise alive; an actor that does not answer yet counts as alive until Ray says it is dead.
Rank 0 ended and a worker outliving it by WORKER_GRACE_S is killed.

A node that leaves. Ray's GCS health-checks every node and declares it dead after `health_check_failure_threshold`
failed checks, one every `health_check_period_ms`, each failing at once when the node is gone or after
`health_check_timeout_ms` when it hangs; the node's actors die with it. The next `poll` (every tick of the
service) reports its jobs lost. So the bound is threshold x period for a node that is gone (15 s with Ray's
defaults 5 x 3000 ms, after the 5 s initial delay for a node that just joined) and threshold x (period + timeout)
for one that hangs (65 s with the default 10000 ms timeout), plus a tick and POLL_TIMEOUT_S. They are set in the
head node's environment: `RAY_health_check_period_ms=1000 RAY_health_check_failure_threshold=3 ray start --head`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import json
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, GetTimeoutError, RayActorError
from ray.util import get_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from waferscale.appliance.launch import Launcher, Status, job_command
from waferscale.appliance.store import Job
from waferscale.errors import ConfigError
from waferscale.util.files import atomic_write_json

__all__ = ["RayLauncher", "RESOURCE", "NAMESPACE"]

RESOURCE = "csx"  # the custom resource a node advertises its systems as
NAMESPACE = "waferscale"
PLACE_TIMEOUT_S = 20.0  # a placement group not placed by then fails the start (the cluster lost systems;
#   a healthy cluster places one in well under a second, and the service's loop waits while it tries)
POLL_TIMEOUT_S = 2.0  # how long a poll waits for the actors' answers (the service's loop waits with it)
WORKER_GRACE_S = 30.0  # a worker rank still running this long after rank 0 ended is killed
RAY_WORKER_ENV = ("OMP_NUM_THREADS", "PYTHONBREAKPOINT", "SPT_NOENV")  # set by Ray for its workers, not the node's


class RayLauncher(Launcher):
    """Jobs as placement groups and detached actors on the Ray cluster at `address` (see the module docstring)."""

    def __init__(self, address: str | None, systems: int) -> None:
        address = address or os.environ.get("RAY_ADDRESS")
        if not address:
            raise ConfigError("--backend ray needs the Ray cluster: --address HOST:PORT (its head's address) or "
                              "RAY_ADDRESS")
        host, _, port = address.rpartition(":")
        try:  # (ray.init waits for an absent head without end)
            socket.create_connection((host, int(port)), timeout=10).close()
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot reach the Ray cluster's head at {address} ({e}): is `ray start --head` "
                              f"running there?") from None
        ray.init(address=address, namespace=NAMESPACE, logging_level="WARNING", log_to_driver=False)
        total = ray.cluster_resources().get(RESOURCE, 0)
        if total != systems:
            ray.shutdown()
            raise ConfigError(f"the Ray cluster at {address} advertises {total:g} systems (resource {RESOURCE!r}) "
                              f"but --systems is {systems}: give --systems {total:g}, or start each node with "
                              f"`ray start ... --resources '{{\"{RESOURCE}\": N}}'` for its N systems")
        self._actors: dict[str, Any] = {}  # actor name -> handle, looked up once

    def plan(self, job: Job, job_dir: Path, attempt: int) -> dict[str, Any]:
        ranks = job.num_csx + 1 if job.kind == "run" and job.num_csx > 1 else 1
        return {"backend": "ray", "name": f"wsc-{job.id}-{attempt}", "dir": str(job_dir / f"attempt-{attempt}"),
                "ranks": ranks, "actors": max(ranks, job.num_csx), "port": None}

    def start(self, job: Job, job_dir: Path, systems: list[int], handle: dict[str, Any]) -> dict[str, Any] | None:
        Path(handle["dir"]).mkdir(parents=True)
        try:
            return self._start(job, job_dir, systems, handle)
        except BaseException:
            self._release(handle)  # nothing of a failed start is left holding systems
            raise

    def capacity(self) -> int | None:
        return int(ray.cluster_resources().get(RESOURCE, 0))

    def _start(self, job: Job, job_dir: Path, systems: list[int], handle: dict[str, Any]) -> dict[str, Any] | None:
        pg = placement_group([{RESOURCE: 1.0}] * job.num_csx, strategy="PACK", name=handle["name"],
                             lifetime="detached")
        try:
            ray.get(pg.ready(), timeout=PLACE_TIMEOUT_S)
        except GetTimeoutError:
            free = ray.available_resources().get(RESOURCE, 0)
            raise RuntimeError(f"Ray could not place {job.num_csx} systems within {PLACE_TIMEOUT_S:.0f} s ({free:g} "
                               f"of the cluster's {ray.cluster_resources().get(RESOURCE, 0):g} free; did a node "
                               f"leave?)") from None
        n = handle["ranks"]
        actors = [_Rank.options(name=_actor_name(handle, i), namespace=NAMESPACE, lifetime="detached", num_cpus=0,
                                max_restarts=0, scheduling_strategy=PlacementGroupSchedulingStrategy(
                                    pg, placement_group_bundle_index=i if n == 1 else max(0, i - 1))
                                ).remote(handle["dir"], i)
                  for i in range(handle["actors"])]
        nodes = ray.get([a.node.remote() for a in actors])  # (node id, ip, its process) of each actor
        learned = None
        if job.kind == "deploy":  # its server listens on its node, on a port free there, for the service's proxy
            learned = handle | {"host": nodes[0][1], "port": ray.get(actors[0].free_port.remote())}
        port, host = (learned["port"], learned["host"]) if learned else (None, "127.0.0.1")
        cmd = job_command(job, job_dir, systems, port, host)
        argv, cwd, log = cmd["argv"], cmd["cwd"], str(job_dir / "log")
        job_env = {k: v for k, v in cmd["env"].items() if os.environ.get(k) != v}  # what the job adds
        envs = [dict(job_env) for _ in range(n)]
        if n > 1:
            port = ray.get(actors[0].free_port.remote())
            for r, env in enumerate(envs):
                local = sum(1 for q in range(1, r) if nodes[q][0] == nodes[r][0])  # its GPU on a multi-GPU node
                env |= {"RANK": str(r), "WORLD_SIZE": str(n), "MASTER_ADDR": nodes[0][1], "MASTER_PORT": str(port),
                        "LOCAL_RANK": str(local)}
        pids = ray.get([a.run.remote(argv, cwd, env, log) for a, env in zip(actors, envs)])
        ray.get([a.hold.remote() for a in actors[n:]])
        pids += [None] * (len(actors) - n)  # (the holders run nothing)
        atomic_write_json(Path(handle["dir"]) / "actors.json", [  # where each one is, for people and tests
            {"actor": i, "node": node, "ip": ip, "actor_pid": apid, "pid": pid}
            for i, ((node, ip, apid), pid) in enumerate(zip(nodes, pids))])
        return learned

    def poll(self, handle: dict[str, Any]) -> Status:
        d = Path(handle["dir"])
        exits: dict[int, dict[str, Any]] = {}
        for r in range(handle["ranks"]):
            try:
                exits[r] = json.loads((d / f"exit-{r}.json").read_text())
            except (OSError, ValueError):
                pass
        if len(exits) == handle["ranks"]:
            self._release(handle)
            return Status("exited", exits[0]["rc"])
        asks = {}
        for i in range(handle["actors"]):  # (the ranks yet to end, and the holders)
            if i in exits:
                continue
            actor = self._actor(handle, i)
            if actor is None:
                self._release(handle)
                return Status("lost", why=f"its actor {i} is gone (its node left the Ray cluster, or the service "
                                          f"stopped while starting it)")
            asks[i] = actor.state.remote()
        ray.wait(list(asks.values()), num_returns=len(asks), timeout=POLL_TIMEOUT_S)
        for i, ref in asks.items():
            try:
                state = ray.get(ref, timeout=0)
            except (ActorUnavailableError, GetTimeoutError):
                continue  # not answering yet: Ray's health check decides whether its node is gone
            except RayActorError as e:
                self._release(handle)
                return Status("lost", why=f"its actor {i} died ({_first_line(e)}): its node left the Ray cluster")
            if state == "idle":
                self._release(handle)
                return Status("lost", why="the service stopped while starting it")
        if 0 in exits and time.time() - exits[0]["ended"] > WORKER_GRACE_S:
            self.signal(handle, force=True)  # rank 0 is done; a worker that waits on it would wait forever
        return Status("alive")

    def signal(self, handle: dict[str, Any], force: bool) -> None:
        for r in range(handle["ranks"]):
            actor = self._actor(handle, r)
            if actor is not None:
                actor.signal.remote(signal.SIGKILL if force else signal.SIGTERM)  # (not awaited)

    def close(self) -> None:
        ray.shutdown()

    def _actor(self, handle: dict[str, Any], rank: int) -> Any:
        name = _actor_name(handle, rank)
        if name not in self._actors:
            try:
                self._actors[name] = ray.get_actor(name, namespace=NAMESPACE)
            except ValueError:  # never made, or dead and gone
                return None
        return self._actors[name]

    def _release(self, handle: dict[str, Any]) -> None:
        """Kill the attempt's actors (their processes die with them) and free its systems; idempotent."""
        for i in range(handle["actors"]):
            actor = self._actor(handle, i)
            if actor is not None:
                ray.kill(actor)
            self._actors.pop(_actor_name(handle, i), None)
        with contextlib.suppress(ValueError):  # (never made, or already removed)
            remove_placement_group(get_placement_group(handle["name"]))


def _actor_name(handle: dict[str, Any], i: int) -> str:
    return f"{handle['name']}-a{i}"


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:160]


@ray.remote
class _Rank:
    """One bundle's actor of an attempt: starts a rank's process and writes exit-RANK.json when it ends, or only
    holds its bundle. Its methods run on the actor's main thread, so the process's parent-death signal follows
    the actor."""

    def __init__(self, attempt_dir: str, rank: int) -> None:
        self.dir, self.rank = Path(attempt_dir), rank
        self.proc: subprocess.Popen | None = None
        self.done = self.holding = False

    def node(self) -> tuple[str, str, int]:
        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def free_port(self) -> int:
        with socket.socket() as s:
            s.bind((ray.util.get_node_ip_address(), 0))
            return s.getsockname()[1]

    def run(self, argv: list[str], cwd: str, env: dict[str, str], log: str) -> int:
        base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_") and k not in RAY_WORKER_ENV}
        with open(log, "ab", buffering=0) as out:
            try:
                self.proc = subprocess.Popen(argv, cwd=cwd, env=base | env, stdin=subprocess.DEVNULL, stdout=out,
                                             stderr=out, process_group=0,
                                             preexec_fn=functools.partial(_die_with, os.getpid()))
            except OSError as e:
                out.write(f"appliance: rank {self.rank}: cannot start {argv[0]}: {e}\n".encode())
                self._ended(127)
                return -1
        threading.Thread(target=lambda: self._ended(self.proc.wait()), daemon=True).start()
        return self.proc.pid

    def _ended(self, rc: int) -> None:
        atomic_write_json(self.dir / f"exit-{self.rank}.json", {"rc": rc, "ended": time.time()})
        self.done = True

    def hold(self) -> None:
        self.holding = True

    def state(self) -> str:
        if self.done:
            return "exited"
        return "running" if self.proc is not None else "holding" if self.holding else "idle"

    def signal(self, sig: int) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


def _die_with(parent: int) -> None:  # in the rank's process, before exec: SIGKILL when its actor's process ends
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the actor died before the signal was armed
        os._exit(1)
