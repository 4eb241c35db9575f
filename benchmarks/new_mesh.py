"""What the first training step on a new device mesh costs a sharded (FSDP2) model beyond a steady step.

DTensor caches its sharding propagation keyed by the device mesh (and the operator's argument shapes), and
the optimizer's step runs on DTensors. A group re-formed in-process at a world size this process has not
trained at gets a mesh no cache entry matches, so its first step propagates every DTensor operator again; a
group of a size seen before pays the same, because the caches are dropped whenever a group is taken down (a
stale entry would carry an earlier group's mesh: docs/sharded.md, *A pitfall of torch's DTensor*). This
measures both in one process on a one-rank gloo group, with benchmarks/sharded_task.py's model (the
transformer of examples/fsdp_train.py sharded per block, AdamW): ``--meshes`` times, a new mesh (a mesh
name not used before, so no entry matches) then ``--steps`` steps; then the last mesh again, the caches
dropped as a re-formation drops them, then the same steps. Printed: the first step and the median of the
others, per mesh, and the median extra cost of a first step.

    .venv/bin/python benchmarks/new_mesh.py --meshes 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))

from fsdp_train import Sequences  # noqa: E402
from sharded_task import Bench, shard  # noqa: E402

from elastic_train import torchcompat  # noqa: E402
from elastic_train.net import free_port  # noqa: E402


def build(mesh: object) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The benchmark's model (1 MiB of ballast) sharded over ``mesh``, seeded, with its AdamW."""
    with torch.device("meta"):
        model = Bench(1.0)
    shard(model, mesh)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            local.normal_(std=0.02)
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    return model, optim


def steps(model: torch.nn.Module, optim: torch.optim.Optimizer, n: int) -> list[float]:
    data = Sequences(64)
    x = torch.stack([data[i][0] for i in range(16)])
    y = torch.stack([data[i][1] for i in range(16)])
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        optim.zero_grad()
        model(x, y).backward()
        optim.step()
        out.append(time.perf_counter() - t0)
    return out


def row(mesh: str, times: list[float]) -> dict[str, Any]:
    """One mesh's first step and the median of its other steps."""
    return {"mesh": mesh, "first_s": times[0], "steady_s": statistics.median(times[1:])}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--meshes", type=int, default=3, help="new meshes, one after the other")
    p.add_argument("--steps", type=int, default=5, help="steps on each mesh (the first is the one timed)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.meshes < 1 or args.steps < 2:
        p.error("--meshes must be >= 1 and --steps >= 2")
    from torch.distributed.device_mesh import init_device_mesh

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    rows = []
    try:
        mesh = None
        for i in range(args.meshes):
            mesh = init_device_mesh("cpu", (1,), mesh_dim_names=(f"mesh{i}",))
            rows.append(row(f"new mesh {i}", steps(*build(mesh), args.steps)))
        torchcompat.clear_sharding_caches()
        rows.append(row("last mesh, caches dropped", steps(*build(mesh), args.steps)))
    finally:
        dist.destroy_process_group()
    print(f"{'mesh':>28} {'first step s':>13} {'steady s':>9} {'extra s':>8}")
    for r in rows:
        r["extra_s"] = r["first_s"] - r["steady_s"]
        print(f"{r['mesh']:>28} {r['first_s']:13.4f} {r['steady_s']:9.4f} {r['extra_s']:8.4f}")
    later = [r["extra_s"] for r in rows[1:]] or [rows[0]["extra_s"]]
    summary = {"extra_s_median": statistics.median(later), "rows": rows, "torch": torch.__version__}
    print(
        f"a first step on a mesh no cache entry matches costs {summary['extra_s_median']:.4f} s more than a "
        f"steady one (median of the meshes after the first, whose step also warms the process)"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
