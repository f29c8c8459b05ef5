"""Tokenizers, one file per kind, behind one interface (`base.Tokenizer`) and one entry point (`load_tokenizer`).

    base.py       the interface: encode/decode, vocab_size, eos/bos, chat template, save, fingerprint
    char.py       CharTokenizer: one id per character (tiny experiments)
    hf.py         HFTokenizer: Hugging Face `tokenizers` from tokenizer.json (+ tokenizer_config.json)
    from_gguf.py  tokenizer_from_gguf: the BPE vocabulary embedded in a GGUF file, as an HFTokenizer
    load.py       load_tokenizer(spec): "char", an asset name, a .gguf, a tokenizer.json or a directory
"""

from waferscale.data.tokenizer.base import Tokenizer, check_vocab_fits
from waferscale.data.tokenizer.char import CharTokenizer
from waferscale.data.tokenizer.from_gguf import read_gguf_metadata, tokenizer_from_gguf
from waferscale.data.tokenizer.hf import HFTokenizer
from waferscale.data.tokenizer.load import load_tokenizer

__all__ = ["CharTokenizer", "HFTokenizer", "Tokenizer", "check_vocab_fits", "load_tokenizer", "read_gguf_metadata",
           "tokenizer_from_gguf"]
