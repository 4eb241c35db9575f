"""An ordinary Hugging Face Trainer script made elastic with elastic_train: the lines marked ``# elastic``.

A small GPT-2 built from a config (no download: nothing is read from the Hub), trained as a causal LM on
synthetic token sequences with ``TrainingArguments``, the Trainer's own ``save_steps`` checkpoints and
``train(resume_from_checkpoint=get_last_checkpoint(...))``, as the Trainer's docs have it; docs/huggingface.md
explains each changed line. Without torchrun it trains a world of one (``--epochs`` shortens a run):

    python examples/hf_train.py --epochs 1

On every node, as any torchrun script (here with an etcd at etcd:2379):

.. doc-test: etcd=etcd:2379 nodes=2 shrink="--epochs 1"

    torchrun --nnodes=2:4 --nproc-per-node=1 --max-restarts=100 --rdzv-backend=etcd3 \\
             --rdzv-endpoint=etcd:2379 --rdzv-id=job-42 examples/hf_train.py

Or through ``elastic-train run``, whose fork server imports transformers once per node rather than at every
worker start:

.. doc-test: etcd=etcd:2379 nodes=2 shrink="--epochs 1"

    elastic-train run --nodes 2:4 --endpoint etcd:2379 --run-id job-42 \\
        --preload elastic_train.hf --entry examples/hf_train.py

A whole job on this machine, node 1 killed after step 8 and a node added after step 60 (the join lands if
the job still trains when the new node has started):

.. doc-test: shrink="--epochs 3"

    elastic-train local --nodes 3 --kill-node 1@step=8 --add-node @step=60 \\
        --preload elastic_train.hf --entry examples/hf_train.py --epochs 12

A node that dies costs at most the step it was in; each epoch trains every sample exactly once, with the same
global batch at every world size. With ``--shares speed`` a slow node trains a smaller share of each step,
by its measured speed (docs/stragglers.md).
"""

from __future__ import annotations

import argparse
import os

import torch
from torch.utils.data import Dataset
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments, set_seed
from transformers.trainer_utils import get_last_checkpoint

from elastic_train.hf import ElasticTrainer  # elastic

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is built locally


class Sequences(Dataset[dict[str, torch.Tensor]]):
    """Token sequences of two learnable kinds (counting by a stride, a repeated motif), fixed by a seed."""

    def __init__(self, n: int, length: int = 16, vocab: int = 64, seed: int = 1234) -> None:
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, vocab, (n, 1), generator=gen)
        stride = torch.randint(1, 5, (n, 1), generator=gen)
        counting = (start + stride * torch.arange(length)) % vocab
        motif = torch.randint(0, vocab, (n, 4), generator=gen).repeat(1, -(-length // 4))[:, :length]
        kind = torch.rand(n, 1, generator=gen) < 0.5
        self.tokens = torch.where(kind, counting, motif)

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.tokens[i], "labels": self.tokens[i]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--samples", type=int, default=256, help="dataset size")
    p.add_argument("--batch-size", type=int, default=8, help="per-device batch (samples per micro-batch)")
    p.add_argument("--accumulation", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--global-batch", type=int, default=24, help="samples per optimizer step, all ranks")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output-dir", default="hf_output", help="the Trainer's output_dir (its checkpoints)")
    p.add_argument("--save-steps", type=int, default=10, help="the Trainer's own checkpoint every N steps")
    p.add_argument("--checkpoint-every", type=int, default=10, help="elastic checkpoint every N steps")
    p.add_argument("--float64", action="store_true", help="train in double precision")
    p.add_argument(
        "--shares",
        choices=("even", "speed"),
        default="even",
        help="split each step evenly, or by the ranks' measured speeds (docs/stragglers.md)",
    )
    return p.parse_args()


def main() -> None:
    args = parse_args()
    set_seed(args.seed)  # the same initial weights on every rank
    config = GPT2Config(
        vocab_size=64, n_positions=32, n_embd=64, n_layer=args.layers, n_head=4,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
    )  # fmt: skip
    model = GPT2LMHeadModel(config)
    if args.float64:
        model = model.double()
    training = TrainingArguments(
        output_dir=args.output_dir,
        per_device_train_batch_size=args.batch_size,
        gradient_accumulation_steps=args.accumulation,
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
        use_cpu=not torch.cuda.is_available(),  # DDP without a GPU (the Trainer's own setting)
    )
    trainer = ElasticTrainer(  # elastic (was: Trainer)
        model=model,
        args=training,
        train_dataset=Sequences(args.samples),
        global_batch=args.global_batch,  # elastic
        every_steps=args.checkpoint_every,  # elastic
        shares=args.shares,  # elastic: even, or by the ranks' measured speeds
    )
    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    trainer.train(resume_from_checkpoint=last)


if __name__ == "__main__":
    main()
