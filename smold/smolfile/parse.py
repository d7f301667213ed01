"""Parse and validate a Smolfile (TOML via tomllib, or an already-decoded mapping) into model dataclasses."""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import posixpath
import re
import tomllib
from collections.abc import Collection, Mapping
from dataclasses import replace
from datetime import date, datetime, time
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlsplit

from .errors import KeyPath, SmolfileError
from .model import (
    DEFAULT_CPUS,
    DEFAULT_IMAGE,
    DEFAULT_MEMORY_MIB,
    MAX_OUTPUTS,
    MAX_TIMEOUT_S,
    MIN_CPUS,
    MIN_MEMORY_MIB,
    SYSTEM_PARENTS,
    SYSTEM_PATHS,
    AllowRule,
    Check,
    Command,
    CommandCheck,
    FileExistsCheck,
    FileMatchesCheck,
    HttpCheck,
    Limits,
    Mount,
    NetworkPolicy,
    PortForward,
    RewardCheck,
    Smolfile,
    Timeouts,
)

DEFAULT_FILENAME = "Smolfile.toml"
MAX_SMOLFILE_BYTES = 1 << 20

TOP_KEYS = ("image", "cpus", "memory", "network", "mounts", "env", "setup", "task", "timeouts", "verifier")
COMMAND_KEYS = ("run", "timeout", "cwd", "user")
CHECK_COMMON_KEYS = ("kind", "name", "timeout")
CHECK_KEYS: dict[str, tuple[str, ...]] = {
    "command": ("run", "expect_exit", "cwd", "user"),
    "file_exists": ("path",),
    "file_matches": ("path", "content", "regex", "sha256"),
    "http": ("url", "expect_status", "contains"),
    "reward": ("path", "threshold"),
}
LOCAL_HTTP_HOSTS = ("127.0.0.1", "localhost", "::1")

# "default", a configured name, a registry reference, or a local OCI layout/archive path
# ("./img", "../x.tar", "/abs/dir", "oci:DIR[:TAG]", "oci-archive:FILE", "docker-archive:FILE").
_IMAGE_RE = re.compile(r"(?:[A-Za-z0-9]|\.{1,2}/|/)[A-Za-z0-9._\-/:@+]{0,254}")
_ENV_KEY_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_MEMORY_RE = re.compile(r"\s*(\d+)\s*([A-Za-z]*)\s*")
_MEMORY_UNITS = {"m": 1, "mib": 1, "g": 1024, "gib": 1024}
_DNS_LABEL_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_SHA256_RE = re.compile(r"[0-9a-fA-F]{64}")
_USER_RE = re.compile(r"[A-Za-z0-9_.][A-Za-z0-9_.-]{0,31}")
_NAME_MAX = 128


def _type_name(value: object) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a float"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, Mapping):
        return "a table"
    if isinstance(value, datetime | date | time):
        return "a date/time"
    return type(value).__name__


