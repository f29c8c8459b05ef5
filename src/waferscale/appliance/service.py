"""The appliance service: `wsc appliance start`. A FastAPI app over the store, and one loop that moves jobs.

The loop (every `tick_s`), under one lock:
1. each running job: ended? -> SUCCEEDED / FAILED (exit reason and the log's last line) / CANCELLED; its
   processes lost (the service was killed, then they died too)? -> queued again in its old place, to resume from
   its last checkpoint (at most MAX_ATTEMPTS attempts); a cancel asked for -> SIGTERM, SIGKILL after `grace_s`;
2. queued jobs asked to cancel -> CANCELLED;
3. the scheduler (scheduler.py) starts what fits and gives every waiting job its reason.
A job is marked RUNNING, with the handle of its attempt, before its processes start, and the attempt's lock
(launch.py) proves whether they live: after a `kill -9` of the service, the next start re-attaches to the jobs
that live, re-queues the ones that do not, and never runs an attempt twice. One service per state directory
(it holds STATE/service.lock).

HTTP: the job API under /api (bearer tokens, store.py; a user sees and acts on their own jobs, an admin on all),
the OpenAI routes of the deployments under /v1 (by the request's `model`), and the dashboard page at /.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import threading
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field

from waferscale.appliance.launch import Launcher, new_key
from waferscale.appliance.scheduler import Pending, schedule
from waferscale.appliance.store import ACTIVE, TERMINAL, Job, Store, User
from waferscale.errors import ConfigError, UserError
from waferscale.serve.openai.app import bearer_token, install_error_handlers
from waferscale.util.files import atomic_write_text
from waferscale.serve.openai.protocol import APIError

__all__ = ["Appliance", "create_app"]

MAX_ATTEMPTS = 3  # a job whose processes are lost this many times is FAILED
PAGE = Path(__file__).resolve().parent / "page"
KINDS = ("run", "script", "deploy")


class Appliance:
    """The pool, the store and the launcher, and the loop that moves jobs between them."""

    def __init__(self, state_dir: Path, store: Store, launcher: Launcher, systems: int, *, grace_s: float = 10.0,
                 tick_s: float = 0.25) -> None:
        self.state_dir, self.store, self.launcher, self.systems = Path(state_dir), store, launcher, systems
        self.grace_s, self.tick_s = grace_s, tick_s
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.started_at = time.time()

    def job_dir(self, jid: str) -> Path:
        return self.state_dir / "jobs" / jid

    # ---- the loop --------------------------------------------------------------------------------------------
    def start(self) -> None:
        self.tick()  # re-attach or re-queue what a previous service left running, before serving anything
        threading.Thread(target=_warm_validator, daemon=True).start()
        self._thread = threading.Thread(target=self._run, name="appliance-loop", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.launcher.close()

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            try:
                self.tick()
            except Exception as e:  # a database hiccup: say so, and try again next tick
                print(f"appliance: loop error: {type(e).__name__}: {e}", flush=True)

    def tick(self) -> None:
        with self._lock:
            for job in self.store.jobs(states=["RUNNING"]):
                self._watch(job)
            for job in self.store.jobs(states=["QUEUED"]):
                if job.cancel_at is not None:
                    self.store.transition(job.id, ["QUEUED"], "CANCELLED", "cancelled while queued",
                                          ended_at=time.time())
            self._schedule()

    def _watch(self, job: Job) -> None:
        st = self.launcher.poll(job.handle) if job.handle else None
        if st is None or st.state == "lost":
            why = st.why if st else "it was being started when the service stopped"
            if job.cancel_at is not None:
                self._end(job, "CANCELLED", f"cancelled; {why}", None)
            elif job.attempts >= MAX_ATTEMPTS:
                self._end(job, "FAILED", f"its processes were lost {job.attempts} times; the last time {why}", None)
            else:
                self.store.transition(job.id, ["RUNNING"], "QUEUED", f"re-queued in its place: {why}; it resumes "
                                      f"from its last checkpoint (attempt {job.attempts + 1})", systems=None)
            return
        if st.state == "exited":
            if job.cancel_at is not None:
                self._end(job, "CANCELLED", f"cancelled ({_exit_words(st.rc)})", st.rc)
            elif st.rc == 0:
                self._end(job, "SUCCEEDED", "exited with code 0", 0)
            else:
                last = log_tail(self.job_dir(job.id), 1)
                self._end(job, "FAILED", _exit_words(st.rc) + (f": {last[0]}" if last else ""), st.rc)
            return
        if job.cancel_at is not None:  # alive, and asked to stop
            self.launcher.signal(job.handle, force=time.time() - job.cancel_at > self.grace_s)

    def _end(self, job: Job, state: str, reason: str, rc: int | None) -> None:
        self.store.transition(job.id, ["RUNNING"], state, reason, exit_code=rc, ended_at=time.time(), systems=None)

    def _schedule(self) -> None:
        running = self.store.jobs(states=["RUNNING"])
        used = {s for j in running for s in (j.systems or [])}
        held: dict[str, int] = {}
        for j in running:
            held[j.user] = held.get(j.user, 0) + j.num_csx
        queued = {j.id: j for j in self.store.jobs(states=["QUEUED"]) if j.cancel_at is None}
        free = [s for s in range(self.systems) if s not in used]
        gone = self.systems - min(self.systems, self.launcher.capacity() or self.systems)
        free = free[:max(0, len(free) - gone)]  # (systems of a node that left are not there to give)
        d = schedule([Pending(j.id, j.user, j.num_csx, j.priority, j.seq) for j in queued.values()], free, held,
                     self.store.quotas())
        for jid, systems in d.starts:
            self._launch(queued[jid], systems)
        for jid, reason in d.reasons.items():
            if queued[jid].reason != reason and not queued[jid].reason.startswith("re-queued"):
                self.store.update(jid, reason=reason)

    def _launch(self, job: Job, systems: list[int]) -> None:
        attempt = job.attempts + 1
        handle = self.launcher.plan(job, self.job_dir(job.id), attempt)
        if not self.store.transition(job.id, ["QUEUED"], "RUNNING", f"running on systems {_ids(systems)}"
                                     + (f" (attempt {attempt})" if attempt > 1 else ""), systems=systems,
                                     handle=handle, attempts=attempt, started_at=time.time()):
            return
        if attempt > 1:
            with open(self.job_dir(job.id) / "log", "ab") as f:
                f.write(f"appliance: attempt {attempt}, resuming from the last checkpoint\n".encode())
        try:
            learned = self.launcher.start(job, self.job_dir(job.id), systems, handle)
            if learned is not None:
                self.store.update(job.id, handle=learned)
        except Exception as e:
            self._end(job, "FAILED", f"could not start: {type(e).__name__}: {e}", None)

    # ---- the API's operations ----------------------------------------------------------------------------------
    def submit(self, user: User, req: SubmitRequest) -> tuple[Job, bool]:
        if req.num_csx > self.systems:
            raise APIError(400, f"num_csx {req.num_csx} is more than the pool's {self.systems} systems; ask for "
                                f"at most {self.systems}", param="num_csx", code="pool_too_small")
        if user.quota is not None and req.num_csx > user.quota:  # (it would wait for ever)
            raise APIError(400, f"num_csx {req.num_csx} is more than your quota of {user.quota} system"
                                f"{'s' if user.quota != 1 else ''} at once; ask for at most {user.quota}, or ask an "
                                f"admin for a larger quota", param="num_csx", code="over_quota")
        spec = dict(req.spec)
        if req.kind == "run":
            _check_run(spec, req.num_csx)
        elif req.kind == "script":
            if not Path(spec.get("script", "")).is_file():
                raise APIError(400, f"script {spec.get('script')!r}: no such file", param="spec.script")
        elif req.kind == "deploy":
            if not spec.get("model"):
                raise APIError(400, "a deployment needs a model", param="spec.model")
            mine = (user.name, req.client_id) if req.client_id is not None else None  # (a resubmission is no clash)
            active = [j for j in self.store.jobs(states=ACTIVE) if j.kind == "deploy"
                      and j.spec["model"] == spec["model"] and (j.user, j.client_id) != mine]
            if active:
                raise APIError(409, f"model {spec['model']!r} is already deployed (job {active[0].id}); "
                                    f"undeploy it first", param="spec.model", code="already_deployed")
            spec["key"] = new_key()
        with self._lock:  # (the loop schedules under it too: a job is launched only once its files are written)
            job, new = self.store.submit(user=user.name, kind=req.kind, spec=spec, num_csx=req.num_csx,
                                         priority=int(req.priority[1]), labels=req.labels, client_id=req.client_id)
            if new:
                self.job_dir(job.id).mkdir(parents=True, exist_ok=True)
                if req.kind == "run":
                    atomic_write_text(self.job_dir(job.id) / "params.yaml", spec["params_yaml"])
                self._schedule()
        if new:
            job = self.store.job(job.id) or job
        return job, new

    def visible(self, user: User, jid: str) -> Job:
        job = self.store.job(jid)
        if job is None:
            raise APIError(404, f"no job {jid!r}", param="id", code="job_not_found")
        if job.user != user.name and not user.admin:
            raise APIError(403, f"job {jid} belongs to another user", type="permission_error",
                           code="not_your_job")
        return job

    def pool(self) -> dict[str, Any]:
        running = self.store.jobs(states=["RUNNING"])
        owner = {s: j.id for j in running for s in (j.systems or [])}
        gone = self.systems - min(self.systems, self.launcher.capacity() or self.systems)
        return {"systems": self.systems, "free": max(0, self.systems - len(owner) - gone), "gone": gone,
                "used": {str(s): owner[s] for s in sorted(owner)},
                "queued": len(self.store.jobs(states=["QUEUED"])), "running": len(running)}


class SubmitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    kind: str = Field(pattern="^(run|script|deploy)$")
    spec: dict[str, Any]
    num_csx: int = Field(default=1, ge=1)
    priority: str = Field(default="p2", pattern="^p[123]$")
    labels: dict[str, str] = Field(default_factory=dict)
    client_id: str | None = Field(default=None, max_length=128)


def _check_run(spec: dict[str, Any], num_csx: int) -> None:
    """A run's params and flags get every check `wsc run` makes before it starts (zoo.runner.prepare_run);
    a failure is refused with the validator's message, and nothing is queued."""
    from waferscale.zoo.runner import prepare_run

    if not isinstance(spec.get("params_yaml"), str) or not spec.get("params_name"):
        raise APIError(400, "a run needs params_yaml (the file's text) and params_name", param="spec.params_yaml")
    flags = dict(spec.get("flags") or {}) | {"num_csx": num_csx, "mode": spec.get("mode", "train")}
    try:  # (no file is read: the params' data paths are checked when the run reads them, in the submitter's cwd)
        prepare_run(spec["params_name"], flags, text=spec["params_yaml"])
    except UserError as e:
        raise APIError(400, str(e), param="spec.params_yaml", code="invalid_params") from None
    except TypeError as e:
        raise APIError(400, f"invalid run flags: {e}", param="spec.flags", code="invalid_params") from None


