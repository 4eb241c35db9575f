"""The durable tier: share files + ``manifest.json`` (written last) + ``latest`` under ``ROOT/RUN_ID/``.

A checkpoint is the flat buffer of the state (:mod:`elastic_train.checkpoint.codec`: every tensor at a
64-byte aligned offset) cut into one contiguous byte range per rank (:func:`policy.share_ranges`); each
rank writes its range as one share file, and the manifest lists the files with their ``offset`` in the
buffer. Loading at any world size reads every file back to its offset.

A step directory is a checkpoint only when its manifest parses, names a format this version reads, and every
file it lists exists with the listed size; loading additionally recomputes each file's checksum (a sha256
tree, :mod:`elastic_train.checkpoint.digest`). Share files carry
a random token in their name, so a new attempt never overwrites bytes an older valid manifest still lists,
and files no manifest lists are leftovers, removed after the next commit.

On storages that recycle (local disks), retention does not delete the share files of a retired checkpoint:
it moves them into the run's :data:`POOL` directory, and the next share is written over one of them in
place. A retired file is unreferenced from the moment its manifest is deleted, and is reused only by a
later save; the pool never holds more bytes than the newest checkpoint and is emptied by the final one.
"""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elastic_train.checkpoint import digest, schema
from elastic_train.checkpoint.errors import (
    CheckpointCorrupt,
    CheckpointError,
    CheckpointNotFound,
    StorageError,
)
from elastic_train.checkpoint.policy import (
    off_line,
    parse_step_dir,
    retention,
    step_dir,
    step_dir_round,
)
from elastic_train.checkpoint.sharded import manifest as sharded_manifest
from elastic_train.checkpoint.specs import TensorSpec, fingerprint_from_specs
from elastic_train.checkpoint.storage import Storage
from elastic_train.log import get_logger

if TYPE_CHECKING:
    import torch

log = get_logger(__name__)

#: The manifest format written and read: byte ranges of the flat buffer per file (``offset``), each with a
#: sha256 tree (``hash``). No release wrote another, so a manifest of any other format is not a checkpoint.
FORMAT = 3
KIND = "elastic_train.checkpoint"
MANIFEST = "manifest.json"
LATEST = "latest"
#: Directory under the run root holding retired share files for reuse (local disks only).
POOL = ".recycle"
#: The run's lineage file: where each round's world started (``[{"round": R, "base": STEP}, ...]``).
LINEAGE = "lineage.json"
#: Lineage records kept (the oldest are dropped; retention keeps fewer checkpoints than this many rounds).
LINEAGE_KEEP = 256
#: Why a step directory without a manifest is not a checkpoint (yet).
NO_MANIFEST = "no manifest.json (interrupted or in-progress save)"


@dataclass(frozen=True, slots=True)
class ShareRecord:
    """What one rank wrote for one checkpoint (sent to rank 0, which lists it in the manifest)."""

    rank: int
    name: str
    size: int
    sha256: str
    offset: int
    """Where the file's bytes start in the flat buffer."""


@dataclass(frozen=True, slots=True)
class Entry:
    """A step directory as found in storage: a checkpoint when ``problem`` is None."""

    step: int
    path: str
    manifest: dict[str, Any] | None
    problem: str | None

    @property
    def valid(self) -> bool:
        return self.problem is None

    @property
    def round(self) -> int | None:
        """The rendezvous round of the world that wrote it (None: written outside an ``etcd3`` round)."""
        r = self.manifest.get("round") if self.manifest else None
        return r if type(r) is int else step_dir_round(self.path)

    @property
    def base(self) -> int | None:
        """The step the writing world started from (restored, or 0), when recorded."""
        b = self.manifest.get("base") if self.manifest else None
        return b if type(b) is int else None


def _view(arr: Any, offset: int, nbytes: int) -> memoryview:
    return memoryview(arr[offset : offset + nbytes])


def write_share(
    storage: Storage,
    path: str,
    rank: int,
    buf: torch.Tensor,
    start: int,
    end: int,
    *,
    pool: str | None = None,
) -> ShareRecord:
    """Write bytes ``[start, end)`` of the flat uint8 buffer ``buf`` as one file (a fresh name per attempt)
    and fsync it. With ``pool`` (the run's :data:`POOL` path), a retired file from there is claimed and
    overwritten. A page-aligned ``buf`` (a shared-memory slot, the manager's staging buffer) lets local
    disks write it with O_DIRECT."""
    name = f"share-{rank:05d}.{uuid.uuid4().hex[:8]}.bin"
    target = storage.join(path, name)
    if pool is not None and storage.recycles:
        reuse(storage, pool, target, end - start)
    size, sha = storage.write_chunks(target, [_view(buf.numpy(), start, end - start)])
    return ShareRecord(rank, name, size, sha, start)


