"""Train a small transformer language model fully sharded (FSDP2) with mpaccel.

Each rank holds 1/n of every parameter, gradient and optimizer state; the decoder blocks are
sharded one by one (auto_wrap_policy="transformer_based_wrap"). The data is generated here: token
sequences that follow a fixed random bigram table, so the loss has a floor to learn towards
(the table's entropy, printed at the start).

    mpiexec -n 2 python examples/train_fsdp.py
    mpiexec -n 4 python examples/train_fsdp.py --hybrid      # HYBRID_SHARD: mesh from the nodes
    srun --mpi=pmi2 -N 2 -n 8 python examples/train_fsdp.py --hybrid
    python examples/train_fsdp.py                           # one process
"""

from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from mpaccel import Accelerator
from mpaccel.utils import FullyShardedDataParallelPlugin, set_seed, tqdm


class DecoderBlock(nn.Module):
    """Pre-norm causal self-attention and MLP: the unit FSDP shards on its own."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    _no_split_modules = ["DecoderBlock"]  # as transformers models name their blocks

    def __init__(self, vocab: int, width: int, depth: int, heads: int, context: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(vocab, width)
        self.positions = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(DecoderBlock(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tokens(ids) + self.positions(torch.arange(ids.shape[1], device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def bigram_corpus(
    samples: int, context: int, vocab: int, seed: int
) -> tuple[TensorDataset, float]:
    """Sequences drawn from a random bigram table (the same on every rank: same seed), and the
    table's mean entropy in nats: the best loss a model can reach."""
    g = torch.Generator().manual_seed(seed)
    table = torch.softmax(3.0 * torch.randn(vocab, vocab, generator=g), dim=1)
    ids = torch.empty(samples, context + 1, dtype=torch.long)
    ids[:, 0] = torch.randint(vocab, (samples,), generator=g)
    for t in range(context):
        ids[:, t + 1] = torch.multinomial(table[ids[:, t]], 1, generator=g).squeeze(1)
    entropy = -(table * table.log()).sum(1).mean().item()
    return TensorDataset(ids[:, :-1], ids[:, 1:]), entropy


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--samples", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=16, help="per process")
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--accumulation", type=int, default=1, help="micro-batches per step")
    p.add_argument("--mixed-precision", default="no", choices=["no", "bf16"])
    p.add_argument("--hybrid", action="store_true", help="HYBRID_SHARD (shard within a node)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    plugin = FullyShardedDataParallelPlugin(
        auto_wrap_policy="transformer_based_wrap",  # the model's _no_split_modules
        sharding_strategy="HYBRID_SHARD" if args.hybrid else "FULL_SHARD",
    )
    accelerator = Accelerator(
        fsdp_plugin=plugin,
        mixed_precision=args.mixed_precision,
        gradient_accumulation_steps=args.accumulation,
    )
    set_seed(args.seed)
    data, floor = bigram_corpus(args.samples, args.context, args.vocab, args.seed)
    model = TinyLM(args.vocab, args.width, args.depth, args.heads, args.context)
    total = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    local = sum(p.to_local().numel() for p in model.parameters())
    mesh = accelerator.torch_device_mesh
    accelerator.print(
        f"{accelerator.num_processes} process(es), mesh {tuple(mesh.shape)} "
        f"{mesh.mesh_dim_names}; {total} parameters, {local} on rank 0; "
        f"loss floor {floor:.3f}"
    )
    start = time.perf_counter()
    for epoch in range(args.epochs):
        model.train()
        total_loss = torch.zeros(())
        bar = tqdm(loader, desc=f"epoch {epoch}", main_process_only=True)
        for ids, targets in bar:
            with accelerator.accumulate(model):
                logits = model(ids)
                loss = nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                optimizer.zero_grad()
            total_loss += loss.detach()
        mean = accelerator.reduce(total_loss / len(loader), "mean").item()
        accelerator.print(f"epoch {epoch} loss {mean:.4f} perplexity {math.exp(mean):.2f}")
    state = accelerator.get_state_dict(model)  # whole tensors, on rank 0
    if accelerator.is_main_process:  # the other ranks' are empty
        values = sum(v.numel() for v in state.values())
        print(f"full state dict: {len(state)} tensors, {values} values")
    accelerator.print(f"done in {time.perf_counter() - start:.1f} s")
    accelerator.end_training()


if __name__ == "__main__":
    main()
