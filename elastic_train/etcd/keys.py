"""Key ranges as etcd v3 takes them: ``[key, range_end)``, with ``range_end`` ``b"\\0"`` meaning "to the end".

Kept free of gRPC (the auth set-up and the rendezvous both build ranges; a unit test checks the edge cases).
"""

from __future__ import annotations

#: ``range_end`` of a range that runs to the end of the keyspace (etcd's "from key" form).
TO_THE_END = b"\0"


def range_end(prefix: str | bytes) -> bytes:
    """The exclusive end of the range holding every key that starts with ``prefix``.

    etcd's rule (clientv3 ``GetPrefixRangeEnd``): increment the last byte below 0xFF and drop the bytes after
    it. A prefix of 0xFF bytes only (or an empty one) has no such byte: its keys run to the end of the
    keyspace, :data:`TO_THE_END`.
    """
    end = bytearray(prefix.encode() if isinstance(prefix, str) else prefix)
    while end and end[-1] == 0xFF:
        end.pop()
    if not end:
        return TO_THE_END
    end[-1] += 1
    return bytes(end)


def prefix_range(prefix: str | bytes) -> tuple[bytes, bytes]:
    """``(key, range_end)`` of every key starting with ``prefix``; the empty prefix is the whole keyspace.

    etcd refuses an empty key, so the whole keyspace is ``(b"\\0", b"\\0")``: every key from the lowest one
    on (clientv3 ``WithPrefix`` on an empty key does the same).
    """
    key = prefix.encode() if isinstance(prefix, str) else bytes(prefix)
    if not key:
        return TO_THE_END, TO_THE_END
    return key, range_end(key)
