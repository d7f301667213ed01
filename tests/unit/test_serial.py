"""The 8250/16550A UART model, driven the way Linux's 8250 driver drives it (PC16550D datasheet)."""

from __future__ import annotations

import pytest

from smold.devices.irq import CountingIrq
from smold.devices.serial import RX_FIFO_CAP, Serial, SerialState

# Register offsets and bits, spelled out here from the datasheet rather than imported.
RBR = THR = DLL = 0
IER = DLM = 1
IIR = FCR = 2
LCR = 3
MCR = 4
LSR = 5
MSR = 6
SCR = 7

IER_RDI, IER_THRI = 0x01, 0x02
IIR_NO_INT, IIR_THRI, IIR_RDI = 0x01, 0x02, 0x04
IIR_FIFO_BITS = 0xC0
LCR_DLAB, LCR_8N1 = 0x80, 0x03
LSR_DR, LSR_THRE, LSR_TEMT = 0x01, 0x20, 0x40
MCR_DTR, MCR_RTS, MCR_OUT1, MCR_OUT2, MCR_LOOP = 0x01, 0x02, 0x04, 0x08, 0x10
MSR_CTS, MSR_DSR, MSR_RI, MSR_DCD = 0x10, 0x20, 0x40, 0x80
FCR_ENABLE, FCR_CLEAR_RCVR = 0x01, 0x02


class Uart:
    def __init__(self) -> None:
        self.irq = CountingIrq()
        self.out: list[bytes] = []
        self.dev = Serial(self.irq, self.out.append)

    def rd(self, off: int) -> int:
        data = self.dev.read(off, 1)
        assert len(data) == 1
        return data[0]

    def wr(self, off: int, value: int) -> None:
        self.dev.write(off, bytes([value]))

    def iir(self) -> int:
        v = self.rd(IIR)
        assert v & IIR_FIFO_BITS == IIR_FIFO_BITS
        return v & 0x0F

    def output(self) -> bytes:
        return b"".join(self.out)

    def drain(self) -> bytes:
        got = bytearray()
        while self.rd(LSR) & LSR_DR:
            got.append(self.rd(RBR))
        return bytes(got)


@pytest.fixture
def u() -> Uart:
    return Uart()


# -- reset state and plain registers ------------------------------------------------------------------
def test_reset_state(u: Uart) -> None:
    assert u.rd(IER) == 0
    assert u.iir() == IIR_NO_INT
    assert u.rd(LSR) == LSR_THRE | LSR_TEMT
    assert u.rd(RBR) == 0                       # empty receiver reads as 0
    assert u.rd(MSR) == MSR_DCD | MSR_DSR | MSR_CTS
    assert u.irq.count == 0 and u.out == []


@pytest.mark.parametrize("value", [0x00, 0x03, 0x1B, 0x5A, 0x7F])
def test_lcr_and_scr_read_back(u: Uart, value: int) -> None:
    u.wr(LCR, value)
    u.wr(SCR, value ^ 0xFF)
    assert u.rd(LCR) == value
    assert u.rd(SCR) == value ^ 0xFF


def test_scratch_holds_every_value(u: Uart) -> None:
    for v in (0x00, 0x55, 0xAA, 0xFF):
        u.wr(SCR, v)
        assert u.rd(SCR) == v


def test_ier_keeps_low_four_bits(u: Uart) -> None:
    """Linux autoconfig writes 0 then 0x0F to IER and expects them back; bit 6 (UUE) must not stick."""
    u.wr(IER, 0)
    assert u.rd(IER) == 0
    u.wr(IER, 0x0F)
    assert u.rd(IER) == 0x0F
    u.wr(IER, 0xF0 | IER_RDI)
    assert u.rd(IER) == IER_RDI


def test_mcr_keeps_low_five_bits(u: Uart) -> None:
    u.wr(MCR, 0xFF)
    assert u.rd(MCR) == 0x1F
    u.wr(MCR, MCR_DTR | MCR_OUT2)
    assert u.rd(MCR) == MCR_DTR | MCR_OUT2


