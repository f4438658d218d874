"""Test setup: the Triton interpreter on CPU (set before any kernel module is imported)."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda") if HAS_CUDA else torch.device("cpu")


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    """The `--model tiny` checkpoint (tokenizer, image processor, random weights), built once
    per session."""
    from spaceserve.server.tiny import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt")
