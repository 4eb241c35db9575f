"""A small transformer language model sharded with FSDP2 (``fully_shard`` per block), made elastic.

Own model, own optimizer (AdamW) and LR schedule, own Dataset and DataLoader, own loop; the lines marked
``# elastic`` are all it takes beyond a plain FSDP2 script (docs/sharded.md explains each). Every rank holds
1/W of the weights and of the Adam moments; when a node dies or joins, the survivors keep their processes,
shard the model over the new world and take the rows they now own from each other's memory. Run it like any
torchrun script. Without torchrun it trains a world of one, 4 epochs of 12 steps (``--epochs`` sets the
length; ``--float64`` trains in double precision, ``--bf16`` computes in bfloat16 with float32 shards):

.. doc-test: shrink="--epochs 1"

    python examples/fsdp_train.py

On every node, as any torchrun script (with an etcd at 127.0.0.1:2379: ``elastic-train etcd`` serves one):

.. doc-test: etcd=127.0.0.1:2379 nodes=2 shrink="--epochs 1"

    torchrun --nnodes=2:3 --nproc-per-node=1 --max-restarts=100 --rdzv-backend=etcd3 \\
             --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=fsdp-train examples/fsdp_train.py --replicas 1

A whole job on this machine, node 1 killed with SIGKILL after step 20 and a node added after step 40:

.. doc-test: covered="tests/integration/test_fsdp_train.py::test_local_entry_kill_and_join"

    elastic-train local --nodes 3 --min-nodes 2 --max-nodes 3 --kill-node 1@step=20 --add-node @step=40 \\
        --summary run.json --entry examples/fsdp_train.py --replicas 1

``--replicas 1`` keeps a copy of each rank's shards in the memory of the next node (a node's death then costs
at most the step it was in; without it, the shards of a dead node come from the last durable checkpoint). A
job that is stopped entirely resumes from the last durable checkpoint (``--checkpoint``, a DCP directory
every ``--checkpoint-every`` steps, readable by ``torch.distributed.checkpoint.load`` at any world size).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.utils.data import DataLoader, Dataset

import elastic_train as et  # elastic
from elastic_train.checkpoint import CheckpointConfig  # elastic


class Sequences(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Token windows of a seeded stream with structure to learn: each token mostly follows from the one
    before (an affine rule modulo the vocabulary), sometimes not."""

    def __init__(self, n: int, length: int = 16, vocab: int = 32, seed: int = 1234) -> None:
        gen = torch.Generator().manual_seed(seed)
        stream = torch.empty(n + length, dtype=torch.long)
        stream[0] = 1
        noise = torch.randint(0, vocab, (n + length,), generator=gen)
        jump = torch.rand(n + length, generator=gen) < 0.15
        for i in range(1, n + length):
            stream[i] = noise[i] if jump[i] else (5 * stream[i - 1] + 3) % vocab
        self.windows = torch.stack([stream[i : i + length + 1] for i in range(n)])

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.windows[i]
        return w[:-1], w[1:]


class Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(
            torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        att = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(torch.nn.Module):
    def __init__(
        self, vocab: int = 32, dim: int = 32, layers: int = 2, heads: int = 4, length: int = 16
    ) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Parameter(torch.randn(length, dim) * 0.02)
        self.blocks = torch.nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token loss (computed here: the sharded root module then returns a fresh scalar)."""
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--samples", type=int, default=192, help="dataset size (token windows)")
    p.add_argument("--global-batch", type=int, default=16, help="windows per step over all ranks")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--checkpoint", default="checkpoints", help="checkpoint root, any fsspec URL")
    p.add_argument("--checkpoint-every", type=int, default=10, help="durable checkpoint every N steps")
    p.add_argument("--replicas", type=int, default=0, choices=(0, 1), help="keep each shard on two nodes")
    p.add_argument("--resume-from", default=None, help="a checkpoint to start from (also a plain DCP one)")
    p.add_argument("--float64", action="store_true", help="train in double precision")
    p.add_argument(
        "--bf16", action="store_true", help="compute in bfloat16 (FSDP2 mixed precision; float32 shards)"
    )
    args = p.parse_args()
    if args.bf16 and args.float64:
        p.error("--bf16 and --float64 exclude each other")
    return args


def main() -> None:
    args = parse_args()
    et.init()  # elastic: replaces init_process_group
    dtype = torch.float64 if args.float64 else torch.float32
    dataset = Sequences(args.samples)
    steps_per_epoch = math.ceil(len(dataset) / args.global_batch)
    sampler = et.ElasticBatchSampler(dataset, args.global_batch, seed=args.seed)  # elastic
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=args.workers)  # elastic: batch_sampler=
    config = CheckpointConfig(shard_replicas=args.replicas)  # elastic
    # FSDP2 mixed precision: each block all-gathers its parameters in bfloat16 and computes in it; gradients
    # are reduced in float32 into the float32 shards, which the optimizer and the checkpoints keep.
    sharding = (
        {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
        if args.bf16
        else {}
    )

    def initial_weights() -> dict[str, torch.Tensor]:
        torch.manual_seed(args.seed)  # the same initial weights at every world size
        return TinyLM().to(dtype).state_dict()

    def train(world: et.World) -> None:  # elastic: re-entered when the group re-forms in-process
        # The model belongs to the group's mesh: built again in each group, from a meta-device skeleton
        # (no memory, no initialisation), fully_shard per block, this rank's shards allocated.
        model = et.shard_model(lambda: TinyLM().to(dtype), **sharding)  # elastic: replaces fully_shard(...)
        optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
        warmup = steps_per_epoch

        def schedule(step: int) -> float:
            progress = max(0.0, (step - warmup) / max(1, args.epochs * steps_per_epoch - warmup))
            return min(1.0, (step + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        state = et.TrainState(
            model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler
        )  # elastic
        with et.Checkpointer(
            state,
            args.checkpoint,
            every_steps=args.checkpoint_every,
            resume_from=args.resume_from,
            config=config,
        ) as ckpt:
            et.time_collectives(model, ckpt.clock)  # elastic: a rank's work told from its wait (slow nodes)
            ckpt.restore()  # elastic: the newest state anywhere, resharded to this world
            if ckpt.source is None:  # elastic: nothing saved anywhere, a first start
                et.load_full(model, initial_weights())  # elastic: each rank takes its rows

            for epoch in range(sampler.epoch, args.epochs):  # elastic: start at the restored epoch
                for x, y in loader:
                    x, y = x.to(world.device), y.to(world.device)
                    loss = model(x, y)
                    (loss * sampler.loss_weight()).backward()  # elastic: uneven shares weigh by sample count
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    scheduler.step()
                    ckpt.commit(loss)  # elastic: memory snapshot every step, DCP every N
                    if world.is_main and ckpt.step % 20 == 0:
                        print(f"epoch {epoch} step {ckpt.step} loss {loss.item():.4f}", flush=True)

            ckpt.finalize()  # elastic: the final checkpoint

    et.run(train)  # elastic: survivors of a node failure keep this process
    et.shutdown()  # elastic: replaces destroy_process_group


if __name__ == "__main__":
    main()
