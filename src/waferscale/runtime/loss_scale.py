"""Dynamic loss scaling for fp16 (torch GradScaler's rule and state-dict keys), kept by MemoryX."""

from __future__ import annotations

from typing import Any

__all__ = ["LossScaler"]


class LossScaler:
    """fp16 loss scale: halve on overflow (the step is skipped), double after `growth_interval` clean steps."""

    def __init__(self, init_scale: float = 2.0 ** 16, growth_interval: int = 2000) -> None:
        self.scale = float(init_scale)
        self.growth_interval = growth_interval
        self.tracker = 0

    @classmethod
    def from_config(cls, loss_scaling_factor: float | str) -> "LossScaler":
        dynamic = loss_scaling_factor == "dynamic"  # also the rule of ResidentExecutor's GradScaler
        return cls(2.0 ** 16 if dynamic else float(loss_scaling_factor), 2000 if dynamic else 2 ** 31 - 1)

    def update(self, found_inf: bool) -> None:
        if found_inf:
            self.scale *= 0.5
            self.tracker = 0
        else:
            self.tracker += 1
            if self.tracker == self.growth_interval:
                self.scale *= 2.0
                self.tracker = 0

    def state_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "growth_factor": 2.0, "backoff_factor": 0.5,
                "growth_interval": self.growth_interval, "_growth_tracker": self.tracker}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.scale = float(s["scale"])
        self.tracker = int(s.get("_growth_tracker", 0))
