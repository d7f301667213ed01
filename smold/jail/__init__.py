"""Isolation of the VMM process: a seccomp-BPF system call filter and a jail (namespaces, chroot, uid, limits)."""
