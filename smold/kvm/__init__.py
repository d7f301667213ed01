"""KVM ioctl bindings following the fd hierarchy Kvm -> Vm -> Vcpu."""

from smold.kvm.api import Kvm, KvmUnavailable, Vcpu, Vm, is_pvm
from smold.kvm.exits import ExitReason
from smold.kvm.ioctl import KvmError

__all__ = ["ExitReason", "Kvm", "KvmError", "KvmUnavailable", "Vcpu", "Vm", "is_pvm"]
