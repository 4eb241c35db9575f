"""Flattening states without pickle, and the pure decisions (shares, retention, restore plan)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from elastic_train.checkpoint import CheckpointError
from elastic_train.checkpoint.codec import copy_into, flatten, model_fingerprint, tensor_at, unflatten
from elastic_train.checkpoint.policy import (
    SHARE_ALIGN,
    Candidate,
    durable_due,
    parse_step_dir,
    restore_order,
    retention,
    share_ranges,
    step_dir,
)
from elastic_train.checkpoint.specs import DTYPE_SIZES, describe_mismatch, fingerprint_from_specs


def roundtrip(state):
    flat = flatten(state)
    buf = torch.zeros(flat.nbytes, dtype=torch.uint8)
    copy_into(flat, buf)
    return unflatten(flat.skeleton, [tensor_at(buf, s) for s in flat.specs])


def test_roundtrip_keeps_types_keys_and_values():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {
        "model": {"w": t.t(), "b": torch.tensor(3.5, dtype=torch.bfloat16), "e": torch.empty(0, 2)},
        "optimizer": {
            "state": {0: {"step": torch.tensor(4.0), "exp_avg": torch.ones(3)}},
            "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": [0]}],
        },
        "rng": {
            "python": (3, tuple(range(5)), None),
            "numpy": ("MT19937", np.arange(4, dtype=np.uint32), 1),
            "flags": torch.tensor([True, False]),
        },
        "extra": {"bytes": b"\x00\xff", "nan": float("inf"), "__tensor__": 1, (1, 2): "tuple key"},
        "step": 7,
    }
    back = roundtrip(state)
    assert torch.equal(back["model"]["w"], t.t()) and back["model"]["b"].dtype == torch.bfloat16
    assert back["model"]["e"].shape == (0, 2)
    assert back["optimizer"]["state"][0]["exp_avg"].tolist() == [1, 1, 1]
    assert back["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)
    assert back["rng"]["python"] == (3, tuple(range(5)), None)
    assert isinstance(back["rng"]["numpy"][1], np.ndarray) and back["rng"]["numpy"][1].tolist() == [
        0,
        1,
        2,
        3,
    ]
    assert back["rng"]["flags"].tolist() == [True, False]
    assert back["extra"] == {"bytes": b"\x00\xff", "nan": float("inf"), "__tensor__": 1, (1, 2): "tuple key"}
    assert back["step"] == 7


def test_layout_is_aligned_and_stable():
    a, b = (
        flatten({"x": torch.ones(3), "y": torch.ones(5, dtype=torch.float64)}),
        flatten({"x": torch.zeros(3), "y": torch.zeros(5, dtype=torch.float64)}),
    )
    assert all(s.offset % 64 == 0 for s in a.specs)
    assert a.layout_key == b.layout_key
    assert flatten({"x": torch.ones(4)}).layout_key != flatten({"x": torch.ones(3)}).layout_key


def test_unsupported_values_name_their_path():
    with pytest.raises(CheckpointError, match="/extra/fn: cannot checkpoint a function"):
        flatten({"extra": {"fn": lambda: 0}})
    with pytest.raises(CheckpointError, match="only dense"):
        flatten({"m": torch.eye(2).to_sparse()})


def test_model_fingerprint_mismatch_is_one_clear_line():
    saved = flatten({"model": torch.nn.Linear(4, 2).state_dict()})
    same = model_fingerprint({"model": torch.nn.Linear(4, 2).state_dict()})
    other = model_fingerprint({"model": torch.nn.Linear(4, 3).state_dict()})
    assert describe_mismatch(fingerprint_from_specs(saved.specs), same or []) is None
    why = describe_mismatch(fingerprint_from_specs(saved.specs), other or [])
    assert why is not None and "'bias' is float32[2] in the checkpoint but float32[3]" in why
    assert "\n" not in why


def test_step_dir_names():
    assert step_dir(123) == "step-00000123" and parse_step_dir("x/step-00000123/") == 123
    assert parse_step_dir("step-12") is None and parse_step_dir("latest") is None


def test_durable_due():
    assert durable_due(10, every_steps=5, every_seconds=0, since_last=0)
    assert not durable_due(11, every_steps=5, every_seconds=0, since_last=1e9)
    assert durable_due(11, every_steps=5, every_seconds=30, since_last=31)
    assert not durable_due(3, every_steps=0, every_seconds=0, since_last=1e9)


@pytest.mark.parametrize("nbytes", [0, 100, 4096, 4097, 3 * 4096, 10_000_000, 1_000_000_007])
@pytest.mark.parametrize("world", [1, 2, 3, 7])
def test_share_ranges_tile_the_buffer_on_page_boundaries_and_balance(nbytes, world):
    ranges = share_ranges(nbytes, world)
    assert len(ranges) == world and ranges[0][0] == 0 and ranges[-1][1] == nbytes
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))  # contiguous, no overlap
    assert all(s <= e for s, e in ranges)
    assert all(s % SHARE_ALIGN == 0 for s, _ in ranges)
    sizes = [e - s for s, e in ranges]
    assert max(sizes) - min(sizes) <= 2 * SHARE_ALIGN  # each cut is within half a page of the even split
    assert ranges == share_ranges(nbytes, world)  # deterministic on every rank


def test_retention_keeps_last_k_every_n_and_the_newest():
    assert retention([1, 2, 3, 4, 5], keep_last=2, keep_every=0) == [1, 2, 3]
    assert retention([10, 20, 25, 30, 35], keep_last=1, keep_every=20) == [10, 25, 30]
    assert retention([7], keep_last=1, keep_every=0) == []


def test_restore_order_prefers_newest_and_memory_on_ties():
    assert restore_order([5, None, 7], [3, 6]) == [
        Candidate("memory", 7, 2),
        Candidate("durable", 6),
        Candidate("durable", 3),
    ]
    assert restore_order([7, 7], [7]) == [Candidate("memory", 7, 0), Candidate("durable", 7)]
    assert restore_order([None, 4], [9, 8, 2]) == [
        Candidate("durable", 9),
        Candidate("durable", 8),
        Candidate("memory", 4, 1),
        Candidate("durable", 2),
    ]
    assert restore_order([None], []) == []


def test_the_dtype_table_read_without_torch_agrees_with_torch() -> None:
    for name, size in DTYPE_SIZES.items():
        assert getattr(torch, name).itemsize == size, name
