"""Train a small LLaMA-like model with tensor parallelism inside FSDP2 (N-D parallelism).

The model is plain torch, written here; its tensor-parallel plan goes to mpaccel in the
ParallelismConfig and prepare() splits it on the mesh's tp dimension, then shards it with FSDP2
over dp_shard. The data follow a fixed random bigram table, so the loss has a floor to learn
towards (printed at the start). The run ends with a save_state checkpoint.

    mpiexec -n 4 python examples/nd_parallel.py --tp-size 2 --dp-shard-size 2
    mpiexec -n 4 python examples/nd_parallel.py --tp-size 4        # tensor parallel alone
"""

from __future__ import annotations

import argparse
import pathlib
import time

import torch
from torch import nn
from torch.utils.data import DataLoader
from train_fsdp import bigram_corpus  # the same synthetic corpus (examples/ is on sys.path)

from mpaccel import Accelerator
from mpaccel.parallelism_config import ParallelismConfig
from mpaccel.utils import (
    FullyShardedDataParallelPlugin,
    TorchTensorParallelConfig,
    set_seed,
    tqdm,
)

# Megatron's split: the projections into the heads and into the MLP by output features, the
# projections out of them by input features, so each block needs one all-reduce per half.
TP_PLAN = {
    "layers.*.attn.q": "colwise",
    "layers.*.attn.k": "colwise",
    "layers.*.attn.v": "colwise",
    "layers.*.attn.o": "rowwise",
    "layers.*.mlp.gate": "colwise",
    "layers.*.mlp.up": "colwise",
    "layers.*.mlp.down": "rowwise",
}


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q = nn.Linear(width, width, bias=False)
        self.k = nn.Linear(width, width, bias=False)
        self.v = nn.Linear(width, width, bias=False)
        self.o = nn.Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: after a colwise split each rank holds heads / tp of them
        q, k, v = (
            proj(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            for proj in (self.q, self.k, self.v)
        )
        q, k = rotate(q, *rope), rotate(k, *rope)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.gate = nn.Linear(width, hidden, bias=False)
        self.up = nn.Linear(width, hidden, bias=False)
        self.down = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(nn.functional.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """A LLaMA decoder layer: RMSNorm, rotary causal attention, RMSNorm, SwiGLU."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(width)
        self.attn = Attention(width, heads)
        self.mlp_norm = nn.RMSNorm(width)
        self.mlp = MLP(width, 4 * width)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    _no_split_modules = ["Block"]  # FSDP2 shards each block on its own

    def __init__(self, vocab: int, width: int, depth: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(Block(width, heads) for _ in range(depth))
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rope = rotary_tables(ids.shape[1], self.head_dim, ids.device)
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, rope)
        return self.head(self.norm(x))


def rotary_tables(length: int, dim: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = 1.0 / 10000 ** (torch.arange(0, dim, 2, device=device).float() / dim)
    angles = torch.outer(torch.arange(length, device=device).float(), freqs)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp-size", type=int, default=2)
    p.add_argument("--dp-shard-size", type=int, default=1)
    p.add_argument("--dp-replicate-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch-size", type=int, default=8, help="per data-parallel rank")
    p.add_argument("--context", type=int, default=32)
    p.add_argument("--vocab", type=int, default=64)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--heads", type=int, default=4, help="a multiple of --tp-size")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--output-dir", default="nd_parallel_checkpoint")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    config = ParallelismConfig(
        dp_replicate_size=args.dp_replicate_size,
        dp_shard_size=args.dp_shard_size,
        tp_size=args.tp_size,
        tp_handler=TorchTensorParallelConfig(tp_plan=TP_PLAN),
    )
    # FSDP2 over the data-parallel dimensions; tensor parallelism alone needs no plugin
    data_parallel = args.dp_shard_size * args.dp_replicate_size > 1
    plugin = (
        FullyShardedDataParallelPlugin(auto_wrap_policy="transformer_based_wrap")
        if data_parallel
        else None
    )
    accelerator = Accelerator(parallelism_config=config, fsdp_plugin=plugin)
    set_seed(args.seed)  # every rank builds the same model; prepare() splits rank 0's
    model = TinyLlama(args.vocab, args.width, args.depth, args.heads)
    total = sum(p.numel() for p in model.parameters())
    samples = args.steps * args.batch_size * args.dp_shard_size * args.dp_replicate_size
    data, floor = bigram_corpus(samples, args.context, args.vocab, args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)

    mesh = accelerator.torch_device_mesh
    local = sum(p.to_local().numel() for p in model.parameters())
    accelerator.print(
        f"{accelerator.num_processes} process(es), mesh {tuple(mesh.shape)} {mesh.mesh_dim_names}; "
        f"{total} parameters, {local} on rank 0; loss floor {floor:.3f}"
    )
    start = time.perf_counter()
    model.train()
    bar = tqdm(loader, desc="train", main_process_only=True)
    for step, (ids, targets) in enumerate(bar):
        logits = model(ids)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        # every rank of a tp group has the same loss: the mean over all is the data-parallel mean
        mean = accelerator.reduce(loss.detach(), "mean").item()
        if step % args.log_every == 0 or step == len(loader) - 1:
            accelerator.print(f"step {step} loss {mean:.4f}")
    accelerator.save_state(args.output_dir)
    files = len(list(pathlib.Path(args.output_dir).iterdir()))
    accelerator.print(f"checkpoint {args.output_dir}: {files} files")
    accelerator.print(f"done in {time.perf_counter() - start:.1f} s")
    accelerator.end_training()


if __name__ == "__main__":
    main()
