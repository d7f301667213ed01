"""smolctl: the command-line client."""
