"""The two training scripts benchmarks/lightning.py compares, run as ``elastic-train local --entry`` scripts.

    python benchmarks/lightning_worker.py elastic DELAY [examples/lightning_train.py's arguments]
    python benchmarks/lightning_worker.py plain DELAY AUDIT_DIR [the same arguments]

``elastic``: examples/lightning_train.py unchanged (``ElasticStrategy``), every step slowed by ``DELAY`` s
through the strategy's public ``hooks`` argument; its sampler writes the audit lines and its checkpointer
the progress events.

``plain``: the same model, data and Trainer settings as plain Lightning does it — ``strategy="ddp"``,
``num_nodes`` from torchrun's environment, Lightning's ``DistributedSampler``, ``ModelCheckpoint`` writing
last.ckpt every 10 steps and ``ckpt_path="last"``. A probe callback (measurement only, it changes nothing of
the training) sleeps ``DELAY`` s per step and writes the same progress events and one audit line per step
and rank with the dataset indices the rank trained.
"""

from __future__ import annotations

import math
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "lightning_train.py"
# Run as a script, this folder is first on sys.path, where benchmarks/lightning.py would shadow Lightning's
# own ``lightning`` package for the example's ``import lightning``.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]


def elastic(delay: float) -> None:
    from elastic_train import lightning

    class SlowStrategy(lightning.ElasticStrategy):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("hooks", [lambda step: time.sleep(delay)])
            super().__init__(*args, **kwargs)

    lightning.ElasticStrategy = SlowStrategy  # type: ignore[misc]  # what the example imports
    sys.argv[0] = str(EXAMPLE)
    runpy.run_path(str(EXAMPLE), run_name="__main__")


def plain(delay: float, audit_dir: str) -> None:
    import lightning.pytorch as pl  # the example's namespace
    import torch
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from torch.utils.data import DataLoader, Dataset

    from elastic_train.train.audit import AuditWriter
    from elastic_train.train.events import EventWriter
    from elastic_train.train.link import worker_env

    sys.path.insert(0, str(EXAMPLE.parent))
    from lightning_train import Regressor, Waves, parse_args

    sys.argv[0] = str(EXAMPLE)
    args = parse_args()

    class Indexed(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
        def __init__(self, inner: Waves) -> None:
            self.inner = inner

        def __len__(self) -> int:
            return len(self.inner)

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int]:
            x, y = self.inner[i]
            return x, y, i

    class Plain(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y, _ = batch
            return super().training_step((x, y), batch_idx)

    class Probe(Callback):
        """Events and audit lines as the elastic sampler and checkpointer write them; a per-step delay."""

        def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            # The round of the agent's assignment: it grows with every re-formation, a join's included
            # (torchrun's restart count grows only with failures).
            env = worker_env()
            rank, world = trainer.global_rank, trainer.world_size
            self.events = EventWriter.from_env(rank=rank, round=env.round, world_size=world)
            self.audit = AuditWriter(audit_dir, rank=rank, world_size=world, round=env.round)
            step = trainer.global_step
            if step:
                self.events.emit("resumed", step, source="last.ckpt", from_step=step)
            else:
                self.events.emit("started", 0)

        def on_train_batch_end(
            self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            time.sleep(delay)
            step = trainer.global_step
            self.audit.write(epoch=trainer.current_epoch, step=step, indices=batch[2].tolist())
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.events.emit("step", step, loss=float(loss), epoch=trainer.current_epoch)

        def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.events.emit("done", trainer.global_step)

    pl.seed_everything(args.seed, verbose=False)
    dataset = Indexed(Waves(args.samples, dtype=torch.float64 if args.float64 else torch.float32))
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    num_nodes = world // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))  # what a plain script has to do
    steps = args.epochs * math.ceil(len(dataset) / (args.batch_size * world))
    trainer = pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=1,
        num_nodes=num_nodes,
        max_epochs=args.epochs,
        precision="64-true" if args.float64 else "32-true",
        default_root_dir=args.root,
        callbacks=[
            ModelCheckpoint(dirpath=f"{args.root}/checkpoints", save_last=True, every_n_train_steps=10),
            Probe(),
        ],
        log_every_n_steps=5,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Plain(lr=args.lr, total_steps=steps), loader, ckpt_path="last")


def main() -> None:
    kind, delay = sys.argv[1], float(sys.argv[2])
    if kind == "elastic":
        del sys.argv[1:3]
        elastic(delay)
    elif kind == "plain":
        audit_dir = sys.argv[3]
        del sys.argv[1:4]
        plain(delay, audit_dir)
    else:
        sys.exit(f"lightning_worker.py: unknown kind {kind!r} (elastic or plain)")


if __name__ == "__main__":
    main()
