"""What runs the model: the runner protocol and its runners.

protocol.py (`ModelRunner`, `PreemptibleEncoder`), qwen2_vl.py (`Qwen2VLRunner`: Qwen2-VL and
Qwen2.5-VL on SpaceServe's kernels), null.py (`NullModelRunner`: a deterministic test double),
step_plan.py (`StepPlanner`: a batch into the step's buffers), model_info.py (`ModelInfo`).
"""
