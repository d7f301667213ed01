"""KVM ioctl bindings following the fd hierarchy Kvm -> Vm -> Vcpu."""
