"""Chrome/Perfetto traces of a step (open in ui.perfetto.dev): spans on named lanes (main / prefetch / memoryx)."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any

from waferscale.util.files import atomic_write_text

__all__ = ["Tracer"]


class Tracer:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.t0 = time.perf_counter()
        self._lock = threading.Lock()
        self._tids: dict[str, int] = {}

    def span(self, lane: str, name: str, start: float, end: float, **args: Any) -> None:
        with self._lock:
            tid = self._tids.setdefault(lane, len(self._tids) + 1)
            self.events.append({"name": name, "ph": "X", "pid": 1, "tid": tid, "ts": (start - self.t0) * 1e6,
                                "dur": (end - start) * 1e6, "args": args})

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        meta = [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": lane}}
                for lane, tid in self._tids.items()]
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"traceEvents": meta + self.events, "displayTimeUnit": "ms"}))
        return path
