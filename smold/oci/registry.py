"""OCI distribution v2 client (distribution-spec "Pulling"): manifests, blobs, bearer-token auth, resume."""

from __future__ import annotations

import base64
import json
import os
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import BinaryIO

from .digest import CHUNK, check_digest, sha256_bytes, verify_bytes
from .errors import RegistryError
from .manifest import ACCEPT, MAX_DOC, Descriptor
from .reference import DOCKER_HUB, Reference

INSECURE_ENV = "SMOL_INSECURE_REGISTRIES"  # comma-separated host[:port] served over plain HTTP
RATE_ENV = "SMOL_PULL_RATE_LIMIT"  # bytes/s cap on blob downloads (0 or unset: none)
TIMEOUT = 60.0
_CHALLENGE_RE = re.compile(r'(\w+)="([^"]*)"')


def _loopback(host: str) -> bool:
    name = host.rsplit(":", 1)[0] if not host.endswith("]") else host
    return name in ("localhost", "127.0.0.1", "[::1]") or name.startswith("127.")


def parse_challenge(header: str) -> tuple[str, dict[str, str]]:
    """``WWW-Authenticate: Bearer realm="...",service="...",scope="..."`` -> ("bearer", params)."""
    scheme, _, rest = header.strip().partition(" ")
    return scheme.lower(), dict(_CHALLENGE_RE.findall(rest))


def docker_config_auth(registry: str) -> tuple[str, str] | None:
    """(user, password) for ``registry`` from ~/.docker/config.json "auths" (base64 user:pass), if any."""
    path = Path(os.environ.get("DOCKER_CONFIG", Path.home() / ".docker")) / "config.json"
    try:
        auths = json.loads(path.read_text()).get("auths", {})
    except (OSError, ValueError):
        return None
    keys = [registry] + (["https://index.docker.io/v1/", "index.docker.io"] if registry == DOCKER_HUB else [])
    for key in keys:
        entry = auths.get(key) or auths.get(f"https://{key}")
        if isinstance(entry, dict) and isinstance(entry.get("auth"), str):
            user, sep, password = base64.b64decode(entry["auth"]).decode().partition(":")
            if sep:
                return user, password
    return None


