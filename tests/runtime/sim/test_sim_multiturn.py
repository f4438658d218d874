"""The simulator's multi-turn image-chat workload: the same conversations with caching on and
off, the closed loop of think times, what a cached turn still computes, and the command."""

from __future__ import annotations

import json

import pytest

from spaceserve.runtime.policy.analytic.model import analytic_curves
from spaceserve.runtime.policy.slo import DEFAULT_SLO
from spaceserve.runtime.sim.cli import main
from spaceserve.runtime.sim.engine import SimConfig
from spaceserve.runtime.sim.multiturn.workload import (
    Conversation,
    MultiTurn,
    conversations,
    next_turn,
    run_multiturn,
    summarize_turns,
)
from spaceserve.runtime.sim.workload import RESOLUTIONS


@pytest.fixture(scope="module")
def h200():
    return analytic_curves(device="H200")


def test_a_follow_up_turn_computes_only_what_the_caches_lack() -> None:
    mt = MultiTurn(1.0, 1.0, text_tokens=10, block_size=16)
    conv = Conversation(0.0, [1.0, 1.0], ["448x448", None, "1280x720"])
    first = next_turn(conv, mt, 0, 0.0, caching=True)
    conv.turn, conv.previous, conv.text = 1, first.prompt_tokens + 7, conv.text + 7
    assert (first.cached_image_tokens, first.cached_tokens) == (0, 0)
    second = next_turn(conv, mt, 1, 5.0, caching=True)  # the same image, asked again
    assert second.image_tokens == second.cached_image_tokens == 256
    assert second.patches == 0  # no encoder work
    assert second.cached_tokens == (256 + 10 + 7) // 16 * 16
    assert second.prompt_tokens == 256 + 10 + 7 + 10
    conv.turn, conv.previous = 2, second.prompt_tokens + 7
    third = next_turn(conv, mt, 2, 9.0, caching=False)  # a new image, caches off
    assert third.image_tokens == 256 + RESOLUTIONS["1280x720"]
    assert (third.cached_image_tokens, third.cached_tokens) == (0, 0)


def test_caching_serves_the_same_conversations_with_less_work_and_faster(h200) -> None:
    mt = MultiTurn(4.0, 3.0, turns=3, think_s=0.5, seed=2)
    runs = {}
    for caching in (True, False):
        turns = run_multiturn(h200, SimConfig(mode="temporal", background=8), mt,
                              caching=caching)
        runs[caching] = summarize_turns(turns, DEFAULT_SLO)
    on, off = runs[True], runs[False]
    assert on["turns"] == off["turns"] > 12
    assert on["encoded_patches"] < off["encoded_patches"]
    assert on["prefilled_tokens"] < off["prefilled_tokens"] / 2
    assert on["followup_ttft"]["mean_ms"] < off["followup_ttft"]["mean_ms"]


def test_follow_ups_wait_for_the_answer_and_the_think_time(h200) -> None:
    mt = MultiTurn(2.0, 2.0, turns=3, think_s=1.0, seed=5)
    turns = run_multiturn(h200, SimConfig(mode="spatial", background=4), mt, caching=True)
    convs = conversations(mt)
    assert len(turns) == 3 * len(convs) > 0
    by = {(i, k): r for i, k, r in turns}
    for (i, k), r in by.items():
        assert r.finish is not None and r.first_token >= r.arrival
        if k == 0:
            assert r.arrival == convs[i].start < 2.0
        else:  # the previous answer, then the think time
            assert r.arrival == pytest.approx(by[i, k - 1].finish + convs[i].thinks[k - 1])


def test_the_multiturn_command(tmp_path, capsys) -> None:
    assert main(["--workload", "multiturn", "--modes", "temporal", "--rates", "2",
                 "--duration", "2", "--turns", "2", "--think", "0.2", "--seeds", "0",
                 "--batch", "4", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| temporal | 2 | on |" in out and "| temporal | 2 | off |" in out
    rows = json.loads((tmp_path / "multiturn.json").read_text())["rows"]
    assert [r["caching"] for r in rows] == [True, False]
    with pytest.raises(SystemExit):
        main(["--workload", "multiturn", "--gpus", "2", "--out", str(tmp_path)])


def test_a_cached_turn_costs_only_its_uncached_prefill(h200) -> None:
    from spaceserve.runtime.sim.engine import Simulator
    from spaceserve.runtime.sim.workload import Request

    ttft = {}
    for cached in (False, True):
        sim = Simulator(h200, SimConfig(mode="temporal", background=0))
        req = Request(0, 0.0, 1369, 131, 2, "image")
        if cached:
            req.cached_image_tokens, req.cached_tokens = 1369, 1488
        sim.add(req)
        sim.drain()
        ttft[cached] = req.first_token - req.arrival
    host = SimConfig().host_s  # an idle engine plans the step, then it runs
    assert ttft[True] == pytest.approx(h200.prefill(1500 - 1488, 1488, h200.num_sms, False)
                                       + host)
    assert ttft[False] > h200.encoder(4 * 1369, h200.encoder_depth, h200.num_sms, False)