class _Parser:
    """Validation helpers bound to one file name; every failure raises SmolfileError at a key path."""

    def __init__(self, file: str, base_dir: str | None, limits: Limits) -> None:
        self.file = file
        self.base_dir = base_dir
        self.limits = limits

    def fail(self, path: KeyPath, reason: str) -> NoReturn:
        raise SmolfileError.at(self.file, path, reason)

    # --- primitive types ---------------------------------------------------------------------------
    def table(self, value: object, path: KeyPath, allowed: Collection[str] | None = None) -> Mapping[str, Any]:
        if not isinstance(value, Mapping):
            self.fail(path, f"must be a table, not {_type_name(value)}")
        if allowed is not None:
            for key in value:
                if key not in allowed:
                    self.fail([*path, key], self._unknown_key(str(key), allowed))
        return value

    @staticmethod
    def _unknown_key(key: str, allowed: Collection[str]) -> str:
        close = difflib.get_close_matches(key, list(allowed), n=1)
        hint = f"did you mean '{close[0]}'?" if close else "expected one of " + ", ".join(allowed)
        return f"unknown key ({hint})"

    def string(self, value: object, path: KeyPath, *, allow_empty: bool = False) -> str:
        if not isinstance(value, str):
            self.fail(path, f"must be a string, not {_type_name(value)}")
        if not value and not allow_empty:
            self.fail(path, "must not be empty")
        if "\0" in value:
            self.fail(path, "must not contain NUL characters")
        return value

    def integer(self, value: object, path: KeyPath, lo: int, hi: int, unit: str = "") -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(path, f"must be an integer, not {_type_name(value)}")
        if not lo <= value <= hi:
            self.fail(path, f"must be between {lo} and {hi}{unit} (got {value})")
        return value

    def number(self, value: object, path: KeyPath) -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            self.fail(path, f"must be a number, not {_type_name(value)}")
        if not math.isfinite(value):
            self.fail(path, "must be a finite number")
        return float(value)

    def seconds(self, value: object, path: KeyPath) -> float:
        s = self.number(value, path)
        if not 0 < s <= MAX_TIMEOUT_S:
            self.fail(path, f"must be more than 0 and at most {MAX_TIMEOUT_S:g} seconds (got {s:g})")
        return s

    def guest_path(self, value: object, path: KeyPath) -> str:
        p = self.string(value, path)
        if not p.startswith("/"):
            self.fail(path, "must be absolute")
        norm = posixpath.normpath(p)
        if norm.startswith("//"):
            norm = "/" + norm.lstrip("/")
        if norm != p.rstrip("/") and not (p == "/" and norm == "/"):
            self.fail(path, f"must be normalized, without '.', '..' or repeated '/' (got '{p}', use '{norm}')")
        return norm

    def user(self, value: object, path: KeyPath) -> str:
        if isinstance(value, int) and not isinstance(value, bool):
            return str(self.integer(value, path, 0, 2**32 - 2))
        name = self.string(value, path)
        if not _USER_RE.fullmatch(name):
            self.fail(path, f"must be a user name or numeric uid (got '{name}')")
        return name

    # --- compound values ---------------------------------------------------------------------------
    def run(self, value: object, path: KeyPath) -> str | tuple[str, ...]:
        """A command line: a string (run with sh -c) or a non-empty array of strings (argv)."""
        if isinstance(value, str):
            return self.string(value, path)
        if isinstance(value, list | tuple):
            if not value:
                self.fail(path, "must not be an empty array")
            argv = tuple(self.string(arg, [*path, i], allow_empty=i > 0) for i, arg in enumerate(value))
            return argv
        self.fail(path, f"must be a string (run with sh -c) or an array of strings, not {_type_name(value)}")

    def command(self, value: object, path: KeyPath) -> Command:
        """A string, an argv array, or a table {run, timeout, cwd, user}."""
        if not isinstance(value, Mapping):
            return Command(self.run(value, path))
        t = self.table(value, path, COMMAND_KEYS)
        if "run" not in t:
            self.fail(path, "missing key 'run'")
        return Command(
            run=self.run(t["run"], [*path, "run"]),
            timeout=self.seconds(t["timeout"], [*path, "timeout"]) if "timeout" in t else None,
            cwd=self.guest_path(t["cwd"], [*path, "cwd"]) if "cwd" in t else None,
            user=self.user(t["user"], [*path, "user"]) if "user" in t else None,
        )

    def image(self, value: object, path: KeyPath) -> str:
        name = self.string(value, path)
        if not _IMAGE_RE.fullmatch(name):
            self.fail(path, f"is not a valid image name (got '{name}')")
        return name

    def memory(self, value: object, path: KeyPath) -> int:
        """MiB as an integer, or a string with a 1024-based unit: "512M", "512MiB", "2G", "2GiB"."""
        hi = self.limits.max_memory_mib
        if isinstance(value, str):
            m = _MEMORY_RE.fullmatch(value)
            if not m:
                self.fail(path, f"must be an integer (MiB) or a size like \"512M\" or \"2G\" (got '{value}')")
            unit = m.group(2).lower()
            if unit not in _MEMORY_UNITS:
                why = "needs a unit" if not unit else f"has unknown unit '{m.group(2)}'"
                self.fail(path, f"{why}: use M/MiB or G/GiB, 1024-based (got '{value}')")
            mib = int(m.group(1)) * _MEMORY_UNITS[unit]
        elif isinstance(value, int) and not isinstance(value, bool):
            mib = value
        else:
            self.fail(path, f"must be an integer (MiB) or a string like \"2G\", not {_type_name(value)}")
        if mib < MIN_MEMORY_MIB:
            self.fail(path, f"must be at least {MIN_MEMORY_MIB} MiB (got {mib} MiB)")
        if mib > hi:
            self.fail(path, f"must be at most {hi} MiB on this host (got {mib} MiB)")
        return mib

    def network(self, value: object, path: KeyPath) -> NetworkPolicy:
        """"off", "public", "closed" (a NIC, nothing allowed), or {public = bool, allow = [entries], forward =
        [entries]} with public true or at least one entry in allow or forward."""
        if isinstance(value, str):
            if value == "public":
                return NetworkPolicy(public=True)
            if value == "closed":
                return NetworkPolicy(closed=True)
            if value != "off":
                self.fail(path, f"must be \"off\", \"public\", \"closed\" or a table {{allow = [...]}} "
                                f"(got '{value}')")
            return NetworkPolicy()
        t = self.table(value, path, ("allow", "forward", "public"))
        public = t.get("public", False)
        if not isinstance(public, bool):
            self.fail([*path, "public"], f"must be true or false, not {_type_name(public)}")
        if "allow" not in t and "forward" not in t and not public:
            self.fail(path, "missing key 'allow'")
        rules: list[AllowRule] = []
        for i, entry in enumerate(self._entries(t, "allow", path)):
            rule = self.allow_rule(entry, [*path, "allow", i])
            if rule in rules:
                self.fail([*path, "allow", i], f"duplicate entry '{rule}'")
            rules.append(rule)
        forwards: list[PortForward] = []
        for i, entry in enumerate(self._entries(t, "forward", path)):
            fwd = self.port_forward(entry, [*path, "forward", i])
            if fwd in forwards:
                self.fail([*path, "forward", i], f"duplicate entry '{fwd}'")
            for other in forwards:
                if fwd.host_port and (other.host_address, other.host_port) == (fwd.host_address, fwd.host_port):
                    self.fail([*path, "forward", i], f"host {fwd.host_address}:{fwd.host_port} is already forwarded")
            forwards.append(fwd)
        if not rules and not forwards and not public:
            self.fail([*path, "allow"], "must not be empty (write network = \"off\" to disable networking)")
        return NetworkPolicy(tuple(rules), tuple(forwards), public)

    def _entries(self, t: Mapping[str, Any], key: str, path: KeyPath) -> list[Any]:
        entries = t.get(key, [])
        if not isinstance(entries, list | tuple):
            self.fail([*path, key], f"must be an array of strings, not {_type_name(entries)}")
        return list(entries)

    def port_forward(self, value: object, path: KeyPath) -> PortForward:
        """"GUEST_PORT", "HOST_PORT:GUEST_PORT" or "HOST_ADDRESS:HOST_PORT:GUEST_PORT" (IPv4; host port 0 or
        none: any free port, on 127.0.0.1 unless an address is given)."""
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        text = self.string(value, path).strip()
        parts = text.split(":")
        if len(parts) > 3:
            self.fail(path, f"invalid forward '{text}': expected GUEST_PORT, HOST_PORT:GUEST_PORT or "
                            "HOST_ADDRESS:HOST_PORT:GUEST_PORT")
        address = parts[0] if len(parts) == 3 else "127.0.0.1"
        try:
            ipaddress.IPv4Address(address)
        except ValueError:
            self.fail(path, f"invalid forward '{text}': the host address must be an IPv4 address (got '{address}')")
        guest = self._port(parts[-1], path, text)
        host = 0
        if len(parts) >= 2 and parts[-2] != "0":
            host = self._port(parts[-2], path, text)
        return PortForward(guest, host, address)

    def allow_rule(self, value: object, path: KeyPath) -> AllowRule:
        """A CIDR, an IP address, or a DNS name; the last two optionally with ":port" ([v6]:port)."""
        text = self.string(value, path).strip()
        if "/" in text:
            try:
                net = ipaddress.ip_network(text, strict=True)
            except ValueError as e:
                self.fail(path, f"invalid CIDR '{text}': {e}")
            return AllowRule("cidr", str(net))
        host, port = text, None
        if text.startswith("["):
            close = text.find("]")
            rest = text[close + 1 :] if close > 0 else ""
            if close < 0 or (rest and not rest.startswith(":")):
                self.fail(path, f"invalid entry '{text}': expected [IPv6] or [IPv6]:port")
            host, port = text[1:close], self._port(rest[1:], path, text) if rest else None
            try:
                ipaddress.IPv6Address(host)
            except ValueError:
                self.fail(path, f"invalid IPv6 address in '{text}'")
        elif text.count(":") == 1:
            host, port_text = text.split(":")
            port = self._port(port_text, path, text)
        try:
            addr = ipaddress.ip_address(host)
            return AllowRule("cidr", str(ipaddress.ip_network(addr)), port)
        except ValueError:
            pass
        name = host.lower().rstrip(".")
        labels = name.split(".")
        if (
            not name
            or len(name) > 253
            or not all(_DNS_LABEL_RE.fullmatch(label) for label in labels)
            or labels[-1].isdigit()
        ):
            self.fail(path, f"'{text}' is not a CIDR, an IP address or a DNS name (optionally with :port)")
        return AllowRule("host", name, port)

    def _port(self, text: str, path: KeyPath, entry: str) -> int:
        if not text.isdigit() or not 1 <= int(text) <= 65535:
            self.fail(path, f"invalid port in '{entry}': must be 1..65535")
        return int(text)

    def mounts(self, value: object, path: KeyPath) -> tuple[Mount, ...]:
        """A table: host path (relative to the Smolfile's directory) = absolute guest path."""
        t = self.table(value, path)
        if t and self.base_dir is None:
            self.fail(path, "mounts need a base directory (where the Smolfile is)")
        mounts: list[Mount] = []
        for host_key, guest_value in t.items():
            mpath = [*path, host_key]
            host = self.string(host_key, mpath)
            if host.startswith("/") or os.path.isabs(host):
                self.fail(mpath, "host path must be relative to the Smolfile's directory")
            norm = posixpath.normpath(host)
            if norm == ".." or norm.startswith("../"):
                self.fail(mpath, "host path escapes the Smolfile's directory")
            guest = self.guest_path(guest_value, mpath)
            if guest == "/":
                self.fail(mpath, "cannot copy onto the guest's root directory")
            for other in mounts:
                if other.host == norm:
                    self.fail(mpath, f"same host path as the mount of '{other.host}'")
                if _overlaps(other.guest, guest):
                    self.fail(mpath, f"guest path '{guest}' overlaps '{other.guest}' (mount of '{other.host}')")
            mounts.append(Mount(norm, guest))
        return tuple(mounts)

    def env(self, value: object, path: KeyPath) -> tuple[tuple[str, str], ...]:
        t = self.table(value, path)
        out: list[tuple[str, str]] = []
        for key, v in t.items():
            if not _ENV_KEY_RE.fullmatch(key):
                self.fail([*path, key], "invalid variable name (letters, digits and '_', not starting with a digit)")
            out.append((key, self.string(v, [*path, key], allow_empty=True)))
        return tuple(sorted(out))  # order carries no meaning (and proto maps do not keep it)

    def timeouts(self, value: object, path: KeyPath) -> Timeouts:
        t = self.table(value, path, ("boot", "setup", "task", "verify"))
        return Timeouts(**{k: self.seconds(v, [*path, k]) for k, v in t.items()})

    # --- verifier ----------------------------------------------------------------------------------
    def verifier(self, value: object, path: KeyPath) -> tuple[Check, ...]:
        t = self.table(value, path, ("checks", "mounts", "outputs", "image"))
        raw = t.get("checks", [])
        cpath = [*path, "checks"]
        if not isinstance(raw, list | tuple):
            self.fail(cpath, f"must be an array of tables ([[verifier.checks]]), not {_type_name(raw)}")
        checks: list[Check] = []
        names: dict[str, int] = {}
        for i, item in enumerate(raw):
            check = self.check(item, [*cpath, i], i)
            if check.name in names:
                self.fail(
                    [*cpath, i, "name"],
                    f"duplicate check name '{check.name}' (same as checks[{names[check.name]}]); "
                    "give each check a distinct name",
                )
            names[check.name] = i
            checks.append(check)
        return tuple(checks)

    def check(self, value: object, path: KeyPath, index: int) -> Check:
        t = self.table(value, path)
        if "kind" not in t:
            self.fail(path, "missing key 'kind' (one of " + ", ".join(CHECK_KEYS) + ")")
        kind = self.string(t["kind"], [*path, "kind"])
        if kind not in CHECK_KEYS:
            close = difflib.get_close_matches(kind, list(CHECK_KEYS), n=1)
            hint = f"; did you mean '{close[0]}'?" if close else ""
            self.fail([*path, "kind"], f"unknown check kind '{kind}' (one of {', '.join(CHECK_KEYS)}){hint}")
        allowed = CHECK_COMMON_KEYS + CHECK_KEYS[kind]
        for key in t:
            if key not in allowed:
                if any(key in keys for keys in CHECK_KEYS.values()):
                    self.fail([*path, key], f"not a key of kind = \"{kind}\" (allowed: {', '.join(allowed)})")
                self.fail([*path, key], self._unknown_key(str(key), allowed))

        def req(key: str) -> Any:
            if key not in t:
                self.fail(path, f"missing key '{key}' (required for kind = \"{kind}\")")
            return t[key]

        def at(key: str) -> KeyPath:
            return [*path, key]

        timeout = self.seconds(t["timeout"], at("timeout")) if "timeout" in t else None
        check: Check
        if kind == "command":
            run = self.run(req("run"), at("run"))
            check = CommandCheck(
                name="",
                timeout=timeout,
                run=run,
                expect_exit=self.integer(t["expect_exit"], at("expect_exit"), 0, 255)
                if "expect_exit" in t
                else 0,
                cwd=self.guest_path(t["cwd"], at("cwd")) if "cwd" in t else None,
                user=self.user(t["user"], at("user")) if "user" in t else None,
            )
        elif kind == "file_exists":
            check = FileExistsCheck(name="", timeout=timeout, path=self.guest_path(req("path"), at("path")))
        elif kind == "file_matches":
            fpath = self.guest_path(req("path"), at("path"))
            given = [k for k in ("content", "regex", "sha256") if k in t]
            if len(given) != 1:
                self.fail(
                    path,
                    "needs exactly one of 'content', 'regex', 'sha256'"
                    + (f" (got {', '.join(given)})" if given else ""),
                )
            content = self.string(t["content"], at("content"), allow_empty=True) if "content" in t else None
            regex = self.string(t["regex"], at("regex")) if "regex" in t else None
            if regex is not None:
                try:
                    re.compile(regex)
                except re.error as e:
                    self.fail(at("regex"), f"invalid regular expression: {e}")
            sha = self.string(t["sha256"], at("sha256")) if "sha256" in t else None
            if sha is not None:
                if sha.startswith("sha256:"):
                    sha = sha[len("sha256:") :]
                if not _SHA256_RE.fullmatch(sha):
                    self.fail(at("sha256"), "must be 64 hexadecimal digits")
                sha = sha.lower()
            check = FileMatchesCheck(
                name="", timeout=timeout, path=fpath, content=content, regex=regex, sha256=sha
            )
        elif kind == "http":
            check = HttpCheck(
                name="",
                timeout=timeout,
                url=self.local_url(req("url"), at("url")),
                expect_status=self.integer(t["expect_status"], at("expect_status"), 100, 599)
                if "expect_status" in t
                else 200,
                contains=self.string(t["contains"], at("contains")) if "contains" in t else None,
            )
        else:
            rpath = self.guest_path(t["path"], at("path")) if "path" in t else None
            check = RewardCheck(
                name="",
                timeout=timeout,
                path=rpath,
                threshold=self.number(t["threshold"], at("threshold")) if "threshold" in t else 1.0,
            )
        name = self.check_name(t["name"], at("name")) if "name" in t else default_check_name(check)
        return _with_name(check, name)

    def check_name(self, value: object, path: KeyPath) -> str:
        name = self.string(value, path)
        if len(name) > _NAME_MAX:
            self.fail(path, f"must be at most {_NAME_MAX} characters")
        if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
            self.fail(path, "must not contain control characters")
        return name

    def local_url(self, value: object, path: KeyPath) -> str:
        url = self.string(value, path)
        where = "must be an http:// URL on 127.0.0.1, localhost or [::1] (it is fetched inside the guest)"
        try:
            parts = urlsplit(url)
            port = parts.port
        except ValueError as e:
            self.fail(path, f"{where}: {e} (got '{url}')")
        if parts.scheme != "http" or parts.hostname not in LOCAL_HTTP_HOSTS:
            self.fail(path, f"{where} (got '{url}')")
        if parts.username is not None or parts.password is not None:
            self.fail(path, f"must not contain credentials (got '{url}')")
        if port == 0:
            self.fail(path, f"invalid port 0 (got '{url}')")
        return url


