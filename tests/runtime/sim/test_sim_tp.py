"""The simulator at tensor parallelism: one rank's analytic curves (the decoder's share plus its
collectives over the link preset; the vision encoder data-parallel or sharded), a data-parallel
encoder run in rounds, and `spaceserve sim --model qwen2-vl-72b --tp 8` with goodput per mode."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter

import pytest

from spaceserve.runtime.encoder.data_parallel import RoundTwsrft
from spaceserve.runtime.policy.analytic.model import (
    PRESETS,
    ModelShape,
    Roofline,
    qwen2_vl_7b_config,
    qwen2_vl_72b_config,
)
from spaceserve.runtime.policy.analytic.tp import (
    LINKS,
    TensorParallelRoofline,
    tensor_parallel_curves,
)
from spaceserve.runtime.policy.slo import DEFAULT_SLO
from spaceserve.runtime.policy.twsrft import TwsrftScheduler
from spaceserve.runtime.sim import SimConfig, Simulator, Workload, generate, simulate
from spaceserve.runtime.sim.cli import main
from spaceserve.runtime.sim.sweep.rates import capacity_rate

H200, NVLINK = PRESETS["H200"], LINKS["H200"]


@pytest.fixture(scope="module")
def shape72() -> ModelShape:
    return ModelShape.from_config(qwen2_vl_72b_config(), "Qwen2-VL-72B")


def rank(shape, tp, mode="data"):
    return TensorParallelRoofline(shape, H200, tp=tp, link=NVLINK, mm_encoder_tp_mode=mode)


def test_one_rank_of_one_is_the_single_gpu_model() -> None:
    shape = ModelShape.from_config(qwen2_vl_7b_config())
    one = Roofline(shape, H200)
    for mode in ("data", "weights"):
        r = rank(shape, 1, mode)
        for sms in (8, 64, 132):
            assert r.decode(32, 1024, sms) == one.decode(32, 1024, sms)
            assert r.prefill(512, 1024, sms) == one.prefill(512, 1024, sms)
            assert r.encoder_layer(4 * 2691, sms) == one.encoder_layer(4 * 2691, sms)


def test_a_rank_runs_its_share_and_waits_for_the_collectives(shape72) -> None:
    r = rank(shape72, 8)
    share = Roofline(dataclasses.replace(shape72, heads=8, kv_heads=1, intermediate=3696,
                                         vocab=19008), H200)
    all_reduce = 15e-6 + 2 * 7 / 8 * (32 * 8192 * 2) / 360e9  # o_proj, down_proj per layer
    logits = 15e-6 + 7 / 8 * (32 * 152064 * 4) / 360e9  # the LM head's fp32 logits, gathered
    assert r.decode(32, 1024, 66) == pytest.approx(share.decode(32, 1024, 66) +
                                                   80 * 2 * all_reduce + logits)
    # the vision encoder: whole on the rank, plus the embeddings' broadcast from their owner
    one = Roofline(shape72, H200)
    p = 4 * 2691
    bcast = 15e-6 + (p / 4 * 8192 * 2) / 360e9
    assert r.encoder_layer(p, 64) == pytest.approx(one.encoder_layer(p, 64) + bcast / 32)
    # replicated (the engine's reference mode): the whole ViT on every rank, no broadcast
    rep = rank(shape72, 8, "replicate")
    assert rep.encoder_layer(p, 64) == one.encoder_layer(p, 64)
    assert rep.decode(32, 1024, 66) == r.decode(32, 1024, 66)
    # sharded: one image faster, eight at once slower
    w = rank(shape72, 8, "weights")
    assert w.encoder_layer(p, 132) < r.encoder_layer(p, 132) < 8 * w.encoder_layer(p, 132)
    assert r.decode(32, 1024, 132) < one.decode(32, 1024, 132) / 4


def test_splits_that_do_not_divide_are_refused(shape72) -> None:
    with pytest.raises(ValueError, match=r"attention heads \(64\) do not split over tp=3"):
        rank(shape72, 3)
    with pytest.raises(ValueError, match="the vision encoder's 16 heads / MLP width 5120 do not "
                                         "split over tp=32"):
        rank(shape72, 32, "weights")
    rank(shape72, 32)  # data-parallel: the ViT stays whole; KV heads replicated 4x
    with pytest.raises(ValueError, match="mm_encoder_tp_mode='tensor' is not one of"):
        rank(shape72, 8, "tensor")


@pytest.fixture(scope="module")
def tp8() -> dict:
    config = qwen2_vl_72b_config()
    return {m: tensor_parallel_curves(config, tp=8, mm_encoder_tp_mode=m)
            for m in ("data", "weights")}


def test_a_data_parallel_encoder_encodes_an_image_per_rank_at_once(tp8) -> None:
    w = Workload(30.0, 1.0, output_tokens=8, seed=4)
    assert tp8["data"].model["encoder_ranks"] == 8 and tp8["weights"].model["encoder_ranks"] == 1
    assert capacity_rate(tp8["data"], w) > capacity_rate(tp8["weights"], w)
    for mode in ("temporal", "temporal-chunked", "spatial"):
        cfg = SimConfig(mode=mode, background=4, background_output=16)
        sim = Simulator(tp8["data"], cfg)
        if mode == "spatial":
            assert isinstance(sim.sched, RoundTwsrft) and sim.sched.ranked.ranks == 8
            one = Simulator(tp8["weights"], cfg)  # one encoder: the engine's co-located step
            assert [type(s) for s in one.sched.scheds] == [TwsrftScheduler] and one.loop
        else:  # the engine's stages: a batch divided over the ranks, or a queue per rank
            assert sim.loop.ranks == 8 and Simulator(tp8["weights"], cfg).loop.ranks == 1
        res = simulate(tp8["data"], cfg, w)
        served = [r for r in res.requests if r.kind == "image"]
        assert len(served) == len(generate(w)) > 10 and all(r.finish for r in served)
        if mode != "temporal":
            sched = res.gpus[0].sched
            ranked = sched.ranked if mode == "spatial" else sched
            assert all(ranked.submitted), "a rank encoded nothing"
        rounds = Counter(r.encoded_at for r in served)  # a round finishes its members at once
        assert len(rounds) < len(served)


def test_sim_at_tp8_prints_goodput_per_mode(tmp_path, capsys) -> None:
    rc = main(["--model", "qwen2-vl-72b", "--tp", "8", "--modes", "temporal,spatial",
               "--rates", "0,6", "--duration", "1", "--no-plot", "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "Qwen2-VL-72B, TP 8 (one rank; encoder data)" in out
    results = json.loads((tmp_path / "results.json").read_text())
    assert (results["meta"]["tp"], results["meta"]["mm_encoder_tp_mode"]) == (8, "data")
    assert results["meta"]["slo"] == DEFAULT_SLO.to_dict()
    rows = results["sweep"]["spatial"]
    assert rows[0]["goodput"]["rate_per_s"] == 0.0 and rows[1]["goodput"]["rate_per_s"] > 0
    main(["--model", "qwen2-vl-72b", "--tp", "8", "--mm-encoder-tp-mode", "weights",
          "--modes", "temporal", "--rates", "2", "--duration", "1", "--no-plot",
          "--out", str(tmp_path)])
    assert "TP 8 (one rank; encoder weights)" in capsys.readouterr().out
    with pytest.raises(SystemExit, match=r"--tp 3: attention heads \(64\) do not split"):
        main(["--model", "qwen2-vl-72b", "--tp", "3", "--out", str(tmp_path)])
