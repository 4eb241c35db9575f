"""What a plain ``transformers.Trainer`` trains across resizes, replayed in one process, against
ElasticTrainer's sampler over the same job (the baseline tests/integration/test_hf.py holds the integration
to).

    python tests/integration/hf_plain_resize.py     # prints one JSON line

The job: ``SAMPLES`` samples, per-device batch ``BATCH``, ``EPOCHS`` epochs, a Trainer checkpoint every
``SAVE`` steps (``save_steps``), ``train(resume_from_checkpoint=...)`` after every restart. It starts at world
3, a node is killed after step 5 (the group restarts at world 2 from checkpoint-4), a node joins after step 11
(world 3 again from checkpoint-10), and it runs to its end. For each world size the Trainer's own data path
is asked what each rank iterates: ``Trainer.get_train_dataloader()`` (``accelerator.prepare`` with that
rank and world), ``set_epoch``, and ``get_resumed_dataloader`` (accelerate's ``skip_first_batches``,
called by name before transformers 5.25) with the epoch and batch count ``_init_training_state`` derives
from the checkpoint's global step. accelerate sees the world of the replayed rank (its shared state's
``num_processes`` and ``process_index``); the process group it broadcasts RNG states over is a real one
of one process.

Each global step is counted from the last segment that trained it (a step redone after a restart replaces
the lost one); per epoch, samples never trained and samples trained more than once are reported for the
plain Trainer and for ElasticTrainer's :class:`MicroBatchSampler` over the same plan.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections import Counter, defaultdict
from typing import Any

import torch

SAMPLES, BATCH, EPOCHS, SAVE = 100, 8, 3, 2
#: (world size, global step it resumes from, global step after which it dies: None = runs to its end)
PLAN: list[tuple[int, int, int | None]] = [(3, 0, 5), (2, 4, 11), (3, 10, None)]


class Indexed(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.tensor([i])}


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids: torch.Tensor | None = None, labels: Any = None) -> Any:
        return {"loss": self.w.sum()}


def plain(trainer: Any) -> dict[int, tuple[int, list[int]]]:
    """Global step -> (epoch, samples trained in it) of the surviving trajectory of the plain Trainer."""
    from accelerate import skip_first_batches
    from accelerate.state import AcceleratorState, PartialState

    def loader(world: int, rank: int) -> Any:
        for shared in (PartialState._shared_state, AcceleratorState._shared_state):
            shared.update(num_processes=world, process_index=rank)
        return trainer.get_train_dataloader()

    trained: dict[int, tuple[int, list[int]]] = {}
    for world, start, dies in PLAN:
        per_epoch = len(loader(world, 0))  # the Trainer's num_update_steps_per_epoch at this world
        last = min(EPOCHS * per_epoch, dies if dies is not None else EPOCHS * per_epoch)
        first_epoch, skip = divmod(start, per_epoch)  # what _init_training_state derives
        step = start
        for epoch in range(first_epoch, EPOCHS):
            ranks = []
            for rank in range(world):
                dl = loader(world, rank)
                if epoch == first_epoch and skip:
                    resumed = getattr(trainer, "get_resumed_dataloader", None)  # transformers >= 5.25
                    dl = resumed(dl, skip) if resumed else skip_first_batches(dl, skip)
                dl.set_epoch(epoch)
                ranks.append([b["input_ids"].flatten().tolist() for b in dl])
            for batches in zip(*ranks, strict=True):
                step += 1
                if step > last:
                    break
                trained[step] = (epoch, [i for b in batches for i in b])
            if step >= last:
                break
    return trained


def elastic() -> dict[int, tuple[int, list[int]]]:
    """The same worlds through ElasticTrainer's sampler, each resuming from the last step of the one before
    (a survivor's memory snapshot holds it, with the data position)."""
    from elastic_train.integrations.hf_data import MicroBatchSampler

    global_batch = BATCH * PLAN[0][0]
    trained: dict[int, tuple[int, list[int]]] = {}
    state, step = MicroBatchSampler(SAMPLES, global_batch, BATCH).state_dict(), 0
    for world, _, dies in PLAN:
        while state["epoch"] < EPOCHS and (dies is None or step < dies):
            taken: list[int] = []
            for rank in range(world):
                s = MicroBatchSampler(SAMPLES, global_batch, BATCH, world_size=world, rank=rank)
                s.load_state_dict(state)
                taken += s.current().indices
                s.advance()
            step += 1
            trained[step] = (int(state["epoch"]), taken)
            state = s.state_dict()
    return trained


def count(trained: dict[int, tuple[int, list[int]]]) -> dict[str, int]:
    per_epoch: dict[int, Counter[int]] = defaultdict(Counter)
    for epoch, indices in trained.values():
        per_epoch[epoch].update(indices)
    lost = sum(SAMPLES - len(per_epoch[e]) for e in range(EPOCHS))
    twice = sum(sum(per_epoch[e].values()) - len(per_epoch[e]) for e in range(EPOCHS))
    return {"lost": lost, "duplicated": twice, "steps": max(trained), "expected": SAMPLES * EPOCHS}


def main() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    from elastic_train.net import free_port

    os.environ["MASTER_PORT"] = str(free_port("127.0.0.1"))
    from transformers import Trainer, TrainingArguments

    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=BATCH, num_train_epochs=EPOCHS, save_steps=SAVE,
            use_cpu=True, report_to="none", disable_tqdm=True, seed=0,
        )  # fmt: skip
        trainer = Trainer(model=Model(), args=args, train_dataset=Indexed())
        result = {"plain": count(plain(trainer)), "elastic": count(elastic())}
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
