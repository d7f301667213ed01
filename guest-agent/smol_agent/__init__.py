"""smol guest agent: runs inside the microVM, stdlib only."""
