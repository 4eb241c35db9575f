"""A holder reads (and hashes) its shared-memory slot on a thread of its own, a few chunks ahead of the one it
sends or lands: every byte still lands in place, the hash still sees every chunk in order, and a read that
fails ends the restore with that error and leaves no thread behind."""

from __future__ import annotations

import threading

import pytest
import torch

from elastic_train.checkpoint import transfer
from elastic_train.checkpoint.codec import Flat, flatten, tensor_at
from elastic_train.checkpoint.errors import CheckpointError
from elastic_train.checkpoint.slots import DataCheck, checksum


def many_loose() -> dict:
    """Big tensors (read in place) with small ones between them: many loose chunks, so that the bounce
    buffers are reused several times over."""
    gen = torch.Generator().manual_seed(7)
    big = transfer.DIRECT_MIN // 4 + 11
    out: dict = {}
    for i in range(24):
        out[f"s{i:02d}"] = torch.rand(3 + i, generator=gen)
        out[f"w{i:02d}"] = torch.rand(big, generator=gen)
    return out


class BufReader:
    """A slot in memory, read like :class:`~elastic_train.checkpoint.slots.SlotReader`; optionally slow
    (so that the sending side is ahead) or failing at byte ``fail_at``."""

    def __init__(self, buf: torch.Tensor, fail_at: int | None = None) -> None:
        self.buf, self.fail_at, self.reads = buf, fail_at, 0

    def read_into(self, start: int, dest: torch.Tensor) -> None:
        if self.fail_at is not None and start <= self.fail_at < start + dest.numel():
            raise CheckpointError("shared-memory snapshot ended while a restore read it (0)")
        dest.copy_(self.buf[start : start + dest.numel()])
        self.reads += 1


def slot_of(state: dict) -> tuple[Flat, torch.Tensor]:
    flat = flatten(state)
    buf = torch.zeros(flat.nbytes, dtype=torch.uint8)
    for s, t in zip(flat.specs, flat.tensors, strict=True):
        tensor_at(buf, s).copy_(t)
    return flat, buf


def readers_alive() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "restore-reader"]


@pytest.mark.parametrize(("window", "ahead"), [(1, 1), (4, 2), (2, 6)])
def test_every_byte_lands_in_place_and_is_hashed_in_order(monkeypatch, window: int, ahead: int) -> None:
    monkeypatch.setattr(transfer, "WINDOW", window)
    monkeypatch.setattr(transfer, "AHEAD", ahead)
    monkeypatch.setattr(transfer, "BUCKET", 64 << 10)  # loose chunks of several pieces, big tensors cut up
    flat, buf = slot_of(many_loose())
    chunks = transfer.chunks_of(flat.specs, flat.nbytes)
    loose = [c for c in chunks if not c[2]]
    assert len(loose) > 2 * (window + ahead + 2), "the bounce buffers are reused"
    pairs = zip(flat.specs, flat.tensors, strict=True)
    live = [torch.zeros_like(t) if s.path.startswith("/w") else None for s, t in pairs]
    landing = transfer.Landing(flat.specs, live)
    check = DataCheck(checksum(memoryview(buf.numpy().data)), flat.nbytes)
    reader = BufReader(buf)
    transfer.land_own(reader, chunks, landing, check)
    assert check.ok()
    assert reader.reads == len(chunks)
    for s, t, got, mine in zip(flat.specs, flat.tensors, landing.tensors, live, strict=True):
        assert torch.equal(got, t), s.path
        if mine is not None:
            assert got is mine, s.path
    assert not readers_alive()


def test_a_torn_byte_fails_the_check_that_the_reader_thread_kept() -> None:
    flat, buf = slot_of(many_loose())
    expected = checksum(memoryview(buf.numpy().data))
    buf[flat.nbytes // 3] ^= 1
    check = DataCheck(expected, flat.nbytes)
    landing = transfer.Landing(flat.specs)
    transfer.land_own(BufReader(buf), transfer.chunks_of(flat.specs, flat.nbytes), landing, check)
    assert not check.ok()


def test_a_read_that_fails_ends_the_restore_with_its_error_and_no_thread_left() -> None:
    flat, buf = slot_of(many_loose())
    check = DataCheck(checksum(memoryview(buf.numpy().data)), flat.nbytes)
    reader = BufReader(buf, fail_at=flat.nbytes // 2)
    with pytest.raises(CheckpointError, match="ended while a restore read it"):
        transfer.land_own(
            reader, transfer.chunks_of(flat.specs, flat.nbytes), transfer.Landing(flat.specs), check
        )
    assert not check.ok()
    assert not readers_alive()


def test_a_failure_on_the_sending_side_stops_the_reader(monkeypatch) -> None:
    """The sending thread gives up (here: landing a loose chunk fails) while the reader is blocked on a full
    queue: the reader stops instead of waiting for a taker forever."""
    monkeypatch.setattr(transfer, "AHEAD", 1)
    flat, buf = slot_of(many_loose())
    landing = transfer.Landing(flat.specs)

    def broken(start: int, data: torch.Tensor) -> None:
        raise RuntimeError("landing failed")

    monkeypatch.setattr(landing, "land", broken)
    reader = BufReader(buf)
    chunks = transfer.chunks_of(flat.specs, flat.nbytes)
    with pytest.raises(RuntimeError, match="landing failed"):
        transfer.land_own(reader, chunks, landing, None)
    assert not readers_alive()
    assert reader.reads < len(chunks)
