"""The engine in its own process (vLLM's EngineCore): the API server's Python never shares a GIL with it.

`wsc serve` runs two processes. The API process (FastAPI, uvicorn, SSE formatting, tokenizing chat templates)
holds `CoreClient`, which has AsyncEngine's interface (`start`, `stop`, `stats`, `generate`, `check_request`,
`max_model_len`). The core process builds the `Engine` and loops: take the commands that arrived (add / abort /
stop), run one `Engine.step()`, send that step's outputs back in one message with the engine's stats.

Why: the engine releases the GIL inside its C kernels, but every return from one needs the GIL back, and while
the API thread formats 16 SSE chunks per step it holds it for milliseconds; in one process the engine (and
the kernel pool's other core) waits. Apart, the engine thread only ever competes with the API for CPU.

Wiring: one duplex pipe. Parent -> child: ("add", id, prompt ids, SamplingParams), ("abort", id), ("stop",).
Child -> parent: ("ready", info) once, then ("out", [EngineOutput], stats) per step, ("reject", id, message,
too_long) for a request the engine refused, ("error", message) when the engine cannot start. A core that
dies fails every open stream with a clear error; the core exits when its parent's end of the pipe closes.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import gc
import multiprocessing as mp
import threading
import time
import traceback
from typing import Any

from waferscale.serve.engine import EngineDead, RequestTooLong, SamplingParams, StreamHub, check_request

__all__ = ["CoreClient", "CoreError"]

_STARTUP_TIMEOUT_S = 900.0


class CoreError(RuntimeError):
    """The engine process could not start (its message says why)."""


def _core_main(conn: Any, model: Any, engine_kw: dict[str, Any]) -> None:
    """The core process: build the engine, then step it while there is work."""
    try:
        from waferscale.serve.engine import Engine

        engine = Engine.from_pretrained(model, **engine_kw)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it there
        from waferscale.errors import UserError

        conn.send(("error", str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}",
                   isinstance(e, UserError)))
        return
    gc.collect()
    gc.freeze()  # the model's and the kernels' objects are never garbage: keep them out of every collection
    # this process is the engine's: its torch ops run on one thread, set once here (the C kernels have their own
    # pool; the step's scoped settings then change nothing)
    import torch

    torch.set_num_threads(1)
    conn.send(("ready", engine.describe()))
    try:
        while True:
            busy = engine.has_unfinished()
            while conn.poll(0 if busy else 0.1):
                cmd = conn.recv()
                if cmd[0] == "add":
                    _, rid, prompt, params = cmd
                    try:
                        engine.add_request(rid, prompt, params)
                    except ValueError as e:
                        conn.send(("reject", rid, str(e), isinstance(e, RequestTooLong)))
                elif cmd[0] == "abort":
                    engine.abort_request(cmd[1])
                else:  # stop
                    return
                busy = True
            if not engine.has_unfinished():
                continue
            try:
                outs = engine.step()
            except Exception as e:  # noqa: BLE001 - a broken step fails every live request; the loop keeps serving
                traceback.print_exc()
                conn.send(("failed", engine.abort_all(), f"engine step failed: {e!r}", engine.stats()))
                continue
            conn.send(("out", outs, engine.stats()))
    except (EOFError, BrokenPipeError, ConnectionResetError, KeyboardInterrupt):
        pass  # the parent is gone
    finally:
        engine.close()


class CoreClient:
    """AsyncEngine's interface over an engine in its own process (see the module docstring).

    model / engine_kw: as `Engine.from_pretrained(model, **engine_kw)`. Construction starts the process and
    waits until the engine is built (raises CoreError with the engine's own message if it cannot be).
    """

    def __init__(self, model: Any, engine_kw: dict[str, Any] | None = None) -> None:
        ctx = mp.get_context("spawn")
        self._lock = threading.Lock()  # one sender at a time on the pipe
        self._closed = False
        self._conn, child = ctx.Pipe(duplex=True)
        self._proc = ctx.Process(target=_core_main, args=(child, model, dict(engine_kw or {})),
                                 name="wsc-engine-core")
        self._proc.start()
        child.close()
        # (before multiprocessing's own exit handler, which would wait for this process to end by itself)
        atexit.register(self.close)
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while not self._conn.poll(0.2):
            if not self._proc.is_alive():
                self.close()
                raise CoreError(f"the engine process exited (code {self._proc.exitcode}) while loading {model!r}")
            if time.monotonic() > deadline:
                self.close()
                raise CoreError(f"the engine process did not load {model!r} in {_STARTUP_TIMEOUT_S:.0f} s")
        try:
            msg = self._conn.recv()
        except EOFError:
            self._proc.join(timeout=30)
            self.close()
            raise CoreError(f"the engine process exited (code {self._proc.exitcode}) while loading {model!r}") \
                from None
        if msg[0] == "error":
            self.close()
            if msg[2]:
                from waferscale.errors import ConfigError

                raise ConfigError(msg[1])
            raise CoreError(f"the engine could not start: {msg[1]}")
        self.info: dict[str, Any] = msg[1]
        self.max_model_len: int = self.info["max_model_len"]
        self._stats: dict[str, Any] = dict(self.info["stats"])
        self._hub = StreamHub()
        self._reader: threading.Thread | None = None
        self._dead: str | None = None

    # ---- AsyncEngine's interface --------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        check_request(prompt_token_ids, params, **self.info["limits"])

    def stats(self) -> dict:
        return dict(self._stats)

    def unhealthy(self) -> str | None:
        """Why the engine cannot serve (its process stopped), or None."""
        if self._dead is None and self._reader is not None and not self._proc.is_alive():
            self._reader.join(timeout=5)  # (it is about to notice)
        return self._dead

    async def start(self) -> None:
        if self._reader is None:
            self._reader = threading.Thread(target=self._read, name="wsc-core-reader", daemon=True)
            self._reader.start()

    async def stop(self) -> None:
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Stop the core process (waits up to 30 s, then kills it). Idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        try:
            self._send(("stop",))
        except (OSError, ValueError):
            pass
        self._proc.join(timeout=30)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=10)
        self._conn.close()

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams) -> Any:
        """Yield this request's EngineOutputs as the core produces them; the last has finished=True."""
        self.check_request(prompt_token_ids, params)
        if self._dead is not None:
            raise EngineDead(self._dead)
        await self.start()

        def abort() -> None:
            if self._dead is None:
                self._send(("abort", request_id))

        async with contextlib.aclosing(self._hub.stream(
                request_id, lambda: self._send(("add", request_id, list(prompt_token_ids), params)),
                abort)) as items:
            async for item in items:
                yield item

    # ---- plumbing -----------------------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        with self._lock:
            self._conn.send(msg)

    def _read(self) -> None:
        try:
            while True:
                msg = self._conn.recv()
                kind = msg[0]
                if kind == "out":
                    _, outs, self._stats = msg
                    self._hub.deliver([(o.request_id, o, o.finished) for o in outs])
                elif kind == "reject":
                    _, rid, text, too_long = msg
                    self._hub.deliver([(rid, RequestTooLong(text) if too_long else ValueError(text), True)])
                elif kind == "failed":
                    _, ids, text, self._stats = msg
                    self._hub.deliver([(rid, RuntimeError(text), True) for rid in ids])
        except (EOFError, OSError):
            pass
        code = self._proc.exitcode if not self._proc.is_alive() else None
        self._dead = "the engine process stopped" + (f" (exit code {code})" if code not in (None, 0) else "")
        self._hub.deliver([(rid, EngineDead(self._dead), True) for rid in self._hub.open_ids()])
