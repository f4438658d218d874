"""Qwen3-VL on SpaceServe's kernels: `vision` (learned resampled positions, DeepStack taps),
`text` (Qwen3 decoder with q/k norm, interleaved M-RoPE and DeepStack adds), `model` (the two
stages behind one object, video positions). The tiny random checkpoint
(``--model tiny-qwen3-vl``) is built by `spaceserve.models.tiny`."""