def pool_path(storage: Storage, run_path: str) -> str:
    return storage.join(run_path, POOL)


def _pool_files(storage: Storage, pool: str) -> list[tuple[int, str]]:
    """(size, path) of the retired files in ``pool``, largest first."""
    out = []
    for name in storage.listdir(pool):
        path = storage.join(pool, name)
        size = storage.size(path)
        if size is not None:
            out.append((size, path))
    return sorted(out, reverse=True)


def reuse(storage: Storage, pool: str, target: str, nbytes: int) -> bool:
    """Claim the retired file that best fits ``nbytes`` as ``target``; False when none could be claimed.

    Best fit: the smallest file of at least ``nbytes`` (its tail is cut), else the largest. Writers of
    other ranks may claim concurrently: a file claimed by another is skipped.
    """
    files = _pool_files(storage, pool)
    fits = [f for f in reversed(files) if f[0] >= nbytes] + [f for f in files if f[0] < nbytes]
    return any(storage.claim(path, target) for _, path in fits)  # stops at the first claimed


def retire(storage: Storage, path: str, pool: str) -> None:
    """Take the step directory ``path`` apart: manifest first (it stops being a checkpoint at once), share
    files into ``pool`` under fresh names, then whatever is left."""
    storage.remove(storage.join(path, MANIFEST))
    for name in storage.listdir(path):
        if name.startswith("share-") and name.endswith(".bin"):
            storage.claim(storage.join(path, name), storage.join(pool, f"{uuid.uuid4().hex}.bin"))
    storage.remove(path, recursive=True)


def trim_pool(storage: Storage, pool: str, budget: int) -> None:
    """Delete retired files beyond ``budget`` bytes (largest kept first); the pool itself when 0."""
    if budget <= 0:
        storage.remove(pool, recursive=True)
        return
    kept = 0
    for size, path in _pool_files(storage, pool):
        if kept + size <= budget:
            kept += size
        else:
            storage.remove(path)


def build_manifest(
    *,
    run_id: str,
    step: int,
    world_size: int,
    skeleton: Any,
    specs: Sequence[TensorSpec],
    shares: Sequence[ShareRecord],
    sampler: Any,
    nbytes: int,
    round: int | None = None,
    base: int | None = None,
) -> dict[str, Any]:
    """The manifest of a checkpoint whose shares (byte ranges of the flat buffer) are all durable.

    ``round`` is the rendezvous round of the writing world and ``base`` the step it started from: the
    stale-writer rule (:func:`elastic_train.checkpoint.policy.off_line`) reads them.
    """
    fingerprint = fingerprint_from_specs(list(specs))
    return {
        **schema.head(
            kind=KIND,
            format=FORMAT,
            run_id=run_id,
            step=step,
            world_size=world_size,
            round=round,
            base=base or 0,
            sampler=sampler,
        ),
        "model": {"params": fingerprint, "count": len(fingerprint)},
        "bytes": sum(s.size for s in shares),
        "layout_bytes": nbytes,
        "files": [
            {
                "name": s.name,
                "offset": s.offset,
                "size": s.size,
                "sha256": s.sha256,
                "hash": digest.TREE,
                "rank": s.rank,
            }
            for s in sorted(shares, key=lambda s: s.offset)
        ],
        "tensors": [spec.to_json() for spec in specs],
        "skeleton": skeleton,
    }


def commit(
    storage: Storage, run_path: str, manifest: dict[str, Any], still_current: Callable[[], bool] | None = None
) -> str | None:
    """Make a checkpoint visible: write its manifest (atomically), then the ``latest`` pointer.

    Files in the step directory the manifest does not list (older attempts) are removed afterwards.
    ``still_current`` (the publish gate) is asked again after the manifest landed: a world that stopped
    being current meanwhile moves no ``latest`` pointer and removes nothing. Returns the step directory
    path, or None when the gate said no.
    """
    name = step_dir(int(manifest["step"]), manifest.get("round"))
    path = storage.join(run_path, name)
    storage.write_small(storage.join(path, MANIFEST), json.dumps(manifest, allow_nan=True).encode())
    if still_current is not None and not still_current():
        return None
    storage.write_small(storage.join(run_path, LATEST), f"{name}\n".encode())
    listed = {f["name"] for f in manifest["files"]} | {MANIFEST}
    for leftover in storage.listdir(path):
        if leftover not in listed:
            storage.remove(storage.join(path, leftover), recursive=True)
    return path


