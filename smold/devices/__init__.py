"""Emulated devices: buses, legacy PC devices and virtio devices."""
