"""The GPU harness and its benchmark sections (run on a lent GPU through run.sh)."""
