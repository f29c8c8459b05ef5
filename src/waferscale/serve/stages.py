"""Pipelined stages: K worker processes, each running a contiguous slice of the layers over its own KV cache.

Why processes (torch.multiprocessing, spawn) and not threads: each stage needs its own intra-op thread pool
(`torch.set_num_threads(total // K)`), which is process-wide state in PyTorch (OpenMP and MKL), and the
per-layer Python work of one stage must not hold the GIL while another stage runs; separate processes give
both, like a stage on its own region of the wafer (or its own device). The weights are not copied: the model's
tensors are shared with the workers through shared memory; each worker builds its fused/packed projections and
its KV cache for its own layers only.

Wiring: driver -> stage 0 -> stage 1 -> ... -> stage K-1 -> driver, one pipe per hop. Stage 0 gets the batch
spec (token ids, positions, block tables); every later hop carries the spec and the (N, d_model) activations;
the last stage sends back the logits of the rows that sample. Because each pipe is FIFO and every stage handles
messages in order, the driver can keep K micro-batches in flight and collect results in submission order.
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp

from waferscale.models.layers import CausalLM
from waferscale.serve.model_runner import BatchSpec, ModelRunner
from waferscale.serve.quant import QWeight

_STARTUP_TIMEOUT_S = 600.0


def split_layers(model: CausalLM, stages: int) -> list[tuple[int, int]]:
    """Contiguous [lo, hi) layer ranges balancing weight bytes read per token; the LM head counts against
    the last stage (for SmolLM2-135M it weighs as much as ~8 of its 30 layers)."""
    cfg = model.config
    n = cfg.n_layer
    per_layer = float(cfg.params_per_block)
    head = float(cfg.vocab_size * cfg.d_model)
    total = per_layer * n + head
    bounds = [0]
    for s in range(1, stages):
        target = total * s / stages
        lo = bounds[-1] + 1
        hi = n - (stages - s)  # leave at least one layer for every later stage
        best = min(range(lo, hi + 1), key=lambda b: abs(b * per_layer - target))
        bounds.append(best)
    bounds.append(n)
    return [(bounds[i], bounds[i + 1]) for i in range(stages)]


def _pack(t: torch.Tensor) -> tuple[np.ndarray, str, tuple[int, ...]]:
    t = t.detach().contiguous()
    return t.view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape)


def _unpack(msg: tuple[np.ndarray, str, tuple[int, ...]]) -> torch.Tensor:
    raw, dtype, shape = msg
    return torch.from_numpy(raw).view(getattr(torch, dtype)).view(shape)


def _stage_main(rank: int, model: CausalLM, lo: int, hi: int, num_stages: int, kw: dict[str, Any],
                threads: int, conn_in: Any, conn_out: Any) -> None:
    torch.set_num_threads(threads)
    try:
        runner = ModelRunner(model, lo, hi, has_embed=rank == 0, has_head=rank == num_stages - 1, **kw)
        del model
        conn_out.send(("ready", rank, runner.fast_linear))
    except Exception:
        conn_out.send(("error", f"stage {rank} failed to start:\n{traceback.format_exc()}"))
        return
    while True:
        msg = conn_in.recv()
        kind = msg[0]
        if kind in ("ready", "stop", "error"):  # from the previous stage: passed on ("ready" after our own)
            conn_out.send(msg)
            if kind == "stop":
                return
            continue
        spec: BatchSpec = msg[1]
        try:
            x = None if rank == 0 else _unpack(msg[2])
            y = runner.run(spec, x)
            conn_out.send(("run", spec, _pack(y)) if rank < num_stages - 1 else ("logits", _pack(y)))
        except Exception:
            conn_out.send(("error", f"stage {rank} failed:\n{traceback.format_exc()}"))


class PipelineExecutor:
    """Submit batch specs to stage 0; collect logits from the last stage, in submission order."""

    def __init__(self, model: CausalLM, stages: int, *, num_blocks: int, block_size: int,
                 device: torch.device | str = "cpu", fast_linear: bool | None = None,
                 threads_per_stage: int | None = None, decode_threads: int | None = None,
                 qweights: dict[str, QWeight] | None = None, kv_dtype: torch.dtype | None = None) -> None:
        if torch.device(device).type != "cpu":
            raise ValueError("pipelined stages run on CPU worker processes here; use stages=1 on "
                             f"{torch.device(device).type}")
        self.ranges = split_layers(model, stages)
        threads = threads_per_stage or max(1, torch.get_num_threads() // stages)
        ctx = mp.get_context("spawn")
        kw = dict(num_blocks=num_blocks, block_size=block_size, device="cpu", fast_linear=fast_linear,
                  threads=threads, decode_threads=decode_threads, qweights=qweights, kv_dtype=kv_dtype)
        prev, self._send = ctx.Pipe(duplex=False)  # prev: the receiving end of the hop into the next stage
        self._procs = []
        for rank, (lo, hi) in enumerate(self.ranges):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_stage_main, name=f"wsc-stage-{rank}", daemon=True,
                            args=(rank, model, lo, hi, stages, kw, threads, prev, send))
            p.start()
            self._procs.append(p)
            prev = recv
        self._recv = prev
        self._closed = False
        self.fast_linear = False
        # readiness travels down the chain: each stage forwards what it receives, then its own "ready"
        ready = 0
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while ready < stages:
            if not self._recv.poll(0.2):
                dead = [p.name for p in self._procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.close()
                    why = (f"{', '.join(dead)} exited during startup (with the 'spawn' start method the main "
                           "script is re-imported in each worker: guard its top level with "
                           "`if __name__ == \"__main__\":`)") if dead else \
                        f"did not start within {_STARTUP_TIMEOUT_S:.0f} s"
                    raise RuntimeError(f"pipeline stages failed: {why}")
                continue
            msg = self._recv.recv()
            if msg[0] == "error":
                self.close()
                raise RuntimeError(msg[1])
            ready += 1
            self.fast_linear = bool(msg[2])
        # a reader thread drains the last stage, so it never blocks on the driver (no pipe-full deadlock)
        self._results: queue.SimpleQueue = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name="wsc-pipeline-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                msg = self._recv.recv()
            except (EOFError, OSError):
                self._results.put(("error", "pipeline stages exited"))
                return
            if msg[0] == "stop":
                return
            self._results.put(msg)

    def submit(self, spec: BatchSpec) -> None:
        self._send.send(("run", spec))

    def collect(self) -> torch.Tensor:
        msg = self._results.get()
        if msg[0] == "error":
            raise RuntimeError(msg[1])
        return _unpack(msg[1])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._send.send(("stop",))
        except (OSError, BrokenPipeError):
            pass
        for p in self._procs:
            p.join(timeout=10 if p.is_alive() else 0.1)
            if p.is_alive():
                p.terminate()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # interpreter shutdown: nothing left to clean up
            pass
