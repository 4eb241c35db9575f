"""Where durable checkpoints live: a narrow storage interface over fsspec URLs.

URLs are plain strings (``/data/ckpt``, ``file:///data/ckpt``, ``memory://ckpt``, ``s3://bucket/ckpt``,
``gcs://bucket/ckpt``). Local files are written with ``os.write`` + ``fsync`` (and atomic renames for small
files) because that is what makes them durable; every other filesystem goes through fsspec, whose object
stores make each finished PUT atomic. Optional backends are imported lazily so a missing one names its extra.
"""

from __future__ import annotations

import errno
import os
import stat
import uuid
from collections.abc import Sequence
from typing import Any, Protocol

from elastic_train.checkpoint import digest
from elastic_train.checkpoint.errors import StorageError

#: pip extra that provides the filesystem of each protocol.
EXTRAS = {"s3": "s3", "s3a": "s3", "gcs": "gcs", "gs": "gcs"}
#: Environment variable read for the S3 endpoint when storage options name none (also read by s3fs users).
ENV_S3_ENDPOINT = "FSSPEC_S3_ENDPOINT_URL"


class Storage(Protocol):
    """The operations checkpoints need from a filesystem; every method raises :class:`StorageError`."""

    url: str
    """The URL this storage was opened at."""
    root: str
    """That URL as a path the other methods take."""
    recycles: bool
    """Whether a retired file can be reused for a new one (:meth:`claim`): true for local disks, where
    overwriting allocated blocks is cheaper than allocating new ones; false for object stores."""

    def join(self, base: str, *parts: str) -> str:
        """``parts`` joined under the path ``base`` (e.g. ``join(root, run_id, "manifest.json")``)."""
        ...

    def write_chunks(self, path: str, chunks: Sequence[memoryview]) -> tuple[int, str]:
        """Write ``chunks`` as one durable file; return (size, digest hex).

        A file already at ``path`` (one :meth:`claim` moved there) is overwritten in place and cut to the
        new size. The digest (:data:`elastic_train.checkpoint.digest.TREE`) is computed on other cores while
        writing.
        """
        ...

    def claim(self, src: str, dst: str) -> bool:
        """Move the file ``src`` to ``dst`` atomically: a retired share into the pool, or a pooled file to
        the path a new share is written to (:meth:`write_chunks` then overwrites it in place).

        Returns False when ``src`` is gone (another writer claimed it) or the storage does not recycle.
        """
        ...

    def write_small(self, path: str, data: bytes) -> None:
        """Write a small file atomically (readers see the old or the new content, never a mix)."""
        ...

    def read(self, path: str) -> bytes:
        """The whole content of ``path``."""
        ...

    def read_into(self, path: str, outs: Sequence[memoryview]) -> None:
        """Fill ``outs`` in order from the start of ``path`` (the caller checks their digest)."""
        ...

    def size(self, path: str) -> int | None:
        """Size in bytes, or None when the file does not exist."""
        ...

    def kind(self, path: str) -> str | None:
        """``"dir"``, ``"file"``, or None when nothing is at ``path``."""
        ...

    def listdir(self, path: str) -> list[str]:
        """Base names directly under ``path`` (empty when it does not exist)."""
        ...

    def remove(self, path: str, recursive: bool = False) -> None:
        """Delete a file (or a whole directory with ``recursive``); missing paths are fine."""
        ...