def _overlaps(a: str, b: str) -> bool:
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def _with_name(check: Check, name: str) -> Check:
    return replace(check, name=name)


def default_check_name(check: Check) -> str:
    """The name a check gets when the Smolfile gives none: its kind and what it looks at."""
    if isinstance(check, CommandCheck):
        shown = check.run if isinstance(check.run, str) else " ".join(check.run)
        if len(shown) > 60:
            shown = shown[:57] + "..."
        return f"command: {shown}"
    if isinstance(check, FileExistsCheck | FileMatchesCheck):
        return f"{check.kind}: {check.path}"
    if isinstance(check, HttpCheck):
        return f"http: {check.url}"
    return f"reward: {check.path or 'reward.txt|reward.json'}"


# --- entry points -----------------------------------------------------------------------------------------
def parse_mapping(
    data: Mapping[str, Any],
    *,
    base_dir: str | os.PathLike[str] | None,
    filename: str = DEFAULT_FILENAME,
    limits: Limits | None = None,
) -> Smolfile:
    """Validate an already-decoded Smolfile mapping (TOML structure) into a Smolfile.

    Validation is lexical only (no file system access); see check_mount_sources for the rest.
    """
    base = os.fspath(base_dir) if base_dir is not None else None
    if base is not None and not os.path.isabs(base):
        raise SmolfileError(filename, "", f"base directory must be an absolute path (got '{base}')")
    p = _Parser(filename, base, limits or Limits())
    t = p.table(data, [], TOP_KEYS)
    return Smolfile(
        image=p.image(t["image"], ["image"]) if "image" in t else DEFAULT_IMAGE,
        cpus=p.integer(t["cpus"], ["cpus"], MIN_CPUS, p.limits.max_cpus) if "cpus" in t else DEFAULT_CPUS,
        memory_mib=p.memory(t["memory"], ["memory"]) if "memory" in t else DEFAULT_MEMORY_MIB,
        network=p.network(t["network"], ["network"]) if "network" in t else NetworkPolicy(),
        mounts=p.mounts(t["mounts"], ["mounts"]) if "mounts" in t else (),
        env=p.env(t["env"], ["env"]) if "env" in t else (),
        setup=_setup(p, t["setup"]) if "setup" in t else (),
        task=p.command(t["task"], ["task"]) if "task" in t else None,
        timeouts=p.timeouts(t["timeouts"], ["timeouts"]) if "timeouts" in t else Timeouts(),
        checks=p.verifier(t["verifier"], ["verifier"]) if "verifier" in t else (),
        base_dir=base,
        verifier_mounts=_verifier_mounts(p, t.get("verifier"), t.get("mounts")),
        verifier_outputs=_verifier_outputs(p, t.get("verifier")),
        verifier_image=_verifier_image(p, t.get("verifier")),
    )


