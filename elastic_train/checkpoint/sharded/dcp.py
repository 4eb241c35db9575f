"""torch.distributed.checkpoint (DCP) directories: written with DCP itself, read without executing pickles.

A sharded durable checkpoint is a DCP directory (``.metadata`` plus one ``__<rank>_<n>.distcp`` file per
writing rank) so that ``dcp.load`` in anyone's code reads it at any world size. Writing is DCP's own
:func:`torch.distributed.checkpoint.save` (through fsspec for URLs). Reading is this module's: DCP's own
reader unpickles ``.metadata`` and every non-tensor entry with ``weights_only=False``, and a checkpoint is
untrusted input here (docs/checkpoints.md). :func:`read_metadata` unpickles ``.metadata`` with an allow-list
of DCP's metadata classes (anything else is refused), and :class:`DcpReader` reads only the tensor items a
rank needs — the stored chunks that intersect the rows it owns — each with ``torch.load(weights_only=True)``.
Bytes entries (pickled objects: param groups, a dataloader's state) are never read.

DCP's fsspec writer and the private classes a ``.metadata`` pickle names are torch's private names, reached
through :mod:`elastic_train.torchcompat`.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import pickle
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from elastic_train import torchcompat
from elastic_train.checkpoint import digest
from elastic_train.checkpoint.errors import CheckpointCorrupt, StorageError
from elastic_train.checkpoint.sharded.manifest import DATA_FILE, METADATA
from elastic_train.checkpoint.storage import LocalStorage, Storage

_META = "torch.distributed.checkpoint.metadata"
#: (module, name) a DCP ``.metadata`` pickle may name; anything else is refused.
_ALLOWED = {
    (_META, "Metadata"),
    (_META, "TensorStorageMetadata"),
    (_META, "TensorProperties"),
    (_META, "ChunkStorageMetadata"),
    (_META, "BytesStorageMetadata"),
    (_META, "MetadataIndex"),
    (_META, "StorageMeta"),
    ("torch", "Size"),
    ("collections", "OrderedDict"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    *torchcompat.DCP_METADATA_PRIVATE,
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype | torch.memory_format):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a DCP checkpoint's metadata")


@dataclass(frozen=True, slots=True)
class Item:
    """One stored chunk of a tensor: where it lies in the tensor and in which file."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    start: int
    length: int


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """A tensor entry of a DCP checkpoint."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    items: tuple[Item, ...]


@dataclass(frozen=True, slots=True)
class Layout:
    """What a DCP checkpoint holds: its tensors (by flattened key) and the keys of its bytes entries."""

    tensors: Mapping[str, StoredTensor]
    other: frozenset[str]


def read_metadata(raw: bytes) -> Layout:
    """A DCP ``.metadata`` file's layout, validated: every item names a data file of the directory and lies
    inside its tensor.

    Raises:
        CheckpointCorrupt: it is not DCP metadata (or names a class DCP metadata never does).
    """
    try:
        meta = _MetadataUnpickler(io.BytesIO(raw)).load()
    except Exception as exc:  # any pickle error, a refused class, a truncated file
        raise CheckpointCorrupt(f"{METADATA}: not DCP metadata ({type(exc).__name__}: {exc})") from None
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    if not isinstance(meta, Metadata) or not isinstance(meta.state_dict_metadata, dict):
        raise CheckpointCorrupt(f"{METADATA}: not DCP metadata")
    storage = meta.storage_data if isinstance(meta.storage_data, dict) else {}
    where: dict[tuple[str, tuple[int, ...]], Any] = {}
    for index, info in storage.items():
        fqn, offset = getattr(index, "fqn", None), getattr(index, "offset", None)
        if isinstance(fqn, str):
            where[(fqn, tuple(offset) if offset is not None else ())] = info
    tensors: dict[str, StoredTensor] = {}
    other = set()
    for key, entry in meta.state_dict_metadata.items():
        if not isinstance(key, str):
            raise CheckpointCorrupt(f"{METADATA}: a key {key!r} is not a string")
        if not isinstance(entry, TensorStorageMetadata):
            other.add(key)
            continue
        shape = tuple(int(s) for s in entry.size)
        dtype = entry.properties.dtype
        if not isinstance(dtype, torch.dtype):
            raise CheckpointCorrupt(f"{METADATA}: {key}: dtype {dtype!r}")
        items = []
        for chunk in entry.chunks:
            offsets, sizes = tuple(int(x) for x in chunk.offsets), tuple(int(x) for x in chunk.sizes)
            if (
                len(offsets) != len(shape)
                or len(sizes) != len(shape)
                or any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offsets, sizes, shape, strict=True))
            ):
                raise CheckpointCorrupt(f"{METADATA}: {key}: a chunk {offsets}+{sizes} outside {shape}")
            info = where.get((key, offsets))
            if info is None:
                raise CheckpointCorrupt(f"{METADATA}: {key}: no file holds its chunk at {offsets}")
            name, start, length = info.relative_path, info.offset, info.length
            if not (isinstance(name, str) and DATA_FILE.match(name)):
                raise CheckpointCorrupt(
                    f"{METADATA}: {key}: data file {name!r} is not one of the directory's"
                )
            if getattr(info, "transform_descriptors", None):
                raise CheckpointCorrupt(
                    f"{METADATA}: {key}: stored with transforms {info.transform_descriptors} (compressed DCP "
                    "checkpoints are not supported)"
                )
            if not (type(start) is int and type(length) is int and start >= 0 and length >= 0):
                raise CheckpointCorrupt(f"{METADATA}: {key}: item at {start!r}+{length!r}")
            items.append(Item(offsets, sizes, name, start, length))
        tensors[key] = StoredTensor(shape, dtype, tuple(items))
    return Layout(tensors, frozenset(other))


def read_range(storage: Storage, path: str, start: int, length: int) -> bytes:
    """Bytes ``[start, start + length)`` of a file.

    Raises:
        StorageError: it cannot be read, or ends first.
    """
    try:
        if isinstance(storage, LocalStorage):
            fd = os.open(path, os.O_RDONLY)
            try:
                out = bytearray(length)
                view, done = memoryview(out), 0
                while done < length:
                    n = os.preadv(fd, [view[done:]], start + done)
                    if n <= 0:
                        break
                    done += n
            finally:
                os.close(fd)
            data = bytes(out[:done])
        else:
            data = bytes(storage.fs.cat_file(path, start=start, end=start + length))  # type: ignore[attr-defined]
    except OSError as exc:
        raise StorageError(f"cannot read {path}: {exc.strerror or exc}") from exc
    except Exception as exc:
        raise StorageError(f"cannot read {path}: {type(exc).__name__}: {exc}".splitlines()[0]) from exc
    if len(data) != length:
        raise StorageError(f"{path}: {len(data)} bytes at {start}, expected {length} (the file is shorter)")
    return data


class DcpReader:
    """Reads the tensors of a DCP directory, only the stored chunks a caller needs.

    Args:
        storage: the checkpoint's storage.
        path: the DCP directory.
        pieces: per file name, the sha256 of each of its 8 MiB pieces (a manifest of this project lists them):
            each piece a read touches is verified once. None (a checkpoint written by other code): items
            are not verified beyond what ``torch.load`` checks.

    Raises:
        CheckpointCorrupt: ``.metadata`` is missing, fails its piece checksum or is not DCP metadata.
    """

    def __init__(
        self, storage: Storage, path: str, pieces: Mapping[str, Sequence[str]] | None = None
    ) -> None:
        self.storage, self.path, self.pieces = storage, path, pieces
        self._verified: dict[tuple[str, int], bytes] = {}
        meta_path = storage.join(path, METADATA)
        try:
            raw = storage.read(meta_path)
        except StorageError as exc:
            raise CheckpointCorrupt(f"{path}: no readable {METADATA} ({exc})") from exc
        if pieces is not None:
            raw = b"".join(self._piece(METADATA, i) for i in range(_count(len(raw))))
        self.layout = read_metadata(raw)

    def _piece(self, name: str, index: int) -> bytes:
        """Piece ``index`` of file ``name``, verified against its listed digest (kept for this reader)."""
        key = (name, index)
        data = self._verified.get(key)
        if data is not None:
            return data
        assert self.pieces is not None
        listed = self.pieces.get(name)
        if listed is None or index >= len(listed):
            raise CheckpointCorrupt(f"{self.path}: {name} is not listed by the manifest (or too long)")
        path = self.storage.join(self.path, name)
        size = self.storage.size(path)
        if size is None:
            raise CheckpointCorrupt(f"{self.path}: missing file {name}")
        start = index * digest.PIECE_BYTES
        data = read_range(self.storage, path, start, min(digest.PIECE_BYTES, size - start))
        if hashlib.sha256(data).hexdigest() != listed[index]:
            raise CheckpointCorrupt(f"{self.path}: checksum mismatch in {name} (bytes {start}+{len(data)})")
        if len(self._verified) > 8:  # a restore walks the files in order: a few pieces back suffice
            self._verified.pop(next(iter(self._verified)))
        self._verified[key] = data
        return data

    def _bytes(self, item: Item) -> bytes:
        if self.pieces is None:
            return read_range(self.storage, self.storage.join(self.path, item.file), item.start, item.length)
        first, last = item.start // digest.PIECE_BYTES, (item.start + item.length - 1) // digest.PIECE_BYTES
        if item.length == 0:
            return b""
        data = b"".join(self._piece(item.file, i) for i in range(first, last + 1))
        skip = item.start - first * digest.PIECE_BYTES
        return data[skip : skip + item.length]

    def _load(self, key: str, item: Item) -> torch.Tensor:
        try:
            t = torch.load(io.BytesIO(self._bytes(item)), map_location="cpu", weights_only=True)
        except (StorageError, CheckpointCorrupt):
            raise
        except Exception as exc:
            raise CheckpointCorrupt(f"{self.path}: {key}: a stored chunk does not load ({exc})") from None
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != item.sizes:
            raise CheckpointCorrupt(f"{self.path}: {key}: a stored chunk is not a tensor of {item.sizes}")
        return t

    def read(self, key: str, into: torch.Tensor, first_row: int = 0) -> None:
        """Fill ``into`` with the tensor's rows ``[first_row, first_row + len(into))`` (all of a 0-d one).

        Raises:
            CheckpointCorrupt: the key is missing, of another shape or dtype, or its stored chunks do not
                cover those rows.
        """
        stored = self.layout.tensors.get(key)
        if stored is None:
            raise CheckpointCorrupt(f"{self.path}: holds no tensor {key!r}")
        want = (len(into), *stored.shape[1:]) if stored.shape else ()
        if tuple(into.shape) != want or into.dtype != stored.dtype:
            raise CheckpointCorrupt(
                f"{self.path}: {key} is {str(stored.dtype).removeprefix('torch.')}{list(stored.shape)}, "
                f"not the {str(into.dtype).removeprefix('torch.')} rows {list(into.shape)} expected"
            )
        if not stored.shape:
            into.copy_(self._load(key, stored.items[0]))
            return
        lo, hi = first_row, first_row + len(into)
        covered = 0
        for item in stored.items:
            start, size = item.offsets[0], item.sizes[0]
            a, b = max(lo, start), min(hi, start + size)
            if a >= b:
                continue
            chunk = self._load(key, item)
            # The region of the chunk that lies in the wanted rows (every other dimension whole or in parts).
            src = chunk[a - start : b - start]
            dst = into[a - lo : b - lo]
            for dim in range(1, len(stored.shape)):
                dst = dst.narrow(dim, item.offsets[dim], item.sizes[dim])
            dst.copy_(src)
            covered += (b - a) * math.prod(item.sizes[1:])
        if covered != (hi - lo) * math.prod(stored.shape[1:]):
            raise CheckpointCorrupt(f"{self.path}: {key}: the stored chunks do not cover rows {lo}-{hi}")


def _count(size: int) -> int:
    return max(1, -(-size // digest.PIECE_BYTES))


def file_digests(storage: Storage, path: str, names: Sequence[str]) -> dict[str, tuple[int, str, list[str]]]:
    """(size, sha256 tree, piece digests) of files of a directory, read back after they were written (the
    pieces hashed on a few threads: hashlib drops the interpreter lock)."""
    out = {}
    with ThreadPoolExecutor(digest.workers(), thread_name_prefix="ckpt-dcp-digest") as pool:
        for name in names:
            data = storage.read(storage.join(path, name))
            view = memoryview(data)
            parts = [view[i : i + digest.PIECE_BYTES] for i in range(0, len(data), digest.PIECE_BYTES)]
            hashes = list(pool.map(lambda p: hashlib.sha256(p).digest(), parts))
            root = hashlib.sha256(b"".join(hashes)).hexdigest()
            out[name] = (len(data), root, [h.hex() for h in hashes])
    return out


def _url(storage: Storage, path: str) -> str:
    """The URL of ``path`` for DCP's fsspec writer: the filesystem's own inverse of its path stripping
    (``s3://bucket/key``; ``file:///abs/path`` for a filesystem of absolute paths, whose leading slash a
    plain ``proto://`` + path join would lose, making the path relative)."""
    if isinstance(storage, LocalStorage):
        return path
    return str(storage.fs.unstrip_protocol(path))  # type: ignore[attr-defined]


def save(
    state: Mapping[str, Any], storage: Storage, path: str, *, group: Any, options: Mapping[str, Any]
) -> None:
    """Write ``state`` (DCP's nested state dict: DTensors, tensors, plain values) as a DCP directory at
    ``path``, collectively over ``group`` (the writer thread's own group).

    Raises:
        StorageError: DCP's write failed (the message is its first line).
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        # A retry writes into the directory a failed attempt left: overwriting is what a retry needs,
        # whatever DCP's default (it announced a change to False)
        if isinstance(storage, LocalStorage):
            writer: Any = dcp.FileSystemWriter(path, overwrite=True)
        else:
            url = _url(storage, path)
            writer = torchcompat.dcp_fsspec_writer(url, overwrite=True, **fsspec_options(storage, options))
        dcp.save(dict(state), storage_writer=writer, process_group=group)
    except (Exception, CheckpointException) as exc:  # DCP's own exception is a BaseException
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StorageError(f"DCP write of {path} failed: {first}") from exc


def fsspec_options(storage: Storage, options: Mapping[str, Any]) -> dict[str, Any]:
    """The filesystem options of ``storage`` for DCP's writer (s3's endpoint as the storage takes it)."""
    opts = dict(options)
    fs = getattr(storage, "fs", None)
    protocol = getattr(fs, "protocol", "")
    if "s3" in (protocol if isinstance(protocol, tuple) else (protocol,)):
        from elastic_train.checkpoint.storage import ENV_S3_ENDPOINT

        endpoint = opts.pop("endpoint_url", None) or os.environ.get(ENV_S3_ENDPOINT)
        if endpoint:
            opts.setdefault("client_kwargs", {})["endpoint_url"] = endpoint
    return opts


def written_by(names: Sequence[str], rank: int) -> list[str]:
    """The data files rank ``rank`` of the writing group wrote (DCP names them ``__<rank>_<n>.distcp``)."""
    prefix = f"__{rank}_"
    return sorted(n for n in names if n.startswith(prefix) and DATA_FILE.match(n))


Fill = Callable[[str, torch.Tensor, int], None]
"""Reads a key's rows into a tensor (``DcpReader.read``'s signature)."""