class LocalStorage:
    """A local directory; writes are fsynced, small files replaced atomically, retired files reusable."""

    recycles = True

    def __init__(self, url: str, root: str, *, direct_io: bool = True) -> None:
        self.url = url
        self.root = root
        self.direct_io = direct_io and hasattr(os, "O_DIRECT")
        """Write page-aligned shares with O_DIRECT (see :func:`direct_aligned`)."""

    def join(self, base: str, *parts: str) -> str:
        return os.path.join(base, *parts)

    def write_chunks(self, path: str, chunks: Sequence[memoryview]) -> tuple[int, str]:
        views = [c.cast("B") if c.format != "B" else c for c in chunks]
        direct = self.direct_io and direct_aligned(views)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            # No O_TRUNC: a claimed file keeps its blocks and is overwritten in place (no block allocation,
            # and no discard of the old blocks on filesystems mounted with -o discard).
            flags = os.O_WRONLY | os.O_CREAT
            fd = -1
            if direct:
                try:
                    fd = os.open(path, flags | os.O_DIRECT, 0o644)
                except OSError as exc:  # a filesystem without O_DIRECT (tmpfs …): the page cache it is
                    if exc.errno != errno.EINVAL:
                        raise
                    direct = False
            if fd < 0:
                fd = os.open(path, flags, 0o644)
            # Direct I/O leaves the CPUs to the hash from the start; a buffered write copies the bytes into
            # the page cache on one core meanwhile, and the others hash (all of them during the fsync).
            pending = digest.start(views, concurrency=digest.workers() - (0 if direct else 1))
            try:
                size = _write_views(fd, views, direct)
                if os.fstat(fd).st_size > size:
                    os.ftruncate(fd, size)
                pending.widen()
                os.fsync(fd)
            finally:
                os.close(fd)
                pending.wait()
            return size, pending.hexdigest()
        except OSError as exc:
            raise StorageError(f"cannot write {path}: {exc.strerror or exc}") from exc

    def claim(self, src: str, dst: str) -> bool:
        try:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            os.rename(src, dst)
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise StorageError(f"cannot move {src} to {dst}: {exc.strerror or exc}") from exc
        return True

    def write_small(self, path: str, data: bytes) -> None:
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            dfd = os.open(os.path.dirname(path), os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as exc:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise StorageError(f"cannot write {path}: {exc.strerror or exc}") from exc

    def read(self, path: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as exc:
            raise StorageError(f"cannot read {path}: {exc.strerror or exc}") from exc

    def read_into(self, path: str, outs: Sequence[memoryview]) -> None:
        try:
            with open(path, "rb", buffering=0) as f:
                for out in outs:
                    pos = 0
                    while pos < out.nbytes:
                        n = f.readinto(out[pos:])
                        if not n:
                            raise StorageError(f"{path}: file is shorter than its manifest says")
                        pos += n
        except OSError as exc:
            raise StorageError(f"cannot read {path}: {exc.strerror or exc}") from exc

    def size(self, path: str) -> int | None:
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StorageError(f"cannot stat {path}: {exc.strerror or exc}") from exc

    def kind(self, path: str) -> str | None:
        try:
            return "dir" if stat.S_ISDIR(os.stat(path).st_mode) else "file"
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            raise StorageError(f"cannot stat {path}: {exc.strerror or exc}") from exc

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []
        except OSError as exc:
            raise StorageError(f"cannot list {path}: {exc.strerror or exc}") from exc

    def remove(self, path: str, recursive: bool = False) -> None:
        import shutil

        try:
            if os.path.isdir(path) and not os.path.islink(path):
                if recursive:
                    shutil.rmtree(path, ignore_errors=False)
                else:
                    os.rmdir(path)
            elif os.path.lexists(path):
                os.unlink(path)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise StorageError(f"cannot remove {path}: {exc.strerror or exc}") from exc


#: Alignment O_DIRECT needs of buffer addresses, file offsets and lengths (a page covers 512 and 4 KiB
#: logical blocks).
DIRECT_ALIGN = 4096
#: Bytes per O_DIRECT write call: large enough to keep the device queue full, small enough to stay
#: interruptible.
DIRECT_REQUEST = 16 << 20


def _address(view: memoryview) -> int:
    import numpy as np

    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data) if view.nbytes else 0


def direct_aligned(views: Sequence[memoryview]) -> bool:
    """Whether ``views`` can be written with O_DIRECT: every view starts on a :data:`DIRECT_ALIGN` boundary
    in memory and all but the last have a length that is a multiple of it (so file offsets stay aligned;
    the last view's unaligned tail is written through the page cache).

    Checkpoint shares are page-aligned byte ranges of a page-aligned flat buffer, so they qualify; anything
    else is written through the page cache.
    """
    views = [v for v in views if v.nbytes]
    if not views:
        return False
    if any(_address(v) % DIRECT_ALIGN for v in views):
        return False
    return all(v.nbytes % DIRECT_ALIGN == 0 for v in views[:-1])


def _clear_direct(fd: int) -> None:
    """Switch ``fd`` from O_DIRECT to writes through the page cache."""
    import fcntl

    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_DIRECT)


def _write_views(fd: int, views: Sequence[memoryview], direct: bool) -> int:
    """Write ``views`` in order at the start of ``fd``; returns the bytes written.

    With ``direct`` (``fd`` opened with O_DIRECT and :func:`direct_aligned` views), the aligned part goes
    straight from memory to the device, in :data:`DIRECT_REQUEST` calls; the final unaligned tail, and
    everything after a direct write the kernel refuses (EINVAL) or cuts short, goes through the page cache.
    """
    size = 0
    for view in views:
        if direct:
            body = view.nbytes - view.nbytes % DIRECT_ALIGN
            pos = 0
            try:
                while pos < body:
                    n = os.write(fd, view[pos : min(body, pos + DIRECT_REQUEST)])
                    pos += n
                    if n % DIRECT_ALIGN:
                        break
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
            size += pos
            view = view[pos:]
            if view.nbytes:
                _clear_direct(fd)
                direct = False
        while view.nbytes:
            n = os.write(fd, view)
            view = view[n:]
            size += n
    return size