def _verifier_image(p: _Parser, verifier: object) -> str:
    """[verifier] image: an image name as for the top-level image; only beside outputs (a sealed Run), since the
    verifier's machine of another image can receive nothing of the task's but its declared outputs."""
    if not isinstance(verifier, dict) or "image" not in verifier:
        return ""
    image = p.image(verifier["image"], ["verifier", "image"])
    if "outputs" not in verifier:
        p.fail(["verifier", "image"], "a verifier image needs [verifier] outputs: the checks run in a machine of "
               "that image, which receives only the task's declared outputs (docs/verifier.md)")
    return image


def _verifier_outputs(p: _Parser, verifier: object) -> tuple[str, ...]:
    """[verifier] outputs: absolute guest paths, none of them system files, none overlapping another, a verifier
    mount or a task mount's guest path; no http check beside them (it needs the task's machine, which is gone)."""
    if not isinstance(verifier, dict) or "outputs" not in verifier:
        return ()
    path = ["verifier", "outputs"]
    value = verifier["outputs"]
    if not isinstance(value, list | tuple):
        p.fail(path, f"must be an array of absolute guest paths, not {_type_name(value)}")
    if not value:
        p.fail(path, "must name at least one guest path (leave it out for verification in the task's machine)")
    if len(value) > MAX_OUTPUTS:
        p.fail(path, f"at most {MAX_OUTPUTS} outputs")
    out: list[str] = []
    for i, item in enumerate(value):
        guest = p.guest_path(item, [*path, i])
        if guest in SYSTEM_PARENTS or any(_overlaps(guest, sp) for sp in SYSTEM_PATHS):
            p.fail([*path, i], f"'{guest}' is or holds system files ({', '.join(SYSTEM_PATHS[:6])}, ..., /root, "
                   "/etc, /logs/verifier): an agent's copy must never reach the verifier; name the directories its "
                   "work lands in (e.g. /app, /logs/agent)")
        for j, other in enumerate(out):
            if _overlaps(other, guest):
                p.fail([*path, i], f"'{guest}' overlaps outputs[{j}] '{other}'")
        out.append(guest)
    vmounts = verifier.get("mounts")
    for vm in p.mounts(vmounts, ["verifier", "mounts"]) if vmounts is not None else ():
        for i, guest in enumerate(out):
            if _overlaps(guest, vm.guest):
                p.fail([*path, i], f"'{guest}' overlaps the verifier mount at '{vm.guest}': the verifier's inputs "
                       "must not mix with the agent's outputs")
    checks = verifier.get("checks")
    for i, c in enumerate(checks if isinstance(checks, list | tuple) else ()):
        if isinstance(c, dict) and c.get("kind") == "http":
            p.fail(["verifier", "checks", i], "an http check needs the task's machine, which sealed verification "
                   "(verifier.outputs) destroys before the checks: drop the check or the outputs")
    return tuple(out)


