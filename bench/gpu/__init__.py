"""The GPU harness and its benchmark sections (run on a CUDA machine through run.sh)."""
