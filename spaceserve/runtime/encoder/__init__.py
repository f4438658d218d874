"""The vision encoder's stages in the time-multiplexed modes, and what every mode shares.

temporal.py (`TemporalEncoderStage`: whole passes inside the step, as vLLM/SGLang),
chunked.py (`ChunkedEncoderStage`: TWSRFT-ordered layer chunks on the whole GPU for a bounded
window before each decode step; the temporal-stage factory), data_parallel.py (encoding spread
over tensor-parallel ranks), cache.py (`EncoderCache`: embeddings by content hash).
"""
