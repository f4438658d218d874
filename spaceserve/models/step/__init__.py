"""One language-model step: context.py (the context object carrying cu_seqlens, block tables
and slots to every layer; `ContextPlanner`), step_context.py (`StepContext`, `HostMeta`),
buffers.py (one device buffer, pinned staging), rows.py (per-sequence planner state),
decode_plan.py (decode-only steps replanned from what changed), graph_buckets.py and
cuda_graph.py (decode graphs per batch size and table width, and their replay)."""
