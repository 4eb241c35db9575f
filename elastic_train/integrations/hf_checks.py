"""What :class:`~elastic_train.integrations.hf.ElasticTrainer` refuses, one line each (pure functions).

Each refused setting would break a promise silently: a sharded state the checkpoints do not hold, a data order
that is not exactly-once across resizes, a loss whose update depends on the world size, a SIGTERM that waits
on peers that are gone. Read from ``TrainingArguments`` by attribute, so a test can pass any object.
"""

from __future__ import annotations

from typing import Any

#: The sampling strategy the elastic sampler replaces (one seeded permutation per epoch).
SUPPORTED_SAMPLING = "random"
#: Process-group backends the own-loop API forms and re-forms.
SUPPORTED_BACKENDS = (None, "gloo", "nccl")

_WHO = "is not supported by ElasticTrainer"


def unsupported_arguments(args: Any) -> str | None:
    """The first setting of ``args`` (``TrainingArguments``) ElasticTrainer cannot keep its promises with, as
    one line, or None."""
    if getattr(args, "deepspeed", None):
        return (
            f"TrainingArguments(deepspeed=...) {_WHO}: DeepSpeed shards and saves the state its own way, "
            "which the per-step snapshots do not hold (ElasticTrainer is DDP)"
        )
    if getattr(args, "fsdp", None):
        return (
            f"TrainingArguments(fsdp={args.fsdp!r}) (FSDP through accelerate) {_WHO}: its sharded state is "
            "not what the per-step snapshots hold (ElasticTrainer is DDP)"
        )
    if getattr(args, "parallelism_config", None) is not None:
        return (
            f"TrainingArguments(parallelism_config=...) (tensor, context or sequence parallelism) {_WHO}: "
            "ElasticTrainer is data parallel only"
        )
    strategy = getattr(args, "train_sampling_strategy", SUPPORTED_SAMPLING)
    if strategy != SUPPORTED_SAMPLING:
        return (
            f"train_sampling_strategy={strategy!r} {_WHO}: the elastic sampler walks one seeded permutation "
            "per epoch, which is what keeps the data exactly-once across resizes (use 'random')"
        )
    if getattr(args, "dataloader_drop_last", False):
        return (
            f"dataloader_drop_last=True {_WHO}: every sample trains once per epoch (an epoch's last step is "
            "a short one)"
        )
    if getattr(args, "ignore_data_skip", False):
        return (
            f"ignore_data_skip=True {_WHO}: a resumed epoch goes on from its saved data position, never from "
            "its start (that would train its first samples twice)"
        )
    if getattr(args, "auto_find_batch_size", False):
        return (
            f"auto_find_batch_size=True {_WHO}: the micro-batch is per_device_train_batch_size at every "
            "world size (lower it if it does not fit)"
        )
    if not getattr(args, "average_tokens_across_devices", True):
        return (
            f"average_tokens_across_devices=False {_WHO}: each rank's loss would be the mean over its own "
            "tokens, and the update would depend on the world size (leave it True, the default)"
        )
    if getattr(args, "enable_jit_checkpoint", False):
        return (
            f"enable_jit_checkpoint=True {_WHO}: the state is already in a memory snapshot after every step, "
            "and a checkpoint written on SIGTERM waits for every peer, some of which may be gone"
        )
    config = getattr(args, "accelerator_config", None)
    for name in ("split_batches", "dispatch_batches"):
        if getattr(config, name, None):
            return (
                f"accelerator_config({name}=True) {_WHO}: ElasticTrainer draws every rank's share of the "
                "global batch itself"
            )
    backend = getattr(args, "ddp_backend", None)
    if backend not in SUPPORTED_BACKENDS:
        return f"ddp_backend={backend!r} {_WHO}: it forms and re-forms gloo or NCCL groups"
    return None


def unsupported_dataset(dataset: Any) -> str | None:
    """Why ``dataset`` cannot be trained exactly once across resizes, as one line, or None."""
    from torch.utils.data import IterableDataset

    if dataset is None:
        return None  # the Trainer's own error says it
    if isinstance(dataset, IterableDataset) or not hasattr(type(dataset), "__len__"):
        return (
            f"the training dataset is a {type(dataset).__name__} without a length (an IterableDataset or a "
            f"streaming dataset), which {_WHO}: exactly-once data needs a map-style dataset (len and "
            "integer indexing)"
        )
    return None
