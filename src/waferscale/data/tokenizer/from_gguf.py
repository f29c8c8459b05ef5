"""`tokenizer_from_gguf`: the tokenizer that llama.cpp embeds in a GGUF file (`tokenizer.ggml.*` metadata), byte-level
BPE ('gpt2') or SentencePiece ('llama': Llama 2, Mistral, Mixtral), rebuilt as an `HFTokenizer`, so the real
SmolLM2 model needs no hub access.

The metadata is read with the `gguf` library through `waferscale.util.gguf` (shared with the model loader).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from waferscale.data.tokenizer.hf import HFTokenizer
from waferscale.errors import DataError
from waferscale.util.gguf import gguf_metadata

__all__ = ["read_gguf_metadata", "tokenizer_from_gguf"]

# llama.cpp token types (gguf.TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# `tokenizer.ggml.pre` values -> pre-tokenizer family, as grouped in llama.cpp's llama-vocab.cpp.
_PRE_FAMILIES = {
    "default": "gpt2", "gpt2": "gpt2", "gpt-2": "gpt2", "mpt": "gpt2", "olmo": "gpt2", "jais": "gpt2",
    # StarCoder family: every digit is its own pre-token, then the GPT-2 regex (HF: Digits + ByteLevel).
    "smollm": "starcoder", "starcoder": "starcoder", "refact": "starcoder", "codeshell": "starcoder",
    "command-r": "starcoder", "exaone": "starcoder", "minerva-7b": "starcoder",
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3", "smaug-bpe": "llama3", "falcon3": "llama3",
    "qwen2": "qwen2", "stablelm2": "qwen2",
    # Falcon: runs of punctuation, then the GPT-2 regex, then runs of three digits, each split apart in turn
    "falcon": "falcon",
}
_FALCON_REGEXES = (r"[\p{P}\$\+<=>\^~\|`]+", r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
                   r"[0-9][0-9][0-9]")


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    family = _PRE_FAMILIES.get(pre)
    if family is None:
        raise DataError(f"GGUF tokenizer pre-tokenizer {pre!r} is not supported; supported: "
                        f"{', '.join(sorted(_PRE_FAMILIES))}")
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)  # the GPT-2 regex, then bytes
    if family == "gpt2":
        return gpt2
    if family == "starcoder":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    if family == "falcon":
        return pre_tokenizers.Sequence([*(pre_tokenizers.Split(Regex(r), behavior="isolated", invert=False)
                                          for r in _FALCON_REGEXES),
                                        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    regex = _LLAMA3_REGEX if family == "llama3" else _QWEN2_REGEX
    return pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
                                    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])


def tokenizer_from_gguf(path: Path | str) -> HFTokenizer:
    """Build the byte-level BPE or SentencePiece tokenizer stored in a GGUF file's `tokenizer.ggml.*` metadata.

    CONTROL and USER_DEFINED tokens become added tokens, so "<|im_start|>" in text encodes as one id. The
    pre-tokenizer follows `tokenizer.ggml.pre` (SmolLM2: "smollm" = single digits + GPT-2 regex). Results are
    cached per (path, size, mtime): opening a GGUF file indexes its whole vocabulary, which takes seconds.
    """
    path = Path(path).expanduser().resolve()
    try:
        st = path.stat()
    except OSError as e:
        raise DataError(f"cannot read GGUF file {path}: {e.strerror}") from e
    return _tokenizer_from_gguf_cached(str(path), st.st_size, st.st_mtime_ns)


def _sentencepiece(tokens: list[str], scores: list[float], types: list[int], add_space_prefix: bool) -> Any:
    """llama.cpp's SentencePiece tokenizer ('llama': Llama 2, Mistral, Mixtral) as a `tokenizers` BPE.

    llama.cpp writes spaces as U+2581 (after one in front of the text and after each special token, with
    add_space_prefix), then merges the adjacent pair whose concatenation is a token of the highest score until
    none is; characters outside the vocabulary become their UTF-8 byte tokens <0xXX>. A BPE whose merges are
    every (left, right) split of each normal token into two tokens, ranked by that token's score, merges alike.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers

    vocab = {tok: i for i, tok in enumerate(tokens)}
    normal = [i for i, t in enumerate(types) if t == _NORMAL]
    splits = [(tokens[i][:k], tokens[i][k:], i) for i in normal for k in range(1, len(tokens[i]))]
    ranked = sorted(((a, b, i) for a, b, i in splits if a in vocab and b in vocab), key=lambda m: (-scores[m[2]], m[2]))
    unk = next((tokens[i] for i, t in enumerate(types) if t == _UNKNOWN), None)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[(a, b) for a, b, _ in ranked], unk_token=unk, fuse_unk=True,
                              byte_fallback=True))
    tk.normalizer = normalizers.Sequence([*([normalizers.Prepend("\u2581")] if add_space_prefix else []),
                                          normalizers.Replace(" ", "\u2581")])
    tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                    *([decoders.Strip(" ", 1, 0)] if add_space_prefix else [])])
    return tk


