"""`spaceserve sim --model`: each preset's images counted under its own preprocessing (Qwen3-VL:
32-px tokens) and its curves; the Qwen3-VL-8B sweep runs."""

from __future__ import annotations

import json

import pytest

from spaceserve.runtime.sim.cli import main
from spaceserve.runtime.sim.workload import (
    RESOLUTIONS,
    Workload,
    generate,
    image_tokens,
    resolution_tokens,
)

QWEN3 = dict(patch=16, merge=2, min_pixels=65536, max_pixels=16777216)


def test_the_qwen2_table_is_its_preprocessing() -> None:
    assert resolution_tokens() == RESOLUTIONS


@pytest.mark.parametrize("w, h", [(448, 448), (1280, 720), (1920, 1080), (3840, 2160),
                                  (100, 90), (8000, 6000), (50, 3000)])
def test_image_tokens_as_transformers_resize(w: int, h: int) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    rh, rw = smart_resize(h, w, factor=32, min_pixels=65536, max_pixels=16777216)
    assert image_tokens(w, h, **QWEN3) == rh * rw // 32 ** 2
    rh, rw = smart_resize(h, w, factor=28, min_pixels=3136, max_pixels=12845056)
    assert image_tokens(w, h) == rh * rw // 28 ** 2


def test_a_workload_draws_its_models_token_counts() -> None:
    table = resolution_tokens(16, 2, 65536, 16777216)
    assert table["448x448"] == 196 and table["1920x1080"] == 2040
    w = Workload(5.0, 4.0, tokens_per_image=table, seed=3)
    reqs = [r for r in generate(w) if r.kind == "image"]
    assert reqs and all(r.image_tokens == table[r.resolution] for r in reqs)
    assert w.mean_image_tokens() == pytest.approx(sum(table[r] for r in w.image_mix) / 4)
    with pytest.raises(ValueError, match="tokens_per_image"):
        Workload(1.0, 1.0, tokens_per_image={"448x448": 196})


def test_sim_runs_qwen3_vl_8b(tmp_path, capsys) -> None:
    rc = main(["--model", "qwen3-vl-8b", "--modes", "temporal,spatial", "--rates", "0,6",
               "--duration", "1", "--no-plot", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "Qwen3-VL-8B" in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["meta"]["model"] == "Qwen3-VL-8B"
    rows = results["sweep"]["spatial"]
    assert rows[1]["goodput"]["rate_per_s"] > 0
    curves = json.loads((tmp_path / "curves_H200.json").read_text())
    assert curves["model"]["vision_deepstack"] == 3 and curves["model"]["head_dim"] == 128


def test_multiturn_takes_the_model(tmp_path, capsys) -> None:
    """--workload multiturn simulates --model's curves and counts its images its way."""
    rc = main(["--workload", "multiturn", "--model", "qwen3-vl-8b", "--modes", "spatial",
               "--rates", "1", "--duration", "2", "--turns", "2", "--no-plot",
               "--out", str(tmp_path)])
    assert rc == 0 and "Qwen3-VL-8B" in capsys.readouterr().out
    saved = json.loads((tmp_path / "multiturn.json").read_text())
    assert saved["model"] == "Qwen3-VL-8B"
    assert saved["workload"]["tokens_per_image"]["1920x1080"] == 2040