# -- divisor latch -------------------------------------------------------------------------------------
def test_divisor_latch_behind_dlab(u: Uart) -> None:
    u.wr(IER, IER_RDI)
    u.wr(LCR, LCR_DLAB | LCR_8N1)
    u.wr(DLL, 0x01)           # 115200 baud
    u.wr(DLM, 0x02)
    assert (u.rd(DLL), u.rd(DLM)) == (0x01, 0x02)
    assert u.out == []        # DLL writes are not transmitted
    u.wr(LCR, LCR_8N1)
    assert u.rd(IER) == IER_RDI   # IER untouched by the DLM write
    assert u.rd(LCR) == LCR_8N1
    u.wr(LCR, LCR_DLAB)
    assert (u.rd(DLL), u.rd(DLM)) == (0x01, 0x02)   # latch survives clearing DLAB


def test_dlab_read_of_offset0_does_not_consume_input(u: Uart) -> None:
    u.dev.queue_input(b"k")
    u.wr(LCR, LCR_DLAB)
    u.wr(DLL, 0x0C)
    assert u.rd(DLL) == 0x0C
    assert u.rd(LSR) & LSR_DR
    u.wr(LCR, 0)
    assert u.rd(RBR) == ord("k")


def test_dlab_write_to_offset1_does_not_enable_interrupts(u: Uart) -> None:
    u.wr(LCR, LCR_DLAB)
    u.wr(DLM, IER_THRI)
    u.wr(LCR, 0)
    assert u.rd(IER) == 0
    assert u.irq.count == 0
    assert u.iir() == IIR_NO_INT


# -- transmit ------------------------------------------------------------------------------------------
def test_thr_bytes_go_to_sink_in_order(u: Uart) -> None:
    for b in b"Linux version 6.1\r\n":
        u.wr(THR, b)
    assert u.output() == b"Linux version 6.1\r\n"
    assert all(len(chunk) == 1 for chunk in u.out)
    assert u.rd(LSR) & (LSR_THRE | LSR_TEMT) == LSR_THRE | LSR_TEMT   # always ready for more


def test_only_first_byte_of_a_wide_write_is_used(u: Uart) -> None:
    u.dev.write(THR, b"AB")
    assert u.output() == b"A"


def test_empty_write_is_ignored(u: Uart) -> None:
    u.dev.write(THR, b"")
    u.dev.write(IER, b"")
    assert u.out == [] and u.rd(IER) == 0 and u.irq.count == 0


def test_transmit_without_interrupts_enabled_raises_no_irq(u: Uart) -> None:
    u.wr(THR, ord("x"))
    assert u.irq.count == 0
    assert u.iir() == IIR_NO_INT


# -- THRE interrupt ------------------------------------------------------------------------------------
def test_enabling_thri_raises_thre_interrupt(u: Uart) -> None:
    u.wr(IER, IER_THRI)
    assert u.irq.count == 1
    assert u.iir() == IIR_THRI
    # Reading IIR while it reports THRE acknowledges it.
    assert u.iir() == IIR_NO_INT
    assert u.irq.count == 1


def test_each_transmit_rearms_thre(u: Uart) -> None:
    u.wr(IER, IER_THRI)
    assert u.iir() == IIR_THRI
    u.wr(THR, ord("a"))
    assert u.irq.count == 2
    assert u.iir() == IIR_THRI
    assert u.iir() == IIR_NO_INT
    u.wr(THR, ord("b"))
    assert u.irq.count == 3
    assert u.output() == b"ab"


def test_thre_test_in_serial8250_startup(u: Uart) -> None:
    """Linux's UART_BUG_THRE probe: enable THRI, read IIR, disable, enable again, read IIR: both pending."""
    u.wr(IER, IER_THRI)
    iir1 = u.iir()
    u.wr(IER, 0)
    u.wr(IER, IER_THRI)
    iir2 = u.iir()
    u.wr(IER, 0)
    assert iir1 == IIR_THRI and iir2 == IIR_THRI
    assert u.rd(LSR) & LSR_TEMT


def test_rewriting_ier_with_thri_already_set_does_not_rearm(u: Uart) -> None:
    u.wr(IER, IER_THRI)
    assert u.iir() == IIR_THRI
    u.wr(IER, IER_THRI | IER_RDI)
    assert u.iir() == IIR_NO_INT


