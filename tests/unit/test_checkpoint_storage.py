"""Local share writes: O_DIRECT for page-aligned buffers, the page cache for the rest, identical bytes."""

from __future__ import annotations

import errno
import os

import pytest
import torch

from elastic_train.checkpoint import digest, durable
from elastic_train.checkpoint.codec import aligned_zeros
from elastic_train.checkpoint.storage import DIRECT_ALIGN, LocalStorage, direct_aligned

needs_direct = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")


def aligned(nbytes: int) -> torch.Tensor:
    buf = aligned_zeros(nbytes, DIRECT_ALIGN)
    buf.copy_(torch.randint(0, 256, (nbytes,), dtype=torch.uint8))
    return buf


def view(buf: torch.Tensor, start: int = 0, end: int | None = None) -> memoryview:
    return memoryview(buf.numpy())[start:end]


def test_aligned_zeros_is_aligned_and_zero():
    for n in (1, 4095, 1 << 20):
        buf = aligned_zeros(n, DIRECT_ALIGN)
        assert buf.numel() == n and buf.data_ptr() % DIRECT_ALIGN == 0 and int(buf.sum()) == 0


def test_direct_aligned_needs_aligned_starts_and_whole_pages_but_the_last():
    buf = aligned(5 * DIRECT_ALIGN)
    assert direct_aligned([view(buf, 0, 3 * DIRECT_ALIGN + 10)])
    assert direct_aligned([view(buf, 0, DIRECT_ALIGN), view(buf, 2 * DIRECT_ALIGN, 2 * DIRECT_ALIGN + 1)])
    assert not direct_aligned([view(buf, 64, DIRECT_ALIGN)])  # starts mid-page
    assert not direct_aligned([view(buf, 0, 100), view(buf, DIRECT_ALIGN)])  # second one off the page grid
    assert not direct_aligned([])


class OpenSpy:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.flags: list[int] = []
        real = os.open

        def spy(path, flags, *a, **k):  # type: ignore[no-untyped-def]
            self.flags.append(flags)
            return real(path, flags, *a, **k)

        monkeypatch.setattr(os, "open", spy)

    @property
    def direct(self) -> bool:
        return any(f & getattr(os, "O_DIRECT", 0) for f in self.flags)


@needs_direct
@pytest.mark.parametrize("nbytes", [DIRECT_ALIGN, 3 * DIRECT_ALIGN + 17, (20 << 20) + 5])
def test_aligned_share_goes_direct_and_reads_back_identical(tmp_path, monkeypatch, nbytes):
    buf = aligned(nbytes)
    storage = LocalStorage(str(tmp_path), str(tmp_path))
    spy = OpenSpy(monkeypatch)
    path = str(tmp_path / "share.bin")
    size, sha = storage.write_chunks(path, [view(buf)])
    assert spy.direct
    assert size == nbytes and os.path.getsize(path) == nbytes
    with open(path, "rb") as f:
        assert f.read() == buf.numpy().tobytes()
    assert sha == digest.digest([view(buf)])


@needs_direct
def test_unaligned_chunks_go_through_the_page_cache(tmp_path, monkeypatch):
    buf = aligned(3 * DIRECT_ALIGN)
    storage = LocalStorage(str(tmp_path), str(tmp_path))
    spy = OpenSpy(monkeypatch)
    path = str(tmp_path / "share.bin")
    chunks = [view(buf, 100, 2 * DIRECT_ALIGN), view(buf, 2 * DIRECT_ALIGN + 3)]
    size, _ = storage.write_chunks(path, chunks)
    assert not spy.direct
    with open(path, "rb") as f:
        assert f.read() == b"".join(bytes(c) for c in chunks) and size == sum(c.nbytes for c in chunks)


@needs_direct
def test_a_refused_direct_write_falls_back_to_the_page_cache(tmp_path, monkeypatch):
    buf = aligned(4 * DIRECT_ALIGN + 9)
    storage = LocalStorage(str(tmp_path), str(tmp_path))
    real, calls = os.write, []

    def write(fd, data):  # type: ignore[no-untyped-def]
        calls.append(len(data))
        if len(calls) == 1:
            raise OSError(errno.EINVAL, "Invalid argument")  # e.g. a filesystem that opens but refuses
        return real(fd, data)

    monkeypatch.setattr(os, "write", write)
    path = str(tmp_path / "share.bin")
    size, _ = storage.write_chunks(path, [view(buf)])
    with open(path, "rb") as f:
        assert f.read() == buf.numpy().tobytes() and size == buf.numel()


def test_overwriting_a_longer_file_in_place_cuts_it(tmp_path):
    path = str(tmp_path / "share.bin")
    with open(path, "wb") as f:
        f.write(b"\xff" * (3 * DIRECT_ALIGN + 500))
    inode = os.stat(path).st_ino
    for direct_io in (True, False):
        buf = aligned(DIRECT_ALIGN + 7)
        LocalStorage(str(tmp_path), str(tmp_path), direct_io=direct_io).write_chunks(path, [view(buf)])
        assert os.stat(path).st_ino == inode  # the same file, its blocks reused
        with open(path, "rb") as f:
            assert f.read() == buf.numpy().tobytes()


def test_reuse_claims_the_smallest_retired_file_that_fits_else_the_largest(tmp_path):
    storage = LocalStorage(str(tmp_path), str(tmp_path))
    pool = str(tmp_path / durable.POOL)
    os.makedirs(pool)
    for name, size in (("small", 100), ("mid", 1000), ("big", 5000)):
        with open(os.path.join(pool, name), "wb") as f:
            f.write(b"\0" * size)

    def claim(nbytes: int) -> str | None:
        target = str(tmp_path / "step" / f"for-{nbytes}.bin")
        if not durable.reuse(storage, pool, target, nbytes):
            return None
        return {100: "small", 1000: "mid", 5000: "big"}[os.path.getsize(target)]

    assert claim(900) == "mid"  # the smallest of at least 900 bytes
    assert claim(6000) == "big"  # none fits: the largest, grown by the write
    assert claim(50) == "small"
    assert claim(50) is None  # the pool is empty
    assert os.listdir(pool) == []
