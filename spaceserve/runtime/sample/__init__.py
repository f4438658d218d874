"""Sampling on the device: sampler.py (`Sampler`: per-request parameters in device tensors,
logprobs, the last-token table), ops.py (the logits-processing and draw operations and their
references)."""
