"""Checkpoint benchmark: training-loop stall per checkpoint and durable throughput, against the limits.

For each state size (model + Adam moments, float32) it measures in one run, median of repeats (each
measurement starts after ``sync`` on a quiet disk, and the order of the methods rotates between repeats):

- ``shm_copy``: copying the state into pre-allocated shared memory (the floor for any stall);
- ``raw_write``: writing the same bytes into a new file with os.write + fsync (the floor for durable time
  of a writer that allocates new files, as torch.save and DCP do; the target is stated against it);
- ``raw_overwrite``: the same, over an existing file of that size (no block allocation): the floor for a
  writer that reuses retired files, as this manager does on local disks;
- ``torch_save``: torch.save + fsync (synchronous: stall = write);
- ``dcp``: torch.distributed.checkpoint.save with FsspecWriter (synchronous);
- ``elastic_train``: CheckpointManager.save with the memory tier on and a durable checkpoint due (stall = the
  save call; durable = until the commit, manifest and latest included).

Ratios printed:

- stall / shm copy (target <= 1.5): the median over repeats of each save's stall divided by a shared-memory
  copy of the same state timed right before it, so a slow moment of a shared machine slows both sides of
  a ratio (the ratio of the two medians is kept as ``stall_over_shm_copy_unpaired``);
- durable throughput / raw write (target >= 0.8) and / DCP (target >= 1);
- durable throughput / raw overwrite: how close the manager comes to the disk's limit for what it does.

Usage: ``python benchmarks/checkpoint.py [--quick] [--json FILE]``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch

from elastic_train.checkpoint import CheckpointConfig, CheckpointManager
from elastic_train.checkpoint.codec import copy_into, flatten
from elastic_train.log import LoggingConfig, configure_logging

MB = 1_000_000


def make_state(total_bytes: int, layers: int = 24) -> dict[str, Any]:
    """A model + Adam state of about ``total_bytes`` (parameters, exp_avg, exp_avg_sq: 3 x 4 bytes each)."""
    per = max(1, total_bytes // (12 * layers))
    params = {f"layers.{i}.weight": torch.randn(per) for i in range(layers)}
    opt_state = {
        i: {"step": torch.tensor(10.0), "exp_avg": torch.randn(per), "exp_avg_sq": torch.rand(per)}
        for i in range(layers)
    }
    return {
        "model": params,
        "optimizer": {"state": opt_state, "param_groups": [{"lr": 1e-3, "params": list(range(layers))}]},
        "sampler": {"epoch": 0, "cursor": 1234, "seed": 0},
        "step": 10,
    }


def timed(fn: Callable[[], Any], repeats: int, setup: Callable[[], Any] | None = None) -> float:
    times = []
    for _ in range(repeats):
        if setup:
            setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def dirty_bytes() -> int:
    """Dirty plus under-writeback page-cache bytes (Linux /proc/meminfo; 0 elsewhere)."""
    total = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(("Dirty:", "Writeback:")):
                total += int(line.split()[1]) * 1024
    return total


def quiet_disk(limit: int = 8 << 20, timeout: float = 10.0) -> None:
    """Flush the page cache and wait (bounded) until what other writers leave dirty is small."""
    os.sync()
    deadline = time.monotonic() + timeout
    while dirty_bytes() > limit and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def bench_size(size_mb: int, repeats: int, workdir: str) -> dict[str, Any]:
    state = make_state(size_mb * MB)
    flat = flatten(state)
    nbytes = flat.nbytes
    out: dict[str, Any] = {"size_mb": round(nbytes / MB, 1)}

    # Shared-memory copy (pre-allocated, pages already touched).
    shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else workdir
    shm_path = os.path.join(shm_dir, f"et-bench-{os.getpid()}")
    fd = os.open(shm_path, os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, nbytes)
    mm = mmap.mmap(fd, nbytes)
    os.close(fd)
    shm_buf = torch.frombuffer(mm, dtype=torch.uint8)
    copy_into(flat, shm_buf)

    # The durable methods run interleaved (one round of every method per repeat) so that the disk's
    # fluctuations on a shared machine hit all of them alike; medians per method.
    buf = torch.empty(nbytes, dtype=torch.uint8)
    copy_into(flat, buf)
    raw_path = os.path.join(workdir, "raw.bin")
    over_path = os.path.join(workdir, "overwrite.bin")
    ts_path = os.path.join(workdir, "state.pt")
    dcp_dir = os.path.join(workdir, "dcp")
    mv = memoryview(buf.numpy())

    def write_fsync(path: str, flags: int) -> None:
        fd = os.open(path, flags, 0o644)
        view = mv
        while view:
            view = view[os.write(fd, view) :]
        os.fsync(fd)
        os.close(fd)

    def raw() -> None:
        write_fsync(raw_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)

    def overwrite() -> None:
        write_fsync(over_path, os.O_WRONLY)

    def tsave() -> None:
        torch.save(state, ts_path)
        fsync_path(ts_path)

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    def dsave() -> None:
        dcp.save(state, storage_writer=FsspecWriter(dcp_dir, sync_files=True))

    mem_dir = tempfile.mkdtemp(dir=shm_dir, prefix="et-bench-mem-")
    cfg = CheckpointConfig(
        url=os.path.join(workdir, "et"), every_steps=1, keep_last=1, memory_every_steps=1, memory_dir=mem_dir
    )
    mgr = CheckpointManager(cfg, "bench", rank=0, world_size=1, local_rank=0)
    step = [0]
    stalls: list[float] = []
    paired: list[float] = []  # a shared-memory copy right before each timed save: the same moment's limit
    durables: list[float] = []

    def ours(timed_run: bool = True) -> None:
        step[0] += 1
        t = time.perf_counter()
        copy_into(flat, shm_buf)
        copy = time.perf_counter() - t
        t = time.perf_counter()
        mgr.save(step[0], state)
        stall = time.perf_counter() - t
        mgr.wait()
        assert mgr.last_committed is not None and mgr.last_committed.step == step[0]
        if timed_run:
            stalls.append(stall)
            paired.append(copy)
            durables.append(mgr.last_committed.seconds)

    for _ in range(3):  # the first saves allocate shared memory and touch each slot once: not timed
        ours(timed_run=False)
    raw()  # the file raw_overwrite rewrites: allocated once, like the manager's retired share
    os.replace(raw_path, over_path)
    samples: dict[str, list[float]] = {
        "shm_copy_s": [],
        "raw_write_s": [],
        "raw_overwrite_s": [],
        "torch_save_s": [],
        "dcp_s": [],
    }
    import warnings

    methods: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
        ("shm_copy_s", lambda: copy_into(flat, shm_buf), lambda: None),
        ("raw_write_s", raw, lambda: _rm(raw_path)),
        ("raw_overwrite_s", overwrite, lambda: None),
        ("torch_save_s", tsave, lambda: _rm(ts_path)),
        ("dcp_s", dsave, lambda: shutil.rmtree(dcp_dir, ignore_errors=True)),
        ("elastic_train", ours, lambda: None),
    ]
    for rep in range(repeats):
        # Each method starts on a quiet disk (no dirty pages left by the one before), and the order rotates
        # from one repeat to the next, so no method always follows the same neighbour.
        for key, fn, clean in methods[rep % len(methods) :] + methods[: rep % len(methods)]:
            clean()
            quiet_disk()
            if key == "elastic_train":
                fn()
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t = time.perf_counter()
                fn()
                samples[key].append(time.perf_counter() - t)
            clean()
    for key, vals in samples.items():
        out[key] = statistics.median(vals)
    shm_buf = torch.empty(0, dtype=torch.uint8)  # drop the view so the mapping can close
    mm.close()
    _rm(shm_path)
    # Memory-only steps (no durable checkpoint due): the stall of most steps.
    mgr.cfg.every_steps = 10**9
    mem_only = []
    for _ in range(repeats):
        step[0] += 1
        t = time.perf_counter()
        mgr.save(step[0], state)
        mem_only.append(time.perf_counter() - t)
        assert mgr.memory is not None
        mgr.memory.wait_idle()
    mgr.close(release_memory=True)
    shutil.rmtree(mem_dir, ignore_errors=True)
    shutil.rmtree(os.path.join(workdir, "et"), ignore_errors=True)
    _rm(over_path)
    out["et_stall_s"] = statistics.median(stalls)
    out["et_memory_step_stall_s"] = statistics.median(mem_only)
    out["et_durable_s"] = statistics.median(durables)
    out["samples"] = {
        **samples,
        "et_durable_s": durables,
        "et_stall_s": stalls,
        "paired_shm_copy_s": paired,
    }

    b = nbytes
    out["throughput_mb_s"] = {
        "shm_copy": b / out["shm_copy_s"] / MB,
        "raw_write": b / out["raw_write_s"] / MB,
        "raw_overwrite": b / out["raw_overwrite_s"] / MB,
        "torch_save": b / out["torch_save_s"] / MB,
        "dcp": b / out["dcp_s"] / MB,
        "elastic_train": b / out["et_durable_s"] / MB,
    }
    tp = out["throughput_mb_s"]
    out["ratios"] = {
        "stall_over_shm_copy": statistics.median(a / b for a, b in zip(stalls, paired, strict=True)),
        "stall_over_shm_copy_unpaired": out["et_stall_s"] / out["shm_copy_s"],
        "memory_step_stall_over_shm_copy": out["et_memory_step_stall_s"] / out["shm_copy_s"],
        "durable_over_raw_write": tp["elastic_train"] / tp["raw_write"],
        "durable_over_raw_overwrite": tp["elastic_train"] / tp["raw_overwrite"],
        "durable_over_dcp": tp["elastic_train"] / tp["dcp"],
        "durable_over_torch_save": tp["elastic_train"] / tp["torch_save"],
    }
    return out


#: The seconds of each way to save, as the figures show them.
SECONDS = {
    "et_stall_s": "elastic_train stall (durable due)",
    "et_memory_step_stall_s": "elastic_train stall (memory only)",
    "shm_copy_s": "shm copy",
    "torch_save_s": "torch.save",
    "dcp_s": "DCP save",
    "raw_write_s": "raw write",
    "raw_overwrite_s": "raw overwrite",
    "et_durable_s": "elastic_train durable",
}
#: The target ratios, their bars and how the figures name them.
RATIOS = {
    "stall_over_shm_copy": ("stall / shm copy", "<=", 1.5),
    "durable_over_raw_write": ("durable / raw write", ">=", 0.8),
    "durable_over_dcp": ("durable / DCP", ">=", 1.0),
    "durable_over_raw_overwrite": ("durable / raw overwrite", None, None),
}


def summary(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` (its ``results``) with what the report shows: figures per size and the two targets."""
    results = sorted(doc["results"], key=lambda r: r["size_mb"])
    figures = []
    for r in results:
        row: dict[str, Any] = {"state MB": r["size_mb"]}
        row |= {label: r[key] for key, label in SECONDS.items()}
        for key, (label, op, bar) in RATIOS.items():
            row[f"{label} ({op} {bar:g})" if op else label] = r["ratios"][key]
        figures.append(row)
    sizes = [f"{r['size_mb']:g} MB" for r in results]
    stall = [r["ratios"]["stall_over_shm_copy"] for r in results]
    raw = [r["ratios"]["durable_over_raw_write"] for r in results]
    dcp = [r["ratios"]["durable_over_dcp"] for r in results]
    targets = [
        {
            "name": "checkpoint stall of the training loop",
            "threshold": "<= 1.5x a plain shared-memory copy, every size",
            "figure": ", ".join(f"{s}: {x:.2f}x" for s, x in zip(sizes, stall, strict=True)),
            "status": "met" if all(x <= 1.5 for x in stall) else "missed",
            "why": "a checkpoint costs the loop little more than copying the state once",
        },
        {
            "name": "durable checkpoint throughput",
            "threshold": ">= 80% of raw write and >= torch DCP, every size",
            "figure": ", ".join(
                f"{s}: {a:.0%} of raw, {b:.2f}x DCP" for s, a, b in zip(sizes, raw, dcp, strict=True)
            ),
            "status": "met" if all(a >= 0.8 for a in raw) and all(b >= 1.0 for b in dcp) else "missed",
            "why": "the background writer keeps up with the disk and with torch's own checkpointing",
        },
    ]
    return doc | {
        "title": "Checkpoint stall and throughput",
        "description": (
            f"Median of {doc['repeats']} repeats per size, torch {doc['torch']}, {doc['cpus']} CPUs: seconds "
            "of each way to save (a stall is what the training loop waits per checkpoint, durable is until "
            "the commit), and the ratios the targets are about (stall / shm copy is paired per save)."
        ),
        "figures": figures,
        "targets": targets,
    }


