"""An 8250/16550A UART (COM1): transmit to an injected sink, receive from injected input, THRE/RDA interrupts."""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass

from smold.devices.irq import IrqLine

# Register offsets (PC16550D datasheet, table 2).
RBR_THR = 0   # DLL when LCR.DLAB
IER = 1       # DLM when LCR.DLAB
IIR_FCR = 2
LCR = 3
MCR = 4
LSR = 5
MSR = 6
SCR = 7

IER_RDA = 0x01
IER_THRE = 0x02
IIR_NONE = 0x01
IIR_THRE = 0x02
IIR_RDA = 0x04
IIR_FIFO_ENABLED = 0xC0
LCR_DLAB = 0x80
LSR_DR = 0x01
LSR_THRE = 0x20
LSR_TEMT = 0x40
MCR_LOOP = 0x10
MSR_DCD_DSR_CTS = 0xB0
RX_FIFO_CAP = 4096


@dataclass(frozen=True)
class SerialState:
    """Snapshot state: register values and pending input."""

    ier: int
    lcr: int
    mcr: int
    scr: int
    dll: int
    dlm: int
    thre_pending: bool
    rx: bytes


class Serial:
    """The guest's console. ``sink`` receives every byte the guest transmits."""

    def __init__(self, irq: IrqLine, sink: Callable[[bytes], None]) -> None:
        self.irq = irq
        self.sink = sink
        self.ier = 0
        self.lcr = 0x03
        self.mcr = 0x08
        self.scr = 0
        self.dll = 0x0C
        self.dlm = 0
        self.thre_pending = False
        self.rx: collections.deque[int] = collections.deque()

    # -- interrupt state ----------------------------------------------------------------------------
    def _iir(self) -> int:
        if self.ier & IER_RDA and self.rx:
            return IIR_RDA
        if self.ier & IER_THRE and self.thre_pending:
            return IIR_THRE
        return IIR_NONE

    def _update_irq(self) -> None:
        if self._iir() != IIR_NONE:
            self.irq.trigger()

    # -- host side ----------------------------------------------------------------------------------
    def queue_input(self, data: bytes) -> int:
        """Bytes typed at the console; returns how many were accepted (the FIFO is capped)."""
        room = RX_FIFO_CAP - len(self.rx)
        accepted = data[:max(room, 0)]
        self.rx.extend(accepted)
        if accepted:
            self._update_irq()
        return len(accepted)

    # -- bus device ---------------------------------------------------------------------------------
    def read(self, offset: int, size: int) -> bytes:
        return bytes([self._read_reg(offset)]) + b"\x00" * (size - 1)

    def _read_reg(self, offset: int) -> int:
        dlab = self.lcr & LCR_DLAB
        if offset == RBR_THR:
            if dlab:
                return self.dll
            value = self.rx.popleft() if self.rx else 0
            self._update_irq()
            return value
        if offset == IER:
            return self.dlm if dlab else self.ier
        if offset == IIR_FCR:
            iir = self._iir()
            if iir == IIR_THRE:
                self.thre_pending = False   # reading IIR clears a THRE interrupt (16550 datasheet)
            return iir | IIR_FIFO_ENABLED
        if offset == LCR:
            return self.lcr
        if offset == MCR:
            return self.mcr
        if offset == LSR:
            return LSR_THRE | LSR_TEMT | (LSR_DR if self.rx else 0)
        if offset == MSR:
            if not self.mcr & MCR_LOOP:
                return MSR_DCD_DSR_CTS
            # Loopback (16550 datasheet): RTS->CTS, DTR->DSR, OUT1->RI, OUT2->DCD.
            m = self.mcr
            return ((m & 0x02) << 3) | ((m & 0x01) << 5) | ((m & 0x04) << 4) | ((m & 0x08) << 4)
        if offset == SCR:
            return self.scr
        return 0

    def write(self, offset: int, data: bytes) -> None:
        if not data:
            return
        value = data[0]
        dlab = self.lcr & LCR_DLAB
        if offset == RBR_THR:
            if dlab:
                self.dll = value
                return
            if self.mcr & MCR_LOOP:
                # The looped-back byte lands in the same capped RX FIFO as host input; when it is full
                # the byte is lost (an overrun, PC16550D "FIFO Mode Operation"), so a guest spinning in
                # loopback cannot grow host memory or the snapshot without bound.
                if len(self.rx) < RX_FIFO_CAP:
                    self.rx.append(value)
            else:
                self.sink(bytes([value]))
            self.thre_pending = True
            self._update_irq()
        elif offset == IER:
            if dlab:
                self.dlm = value
                return
            enabling_thre = value & IER_THRE and not self.ier & IER_THRE
            self.ier = value & 0x0F
            if enabling_thre:
                self.thre_pending = True
            self._update_irq()
        elif offset == IIR_FCR:
            if value & 0x02:
                self.rx.clear()
        elif offset == LCR:
            self.lcr = value
        elif offset == MCR:
            self.mcr = value & 0x1F
        elif offset == SCR:
            self.scr = value

    # -- snapshot -------------------------------------------------------------------------------------
    def save(self) -> SerialState:
        return SerialState(self.ier, self.lcr, self.mcr, self.scr, self.dll, self.dlm, self.thre_pending,
                           bytes(self.rx))

    def restore(self, state: SerialState) -> None:
        self.ier, self.lcr, self.mcr, self.scr = state.ier, state.lcr, state.mcr, state.scr
        self.dll, self.dlm, self.thre_pending = state.dll, state.dlm, state.thre_pending
        self.rx = collections.deque(state.rx)
