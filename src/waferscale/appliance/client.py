"""The appliance's client, for the CLI and for notebooks:

    from waferscale.appliance import Client
    c = Client()                                   # $WSC_MGMT_ADDRESS, token from $WSC_CREDENTIALS_PATH
    job = c.submit_run("configs/gpt2_tiny_shakespeare.yaml", mode="train", num_csx=2, priority="p1")
    c.status(job["id"])["reason"]; c.metrics(job["id"]); c.cancel(job["id"])
    for text in c.logs(job["id"], follow=True): print(text, end="")

The service is found at `mgmt_address` (default $WSC_MGMT_ADDRESS, else http://127.0.0.1:8300), the token is
read from `credentials_path` (default $WSC_CREDENTIALS_PATH, else ~/.config/waferscale/credentials) unless
given. A refusal raises ApplianceError with the service's message and status.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from waferscale.errors import UserError

__all__ = ["ApplianceError", "Client", "DEFAULT_ADDRESS", "default_credentials_path"]

DEFAULT_ADDRESS = "http://127.0.0.1:8300"


class ApplianceError(UserError):
    """The service refused a request (`status`: the HTTP status), or cannot be reached (status 0)."""

    def __init__(self, message: str, status: int = 0, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code = status, code


def default_credentials_path() -> Path:
    return Path(os.environ.get("WSC_CREDENTIALS_PATH") or Path.home() / ".config" / "waferscale" / "credentials")


class Client:
    def __init__(self, mgmt_address: str | None = None, token: str | None = None,
                 credentials_path: str | os.PathLike | None = None, timeout_s: float = 30.0) -> None:
        self.address = (mgmt_address or os.environ.get("WSC_MGMT_ADDRESS") or DEFAULT_ADDRESS).rstrip("/")
        if "://" not in self.address:
            self.address = "http://" + self.address
        if token is None:
            path = Path(credentials_path) if credentials_path else default_credentials_path()
            try:
                token = path.read_text().strip()
            except OSError as e:
                raise ApplianceError(f"cannot read the token file {path} ({e.strerror}): give --credentials_path, "
                                     f"or set WSC_CREDENTIALS_PATH (`wsc appliance token create USER --out FILE` "
                                     f"writes one)") from None
        self._http = httpx.Client(base_url=self.address, timeout=timeout_s,
                                  headers={"authorization": f"Bearer {token}"})

    # ---- jobs --------------------------------------------------------------------------------------------------
    def submit_run(self, params: str | os.PathLike, *, mode: str = "train", num_csx: int = 1,
                   priority: str = "p2", labels: dict[str, str] | None = None, client_id: str | None = None,
                   model_dir: str | None = None, **flags: Any) -> dict[str, Any]:
        """Submit `wsc run --params PARAMS --mode MODE --num_csx N` (more `wsc run` flags as keywords)."""
        path = Path(params)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ApplianceError(f"{path}: cannot read the params file ({e.strerror})") from None
        spec = {"params_yaml": text, "params_name": str(path), "mode": mode, "cwd": os.getcwd(),
                "flags": flags, "model_dir": str(Path(model_dir).resolve()) if model_dir else None}
        return self.submit("run", spec, num_csx=num_csx, priority=priority, labels=labels, client_id=client_id)

    def submit_script(self, script: str | os.PathLike, args: list[str] | None = None, *, num_csx: int = 1,
                      priority: str = "p2", labels: dict[str, str] | None = None,
                      client_id: str | None = None) -> dict[str, Any]:
        """Submit a cstorch script (`python SCRIPT ARGS`; it finds its systems in $WSC_NUM_CSX)."""
        spec = {"script": str(Path(script).resolve()), "args": list(args or []), "cwd": os.getcwd()}
        return self.submit("script", spec, num_csx=num_csx, priority=priority, labels=labels, client_id=client_id)

    def deploy(self, model: str, *, num_csx: int = 1, priority: str = "p2", args: list[str] | None = None,
               labels: dict[str, str] | None = None) -> dict[str, Any]:
        """Serve `model` (what `wsc serve --model` takes: a zoo name, a HF directory or a .gguf file) until
        undeployed, at the appliance's /v1 routes, by the id `GET /v1/models` lists (a path's last component)."""
        if Path(model).expanduser().exists():
            model = str(Path(model).expanduser().resolve())
        spec = {"model": model, "args": list(args or []), "cwd": os.getcwd()}
        return self.submit("deploy", spec, num_csx=num_csx, priority=priority, labels=labels)

    def undeploy(self, model: str) -> dict[str, Any]:
        full = str(Path(model).expanduser().resolve()) if Path(model).expanduser().exists() else model
        for j in self.jobs():
            if j["kind"] == "deploy" and j["spec"]["model"] in (model, full):
                return self.cancel(j["id"])
        raise ApplianceError(f"no deployment of {model!r} of yours is queued or running", 404)

    def submit(self, kind: str, spec: dict[str, Any], *, num_csx: int = 1, priority: str = "p2",
               labels: dict[str, str] | None = None, client_id: str | None = None) -> dict[str, Any]:
        body = {"kind": kind, "spec": spec, "num_csx": num_csx, "priority": priority, "labels": labels or {},
                "client_id": client_id}
        return self._call("POST", "/api/jobs", json=body)

    def jobs(self, all: bool = False) -> list[dict[str, Any]]:
        return self._call("GET", "/api/jobs", params={"all": all})["data"]

    def status(self, job_id: str) -> dict[str, Any]:
        return self._call("GET", f"/api/jobs/{job_id}")

    def cancel(self, job_id: str) -> dict[str, Any]:
        return self._call("POST", f"/api/jobs/{job_id}/cancel")

    def metrics(self, job_id: str) -> list[dict[str, Any]]:
        """The run's metrics.jsonl rows so far (step, loss, ...): plot them while it runs."""
        return self._call("GET", f"/api/jobs/{job_id}/metrics")["data"]

    def pool(self) -> dict[str, Any]:
        return self._call("GET", "/api/pool")

    def wait(self, job_id: str, timeout_s: float | None = None, poll_s: float = 0.25) -> dict[str, Any]:
        """The job once it has ended (SUCCEEDED, FAILED or CANCELLED)."""
        end = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            j = self.status(job_id)
            if j["state"] not in ("QUEUED", "RUNNING"):
                return j
            if end is not None and time.monotonic() > end:
                raise TimeoutError(f"job {job_id} is still {j['state']} after {timeout_s} s: {j['reason']}")
            time.sleep(poll_s)

    def logs(self, job_id: str, follow: bool = False, poll_s: float = 0.25,
             reconnect_s: float = 600.0) -> Iterator[str]:
        """The job's output from its start; with `follow`, until it ends, riding out lost connections and
        service restarts for up to `reconnect_s` at a time (it goes on from where it was)."""
        offset, down_since = 0, None
        while True:
            try:
                r = self._call("GET", f"/api/jobs/{job_id}/logs", params={"offset": offset})
            except ApplianceError as e:
                if e.status != 0 or not follow:
                    raise
                down_since = down_since or time.monotonic()
                if time.monotonic() - down_since > reconnect_s:
                    raise
                time.sleep(poll_s)
                continue
            down_since = None
            if r["data"]:
                yield r["data"]
            offset = r["offset"]
            if not follow or (r["done"] and not r["data"]):
                return
            if not r["data"]:
                time.sleep(poll_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _call(self, method: str, path: str, **kw: Any) -> Any:
        try:
            r = self._http.request(method, path, **kw)
        except httpx.TransportError as e:
            raise ApplianceError(f"cannot reach the appliance at {self.address} ({type(e).__name__}): is it "
                                 f"running? (`wsc appliance start`; --mgmt_address or WSC_MGMT_ADDRESS)") from None
        if r.status_code >= 400:
            try:
                err = r.json()["error"]
                raise ApplianceError(err["message"], r.status_code, err.get("code"))
            except (ValueError, KeyError, TypeError):
                raise ApplianceError(f"{method} {path}: HTTP {r.status_code}: {r.text[:200]}",
                                     r.status_code) from None
        return r.json()