@functools.lru_cache(maxsize=4)
def _tokenizer_from_gguf_cached(path: str, size: int, mtime_ns: int) -> HFTokenizer:
    from tokenizers import AddedToken, decoders, models, processors
    from tokenizers import Tokenizer as _TK

    metadata = gguf_metadata(path, error=DataError)

    def required(name: str) -> Any:
        if name not in metadata:
            raise DataError(f"{path}: GGUF metadata lacks {name!r}; it carries no usable tokenizer")
        return metadata[name]

    model = required("tokenizer.ggml.model")
    if model not in ("gpt2", "llama"):
        raise DataError(f"{path}: GGUF tokenizer model {model!r} is not supported (supported: byte-level BPE 'gpt2', "
                        "SentencePiece 'llama'); export a tokenizer.json with Hugging Face tokenizers and pass its "
                        "path instead")
    tokens: list[str] = required("tokenizer.ggml.tokens")
    types: list[int] = metadata.get("tokenizer.ggml.token_type", [_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise DataError(f"{path}: {len(tokens)} tokens but {len(types)} token types in GGUF metadata")

    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise DataError(f"{path}: GGUF vocabulary has duplicate tokens")
    if model == "llama":
        tk = _sentencepiece(tokens, required("tokenizer.ggml.scores"), types,
                            bool(metadata.get("tokenizer.ggml.add_space_prefix", True)))
    else:
        merges_raw: list[str] = required("tokenizer.ggml.merges")
        bad = next((m for m in merges_raw if " " not in m), None)
        if bad is not None:
            raise DataError(f"{path}: malformed BPE merge {bad!r} in GGUF metadata")
        merges = [tuple(m.split(" ", 1)) for m in merges_raw]
        tk = _TK(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
        tk.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "default"))
        tk.decoder = decoders.ByteLevel()
        tk.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [AddedToken(tokens[i], special=(t == _CONTROL), normalized=False)
             for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)]
    tk.add_special_tokens([a for a in added if a.special])
    tk.add_tokens([a for a in added if not a.special])
    n = tk.get_vocab_size(with_added_tokens=True)
    if n != len(tokens):
        raise DataError(f"{path}: rebuilt tokenizer has {n} tokens, GGUF lists {len(tokens)}")

    eos_id, bos_id = (metadata.get(f"tokenizer.ggml.{which}_token_id") for which in ("eos", "bos"))
    # the special tokens an input gets (encode(add_special_tokens=True)), as llama.cpp reads them: the file's
    # add_bos_token / add_eos_token (T5's converter writes add_eos_token, its inputs ending in </s>), else its
    # default per tokenizer model (a SentencePiece 'llama' vocabulary starts with BOS)
    add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", model == "llama")) and bos_id is not None
    add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    if add_bos or add_eos:
        specials = [(tokens[int(i)], int(i)) for i, on in ((bos_id, add_bos), (eos_id, add_eos)) if on]
        single = " ".join([*([f"{tokens[int(bos_id)]}:0"] if add_bos else []), "$A:0",
                           *([f"{tokens[int(eos_id)]}:0"] if add_eos else [])])
        template = processors.TemplateProcessing(single=single, special_tokens=specials)
        tk.post_processor = template if tk.post_processor is None else \
            processors.Sequence([tk.post_processor, template])
    return HFTokenizer(tk, eos_id=None if eos_id is None else int(eos_id),
                       bos_id=None if bos_id is None else int(bos_id),
                       chat_template=metadata.get("tokenizer.chat_template"))


def read_gguf_metadata(path: Path | str) -> dict[str, Any]:
    """The key/value metadata of a GGUF file as Python values (arrays as lists), read with the `gguf` library
    (`waferscale.util.gguf`); DataError naming the file if it is not readable GGUF."""
    return dict(gguf_metadata(path, error=DataError))

