"""Benchmark: the appliance under load, and its overhead against running the same job directly.

Load: a service with a pool of SYSTEMS systems, USERS users (every other one with a quota of 2 systems), and JOBS
short jobs (a Python script sleeping 0.1-0.5 s, num_csx 1 or 2, priority p1/p2/p3 at random) submitted from one
thread per user as fast as the service takes them. Reported: the time until every job has ended (bounded by
--timeout), jobs per state, the largest quota overshoot (the most systems a user's jobs held at once, over their
quota; target 0, computed from every job's start and end), priority inversions (a job started while a job of higher
priority that fit the free systems and its user's quota was waiting), and scheduling latency p50/p99: from the
moment a job could start (its submission, or the end of the job that freed the systems it got) to its start.

Overhead: `wsc run` of configs/gpt2_tiny_shakespeare.yaml for --steps steps directly, then the same through the
appliance (`wsc submit` + `wsc logs -f`): time to the first training step and total time, and their ratio.

    python bench/appliance_load.py [--jobs 200] [--users 10] [--systems 4] [--steps 20]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from appliance_helpers import ApplianceProc  # noqa: E402


def start_service(tmp: Path, systems: int, users: int) -> ApplianceProc:
    """Users u0..u{users-1}, every other one with a quota of 2 systems."""
    return ApplianceProc(tmp, systems, users={f"u{i}": (["--quota", "2"] if i % 2 == 0 else [])
                                              for i in range(users)}, grace_s=10.0)


def load(a: argparse.Namespace, tmp: Path) -> None:
    sleeper = tmp / "sleeper.py"
    sleeper.write_text("import sys, time\ntime.sleep(float(sys.argv[1]))\n")
    service = start_service(tmp / "load", a.systems, a.users)
    users = [u for u in service.tokens if u != "admin"]
    quotas = {u: (2 if i % 2 == 0 else None) for i, u in enumerate(users)}
    rng = random.Random(0)
    plan = {u: [(rng.choice((1, 1, 2)), rng.choice(("p1", "p2", "p2", "p3")), rng.uniform(0.1, 0.5))
                for _ in range(a.jobs // a.users)] for u in users}

    def user(u: str) -> None:
        c = service.client(u)
        for n, prio, dur in plan[u]:
            c.submit_script(sleeper, [f"{dur:.3f}"], num_csx=n, priority=prio)

    t0 = time.monotonic()
    threads = [threading.Thread(target=user, args=(u,)) for u in users]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    submitted = time.monotonic() - t0
    admin = service.client("admin")
    while time.monotonic() - t0 < a.timeout:
        jobs = admin.jobs(all=True)
        if all(j["state"] in ("SUCCEEDED", "FAILED", "CANCELLED") for j in jobs):
            break
        time.sleep(0.5)
    wall = time.monotonic() - t0
    jobs = admin.jobs(all=True)
    service.stop()
    states: dict[str, int] = {}
    for j in jobs:
        states[j["state"]] = states.get(j["state"], 0) + 1
    ran = [j for j in jobs if j["started_at"] is not None and j["ended_at"] is not None]
    # quota overshoot: the most systems each user held at once, from start/end events
    over = 0
    for u, q in quotas.items():
        ev = sorted([(j["started_at"], j["num_csx"]) for j in ran if j["user"] == u]
                    + [(j["ended_at"], -j["num_csx"]) for j in ran if j["user"] == u], key=lambda e: (e[0], e[1]))
        held = peak = 0
        for _, d in ev:
            held += d
            peak = max(peak, held)
        if q is not None:
            over = max(over, peak - q)
    # priority inversions and latency, replayed from the starts and ends
    ends = sorted(j["ended_at"] for j in ran)
    inversions, lat = 0, []
    for j in ran:
        t = j["started_at"]
        freed = [e for e in ends if e <= t]
        lat.append(t - max([j["submitted_at"]] + freed[-1:]))
        busy = [k for k in ran if k["started_at"] <= t < k["ended_at"] and k is not j]
        free = a.systems - sum(k["num_csx"] for k in busy) - j["num_csx"]
        for k in ran:
            if k["priority"] < j["priority"] and k["submitted_at"] < t < k["started_at"] and k["num_csx"] <= free:
                q = quotas[k["user"]]
                held = sum(x["num_csx"] for x in busy if x["user"] == k["user"])
                if q is None or held + k["num_csx"] <= q:
                    inversions += 1
                    break
    lat.sort()
    print(f"load: {len(jobs)} jobs from {a.users} users on {a.systems} systems (submitted in {submitted:.1f} s), "
          f"all ended in {wall:.1f} s (bound {a.timeout:.0f} s)")
    print(f"  states: {', '.join(f'{k} {v}' for k, v in sorted(states.items()))}")
    print(f"  largest quota overshoot: {over} systems (target 0); priority inversions: {inversions}")
    print(f"  scheduling latency: p50 {statistics.median(lat) * 1e3:.0f} ms, "
          f"p99 {lat[min(len(lat) - 1, int(0.99 * len(lat)))] * 1e3:.0f} ms")


def overhead(a: argparse.Namespace, tmp: Path) -> None:
    params = ROOT / "configs" / "gpt2_tiny_shakespeare.yaml"
    run_flags = ["--mode", "train", "--max_steps", str(a.steps), "--num_csx", "1"]

    def first_step(metrics: Callable[[], Path | None], t0: float, done: threading.Event, out: list[float]) -> None:
        while not done.is_set():  # the first line of metrics.jsonl: the first step has run
            p = metrics()
            if p is not None and p.exists() and p.stat().st_size > 0:
                out.append(time.monotonic() - t0)
                return
            time.sleep(0.01)

    t0, done, first = time.monotonic(), threading.Event(), []
    watch = threading.Thread(target=first_step, args=(lambda: tmp / "direct" / "metrics.jsonl", t0, done, first))
    watch.start()
    subprocess.run([sys.executable, "-m", "waferscale", "run", "--params", str(params), "--model_dir",
                    str(tmp / "direct"), "--no_progress", *run_flags], capture_output=True, check=True)
    direct = (first[0] if first else float("nan")), time.monotonic() - t0
    done.set()
    watch.join()
    service = start_service(tmp / "overhead", 1, 1)
    env = {"WSC_MGMT_ADDRESS": service.address, "WSC_CREDENTIALS_PATH": str(service.tokens["u0"])}
    sub = [sys.executable, "-m", "waferscale", "submit", "--params", str(params), "--id", "overhead", *run_flags]
    follow = [sys.executable, "-m", "waferscale", "logs", "-f", "JOB"]

    def metrics() -> Path | None:
        found = list((service.state / "jobs").glob("*/model_dir/metrics.jsonl"))
        return found[0] if found else None

    # `wsc submit` then `wsc logs -f` until the job ends (the job id comes from the submit's output)
    t0, done, first = time.monotonic(), threading.Event(), []
    watch = threading.Thread(target=first_step, args=(metrics, t0, done, first))
    watch.start()
    jid = subprocess.run(sub, capture_output=True, text=True, env={**os.environ, **env}, check=True).stdout.split()[0]
    follow[-1] = jid
    subprocess.run(follow, capture_output=True, text=True, env={**os.environ, **env}, check=True)
    via = (first[0] if first else float("nan")), time.monotonic() - t0
    done.set()
    watch.join()
    state = service.client("u0").status(jid)["state"]
    service.stop()
    assert state == "SUCCEEDED", state
    print(f"overhead: {a.steps} steps of the demo model, direct `wsc run` vs `wsc submit` + `wsc logs -f`")
    print(f"  {'':<22} {'direct':>8} {'appliance':>10} {'ratio':>6}")
    print(f"  {'first step (s)':<22} {direct[0]:>8.2f} {via[0]:>10.2f} {via[0] / direct[0]:>6.2f}")
    print(f"  {'total (s)':<22} {direct[1]:>8.2f} {via[1]:>10.2f} {via[1] / direct[1]:>6.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--users", type=int, default=10)
    ap.add_argument("--systems", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--timeout", type=float, default=600)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "load").mkdir()
        (Path(tmp) / "overhead").mkdir()
        load(a, Path(tmp))
        overhead(a, Path(tmp))


if __name__ == "__main__":
    main()