def _verifier_mounts(p: _Parser, verifier: object, mounts: object) -> tuple[Mount, ...]:
    """[verifier.mounts]: the same rules as [mounts], and no guest path overlapping one of [mounts] (a verifier
    mount replaces what is at its guest path when verification starts)."""
    if not isinstance(verifier, dict) or "mounts" not in verifier:
        return ()
    path = ["verifier", "mounts"]
    vmounts = p.mounts(verifier["mounts"], path)
    for vm in vmounts:
        for m in p.mounts(mounts, ["mounts"]) if mounts is not None else ():
            if _overlaps(m.guest, vm.guest):
                p.fail([*path, vm.host], f"guest path '{vm.guest}' overlaps '{m.guest}' (mount of '{m.host}'): "
                                         "a verifier mount may not replace or sit inside a task mount")
            if _host_overlaps(m.host, vm.host):
                p.fail([*path, vm.host], f"host path '{vm.host}' overlaps the task mount of '{m.host}', which "
                                         "would copy it into the guest before the task: narrow that mount")
    return vmounts


def _host_overlaps(a: str, b: str) -> bool:
    """Two normalized relative host paths where one is, or lies inside, the other ("." holds everything)."""
    if a == "." or b == ".":
        return True
    return a == b or b.startswith(a + "/") or a.startswith(b + "/")


