"""x86-64 direct kernel boot (Linux boot protocol)."""
