"""Tokenizers, one file per kind (char.py, hf.py, from_gguf.py: each module's docstring says what it reads), behind
one interface (`base.Tokenizer`) and one entry point (`load.load_tokenizer`)."""

from waferscale.data.tokenizer.base import Tokenizer, check_vocab_fits
from waferscale.data.tokenizer.char import CharTokenizer
from waferscale.data.tokenizer.from_gguf import read_gguf_metadata, tokenizer_from_gguf
from waferscale.data.tokenizer.hf import HFTokenizer
from waferscale.data.tokenizer.load import load_tokenizer

__all__ = ["CharTokenizer", "HFTokenizer", "Tokenizer", "check_vocab_fits", "load_tokenizer", "read_gguf_metadata",
           "tokenizer_from_gguf"]
