"""Generic, strict JSON encoding of frozen dataclasses of plain values (no pickle, DEVELOPERS.md rule 6).

Supported field types: ``int``, ``bool``, ``str``, ``float``, ``bytes`` (base64), ``X | None``,
``tuple[T, ...]``, fixed ``tuple[A, B]``, nested frozen dataclasses and unions of dataclasses. Every
dataclass is encoded as a JSON object tagged with its class name (``"$type"``), which also selects the
member of a union. Decoding is driven by the type annotations and rejects anything that does not match
exactly: unknown or missing fields, a bool where an int is expected, bad base64, a wrong tag.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import types
import typing
from typing import Any, TypeVar

from smold.snapshot.errors import SnapshotFormatError

T = TypeVar("T")

TAG = "$type"       # key naming the dataclass of a union member
_MAX_DEPTH = 32


class CodecError(SnapshotFormatError):
    """A value does not match the dataclass it is decoded into (or cannot be encoded)."""


def _hints(cls: type) -> dict[str, Any]:
    cached = _HINTS.get(cls)
    if cached is None:
        cached = typing.get_type_hints(cls)
        _HINTS[cls] = cached
    return cached


_HINTS: dict[type, dict[str, Any]] = {}


def _check_frozen(cls: type) -> None:
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen:
        raise CodecError(f"{cls.__name__} is not a frozen dataclass")


# -- encode -----------------------------------------------------------------------------------------------
def encode(obj: Any) -> Any:
    """A JSON-compatible value for a frozen dataclass instance (recursively)."""
    return _encode(obj, 0)


def _encode(obj: Any, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise CodecError("value nested too deeply")
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        _check_frozen(type(obj))
        out: dict[str, Any] = {TAG: type(obj).__name__}
        for f in dataclasses.fields(obj):
            out[f.name] = _encode(getattr(obj, f.name), depth + 1)
        return out
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    if isinstance(obj, float):
        if obj != obj or obj in (float("inf"), float("-inf")):
            raise CodecError("NaN and infinity cannot be encoded")
        return obj
    if isinstance(obj, (bytes, bytearray, memoryview)):
        return base64.b64encode(bytes(obj)).decode("ascii")
    if isinstance(obj, (tuple, list)):
        return [_encode(v, depth + 1) for v in obj]
    raise CodecError(f"cannot encode a {type(obj).__name__}")


# -- decode -----------------------------------------------------------------------------------------------
def decode(cls: type[T], data: Any) -> T:
    """Build a ``cls`` instance from ``encode``'s output; CodecError on any mismatch."""
    return typing.cast(T, _decode(cls, data, cls.__name__, 0))


def _decode(tp: Any, data: Any, where: str, depth: int) -> Any:
    if depth > _MAX_DEPTH:
        raise CodecError(f"{where}: nested too deeply")
    origin = typing.get_origin(tp)
    if tp is Any:
        raise CodecError(f"{where}: untyped field")
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return _decode_dataclass(tp, data, where, depth)
    if origin in (typing.Union, types.UnionType):
        return _decode_union(tp, data, where, depth)
    if origin is tuple:
        return _decode_tuple(tp, data, where, depth)
    if tp is bool:
        if not isinstance(data, bool):
            raise CodecError(f"{where}: expected a boolean, got {type(data).__name__}")
        return data
    if tp is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise CodecError(f"{where}: expected an integer, got {type(data).__name__}")
        return data
    if tp is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise CodecError(f"{where}: expected a number, got {type(data).__name__}")
        return float(data)
    if tp is str:
        if not isinstance(data, str):
            raise CodecError(f"{where}: expected a string, got {type(data).__name__}")
        return data
    if tp is bytes:
        if not isinstance(data, str):
            raise CodecError(f"{where}: expected base64 bytes, got {type(data).__name__}")
        try:
            return base64.b64decode(data.encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError) as e:
            raise CodecError(f"{where}: bad base64: {e}") from None
    if tp is type(None):
        if data is not None:
            raise CodecError(f"{where}: expected null")
        return None
    raise CodecError(f"{where}: unsupported field type {tp!r}")


def _decode_dataclass(cls: type, data: Any, where: str, depth: int) -> Any:
    _check_frozen(cls)
    if not isinstance(data, dict):
        raise CodecError(f"{where}: expected an object for {cls.__name__}, got {type(data).__name__}")
    hints = _hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]
    if data.get(TAG) != cls.__name__:
        raise CodecError(f"{where}: expected a {cls.__name__} object, got {data.get(TAG)!r}")
    names = {f.name for f in fields}
    unknown = set(data) - names - {TAG}
    if unknown:
        raise CodecError(f"{where}: unknown field(s) {', '.join(sorted(unknown))} for {cls.__name__}")
    kwargs = {}
    for f in fields:
        if f.name not in data:
            raise CodecError(f"{where}: missing field {f.name!r} of {cls.__name__}")
        kwargs[f.name] = _decode(hints[f.name], data[f.name], f"{where}.{f.name}", depth + 1)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as e:
        raise CodecError(f"{where}: {cls.__name__} rejected its values: {e}") from None


def _decode_union(tp: Any, data: Any, where: str, depth: int) -> Any:
    members = typing.get_args(tp)
    if data is None:
        if type(None) in members:
            return None
        raise CodecError(f"{where}: null is not allowed here")
    rest = [m for m in members if m is not type(None)]
    classes: list[type] = [m for m in rest if isinstance(m, type) and dataclasses.is_dataclass(m)]
    if len(rest) == 1:
        return _decode(rest[0], data, where, depth)
    if classes and len(classes) == len(rest):
        if not isinstance(data, dict):
            raise CodecError(f"{where}: expected an object, got {type(data).__name__}")
        tag = data.get(TAG)
        for c in classes:
            if c.__name__ == tag:
                return _decode_dataclass(c, data, where, depth)
        raise CodecError(f"{where}: {tag!r} is not one of {', '.join(c.__name__ for c in classes)}")
    raise CodecError(f"{where}: unsupported union {tp!r}")


def _decode_tuple(tp: Any, data: Any, where: str, depth: int) -> tuple[Any, ...]:
    if not isinstance(data, list):
        raise CodecError(f"{where}: expected a list, got {type(data).__name__}")
    args = typing.get_args(tp)
    if len(args) == 2 and args[1] is Ellipsis:
        return tuple(_decode(args[0], v, f"{where}[{i}]", depth + 1) for i, v in enumerate(data))
    if len(args) != len(data):
        raise CodecError(f"{where}: expected {len(args)} items, got {len(data)}")
    return tuple(_decode(a, v, f"{where}[{i}]", depth + 1)
                 for i, (a, v) in enumerate(zip(args, data, strict=True)))
