"""`wsc appliance start|token`, and the client's commands: submit, jobs, status, logs, cancel, deploy, undeploy."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from waferscale.errors import ConfigError

PRIORITIES = ("p1", "p2", "p3")


def default_state_dir() -> Path:
    return Path(os.environ.get("WSC_APPLIANCE_DIR") or Path.home() / ".local" / "share" / "waferscale" / "appliance")


def _db_url(a: argparse.Namespace) -> str:
    if a.db:
        return a.db
    Path(a.state_dir).mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{Path(a.state_dir).resolve() / 'appliance.db'}"


def cmd_appliance(a: argparse.Namespace) -> int:
    from waferscale.appliance.store import Store

    state = Path(a.state_dir).resolve()
    if a.action == "token":
        store = Store(_db_url(a))
        token = store.create_user(a.user, admin=a.admin, quota=a.quota)
        if a.out:
            _write_token(Path(a.out), token)
            print(f"token for {a.user}{' (admin)' if a.admin else ''} written to {a.out}")
        else:
            print(token)
        return 0
    # start
    import uvicorn

    from waferscale.appliance.launch import LocalLauncher
    from waferscale.appliance.service import Appliance, create_app, hold_state_dir

    if a.systems < 1:
        raise ConfigError(f"--systems must be at least 1, got {a.systems}")
    hold_state_dir(state)
    store = Store(_db_url(a))
    admin_file = state / "admin.token"
    if not admin_file.exists():
        _write_token(admin_file, store.create_user("admin", admin=True))
    if a.backend == "ray":
        from waferscale.appliance.ray_backend import RayLauncher

        launcher = RayLauncher(a.address, a.systems)
    else:
        launcher = LocalLauncher()
    app = create_app(Appliance(state, store, launcher, a.systems, grace_s=a.grace_s))
    print(f"appliance: {a.systems} systems, {a.backend} backend, store {store.url.split('://')[0]}, state {state}; "
          f"admin token in {admin_file}; http://{a.host}:{a.port}/", flush=True)
    uvicorn.run(app, host=a.host, port=a.port, log_level="warning")
    return 0


def _write_token(path: Path, token: str) -> None:
    from waferscale.util.files import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, token + "\n")
    os.chmod(path, 0o600)


def _client(a: argparse.Namespace):
    from waferscale.appliance import Client

    return Client(a.mgmt_address, credentials_path=a.credentials_path)


def _labels(items: list[str]) -> dict[str, str]:
    out = {}
    for it in items:
        k, sep, v = it.partition("=")
        if not sep or not k:
            raise ConfigError(f"--job_labels takes KEY=VALUE pairs, got {it!r}")
        out[k] = v
    return out


def cmd_submit(a: argparse.Namespace) -> int:
    if (a.params is None) == (a.script is None):
        raise ConfigError("give exactly one of --params P.yaml (a `wsc run` job) or --script S.py (a cstorch script)")
    c = _client(a)
    common = dict(priority=a.job_priority, labels=_labels(a.job_labels), client_id=a.id)
    if a.script:
        args = a.script_args[1:] if a.script_args[:1] == ["--"] else a.script_args
        job = c.submit_script(a.script, args, num_csx=a.num_csx or 1, **common)
    else:
        skip = {"params", "mode", "model_dir", "num_csx", "no_progress", "validate_only", "compile_only"}
        flags = {k: getattr(a, k) for k, default in a.run_defaults.items()
                 if k not in skip and getattr(a, k) != default}  # the `wsc run` flags given
        job = c.submit_run(a.params, mode=a.mode, num_csx=a.num_csx or 1, model_dir=a.model_dir, **common,
                           **flags)
    print(f"{job['id']}  {job['state']}  {job['reason']}")
    return 0


def cmd_jobs(a: argparse.Namespace) -> int:
    jobs = _client(a).jobs(all=a.all)
    if a.json:
        print(json.dumps(jobs, indent=1))
        return 0
    print(f"{'ID':<15} {'USER':<10} {'KIND':<7} {'PRIO':<4} {'CSX':>3} {'STATE':<10} REASON")
    for j in jobs:
        print(f"{j['id']:<15} {j['user']:<10} {j['kind']:<7} {j['priority']:<4} {j['num_csx']:>3} "
              f"{j['state']:<10} {j['reason']}")
    return 0


def cmd_status(a: argparse.Namespace) -> int:
    j = _client(a).status(a.job_id)
    if a.json:
        print(json.dumps(j, indent=1))
        return 0
    what = j["spec"].get("params_name") or j["spec"].get("script") or j["spec"].get("model")
    print(f"{j['id']}  {j['kind']} {what}  user {j['user']}  {j['priority']}  num_csx {j['num_csx']}"
          + (f"  labels {','.join(f'{k}={v}' for k, v in j['labels'].items())}" if j["labels"] else ""))
    print(f"state: {j['state']}: {j['reason']}")
    for e in j["events"]:
        print(f"  {time.strftime('%H:%M:%S', time.localtime(e['at']))}  {e['state']:<10} {e['reason']}")
    if j["log_tail"]:
        print("log tail:")
        for line in j["log_tail"][-10:]:
            print(f"  {line}")
    return 0


def cmd_logs(a: argparse.Namespace) -> int:
    for text in _client(a).logs(a.job_id, follow=a.follow):
        sys.stdout.write(text)
        sys.stdout.flush()
    return 0


def cmd_cancel(a: argparse.Namespace) -> int:
    j = _client(a).cancel(a.job_id)
    print(f"{j['id']}  {j['state']}  cancel asked" + ("" if j["state"] in ("QUEUED", "RUNNING") else " (it had ended)"))
    return 0


def cmd_deploy(a: argparse.Namespace) -> int:
    j = _client(a).deploy(a.model, num_csx=a.num_csx, priority=a.job_priority, labels=_labels(a.job_labels))
    print(f"{j['id']}  {j['state']}  {j['reason']}; once running, the model answers at "
          f"{a.mgmt_address or os.environ.get('WSC_MGMT_ADDRESS') or 'the appliance'}/v1 as {a.model!r}")
    return 0


def cmd_undeploy(a: argparse.Namespace) -> int:
    j = _client(a).undeploy(a.model)
    print(f"{j['id']}  {j['state']}  undeploy asked")
    return 0


def _client_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mgmt_address", default=None, help="the appliance (default: $WSC_MGMT_ADDRESS, else "
                                                        "http://127.0.0.1:8300)")
    p.add_argument("--credentials_path", default=None, help="the token file (default: $WSC_CREDENTIALS_PATH, else "
                                                            "~/.config/waferscale/credentials)")


def _job_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--job_priority", default="p2", choices=PRIORITIES, help="p1 runs first (default p2)")
    p.add_argument("--job_labels", nargs="*", default=[], metavar="KEY=VALUE")


def register(sub: Any, run_flags: Callable[..., None]) -> dict[str, Callable[[argparse.Namespace], int]]:
    """Add the appliance's commands to the `wsc` subparsers; `run_flags` adds `wsc run`'s flags."""
    p = sub.add_parser("appliance", help="the job service: start it, or make a user's token",
                       description="the job service: start it, or make a user's token")
    p.set_defaults(fn=cmd_appliance)
    act = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    s = act.add_parser("start", help="run the service (foreground)")
    s.add_argument("--systems", type=int, default=2, help="systems in the pool")
    s.add_argument("--port", type=int, default=8300)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--grace_s", type=float, default=10.0, help="a cancelled job's time to stop before SIGKILL")
    s.add_argument("--backend", default="local", choices=["local", "ray"])
    s.add_argument("--address", default=None, help="--backend ray: the Ray cluster (host:port of its head)")
    t = act.add_parser("token", help="make (or replace) a user's token")
    t.add_argument("verb", choices=["create"])
    t.add_argument("user")
    t.add_argument("--admin", action="store_true", help="sees and acts on every user's jobs")
    t.add_argument("--quota", type=int, default=None, help="most systems the user's jobs hold at once")
    t.add_argument("--out", default=None, help="write the token to this file (mode 600) instead of printing it")
    for q in (s, t):
        q.add_argument("--state_dir", default=str(default_state_dir()),
                       help="jobs' logs and the SQLite store (default: $WSC_APPLIANCE_DIR, else "
                            "~/.local/share/waferscale/appliance)")
        q.add_argument("--db", default=None, help="the store: sqlite:///PATH or postgresql+psycopg://USER@HOST/DB "
                                                  "(default: STATE_DIR/appliance.db)")

    cmds: dict[str, Callable[[argparse.Namespace], int]] = {"appliance": cmd_appliance}
    q = sub.add_parser("submit", help="submit a `wsc run` job (or a cstorch script) to the appliance")
    run_flags(q, params_required=False)
    q.set_defaults(run_defaults={act.dest: act.default for act in q._actions if act.dest != "help"})
    q.add_argument("--script", default=None, help="a cstorch script to run instead of --params")
    q.add_argument("--id", default=None, help="a client id: submitting it again returns the same job")
    q.add_argument("script_args", nargs=argparse.REMAINDER, help="-- then the script's arguments")
    _job_flags(q)
    cmds["submit"] = cmd_submit
    for name, fn, help_ in (("jobs", cmd_jobs, "your queued and running jobs (--all: ended ones too)"),
                            ("status", cmd_status, "a job's state, its reason and history, its log's tail"),
                            ("logs", cmd_logs, "a job's output (-f: follow it until it ends)"),
                            ("cancel", cmd_cancel, "cancel a job (SIGTERM, then SIGKILL after the grace period)"),
                            ("deploy", cmd_deploy, "serve a model through the appliance's /v1 routes"),
                            ("undeploy", cmd_undeploy, "stop serving a model")):
        q = sub.add_parser(name, help=help_, description=help_)
        if name == "jobs":
            q.add_argument("--all", action="store_true")
        if name in ("jobs", "status"):
            q.add_argument("--json", action="store_true")
        if name in ("status", "logs", "cancel"):
            q.add_argument("job_id")
        if name == "logs":
            q.add_argument("-f", "--follow", action="store_true")
        if name in ("deploy", "undeploy"):
            q.add_argument("--model", required=True)
        if name == "deploy":
            q.add_argument("--num_csx", type=int, default=1)
            _job_flags(q)
        cmds[name] = fn
    for name, fn in cmds.items():
        sub.choices[name].set_defaults(fn=fn)
        if name != "appliance":
            _client_flags(sub.choices[name])
    return cmds
