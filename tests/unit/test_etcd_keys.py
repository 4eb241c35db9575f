"""Key ranges: the end of a prefix's range follows etcd's rule, trailing 0xFF bytes included."""

from __future__ import annotations

import pytest

from elastic_train.etcd.keys import TO_THE_END, prefix_range, range_end


@pytest.mark.parametrize(
    ("prefix", "end"),
    [
        ("/elastic_train/run/", b"/elastic_train/run0"),  # '/' + 1 == '0'
        ("a", b"b"),
        (b"a\x00", b"a\x01"),
        (b"a\xfe", b"a\xff"),
        (b"a\xff", b"b"),  # the 0xFF is dropped, the byte before it incremented
        (b"a\xfe\xff\xff", b"a\xff"),
        (b"\xff", TO_THE_END),  # nothing to increment: every key from the prefix on
        (b"\xff\xff\xff", TO_THE_END),
        ("", TO_THE_END),
        ("é", "é".encode()[:-1] + bytes(["é".encode()[-1] + 1])),  # str prefixes are UTF-8 bytes
    ],
)
def test_range_end_increments_the_last_byte_below_0xff(prefix: str | bytes, end: bytes) -> None:
    assert range_end(prefix) == end


@pytest.mark.parametrize(
    ("prefix", "outside"),
    [
        (b"k", [b"j\xff", b"l", b"l\x00"]),
        (b"k\xff", [b"k", b"k\xfe\xff", b"l", b"l\x00"]),
        (b"a\xfe\xff", [b"a\xfe", b"a\xff", b"b"]),
        (b"\xff", [b"\xfe\xff"]),
        (b"\x00", [b"", b"\x01"]),
    ],
)
def test_the_range_holds_exactly_the_keys_with_the_prefix(prefix: bytes, outside: list[bytes]) -> None:
    key, end = prefix_range(prefix)

    def in_range(k: bytes) -> bool:
        return key <= k and (end == TO_THE_END or k < end)

    assert all(in_range(prefix + tail) for tail in (b"", b"\x00", b"\xff\xff", b"zzz"))
    assert not any(in_range(k) for k in outside)


def test_the_empty_prefix_is_the_whole_keyspace() -> None:
    # etcd refuses an empty key: the whole keyspace is every key from b"\0" on.
    assert prefix_range("") == (b"\x00", b"\x00")
    assert prefix_range("/a") == (b"/a", b"/b")