def test_disabling_thri_hides_pending_thre(u: Uart) -> None:
    u.wr(IER, IER_THRI)
    u.wr(IER, 0)
    assert u.iir() == IIR_NO_INT
    assert u.irq.count == 1


# -- receive -------------------------------------------------------------------------------------------
def test_input_read_through_rbr_with_dr(u: Uart) -> None:
    assert u.dev.queue_input(b"ls\n") == 3
    assert u.rd(LSR) & LSR_DR
    assert u.rd(RBR) == ord("l")
    assert u.rd(LSR) & LSR_DR
    assert u.drain() == b"s\n"
    assert not u.rd(LSR) & LSR_DR
    assert u.rd(RBR) == 0


def test_input_without_rdi_raises_no_irq(u: Uart) -> None:
    u.dev.queue_input(b"x")
    assert u.irq.count == 0
    assert u.iir() == IIR_NO_INT


def test_rda_interrupt_until_fifo_empty(u: Uart) -> None:
    u.wr(IER, IER_RDI)
    assert u.irq.count == 0           # nothing to receive yet
    u.dev.queue_input(b"ab")
    assert u.irq.count == 1
    assert u.iir() == IIR_RDI
    assert u.iir() == IIR_RDI         # reading IIR does not acknowledge RDA
    assert u.rd(RBR) == ord("a")
    assert u.iir() == IIR_RDI
    assert u.rd(RBR) == ord("b")
    assert u.iir() == IIR_NO_INT


def test_rda_has_priority_over_thre(u: Uart) -> None:
    u.wr(IER, IER_RDI | IER_THRI)
    u.dev.queue_input(b"z")
    assert u.iir() == IIR_RDI
    assert u.rd(RBR) == ord("z")
    assert u.iir() == IIR_THRI        # THRE was not lost behind RDA
    assert u.iir() == IIR_NO_INT


def test_enabling_rdi_with_input_waiting_raises_irq(u: Uart) -> None:
    u.dev.queue_input(b"q")
    u.wr(IER, IER_RDI)
    assert u.irq.count == 1
    assert u.iir() == IIR_RDI


def test_queue_input_capped(u: Uart) -> None:
    assert u.dev.queue_input(b"a" * (RX_FIFO_CAP - 10)) == RX_FIFO_CAP - 10
    assert u.dev.queue_input(b"b" * 100) == 10
    assert u.dev.queue_input(b"c") == 0
    got = u.drain()
    assert got == b"a" * (RX_FIFO_CAP - 10) + b"b" * 10


def test_queue_empty_input_raises_no_irq(u: Uart) -> None:
    u.wr(IER, IER_RDI)
    assert u.dev.queue_input(b"") == 0
    assert u.irq.count == 0


def test_fcr_clear_receiver(u: Uart) -> None:
    u.dev.queue_input(b"stale")
    u.wr(FCR, FCR_ENABLE)               # enable alone keeps the data
    assert u.rd(LSR) & LSR_DR
    u.wr(FCR, FCR_ENABLE | FCR_CLEAR_RCVR)
    assert not u.rd(LSR) & LSR_DR
    assert u.rd(RBR) == 0


def test_fifo_probe_reports_16550a(u: Uart) -> None:
    """Linux autoconfig: write FCR enable, IIR >> 6 == 3 means a working 16550A FIFO."""
    u.wr(LCR, 0)
    u.wr(FCR, FCR_ENABLE)
    assert u.rd(IIR) >> 6 == 3


# -- loopback and modem status -------------------------------------------------------------------------
def test_loopback_probe_in_autoconfig(u: Uart) -> None:
    """Linux autoconfig writes MCR = LOOP|OUT2|RTS and expects MSR & 0xF0 == DCD|CTS (0x90)."""
    u.wr(MCR, MCR_LOOP | MCR_OUT2 | MCR_RTS)
    assert u.rd(MSR) & 0xF0 == 0x90


@pytest.mark.parametrize(("mcr", "msr"), [
    (0, 0),
    (MCR_DTR, MSR_DSR),
    (MCR_RTS, MSR_CTS),
    (MCR_OUT1, MSR_RI),
    (MCR_OUT2, MSR_DCD),
    (MCR_DTR | MCR_RTS | MCR_OUT1 | MCR_OUT2, MSR_DSR | MSR_CTS | MSR_RI | MSR_DCD),
])
def test_loopback_modem_lines(u: Uart, mcr: int, msr: int) -> None:
    u.wr(MCR, MCR_LOOP | mcr)
    assert u.rd(MSR) == msr


