"""A plain DDP training script of the PyTorch-tutorial kind, made elastic with elastic_train.

Own model, own optimizer, own Dataset and DataLoader, own loop; the lines marked ``# elastic`` are all it
takes (docs/own-loop.md explains each). Without torchrun it trains a world of one, 4 epochs of 15 steps
(``--epochs`` sets the length; ``--float64`` trains in double precision):

.. doc-test: covered="tests/integration/test_own_loop.py::test_a_world_of_one_as_shipped"

    python examples/own_loop.py

On every node, as any torchrun script (with an etcd at 127.0.0.1:2379: ``elastic-train etcd`` serves one):

.. doc-test: etcd=127.0.0.1:2379 nodes=2 shrink="--epochs 1"

    torchrun --nnodes=2:4 --nproc-per-node=1 --max-restarts=100 --rdzv-backend=etcd3 \\
             --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=job-42 examples/own_loop.py

A whole job on this machine, node 1 killed with SIGKILL after step 30 and a node added after step 60; 300
epochs, so that the new node, starting beside three busy workers, joins before training ends:

.. doc-test: shrink="--epochs 8" covered="tests/integration/test_own_loop.py::test_local_entry_kill_and_join"

    elastic-train local --nodes 3 --min-nodes 2 --max-nodes 4 --kill-node 1@step=30 --add-node @step=60 \\
        --summary run.json --entry examples/own_loop.py --epochs 300

A node that dies costs at most the step it was in: the others resume from their shared-memory snapshot. A
job that is stopped entirely resumes from the last durable checkpoint (``--checkpoint``, every
``--checkpoint-every`` steps). Each epoch trains every sample exactly once, whatever the world size did.
With ``--shares speed`` a slow node trains a smaller share of each step, by its measured speed
(docs/stragglers.md).
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset

import elastic_train as et  # elastic


class Waves(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A synthetic regression set: y = sin(x · w) + 0.3 · (x · v), plus noise; fixed by its seed."""

    def __init__(self, n: int, dim: int = 8, seed: int = 1234, dtype: torch.dtype = torch.float32) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, dim, generator=gen, dtype=torch.float64)
        w, v = torch.randn(dim, 1, generator=gen, dtype=torch.float64), torch.randn(dim, 1, generator=gen)
        noise = 0.05 * torch.randn(n, 1, generator=gen, dtype=torch.float64)
        self.y = (torch.sin(self.x @ w) + 0.3 * (self.x @ v.double()) + noise).to(dtype)
        self.x = self.x.to(dtype)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Net(torch.nn.Module):
    def __init__(self, dim: int = 8, hidden: int = 32) -> None:
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Linear(dim, hidden),
            torch.nn.Tanh(),
            torch.nn.Linear(hidden, hidden),
            torch.nn.Tanh(),
            torch.nn.Linear(hidden, 1),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.body(x)
        return out


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--samples", type=int, default=240, help="dataset size")
    p.add_argument("--global-batch", type=int, default=16, help="samples per step over all ranks")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes")
    p.add_argument("--checkpoint", default="checkpoints", help="checkpoint root, any fsspec URL")
    p.add_argument("--checkpoint-every", type=int, default=10, help="durable checkpoint every N steps")
    p.add_argument("--float64", action="store_true", help="train in double precision")
    p.add_argument(
        "--shares",
        choices=("even", "speed"),
        default="even",
        help="split each step evenly over the ranks, or by their measured speeds (docs/stragglers.md)",
    )
    return p.parse_args()


def main() -> None:
    args = parse_args()
    world = et.init()  # elastic: replaces init_process_group + set_device
    dtype = torch.float64 if args.float64 else torch.float32
    torch.manual_seed(args.seed)  # the same initial weights on every rank

    dataset = Waves(args.samples, dtype=dtype)
    model = Net().to(world.device, dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    steps_per_epoch = math.ceil(len(dataset) / args.global_batch)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * steps_per_epoch)

    shares = args.shares  # even, or by the ranks' measured speeds
    sampler = et.ElasticBatchSampler(dataset, args.global_batch, seed=args.seed, shares=shares)  # elastic
    loader = DataLoader(
        dataset,
        batch_sampler=sampler,  # elastic: replaces batch_size=, shuffle=, sampler=DistributedSampler(...)
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
    )
    state = et.TrainState(model=model, optimizer=optimizer, scheduler=scheduler, sampler=sampler)  # elastic

    def train(world: et.World) -> None:  # elastic: re-entered when the group re-forms in-process
        with et.Checkpointer(state, args.checkpoint, every_steps=args.checkpoint_every) as ckpt:  # elastic
            ckpt.restore()  # elastic: replaces loading snapshot.pt
            ddp = DDP(model, device_ids=world.device_ids)
            et.time_collectives(ddp, ckpt.clock)  # elastic: a rank's work told from its wait (slow nodes)

            for epoch in range(sampler.epoch, args.epochs):  # elastic: start at the restored epoch
                for x, y in loader:
                    x, y = x.to(world.device), y.to(world.device)
                    loss = F.mse_loss(ddp(x), y)
                    (loss * sampler.loss_weight()).backward()  # elastic: uneven shares weigh by sample count
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    scheduler.step()
                    ckpt.commit(loss)  # elastic: replaces the every-N-epochs torch.save
                    if world.is_main and ckpt.step % 20 == 0:
                        print(f"epoch {epoch} step {ckpt.step} loss {loss.item():.5f}", flush=True)

            ckpt.finalize()  # elastic: the final checkpoint
        del ddp

    et.run(train)  # elastic: survivors of a node failure keep this process
    et.shutdown()  # elastic: replaces destroy_process_group


if __name__ == "__main__":
    main()
