"""Which queued jobs start now, on which systems, and why the others wait. A pure function of the queue.

The rule, in order:
1. Queued jobs are taken by priority (p1 first), then in submission order (FIFO within a priority).
2. A job whose user would go over their quota (systems held at once) waits for that user's own jobs to end; it
   holds nothing back: the jobs behind it are considered as if it were not there.
3. Otherwise the job starts if its `num_csx` systems are free (gang placement: all of them or none).
4. The first job that does not fit stops the walk: nothing behind it starts, whatever its priority or size,
   until it has started. So a large job is never starved by a stream of small ones (they cannot pass it), at the
   cost of systems left idle while it waits for enough of them; the jobs behind it say whom they wait for.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Decision", "Pending", "schedule"]


@dataclass(frozen=True)
class Pending:
    id: str
    user: str
    num_csx: int
    priority: int  # 1..3
    seq: int  # submission order


@dataclass
class Decision:
    starts: list[tuple[str, list[int]]]  # (job id, the system ids it gets), in start order
    reasons: dict[str, str]  # job id -> why it waits, for every queued job that does not start


def schedule(queued: list[Pending], free: list[int], held: dict[str, int],
             quotas: dict[str, int | None]) -> Decision:
    """`free`: the pool's free system ids; `held`: systems each user's running jobs hold; `quotas`: each user's
    most systems at once (None or absent: no limit but the pool)."""
    free = sorted(free)
    held = dict(held)
    starts: list[tuple[str, list[int]]] = []
    reasons: dict[str, str] = {}
    blocker: Pending | None = None
    ahead = {p: 0 for p in (1, 2, 3)}  # jobs passed so far that still wait, at each priority
    for job in sorted(queued, key=lambda j: (j.priority, j.seq)):
        before = _ahead(ahead, job.priority)
        ahead[job.priority] += 1  # (taken back below if it starts)
        quota = quotas.get(job.user)
        if blocker is not None:
            reasons[job.id] = (f"waiting behind {blocker.id} (p{blocker.priority}, {blocker.user}), which needs "
                               f"{_n(blocker.num_csx)}: no job passes a waiting one ahead of it{before}")
        elif quota is not None and held.get(job.user, 0) + job.num_csx > quota:
            reasons[job.id] = (f"waiting for {job.user}'s quota: {_n(job.num_csx)} asked, "
                               f"{held.get(job.user, 0)} of {quota} in use by their running jobs")
        elif job.num_csx <= len(free):
            got, free = free[:job.num_csx], free[job.num_csx:]
            held[job.user] = held.get(job.user, 0) + job.num_csx
            starts.append((job.id, got))
            ahead[job.priority] -= 1
        else:
            blocker = job
            reasons[job.id] = f"waiting for {_n(job.num_csx)}, {len(free)} free{before}"
    return Decision(starts, reasons)


def _n(k: int) -> str:
    return f"{k} system" + ("s" if k != 1 else "")


def _ahead(ahead: dict[int, int], priority: int) -> str:
    parts = [f"{n} at p{p}" for p, n in ahead.items() if n and p <= priority]
    return "; waiting ahead of it: " + ", ".join(parts) if parts else ""
