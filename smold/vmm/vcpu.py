"""One thread per vCPU: KVM_RUN in a loop, exits dispatched through a table to the PIO and MMIO buses."""

from __future__ import annotations

import errno
import logging
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

from smold.devices.bus import Bus
from smold.kvm import ExitReason, KvmError, Vcpu
from smold.kvm.exits import KVM_EXIT_IO_OUT, SystemEvent

log = logging.getLogger(__name__)

KICK_SIGNAL = signal.SIGUSR1


@dataclass(frozen=True)
class VcpuExit:
    """Why a vCPU thread stopped running the guest."""

    vcpu: int
    kind: str          # "stopped", "reset", "shutdown", "crash", "error"
    detail: str = ""


def install_kick_handler() -> None:
    """A no-op handler so the kick signal interrupts KVM_RUN (EINTR) instead of killing the process.

    Must be called from the main thread before vCPU threads start.
    """
    signal.signal(KICK_SIGNAL, lambda *_: None)


class VcpuThread(threading.Thread):
    """Runs one vCPU until told to stop or until the guest resets, shuts down or faults."""

    def __init__(self, vcpu: Vcpu, pio: Bus, mmio: Bus, on_exit: Callable[[VcpuExit], None],
                 *, describe_fault: Callable[[Vcpu], str] | None = None) -> None:
        super().__init__(name=f"vcpu{vcpu.index}", daemon=True)
        self.vcpu = vcpu
        self.pio = pio
        self.mmio = mmio
        self.on_exit = on_exit
        self.describe_fault = describe_fault
        self._stop_requested = threading.Event()
        self._pause_requested = threading.Event()
        self._resume = threading.Event()
        self.paused = threading.Event()   # set while the thread is parked (see ``pause``)
        self.exit_counts: dict[ExitReason, int] = {}
        self._handlers: dict[int, Callable[[], VcpuExit | None]] = {
            ExitReason.IO: self._on_io,
            ExitReason.MMIO: self._on_mmio,
            ExitReason.HLT: self._on_hlt,
            ExitReason.SHUTDOWN: self._on_shutdown,
            ExitReason.SYSTEM_EVENT: self._on_system_event,
            ExitReason.INTERNAL_ERROR: self._on_internal_error,
            ExitReason.FAIL_ENTRY: self._on_fail_entry,
            ExitReason.INTR: lambda: None,
            ExitReason.IRQ_WINDOW_OPEN: lambda: None,
        }

    # -- control from other threads -----------------------------------------------------------------
    def kick(self) -> None:
        """Force the vCPU out of KVM_RUN (immediate_exit closes the race with a signal in flight)."""
        self.vcpu.request_exit()
        if self.ident is not None and self.is_alive():
            try:
                signal.pthread_kill(self.ident, KICK_SIGNAL)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self._stop_requested.set()
        self._resume.set()
        self.kick()

    def pause(self) -> None:
        """Ask the thread to park outside KVM_RUN; ``paused`` is set once it has (see ``_park``)."""
        self._resume.clear()
        self._pause_requested.set()
        self.kick()

    def resume(self) -> None:
        self._pause_requested.clear()
        self._resume.set()

    # -- the loop -----------------------------------------------------------------------------------
    def run(self) -> None:
        result = VcpuExit(self.vcpu.index, "stopped")
        try:
            while not self._stop_requested.is_set():
                if self._pause_requested.is_set():
                    outcome = self._park()
                    if outcome is not None:
                        result = outcome
                        break
                    continue
                try:
                    reason = self.vcpu.run()
                except KvmError as e:
                    if e.errno in (errno.EINTR, errno.EAGAIN):
                        self.vcpu.clear_exit_request()
                        continue
                    result = VcpuExit(self.vcpu.index, "error", f"KVM_RUN failed: {e}")
                    break
                outcome = self._dispatch(reason)
                if outcome is not None:
                    result = outcome
                    break
        except Exception as e:  # a VMM bug must still end the VM cleanly, with the reason
            log.exception("vcpu%d crashed", self.vcpu.index)
            result = VcpuExit(self.vcpu.index, "error", f"vCPU thread failed: {e!r}")
        self.on_exit(result)

    def _dispatch(self, reason: int) -> VcpuExit | None:
        try:
            key = ExitReason(reason)
        except ValueError:
            return VcpuExit(self.vcpu.index, "error", f"unhandled KVM exit reason {reason}")
        self.exit_counts[key] = self.exit_counts.get(key, 0) + 1
        handler = self._handlers.get(key)
        if handler is None:
            return VcpuExit(self.vcpu.index, "error", f"unhandled KVM exit {key.name}")
        return handler()

    def _park(self) -> VcpuExit | None:
        """Complete the instruction of the last PIO/MMIO exit, then wait until resumed or stopped.

        KVM finishes an exit's instruction (an IN's or MMIO read's destination register, a string
        I/O's next iteration) only on the next KVM_RUN. With immediate_exit set that KVM_RUN does just
        this and returns EINTR without entering the guest, so the registers read while parked are
        at an instruction boundary (Documentation/virt/kvm/api.rst, KVM_RUN / immediate_exit).
        """
        for _ in range(4096):   # a rep string instruction may exit again before it completes
            self.vcpu.request_exit()
            try:
                reason = self.vcpu.run()
            except KvmError as e:
                if e.errno in (errno.EINTR, errno.EAGAIN):
                    break
                return VcpuExit(self.vcpu.index, "error", f"KVM_RUN (completing I/O before pause) failed: {e}")
            outcome = self._dispatch(reason)
            if outcome is not None:
                return outcome
        self.vcpu.clear_exit_request()
        self.paused.set()
        self._resume.wait()
        self.paused.clear()
        return None

    # -- exit handlers --------------------------------------------------------------------------------
    def _on_io(self) -> VcpuExit | None:
        io = self.vcpu.run_struct.u.io
        size, count, port, offset = int(io.size), int(io.count), int(io.port), int(io.data_offset)
        if size not in (1, 2, 4) or count > 4096:
            return VcpuExit(self.vcpu.index, "error", f"bad PIO exit size={size} count={count}")
        for i in range(count):
            at = offset + i * size
            if io.direction == KVM_EXIT_IO_OUT:
                self.pio.write(port, self.vcpu.run_data(at, size))
            else:
                self.vcpu.set_run_data(at, self.pio.read(port, size))
        return None

    def _on_mmio(self) -> VcpuExit | None:
        mmio = self.vcpu.run_struct.u.mmio
        length = int(mmio.len)
        if length not in (1, 2, 4, 8):
            return VcpuExit(self.vcpu.index, "error", f"bad MMIO exit length {length}")
        addr = int(mmio.phys_addr)
        if mmio.is_write:
            self.mmio.write(addr, bytes(mmio.data[:length]))
        else:
            data = self.mmio.read(addr, length)
            for i in range(length):
                mmio.data[i] = data[i]
        return None

    def _on_hlt(self) -> VcpuExit | None:
        # Only reached without an in-kernel irqchip (tiny test guests): a halted guest is finished.
        return VcpuExit(self.vcpu.index, "shutdown", "guest halted")

    def _on_shutdown(self) -> VcpuExit | None:
        return VcpuExit(self.vcpu.index, "reset", "triple fault (KVM_EXIT_SHUTDOWN)")

    def _on_system_event(self) -> VcpuExit | None:
        kind = int(self.vcpu.run_struct.u.system_event.type)
        if kind == SystemEvent.SHUTDOWN:
            return VcpuExit(self.vcpu.index, "shutdown", "guest powered off")
        if kind == SystemEvent.RESET:
            return VcpuExit(self.vcpu.index, "reset", "guest reset")
        return VcpuExit(self.vcpu.index, "crash", f"system event {kind}")

    def _fault_detail(self) -> str:
        if self.describe_fault is None:
            return ""
        try:
            return "; " + self.describe_fault(self.vcpu)
        except Exception as e:  # best effort diagnostics
            return f"; (no register dump: {e})"

    def _on_internal_error(self) -> VcpuExit | None:
        ie = self.vcpu.run_struct.u.internal
        data = " ".join(f"{ie.data[i]:#x}" for i in range(min(int(ie.ndata), 16)))
        return VcpuExit(self.vcpu.index, "error",
                        f"KVM_EXIT_INTERNAL_ERROR suberror={ie.suberror} data=[{data}]{self._fault_detail()}")

    def _on_fail_entry(self) -> VcpuExit | None:
        fe = self.vcpu.run_struct.u.fail_entry
        return VcpuExit(self.vcpu.index, "error",
                        f"KVM_EXIT_FAIL_ENTRY reason={fe.hardware_entry_failure_reason:#x}{self._fault_detail()}")
