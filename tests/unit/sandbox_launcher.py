"""A host-agent "VM" with private copies of /etc and /home, so guest commands may add and remove users."""

from __future__ import annotations

import sys

from daemon_support import AGENT_SOCKET, HostAgentLauncher

from smold.daemon.launcher import LaunchSpec

# In a new mount namespace: bind copies of /etc and /home (under the machine's state dir) over the real ones.
_PRIVATE = ('d="$1/private"; shift; mkdir -p "$d/home" && cp -a /etc "$d/etc" && '
            'mount --make-rprivate / && mount --bind "$d/etc" /etc && mount --bind "$d/home" /home && exec "$@"')


class PrivateEtcLauncher(HostAgentLauncher):
    """HostAgentLauncher whose agent sees its own /etc and /home (needs root and unshare(1))."""

    kind = "host-agent-private-etc"

    def command(self, spec: LaunchSpec) -> list[str]:
        return ["unshare", "--mount", "sh", "-c", _PRIVATE, "sh", str(spec.state_dir),
                sys.executable, "-m", "smol_agent", "--listen", f"unix:{spec.state_dir / AGENT_SOCKET}"]


# Harbor tasks use fixed guest paths: each machine gets private (initially empty) /tests, /solution, /logs and
# /app, bound over mount points created on the host if missing, and a network namespace with no interfaces up.
TASK_DIRS = ("/tests", "/solution", "/logs", "/app")
_TASK = ('d="$1/private"; shift; for p in ' + " ".join(TASK_DIRS) + '; do mkdir -p "$p" "$d$p" || exit 1; done; '
         'mount --make-rprivate / && for p in ' + " ".join(TASK_DIRS) + '; do mount --bind "$d$p" "$p" || exit 1; '
         'done; exec "$@"')


class TaskLauncher(HostAgentLauncher):
    """HostAgentLauncher for Harbor tasks: private task directories, no network (needs root and unshare(1))."""

    kind = "host-agent-task"

    def command(self, spec: LaunchSpec) -> list[str]:
        return ["unshare", "--mount", "--net", "sh", "-c", _TASK, "sh", str(spec.state_dir),
                sys.executable, "-m", "smol_agent", "--listen", f"unix:{spec.state_dir / AGENT_SOCKET}"]
