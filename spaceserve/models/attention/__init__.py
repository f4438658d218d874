"""Attention backends behind one small interface: backends.py (the interface, the registry, the
triton and torch backends), library.py (optional flash_attn and flashinfer backends)."""
