"""The one memory answer for training: what a training step keeps on the wafer and whether it fits one wafer's
SRAM. `wsc compile --mode train` decides by it (resident training when it fits, weight streaming when not) and
`wsc estimate` prints it, so the two never disagree.

Resident training keeps, per unit (layer): its weights and gradients (fp16/bf16 with mixed precision, else
fp32), the Adam optimizer state (fp32 master weights with mixed precision, and the two fp32 moments:
`strategy.ADAM_STATE_BYTES_PER_PARAM`), and the activations it keeps for backward at the configured batch: in a
1F1B layer pipeline stage i holds the sequences between its forward and its backward, min(stages - i, sequences
per system). A tied embedding matrix is held by both units that use it (the embedding and the LM head). The
capacity is the usable PEs' SRAM less each PE's program reserve (`strategy.data_bytes_per_pe`, an assumption).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from waferscale.compiler.ir import Graph, Unit
from waferscale.compiler.seq2seq import per_sequence
from waferscale.compiler.strategy import ADAM_STATE_BYTES_PER_PARAM, data_bytes_per_pe, gb
from waferscale.errors import ConfigError
from waferscale.fabric.spec import FabricSpec

__all__ = ["TrainingWorkload", "TrainingMemory", "training_workload", "training_memory"]


@dataclass(frozen=True)
class TrainingWorkload:
    """A training step's shape: `batch_size` sequences of `seq_len` tokens over `systems` systems (the batch
    defaults to the weight-streaming no-stall minimum, `batch_defaulted`), and the units as they compute it."""

    seq_len: int
    batch_size: int
    batch_defaulted: bool
    systems: int
    units: list[Unit]
    tok: Callable[[Unit], int]  # tokens a unit computes per sequence
    actx: Callable[[Unit], int]  # keys each of its queries attends to
    seq_tok: int  # tokens per sequence (an encoder-decoder: encoder + decoder tokens)
    t_min: int  # the no-stall minimum tokens per system per micro-batch (WSE.md)
    rule: str
    peak_flops: float  # one wafer's, over its usable PEs

    @property
    def per_system(self) -> int:
        return self.batch_size // self.systems


def training_workload(g: Graph, spec: FabricSpec, usable_pes: int, systems: int, batch_size: int | None,
                      seq_len: int | None) -> TrainingWorkload:
    """The step's sequence length (default: the graph's, else its context) and batch (default: the graph's, else
    the weight-streaming no-stall minimum T >= (b/3) F / BW per system, WSE.md). ConfigError on a bad request."""
    seq = seq_len or int(g.defaults.get("seq_len") or g.max_seq_len)
    if seq > g.max_seq_len:
        raise ConfigError(f"--seq_len {seq} exceeds {g.name}'s maximum sequence length {g.max_seq_len}")
    units, tok, actx, seq_tok = per_sequence(g, seq, g.defaults.get("target_len"))
    F = usable_pes * (spec.fp16_flops_per_cycle_per_pe if g.dtype != "fp32" else spec.fp32_flops_per_cycle_per_pe) \
        * spec.clock_hz
    t_min = math.ceil((g.dtype_bytes / 3) * F / spec.io_bytes_per_s)  # WSE.md: T >= (b/3) F / BW
    rule = "T >= (b/3)F/BW"
    if g.moe:  # an expert's weights serve only the k/E of the tokens routed to it: E/k times the tokens to hide them
        u = next(x for x in units if x.expert_of)
        t_min = math.ceil(u.n_experts / u.experts_per_token * t_min)
        rule = f"T >= ({u.n_experts}/{u.experts_per_token})(b/3)F/BW"
    if batch_size is None and g.defaults.get("batch_size"):
        batch_size = int(g.defaults["batch_size"])
    defaulted = batch_size is None
    if batch_size is None:
        batch_size = systems * max(1, math.ceil(t_min / seq_tok))
    if batch_size % systems:
        raise ConfigError(f"--batch_size {batch_size} is not divisible by --systems {systems}; the global batch "
                          f"is split evenly across systems")
    return TrainingWorkload(seq, batch_size, defaulted, systems, units, tok, actx, seq_tok, t_min, rule, F)


@dataclass(frozen=True)
class TrainingMemory:
    """Bytes a resident training step keeps on one wafer (module docstring), against its SRAM for data."""

    workload: TrainingWorkload
    mixed: bool
    params: int  # parameters held on the wafer (a tied matrix counted in both units that hold it)
    weights: int
    gradients: int
    optimizer_state: int  # master weights (mixed precision) + Adam's two moments
    activations: int  # kept for backward by the 1F1B pipeline at the configured batch
    sram: int  # one wafer's usable PEs x their data bytes
    per_unit: tuple[int, ...]  # each unit's share of the total (the resident pipeline sizes its regions by them)

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer_state + self.activations

    @property
    def fits(self) -> bool:
        return self.total <= self.sram

    @property
    def bytes_per_param(self) -> int:
        return sum(ADAM_STATE_BYTES_PER_PARAM["mixed" if self.mixed else "fp32"])

    def summary(self) -> dict[str, int | bool | str]:
        """The figures a training plan carries (`plan.json`'s "memory")."""
        return {"weights_bytes": self.weights, "gradients_bytes": self.gradients,
                "optimizer_state_bytes": self.optimizer_state, "activations_bytes": self.activations,
                "total_bytes": self.total, "sram_bytes": self.sram, "fits_in_sram": self.fits, "why": self.why()}

    def why(self) -> str:
        """One sentence: each part, the total against SRAM, and the verdict."""
        w = self.workload
        parts = (f"weights {gb(self.weights)} + gradients {gb(self.gradients)} + optimizer state "
                 f"{gb(self.optimizer_state)} ({self.bytes_per_param} B/param in all) + activations kept for "
                 f"backward {gb(self.activations)} ({w.per_system} sequences of {w.seq_len} per system in a 1F1B "
                 f"layer pipeline) = {gb(self.total)}")
        if self.fits:
            return f"{parts} <= {gb(self.sram)} of SRAM: fits, trained resident (no streaming)"
        return (f"{parts} > {gb(self.sram)} of SRAM: does not fit, so weights live in MemoryX and stream in one "
                f"layer at a time")


def training_memory(g: Graph, spec: FabricSpec, usable_pes: int, systems: int = 1, batch_size: int | None = None,
                    seq_len: int | None = None, mixed: bool | None = None) -> TrainingMemory:
    """The memory answer for training graph `g` on wafers of `spec` with `usable_pes` each (module docstring);
    `mixed`: mixed precision (default: as the graph's dtype)."""
    w = training_workload(g, spec, usable_pes, systems, batch_size, seq_len)
    mixed = g.dtype != "fp32" if mixed is None else mixed
    half, grad, master, m1, m2 = ADAM_STATE_BYTES_PER_PARAM["mixed" if mixed else "fp32"]
    act_bytes = g.dtype_bytes if mixed else 4
    n_units, state = len(w.units), half + grad + master + m1 + m2
    held = [u.params + u.tied_params for u in w.units]
    acts = [u.train_act_elems_per_token * act_bytes * w.tok(u) * min(n_units - i, w.per_system)
            * (u.token_share if u.expert_of else 1) for i, u in enumerate(w.units)]  # an expert: its tokens only
    n = sum(held)
    return TrainingMemory(w, mixed, n, n * half, n * grad, n * (master + m1 + m2), int(sum(acts)),
                          usable_pes * data_bytes_per_pe(spec), tuple(p * state + a for p, a in zip(held, acts)))
