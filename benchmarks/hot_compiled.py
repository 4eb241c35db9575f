"""An own-loop training script whose model is ``torch.compile``d (8 small residual blocks), for ``hot.py``.

The model is compiled once per process (``dynamic=True``: one graph for every per-rank batch size, so a
change of world size does not recompile). A worker that keeps its process across a membership change (hot
recovery) keeps its compiled code; a restarted worker compiles again (from the warm inductor cache that
``hot.py`` fills first, ``TORCHINDUCTOR_CACHE_DIR``). Run it like any torchrun script, or alone (a world of
one) to warm the cache:

    python benchmarks/hot_compiled.py --steps 3 --checkpoint /tmp/ckpt
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import UTC, datetime

import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import TensorDataset

import elastic_train as et


class Block(torch.nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self, dim: int = 16, width: int = 32, blocks: int = 8) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(dim, width)
        self.blocks = torch.nn.Sequential(*[Block(width) for _ in range(blocks)])
        self.out = torch.nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.out(self.blocks(self.inp(x)))
        return out


def report_graphs(world: et.World) -> None:
    """One JSON line: how many graphs dynamo compiled in this process so far (``hot.py`` compares them
    before and after a membership change: a process that kept its compiled code compiles none)."""
    from torch._dynamo.utils import counters

    record = {
        "event": "dynamo_graphs",
        "graphs": int(counters["stats"]["unique_graphs"]),
        "pid": os.getpid(),
        "round": world.round,
        "timestamp": datetime.now(UTC).isoformat(),
    }
    print(json.dumps(record), flush=True)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200, help="optimizer steps in all")
    p.add_argument("--samples", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=24)
    p.add_argument("--checkpoint", default="checkpoints")
    p.add_argument("--checkpoint-every", type=int, default=0, help="durable checkpoint every N steps")
    p.add_argument("--no-compile", action="store_true", help="eager model (to compare)")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    et.init()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(args.samples, 16, generator=gen)
    y = torch.sin(x.sum(1, keepdim=True))
    dataset = TensorDataset(x, y)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = et.ElasticBatchSampler(dataset, args.global_batch, seed=0)
    state = et.TrainState(model=model, optimizer=optimizer, sampler=sampler)
    # compiled once per process: a group re-formed in-process calls the same compiled module again
    forward = model if args.no_compile else torch.compile(model, dynamic=True)

    def train(world: et.World) -> None:
        with et.Checkpointer(state, args.checkpoint, every_steps=args.checkpoint_every) as ckpt:
            ckpt.restore()
            ddp = DDP(forward, device_ids=world.device_ids)
            reported = False
            while ckpt.step < args.steps:
                for indices in sampler:  # the rest of the current epoch
                    loss = F.mse_loss(ddp(x[indices]), y[indices])
                    (loss * sampler.loss_weight()).backward()
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    ckpt.commit(loss)
                    if not reported:
                        report_graphs(world)  # after this group's first step: its compilations are done
                        reported = True
                    if ckpt.step >= args.steps:
                        break
            ckpt.finalize()
        del ddp

    et.run(train)
    et.shutdown()


if __name__ == "__main__":
    main()
