"""Unit tests of the guest-agent wire protocol: framing, header validation and the JSON codec."""

import json
import struct
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st
from smol_agent import protocol as P


def test_header_layout_is_16_bytes_big_endian():
    frame = P.pack_frame(P.MsgType.EXEC, 0x01020304, b"xyz", P.FLAG_END)
    assert len(frame) == P.HEADER_SIZE + 3 == 19
    magic, version, mtype, flags, rid, length = struct.unpack(">4sBBHII", frame[:16])
    assert (magic, version, mtype, flags, rid, length) == (b"SMOL", 1, 0x10, 1, 0x01020304, 3)
    assert frame[16:] == b"xyz"


def test_decoder_reassembles_frames_fed_byte_by_byte():
    frames = [
        (P.MsgType.HELLO, 0, 1, b'{"major":1}'),
        (P.MsgType.STDIN, P.FLAG_END, 7, bytes(range(256))),
        (P.MsgType.HEALTH, 0, 8, b""),
    ]
    wire = b"".join(P.pack_frame(t, rid, payload, flags) for t, flags, rid, payload in frames)
    dec = P.FrameDecoder()
    got = []
    for i in range(len(wire)):
        dec.feed(wire[i : i + 1])
        while (frame := dec.next_frame()) is not None:
            got.append(frame)
    assert got == frames
    assert dec.pending == 0


@pytest.mark.parametrize(
    ("header", "code"),
    [
        (b"JUNK" + bytes(12), P.ErrorCode.EPROTO),
        (struct.pack(">4sBBHII", b"SMOL", 2, P.MsgType.HELLO, 0, 1, 0), P.ErrorCode.EVERSION),
        (struct.pack(">4sBBHII", b"SMOL", 1, P.MsgType.DATA, 0, 1, P.MAX_PAYLOAD + 1), P.ErrorCode.EMSGSIZE),
    ],
)
def test_bad_headers_are_rejected_with_codes(header, code):
    dec = P.FrameDecoder()
    dec.feed(header)
    with pytest.raises(P.ProtocolError) as info:
        dec.next_frame()
    assert info.value.code == code


def test_max_payload_is_accepted_but_not_more():
    assert len(P.pack_frame(P.MsgType.DATA, 1, bytes(P.MAX_PAYLOAD))) == P.HEADER_SIZE + P.MAX_PAYLOAD
    with pytest.raises(P.ProtocolError) as info:
        P.pack_frame(P.MsgType.DATA, 1, bytes(P.MAX_PAYLOAD + 1))
    assert info.value.code == P.ErrorCode.EMSGSIZE


def test_incomplete_frame_is_not_returned():
    frame = P.pack_frame(P.MsgType.DATA, 3, b"abcdef")
    dec = P.FrameDecoder()
    dec.feed(frame[:-1])
    assert dec.next_frame() is None
    assert dec.pending == len(frame) - 1


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(), children, max_size=5),
    max_leaves=30,
)


@given(st.dictionaries(st.text(), json_values, max_size=8))
def test_json_codec_matches_stdlib_json(obj):
    encoded = P.encode_json(obj)
    assert json.loads(encoded) == obj
    assert P.decode_json(encoded) == obj
    assert P.decode_json(json.dumps(obj, indent=2).encode()) == obj


@pytest.mark.parametrize(
    "payload", [b"[1, 2]", b"{", b'{"a": NaN}', b'{"a": 1} x', b"\xff\xfe", b"null", b'{"a": Infinity}']
)
def test_decode_json_rejects_non_objects_and_garbage(payload):
    with pytest.raises(P.ProtocolError) as info:
        P.decode_json(payload)
    assert info.value.code == P.ErrorCode.EINVAL


def test_encode_json_rejects_unencodable():
    with pytest.raises(ValueError):
        P.encode_json({"x": float("nan")})
    with pytest.raises(TypeError):
        P.encode_json({"x": object()})
    with pytest.raises(TypeError):
        P.encode_json({1: "x"})  # type: ignore[dict-item]


def test_empty_payload_decodes_as_empty_object():
    assert P.decode_json(b"") == {}


def test_type_numbers_are_unique():
    values = [v for k, v in vars(P.MsgType).items() if not k.startswith("_")]
    assert len(values) == len(set(values)) == len(P.TYPE_NAMES)


def test_guest_boot_path_imports_no_heavy_modules_and_still_reports_json_errors():
    # In a fresh interpreter (pytest itself imports json): the agent's modules must not pull in json/re/enum,
    # and malformed JSON must still map to EINVAL although _json's error class is not loaded yet.
    code = (
        "import sys\n"
        "import smol_agent.server, smol_agent.__main__\n"
        "from smol_agent import protocol as P\n"
        "heavy = sorted(m for m in ('json', 're', 'enum', 'socket', 'signal', 'subprocess', 'asyncio',"
        " 'selectors', 'threading', 'argparse', 'typing') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
        "try:\n"
        "    P.decode_json(b'{not json')\n"
        "except P.ProtocolError as e:\n"
        "    print(e.code)\n"
    )
    r = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, env=_env())
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "EINVAL"


def _env():
    import os
    from pathlib import Path

    import smol_agent

    return {**os.environ, "PYTHONPATH": str(Path(smol_agent.__file__).parent.parent)}
