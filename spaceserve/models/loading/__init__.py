"""Building the models: loader.py (from a checkpoint directory or a state dict), weights.py
(where tensors come from; each rank's shards)."""
