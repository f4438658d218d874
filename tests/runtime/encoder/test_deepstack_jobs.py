"""Qwen3-VL encoder jobs through the runner's preemptible interface (what TWSRFT and the
spatial encoder stage drive): a job split at every layer boundary, under changing SM budgets,
yields bitwise the rows of the one-shot pass - embeddings and every DeepStack feature."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from spaceserve.models import DeepStackJob, from_pretrained
from spaceserve.runtime.core.request import MultiModalData
from spaceserve.runtime.worker.qwen2_vl import Qwen2VLRunner
from tests.models import qwen3_ref as ref

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    path, _ = ref.build(tmp_path_factory.mktemp("qwen3vl_jobs"), tied=True)
    return Qwen2VLRunner(from_pretrained(path, attention_backend="torch", dtype=torch.float32,
                                         device="cpu"))


def _media(grid: list[list[int]], seed: int) -> MultiModalData:
    pv, g = ref.pixels(grid, seed)
    tokens = sum(t * h * w for t, h, w in grid) // 4
    return MultiModalData(pv, g, np.arange(tokens) + 3)


@pytest.mark.parametrize("split", ["every-layer", "two-then-one", "one-then-two"])
def test_split_jobs_keep_their_taps_bitwise(runner, split):
    mm = _media([[1, 4, 6], [2, 4, 4], [1, 8, 4]], 11)  # two images and a video
    whole = runner.encode([mm])[0]
    layers = runner.encoder_layers
    chunks = {"every-layer": [1] * layers, "two-then-one": [2, 1], "one-then-two": [1, 2]}
    job = runner.start_encode(mm)
    assert isinstance(job, DeepStackJob)
    for i, n in enumerate(chunks[split]):
        assert runner.advance_encode(job, n, num_sms=[None, 4, 1][i % 3]) == n
    assert job.done and len(job.taps) == 2
    rows = runner.finish_encode(job)
    assert rows.shape == (mm.num_tokens, 3 * runner.model.language.hidden)
    assert torch.equal(rows, whole)


def test_an_unfinished_job_cannot_finish(runner):
    job = runner.start_encode(_media([[1, 4, 4]], 12))
    runner.advance_encode(job, 1)
    with pytest.raises(ValueError, match="advance it to the end"):
        runner.finish_encode(job)
