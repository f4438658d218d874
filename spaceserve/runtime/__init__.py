"""The runtime: a request's path from admission to its last token, one room per stage.

    engine/   the Engine (add, step, abort, generate, stream), EngineConfig, outputs, assembly
    inputs/   chat messages, images and videos -> token ids and pixels (no HTTP)
    core/     requests, the scheduler and its ScheduledBatch, KV blocks, prefix cache, forks
    encoder/  the time-multiplexed encoder stages (temporal, chunked), data-parallel encoding,
              the encoder output cache
    spatial/  the co-located step: SM partitions, green contexts, split sets, encoder launches
    policy/   SIS, TWSRFT, resource-utility curves, the analytic model, contention, SLOs
              (pure Python, shared with sim/)
    worker/   the model-runner protocol, the Qwen2-VL runner, the null runner, step planning
    sample/   logits processing and sampling on the device
    routing/  replica routing keys and the router's load tracker
    tp/       tensor parallelism: rank 0's runner, worker processes, collectives
    sim/      the discrete-event simulator driving the same policy objects

Leaves: `modes.py` (the names settings take). Rooms import downwards: engine -> spatial /
encoder / tp -> worker -> core; policy and modes import no torch.
"""
