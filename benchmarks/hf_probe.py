"""The two training scripts benchmarks/hf.py compares, run as ``elastic-train local --entry`` scripts.

    python benchmarks/hf_probe.py elastic DELAY [examples/hf_train.py's arguments]
    python benchmarks/hf_probe.py plain DELAY AUDIT_DIR [the same arguments]

``elastic``: examples/hf_train.py unchanged (``ElasticTrainer``), every step slowed by ``DELAY`` s through
its public ``hooks`` argument; its sampler writes the audit lines and its checkpointer the progress events.

``plain``: the same model, data and ``TrainingArguments`` with ``transformers.Trainer`` as a Trainer user
writes it under torchrun — a per-device batch of the global batch / 3 (so the starting world of 3 trains
the global batch), the Trainer's ``save_steps`` checkpoints and
``train(resume_from_checkpoint=get_last_checkpoint(...))``. A probe (measurement only, it changes nothing of
the training) sleeps ``DELAY`` s per step and writes the same progress events and one audit line per step
and rank with the dataset indices the rank trained: the dataset adds each sample's index, which the probe's
``compute_loss`` takes out of the batch before the model sees it.
"""

from __future__ import annotations

import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "hf_train.py"


def elastic(delay: float) -> None:
    from elastic_train import hf

    class SlowTrainer(hf.ElasticTrainer):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            kwargs.setdefault("hooks", [lambda step: time.sleep(delay)])
            super().__init__(*args, **kwargs)

    hf.ElasticTrainer = SlowTrainer  # type: ignore[misc]  # what the example imports
    sys.argv[0] = str(EXAMPLE)
    runpy.run_path(str(EXAMPLE), run_name="__main__")


def plain(delay: float, audit_dir: str) -> None:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments
    from transformers import set_seed as seed_all
    from transformers.trainer_utils import get_last_checkpoint

    from elastic_train.train.audit import AuditWriter
    from elastic_train.train.events import EventWriter
    from elastic_train.train.link import worker_env

    sys.path.insert(0, str(EXAMPLE.parent))
    from hf_train import Sequences, parse_args

    sys.argv[0] = str(EXAMPLE)
    args = parse_args()

    class Indexed(Sequences):
        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {**super().__getitem__(i), "index": torch.tensor(i)}

    trained: list[int] = []

    class Probed(Trainer):
        def compute_loss(self, model: Any, inputs: dict[str, Any], *a: Any, **k: Any) -> Any:
            if model.training:
                trained.extend(inputs.pop("index").tolist())
            else:
                inputs.pop("index", None)
            return super().compute_loss(model, inputs, *a, **k)

    class Probe(TrainerCallback):
        """Events and audit lines as the elastic sampler and checkpointer write them; a per-step delay."""

        def on_train_begin(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
            # The round of the agent's assignment: it grows with every re-formation, a join's included
            # (torchrun's restart count grows only with failures).
            env = worker_env()
            rank, world = targs.process_index, targs.world_size
            self.events = EventWriter.from_env(rank=rank, round=env.round, world_size=world)
            self.audit = AuditWriter(audit_dir, rank=rank, world_size=world, round=env.round)
            step = state.global_step
            if step:
                self.events.emit("resumed", step, source="checkpoint", from_step=step)
            else:
                self.events.emit("started", 0)

        def on_step_end(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
            time.sleep(delay)
            epoch = int(state.epoch - 1e-9) if state.epoch else 0
            self.audit.write(epoch=epoch, step=state.global_step, indices=list(trained))
            trained.clear()
            self.events.emit("step", state.global_step, epoch=epoch)

        def on_train_end(self, targs: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.events.emit("done", state.global_step)

    seed_all(args.seed)
    config = GPT2Config(
        vocab_size=64, n_positions=32, n_embd=64, n_layer=args.layers, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    if args.float64:
        model = model.double()
    training = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.global_batch // 3,
        gradient_accumulation_steps=1,
        num_train_epochs=args.epochs,
        learning_rate=args.lr,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        logging_steps=5,
        save_steps=args.save_steps,
        save_total_limit=2,
        seed=args.seed,
        report_to="none",
        disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(),
        remove_unused_columns=False,  # the probe's index reaches compute_loss
    )
    trainer = Probed(model=model, args=training, train_dataset=Indexed(args.samples), callbacks=[Probe()])
    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    trainer.train(resume_from_checkpoint=last)


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
        sys.exit(f"hf_probe.py: unknown kind {kind!r} (elastic or plain)")


if __name__ == "__main__":
    main()