def check_manifest(m: Any, step: int | None = None) -> str | None:
    """Why ``m`` is not a usable manifest (None when it is): see :mod:`elastic_train.checkpoint.schema`."""
    if not isinstance(m, dict) or m.get("kind") != KIND:
        return "not an elastic_train manifest"
    if m.get("format") == sharded_manifest.FORMAT:  # a sharded state in DCP's layout
        return sharded_manifest.problem(m, step)
    if type(m.get("format")) is not int or m["format"] != FORMAT:
        return f"unsupported format {m.get('format')!r} (this version reads {FORMAT})"
    for key in ("step", "world_size", "files", "tensors", "skeleton"):
        if key not in m:
            return f"manifest lacks {key!r}"
    try:
        schema.manifest(m)
    except ValueError as exc:
        return str(exc)
    if step is not None and m["step"] != step:
        return f"manifest says step {m['step']}, directory says {step}"
    return None


def read_entry(storage: Storage, path: str, *, check_sizes: bool = True) -> Entry:
    """Inspect one step directory: parse the manifest and (by default) check every listed file's size."""
    step = parse_step_dir(path)
    step_no = -1 if step is None else step
    try:
        raw = storage.read(storage.join(path, MANIFEST))
    except StorageError:
        if storage.size(storage.join(path, MANIFEST)) is None:
            return Entry(step_no, path, None, NO_MANIFEST)
        raise
    try:
        m = json.loads(raw)
    except (ValueError, RecursionError):
        return Entry(step_no, path, None, "manifest.json is not valid JSON")
    problem = check_manifest(m, step)
    if problem:
        return Entry(step_no, path, m if isinstance(m, dict) else None, problem)
    if check_sizes:
        for f in m["files"]:
            size = storage.size(storage.join(path, f["name"]))
            if size is None:
                return Entry(step_no, path, m, f"missing file {f['name']}")
            if size != f["size"]:
                return Entry(step_no, path, m, f"{f['name']} has {size} bytes, manifest says {f['size']}")
    return Entry(int(m["step"]), path, m, None)


def list_entries(storage: Storage, run_path: str, *, check_sizes: bool = True) -> list[Entry]:
    """Every step directory under ``run_path``, oldest first (then by round), valid or not.

    A checkpoint a later world left behind (:func:`~elastic_train.checkpoint.policy.off_line`: a stale
    writer's) is listed as invalid, so it is never the newest and retention removes it.
    """
    out = []
    for name in storage.listdir(run_path):
        if parse_step_dir(name) is not None:
            out.append(read_entry(storage, storage.join(run_path, name), check_sizes=check_sizes))
    valid = [e for e in out if e.valid]
    behind = off_line([(e.step, e.round, e.base) for e in valid], read_lineage(storage, run_path))
    for i, (later, base) in behind.items():
        e = valid[i]
        problem = f"written by round {e.round}, left behind: round {later} restarted from step {base}"
        out[out.index(e)] = Entry(e.step, e.path, e.manifest, problem)
    return sorted(out, key=lambda e: (e.step, e.round if e.round is not None else -1))


def listing(storage: Storage, run_path: str) -> list[Entry] | CheckpointError:
    """:func:`list_entries`, or the error it raised: a restore's decider lists before the collective that
    waits for it and raises the error only after that collective (every rank then raises the same)."""
    try:
        return list_entries(storage, run_path)
    except CheckpointError as exc:
        return exc


def read_lineage(storage: Storage, run_path: str) -> list[tuple[int, int]]:
    """``(round, base)`` of the worlds that recorded where they started (unreadable records ignored)."""
    try:
        raw = json.loads(storage.read(storage.join(run_path, LINEAGE)))
    except (StorageError, ValueError, RecursionError):
        return []
    if not isinstance(raw, list):
        return []
    return [
        (r["round"], r["base"])
        for r in raw
        if isinstance(r, dict) and type(r.get("round")) is int and type(r.get("base")) is int
    ]


