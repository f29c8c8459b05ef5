"""Tokenizers: a character tokenizer for tiny experiments and Hugging Face `tokenizers` BPE for real models.

Every tokenizer exposes the same small surface (`Tokenizer`): `encode`/`decode`, `vocab_size`, `eos_id`,
`bos_id`, a Jinja chat template, `save(directory)` and a `fingerprint()` used in token-cache keys.

`tokenizer_from_gguf` rebuilds the byte-level BPE tokenizer that llama.cpp embeds in a GGUF file
(`tokenizer.ggml.*` metadata), so the real SmolLM2 model needs no hub access. `load_tokenizer(spec)` is the
one entry point the CLI uses.
"""

from __future__ import annotations

import functools
import hashlib
import json
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from waferscale.errors import DataError
from waferscale.util.assets import ASSETS, asset_path, find_asset
from waferscale.util.files import atomic_write_text
from waferscale.util.gguf import gguf_metadata

__all__ = [
    "ASSETS",
    "CharTokenizer",
    "HFTokenizer",
    "Tokenizer",
    "asset_path",
    "check_vocab_fits",
    "load_tokenizer",
    "read_gguf_metadata",
    "tokenizer_from_gguf",
]

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"


class Tokenizer:
    """Base class. Subclasses set the four attributes and implement `encode`/`decode`/`_save_vocab`.

    Ids are ints in [0, vocab_size). `eos_id`/`bos_id` are None when the vocabulary has no such token.
    """

    vocab_size: int
    eos_id: int | None = None
    bos_id: int | None = None
    chat_template: str | None = None

    # ---- text <-> ids -------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int]) -> str:
        """Text for `ids`. Ids outside [0, vocab_size) are skipped, as Hugging Face `tokenizers` does (a model
        whose embedding is padded past the tokenizer's vocabulary can sample them); mask such logits when
        sampling if they must never appear."""
        raise NotImplementedError

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many texts; subclasses override this with a faster (parallel / vectorized) path."""
        return [self.encode(t) for t in texts]

    def id_to_token(self, token_id: int) -> str | None:
        raise NotImplementedError

    def token_to_id(self, token: str) -> int | None:
        raise NotImplementedError

    @property
    def eos_token(self) -> str | None:
        return None if self.eos_id is None else self.id_to_token(self.eos_id)

    @property
    def bos_token(self) -> str | None:
        return None if self.bos_id is None else self.id_to_token(self.bos_id)

    # ---- chat ---------------------------------------------------------------------------------------------
    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, **kw: Any
    ) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the tokenizer's Jinja chat template.

        Same conventions as Hugging Face: sandboxed Jinja, trim_blocks/lstrip_blocks, `raise_exception`,
        `strftime_now`, a non-escaping `tojson`, and `bos_token`/`eos_token` in the context. Extra keyword
        arguments (e.g. `tools`) are passed to the template.
        """
        if not self.chat_template:
            raise DataError(
                f"{type(self).__name__} has no chat template; use a tokenizer that ships one "
                "(e.g. 'smollm2') or put a 'chat_template' entry in tokenizer_config.json"
            )
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise DataError("chat messages must be a list of dicts like {'role': 'user', 'content': 'hi'}")
        import jinja2

        template = _compile_chat_template(self.chat_template)
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **kw}
        try:
            return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **context)
        except jinja2.TemplateError as e:
            raise DataError(f"chat template rejected the messages: {e}") from e

    # ---- persistence / identity ---------------------------------------------------------------------------
    def save(self, directory: Path | str) -> None:
        """Write `tokenizer.json` (+ `tokenizer_config.json` when there is a template or bos/eos) into `directory`."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_text(directory / TOKENIZER_FILE, self._tokenizer_json())
        config: dict[str, Any] = {}
        if self.chat_template:
            config["chat_template"] = self.chat_template
        if self.eos_id is not None:
            config["eos_token"] = self.eos_token
            config["eos_token_id"] = self.eos_id
        if self.bos_id is not None:
            config["bos_token"] = self.bos_token
            config["bos_token_id"] = self.bos_id
        if config:
            atomic_write_text(directory / CONFIG_FILE, json.dumps(config, indent=2, ensure_ascii=False))

    def _tokenizer_json(self) -> str:
        raise NotImplementedError

    def fingerprint(self) -> str:
        """Hex sha256 of everything that decides the ids: the serialized vocabulary, merges and pre-tokenizer."""
        return hashlib.sha256(self._tokenizer_json().encode("utf-8")).hexdigest()

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eos_id={self.eos_id}, bos_id={self.bos_id})"


def check_vocab_fits(tokenizer: Tokenizer, model_vocab_size: int) -> None:
    """DataError unless every id the tokenizer can emit is a valid row of a `model_vocab_size` embedding."""
    if tokenizer.vocab_size > model_vocab_size:
        raise DataError(
            f"tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {model_vocab_size}; "
            f"set model vocab_size >= {tokenizer.vocab_size} or use the model's own tokenizer"
        )


# ==========================================================================================================
# Character tokenizer
# ==========================================================================================================


class CharTokenizer(Tokenizer):
    """One id per character; the vocabulary is the sorted set of characters seen in the training text."""

    def __init__(self, chars: list[str] | str):
        chars = list(chars)
        if not chars:
            raise DataError("character tokenizer needs a non-empty vocabulary (got no characters)")
        if any(len(c) != 1 for c in chars):
            raise DataError("character tokenizer vocabulary must hold single characters")
        if len(set(chars)) != len(chars):
            raise DataError("character tokenizer vocabulary has duplicate characters")
        self.chars = chars
        self.vocab_size = len(chars)
        self.stoi = {c: i for i, c in enumerate(chars)}
        # Vectorized encode: code point -> id lookup table (-1 for unknown).
        cps = np.array([ord(c) for c in chars], dtype=np.int64)
        self._lut = np.full(int(cps.max()) + 1, -1, dtype=np.int64)
        self._lut[cps] = np.arange(len(chars))
        self._itos = np.array(chars, dtype=object)

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        if not text:
            raise DataError("cannot build a character tokenizer from empty text")
        return cls(sorted(set(text)))

    def encode_array(self, text: str) -> np.ndarray:
        """Ids as an int64 array of shape (len(text),)."""
        cps = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        ids = np.full(cps.shape, -1, dtype=np.int64)
        known = cps < len(self._lut)
        ids[known] = self._lut[cps[known]]
        if (ids < 0).any():
            pos = int(np.argmax(ids < 0))
            ch = text[pos]
            raise DataError(
                f"character {ch!r} (U+{ord(ch):04X}) at position {pos} is not in the character tokenizer's "
                f"vocabulary of {self.vocab_size} characters; build the tokenizer from text that includes it"
            )
        return ids

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        out = []
        for n, t in enumerate(texts):
            try:
                out.append(self.encode(t))
            except DataError as e:
                raise DataError(f"text {n} of the batch: {e}") from None
        return out

    def decode(self, ids: list[int]) -> str:
        n = self.vocab_size
        return "".join(self.chars[i] for i in map(int, ids) if 0 <= i < n)

    def id_to_token(self, token_id: int) -> str | None:
        return self.chars[token_id] if 0 <= token_id < self.vocab_size else None

    def token_to_id(self, token: str) -> int | None:
        return self.stoi.get(token)

    def _tokenizer_json(self) -> str:
        return json.dumps({"type": "char", "version": 1, "vocab": self.chars}, ensure_ascii=False)

    @classmethod
    def from_json(cls, data: dict, source: str = "<json>") -> CharTokenizer:
        vocab = data.get("vocab")
        if not isinstance(vocab, list) or not all(isinstance(c, str) for c in vocab):
            raise DataError(f"{source}: a char tokenizer file needs 'vocab': a list of single characters")
        return cls(vocab)


# ==========================================================================================================
# Hugging Face tokenizers
# ==========================================================================================================


class HFTokenizer(Tokenizer):
    """Wraps a `tokenizers.Tokenizer` (BPE, WordPiece, ...). Special tokens in the text encode as one id."""

    def __init__(
        self,
        tokenizer: Any,
        eos_id: int | None = None,
        bos_id: int | None = None,
        chat_template: str | None = None,
    ):
        self.tk = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        for name, value in (("eos_id", eos_id), ("bos_id", bos_id)):
            if value is not None and not 0 <= value < self.vocab_size:
                raise DataError(f"{name}={value} is outside the tokenizer vocabulary [0, {self.vocab_size})")
        self.eos_id = eos_id
        self.bos_id = bos_id
        self.chat_template = chat_template

    @classmethod
    def from_file(cls, path: Path | str) -> HFTokenizer:
        """Load `tokenizer.json`, or a directory holding it; `tokenizer_config.json` beside it adds
        `chat_template` and the bos/eos tokens."""
        from tokenizers import Tokenizer as _TK

        path = Path(path)
        file = path / TOKENIZER_FILE if path.is_dir() else path
        if not file.is_file():
            raise DataError(f"no {TOKENIZER_FILE} at {path}")
        try:
            tk = _TK.from_file(str(file))
        except Exception as e:  # tokenizers raises a plain Exception on bad JSON / unknown model
            raise DataError(f"{file}: not a Hugging Face tokenizer.json ({e})") from e
        config = _read_tokenizer_config(file.parent / CONFIG_FILE)
        eos_id = _special_id(tk, config, "eos", file.parent)
        bos_id = _special_id(tk, config, "bos", file.parent)
        template = config.get("chat_template")
        if isinstance(template, list):  # HF allows [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        if template is None and (file.parent / "chat_template.jinja").is_file():
            template = (file.parent / "chat_template.jinja").read_text(encoding="utf-8")
        return cls(tk, eos_id=eos_id, bos_id=bos_id, chat_template=template)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids for `text`. No BOS/EOS is added (add_special_tokens=False) unless asked; special-token strings
        such as "<|im_start|>" inside `text` still encode as their single id."""
        return self.tk.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        """Parallel (Rust threads) encode of many texts."""
        return [e.ids for e in self.tk.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        n = self.vocab_size
        ids = [i for i in map(int, ids) if 0 <= i < n]  # out-of-vocabulary ids are skipped (see Tokenizer.decode)
        return self.tk.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.tk.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.tk.token_to_id(token)

    def _tokenizer_json(self) -> str:
        return self.tk.to_str()


def _read_tokenizer_config(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{path}: cannot read tokenizer config ({e})") from e
    if not isinstance(config, dict):
        raise DataError(f"{path}: expected a JSON object")
    return config


def _special_id(tk: Any, config: dict, which: str, where: Path) -> int | None:
    """Resolve `<which>_token` (a string or {"content": ...}) or `<which>_token_id` from a tokenizer config."""
    if isinstance(config.get(f"{which}_token_id"), int):
        return config[f"{which}_token_id"]
    token = config.get(f"{which}_token")
    if isinstance(token, dict):
        token = token.get("content")
    if not token:
        return None
    token_id = tk.token_to_id(token)
    if token_id is None:
        raise DataError(f"{where / CONFIG_FILE}: {which}_token {token!r} is not in the tokenizer vocabulary")
    return token_id


@functools.lru_cache(maxsize=8)
def _compile_chat_template(source: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None, sort_keys=False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise DataError(f"chat template is not valid Jinja (line {e.lineno}): {e.message}") from e


# ==========================================================================================================
# GGUF -> tokenizers.Tokenizer
# ==========================================================================================================

# llama.cpp token types (gguf.TokenType)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN2_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` values -> pre-tokenizer family, as grouped in llama.cpp's llama-vocab.cpp.
_PRE_FAMILIES = {
    "default": "gpt2", "gpt2": "gpt2", "gpt-2": "gpt2", "mpt": "gpt2", "olmo": "gpt2", "jais": "gpt2",
    # StarCoder family: every digit is its own pre-token, then the GPT-2 regex (HF: Digits + ByteLevel).
    "smollm": "starcoder", "starcoder": "starcoder", "refact": "starcoder", "codeshell": "starcoder",
    "command-r": "starcoder", "exaone": "starcoder", "minerva-7b": "starcoder",
    "llama3": "llama3", "llama-v3": "llama3", "llama-bpe": "llama3", "smaug-bpe": "llama3", "falcon3": "llama3",
    "qwen2": "qwen2", "stablelm2": "qwen2",
}


def _pre_tokenizer(pre: str) -> Any:
    from tokenizers import Regex, pre_tokenizers

    family = _PRE_FAMILIES.get(pre)
    if family is None:
        raise DataError(
            f"GGUF tokenizer pre-tokenizer {pre!r} is not supported; supported: {', '.join(sorted(_PRE_FAMILIES))}"
        )
    if family == "gpt2":
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if family == "starcoder":
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    regex = _LLAMA3_REGEX if family == "llama3" else _QWEN2_REGEX
    return pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )


def tokenizer_from_gguf(path: Path | str) -> HFTokenizer:
    """Build the GPT-2-style byte-level BPE tokenizer stored in a GGUF file's `tokenizer.ggml.*` metadata.

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


@functools.lru_cache(maxsize=4)
def _tokenizer_from_gguf_cached(path: str, size: int, mtime_ns: int) -> HFTokenizer:
    from tokenizers import AddedToken, decoders, models, processors
    from tokenizers import Tokenizer as _TK

    metadata = gguf_metadata(path, error=DataError)

    def field(name: str, default: Any = None, required: bool = False) -> Any:
        if name not in metadata:
            if required:
                raise DataError(f"{path}: GGUF metadata lacks {name!r}; it carries no usable tokenizer")
            return default
        return metadata[name]

    model = field("tokenizer.ggml.model", required=True)
    if model != "gpt2":
        raise DataError(
            f"{path}: GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2'); "
            "export a tokenizer.json with Hugging Face tokenizers and pass its path instead"
        )
    tokens: list[str] = field("tokenizer.ggml.tokens", required=True)
    merges_raw: list[str] = field("tokenizer.ggml.merges", required=True)
    types: list[int] = field("tokenizer.ggml.token_type", [_NORMAL] * len(tokens))
    if len(types) != len(tokens):
        raise DataError(f"{path}: {len(tokens)} tokens but {len(types)} token types in GGUF metadata")

    vocab = {tok: i for i, tok in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise DataError(f"{path}: GGUF vocabulary has duplicate tokens")
    merges = []
    for m in merges_raw:
        a, sep, b = m.partition(" ")
        if not sep:
            raise DataError(f"{path}: malformed BPE merge {m!r} in GGUF metadata")
        merges.append((a, b))

    tk = _TK(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tk.pre_tokenizer = _pre_tokenizer(field("tokenizer.ggml.pre", "default"))
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [
        AddedToken(tokens[i], special=(t == _CONTROL), normalized=False)
        for i, t in enumerate(types)
        if t in (_CONTROL, _USER_DEFINED)
    ]
    tk.add_special_tokens([a for a in added if a.special])
    tk.add_tokens([a for a in added if not a.special])
    if tk.get_vocab_size(with_added_tokens=True) != len(tokens):
        n = tk.get_vocab_size(with_added_tokens=True)
        raise DataError(f"{path}: rebuilt tokenizer has {n} tokens, GGUF lists {len(tokens)}")

    eos_id = field("tokenizer.ggml.eos_token_id")
    bos_id = field("tokenizer.ggml.bos_token_id")
    return HFTokenizer(
        tk,
        eos_id=None if eos_id is None else int(eos_id),
        bos_id=None if bos_id is None else int(bos_id),
        chat_template=field("tokenizer.chat_template"),
    )


def read_gguf_metadata(path: Path | str) -> dict[str, Any]:
    """The key/value metadata of a GGUF file as Python values (arrays as lists), read with the `gguf` library
    (`waferscale.util.gguf`); DataError naming the file if it is not readable GGUF."""
    return dict(gguf_metadata(path, error=DataError))


# ==========================================================================================================
# The one entry point
# ==========================================================================================================

def load_tokenizer(spec: str | Path, text_for_char: str | None = None) -> Tokenizer:
    """Resolve a tokenizer spec.

    Accepted: "char" (built from `text_for_char`), an asset name ("smollm2", "smollm2-135m-instruct"),
    a `.gguf` file, a `tokenizer.json` (Hugging Face, or the char format written by `Tokenizer.save`),
    or a directory holding a `tokenizer.json` (a HF model dir or one written by `Tokenizer.save`).
    """
    accepted = (
        "accepted: 'char', 'smollm2' / 'smollm2-135m-instruct', a .gguf file, a tokenizer.json, "
        "or a directory containing tokenizer.json"
    )
    s = str(spec)
    if s == "char":
        if not text_for_char:
            raise DataError("tokenizer 'char' is built from the training text, but no text was given")
        return CharTokenizer.from_text(text_for_char)
    if find_asset(s, "model") is not None:
        return tokenizer_from_gguf(asset_path(s, "model"))
    path = Path(s).expanduser()
    if path.is_dir():
        file = path / TOKENIZER_FILE
        if not file.is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return tokenizer_from_gguf(ggufs[0])
            raise DataError(f"directory {path} has no {TOKENIZER_FILE}; {accepted}")
        return _load_json_tokenizer(file)
    if path.is_file():
        if path.suffix == ".gguf":
            return tokenizer_from_gguf(path)
        if path.suffix == ".json":
            return _load_json_tokenizer(path)
        raise DataError(f"tokenizer file {path} is neither .json nor .gguf; {accepted}")
    raise DataError(f"tokenizer {s!r} is not a known name and no such file or directory exists; {accepted}")


def _load_json_tokenizer(file: Path) -> Tokenizer:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"{file}: cannot read tokenizer JSON ({e})") from e
    if isinstance(data, dict) and data.get("type") == "char":
        return CharTokenizer.from_json(data, str(file))
    return HFTokenizer.from_file(file)