def _rm(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="50 and 200 MB only")
    ap.add_argument("--sizes", type=int, nargs="*", help="state sizes in MB (default 50 200 1000)")
    ap.add_argument("--repeats", type=int, default=7, help="repeats per measurement (median)")
    ap.add_argument("--dir", default=None, help="directory on the disk to measure (default: a temp dir here)")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON")
    args = ap.parse_args(argv)
    configure_logging(LoggingConfig(level="warning"))
    sizes = args.sizes or ([50, 200] if args.quick else [50, 200, 1000])
    repeats = args.repeats
    workdir = tempfile.mkdtemp(prefix="et-ckpt-bench-", dir=args.dir or os.getcwd())
    results = []
    try:
        for size in sizes:
            r = bench_size(size, repeats, workdir)
            results.append(r)
            tp, ra = r["throughput_mb_s"], r["ratios"]
            print(f"\n== state {r['size_mb']} MB (median of {repeats})")
            print(
                f"  stall per checkpoint: elastic_train {r['et_stall_s'] * 1e3:8.1f} ms"
                f"   memory-only step {r['et_memory_step_stall_s'] * 1e3:8.1f} ms"
                f"   shm copy {r['shm_copy_s'] * 1e3:8.1f} ms"
                f"   torch.save {r['torch_save_s'] * 1e3:8.1f} ms   dcp {r['dcp_s'] * 1e3:8.1f} ms"
            )
            print("  durable throughput MB/s: " + "  ".join(f"{k} {v:8.0f}" for k, v in tp.items()))
            print(
                f"  ratios: stall/shm_copy {ra['stall_over_shm_copy']:.2f} (target <= 1.5)"
                f"   memory-step/shm_copy {ra['memory_step_stall_over_shm_copy']:.2f}"
                f"   durable/raw_write {ra['durable_over_raw_write']:.2f} (target >= 0.8)"
                f"   durable/dcp {ra['durable_over_dcp']:.2f} (target >= 1)"
                f"   durable/torch.save {ra['durable_over_torch_save']:.2f}"
                f"   durable/raw_overwrite {ra['durable_over_raw_overwrite']:.2f}"
            )
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if args.json:
        meta = {
            "benchmark": "checkpoint",
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "repeats": repeats,
        }
        with open(args.json, "w") as f:
            json.dump(summary({**meta, "results": results}), f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