def _warm_validator() -> None:
    """Import what `_check_run` needs (torch, the zoo) now, not in the first user's submit."""
    import waferscale.zoo.runner  # noqa: F401


def log_tail(job_dir: Path, lines: int) -> list[str]:
    try:
        with open(job_dir / "log", "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return []
    return [ln for ln in text.replace("\r", "\n").splitlines() if ln.strip()][-lines:]


def _exit_words(rc: int | None) -> str:
    if rc is None:
        return "exit unknown"
    if rc < 0:
        import signal as _signal

        try:
            name = _signal.Signals(-rc).name
        except ValueError:
            name = f"signal {-rc}"
        return f"killed by {name}"
    return f"exited with code {rc}"


def _ids(systems: list[int]) -> str:
    return ", ".join(map(str, systems))


def create_app(app_: Appliance) -> FastAPI:
    """The HTTP face of `app_` (its loop starts and stops with the app)."""

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        app_.start()
        async with httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0)) as client:
            state["proxy"] = client
            try:
                yield
            finally:
                app_.stop()

    state: dict[str, Any] = {}
    app = FastAPI(title="waferscale appliance", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)

    def who(request: Request) -> User:
        token = bearer_token(request)
        if not token:
            raise APIError(401, "no token: pass 'Authorization: Bearer TOKEN' (`wsc appliance token create USER` "
                                "makes one)", code="missing_token")
        user = app_.store.user_for_token(token)
        if user is None:
            raise APIError(401, "unknown token: it is wrong, or was replaced by a newer one", code="invalid_token")
        return user

    @app.post("/api/jobs")
    async def submit(req: SubmitRequest, request: Request) -> JSONResponse:
        user = who(request)
        job, new = await asyncio.to_thread(app_.submit, user, req)
        return JSONResponse(job.public(), status_code=201 if new else 200)

    @app.get("/api/jobs")
    async def jobs(request: Request, all: bool = False) -> dict[str, Any]:
        user = who(request)
        states = None if all else ACTIVE
        mine = app_.store.jobs(user=None if user.admin else user.name, states=states)
        return {"object": "list", "data": [j.public() for j in mine]}

    @app.get("/api/jobs/{jid}")
    async def job(jid: str, request: Request) -> dict[str, Any]:
        j = app_.visible(who(request), jid)
        return j.public() | {"events": app_.store.events(jid), "log_tail": log_tail(app_.job_dir(jid), 20)}

    @app.get("/api/jobs/{jid}/logs")
    async def logs(jid: str, request: Request, offset: int = 0, limit: int = 1 << 20) -> dict[str, Any]:
        j = app_.visible(who(request), jid)
        data = b""
        try:
            with open(app_.job_dir(jid) / "log", "rb") as f:
                f.seek(offset)
                data = f.read(max(0, min(limit, 1 << 22)))
        except OSError:
            pass
        return {"data": data.decode("utf-8", "replace"), "offset": offset + len(data), "state": j.state,
                "done": j.state not in ACTIVE}

    @app.get("/api/jobs/{jid}/metrics")
    async def metrics(jid: str, request: Request) -> dict[str, Any]:
        j = app_.visible(who(request), jid)
        path = Path(j.spec.get("model_dir") or app_.job_dir(jid) / "model_dir") / "metrics.jsonl"
        text = path.read_text() if path.is_file() else ""  # (no file: the run has not logged a step yet)
        lines = text.splitlines()
        if lines and not text.endswith("\n"):
            lines.pop()  # the line being written
        return {"object": "list", "data": [json.loads(line) for line in lines if line.strip()]}

    @app.post("/api/jobs/{jid}/cancel")
    async def cancel(jid: str, request: Request) -> dict[str, Any]:
        j = app_.visible(who(request), jid)
        app_.store.request_cancel(j.id)
        return (app_.store.job(jid) or j).public()

    @app.get("/api/pool")
    async def pool(request: Request) -> dict[str, Any]:
        who(request)
        return app_.pool()

    @app.get("/api/whoami")
    async def whoami(request: Request) -> dict[str, Any]:
        u = who(request)
        return {"user": u.name, "admin": u.admin, "quota": u.quota}

    # ---- deployments: OpenAI routes by model name -------------------------------------------------------------
    def deployed(states: tuple[str, ...] = ("RUNNING",)) -> list[tuple[Job, str, set[str]]]:
        """Deployments in `states` (running, by default), each with the id its server answers to and the other
        names it takes."""
        from waferscale.runtime.source import served_id

        return [(j, *served_id(j.spec["model"])) for j in app_.store.jobs(states=states) if j.kind == "deploy"]

    def deployments_of(model: str | None, states: tuple[str, ...]) -> list[Job]:
        """Deployments in `states` that answer to `model` (by id or another name), in submission order."""
        return [j for j, mid, aliases in deployed(states) if model == mid or model in aliases]

    def deployment(model: str | None) -> Job:
        """The running deployment serving `model`. Else 503 while one is queued to start (first, or again after
        its processes were lost: clients retry), or 404 naming what is deployed and how the last deployment of
        `model` ended, if one did."""
        running = deployments_of(model, ("RUNNING",))
        if running:
            return running[0]
        queued = deployments_of(model, ("QUEUED",))
        if queued:
            raise APIError(503, f"the model {model!r} is queued to start ({queued[0].reason or 'waiting for a system'}"
                                "); retry shortly", type="server_error", code="model_starting")
        names = ", ".join(repr(mid) for _, mid, _ in deployed()) or "none"
        ended = deployments_of(model, TERMINAL)
        last = f"; its last deployment, {ended[-1].id}, ended {ended[-1].state}: {ended[-1].reason}" if ended else ""
        raise APIError(404, f"the model {model!r} is not deployed here (deployed: {names}{last}); "
                            f"`wsc deploy --model {model}` deploys it", param="model", code="model_not_found")

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        who(request)
        return {"object": "list", "data": [{"id": mid, "object": "model", "owned_by": j.user,
                                            "created": int(j.started_at or 0)} for j, mid, _ in deployed()]}

    @app.post("/v1/{route:path}")
    async def proxy(route: str, request: Request) -> Response:
        who(request)
        body = await request.body()
        try:
            model = json.loads(body).get("model")
        except (ValueError, AttributeError):
            raise APIError(400, "the request body is not a JSON object") from None
        dep = deployment(model)
        url = f"http://{dep.handle.get('host') or '127.0.0.1'}:{dep.handle['port']}/v1/{route}"
        headers = {"authorization": f"Bearer {dep.spec['key']}", "content-type": "application/json"}
        client: httpx.AsyncClient = state["proxy"]
        try:
            upstream = await client.send(client.build_request("POST", url, content=body, headers=headers),
                                         stream=True)
        except httpx.TransportError:
            raise APIError(503, f"the model {model!r} is starting (or its server stopped); retry shortly",
                           type="server_error", code="model_starting") from None

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()

        keep = {k: v for k, v in upstream.headers.items() if k.lower() in ("content-type", "cache-control")}
        return StreamingResponse(relay(), status_code=upstream.status_code, headers=keep)

    # ---- the page ----------------------------------------------------------------------------------------------
    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return FileResponse(PAGE / "index.html", media_type="text/html; charset=utf-8")

    page_files = {"app.js": "text/javascript; charset=utf-8", "style.css": "text/css; charset=utf-8"}

    @app.get("/page/{name}", include_in_schema=False)
    async def page_file(name: str) -> Response:  # (no token: the files are the same for everyone)
        if name not in page_files:
            raise APIError(404, f"no page file {name!r}", code="not_found")
        return FileResponse(PAGE / name, media_type=page_files[name])

    return app


def hold_state_dir(state_dir: Path) -> int:
    """Take STATE/service.lock (one service per state directory). Returns its fd, held for the process's life."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / "service.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"another appliance service is running on {state_dir}; stop it, or give another "
                          f"--state_dir") from None
    return fd

