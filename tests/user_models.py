"""Language models written the way users write them (no `units()`, plain torch modules), and a script that
trains one with the cstorch API, for the tests of automatic unit splitting.

    python tests/user_models.py --model tutorial --backend CSX --num_csx 2 --out losses.json
"""

from __future__ import annotations

import argparse
import json

import torch
from torch import nn

VOCAB, BLOCK = 41, 16


class Block(nn.Module):
    """A pre-norm transformer block on nn.MultiheadAttention, the causal mask passed in."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=dropout, batch_first=True)  # functional dropout
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Dropout(dropout), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TutorialLM(nn.Module):
    """Token embedding + a learned positional parameter on the root, a ModuleList of blocks, a final norm and a
    head; the causal mask is a buffer sliced to the input's length."""

    def __init__(self, vocab: int = VOCAB, d: int = 32, n_layer: int = 3, heads: int = 4, block: int = BLOCK,
                 tie: bool = False, dropout: float = 0.1) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(1, block, d) * 0.02)
        self.blocks = nn.ModuleList([Block(d, heads, dropout) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.head.weight = self.embedding.weight
        self.register_buffer("causal", torch.triu(torch.ones(block, block, dtype=torch.bool), 1), persistent=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        x = self.embedding(idx) + self.pos[:, :T]
        for blk in self.blocks:
            x = blk(x, self.causal[:T, :T])
        return self.head(self.ln_f(x))


class BranchyLM(TutorialLM):
    """The same model, but its forward builds the mask with a Python-level shape (not traceable symbolically):
    it streams as one unit."""

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.size(1)
        mask = torch.triu(torch.ones(T, T, dtype=torch.bool, device=idx.device), 1)
        x = self.embedding(idx) + self.pos[:, :T]
        for blk in self.blocks:
            x = blk(x, mask)
        return self.head(self.ln_f(x))


class TokenNorm(nn.Module):
    """BatchNorm over every token's features (running statistics: a recomputed forward must not count twice)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        return self.bn(x.reshape(B * T, D)).reshape(B, T, D)


class BatchNormLM(nn.Module):
    """An embedding, an MLP with batch norms, a head: a plain top-level chain of children."""

    def __init__(self, vocab: int = VOCAB, d: int = 32, dropout: float = 0.1) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab, d)
        self.up = nn.Linear(d, 2 * d)
        self.norm = TokenNorm(2 * d)
        self.drop = nn.Dropout(dropout)
        self.down = nn.Linear(2 * d, d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embedding(idx)
        x = self.drop(torch.relu(self.norm(self.up(x))))
        return self.head(self.down(x))


MODELS = {"tutorial": TutorialLM, "tied": lambda **kw: TutorialLM(tie=True, **kw), "branchy": BranchyLM,
          "batchnorm": BatchNormLM}


def batches(n: int, b: int = 4, t: int = BLOCK) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(n):
        x = torch.randint(0, VOCAB, (b, t + 1), generator=g)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def train(model_name: str, backend_type: str, *, num_csx: int = 1, steps: int = 5, artifact_dir: str = "artifacts",
          dropout: float = 0.1, sparsity: dict | None = None):
    """(losses, final weights, the optimizer) of `steps` AdamW steps with the cstorch API; `sparsity`: a
    cstorch.sparse.configure config applied as a user would (model.apply, optimizer.apply)."""
    import waferscale.pytorch as cstorch

    torch.manual_seed(0)
    model = MODELS[model_name](dropout=dropout)
    backend = cstorch.backend(backend_type, artifact_dir=artifact_dir,
                              cluster_config=cstorch.distributed.ClusterConfig(num_csx=num_csx))
    compiled = cstorch.compile(model, backend)
    optimizer = cstorch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    if sparsity is not None:
        sparse = cstorch.sparse.configure(sparsity)
        model.apply(sparse)
        optimizer.apply(sparse)
    loss_fn = nn.CrossEntropyLoss()
    losses: list[float] = []

    @cstorch.trace
    def step(x, y):
        logits = compiled(x)
        loss = loss_fn(logits.view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    @cstorch.step_closure
    def record(loss):
        losses.append(loss.item())

    executor = cstorch.utils.data.DataExecutor(cstorch.utils.data.DataLoader(lambda: batches(2)), num_steps=steps)
    for x, y in executor:
        record(step(x, y))
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return losses, weights, optimizer


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tutorial", choices=sorted(MODELS))
    ap.add_argument("--backend", default="CSX")
    ap.add_argument("--num_csx", type=int, default=1)
    ap.add_argument("--artifact_dir", default="artifacts")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--sparsity", default=None, help="a cstorch.sparse.configure config, as JSON")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    losses, weights, _ = train(a.model, a.backend, num_csx=a.num_csx, artifact_dir=a.artifact_dir,
                               dropout=a.dropout, steps=a.steps,
                               sparsity=json.loads(a.sparsity) if a.sparsity else None)
    import waferscale.pytorch as cstorch

    if cstorch.distributed.is_master():
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in weights.items()}, a.out + ".safetensors")
        with open(a.out, "w") as f:
            json.dump(losses, f)
