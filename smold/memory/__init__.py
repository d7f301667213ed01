"""Guest memory: the only object that touches the guest RAM mapping."""

from smold.memory.guest import PAGE_SIZE, GuestMemory, GuestMemoryError, MemoryRegion

__all__ = ["PAGE_SIZE", "GuestMemory", "GuestMemoryError", "MemoryRegion"]
