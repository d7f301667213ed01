"""The per-VM VMM process."""
