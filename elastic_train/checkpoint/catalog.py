"""What ``elastic-train ckpt`` does: list, show, verify, export and remove durable checkpoints."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import torch

from elastic_train.checkpoint import durable
from elastic_train.checkpoint.codec import tensor_at, unflatten
from elastic_train.checkpoint.errors import CheckpointError, CheckpointNotFound
from elastic_train.checkpoint.policy import parse_step_dir
from elastic_train.checkpoint.storage import open_storage


def _options(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in args.storage_option:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CheckpointError(f"--storage-option {item!r}: expected KEY=VALUE")
        out[key] = value
    return out


def _open(args: argparse.Namespace) -> tuple[Any, str]:
    storage = open_storage(args.url, _options(args))
    return storage, storage.root


def _newest_valid(storage: Any, path: str) -> durable.Entry:
    _, entries = durable.resolve(storage, path)
    if not entries:
        raise CheckpointNotFound(f"{path}: no checkpoints here")
    if len(entries) == 1 and entries[0].problem:
        raise CheckpointError(f"{entries[0].path}: not a valid checkpoint: {entries[0].problem}")
    for e in entries:
        if e.valid:
            return e
    raise CheckpointNotFound(f"{path}: no valid checkpoint ({len(entries)} invalid)")


def _mb(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def cmd_ls(args: argparse.Namespace) -> int:
    storage, path = _open(args)
    entries = durable.list_entries(storage, path)
    if not entries:
        raise CheckpointNotFound(f"{args.url}: no checkpoints here")
    print(f"{'STEP':>10}  {'TIME (UTC)':<20} {'WORLD':>5} {'SIZE':>11}  STATUS")
    for e in entries:
        m = e.manifest or {}
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(m["time"])) if "time" in m else "-"
        size = _mb(m["bytes"]) if "bytes" in m else "-"
        status = "valid" if e.valid else f"invalid: {e.problem}"
        print(f"{e.step:>10}  {when:<20} {m.get('world_size', '-')!s:>5} {size:>11}  {status}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    storage, path = _open(args)
    e = _newest_valid(storage, path)
    m = e.manifest
    assert m is not None
    if args.json:
        print(json.dumps(m, indent=2))
        return 0
    print(f"checkpoint  {e.path}")
    print(f"step        {m['step']}   world size at save {m['world_size']}   run {m.get('run_id')}")
    print(f"created     {m.get('created')}   versions {json.dumps(m.get('versions'))}")
    print(f"sampler     {json.dumps(m.get('sampler'))}")
    print(f"bytes       {m['bytes']} in {len(m['files'])} file(s)")
    for f in m["files"]:
        where = f"  at {f['offset']:>12}" if "offset" in f else ""
        print(
            f"  {f['name']}{where}  {f['size']:>12}  {durable.file_hash(f)} {f['sha256']}  (rank {f['rank']})"
        )
    groups: dict[str, list[int]] = {}
    for t in m["tensors"]:
        top = t["path"].strip("/").split("/", 1)[0] or "/"
        g = groups.setdefault(top, [0, 0])
        g[0] += 1
        g[1] += int(t["nbytes"])
    print("tensors")
    for top, (count, nbytes) in sorted(groups.items()):
        print(f"  {top:<12} {count:>6} tensors  {_mb(nbytes):>11}")
    params = m.get("model", {}).get("params", [])
    if params:
        print(f"model       {len(params)} tensors, {sum(_numel(s) for _, _, s in params)} elements")
        for name, dtype, shape in params[:20]:
            print(f"  {name:<40} {dtype:<9} {list(shape)}")
        if len(params) > 20:
            print(f"  … {len(params) - 20} more")
    return 0


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def cmd_verify(args: argparse.Namespace) -> int:
    storage, path = _open(args)
    if parse_step_dir(path) is not None or storage.size(storage.join(path, durable.MANIFEST)) is not None:
        targets = [path]
    else:
        targets = [e.path for e in durable.list_entries(storage, path)]
        if not targets:
            raise CheckpointNotFound(f"{args.url}: no checkpoints here")
    bad = 0
    for t in targets:
        problems = durable.verify(storage, t)
        if problems:
            bad += 1
            for p in problems:
                print(f"FAIL {t}: {p}")
        else:
            print(f"ok   {t}")
    return 1 if bad else 0


def cmd_export(args: argparse.Namespace) -> int:
    storage, path = _open(args)
    e = _newest_valid(storage, path)
    buf, specs = durable.load(storage, e)
    assert e.manifest is not None
    state = unflatten(e.manifest["skeleton"], [tensor_at(buf, s) for s in specs])
    model = state.get("model") if isinstance(state, dict) else None
    if not isinstance(model, dict) or not model:
        raise CheckpointError(f"{e.path}: the checkpoint holds no model state")
    plain = {str(k): v.clone() for k, v in model.items() if isinstance(v, torch.Tensor)}
    tmp = f"{args.to}.tmp"
    try:
        torch.save(plain, tmp)
        os.replace(tmp, args.to)
    except OSError as exc:
        raise CheckpointError(f"cannot write {args.to}: {exc.strerror or exc}") from exc
    print(f"exported {len(plain)} tensors of step {e.manifest['step']} to {args.to}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    storage, path = _open(args)
    if parse_step_dir(path) is None:
        raise CheckpointError(f"{args.url}: rm takes one step directory (…/step-XXXXXXXX)")
    if storage.size(storage.join(path, durable.MANIFEST)) is None and not storage.listdir(path):
        raise CheckpointNotFound(f"{args.url}: no such checkpoint")
    storage.remove(path, recursive=True)
    print(f"removed {args.url}")
    return 0
