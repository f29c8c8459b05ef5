"""Launching a job's processes and finding them again: what a job runs (`job_command`) and the local backend.

A job's directory (STATE/jobs/ID) holds its `log` (every attempt's output, appended) and one directory per
attempt (`attempt-N`: the lock, launch.json, pgid.json, exit.json; shim.py says what each is). The handle the
store keeps for a running job names its attempt directory, so a restarted service finds the processes again.

Backends share one protocol (`Launcher`); `LocalLauncher` runs each attempt as a process group on this machine
under shim.py, and `ray_backend.RayLauncher` places it on a Ray cluster.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, NamedTuple

from waferscale.appliance.shim import LOCK_FD
from waferscale.appliance.store import Job
from waferscale.util.files import atomic_write_json

__all__ = ["Launcher", "LocalLauncher", "Status", "job_command"]


class Status(NamedTuple):
    state: str  # "alive" | "exited" | "lost"
    rc: int | None = None  # exited: the exit code, or minus the signal that ended it
    why: str = ""  # lost: what is known


def job_command(job: Job, job_dir: Path, systems: list[int], port: int | None = None,
                host: str = "127.0.0.1") -> dict[str, Any]:
    """argv, cwd and env of a job's main process (`launch.json`, mode 0o600). Runs resume from the latest checkpoint in
    their model_dir (the job's own, STATE/jobs/ID/model_dir, unless the submitter named one), so a restarted
    attempt picks up where the last checkpoint left it."""
    s = job.spec
    py = [sys.executable, "-m", "waferscale"]
    if job.kind == "run":
        argv = py + ["run", "--params", str(job_dir / "params.yaml"), "--mode", s["mode"],
                     "--num_csx", str(job.num_csx), "--model_dir", s.get("model_dir") or str(job_dir / "model_dir")
                     ] + [a for k, v in (s.get("flags") or {}).items() if v is not None
                                         for a in (f"--{k}", str(v))]
    elif job.kind == "script":
        argv = [sys.executable, s["script"]] + list(s.get("args", []))
    elif job.kind == "deploy":
        argv = py + ["serve", "--model", s["model"], "--host", host, "--port", str(port)] + list(s.get("args", []))
    else:
        raise ValueError(f"unknown job kind {job.kind!r}")
    env = dict(os.environ) | dict(s.get("env", {})) | {
        "PYTHONUNBUFFERED": "1", "TQDM_MININTERVAL": "2",  # (a run's progress bar goes to the log every 2 s)
        "WSC_APPLIANCE_JOB": job.id, "WSC_APPLIANCE_SYSTEMS": ",".join(map(str, systems)),
        "WSC_NUM_CSX": str(job.num_csx)}  # (cstorch's ClusterConfig() takes its num_csx from it)
    if job.kind == "deploy":  # the deployment's key by environment, never in argv (`ps` shows argv to everyone)
        env["WSC_API_KEY"] = s["key"]
    return {"argv": argv, "cwd": s.get("cwd") or str(job_dir), "env": env}


class Launcher(ABC):
    """Starts an attempt of a job, tells whether it lives, signals it. An attempt's handle is made (`plan`) and
    stored before its processes start (`start`), so that a service stopped between the two finds out."""

    @abstractmethod
    def plan(self, job: Job, job_dir: Path, attempt: int) -> dict[str, Any]:
        """The handle (JSON) of the job's attempt number `attempt`: where its processes will be found."""

    @abstractmethod
    def start(self, job: Job, job_dir: Path, systems: list[int], handle: dict[str, Any]) -> dict[str, Any] | None:
        """Start the attempt `handle` names on `systems`; returns the handle with what only the start could learn
        (a deployment's host and port), or None when it is as planned."""

    @abstractmethod
    def poll(self, handle: dict[str, Any]) -> Status:
        """Whether the attempt lives; how it ended if not."""

    @abstractmethod
    def signal(self, handle: dict[str, Any], force: bool) -> None:
        """SIGTERM the attempt's processes (SIGKILL with `force`); nothing if they are gone."""

    def capacity(self) -> int | None:
        """Systems the backend has now, when that can fall below the pool's size (a Ray node left); None: all."""
        return None

    def close(self) -> None:
        """Let go of the backend (the jobs go on)."""


class LocalLauncher(Launcher):
    """Jobs as process groups on this machine, each kept by a shim (shim.py) in a session of its own."""

    def __init__(self) -> None:
        self._children: list[subprocess.Popen] = []  # shims this service started (reaped as they end)

    def plan(self, job: Job, job_dir: Path, attempt: int) -> dict[str, Any]:
        return {"backend": "local", "dir": str(job_dir / f"attempt-{attempt}"),
                "port": free_port() if job.kind == "deploy" else None}

    def start(self, job: Job, job_dir: Path, systems: list[int], handle: dict[str, Any]) -> None:
        d = Path(handle["dir"])
        d.mkdir(parents=True)  # (a fresh attempt: nobody holds its lock)
        # (its env holds the service's environment and a deployment's key: readable by this user only)
        atomic_write_json(d / "launch.json", job_command(job, job_dir, systems, handle["port"]), mode=0o600)
        fd = os.open(d / "lock", os.O_RDWR | os.O_CREAT, 0o600)

        def lock_at_fd3() -> None:  # in the shim, before exec: the lock's open file at LOCK_FD
            if fd == LOCK_FD:
                os.set_inheritable(fd, True)
            else:
                os.dup2(fd, LOCK_FD)

        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with open(d / "shim.err", "ab") as err:
                self._children.append(subprocess.Popen(
                    [sys.executable, "-m", "waferscale.appliance.shim", str(d)], stdin=subprocess.DEVNULL,
                    stdout=err, stderr=err, start_new_session=True, pass_fds=(LOCK_FD,), preexec_fn=lock_at_fd3))
        finally:
            os.close(fd)  # the shim holds the lock now (the same open file, through its fd LOCK_FD)
        self._children = [c for c in self._children if c.poll() is None]

    def poll(self, handle: dict[str, Any]) -> Status:
        d = Path(handle["dir"])
        if _locked(d / "lock"):
            return Status("alive")
        try:
            return Status("exited", json.loads((d / "exit.json").read_text())["rc"])
        except (OSError, ValueError, KeyError):
            return Status("lost", why="its processes ended without a word (killed with their keeper)")

    def signal(self, handle: dict[str, Any], force: bool) -> None:
        record = Path(handle["dir"]) / "pgid.json"
        if not record.is_file():
            return  # not started yet: the next call finds it
        with contextlib.suppress(ProcessLookupError):  # (already gone)
            os.killpg(json.loads(record.read_text())["pgid"], signal.SIGKILL if force else signal.SIGTERM)


def _locked(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def new_key() -> str:
    return secrets.token_urlsafe(24)
