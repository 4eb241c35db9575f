"""The Hugging Face integration's pure parts: micro-batches and their loss weights at any world size, the
sampler's epoch, and the settings it refuses (elastic_train/integrations/hf_data.py, hf_checks.py)."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest

from elastic_train.integrations.hf_checks import unsupported_arguments, unsupported_dataset
from elastic_train.integrations.hf_data import (
    MicroBatchSampler,
    accumulation,
    default_global_batch,
    epoch_micro_batches,
    micro_weights,
    split,
    step_sizes,
)


@pytest.mark.parametrize(
    ("step", "world", "micro", "expected"),
    [
        (96, 1, 32, 3),  # a world of one accumulates what the script's 3 nodes did at once
        (96, 3, 32, 1),  # the world the script was written for: one micro-batch of 32 each
        (96, 2, 32, 2),  # 48 each: two of 24
        (96, 4, 32, 1),  # 24 each, under the per-device batch
        (96, 5, 32, 1),  # 20 or 19 each
        (24, 100, 8, 1),  # a world larger than the step: one (padding) micro-batch each
        (3, 2, 1, 2),  # shares of 2 and 1: the smaller one gets a padding micro-batch
    ],
)
def test_accumulation_fits_the_largest_share_in_per_device_batches(
    step: int, world: int, micro: int, expected: int
) -> None:
    m = accumulation(step, world, micro)
    assert m == expected
    largest = -(-step // world)
    assert -(-largest // m) <= micro  # no micro-batch larger than the per-device batch


def test_split_covers_the_share_in_nearly_equal_consecutive_chunks() -> None:
    assert split([1, 2, 3, 4, 5], 2) == [[1, 2, 3], [4, 5]]
    assert split([7], 3) == [[7], [], []]
    assert split([], 1) == [[]]


def test_the_dataloader_length_is_the_epoch_in_micro_batches() -> None:
    assert step_sizes(256, 24) == [24] * 10 + [16]
    # world 2: 12 samples each per full step (2 micro-batches of 6), 8 each in the last step (1 micro-batch)
    assert epoch_micro_batches(256, 24, 2, 8) == 10 * 2 + 1
    assert epoch_micro_batches(256, 24, 1, 8) == 10 * 3 + 2
    assert epoch_micro_batches(240, 24, 3, 8) == 10


def test_default_global_batch_is_what_one_node_trains_per_step() -> None:
    assert default_global_batch(32, 2, 1) == 64
    assert default_global_batch(8, 1, 4) == 32


def test_micro_weights_make_ddp_average_the_mean_over_the_step() -> None:
    # A step of 5 samples over 2 ranks: rank 0 has 3 (2 + 1), rank 1 has 2 (1 + 1); the Trainer divides each
    # micro-batch mean by 2. Each sample's gradient must end up with weight 1/5 after DDP's average over 2.
    step, world, m = 5, 2, 2
    for counts in ([2, 1], [1, 1]):
        weights = micro_weights(counts, step, world, m)
        for k, w in zip(counts, weights, strict=True):
            per_sample = (w / m) / k / world  # (micro mean / m) * w, averaged over the world
            assert per_sample == pytest.approx(1 / step)
    assert micro_weights([0, 3], 6, 2, 2) == [0.0, 2.0]  # padding counts for nothing


def test_sampler_yields_every_sample_once_per_epoch_across_resizes() -> None:
    """Two steps at world 3, one at world 2, the rest of the epoch at world 5: every sample once, each rank's
    share in micro-batches of at most the per-device batch, padding only where a share has no sample."""
    seen: Counter[int] = Counter()
    state = MicroBatchSampler(50, 12, 4, seed=3).state_dict()
    for world, steps in ((3, 2), (2, 1), (5, 99)):
        ranks = []
        for rank in range(world):
            s = MicroBatchSampler(50, 12, 4, seed=3, world_size=world, rank=rank)
            s.load_state_dict(state)
            assert len(s) == epoch_micro_batches(50, 12, world, 4)
            ranks.append((s, iter(s)))
        for _ in range(steps):
            if ranks[0][0].epoch == 1:
                break
            for s, batches in ranks:
                size, counts = s.micro_counts()
                assert len(counts) == accumulation(size, world, 4)
                for k in counts:
                    batch = next(batches)
                    assert len(batch) == max(k, 1) <= 4
                    seen.update(batch if k else [])
                s.advance()
        state = ranks[0][0].state_dict()
    assert state["epoch"] == 1 and state["cursor"] == 0
    assert seen == Counter(range(50))


def test_speed_shares_keep_the_accumulation_and_resize_the_micro_batches() -> None:
    """Shares of 1 : 2 : 1 from step 2 on (G = 24, per-device batch 4: 2 micro-batches of 4 at even shares):
    every rank still trains 2 micro-batches a step, the fast one two of 6 (at most twice the per-device
    batch), the others two of 3; the micro-batches are the share the step's plan gives, every sample once."""
    samplers = [MicroBatchSampler(48, 24, 4, world_size=3, rank=r, shares="speed") for r in range(3)]
    for s in samplers:
        s.set_weights((1.0, 2.0, 1.0), first_step=2)
    iters = [iter(s) for s in samplers]
    seen: Counter[int] = Counter()
    for step, want in ((1, [[4, 4], [4, 4], [4, 4]]), (2, [[3, 3], [6, 6], [3, 3]])):
        for r, (s, batches) in enumerate(zip(samplers, iters, strict=True)):
            size, counts = s.micro_counts()
            assert (size, counts) == (24, want[r]), (step, r)
            drawn = [next(batches) for _ in counts]
            assert [len(b) for b in drawn] == counts
            flat = [i for b in drawn for i in b]
            assert flat == s.current().indices
            seen.update(flat)
            s.advance()
        assert len(samplers[0]) == epoch_micro_batches(48, 24, 3, 4)  # the Trainer's epoch: unchanged
    assert seen == Counter(range(48))


def test_refused_arguments_are_one_line_each() -> None:
    ok = SimpleNamespace(train_sampling_strategy="random", average_tokens_across_devices=True)
    assert unsupported_arguments(ok) is None
    cases = {
        "deepspeed": {"deepspeed": "ds.json"},
        "fsdp": {"fsdp": "full_shard"},
        "parallelism_config": {"parallelism_config": object()},
        "group_by_length": {"train_sampling_strategy": "group_by_length"},
        "dataloader_drop_last": {"dataloader_drop_last": True},
        "ignore_data_skip": {"ignore_data_skip": True},
        "auto_find_batch_size": {"auto_find_batch_size": True},
        "average_tokens_across_devices": {"average_tokens_across_devices": False},
        "enable_jit_checkpoint": {"enable_jit_checkpoint": True},
        "split_batches": {"accelerator_config": SimpleNamespace(split_batches=True)},
        "ddp_backend": {"ddp_backend": "ccl"},
    }
    for word, change in cases.items():
        reason = unsupported_arguments(SimpleNamespace(**{**vars(ok), **change}))
        assert reason is not None and word in reason and "\n" not in reason, (word, reason)
        assert "is not supported by ElasticTrainer" in reason


def test_a_dataset_without_length_is_refused() -> None:
    import torch.utils.data

    class Stream(torch.utils.data.IterableDataset[int]):
        def __iter__(self):  # type: ignore[no-untyped-def]
            yield 1

    reason = unsupported_dataset(Stream())
    assert reason is not None and "map-style" in reason
    assert unsupported_dataset([1, 2, 3]) is None
