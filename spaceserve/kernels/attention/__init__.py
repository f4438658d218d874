"""Attention kernels, each file a kernel, its launcher and its torch reference: paged.py (the paged
decode and prefill front door), paged_decode.py and paged_prefill.py (split-KV decode, causal
prefill), paged_plan.py (their host-side work lists), vit.py and vit_plan.py (varlen
bidirectional ViT attention and its LPT work list), kv_cache.py (`store_kv`)."""
