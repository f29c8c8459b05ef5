"""`serve(...)`: load a model into the engine and serve the OpenAI-compatible API + playground with uvicorn.

    wsc serve [--model NAME|PATH] [--host 127.0.0.1] [--port 8000] [--api-key KEY] [--stages K]
              [--target wse3 [--systems N]] [--max-num-seqs N] [--no-enable-prefix-caching]

`python -m waferscale.serve.server ...` is `wsc serve ...`: the flags are parsed by the command line's one table
(cli/main.py), the only entry point above this module.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from waferscale.runtime.source import resolve, served_id

__all__ = ["serve", "build_app", "wafer_projection"]

DEFAULT_MODEL = "smollm2-135m-instruct"


def wafer_projection(model: str, target: str, systems: int = 1) -> dict[str, Any]:
    """The compiler's inference plan (`plan_json`) for `model` on `systems` x `target`: projected decode
    tokens/s per user, time to first token, users in flight, and the assumptions behind them."""
    from waferscale.compiler import compile_model
    from waferscale.compiler.api import plan_json

    plan = compile_model(graph=resolve(model).graph(), target=target, systems=systems, mode="inference")
    return plan_json(plan)


def build_app(model: str = DEFAULT_MODEL, *, api_key: str | None = None, stages: int = 1,
              target: str | None = None, systems: int = 1, engine_kw: dict[str, Any] | None = None,
              log=print, engine_process: bool = True) -> Any:
    """Load the model and tokenizer, build the engine and the FastAPI app (not started).

    engine_process: run the engine in its own process (serve/core.py; the default, as `wsc serve` does), else
    in a thread of this one (AsyncEngine)."""
    from waferscale.serve.openai.app import create_app

    t = time.perf_counter()
    source = resolve(model)  # (the engine process resolves it the same way)
    if engine_process:
        from waferscale.serve.core import CoreClient

        engine = aengine = CoreClient(model, {"stages": stages, **(engine_kw or {})})
    else:
        from waferscale.serve.engine import AsyncEngine, Engine

        engine = Engine.from_pretrained(model, stages=stages, **(engine_kw or {}))
        aengine = AsyncEngine(engine)
    tokenizer = source.tokenizer((engine_kw or {}).get("tokenizer"))
    model_id, aliases = served_id(model)
    log(f"wsc serve: loaded {model_id} in {time.perf_counter() - t:.1f} s "
        f"(context {engine.max_model_len} tokens, {stages} stage{'s' if stages != 1 else ''}; "
        f"C kernels: {engine.stats().get('kernel_path')})")
    projection = None
    if target is not None:
        t = time.perf_counter()
        projection = wafer_projection(model, target, systems)
        log(f"wsc serve: projection on {systems} x {target} ({time.perf_counter() - t:.1f} s): "
            f"{projection['decode_tokens_per_s_per_user']:,.0f} tokens/s per user, time to first token "
            f"{projection['time_to_first_token_s'] * 1e3:.2f} ms, {projection['users_in_flight']} users in flight "
            f"(a projection from the compiler's cost model, not a measurement)")
    return create_app(engine, aengine, tokenizer, model_id=model_id, aliases=aliases, api_key=api_key,
                      projection=projection)


def serve(model: str = DEFAULT_MODEL, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          stages: int = 1, target: str | None = None, systems: int = 1, *, log_level: str = "warning",
          engine_kw: dict[str, Any] | None = None) -> None:
    """Serve `model` until interrupted (blocks). OpenAI base_url: http://HOST:PORT/v1; playground: /."""
    import uvicorn

    from waferscale.errors import ConfigError

    if not isinstance(port, int) or not 0 <= port < 65536:
        raise ConfigError(f"--port must be in [0, 65535], got {port!r}")
    if not isinstance(stages, int) or stages < 1:
        raise ConfigError(f"--stages must be a positive integer, got {stages!r}")
    if not isinstance(systems, int) or systems < 1:
        raise ConfigError(f"--systems must be a positive integer, got {systems!r}")
    seqs = (engine_kw or {}).get("max_num_seqs", 1)
    if not isinstance(seqs, int) or seqs < 1:
        raise ConfigError(f"--max-num-seqs must be a positive integer, got {seqs!r}")
    if api_key is None:
        api_key = os.environ.get("WSC_API_KEY") or None
    app = build_app(model, api_key=api_key, stages=stages, target=target, systems=systems, engine_kw=engine_kw)
    print(f"wsc serve: http://{host}:{port}/  (playground)   OpenAI base_url: http://{host}:{port}/v1"
          f"{'   API key required' if api_key else ''}", flush=True)
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)


if __name__ == "__main__":  # one argparse, the command line's: this is `wsc serve`
    from waferscale.cli.main import main

    sys.exit(main(["serve", *sys.argv[1:]]))
