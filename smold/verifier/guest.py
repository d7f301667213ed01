"""The slice of the guest-agent client the verifier needs (smold.agent.AgentClient satisfies it)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from smold.agent import ExecEvent

if TYPE_CHECKING:
    from smold.agent import AgentClient


class ExecEvents(Protocol):
    """A started (or lazily started) exec: iterate its events; aclose() abandons it (SIGKILL)."""

    def __aiter__(self) -> AsyncIterator[ExecEvent]: ...

    async def aclose(self) -> None: ...


class Guest(Protocol):
    """exec and read_file as AgentClient offers them."""

    def exec(
        self,
        argv: list[str],
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | int | None = None,
        stdin: bytes | None = None,
        timeout: float | None = None,
    ) -> ExecEvents: ...

    async def read_file(self, path: str, max_size: int) -> bytes: ...


if TYPE_CHECKING:

    def _agent_client_is_a_guest(client: AgentClient) -> Guest:  # mypy proves the protocol match
        return client
