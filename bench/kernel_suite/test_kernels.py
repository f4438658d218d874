"""Benchmarks of every kernel of `spaceserve.kernels` over cases, dtypes and SM budgets.

Parametrised in conftest.py; each test times one (case, dtype, budget) point. The rotary table
builders (torch ops, no budget of their own) run at the whole device only.
"""


def test_linear(run_kernel):
    run_kernel("linear")


def test_gated_mlp(run_kernel):
    run_kernel("gated_mlp")


def test_rms_norm(run_kernel):
    run_kernel("rms_norm")


def test_layer_norm(run_kernel):
    run_kernel("layer_norm")


def test_apply_rotary(run_kernel):
    run_kernel("apply_rotary")


def test_rotary_tables(run_kernel):
    run_kernel("rotary_tables")


def test_vit_attention(run_kernel):
    run_kernel("vit_attention")


def test_paged_decode_attention(run_kernel):
    run_kernel("paged_decode_attention")


def test_paged_prefill_attention(run_kernel):
    run_kernel("paged_prefill_attention")


def test_store_kv(run_kernel):
    run_kernel("store_kv")
