"""Prometheus text exposition (format 0.0.4), written by hand: counters, gauges and histograms for the server.

Names follow Prometheus conventions (`wsc_` prefix, base units, `_total` for counters).
"""

from __future__ import annotations

import bisect
import threading
from collections import defaultdict
from typing import Callable

__all__ = ["Metrics", "Histogram"]

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                     5.0, 10.0, 20.0, 40.0, 80.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = LATENCY_BUCKETS_S):
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # last: +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, x: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, x)] += times
        self.sum += x * times
        self.count += times

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.buckets, self.counts):
            acc += c
            out.append(f'{name}_bucket{{le="{b}"}} {acc}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.count}')
        out += [f"{name}_sum {self.sum:.6f}", f"{name}_count {self.count}"]
        return out


class Metrics:
    """Thread-safe counters/histograms; gauges are read at scrape time from `gauges()`."""

    def __init__(self, gauges: Callable[[], dict[str, float]]):
        self._lock = threading.Lock()
        self._gauges = gauges
        self.requests: dict[tuple[str, str], int] = defaultdict(int)  # (endpoint, status) -> count
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.aborted = 0
        self.ttft = Histogram()
        self.itl = Histogram()
        self.e2e = Histogram()
        self.in_flight = 0

    def request_done(self, endpoint: str, status: int) -> None:
        with self._lock:
            self.requests[(endpoint, str(status))] += 1

    def tokens(self, prompt: int = 0, generated: int = 0) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.generation_tokens += generated

    def observe(self, h: Histogram, s: float, times: int = 1) -> None:
        """Record s (seconds) `times` times in one of this object's histograms (ttft, itl, e2e)."""
        with self._lock:
            h.observe(s, times)

    def render(self) -> str:
        g = self._gauges()
        with self._lock:
            lines = ["# HELP wsc_requests_total HTTP requests answered, by endpoint and status code.",
                     "# TYPE wsc_requests_total counter"]
            for (ep, st), c in sorted(self.requests.items()):
                lines.append(f'wsc_requests_total{{endpoint="{ep}",status="{st}"}} {c}')
            for name, help_, val in (
                    ("wsc_prompt_tokens_total", "Prompt tokens processed.", self.prompt_tokens),
                    ("wsc_generation_tokens_total", "Tokens generated.", self.generation_tokens),
                    ("wsc_requests_aborted_total", "Sequences aborted (client disconnect or error).", self.aborted)):
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {val}"]
            for name, help_ in (("wsc_http_requests_in_flight", "HTTP generation requests being answered."),):
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {self.in_flight}"]
            for key, name, help_ in (
                    ("running", "wsc_num_requests_running", "Sequences decoding in the engine."),
                    ("waiting", "wsc_num_requests_waiting", "Sequences queued in the engine (queue depth)."),
                    ("kv_blocks_used", "wsc_kv_blocks_used", "KV-cache blocks in use."),
                    ("kv_blocks_total", "wsc_kv_blocks_total", "KV-cache blocks in the pool.")):
                if key in g:
                    lines += [f"# HELP {name} {help_}", f"# TYPE {name} gauge", f"{name} {g[key]}"]
            for key, name, kind, help_ in (  # the weight bytes decode reads (one stage: the engine's runner)
                    ("decode_weight_bytes", "wsc_decode_weight_bytes_total", "counter",
                     "Weight bytes read by decode steps (a batch reads its weights once for all its tokens)."),
                    ("decode_tokens", "wsc_decode_tokens_total", "counter", "Tokens decoded by those steps."),
                    ("decode_weight_bytes_per_token", "wsc_decode_weight_bytes_per_token", "gauge",
                     "Weight bytes read per decoded token so far (a mixture of experts: its routed experts only)."),
                    ("active_weight_bytes", "wsc_active_weight_bytes", "gauge",
                     "Weight bytes of the parameters one token computes with (a mixture: k routed experts)."),
                    ("total_weight_bytes", "wsc_total_weight_bytes", "gauge", "Weight bytes of all parameters.")):
                if key in g:
                    lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {g[key]}"]
            if g.get("prefix_caching"):  # vLLM's prefix_cache_queries / _hits, in tokens, and their ratio
                q, hit = g["prefix_cache_queries"], g["prefix_cache_hits"]
                for name, kind, help_, val in (
                        ("wsc_prefix_cache_queries_total", "counter",
                         "Prompt tokens looked up in the prefix cache (requests admitted, preempted ones again).", q),
                        ("wsc_prefix_cache_hits_total", "counter", "Of those, tokens found in the cache.", hit),
                        ("wsc_prefix_cache_hit_rate", "gauge", "Prefix cache hits / queries so far.",
                         hit / q if q else 0.0),
                        ("wsc_kv_blocks_cached", "gauge",
                         "KV-cache blocks holding a cached full block (in use or free).", g["kv_blocks_cached"])):
                    lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {val}"]
            if "spec_draft_tokens" in g:  # speculative decoding (vLLM's spec_decode_* counters)
                d, acc = g["spec_draft_tokens"], g["spec_accepted_tokens"]
                for name, kind, help_, val in (
                        ("wsc_spec_decode_num_drafts_total", "counter", "Verification steps with drafted tokens.",
                         g["spec_drafts"]),
                        ("wsc_spec_decode_num_draft_tokens_total", "counter", "Tokens drafted.", d),
                        ("wsc_spec_decode_num_accepted_tokens_total", "counter", "Drafted tokens accepted.", acc),
                        ("wsc_spec_decode_acceptance_rate", "gauge", "Accepted / drafted tokens so far.",
                         acc / d if d else 0.0)):
                    lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {val}"]
            for h, name, help_ in (
                    (self.ttft, "wsc_time_to_first_token_seconds", "Request arrival to first generated token."),
                    (self.itl, "wsc_inter_token_latency_seconds", "Time between consecutive generated tokens."),
                    (self.e2e, "wsc_e2e_request_latency_seconds", "Request arrival to last token.")):
                lines += [f"# HELP {name} {help_}", f"# TYPE {name} histogram", *h.lines(name)]
        return "\n".join(lines) + "\n"
