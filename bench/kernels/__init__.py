"""Kernel and model-stage benchmarks on the GPU, each a section of the harness (bench/gpu/).

- `paged_attention`: paged decode / prefill attention on Qwen2-VL-7B heads ("paged-attention").
- `vit_attention`: varlen ViT attention on Qwen2-VL vision heads ("vit-attention").
- `models`: Qwen2-VL-7B vision pass, prefill and decode vs transformers ("models").
- `qwen25_vision`: Qwen2.5-VL-7B's vision tower vs transformers' ("qwen25-vision").
- `autotune`: measured resource-utility curves and per-budget kernel configs ("autotune").
- `__main__`: ``python -m bench.kernels``, the kernel demo (= ``spaceserve demo``).
"""
