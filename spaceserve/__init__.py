"""SpaceServe: spatial multiplexing of a vision encoder and an LLM decoder on one GPU."""

__version__ = "0.1.0"
