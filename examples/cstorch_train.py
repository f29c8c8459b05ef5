"""The cstorch training example, unchanged except for its import line: a GPT trained on Shakespeare by
weight streaming (the "CSX" backend: weights in MemoryX, streamed unit by unit, the optimizer in MemoryX).

    python examples/cstorch_train.py                      # weight streaming on this machine
    python examples/cstorch_train.py --num_csx 2          # two data-parallel systems sharing one MemoryX
    python examples/cstorch_train.py --backend CPU        # the same script, resident on the CPU
    python examples/cstorch_train.py --sparsity 0.75      # 75% of each block's weights zero (cstorch.sparse)
"""

import argparse

import torch

import waferscale.pytorch as cstorch  # the only line that differs: `import cerebras.pytorch as cstorch`
from waferscale.data.corpus import read_documents  # any torch data pipeline works
from waferscale.models import ModelConfig, build  # any torch.nn.Module works; units() makes it stream per block

ap = argparse.ArgumentParser()
ap.add_argument("--backend", default="CSX")
ap.add_argument("--num_csx", type=int, default=1)
ap.add_argument("--steps", type=int, default=60)
ap.add_argument("--checkpoint_steps", type=int, default=30)
ap.add_argument("--artifact_dir", default="./artifacts")
ap.add_argument("--seed", type=int, default=0)
ap.add_argument("--sparsity", type=float, default=None, help="static weight sparsity of the blocks' matrices")
args = ap.parse_args()

torch.manual_seed(args.seed)
text = "".join(read_documents("shakespeare"))[:400_000]
chars = sorted(set(text))
data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
block = 64

model = build(ModelConfig(name="gpt-example", family="gpt", vocab_size=len(chars), d_model=128, n_layer=4,
                          n_head=4, max_seq_len=block))

backend = cstorch.backend(args.backend, artifact_dir=args.artifact_dir,
                          cluster_config=cstorch.distributed.ClusterConfig(num_csx=args.num_csx))
compiled_model = cstorch.compile(model, backend)

optimizer = cstorch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
scheduler = cstorch.optim.lr_scheduler.LinearLR(optimizer, initial_learning_rate=3e-3, end_learning_rate=3e-4,
                                                total_iters=args.steps)
loss_fn = torch.nn.CrossEntropyLoss()
if args.sparsity is not None:
    sparsity = cstorch.sparse.configure({"algorithm": "static", "sparsity": args.sparsity})
    model.apply(sparsity)
    optimizer.apply(sparsity)


@cstorch.trace
def training_step(inputs, targets):
    logits = compiled_model(inputs)
    loss = loss_fn(logits.view(-1, logits.size(-1)), targets.view(-1))
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    scheduler.step()
    return loss


@cstorch.step_closure
def print_loss(loss, step):
    rate = executor.profiler.rate_tracker.global_rate()
    print(f"step {step:4d}  loss {loss.item():.4f}  {rate:,.0f} samples/s", flush=True)


@cstorch.checkpoint_closure
def save_checkpoint(step):
    path = f"{args.artifact_dir}/checkpoint_{step}.mdl"
    cstorch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                  "schedulers": [scheduler.state_dict()], "global_step": step}, path)
    print(f"saved {path}", flush=True)


def input_fn(batch_size):
    windows = data[: (len(data) - 1) // block * block + 1]
    x = windows[:-1].view(-1, block)
    y = windows[1:].view(-1, block)
    dataset = torch.utils.data.TensorDataset(x, y)
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True,
                                       generator=torch.Generator().manual_seed(args.seed))


dataloader = cstorch.utils.data.DataLoader(input_fn, 32)
executor = cstorch.utils.data.DataExecutor(dataloader, num_steps=args.steps, checkpoint_steps=args.checkpoint_steps)
for inputs, targets in executor:
    loss = training_step(inputs, targets)
    print_loss(loss, executor.user_iteration)
    save_checkpoint(executor.user_iteration)
