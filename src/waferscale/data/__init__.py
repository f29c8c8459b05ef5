"""Corpora, tokenizers, memory-mapped token files and resumable loaders."""

from waferscale.data.corpus import held_out_shakespeare_passage, read_documents, shakespeare_dir
from waferscale.data.loader import BatchLoader, eval_batches
from waferscale.data.masking import MaskedBatches, Masker, tokenizer_with_mask
from waferscale.data.tokenizer import (CharTokenizer, HFTokenizer, Tokenizer, check_vocab_fits, load_tokenizer,
                                       read_gguf_metadata, tokenizer_from_gguf)
from waferscale.data.tokens import TokenSplits, build_token_splits, load_token_splits

__all__ = ["BatchLoader", "CharTokenizer", "HFTokenizer", "Tokenizer", "TokenSplits", "build_token_splits",
           "check_vocab_fits", "eval_batches", "held_out_shakespeare_passage", "load_token_splits", "load_tokenizer",
           "MaskedBatches", "Masker", "read_documents", "read_gguf_metadata", "shakespeare_dir", "tokenizer_from_gguf",
           "tokenizer_with_mask"]
