"""What ``elastic-train ckpt`` does: list, show, verify, export and remove durable checkpoints.

Safe to type: a path that does not exist says so; ``rm`` removes only checkpoint directories, confirms (on a
terminal, else ``--yes``), keeps the newest valid checkpoint of a run unless ``--force`` and keeps ``latest``
naming a valid one; ``export`` never overwrites without ``--force``, never writes into the checkpoint store
and leaves nothing behind when it fails.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import sys
import tempfile
import time
from typing import TYPE_CHECKING, Any

from elastic_train.checkpoint import durable
from elastic_train.checkpoint.errors import CheckpointError, CheckpointNotFound
from elastic_train.checkpoint.policy import parse_step_dir
from elastic_train.checkpoint.sharded import manifest as sharded_manifest
from elastic_train.checkpoint.storage import LocalStorage, Storage, open_storage

if TYPE_CHECKING:
    import torch

#: What a step directory may hold to be removed by ``rm``: share files, the manifest, a manifest being
#: written (a local disk's atomic replace), a sharded checkpoint's DCP files.
_CHECKPOINT_FILE = re.compile(
    r"^(share-\d{5}\.[A-Za-z0-9]+\.bin|manifest\.json(\.tmp-[0-9a-f]+)?|\.metadata|__\d{1,7}_\d{1,7}\.distcp)$"
)


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


def _existing(storage: Storage, path: str, url: str) -> str:
    """The kind of ``path`` ("dir" or "file"); a path that does not exist is an error."""
    kind = storage.kind(path)
    if kind is None:
        raise CheckpointNotFound(f"{url}: does not exist")
    return kind


def _nothing_here(storage: Storage, path: str, url: str) -> CheckpointNotFound:
    runs = durable.runs_under(storage, path)
    if runs:
        shown = ", ".join(runs[:5]) + (", …" if len(runs) > 5 else "")
        return CheckpointNotFound(f"{url}: a checkpoint root (runs {shown}); name a run: {url}/RUN")
    return CheckpointNotFound(f"{url}: no checkpoints here")


def _newest_valid(storage: Storage, path: str, url: str) -> durable.Entry:
    _existing(storage, path, url)
    _, entries = durable.resolve(storage, path)
    if not entries:
        raise _nothing_here(storage, path, url)
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
    """The checkpoints of a run (exit 1 when one is invalid), or the runs of a checkpoint root."""
    storage, path = _open(args)
    if _existing(storage, path, args.url) == "file":
        raise CheckpointError(f"{args.url}: is a file, not a checkpoint directory")
    if parse_step_dir(path) is not None:
        entries = [durable.read_entry(storage, path)]
    else:
        entries = durable.list_entries(storage, path)
    if not entries:
        runs = durable.runs_under(storage, path)
        if runs:
            return _ls_root(storage, path, runs)
        raise CheckpointNotFound(f"{args.url}: no checkpoints here")
    print(f"{'STEP':>10}  {'TIME (UTC)':<20} {'WORLD':>5} {'SIZE':>11}  STATUS")
    for e in entries:
        m = e.manifest if e.valid else {}
        assert m is not None
        size = _mb(m["bytes"]) if "bytes" in m else "-"
        status = "valid" if e.valid else f"invalid: {e.problem}"
        print(f"{e.step:>10}  {_when(m):<20} {m.get('world_size', '-')!s:>5} {size:>11}  {status}")
    # A save in progress has no manifest yet; anything else invalid is worth a non-zero exit.
    return 1 if any(not e.valid and e.problem != durable.NO_MANIFEST for e in entries) else 0


def _when(m: dict[str, Any]) -> str:
    t = m.get("time")
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(t)) if isinstance(t, (int, float)) else "-"


def _ls_root(storage: Storage, root: str, runs: list[str]) -> int:
    print(f"{'RUN':<32} {'NEWEST VALID':>12}  {'TIME (UTC)':<20} {'CHECKPOINTS':>11}")
    for run in runs:
        run_path = storage.join(root, run)
        newest = durable.newest_valid(storage, run_path)
        count = len(durable.step_names(storage, run_path))
        step = "none" if newest is None else str(newest.step)
        when = _when(newest.manifest) if newest is not None and newest.manifest else "-"
        print(f"{run:<32} {step:>12}  {when:<20} {count:>11}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    storage, path = _open(args)
    e = _newest_valid(storage, path, args.url)
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
        print(f"  {f['name']}{where}  {f['size']:>12}  {f['hash']} {f['sha256']}  (rank {f['rank']})")
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
    _existing(storage, path, args.url)
    if parse_step_dir(path) is not None or storage.size(storage.join(path, durable.MANIFEST)) is not None:
        targets = [path]
    else:
        targets = [e.path for e in durable.list_entries(storage, path)]
        if not targets:
            raise _nothing_here(storage, path, args.url)
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
    target = os.path.abspath(os.path.expanduser(args.to))
    _check_target(storage, path, target, args)
    e = _newest_valid(storage, path, args.url)
    assert e.manifest is not None
    if e.manifest.get("format") == sharded_manifest.FORMAT:  # a DCP directory: whole tensors, any world size
        from elastic_train.checkpoint.sharded.export import model_tensors

        plain = model_tensors(storage, e.path, e.manifest)
    else:
        plain = _replicated_model(storage, e)
    _write_new(target, plain, args)
    print(f"exported {len(plain)} tensors of step {e.manifest['step']} to {args.to}")
    return 0


def _replicated_model(storage: Storage, e: durable.Entry) -> dict[str, torch.Tensor]:
    import torch

    from elastic_train.checkpoint.codec import tensor_at, unflatten

    buf, specs = durable.load(storage, e)
    assert e.manifest is not None
    state = unflatten(e.manifest["skeleton"], [tensor_at(buf, s) for s in specs])
    model = state.get("model") if isinstance(state, dict) else None
    if not isinstance(model, dict) or not model:
        raise CheckpointError(f"{e.path}: the checkpoint holds no model state")
    return {str(k): v.clone() for k, v in model.items() if isinstance(v, torch.Tensor)}


def _check_target(storage: Storage, path: str, target: str, args: argparse.Namespace) -> None:
    """Refuse an export target that is a directory, exists (without ``--force``), has no directory to go
    into, or lies inside the checkpoint store the checkpoint is read from."""
    if os.path.isdir(target):
        raise CheckpointError(f"--to {args.to}: is a directory; name a file")
    if os.path.lexists(target) and not args.force:
        raise CheckpointError(f"--to {args.to}: exists; pass --force to overwrite it")
    parent = os.path.dirname(target)
    if not os.path.isdir(parent):
        why = "is not a directory" if os.path.lexists(parent) else "does not exist"
        raise CheckpointError(f"--to {args.to}: {parent} {why}")
    if isinstance(storage, LocalStorage):
        # The checkpoint root: the parent of the run directory (the URL names a run or one of its steps).
        run_path = os.path.dirname(path) if parse_step_dir(path) is not None else path
        store = os.path.realpath(os.path.dirname(run_path.rstrip(os.sep)) or os.sep)
        for candidate in (os.path.realpath(parent), os.path.realpath(target)):
            if candidate == store or candidate.startswith(store.rstrip(os.sep) + os.sep):
                raise CheckpointError(
                    f"--to {args.to}: inside the checkpoint store {store}; export to a path outside it"
                )


def _write_new(target: str, obj: Any, args: argparse.Namespace) -> None:
    """``torch.save`` into a temporary file next to ``target``, then put it in place: with ``--force`` over
    whatever is there, otherwise only if ``target`` still does not exist. Nothing is left on failure."""
    import torch

    parent, name = os.path.split(target)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=parent, prefix=f".{name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        if args.force:
            os.replace(tmp, target)
        else:
            _link_new(tmp, target)
    except FileExistsError:
        raise CheckpointError(f"--to {args.to}: exists; pass --force to overwrite it") from None
    except (OSError, RuntimeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
        raise CheckpointError(f"cannot write {args.to}: {why}") from exc
    finally:
        if tmp is not None and os.path.lexists(tmp):
            os.unlink(tmp)


def _link_new(tmp: str, target: str) -> None:
    """Give ``tmp`` the name ``target`` unless that exists (FileExistsError), atomically where links work."""
    try:
        os.link(tmp, target)
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        if os.path.lexists(target):  # a filesystem without hard links: check, then rename
            raise FileExistsError(errno.EEXIST, "exists", target) from exc
        os.replace(tmp, target)


def cmd_rm(args: argparse.Namespace) -> int:
    """Remove one checkpoint (a step directory) of a run, safely: see the module docstring."""
    storage, path = _open(args)
    step = parse_step_dir(path)
    if step is None:
        raise CheckpointError(f"{args.url}: rm takes one step directory (…/step-XXXXXXXX)")
    if _existing(storage, path, args.url) == "file":
        raise CheckpointError(f"{args.url}: is a file, not a checkpoint; nothing removed")
    names = storage.listdir(path)
    strangers = [n for n in names if not _CHECKPOINT_FILE.match(n)]
    if strangers:
        raise CheckpointError(f"{args.url}: not a checkpoint (it holds {strangers[0]!r}); nothing removed")
    entry = durable.read_entry(storage, path)
    if entry.problem == "not an elastic_train manifest":
        raise CheckpointError(f"{args.url}: not a checkpoint ({entry.problem}); nothing removed")
    if entry.manifest is None and not args.force:
        what = "an empty directory" if not names else durable.NO_MANIFEST
        raise CheckpointError(f"{args.url}: not a checkpoint ({what}); pass --force to remove it")
    run_path = path.rstrip("/").rsplit("/", 1)[0]
    run = run_path.rsplit("/", 1)[-1]
    valid = [e for e in durable.list_entries(storage, run_path) if e.valid]
    if valid and valid[-1].step == step and not args.force and not durable.verify(storage, path):
        only = " and only" if len(valid) == 1 else ""
        raise CheckpointError(
            f"{args.url}: the newest{only} valid checkpoint of run {run}; pass --force to remove it anyway"
        )
    state = "valid" if entry.valid else f"invalid: {entry.problem}"
    size = f", {_mb(entry.manifest['bytes'])}" if entry.valid and entry.manifest else ""
    _confirm(args, f"remove checkpoint {args.url} (step {step}, {state}{size})?")
    latest = _repoint_latest(storage, run_path, [e for e in valid if e.step != step])
    storage.remove(storage.join(path, durable.MANIFEST))  # from here on it is not a checkpoint
    storage.remove(path, recursive=True)
    print(f"removed {args.url}" + (f"; latest is now {latest}" if latest else ""))
    return 0


def _confirm(args: argparse.Namespace, question: str) -> None:
    if args.yes:
        return
    if not sys.stdin.isatty():
        raise CheckpointError(f"{question.rstrip('?')}: not confirmed; pass --yes (stdin is not a terminal)")
    try:
        answer = input(f"{question} [y/N] ")
    except EOFError:
        answer = ""
    if answer.strip().lower() not in ("y", "yes"):
        raise CheckpointError("not confirmed; nothing removed")


def _repoint_latest(storage: Storage, run_path: str, remaining: list[durable.Entry]) -> str | None:
    """Before a checkpoint is removed: keep ``latest`` naming a valid checkpoint of those that stay (the
    newest), or remove it when none stays. Returns what it now names when it was rewritten."""
    pointer = storage.join(run_path, durable.LATEST)
    try:
        current = storage.read(pointer).decode(errors="replace").strip()
    except CheckpointError:
        current = ""
    if current and parse_step_dir(current) in {e.step for e in remaining}:
        return None  # it names a valid checkpoint that stays
    if not remaining:
        storage.remove(pointer)
        return None
    name = remaining[-1].path.rstrip("/").rsplit("/", 1)[-1]
    storage.write_small(pointer, f"{name}\n".encode())
    return name
