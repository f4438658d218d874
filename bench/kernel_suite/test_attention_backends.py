"""Benchmarks of every registered attention backend (triton, torch, flash_attn, flashinfer) on
the same ViT, paged-decode and paged-prefill problems, through the backend interface.

A backend whose library is missing (or that needs a GPU) is skipped with a reason naming it.
"""


def test_backend_vit(run_backend):
    run_backend("vit")


def test_backend_paged_decode(run_backend):
    run_backend("paged_decode")


def test_backend_paged_prefill(run_backend):
    run_backend("paged_prefill")