def _setup(p: _Parser, value: object) -> tuple[Command, ...]:
    if not isinstance(value, list | tuple):
        p.fail(["setup"], f"must be an array of commands, not {_type_name(value)}")
    return tuple(p.command(item, ["setup", i]) for i, item in enumerate(value))


def parse_smolfile(
    text: str | bytes,
    *,
    base_dir: str | os.PathLike[str] | None,
    filename: str = DEFAULT_FILENAME,
    limits: Limits | None = None,
) -> Smolfile:
    """Parse Smolfile TOML text; mounts are relative to base_dir. Raises SmolfileError."""
    if len(text) > MAX_SMOLFILE_BYTES:
        raise SmolfileError(filename, "", f"larger than {MAX_SMOLFILE_BYTES} bytes")
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise SmolfileError(filename, "", f"not valid UTF-8: {e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise SmolfileError(filename, "", f"invalid TOML: {e}") from None
    return parse_mapping(data, base_dir=base_dir, filename=filename, limits=limits)


def check_mount_sources(smolfile: Smolfile, *, filename: str = DEFAULT_FILENAME) -> None:
    """File-system checks of the mounts: each source exists, is a file or directory, and (symlinks
    resolved) stays inside the base directory. Raises SmolfileError at the mount's key."""
    if not smolfile.all_mounts:
        return
    assert smolfile.base_dir is not None  # parse_mapping guarantees it when there are mounts
    base = Path(smolfile.base_dir).resolve()
    for prefix, mount in smolfile.all_mounts:
        key = [*prefix, mount.host]
        src = smolfile.host_path(mount)
        if not src.exists():
            raise SmolfileError.at(filename, key, f"host path {src} does not exist")
        real = src.resolve()
        if real != base and base not in real.parents:
            raise SmolfileError.at(filename, key, f"host path resolves to {real}, outside {base}")
        if not (real.is_dir() or real.is_file()):
            raise SmolfileError.at(filename, key, f"host path {src} is neither a file nor a directory")


def load_smolfile(path: str | os.PathLike[str], *, limits: Limits | None = None) -> Smolfile:
    """Read, parse and validate a Smolfile on disk (mounts relative to its directory, sources checked)."""
    filename = os.fspath(path)
    try:
        with open(filename, "rb") as f:
            data = f.read(MAX_SMOLFILE_BYTES + 1)
    except OSError as e:
        raise SmolfileError(filename, "", f"cannot read: {e.strerror or e}") from None
    base = os.path.dirname(os.path.abspath(filename))
    smolfile = parse_smolfile(data, base_dir=base, filename=filename, limits=limits)
    check_mount_sources(smolfile, filename=filename)
    return smolfile
