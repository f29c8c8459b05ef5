"""The appliance as its tests (and bench/appliance_load.py) run it: `wsc appliance start` in a subprocess on a
free port with its own state directory, users' tokens made by `wsc appliance token create`, and waits."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from serve_helpers import free_port
from waferscale.appliance import ApplianceError, Client

SRC = str(Path(__file__).resolve().parents[1] / "src")


def wsc_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a `wsc` subprocess that runs this checkout's package."""
    return {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": SRC, **(extra or {})}


class ApplianceProc:
    """`wsc appliance start --systems N [EXTRA]` in a subprocess (its output in TMP/service.log). `users` maps
    each user to the extra flags of their `token create` (e.g. ["--quota", "1"]); `tokens` has their token files
    and the admin's."""

    def __init__(self, tmp: Path, systems: int = 2, users: Mapping[str, Sequence[str]] | None = None,
                 extra: Sequence[str] = (), env: Mapping[str, str] | None = None, grace_s: float = 2.0,
                 db: str | None = None) -> None:
        self.tmp, self.systems, self.grace_s = tmp, systems, grace_s
        self.state = tmp / "state"
        self.db = ["--db", db] if db else []
        self.extra, self.env = list(extra), wsc_env(env)
        self.port = free_port()
        self.address = f"http://127.0.0.1:{self.port}"
        self.tokens: dict[str, Path] = {}
        for user, flags in (users or {"bob": []}).items():
            self.tokens[user] = tmp / f"{user}.token"
            r = subprocess.run([sys.executable, "-m", "waferscale", "appliance", "token", "create", user,
                                "--state_dir", str(self.state), "--out", str(self.tokens[user]), *self.db, *flags],
                               capture_output=True, text=True, env=self.env, timeout=120)
            assert r.returncode == 0, r.stderr
        self.tokens["admin"] = self.state / "admin.token"
        self.start()

    def command(self) -> list[str]:
        return [sys.executable, "-m", "waferscale", "appliance", "start", "--systems", str(self.systems), "--port",
                str(self.port), "--state_dir", str(self.state), "--grace_s", str(self.grace_s), *self.db,
                *self.extra]

    def start(self, timeout: float = 90) -> None:
        self.log = open(self.tmp / "service.log", "ab")
        self.proc = subprocess.Popen(self.command(), stdout=self.log, stderr=self.log, env=self.env)
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, (self.tmp / "service.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the appliance did not start"
            try:
                self.client("admin").pool()
                return
            except (ApplianceError, OSError):
                time.sleep(0.2)

    def client(self, user: str) -> Client:
        return Client(self.address, credentials_path=self.tokens[user])

    def cli(self, user: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        """`wsc ARGS` as `user` (the address and token from the environment, as a user would set them)."""
        env = wsc_env({"WSC_MGMT_ADDRESS": self.address, "WSC_CREDENTIALS_PATH": str(self.tokens[user])})
        return subprocess.run([sys.executable, "-m", "waferscale", *args], capture_output=True, text=True, env=env,
                              timeout=timeout)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.log.close()

    def stop(self) -> None:
        """Stop the service, then every local job process it started (nothing a test started outlives it)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
        self.log.close()
        for attempt in (self.state / "jobs").glob("*/attempt-*"):
            try:
                os.killpg(json.loads((attempt / "pgid.json").read_text())["pgid"], signal.SIGKILL)
            except (OSError, ValueError):
                pass

    def job_pids(self, jid: str) -> dict[str, int]:
        """The local backend's record of the job's latest attempt: its process group and its keeper's pid."""
        attempts = sorted((self.state / "jobs" / jid).glob("attempt-*"))
        return json.loads((attempts[-1] / "pgid.json").read_text())


def wait_for(cond: Callable[[], Any], what: str, timeout: float = 60) -> Any:
    """cond()'s first truthy value, polled every 0.1 s."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def wait_state(c: Client, jid: str, states: tuple[str, ...], timeout: float = 60) -> dict[str, Any]:
    return wait_for(lambda: (j := c.status(jid))["state"] in states and j, f"{jid} to be in {states}", timeout)


def wait_file(p: Path, timeout: float = 60) -> None:
    wait_for(p.exists, f"{p}", timeout)