class FsspecStorage:
    """Any other fsspec filesystem (memory, s3, gcs …); objects are never reused."""

    recycles = False

    def __init__(self, url: str, fs: Any, root: str) -> None:
        self.url = url
        self.fs = fs
        self.root = root.rstrip("/")

    def join(self, base: str, *parts: str) -> str:
        return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts if p)])

    def _wrap(self, what: str, path: str, exc: Exception) -> StorageError:
        return StorageError(
            f"cannot {what} {self._display(path)}: {type(exc).__name__}: {exc}".splitlines()[0]
        )

    def _display(self, path: str) -> str:
        proto = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        return f"{proto}://{path.lstrip('/')}" if proto != "file" else path

    def write_chunks(self, path: str, chunks: Sequence[memoryview]) -> tuple[int, str]:
        pending = digest.start(chunks)
        size = 0
        try:
            with self.fs.open(path, "wb") as f:
                for c in chunks:
                    f.write(c.cast("B") if c.format != "B" else c)
                    size += c.nbytes
        except Exception as exc:
            raise self._wrap("write", path, exc) from exc
        finally:
            pending.wait()
        return size, pending.hexdigest()

    def claim(self, src: str, dst: str) -> bool:
        return False

    def write_small(self, path: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(path, data)
        except Exception as exc:
            raise self._wrap("write", path, exc) from exc

    def read(self, path: str) -> bytes:
        try:
            return bytes(self.fs.cat_file(path))
        except Exception as exc:
            raise self._wrap("read", path, exc) from exc

    def read_into(self, path: str, outs: Sequence[memoryview]) -> None:
        try:
            with self.fs.open(path, "rb", block_size=16 << 20) as f:
                for out in outs:
                    pos = 0
                    while pos < out.nbytes:
                        data = f.read(min(64 << 20, out.nbytes - pos))
                        if not data:
                            raise StorageError(
                                f"{self._display(path)}: file is shorter than its manifest says"
                            )
                        out[pos : pos + len(data)] = data
                        pos += len(data)
        except StorageError:
            raise
        except Exception as exc:
            raise self._wrap("read", path, exc) from exc

    def size(self, path: str) -> int | None:
        try:
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise self._wrap("stat", path, exc) from exc
        return None if info.get("type") == "directory" else int(info.get("size") or 0)

    def kind(self, path: str) -> str | None:
        try:
            self.fs.invalidate_cache(path)
            info = self.fs.info(path)
        except FileNotFoundError:
            return None
        except Exception as exc:
            raise self._wrap("stat", path, exc) from exc
        return "dir" if info.get("type") == "directory" else "file"

    def listdir(self, path: str) -> list[str]:
        try:
            self.fs.invalidate_cache(path)
            entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        except Exception as exc:
            raise self._wrap("list", path, exc) from exc
        names = {str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries}
        return sorted(n for n in names if n)

    def remove(self, path: str, recursive: bool = False) -> None:
        try:
            self.fs.rm(path, recursive=recursive)
        except FileNotFoundError:
            return
        except Exception as exc:
            raise self._wrap("remove", path, exc) from exc


def open_storage(url: str, options: dict[str, Any] | None = None, *, direct_io: bool = True) -> Storage:
    """Open the filesystem of ``url`` (a plain path or any fsspec URL).

    ``options`` are passed to the fsspec filesystem; for s3, ``endpoint_url`` is moved into
    ``client_kwargs`` and :data:`ENV_S3_ENDPOINT` is honoured when no endpoint is given. ``direct_io``
    lets a local directory write aligned shares with O_DIRECT.

    Raises:
        StorageError: the protocol is unknown or its optional package is not installed.
    """
    import fsspec
    from fsspec.core import split_protocol

    protocol, rest = split_protocol(url)
    if protocol in (None, "file", "local"):
        root = os.path.abspath(os.path.expanduser(rest if protocol else url))
        return LocalStorage(url, root, direct_io=direct_io)
    opts = dict(options or {})
    if protocol in ("s3", "s3a"):
        endpoint = opts.pop("endpoint_url", None) or os.environ.get(ENV_S3_ENDPOINT)
        if endpoint:
            opts.setdefault("client_kwargs", {})["endpoint_url"] = endpoint
    try:
        fs = fsspec.filesystem(protocol, **opts)
    except ImportError as exc:
        extra = EXTRAS.get(protocol or "")
        hint = (
            f"install elastic-train's [{extra}] extra (pip install -e '.[{extra}]' in the checkout)"
            if extra
            else "install its fsspec implementation"
        )
        raise StorageError(f"{url}: the {protocol}:// filesystem is not installed ({hint})") from exc
    except ValueError as exc:
        raise StorageError(f"{url}: unknown storage protocol {protocol!r}") from exc
    except Exception as exc:
        raise StorageError(f"{url}: cannot open storage: {exc}".splitlines()[0]) from exc
    return FsspecStorage(url, fs, fs._strip_protocol(url))
