"""An ordinary Lightning script made elastic with elastic_train: the lines marked ``# elastic``.

A LightningModule, a DataLoader, a Trainer with ModelCheckpoint and ``ckpt_path="last"``, as Lightning's own
docs have them (``import lightning as L``; a ``pytorch_lightning`` script takes the same lines);
docs/lightning.md explains each changed line. Without torchrun it trains a world of one, 4 epochs of 15 steps
(``--epochs`` sets the length; ``--float64`` trains in double precision):

.. doc-test: covered="tests/integration/test_lightning.py::test_a_world_of_one_stops_at_sigterm_and_resumes"

    python examples/lightning_train.py

On every node, as any torchrun script (with an etcd at 127.0.0.1:2379: ``elastic-train etcd`` serves one):

.. doc-test: etcd=127.0.0.1:2379 nodes=2 shrink="--epochs 1"

    torchrun --nnodes=2:4 --nproc-per-node=1 --max-restarts=100 --rdzv-backend=etcd3 \\
             --rdzv-endpoint=127.0.0.1:2379 --rdzv-id=job-42 examples/lightning_train.py

Or through ``elastic-train run``, whose fork server imports Lightning once per node rather than at every
worker start:

.. doc-test: etcd=127.0.0.1:2379 nodes=2 shrink="--epochs 1"

    elastic-train run --nodes 2:4 --endpoint 127.0.0.1:2379 --run-id job-42 \\
        --preload elastic_train.lightning --entry examples/lightning_train.py

A whole job on this machine, node 1 killed with SIGKILL after step 30 and a node added after step 60; 300
epochs, so that the new node, starting beside three busy workers, joins before training ends:

.. doc-test: shrink="--epochs 8" covered="tests/integration/test_lightning.py::test_local_entry_kill_and_join"

    elastic-train local --nodes 3 --min-nodes 2 --max-nodes 4 --kill-node 1@step=30 --add-node @step=60 \\
        --summary run.json --preload elastic_train.lightning --entry examples/lightning_train.py --epochs 300

A node that dies costs at most the step it was in; each epoch trains every sample exactly once, with the same
global batch at every world size. With ``--shares speed`` a slow node trains a smaller share of each step,
by its measured speed (docs/stragglers.md).
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, Dataset

from elastic_train.lightning import ElasticStrategy  # elastic


class Waves(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """A synthetic regression set: y = sin(x · w) + 0.3 · (x · v), plus noise; fixed by its seed."""

    def __init__(self, n: int, dim: int = 8, seed: int = 1234, dtype: torch.dtype = torch.float32) -> None:
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn(n, dim, generator=gen, dtype=torch.float64)
        w, v = torch.randn(dim, 1, generator=gen, dtype=torch.float64), torch.randn(dim, 1, generator=gen)
        noise = 0.05 * torch.randn(n, 1, generator=gen, dtype=torch.float64)
        self.x = x.to(dtype)
        self.y = (torch.sin(x @ w) + 0.3 * (x @ v.double()) + noise).to(dtype)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class Regressor(L.LightningModule):
    def __init__(self, lr: float, total_steps: int, dim: int = 8, hidden: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
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

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams["lr"], momentum=0.9)
        scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.hparams["total_steps"])
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--samples", type=int, default=240, help="dataset size")
    p.add_argument("--batch-size", type=int, default=16, help="samples per step and rank")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workers", type=int, default=0, help="DataLoader worker processes")
    p.add_argument("--root", default="lightning_logs", help="Lightning's default_root_dir (its last.ckpt)")
    p.add_argument("--checkpoint", default="checkpoints", help="elastic checkpoint root, any fsspec URL")
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
    L.seed_everything(args.seed, verbose=False)  # the same initial weights on every rank
    dataset = Waves(args.samples, dtype=torch.float64 if args.float64 else torch.float32)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    steps = args.epochs * math.ceil(len(dataset) / args.batch_size)
    model = Regressor(lr=args.lr, total_steps=steps)
    every, shares = args.checkpoint_every, args.shares  # shares: even, or by the ranks' measured speeds
    trainer = L.Trainer(
        strategy=ElasticStrategy(checkpoint=args.checkpoint, every_steps=every, shares=shares),  # elastic
        accelerator="cpu",
        devices=1,
        max_epochs=args.epochs,
        precision="64-true" if args.float64 else "32-true",
        default_root_dir=args.root,
        callbacks=[
            ModelCheckpoint(dirpath=f"{args.root}/checkpoints", save_last=True, every_n_train_steps=10)
        ],
        log_every_n_steps=5,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, loader, ckpt_path="last")


if __name__ == "__main__":
    main()
