"""The keeper of one job attempt's processes: `python -m waferscale.appliance.shim ATTEMPT_DIR`.

The service starts it in a session of its own (so it outlives the service: a `kill -9` of the service leaves the
job running) with the attempt's lock already taken (ATTEMPT_DIR/lock, flock; the open file is inherited through
fd LOCK_FD and passed on to the job's process). The lock is held while the shim or the job lives, and only then:
that is how a restarted service tells a live job from a lost one, and why an attempt can never start twice.

It runs `launch.json`'s argv in its own process group (the service signals that group to cancel; the shim stays
to record how it ended), output appended to the job's log (ATTEMPT_DIR/../log), and writes ATTEMPT_DIR/exit.json
({"rc": code, or minus the signal}) when it ends. It ignores SIGTERM/SIGINT/SIGHUP: those are for the job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from waferscale.util.files import atomic_write_json

LOCK_FD = 3  # the lock's file descriptor in the shim (launch.py dups it there)


def main(job_dir: str) -> int:
    d = Path(job_dir)
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    spec = json.loads((d / "launch.json").read_text())
    with open(d.parent / "log", "ab", buffering=0) as log:  # (the job's log: every attempt's output)
        try:
            p = subprocess.Popen(spec["argv"], cwd=spec["cwd"], env=spec["env"], stdin=subprocess.DEVNULL,
                                 stdout=log, stderr=log, pass_fds=(LOCK_FD,), process_group=0,
                                 preexec_fn=_default_signals)
        except OSError as e:
            log.write(f"appliance: cannot start {spec['argv'][0]}: {e}\n".encode())
            atomic_write_json(d / "exit.json", {"rc": 127, "ended": time.time()})
            return 0
        atomic_write_json(d / "pgid.json", {"pgid": p.pid, "shim": os.getpid()})
        rc = p.wait()
    atomic_write_json(d / "exit.json", {"rc": rc, "ended": time.time()})
    return 0


def _default_signals() -> None:  # the job gets the signals the shim ignores
    for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_DFL)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1]))
