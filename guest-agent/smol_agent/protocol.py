"""Guest-agent wire protocol: frame layout, message types, error codes and the JSON codec (shared by host and guest)."""

# This module is the single source of truth for the protocol; docs/agent-protocol.md describes it in prose.
# It is imported by the guest agent at boot, so it only uses C-level stdlib modules (no enum, json, re):
# every imported module costs syscalls and page faults inside the emulated guest kernel.

import _json
import _struct

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

# --- versions -----------------------------------------------------------------------------------------------
PROTOCOL_MAJOR = 1  # carried in every frame header; a different major is rejected with EVERSION
PROTOCOL_MINOR = 2  # carried in HELLO; minors are backwards compatible, peers use min(minor_a, minor_b)
AGENT_VERSION = "0.1.0"

# --- frame header -------------------------------------------------------------------------------------------
# Big-endian, 16 bytes: magic(4) version(u8) type(u8) flags(u16) request_id(u32) payload_len(u32)
MAGIC = b"SMOL"
HEADER = _struct.Struct(">4sBBHII")
HEADER_SIZE = HEADER.size  # 16
MAX_PAYLOAD = 1 << 20  # 1 MiB per frame, both directions
CHUNK_SIZE = 256 * 1024  # preferred size of DATA/STDIN/STDOUT/STDERR chunks
MAX_REQUEST_ID = 0xFFFFFFFF

FLAG_END = 0x0001  # last frame of a DATA / STDIN stream
KNOWN_FLAGS = FLAG_END


class MsgType:
    """Frame type numbers (plain ints: no enum import on the guest's boot path)."""

    HELLO = 0x01  # C->A json {"major", "minor", "client"?}
    HELLO_OK = 0x02  # A->C json {"major", "minor", "agent_version", "pid1", "max_payload"}
    ERROR = 0x03  # A->C json {"code", "message", "errno"?}; final frame of a request
    RESULT = 0x04  # A->C json; final successful frame of a non-exec request
    DATA = 0x05  # raw bytes; file content (C->A for WRITE_FILE, A->C for READ_FILE)
    HEALTH = 0x06  # C->A json {} -> RESULT {"agent_version", "protocol", "uptime", "pid1", "pid", ...}
    POWEROFF = 0x07  # C->A json {} -> RESULT {} then the guest powers off
    EXEC = 0x10  # C->A json exec spec
    STARTED = 0x11  # A->C json {"pid"}
    STDIN = 0x12  # C->A raw bytes; FLAG_END closes the child's stdin
    STDOUT = 0x13  # A->C raw bytes
    STDERR = 0x14  # A->C raw bytes
    EXIT = 0x15  # A->C json {"exit_code", "signal", "timed_out", "duration"}; final frame of an exec
    SIGNAL = 0x16  # C->A json {"signal"}; delivered to the exec's process group
    WRITE_FILE = 0x20  # C->A json {"path", "mode", "mkdirs"}, then DATA frames -> RESULT {"size"}
    READ_FILE = 0x21  # C->A json {"path", "max_size"} -> DATA frames, RESULT {"size"}
    SET_TIME = 0x30  # C->A json {"realtime_ns"} -> RESULT {"previous_ns", "realtime_ns"} (minor >= 1)
    IDENTITY = 0x31  # C->A json {"hostname"?, "machine_id"?, "entropy"?} -> RESULT {...} (minor >= 1)
    KILL_ALL = 0x32  # C->A json {} -> RESULT {"killed"}: SIGKILL every process but PID 1 (minor >= 2; PID 1 only)


TYPE_NAMES = {v: k for k, v in vars(MsgType).items() if not k.startswith("_")}
RAW_TYPES = frozenset({MsgType.DATA, MsgType.STDIN, MsgType.STDOUT, MsgType.STDERR})


class ErrorCode:
    """Error codes carried in ERROR frames; OS failures use the errno name (ENOENT, EACCES, ...)."""

    EPROTO = "EPROTO"  # malformed frame (bad magic, truncated, unexpected frame); connection is closed
    EVERSION = "EVERSION"  # protocol major version mismatch; connection is closed
    EMSGSIZE = "EMSGSIZE"  # payload length over MAX_PAYLOAD; connection is closed
    EINVAL = "EINVAL"  # request payload invalid (bad JSON, missing/ill-typed field, id in use)
    ENOSYS = "ENOSYS"  # unknown message type
    EFBIG = "EFBIG"  # READ_FILE: the file is larger than max_size
    ENOENT = "ENOENT"
    EACCES = "EACCES"
    EPERM = "EPERM"
    EINTERNAL = "EINTERNAL"  # agent bug; the request failed, the agent keeps serving


