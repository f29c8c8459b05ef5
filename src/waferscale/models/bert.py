"""The encoder families: BERT (Devlin et al. 2019) and RoBERTa (Liu et al. 2019), with the masked-LM head.

Every token attends to every token (no causal mask); blocks are post-norm as in the original Transformer,
x = norm1(x + attn(x)); x = norm2(x + mlp(x)), with exact-erf GELU MLPs. The embedding unit adds learned
absolute positions and token type (segment) embeddings to the token embeddings and normalizes the sum; RoBERTa
numbers positions after its padding token, as fairseq did (its table has max_seq_len + pad + 1 rows). The head
unit is the masked-LM head: dense + GELU + LayerNorm, then a decoder tied to the token embeddings with a bias of
its own. BERT also has the next-sentence head: a tanh pooler over the first ([CLS]) token and a 2-way
classifier. The units stay embedding, one per layer, head, so weight streaming and SwarmX run encoders as they
run decoders. Shapes are those of the original releases (bert-base-uncased, roberta-base and their large
siblings).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from waferscale.errors import ConfigError
from waferscale.models.config import ModelConfig
from waferscale.models.init import Initializer
from waferscale.models.layers import MLP, Attention, CausalLM, make_norm


class EncoderEmbedding(nn.Module):
    """Unit 0: token ids (B, T) (and token types) -> norm(token + type + position) (B, T, C). Without explicit
    token types, ids of type t arrive as t * vocab_size + id (data/sentence_pairs.py: the executors carry one
    (B, T) input), so plain ids are type 0."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.segment = nn.Embedding(cfg.type_vocab_size, cfg.d_model) if cfg.type_vocab_size else None
        self.pos = nn.Embedding(cfg.max_seq_len + cfg.position_offset, cfg.d_model)
        self.norm = make_norm(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.max_seq_len, self.vocab_size = cfg.max_seq_len, cfg.vocab_size
        self.pad = cfg.pad_token_id if cfg.family == "roberta" else None

    def forward(self, idx: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        T = idx.shape[1]
        if T > self.max_seq_len:
            raise ValueError(f"sequence of {T} tokens exceeds max_seq_len {self.max_seq_len}")
        if token_type_ids is None and self.segment is not None:
            token_type_ids, idx = idx // self.vocab_size, idx % self.vocab_size
        if self.pad is None:
            pos = torch.arange(T, device=idx.device)
        else:  # RoBERTa: the n-th non-padding token sits at pad + n, padding at pad (transformers does the same)
            keep = (idx != self.pad).long()
            pos = torch.cumsum(keep, dim=1) * keep + self.pad  # (B, T)
        x = self.tok(idx)  # (B, T, C)
        if self.segment is not None:
            x = x + self.segment(token_type_ids)
        return self.drop(self.norm(x + self.pos(pos)))


class EncoderAttention(Attention):
    """Bidirectional attention: no mask (and no rotary or ALiBi; positions are in the embedding)."""

    def _mask(self, start_pos: int, T: int, S: int, k_start: int, dtype: torch.dtype,
              device: torch.device) -> tuple[Tensor | None, bool]:
        return None, False


class EncoderBlock(nn.Module):
    """One post-norm encoder layer, a streamable unit: (B, T, C) -> (B, T, C)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn = EncoderAttention(cfg)
        self.attn_norm = make_norm(cfg)
        self.mlp = MLP(cfg)
        self.mlp_norm = make_norm(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        x = self.attn_norm(x + self.drop(self.attn(x)))
        return self.mlp_norm(x + self.drop(self.mlp(x)))


class MaskedLMHead(nn.Module):
    """Last unit: (B, T, C) -> masked-LM logits (B, T, V); with the next-sentence head, (B, T + 1, V): the
    masked-LM logits, then one row whose first two entries are the next-sentence logits (the rest 0), so that
    the pretraining objective's two outputs travel as one tensor to the loss (`BERT.loss`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.d_model, cfg.d_model)
        self.act = {"gelu": nn.GELU(), "gelu_tanh": nn.GELU(approximate="tanh"), "relu": nn.ReLU()}[cfg.activation]
        self.norm = make_norm(cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=True)
        self.pooler = nn.Linear(cfg.d_model, cfg.d_model) if cfg.nsp_head else None
        self.nsp = nn.Linear(cfg.d_model, 2) if cfg.nsp_head else None

    def masked_lm(self, x: Tensor) -> Tensor:
        return self.lm_head(self.norm(self.act(self.dense(x))))

    def forward(self, x: Tensor) -> Tensor:
        logits = self.masked_lm(x)
        if self.nsp is None:
            return logits
        nsp = F.pad(self.next_sentence(x).to(logits.dtype), (0, logits.shape[-1] - 2))
        return torch.cat((logits, nsp[:, None]), dim=1)

    def next_sentence(self, x: Tensor) -> Tensor:
        """(B, T, C) -> (B, 2) logits: is the second segment the one that followed the first ([CLS]'s state)."""
        if self.nsp is None:
            raise ConfigError("this model has no next-sentence head (nsp_head is False)")
        return self.nsp(torch.tanh(self.pooler(x[:, 0])))


class BERT(CausalLM):
    """An encoder with the masked-LM head (and BERT's next-sentence head): embedding -> blocks -> head, as units
    (see `CausalLM`). Training (`forward_aux`, the units) trains BERT's pretraining objective where the model has
    the next-sentence head, the masked LM alone otherwise."""

    embedding_cls, block_cls, head_cls = EncoderEmbedding, EncoderBlock, MaskedLMHead

    def encode(self, idx: Tensor, token_type_ids: Tensor | None = None) -> Tensor:
        """idx (B, T) -> the last layer's states (B, T, C)."""
        x = self.embed(idx, token_type_ids)
        for block in self.blocks:
            x = block(x)
        return x

    def forward(self, idx: Tensor, token_type_ids: Tensor | None = None,
                with_aux: bool = False) -> Tensor | tuple[Tensor, None]:
        """idx (B, T) int64 -> masked-LM logits (B, T, V) at every position; `with_aux`: (the head unit's output,
        None), what `loss` reads (an encoder has no auxiliary loss)."""
        x = self.encode(idx, token_type_ids)
        return (self.head(x), None) if with_aux else self.head.masked_lm(x)

    def forward_aux(self, idx: Tensor, token_type_ids: Tensor | None = None) -> tuple[Tensor, None]:
        return self(idx, token_type_ids, with_aux=True)

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """The masked-LM loss over the positions whose target is not -100: their mean cross-entropy or, with
        `mlm_loss_weight`, Model Zoo's weight x their sum / the number of sequences (a mean over sequences, so
        micro-batches and systems split it as they split the mean). With the next-sentence head, `logits` is the
        head unit's (B, T + 1, V) and the targets' first column ([CLS]) holds the next-sentence labels: the loss
        adds their mean cross-entropy, as Model Zoo's BertPretrainModelLoss (cerebras/modelzoo/losses) and
        transformers' BertForPreTraining do (total = masked-LM loss + next-sentence loss)."""
        nsp = None
        if self.config.nsp_head:
            logits, nsp = logits[:, :-1], logits[:, -1, :2]
            targets, nsp_labels = targets.clone(), targets[:, 0]
            targets[:, 0] = -100
        w = self.config.mlm_loss_weight
        mlm = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-100,
                              reduction="mean" if w is None else "sum")
        if w is not None:
            mlm = w * mlm / targets.shape[0]
        return mlm if nsp is None else mlm + F.cross_entropy(nsp.float(), nsp_labels)

    def pretraining_logits(self, idx: Tensor, token_type_ids: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """(masked-LM logits (B, T, V), next-sentence logits (B, 2)), what BertForPreTraining returns."""
        x = self.encode(idx, token_type_ids)
        return self.head.masked_lm(x), self.head.next_sentence(x)

    def make_kv_caches(self, *args, **kwargs):
        raise ConfigError(f"model {self.config.name!r} is an encoder: it reads whole sequences and keeps no KV "
                          "cache (it fills masks, it does not generate)")

    @torch.no_grad()
    def init_parameter(self, name: str, t: Tensor) -> None:
        """BERT's initialisation (`reset_parameters` applies it to each parameter, MemoryX to the weights of a
        model built on the meta device): biases 0, norms 1, the matrices as `init_for` says, the padding token's
        embedding 0."""
        if t.ndim == 1:
            t.fill_(1.0) if name.endswith("norm.weight") else t.zero_()
            return
        self.init_for(name)(t)
        if name == "embed.tok.weight" and self.config.pad_token_id is not None:
            t[self.config.pad_token_id].zero_()

    def init_for(self, name: str) -> Initializer:
        """The config's initializers where Model Zoo's BERT applies them (as the decoders' `CausalLM.init_for`;
        the heads' matrices: initializer); left out, N(0, init_std) (no depth scaling: BERT's)."""
        cfg = self.config
        if name.startswith("embed."):
            chosen = cfg.embedding_initializer
        elif name.endswith("o_proj.weight"):
            chosen = cfg.output_layer_initializer or cfg.initializer
        elif name.endswith("down_proj.weight"):
            chosen = (cfg.ffn_output_layer_initializer or cfg.output_layer_initializer or cfg.ffn_initializer
                      or cfg.initializer)
        elif name.endswith("up_proj.weight"):
            chosen = cfg.ffn_initializer or cfg.initializer
        else:
            chosen = cfg.initializer
        return chosen or Initializer("normal", std=cfg.init_std)


class RoBERTa(BERT):
    """BERT's architecture with RoBERTa's positions (after the padding token) and one token type."""


def _encoder(name: str, family: str, *, vocab: int, n_layer: int, d_model: int, n_head: int, ctx: int = 512,
             **kw) -> ModelConfig:
    return ModelConfig(name=name, family=family, vocab_size=vocab, n_layer=n_layer, n_head=n_head, d_model=d_model,
                       max_seq_len=ctx, norm="layernorm", activation="gelu", position="learned", block="post_norm",
                       tie_embeddings=True, lm_head_bias=True, **kw)


# BERT: WordPiece vocabulary of 30522 ([PAD] = 0), two segments, LayerNorm eps 1e-12, the next-sentence head.
# RoBERTa: byte-level BPE of 50265 (<pad> = 1), one token type, eps 1e-5, no next-sentence head.
_BERT = dict(family="bert", vocab=30522, type_vocab_size=2, pad_token_id=0, norm_eps=1e-12, nsp_head=True)
_ROBERTA = dict(family="roberta", vocab=50265, type_vocab_size=1, pad_token_id=1, norm_eps=1e-5)

PRESETS: dict[str, ModelConfig] = {c.name: c for c in [
    _encoder("bert-base", **_BERT, n_layer=12, d_model=768, n_head=12),  # 110 M
    _encoder("bert-large", **_BERT, n_layer=24, d_model=1024, n_head=16),  # 340 M
    _encoder("roberta-base", **_ROBERTA, n_layer=12, d_model=768, n_head=12),  # 125 M
    _encoder("roberta-large", **_ROBERTA, n_layer=24, d_model=1024, n_head=16),  # 355 M
    # tiny shapes for tests; bert-tiny is BertForMaskedLM's shape (no next-sentence head: the masked-LM objective
    # would leave it without gradients)
    _encoder("bert-tiny", **{**_BERT, "vocab": 256, "nsp_head": False}, n_layer=2, d_model=32, n_head=4, ctx=64),
    _encoder("roberta-tiny", **{**_ROBERTA, "vocab": 256}, n_layer=2, d_model=32, n_head=4, ctx=64),
]}

ALIASES = {"bert-base-uncased": "bert-base", "bert-large-uncased": "bert-large", "bert": "bert-base",
           "roberta": "roberta-base"}
