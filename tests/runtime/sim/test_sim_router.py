"""The simulator's cluster mode with SpaceServe's router (`--router media_aware`)."""

from __future__ import annotations

import json

import pytest

from spaceserve.runtime.policy.analytic.model import analytic_curves
from spaceserve.runtime.sim import ROUTERS, SimConfig, Workload, generate, simulate, summarize
from spaceserve.runtime.sim.cli import main


@pytest.fixture(scope="module")
def h200():
    return analytic_curves(device="H200")


def test_media_aware_routes_every_request_and_spreads_the_work(h200) -> None:
    assert "media_aware" in ROUTERS
    w = Workload(30.0, 1.0, image_mix={"448x448": 0.5, "3840x2160": 0.5}, seed=3)
    res = simulate(h200, SimConfig(mode="spatial", background=4), w, num_gpus=3,
                   router="media_aware")
    images = [r for r in res.requests if r.kind == "image"]
    assert len(images) == len(generate(w)) and all(r.done for r in res.requests)
    # predicted encoder work, not request counts, is balanced: the 4K images are spread
    big = [sum(r.gpu == g and r.resolution == "3840x2160" for r in images) for g in range(3)]
    assert max(big) - min(big) <= 2, big


def test_media_aware_cuts_the_ttft_tail_under_a_mixed_load(h200) -> None:
    """The same arrivals (three seeds, pooled) over 4 GPUs: routing by predicted work lowers
    mean and p99 TTFT against both baselines (a deterministic simulation, not a timing)."""
    ttft = {}
    for router in ROUTERS:
        reqs = [r for seed in (1, 2, 3) for r in simulate(
            h200, SimConfig(mode="spatial", background=8), Workload(28.0, 3.0, seed=seed),
            num_gpus=4, router=router).requests]
        ttft[router] = summarize(reqs)["ttft"]
    for stat in ("mean_ms", "p99_ms"):
        others = min(ttft["round_robin"][stat], ttft["least_loaded"][stat])
        assert ttft["media_aware"][stat] < others, (stat, ttft)


def test_cli_takes_the_router(tmp_path, capsys) -> None:
    rc = main(["--gpus", "2", "--router", "media_aware", "--modes", "spatial", "--rates",
               "0,10", "--duration", "1", "--no-plot", "--out", str(tmp_path)])
    assert rc == 0
    meta = json.loads((tmp_path / "results.json").read_text())["meta"]
    assert meta["router"] == "media_aware" and meta["gpus"] == 2
