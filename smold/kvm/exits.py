"""KVM exit reasons (include/uapi/linux/kvm.h)."""

from __future__ import annotations

import enum


class ExitReason(enum.IntEnum):
    UNKNOWN = 0
    EXCEPTION = 1
    IO = 2
    HYPERCALL = 3
    DEBUG = 4
    HLT = 5
    MMIO = 6
    IRQ_WINDOW_OPEN = 7
    SHUTDOWN = 8
    FAIL_ENTRY = 9
    INTR = 10
    SET_TPR = 11
    TPR_ACCESS = 12
    NMI = 16
    INTERNAL_ERROR = 17
    OSI = 18
    SYSTEM_EVENT = 24
    X86_RDMSR = 29
    X86_WRMSR = 30


class SystemEvent(enum.IntEnum):
    SHUTDOWN = 1
    RESET = 2
    CRASH = 3


KVM_EXIT_IO_IN = 0
KVM_EXIT_IO_OUT = 1
