"""The ``nft`` command run inside a VM's namespace: apply a ruleset, add set elements, read counters back."""

from __future__ import annotations

import ipaddress
import json
import subprocess
from dataclasses import dataclass
from typing import Any

from .errors import NftError
from .netns import netns_path
from .rules import FAMILY, TABLE

NFT = "nft"
NFT_TIMEOUT_S = 30.0


def _run(namespace: str | None, args: list[str], stdin: str | None = None) -> str:
    """``nft ARGS`` in the namespace (None: the daemon's own, the host's)."""
    argv = ["nsenter", f"--net={netns_path(namespace)}", "--", NFT, *args] if namespace is not None else [NFT, *args]
    where = namespace or "the host's namespace"
    try:
        done = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=NFT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NftError(f"nft {' '.join(args[:2])} in {where}: {e}") from None
    if done.returncode != 0:
        raise NftError(f"nft {' '.join(args)} in {where} failed: {done.stderr.strip()[:2000]}")
    return done.stdout


def apply(namespace: str | None, script: str) -> None:
    """Load an ``nft -f`` script (atomically: all of it or nothing)."""
    _run(namespace, ["-f", "-"], stdin=script)


def check(script: str) -> None:
    """Validate a script without applying it (``nft -c``; runs in the caller's namespace, changes nothing)."""
    try:
        done = subprocess.run([NFT, "-c", "-f", "-"], input=script, capture_output=True, text=True,
                              timeout=NFT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NftError(f"nft -c: {e}") from None
    if done.returncode != 0:
        raise NftError(f"nft -c failed: {done.stderr.strip()[:2000]}")


def add_elements(namespace: str | None, set_name: str, elements: list[str], table: str = TABLE) -> None:
    if elements:
        _run(namespace, ["add", "element", FAMILY, table, set_name, "{ " + ", ".join(elements) + " }"])


def delete_elements(namespace: str | None, set_name: str, elements: list[str], table: str = TABLE) -> None:
    if elements:
        _run(namespace, ["delete", "element", FAMILY, table, set_name, "{ " + ", ".join(elements) + " }"])


def set_elements(namespace: str | None, set_name: str, table: str = TABLE) -> list[Any]:
    """The elements of a set as nft's JSON gives them (plain strings, or prefix/range objects)."""
    for item in list_json(namespace, "set", FAMILY, table, set_name):
        s = item.get("set")
        if isinstance(s, dict):
            elem = s.get("elem", [])
            return list(elem) if isinstance(elem, list) else []
    return []


def list_json(namespace: str | None, *what: str) -> list[dict[str, Any]]:
    out = _run(namespace, ["-j", "list", *what])
    try:
        doc = json.loads(out)
    except ValueError as e:
        raise NftError(f"nft -j list {' '.join(what)}: unreadable JSON: {e}") from None
    items = doc.get("nftables", []) if isinstance(doc, dict) else []
    return [i for i in items if isinstance(i, dict)]


def table_exists(namespace: str | None, table: str = TABLE) -> bool:
    try:
        items = list_json(namespace, "tables")
    except NftError:
        return False
    return any(i.get("table", {}).get("name") == table and i["table"].get("family") == FAMILY for i in items)


def chain_names(namespace: str | None, table: str = TABLE) -> set[str]:
    """The names of the table's chains."""
    return {c["chain"]["name"] for c in list_json(namespace, "chains", FAMILY)
            if isinstance(c.get("chain"), dict) and c["chain"].get("table") == table
            and isinstance(c["chain"].get("name"), str)}


def read_counters(namespace: str | None, table: str = TABLE) -> dict[str, int]:
    """Packets per named counter of the table."""
    out: dict[str, int] = {}
    for item in list_json(namespace, "counters", "table", FAMILY, table):
        c = item.get("counter")
        if isinstance(c, dict) and isinstance(c.get("name"), str):
            out[c["name"]] = int(c.get("packets", 0))
    return out


@dataclass(frozen=True)
class DeniedElement:
    address: str
    protocol: str
    port: int   # 0 for protocols without ports
    packets: int


def read_denied(namespace: str, set_name: str, table: str = TABLE) -> list[DeniedElement]:
    """The elements of a dynamic ``denied_*`` set (address . protocol [. port]) with their packet counters."""
    out = []
    for item in list_json(namespace, "set", FAMILY, table, set_name):
        s = item.get("set")
        if not isinstance(s, dict):
            continue
        for elem in s.get("elem", []) or []:
            out.extend(_denied_element(elem))
    return out


def _denied_element(elem: Any) -> list[DeniedElement]:
    packets = 0
    if isinstance(elem, dict) and "elem" in elem:
        inner = elem["elem"]
        counter = inner.get("counter") if isinstance(inner, dict) else None
        packets = int(counter.get("packets", 0)) if isinstance(counter, dict) else 0
        elem = inner.get("val") if isinstance(inner, dict) else None
    if not isinstance(elem, dict) or not isinstance(elem.get("concat"), list):
        return []
    parts = elem["concat"]
    if len(parts) < 2:
        return []
    try:
        addr = str(ipaddress.ip_address(str(parts[0])))
    except ValueError:
        return []
    proto = str(parts[1])
    port = int(parts[2]) if len(parts) > 2 and isinstance(parts[2], int) else 0
    return [DeniedElement(addr, proto, port, packets)]
