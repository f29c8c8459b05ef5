"""Benchmark: MemoryX's optimizer throughput (parameters updated per second) against torch's fused CPU AdamW
called directly on the same parameters. MemoryX runs Cerebras' AdamW (`runtime.optimizers`: eps before the bias
correction), a sequence of torch element-wise operations; the peer is torch's own formula in one fused kernel.

    peer    torch.optim.AdamW(fused=True) over the model's parameters (decay / no-decay groups), `.step()` timed
    ours    MemoryX: the per-unit optimizers (Cerebras' AdamW), as a training step runs them (`MemoryX._update` per unit, on its
            worker lane; timed from the first update submitted to the last finished). Gradient write-back
            (copying gradients into MemoryX) is timed separately and printed, not counted as optimizer time.

Same parameter values, same gradients, same process, same thread count; runs alternate and medians are reported.

    python bench/optimizer_memoryx.py [--model gpt-mini] [--layers 8] [--hidden 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from waferscale.params import OptimizerParams
from waferscale.models import from_name
from waferscale.runtime.memoryx import MemoryX
from waferscale.runtime.optim import param_groups


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt-mini")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--steps", type=int, default=5, help="optimizer steps per timed repeat")
    a = ap.parse_args()
    opt = OptimizerParams(optimizer_type="AdamW", learning_rate=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    torch.manual_seed(0)
    model = from_name(a.model, d_model=a.hidden, n_layer=a.layers, n_head=a.heads, device="cpu")
    n = model.num_params()
    grads = [torch.randn_like(p) * 1e-3 for p in model.parameters()]

    mx = MemoryX(model, opt)
    # (build_optimizer gives Cerebras' AdamW, which MemoryX steps: the peer is torch's, same hyper-parameters)
    peer_opt = torch.optim.AdamW(param_groups(model.parameters(), opt.weight_decay), lr=opt.learning_rate,
                                 betas=opt.betas, eps=opt.eps, fused=True)
    for p, g in zip(model.parameters(), grads):
        p.grad = g
    # MemoryX gets the same gradients in its own layout (payload order of each unit)
    by_name = dict(zip([k for k, _ in model.named_parameters()], grads))
    every = {e.global_index for lay in mx.layouts for e in lay.owned}  # (every parameter has a gradient)
    unit_grads = []
    for lay in mx.layouts:
        big = torch.cat([by_name[e.name].reshape(-1) for e in lay.entries if e.matrix] or [torch.empty(0)])
        small = torch.cat([by_name[e.name].reshape(-1) for e in lay.entries if not e.matrix] or [torch.empty(0)])
        unit_grads.append((big, small))

    def run_peer() -> float:
        t = time.perf_counter()
        for _ in range(a.steps):
            peer_opt.step()
        return n * a.steps / (time.perf_counter() - t)

    def run_ours() -> tuple[float, float]:
        wb = 0.0
        opt_s = 0.0
        for _ in range(a.steps):
            mx.begin_step(1e-4)
            t = time.perf_counter()
            for u in range(mx.n_units - 1, -1, -1):  # write-back only (the eager update is timed below)
                mx.push_grads(u, *unit_grads[u])
            for f in mx._grad_futs:
                f.result()
            wb += time.perf_counter() - t
            t = time.perf_counter()
            futs = [mx._lane.submit(mx._update, u, 1e-4, 1.0, 1.0, every) for u in range(mx.n_units)]
            for f in futs:
                f.result()
            opt_s += time.perf_counter() - t
            mx._grad_futs = []
        return n * a.steps / opt_s, n * a.steps / wb

    mx.policy = "write-back only"  # push_grads copies gradients; updates are submitted by this benchmark
    run_peer(), run_ours()  # warm-up (lazy optimizer state)
    peers, ours, wbs = [], [], []
    for _ in range(a.repeats):
        peers.append(run_peer())
        o, w = run_ours()
        ours.append(o)
        wbs.append(w)
    p, o, w = statistics.median(peers), statistics.median(ours), statistics.median(wbs)
    print(f"model {a.model}: {n / 1e6:.2f}M parameters in {mx.n_units} units, AdamW, {torch.get_num_threads()} threads")
    print(f"torch fused AdamW, called directly : {p / 1e6:10.1f} M params/s")
    print(f"MemoryX optimizer (per unit, lane) : {o / 1e6:10.1f} M params/s")
    print(f"ratio MemoryX / torch fused        : {o / p:10.3f}   (target >= 1.0)")
    print(f"(gradient write-back into MemoryX, not counted above: {w / 1e6:.1f} M params/s)")
    mx.close()


if __name__ == "__main__":
    main()
