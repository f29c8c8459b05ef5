"""A params file for the wafer compiler: its model as a graph, with the file's batch, sequence length and
number of systems as the workload's defaults (`wsc compile --params`, `wsc estimate --params`,
`wsc run --compile_only`)."""

from __future__ import annotations

from typing import Any

from waferscale.compiler.capture import capture_config, dtype_label
from waferscale.compiler.ir import Graph
from waferscale.params import Params


def params_graph(params: Params) -> Graph:
    """The model section captured on the meta device (nothing materialized). Defaults: train_input's
    batch_size, max_sequence_length (else the model's context), micro_batch_size, and runconfig.num_csx; the
    graph's dtype follows model.mixed_precision / fp16_type."""
    cfg = params.model.to_model_config()
    ti = params.train_input
    defaults: dict[str, Any] = {"batch_size": ti.batch_size, "seq_len": ti.max_sequence_length or cfg.max_seq_len,
                                "num_csx": params.runconfig.num_csx}
    if ti.micro_batch_size is not None:
        defaults["micro_batch_size"] = ti.micro_batch_size
    return capture_config(cfg, source=f"params:{params.source}", dtype=dtype_label(params.model.half_dtype),
                          defaults=defaults)


__all__ = ["params_graph"]