def test_msr_outside_loopback_ignores_mcr(u: Uart) -> None:
    u.wr(MCR, 0)
    assert u.rd(MSR) == MSR_DCD | MSR_DSR | MSR_CTS


def test_loopback_transmit_is_received_not_output(u: Uart) -> None:
    u.wr(IER, IER_RDI)
    u.wr(MCR, MCR_LOOP)
    u.wr(THR, 0x5A)
    u.wr(THR, 0xA5)
    assert u.out == []
    assert u.rd(LSR) & LSR_DR
    assert u.irq.count == 2            # one RDA edge per looped-back byte
    assert u.iir() == IIR_RDI
    assert u.drain() == b"\x5a\xa5"
    u.wr(MCR, 0)
    u.wr(THR, ord("o"))
    assert u.output() == b"o"
    assert not u.rd(LSR) & LSR_DR


def test_loopback_receive_fifo_is_capped(u: Uart) -> None:
    u.wr(MCR, MCR_LOOP)
    for _ in range(RX_FIFO_CAP + 100):
        u.wr(THR, ord("L"))
    assert len(u.dev.save().rx) == RX_FIFO_CAP     # the snapshot is bounded too
    assert u.out == []
    assert len(u.drain()) == RX_FIFO_CAP


def test_loopback_and_host_input_share_one_fifo_cap(u: Uart) -> None:
    assert u.dev.queue_input(b"h" * (RX_FIFO_CAP - 1)) == RX_FIFO_CAP - 1
    u.wr(MCR, MCR_LOOP)
    u.wr(THR, ord("a"))                            # fills the last slot
    u.wr(THR, ord("b"))                            # overrun: dropped
    assert u.dev.queue_input(b"c") == 0
    data = u.drain()
    assert len(data) == RX_FIFO_CAP and data[-1:] == b"a"


# -- out of range --------------------------------------------------------------------------------------
@pytest.mark.parametrize("offset", [8, 9, 0x100, -1])
def test_unimplemented_offsets_read_zero_and_ignore_writes(u: Uart, offset: int) -> None:
    before = u.dev.save()
    assert u.rd(offset) == 0
    u.wr(offset, 0xFF)
    assert u.dev.save() == before
    assert u.out == [] and u.irq.count == 0


@pytest.mark.parametrize("size", [2, 4])
def test_wide_reads_zero_extend(u: Uart, size: int) -> None:
    u.wr(SCR, 0x9C)
    assert u.dev.read(SCR, size) == b"\x9c" + bytes(size - 1)
    assert u.dev.read(LSR, size) == bytes([LSR_THRE | LSR_TEMT]) + bytes(size - 1)


# -- snapshot ------------------------------------------------------------------------------------------
def test_save_restore_roundtrip() -> None:
    a = Uart()
    a.wr(LCR, LCR_DLAB)
    a.wr(DLL, 0x30)
    a.wr(DLM, 0x01)
    a.wr(LCR, LCR_8N1)
    a.wr(IER, IER_RDI | IER_THRI)
    a.wr(MCR, MCR_DTR | MCR_OUT2)
    a.wr(SCR, 0x42)
    a.dev.queue_input(b"pending")
    state = a.dev.save()
    assert isinstance(state, SerialState)
    assert state.rx == b"pending" and state.thre_pending

    b = Uart()
    b.dev.restore(state)
    assert b.dev.save() == state
    assert (b.rd(IER), b.rd(LCR), b.rd(MCR), b.rd(SCR)) == (IER_RDI | IER_THRI, LCR_8N1,
                                                             MCR_DTR | MCR_OUT2, 0x42)
    assert b.iir() == IIR_RDI
    assert b.drain() == b"pending"
    assert b.iir() == IIR_THRI
    b.wr(LCR, LCR_DLAB)
    assert (b.rd(DLL), b.rd(DLM)) == (0x30, 0x01)
    # The original is independent of the restored copy.
    assert a.drain() == b"pending"