class ProtocolError(Exception):
    """A frame or payload violates the protocol; `code` is an ErrorCode value."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# --- framing ------------------------------------------------------------------------------------------------
def pack_frame(mtype: int, request_id: int, payload: bytes = b"", flags: int = 0) -> bytes:
    """Encode one frame (header + payload)."""
    if len(payload) > MAX_PAYLOAD:
        raise ProtocolError(ErrorCode.EMSGSIZE, f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD}")
    return HEADER.pack(MAGIC, PROTOCOL_MAJOR, mtype, flags, request_id, len(payload)) + payload


def unpack_header(data: bytes | bytearray | memoryview) -> tuple[int, int, int, int]:
    """Decode and validate a 16-byte header; returns (type, flags, request_id, payload_len)."""
    magic, version, mtype, flags, request_id, length = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(ErrorCode.EPROTO, f"bad magic {bytes(magic)!r}")
    if version != PROTOCOL_MAJOR:
        raise ProtocolError(
            ErrorCode.EVERSION, f"frame has protocol major version {version}, peer speaks {PROTOCOL_MAJOR}"
        )
    if length > MAX_PAYLOAD:
        raise ProtocolError(ErrorCode.EMSGSIZE, f"payload length {length} exceeds {MAX_PAYLOAD}")
    return mtype, flags, request_id, length


class FrameDecoder:
    """Incremental decoder: feed() bytes, then iterate frames() -> (type, flags, request_id, payload)."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> None:
        self._buf += data

    @property
    def pending(self) -> int:
        """Bytes buffered that do not yet form a complete frame."""
        return len(self._buf)

    def next_frame(self) -> "tuple[int, int, int, bytes] | None":
        """Return the next complete frame, or None; raises ProtocolError on a bad header."""
        buf = self._buf
        if len(buf) < HEADER_SIZE:
            return None
        mtype, flags, request_id, length = unpack_header(buf)
        end = HEADER_SIZE + length
        if len(buf) < end:
            return None
        payload = bytes(buf[HEADER_SIZE:end])
        del buf[:end]
        return mtype, flags, request_id, payload


# --- JSON codec ---------------------------------------------------------------------------------------------
# Control payloads are UTF-8 JSON objects. The codec sits directly on the C accelerator `_json` so the guest
# does not import json/re/enum at boot; its output is standard, compact JSON.
class _ScanContext:
    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int

    @staticmethod
    def parse_constant(name: str) -> "Any":
        raise ValueError(f"non-finite number {name} is not allowed")


_scan = _json.make_scanner(_ScanContext())  # type: ignore[arg-type]  # any object with the attributes
_encode_str = _json.encode_basestring_ascii
_WS = " \t\n\r"


def _encode(obj: "Any", out: "list[str]") -> None:
    if obj is None:
        out.append("null")
    elif obj is True:
        out.append("true")
    elif obj is False:
        out.append("false")
    elif isinstance(obj, str):
        out.append(_encode_str(obj))
    elif isinstance(obj, int):
        out.append(int.__repr__(obj))
    elif isinstance(obj, float):
        if obj != obj or obj in (float("inf"), float("-inf")):
            raise ValueError("non-finite float cannot be encoded")
        out.append(float.__repr__(obj))
    elif isinstance(obj, dict):
        out.append("{")
        first = True
        for key, value in obj.items():
            if not isinstance(key, str):
                raise TypeError(f"JSON object keys must be str, not {type(key).__name__}")
            if not first:
                out.append(",")
            first = False
            out.append(_encode_str(key))
            out.append(":")
            _encode(value, out)
        out.append("}")
    elif isinstance(obj, list | tuple):
        out.append("[")
        for i, value in enumerate(obj):
            if i:
                out.append(",")
            _encode(value, out)
        out.append("]")
    else:
        raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def encode_json(obj: "dict[str, Any]") -> bytes:
    """Encode a control payload (a dict) as compact ASCII JSON."""
    out: list[str] = []
    _encode(obj, out)
    return "".join(out).encode("ascii")


def decode_json(payload: bytes) -> "dict[str, Any]":
    """Decode a control payload; an empty payload is {}. Raises ProtocolError(EINVAL) unless a JSON object."""
    if not payload:
        return {}
    for attempt in (1, 2):
        try:
            text = payload.decode("utf-8")
            start = len(text) - len(text.lstrip(_WS))
            obj, end = _scan(text, start)
            break
        except StopIteration:
            raise ProtocolError(ErrorCode.EINVAL, "payload is not valid JSON") from None
        except (ValueError, RecursionError) as exc:
            raise ProtocolError(ErrorCode.EINVAL, f"payload is not valid JSON: {exc}") from None
        except SystemError:
            # _json reports syntax errors as json.decoder.JSONDecodeError, but only once json.decoder is
            # imported (otherwise: SystemError). Import it on the first malformed payload, then retry.
            if attempt == 2:
                raise ProtocolError(ErrorCode.EINVAL, "payload is not valid JSON") from None
            import json.decoder  # noqa: F401
    if text[end:].strip(_WS):
        raise ProtocolError(ErrorCode.EINVAL, "trailing data after JSON payload")
    if not isinstance(obj, dict):
        raise ProtocolError(ErrorCode.EINVAL, "JSON payload must be an object")
    return obj


def pack_json(mtype: int, request_id: int, obj: "dict[str, Any]", flags: int = 0) -> bytes:
    """Encode a frame whose payload is a JSON control object."""
    return pack_frame(mtype, request_id, encode_json(obj), flags)


def error_payload(code: str, message: str, errno_value: "int | None" = None) -> "dict[str, Any]":
    """Build an ERROR frame payload."""
    payload: dict[str, Any] = {"code": code, "message": message}
    if errno_value is not None:
        payload["errno"] = errno_value
    return payload
