"""The daemon process: state-dir lock, result store, re-adoption, the gRPC servers (Unix socket, optional TLS
TCP), shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import grp
import logging
import os
import signal
import socket
from pathlib import Path
from typing import Any

import grpc

from smold.api.v1 import smol_pb2_grpc as pb_grpc

from .config import DaemonConfig
from .controller import Controller
from .errors import DaemonSetupError
from .images import ImageStore
from .launcher import JailOptions, Launcher, load_launcher
from .notify import sd_notify
from .results import ResultStore
from .runs import Runs
from .servicer import SmolServicer
from .tcp import BearerTokenInterceptor, TcpListener, load_tcp_listener

log = logging.getLogger("smold")
LOCK_FILE = "smold.lock"
STOP_GRACE_S = 5.0           # in-flight RPCs get this long after SIGTERM before they are cancelled
MESSAGE_OVERHEAD = 1 << 20   # gRPC message size limit = copy cap + this (paths, framing)


def _resolve_group(group: str) -> int:
    if group.isdigit():
        return int(group)
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise DaemonSetupError(f"--group: no group named {group!r}") from None


def _clear_stale_socket(path: Path) -> None:
    """Remove a socket nobody serves on; refuse if another daemon answers or the path is not a socket."""
    if not path.exists() and not path.is_symlink():
        return
    if not path.is_socket():
        raise DaemonSetupError(f"{path} exists and is not a socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except OSError as e:
            if e.errno not in (errno.ECONNREFUSED, errno.ENOENT):
                raise DaemonSetupError(f"cannot check {path}: {e}") from None
        else:
            raise DaemonSetupError(f"another daemon is serving on {path}")
    path.unlink(missing_ok=True)


class Daemon:
    """One smold: run() serves until stop() (or SIGTERM/SIGINT), then destroys or leaves its machines."""

    def __init__(self, config: DaemonConfig, launcher: Launcher | None = None,
                 images: ImageStore | None = None) -> None:
        config.validate()
        self.config = config
        if images is None:
            images = ImageStore.with_files(dict(config.images), oci_root=config.state_dir / "oci")
        self.tcp: TcpListener | None = load_tcp_listener(config)  # refuses bad TLS/token files before anything
        self.controller = Controller(config, launcher or load_launcher(
            config.launcher, config.vmm_seccomp,
            JailOptions(config.jail_uid, config.jail_gid) if config.jail else None), images)
        self.results = ResultStore(config.state_dir / "results")
        self.runs = Runs(self.controller, self.results)
        self._stop = asyncio.Event()
        self._lock_fd = -1
        self._served = False
        self.server: grpc.aio.Server | None = None
        self.tcp_server: grpc.aio.Server | None = None
        self.tcp_port = 0  # the bound TCP port (useful with --tcp HOST:0)

    def stop(self) -> None:
        self._stop.set()

    def _lock_state_dir(self) -> None:
        state = self.config.state_dir
        try:
            state.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd = os.open(state / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise DaemonSetupError(f"cannot use state directory {state}: {e}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise DaemonSetupError(f"state directory {state} is in use by another smold") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def _server_options(self) -> list[tuple[str, Any]]:
        limit = self.config.copy_cap_bytes + MESSAGE_OVERHEAD
        return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]

    async def _serve_tcp(self, servicer: SmolServicer, tcp: TcpListener) -> grpc.aio.Server:
        """A second server, TLS only, whose every call must carry the bearer token (the interceptor)."""
        server = grpc.aio.server(options=self._server_options(), interceptors=[BearerTokenInterceptor(tcp.token)],
                                 maximum_concurrent_rpcs=self.config.max_concurrent_calls)
        pb_grpc.add_SmolServicer_to_server(servicer, server)
        try:
            port = server.add_secure_port(tcp.address, tcp.credentials())
            if not port:
                raise RuntimeError("address in use or not local")
            await server.start()
        except Exception as e:
            await server.stop(None)
            raise DaemonSetupError(f"cannot listen on --tcp {tcp.address}: {e}") from None
        self.tcp_port = port
        return server

    async def _serve(self, servicer: SmolServicer) -> grpc.aio.Server:
        cfg = self.config
        path = cfg.socket_path
        gid = _resolve_group(cfg.socket_group) if cfg.socket_group else -1
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o755)
            _clear_stale_socket(path)
        except OSError as e:
            raise DaemonSetupError(f"cannot prepare {path}: {e}") from None
        server = grpc.aio.server(options=self._server_options(), maximum_concurrent_rpcs=cfg.max_concurrent_calls)
        pb_grpc.add_SmolServicer_to_server(servicer, server)
        if not server.add_insecure_port(f"unix:{path}"):
            raise DaemonSetupError(f"cannot listen on {path}")
        old = os.umask(0o777 & ~cfg.socket_mode)  # the socket is born with its final mode
        try:
            await server.start()
        except Exception as e:
            raise DaemonSetupError(f"cannot listen on {path}: {e}") from None
        finally:
            os.umask(old)
        try:
            if gid >= 0:
                os.chown(path, -1, gid)
            os.chmod(path, cfg.socket_mode)
        except OSError as e:
            await server.stop(None)
            raise DaemonSetupError(f"cannot set the owner or mode of {path}: {e}") from None
        return server

    async def run(self, *, handle_signals: bool = True) -> None:
        """Serve until stopped. Raises DaemonSetupError when it cannot start."""
        loop = asyncio.get_running_loop()
        if handle_signals:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
        try:
            self._lock_state_dir()
            await self.results.open()  # first: Runs a dead daemon left become interrupted
            await self.controller.start()
            servicer = SmolServicer(self.controller, self.runs)
            if self.tcp is not None:
                self.tcp_server = await self._serve_tcp(servicer, self.tcp)
                log.info("serving TLS on tcp %s (port %d); calls need the bearer token", self.tcp.address,
                         self.tcp_port)
            self.server = await self._serve(servicer)
            log.info("serving on %s (state %s, launcher %s, at most %d machines and %d MiB)",
                     self.config.socket_path, self.config.state_dir, self.controller.launcher.kind,
                     self.config.max_machines, self.config.max_memory_mib)
            self._served = True
            sd_notify("READY=1", f"STATUS=serving on {self.config.socket_path}", f"MAINPID={os.getpid()}")
            await self._stop.wait()
            sd_notify("STOPPING=1", "STATUS=shutting down")
            log.info("shutting down (%s machines)", self.config.on_shutdown)
        finally:
            if handle_signals:
                for sig in (signal.SIGTERM, signal.SIGINT):
                    loop.remove_signal_handler(sig)
            await self._close()

    async def _close(self) -> None:
        self.controller.stop_admitting()  # no new machines while in-flight calls finish
        servers = [s for s in (self.server, self.tcp_server) if s is not None]
        await asyncio.gather(*(s.stop(STOP_GRACE_S) for s in servers))
        if self.server is not None:
            with contextlib.suppress(OSError):
                self.config.socket_path.unlink()
        # Runs still going end interrupted (their machines destroyed), written while the store is open.
        await self.runs.shutdown()
        # A daemon that never served (it failed to start) leaves re-adopted machines alone.
        await self.controller.shutdown(leave=self.config.on_shutdown == "leave" or not self._served)
        await self.results.close()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