def lineage_start(
    storage: Storage, run_path: str, round: int, base: int, *, again: int | None = None
) -> tuple[int, bytes]:
    """The record that the world of rendezvous round ``round`` starts from step ``base`` (before it trains a
    step): the round its checkpoints carry, and the new content of the run's :data:`LINEAGE` file, which
    the caller writes (``storage.write_small``) before that world trains a step.

    ``again``: the round this world already recorded (its restore found the chosen snapshot torn and looked
    again): that record's base is replaced and the round kept.

    Once written, a stale world's checkpoint past ``base`` is left behind, even before this world commits
    one. The returned round is ``round``, or one more than any round the run's directory already holds when
    that is higher: rendezvous rounds start again at 1 when a run id is reused after its record expired,
    and the new worlds must still come after the earlier ones. Only a world's rank 0 writes, once, after
    the world formed; a stale world never does.
    """
    records = read_lineage(storage, run_path)
    try:
        names = storage.listdir(run_path)
    except StorageError:
        names = []
    seen = [r for r, _ in records] + [r for r in map(step_dir_round, names) if r is not None]
    stamp = again if again is not None else max([round, *(r + 1 for r in seen if r >= round)])
    kept = [{"round": r, "base": b} for r, b in records if r < stamp]
    kept.append({"round": stamp, "base": base})
    return stamp, json.dumps(kept[-LINEAGE_KEEP:]).encode()


class LineageWrite:
    """Rank 0's record that its world starts from step ``base`` (:func:`lineage_start`), written by a thread
    while the restore moves the state: on remote storage a write costs a round trip or more. :meth:`wait`
    for it before the world trains a step.

    A storage error writing it is logged (``lineage_not_recorded``) and not raised: the manifests' own round
    and base still fence a stale writer later, so it is not worth a restart (an unreadable old record or
    listing is :func:`lineage_start`'s to ignore). ``stamp`` is the round this world's checkpoints carry.
    """

    def __init__(
        self, storage: Storage, run_path: str, round: int, base: int, *, again: int | None = None
    ) -> None:
        self._failed: list[BaseException] = []
        self.stamp, record = lineage_start(storage, run_path, round, base, again=again)
        path = storage.join(run_path, LINEAGE)

        def write() -> None:
            try:
                storage.write_small(path, record)
            except StorageError as exc:
                log.warning("lineage_not_recorded", round=round, base=base, error=str(exc))
            except BaseException as exc:  # raised by wait(), as if written there
                self._failed.append(exc)

        self._thread = threading.Thread(target=write, name="ckpt-lineage", daemon=True)
        self._thread.start()

    def wait(self, *, quiet: bool = False) -> None:
        """Wait for the write; raise what it raised (other than a storage error) unless ``quiet`` (the
        restore is already raising an error of its own)."""
        self._thread.join()
        if self._failed and not quiet:
            raise self._failed[0]


def step_names(storage: Storage, run_path: str) -> list[str]:
    """Names of the step directories directly under ``run_path``, newest first."""
    names = [n for n in storage.listdir(run_path) if parse_step_dir(n) is not None]
    return sorted(names, key=lambda n: parse_step_dir(n) or 0, reverse=True)


def runs_under(storage: Storage, root: str) -> list[str]:
    """Names of the runs directly under the checkpoint root ``root`` (directories with step directories)."""
    return [
        name
        for name in storage.listdir(root)
        if not name.startswith(".")
        and parse_step_dir(name) is None
        and step_names(storage, storage.join(root, name))
    ]


def newest_valid(storage: Storage, run_path: str) -> Entry | None:
    """The newest valid checkpoint of a run (manifests and sizes checked; none a later world left behind)."""
    valid = [e for e in list_entries(storage, run_path) if e.valid]
    return valid[-1] if valid else None


def load(storage: Storage, entry: Entry) -> tuple[torch.Tensor, list[TensorSpec]]:
    """Read a checkpoint into one flat uint8 buffer (the layout of the saver), verifying every sha256.

    Raises:
        CheckpointCorrupt: a file is missing, short, or its sha256 differs from the manifest.
    """
    m = entry.manifest
    if m is None or entry.problem:
        raise CheckpointCorrupt(f"{entry.path}: {entry.problem}")
    if m.get("format") == sharded_manifest.FORMAT:
        raise CheckpointCorrupt(
            f"{entry.path}: a sharded checkpoint (torch.distributed.checkpoint); it loads into a sharded "
            "(FSDP2) model, or through elastic-train ckpt export"
        )
    import torch  # listing and verifying checkpoints does without it

    specs = [TensorSpec.from_json(t) for t in m["tensors"]]
    nbytes = int(m.get("layout_bytes") or 0) or max((s.offset + s.nbytes for s in specs), default=0)
    buf = torch.empty(nbytes, dtype=torch.uint8)
    arr = buf.numpy()
    for f in m["files"]:
        path = storage.join(entry.path, f["name"])
        outs = [_view(arr, int(f["offset"]), int(f["size"]))] if f["size"] else []
        try:
            storage.read_into(path, outs)
            sha = digest.digest(outs)
        except (StorageError, ValueError) as exc:
            raise CheckpointCorrupt(f"{entry.path}: {exc}") from exc
        if sha != f["sha256"]:
            raise CheckpointCorrupt(f"{entry.path}: checksum mismatch in {f['name']}")
    return buf, specs


