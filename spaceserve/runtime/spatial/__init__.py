"""The co-located modes: encoder and decoder at the same time on their own SMs.

step.py (the co-located step: decode on its partition while encoder layers and prefills run on
the other), encoder_stage.py (`SpatialEncoderStage`: TWSRFT-ordered, preemptible at layer
boundaries), launches.py (cooperative and threaded encoder launches), partition.py
(`PartitionSet`: one partition per split and the whole device), green_context.py (CUDA green
contexts through cuda.bindings), partition_probe.py (a split's SMs checked when it is made),
split_set.py (the split set chosen at start-up), batch_split.py (a step's batch cut into its
decodes and its prefill chunks).
"""
