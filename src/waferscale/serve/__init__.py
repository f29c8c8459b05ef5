"""Inference serving: the continuous-batching engine (engine.py), its scheduler, sampling and paged KV cache,
the paged model runner (model_runner.py), pipelined stages, the OpenAI-compatible server (openai/), and the
in-process front end that `wsc generate` runs (llm.py)."""
