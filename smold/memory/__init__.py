"""Guest memory: the only object that touches the guest RAM mapping."""
