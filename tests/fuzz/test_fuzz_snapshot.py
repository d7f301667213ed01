"""Fuzz: the snapshot state file parser. Random, mutated and well-sealed-but-hostile files must give a typed
SnapshotError (or a valid state), never another exception or a hang."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_snapshot_format import sample_snapshot

from smold.snapshot import format
from smold.snapshot.errors import SnapshotError, SnapshotFormatError
from smold.snapshot.state import VmSnapshot

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    return format.pack_state(sample_snapshot(tmp_path_factory.mktemp("snap")))


def seal(packed: bytes, body: bytes) -> bytes:
    """A header for ``body`` with a correct length and digest: only the body's content can be wrong."""
    header = packed[:16] + struct.pack("<Q", len(body)) + bytes(32) + packed[56:64]
    digest = hashlib.sha256(header + body).digest()
    return header[:24] + digest + header[56:] + body


def decode(data: bytes) -> VmSnapshot | None:
    try:
        return format.unpack_state(VmSnapshot, data)
    except SnapshotError:
        return None


@given(data=st.binary(max_size=512))
def test_random_bytes_are_refused(data: bytes) -> None:
    with pytest.raises(SnapshotFormatError):
        format.unpack_state(VmSnapshot, data)


@given(prefix=st.binary(max_size=64), use_magic=st.booleans())
def test_random_headers_are_refused(packed: bytes, prefix: bytes, use_magic: bool) -> None:
    data = (format.MAGIC + prefix[8:] if use_magic else prefix) + packed[len(prefix):]
    if data == packed:
        return
    with pytest.raises(SnapshotFormatError):
        format.unpack_state(VmSnapshot, data)


@given(edits=st.lists(st.tuples(st.integers(0, 2**31), st.sampled_from(["flip", "insert", "delete"]),
                                st.integers(0, 255)), min_size=1, max_size=8))
def test_mutated_sealed_body_gives_a_typed_error_or_a_state(packed: bytes, edits: list) -> None:
    body = bytearray(packed[64:])
    for pos, kind, value in edits:
        i = pos % (len(body) + 1)
        if kind == "insert":
            body[i:i] = bytes([value])
        elif body and i < len(body):
            if kind == "flip":
                body[i] ^= value or 1
            else:
                del body[i]
    decode(seal(packed, bytes(body)))


json_st = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False),
              st.text(max_size=12), st.sampled_from(["VcpuState", "VmState", "BlockState", "", "$type"])),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)


def _paths(obj: Any, path: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [path]
    if isinstance(obj, dict):
        for k, v in obj.items():
            out += _paths(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out += _paths(v, path + (i,))
    return out


@given(which=st.integers(0, 2**31), value=json_st, drop=st.booleans())
def test_hostile_json_values_give_a_typed_error_or_a_state(packed: bytes, which: int, value: Any,
                                                           drop: bool) -> None:
    body = json.loads(packed[64:])
    paths = _paths(body)[1:]
    path = paths[which % len(paths)]
    parent = body
    for p in path[:-1]:
        parent = parent[p]
    if drop and isinstance(parent, dict):
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    decode(seal(packed, json.dumps(body).encode()))


def test_a_deeply_nested_state_is_refused(packed: bytes) -> None:
    body = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(SnapshotFormatError):
        format.unpack_state(VmSnapshot, seal(packed, body))


def test_read_state_file_refuses_a_random_file(tmp_path: Path) -> None:
    (tmp_path / "state").write_bytes(b"\x00" * 100)
    with pytest.raises(SnapshotFormatError):
        format.read_state_file(tmp_path / "state", VmSnapshot)
