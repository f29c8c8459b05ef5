"""`cstorch.backend(...)`: where compiled models run.

    "CSX"  the wafer's execution model run on the hardware at hand: weights live in MemoryX (host RAM, plus
           flash files beyond `memoryx_ram_mb`), stream to the device (CUDA when present, else the CPU) one
           unit at a time, gradients stream back, the optimizer runs in MemoryX. With
           `cluster_config=ClusterConfig(num_csx=N)`, N data-parallel systems share that MemoryX over SwarmX.
    "CPU"  plain resident execution on the CPU (the model and optimizer live where they were built).
    "GPU"  the same on CUDA.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from waferscale.errors import ConfigError
from waferscale.pytorch import context
from waferscale.pytorch.distributed import ClusterConfig, launch

BACKEND_TYPES = ("CSX", "CPU", "GPU")



@dataclass
class Backend:
    backend_type: str
    device: torch.device
    artifact_dir: Path
    compile_dir: Path
    compile_only: bool
    cluster_config: ClusterConfig
    device_memory_mb: float | None = None  # CSX: the device budget streaming respects
    memoryx_ram_mb: float | None = None  # CSX: MemoryX RAM tier; units beyond it go to flash_dir
    flash_dir: Path | None = None

    @property
    def is_csx(self) -> bool:
        return self.backend_type == "CSX"

    @property
    def num_csx(self) -> int:
        return self.cluster_config.num_csx


def cerebras_only(where: str, given: dict[str, Any], names: tuple[str, ...]) -> None:
    """Arguments Cerebras' `where` takes that ours has no use for (`names`): each given one is named in a warning
    (once per call site, Python's default); any other name is a TypeError, never silently accepted."""
    unknown = sorted(set(given) - set(names))
    if unknown:
        raise TypeError(f"{where}() got unexpected keyword argument(s): {', '.join(unknown)}")
    if given:
        warnings.warn(f"{where}: {', '.join(sorted(given))} accepted as Cerebras' {where} takes them; they have no "
                      "effect here", stacklevel=3)


# Cerebras' backend arguments (releases 2.0-2.10) with no effect here: the device and the compile are this package's
_CEREBRAS_BACKEND_ONLY = ("drop_data", "max_checkpoints", "log_initialization", "use_cs_grad_accum",
                          "micro_batch_size", "retrace_every_iteration")


def backend(backend_type: str | None = None, *, artifact_dir: str | Path = "./cerebras_artifacts",
            compile_dir: str | Path | None = None, compile_only: bool = False, validate_only: bool = False,
            cluster_config: ClusterConfig | None = None, device: str | None = None,
            device_memory_mb: float | None = None, memoryx_ram_mb: float | None = None,
            flash_dir: str | Path | None = None, spawn_script_copies: bool = True, **cerebras: Any) -> Backend:
    """Create (and make current) a backend; `backend()` with no type returns the current one.

    With num_csx > 1 the script runs once per system (see `waferscale.pytorch.distributed`), unless
    `spawn_script_copies=False`: then only fused steps (the zoo's `compile_lm_step`) run there, in their own workers."""
    cerebras_only("cstorch.backend", cerebras, _CEREBRAS_BACKEND_ONLY)
    if backend_type is None:
        if context.current().backend is None:
            raise ConfigError('no backend yet: call cstorch.backend("CSX") (or "CPU"/"GPU") first')
        return context.current().backend
    kind = str(backend_type).upper()
    if kind not in BACKEND_TYPES:
        raise ConfigError(f"backend type {backend_type!r} is not one of {', '.join(BACKEND_TYPES)}")
    if kind == "GPU" and not torch.cuda.is_available():
        raise ConfigError('backend "GPU" needs CUDA, which this machine does not have; use "CPU" or "CSX"')
    cluster = cluster_config or ClusterConfig()
    if not isinstance(cluster, ClusterConfig):
        raise ConfigError("cluster_config must be a cstorch.distributed.ClusterConfig")
    if cluster.num_csx > 1 and kind != "CSX":
        raise ConfigError(f"ClusterConfig(num_csx={cluster.num_csx}) needs the \"CSX\" backend (weight streaming "
                          f"from MemoryX); {kind} runs on one device")
    for name, v in (("device_memory_mb", device_memory_mb), ("memoryx_ram_mb", memoryx_ram_mb)):
        if v is not None and v <= 0:
            raise ConfigError(f"{name} must be positive, got {v}")
    dev = torch.device(device or ("cuda" if kind != "CPU" and torch.cuda.is_available() else "cpu"))
    art = Path(artifact_dir)
    flash = Path(flash_dir) if flash_dir is not None else (art / "memoryx_flash" if memoryx_ram_mb else None)
    b = Backend(kind, dev, art, Path(compile_dir) if compile_dir else art / "compile", compile_only or validate_only,
                cluster, device_memory_mb, memoryx_ram_mb, flash)
    if cluster.num_csx > 1 and spawn_script_copies:
        launch(b)
    context.current().backend = b
    return b


def current_backend() -> Backend | None:
    return context.current().backend


__all__ = ["Backend", "backend", "current_backend", "BACKEND_TYPES"]
