"""Where a memory restore's time goes: hashing, first touch of shared memory, gloo against a socket.

benchmarks/recovery.py times the whole restore inside a job; this times its parts in isolation on loopback, so
that a restore figure can be read as the sum of them:

- ``hash``: xxh3-64 (the slot checksum) over a state already in memory, one pass and per bucket (streaming);
- ``first touch``: reading a shared-memory snapshot a new process has just mapped (page-table faults), plain
  and with ``MAP_POPULATE``, and a holder's read per chunk: from a fresh mapping (hash, copy into the live
  tensor) against ``pread`` into the live tensor and hash it there (what a restore does now);
- ``socket``: one TCP stream over 127.0.0.1 (what recovery.py calls the loopback bandwidth);
- ``gloo``: the same bytes from one process to another as gloo broadcasts and as send/recv, per bucket size
  and number in flight, and the fixed cost of an object broadcast / all_gather of a small object.

    PYTHONPATH=. .venv/bin/python benchmarks/restore_pieces.py --mb 1000
"""

from __future__ import annotations

import argparse
import collections
import json
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import xxhash  # noqa: E402
from recovery import loopback_bandwidth  # noqa: E402

from elastic_train.net import free_port  # noqa: E402

MIB = 1 << 20


def _best(fn: Any, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def hash_rate(nbytes: int, bucket: int) -> dict[str, float]:
    """xxh3-64 bytes/s over a resident buffer: one call, and streamed per ``bucket``."""
    buf = torch.ones(nbytes, dtype=torch.uint8)
    mv = buf.numpy().data

    def once() -> None:
        xxhash.xxh3_64_intdigest(mv)

    def streamed() -> None:
        h = xxhash.xxh3_64()
        for s in range(0, nbytes, bucket):
            h.update(mv[s : s + bucket])
        h.intdigest()

    return {"one_call": nbytes / _best(once), "per_bucket": nbytes / _best(streamed)}


def first_touch(nbytes: int, directory: str) -> dict[str, float]:
    """Seconds to read (hash) a tmpfs file just mapped by this process, with and without MAP_POPULATE."""
    out: dict[str, float] = {}
    path = os.path.join(directory, f"et-pieces-{os.getpid()}")
    with open(path, "wb") as f:
        os.posix_fallocate(f.fileno(), 0, nbytes)
        for s in range(0, nbytes, 64 * MIB):
            f.write(b"\1" * min(64 * MIB, nbytes - s))
    try:
        for name, flags in (("plain", mmap.MAP_SHARED), ("populate", mmap.MAP_SHARED | mmap.MAP_POPULATE)):
            times = []
            for _ in range(3):
                fd = os.open(path, os.O_RDWR)
                t = time.perf_counter()
                mm = mmap.mmap(fd, nbytes, flags=flags)
                os.close(fd)
                mapped = time.perf_counter() - t
                xxhash.xxh3_64_intdigest(memoryview(mm))
                times.append((mapped, time.perf_counter() - t))
                mm.close()
            mapped, total = min(times, key=lambda x: x[1])
            out[f"{name}_map_s"], out[f"{name}_map_and_hash_s"] = mapped, total
        resident = torch.ones(nbytes, dtype=torch.uint8)
        out["resident_hash_s"] = _best(lambda: xxhash.xxh3_64_intdigest(resident.numpy().data))
        # What a restore's holder does per chunk: from a fresh mapping (faults, hash, copy into the live
        # tensor) against pread into the live tensor and hash it there (memory.SlotReader).
        dest = resident.numpy().data

        def mapped_copy() -> None:
            fd = os.open(path, os.O_RDONLY)
            mm = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
            os.close(fd)
            src = memoryview(mm)
            h = xxhash.xxh3_64()
            for s in range(0, nbytes, 8 * MIB):
                h.update(src[s : s + 8 * MIB])
                dest[s : s + 8 * MIB] = src[s : s + 8 * MIB]
            del src
            mm.close()

        def pread() -> None:
            fd = os.open(path, os.O_RDONLY)
            h = xxhash.xxh3_64()
            for s in range(0, nbytes, 8 * MIB):
                os.preadv(fd, [dest[s : s + 8 * MIB]], s)
                h.update(dest[s : s + 8 * MIB])
            os.close(fd)

        out["mapped_hash_copy_s"] = _best(mapped_copy)
        out["pread_hash_s"] = _best(pread)
    finally:
        os.unlink(path)
    return out


def _gloo_worker(rank: int, port: int, nbytes: int, cases: list[tuple[str, int, int]], out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    buf = torch.ones(nbytes, dtype=torch.uint8)
    results = {}
    for kind, bucket, window in cases:
        best = float("inf")
        for _ in range(3):
            dist.barrier()
            t = time.perf_counter()
            pending: collections.deque[Any] = collections.deque()
            for k, s in enumerate(range(0, nbytes, bucket)):
                data = buf[s : s + bucket]
                if kind == "broadcast":
                    w = dist.broadcast(data, src=0, async_op=True)
                elif rank == 0:
                    w = dist.isend(data, dst=1, tag=k)
                else:
                    w = dist.irecv(data, src=0, tag=k)
                pending.append(w)
                if len(pending) >= window:
                    pending.popleft().wait()
            while pending:
                pending.popleft().wait()
            dist.barrier()
            best = min(best, time.perf_counter() - t)
        results[f"{kind} {bucket // MIB} MiB x{window}"] = nbytes / best
    for name, call in (
        ("broadcast_object_list", lambda: dist.broadcast_object_list([{"a": list(range(100))}], src=0)),
        ("all_gather_object", lambda: dist.all_gather_object([None, None], {"a": 1})),
        ("barrier", dist.barrier),
    ):
        call()
        t = time.perf_counter()
        for _ in range(20):
            call()
        results[f"{name}_s"] = (time.perf_counter() - t) / 20
    if rank == 1:
        out.put(results)
    dist.destroy_process_group()


def _two_ranks(target: Any, args: tuple[Any, ...], results: int) -> list[Any]:
    """Run ``target(rank, port, *args, queue)`` as ranks 0 and 1 of a gloo group in fresh (spawned)
    processes; returns the first ``results`` items they put on the queue."""
    port = free_port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(r, port, *args, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return [q.get(timeout=600) for _ in range(results)]
    finally:
        for p in procs:
            p.join(60)


def gloo_rates(nbytes: int, cases: list[tuple[str, int, int]]) -> dict[str, float]:
    (results,) = _two_ranks(_gloo_worker, (nbytes, cases), 1)  # rank 1 reports
    return results  # type: ignore[no-any-return]


def _restore_worker(rank: int, port: int, nbytes: int, memdir: str, in_place: bool, out: Any) -> None:
    """One rank of :func:`restore_once`: rank 0 holds the snapshot (a fresh process mapping it, or with
    ``in_place`` the process that took it from its live tensor), rank 1 receives into a live tensor of the
    state's shape."""
    from elastic_train.checkpoint import CheckpointConfig, CheckpointManager

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    cfg = CheckpointConfig(url=os.path.join(memdir, "ck"), every_steps=0, memory_dir=memdir)
    if in_place and rank == 0:  # as a survivor of hot recovery: its live tensor is the snapshot's step
        live = torch.rand(nbytes // 4)
        saver = CheckpointManager(cfg, "pieces-own", rank=0, world_size=1, local_rank=0)
        saver.save(1, {"w": live, "step": 1})
        saver.close()
    else:
        live = torch.zeros(nbytes // 4)
    run = ("pieces-own" if in_place else "pieces") if rank == 0 else "none"
    # rank 1 looks in a run whose snapshot does not exist: it holds nothing
    m = CheckpointManager(cfg, run, rank=rank, world_size=2, local_rank=0, group=dist.group.WORLD)
    dist.barrier()
    t, c = time.perf_counter(), time.process_time()
    restored = m.restore(
        into=lambda specs: [live if s.path == "/w" else None for s in specs],
        live=1 if in_place and rank == 0 else None,
    )
    wall, cpu = time.perf_counter() - t, time.process_time() - c
    assert restored is not None and restored.state["w"] is live
    out.put((rank, wall, cpu))
    m.close()
    dist.barrier()
    dist.destroy_process_group()


def restore_once(nbytes: int, in_place: bool = False) -> dict[str, float]:
    """A whole memory restore with one receiver: seconds (wall and process CPU) on the holder and the
    receiver, both fresh processes (as after a restart), the holder's snapshot written by another one; with
    ``in_place`` the holder took the snapshot from its live tensor and restores as a survivor of hot
    recovery does (``restore(live=step)``: hashed and sent from there)."""
    from elastic_train.checkpoint import CheckpointConfig, CheckpointManager

    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as memdir:
        os.environ["ELASTIC_TRAIN_SHM_OWNER"] = str(os.getpid())
        cfg = CheckpointConfig(url=os.path.join(memdir, "ck"), every_steps=0, memory_dir=memdir)
        if not in_place:  # (an in-place holder takes its own)
            saver = CheckpointManager(cfg, "pieces", rank=0, world_size=1, local_rank=0)
            saver.save(1, {"w": torch.rand(nbytes // 4), "step": 1})
            saver.close()
            del saver
        got = sorted(_two_ranks(_restore_worker, (nbytes, memdir, in_place), 2))
    return {
        "holder_s": got[0][1],
        "receiver_s": got[1][1],
        "holder_cpu_s": got[0][2],
        "receiver_cpu_s": got[1][2],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=int, default=1000, help="state size in MiB")
    p.add_argument("--json", metavar="FILE", help="write the results here")
    p.add_argument(
        "--restore",
        type=int,
        metavar="N",
        help="only time N whole restores with one receiver (paired with another checkout's PYTHONPATH)",
    )
    p.add_argument(
        "--in-place",
        action="store_true",
        help="with --restore: the holder restores as a hot-recovery survivor",
    )
    args = p.parse_args(argv)
    nbytes = args.mb * MIB
    if args.restore:
        for _ in range(args.restore):
            bw = loopback_bandwidth()
            r = restore_once(nbytes, args.in_place)
            print(
                json.dumps(
                    {
                        "load": os.getloadavg()[0],
                        "socket_MBps": round(bw / 1e6),
                        "ideal_s": round(nbytes / bw, 3),
                        **{k: round(v, 3) for k, v in r.items()},
                        "receiver_over_ideal": round(r["receiver_s"] / (nbytes / bw), 2),
                    }
                ),
                flush=True,
            )
        return 0
    load = os.getloadavg()
    bw = loopback_bandwidth()
    res: dict[str, Any] = {"mb": args.mb, "load_start": load, "socket_bytes_per_s": bw}
    print(f"load {load}; loopback socket {bw / 1e9:.2f} GB/s", flush=True)
    res["hash"] = hash_rate(nbytes, 8 * MIB)
    print("hash GB/s:", {k: round(v / 1e9, 2) for k, v in res["hash"].items()}, flush=True)
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        res["first_touch"] = first_touch(nbytes, d)
    print("first touch s:", {k: round(v, 3) for k, v in res["first_touch"].items()}, flush=True)
    cases = [("broadcast", b * MIB, w) for b, w in ((1, 4), (4, 4), (8, 1), (8, 4), (32, 2), (64, 2))] + [
        ("p2p", b * MIB, w) for b, w in ((8, 4), (32, 2), (64, 2))
    ]
    res["gloo"] = gloo_rates(nbytes, cases)
    for k, v in res["gloo"].items():
        print(f"gloo {k}: " + (f"{v * 1e3:.2f} ms" if k.endswith("_s") else f"{v / bw:.2f}x socket"))
    res["load_end"] = os.getloadavg()
    print(f"load at end {res['load_end']}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
