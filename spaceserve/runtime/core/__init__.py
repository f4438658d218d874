"""Requests and their bookkeeping: what the scheduler decides and the runner executes.

request.py (`Request`, `MultiModalData`, outputs' records), sampling_params.py
(`SamplingParams`), batch.py (`ScheduledBatch`: one step's work), scheduler.py (continuous
batching with chunked prefill, admission, preemption), block_manager.py (paged KV blocks),
prefix_cache.py (block hashes, take/commit), forks.py (parallel sampling: sequence groups, copy
on write), memory.py (KV-cache sizing), mm_hash.py (content hashes of media items).
"""
