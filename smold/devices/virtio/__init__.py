"""virtio 1.2 transport (virtio-mmio) and split virtqueues."""
