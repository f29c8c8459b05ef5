"""Inference serving: the continuous-batching engine (engine.py), its scheduler, sampling and paged KV cache,
pipelined stages, and the OpenAI-compatible server (openai/)."""
