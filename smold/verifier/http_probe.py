"""The http check's probe: a python3 -c script run inside the guest (via exec) and the parsing of its report.

The guest always has python3 (the agent is Python), so the request is made from inside the guest's
network namespace with urllib: one GET, no proxies, redirects not followed (a 3xx is the status
seen), the body read up to MAX_BODY_BYTES. The script prints one JSON line:
{"status": int, "found": bool | null, "body_tail": str} or {"error": str}.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from .errors import CheckFailed

MAX_BODY_BYTES = 1 << 20
BODY_TAIL_BYTES = 4096

PROBE_SCRIPT = f"""\
import json, sys, urllib.error, urllib.request
url, timeout, needle = sys.argv[1], float(sys.argv[2]), sys.argv[3].encode()
class NoRedirect(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, *args, **kwargs):
        return None
opener = urllib.request.build_opener(urllib.request.ProxyHandler({{}}), NoRedirect)
try:
    try:
        resp = opener.open(url, timeout=timeout)
    except urllib.error.HTTPError as e:
        resp = e
    with resp:
        body = resp.read({MAX_BODY_BYTES})
        out = {{"status": resp.getcode(), "found": (needle in body) if needle else None,
               "body_tail": body[-{BODY_TAIL_BYTES}:].decode("utf-8", "replace")}}
except Exception as e:
    out = {{"error": type(e).__name__ + ": " + str(e)}}
print(json.dumps(out))
"""


@dataclass(frozen=True)
class ProbeReport:
    """What the probe saw."""

    status: int
    found: bool | None
    body_tail: str


def probe_argv(url: str, timeout: float, contains: str | None) -> list[str]:
    """argv for the guest: python3 in isolated mode (-I: no user site, no PYTHON* variables)."""
    return ["python3", "-I", "-c", PROBE_SCRIPT, url, f"{timeout:.3f}", contains or ""]


def parse_report(stdout: bytes) -> ProbeReport:
    """Parse the probe's JSON line; CheckFailed if the request failed or the output is not a report."""
    lines = stdout.decode("utf-8", errors="replace").strip().splitlines()
    try:
        doc = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        doc = None
    if not isinstance(doc, dict):
        raise CheckFailed("the http probe printed no report")
    if "error" in doc:
        raise CheckFailed(f"request failed: {doc['error']}")
    status, found, body = doc.get("status"), doc.get("found"), doc.get("body_tail", "")
    if not isinstance(status, int) or not isinstance(found, bool | None) or not isinstance(body, str):
        raise CheckFailed("the http probe printed a malformed report")
    return ProbeReport(status, found, body)