class _NoRedirectAuth(urllib.request.HTTPRedirectHandler):
    """Follow redirects (blob storage often lives elsewhere) without carrying Authorization along."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None:
            for k in list(new.headers):
                if k.lower() in ("authorization", "range"):
                    del new.headers[k]
            if req.has_header("Range"):
                new.add_header("Range", req.get_header("Range"))  # type: ignore[arg-type]
        return new


class RegistryClient:
    """One repository on one registry; keeps the bearer token between requests."""

    def __init__(self, ref: Reference, *, insecure: bool | None = None, rate_limit: int | None = None,
                 credentials: tuple[str, str] | None = None) -> None:
        self.ref = ref
        host = ref.api_host
        allowed = {h.strip() for h in os.environ.get(INSECURE_ENV, "").split(",") if h.strip()}
        plain = insecure if insecure is not None else (_loopback(host) or host in allowed)
        self.base = f"{'http' if plain else 'https'}://{host}/v2/{ref.repository}"
        self._token: str | None = None
        self._basic = credentials if credentials is not None else docker_config_auth(ref.registry)
        self._opener = urllib.request.build_opener(_NoRedirectAuth())
        self.rate_limit = rate_limit if rate_limit is not None else int(os.environ.get(RATE_ENV, "0") or 0)
        self.requests: list[tuple[str, str]] = []  # (method, path) of every request, for tests and logs
        self.bytes_received = 0

    # -- transport ----------------------------------------------------------------------------------
    def _request(self, method: str, url: str, headers: dict[str, str]) -> urllib.request.Request:
        req = urllib.request.Request(url, method=method, headers=headers)
        if self._token:
            req.add_unredirected_header("Authorization", f"Bearer {self._token}")
        elif self._basic:
            cred = base64.b64encode(f"{self._basic[0]}:{self._basic[1]}".encode()).decode()
            req.add_unredirected_header("Authorization", f"Basic {cred}")
        return req

    def _open(self, method: str, path: str, headers: dict[str, str]):  # type: ignore[no-untyped-def]
        url = f"{self.base}/{path}"
        for attempt in range(2):
            self.requests.append((method, path))
            try:
                return self._opener.open(self._request(method, url, headers), timeout=TIMEOUT)
            except urllib.error.HTTPError as e:
                if e.code == 401 and attempt == 0 and self._authenticate(e.headers.get("WWW-Authenticate", "")):
                    e.close()
                    continue
                body = e.read(4096).decode("utf-8", "replace")
                e.close()
                raise RegistryError(f"{method} {url}: HTTP {e.code} {e.reason}: {_error_text(body)}") from None
            except (urllib.error.URLError, OSError) as e:
                raise RegistryError(f"{method} {url}: {getattr(e, 'reason', e)}") from None
        raise RegistryError(f"{method} {url}: unauthorized")

    def _authenticate(self, header: str) -> bool:
        """Answer a 401 challenge: fetch a bearer token from the realm (token auth spec), or use Basic."""
        scheme, params = parse_challenge(header)
        if scheme == "basic":
            # Basic credentials are sent with every request already; a 401 means they were refused.
            return False
        if scheme != "bearer" or "realm" not in params:
            return False
        query = {"service": params.get("service", "")} if params.get("service") else {}
        query["scope"] = params.get("scope") or f"repository:{self.ref.repository}:pull"
        url = f"{params['realm']}?{urllib.parse.urlencode(query)}"
        req = urllib.request.Request(url)
        if self._basic:
            cred = base64.b64encode(f"{self._basic[0]}:{self._basic[1]}".encode()).decode()
            req.add_header("Authorization", f"Basic {cred}")
        try:
            with urllib.request.urlopen(req, timeout=TIMEOUT) as resp:
                doc = json.loads(resp.read(MAX_DOC))
        except (urllib.error.URLError, OSError, ValueError) as e:
            raise RegistryError(f"token request to {params['realm']} failed: {e}") from None
        token = doc.get("token") or doc.get("access_token")
        if not isinstance(token, str) or not token:
            raise RegistryError(f"token endpoint {params['realm']} returned no token")
        self._token = token
        return True

    # -- API ----------------------------------------------------------------------------------------
    def get_manifest(self, wanted: str) -> tuple[bytes, str, str]:
        """(bytes, media type, digest) of a manifest or index by tag or digest; a digest is verified."""
        with self._open("GET", f"manifests/{wanted}", {"Accept": ACCEPT}) as resp:
            data = resp.read(MAX_DOC + 1)
            media = resp.headers.get("Content-Type", "").split(";")[0].strip()
            header_digest = resp.headers.get("Docker-Content-Digest")
        if len(data) > MAX_DOC:
            raise RegistryError(f"manifest {wanted} is larger than {MAX_DOC} bytes")
        digest = sha256_bytes(data)
        if wanted.startswith("sha256:"):
            verify_bytes(data, check_digest(wanted), what="manifest")
        elif header_digest and header_digest.startswith("sha256:") and header_digest != digest:
            raise RegistryError(f"manifest {wanted}: registry says {header_digest}, content hashes to {digest}")
        return data, media, digest

    def fetch_blob(self, desc: Descriptor, out: BinaryIO, offset: int) -> None:
        """Stream a blob into ``out`` from ``offset`` (Range request); restart from 0 if not honoured."""
        headers = {"Range": f"bytes={offset}-"} if offset else {}
        with self._open("GET", f"blobs/{desc.digest}", headers) as resp:
            if offset and resp.status != 206:
                out.seek(0)
                out.truncate(0)  # the server sent the whole blob
            else:
                out.seek(offset)
            limit = desc.size - (offset if resp.status == 206 else 0)
            got = 0
            t0 = time.monotonic()
            while got <= limit:
                data = resp.read(min(CHUNK, 64 << 10) if self.rate_limit else CHUNK)
                if not data:
                    break
                got += len(data)
                if got > limit:
                    raise RegistryError(f"blob {desc.digest}: registry sent more than {desc.size} bytes")
                out.write(data)
                self.bytes_received += len(data)
                if self.rate_limit:
                    ahead = got / self.rate_limit - (time.monotonic() - t0)
                    if ahead > 0:
                        out.flush()
                        time.sleep(ahead)


def _error_text(body: str) -> str:
    """The distribution-spec error body's messages, or the raw text."""
    try:
        errors = json.loads(body).get("errors", [])
        return "; ".join(f"{e.get('code')}: {e.get('message')}" for e in errors) or body[:300]
    except (ValueError, AttributeError):
        return body[:300]