def verify(storage: Storage, path: str) -> list[str]:
    """Every problem of the checkpoint at ``path`` (empty: valid), recomputing all checksums."""
    entry = read_entry(storage, path)
    if entry.problem:
        return [entry.problem]
    problems = []
    assert entry.manifest is not None
    for f in entry.manifest["files"]:
        size = storage.size(storage.join(path, f["name"]))
        if size is None or size != f["size"]:
            problems.append(f"{f['name']}: size {size} != {f['size']}")
            continue
        out = memoryview(bytearray(size))
        try:
            storage.read_into(storage.join(path, f["name"]), [out])
            sha = digest.digest([out])
        except (StorageError, ValueError) as exc:
            problems.append(str(exc))
            continue
        if sha != f["sha256"]:
            problems.append(
                f"{f['name']}: checksum mismatch ({f['hash']}: stored {f['sha256'][:12]}…, "
                f"actual {sha[:12]}…)"
            )
    return problems


def resolve(storage: Storage, path: str) -> tuple[str, list[Entry]]:
    """For a run root or a step directory, (run root path, candidate entries newest first)."""
    if parse_step_dir(path) is not None:
        return path.rstrip("/").rsplit("/", 1)[0], [read_entry(storage, path)]
    entries = list_entries(storage, path)
    if not entries and storage.size(storage.join(path, MANIFEST)) is not None:
        entry = read_entry(storage, path)
        return path, [Entry(entry.step if entry.manifest else -1, path, entry.manifest, entry.problem)]
    return path, entries[::-1]


def load_newest(
    storage: Storage, entries: Sequence[Entry], *, min_step: int = -1, what: str = "checkpoint"
) -> tuple[Entry, torch.Tensor, list[TensorSpec]]:
    """Load the newest valid entry newer than ``min_step``, logging and skipping torn or corrupt ones.

    Raises:
        CheckpointNotFound: none of them loads.
    """
    for entry in sorted(entries, key=lambda e: (e.step, e.round or -1), reverse=True):
        if entry.step <= min_step:
            break
        if entry.problem:
            log.warning("checkpoint_skipped", path=entry.path, step=entry.step, reason=entry.problem)
            continue
        try:
            buf, specs = load(storage, entry)
        except CheckpointCorrupt as exc:
            log.warning("checkpoint_skipped", path=entry.path, step=entry.step, reason=str(exc))
            continue
        return entry, buf, specs
    raise CheckpointNotFound(f"no valid {what} found")


def prune(
    storage: Storage,
    run_path: str,
    *,
    keep_last: int,
    keep_every: int,
    current: int,
    recycle_bytes: int = 0,
    round: int | None = None,
) -> list[str]:
    """Apply retention and remove leftovers (step directories without a valid manifest).

    Called by the committer right after committing ``current``, when no other save of the run is in
    flight. With ``recycle_bytes`` > 0 on a storage that recycles, share files of the removed directories
    go to the pool, which is then cut to that many bytes; with 0 the pool is emptied. Returns the removed
    paths. With ``round``, the directories of later rounds are left alone (this committer may be a stale
    world's, and a later world's save may be in progress there).
    """
    entries = list_entries(storage, run_path, check_sizes=False)
    if round is not None:
        entries = [e for e in entries if (step_dir_round(e.path) or 0) <= round]
    valid = [e.step for e in entries if e.valid]
    doomed = set(retention(valid, keep_last=keep_last, keep_every=keep_every))
    recycle = recycle_bytes > 0 and storage.recycles
    pool = pool_path(storage, run_path)
    removed = []
    for e in entries:
        if e.step == current and step_dir_round(e.path) == round:  # the checkpoint just committed
            continue
        if e.step in doomed or not e.valid:
            if recycle:
                retire(storage, e.path, pool)
            else:
                storage.remove(e.path, recursive=True)
            removed.append(e.path)
    if storage.recycles:
        trim_pool(storage, pool, recycle_bytes)
    return removed
