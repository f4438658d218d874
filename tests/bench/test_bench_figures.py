"""What the GPU harness's figures mean, checked on CPU: which calls are graph-timed and what a
timed call reports, the kernels section's rows (every kernel row says how it was timed and what
its launcher costs the host), the facts' green-streams row (overlap fraction and granted
budgets) and the environment run.sh gives the sections."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.common import GRAPH_MAX_M, graph_timed, launch_count, time_call

ROOT = Path(__file__).resolve().parents[2]


def test_graph_timing_rule():
    assert graph_timed(1) and graph_timed(GRAPH_MAX_M)
    assert not graph_timed(GRAPH_MAX_M + 1) and not graph_timed(4096, 1)
    assert graph_timed(4096, 2)  # multi-launch: split-K + reduce, gated MLP, decode + merge
    assert not graph_timed(None)


def test_time_call_reports_how_and_host_time_on_cpu():
    calls = []
    t = time_call(lambda: calls.append(1), graph=True, rep_ms=1, device="cpu")
    assert set(t) == {"ms", "graph", "host_us", "timing"}
    assert t["graph"] is False and t["timing"] == "wall (CPU)" and t["host_us"] >= 0
    assert calls


def test_launch_count_counts_a_split_k_linear():
    import torch

    from spaceserve.kernels import linear

    w = torch.randn(32, 96)
    assert launch_count(lambda: linear(torch.randn(2, 96), w)) == 2  # split-K + reduce
    assert launch_count(lambda: linear(torch.randn(96, 32), w.t().contiguous())) == 1


@pytest.mark.usefixtures("one_thread_bench")
def test_every_kernel_row_carries_graph_and_host_us(tmp_path: Path):
    from bench.gpu import bench_kernels as bk

    rows = bk.measure(tmp_path, 60, bk.CPU)
    timed = [r for r in rows if "ms" in r]
    kinds = {r["kernel"] for r in timed}
    assert kinds == {"linear", "gated_mlp", "rms_norm", "layer_norm", "linear_sweep"}, rows
    for r in timed:
        assert isinstance(r["graph"], bool) and r["host_us"] > 0 and r["timing"], r
        assert r["launches"] >= 1 and r["status"] == "ok", r
    assert all(r["launches"] >= 2 for r in timed if r["kernel"] == "gated_mlp")
    assert any(r["launches"] == 2 and r["M"] <= GRAPH_MAX_M for r in timed
               if r["kernel"] == "linear")  # the decode-shape split-K row a GPU graph-times
    assert any("host us per call" in r.get("headline", "") for r in rows)


@pytest.fixture
def one_thread_bench():
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_facts_green_streams_row_names_overlap_and_granted_budgets():
    import torch

    from bench.gpu.facts import green_streams_row
    from spaceserve.kernels.budget import device_num_sms

    row = green_streams_row(torch.device("cpu"))
    total = device_num_sms("cpu")
    assert row["split"] == 64 and (row["encoder_sms"], row["decoder_sms"]) == (64, total - 64)
    assert row["figures"] == {"overlap_fraction": None, "granted_encoder_sms": 64,
                              "granted_decoder_sms": total - 64, "green_split": False}
    assert "needs a CUDA device" in row["skipped"] and "overlap -" in row["headline"]


def test_run_sh_gives_every_stream_its_own_hardware_queue():
    text = (ROOT / "bench/gpu/run.sh").read_text()
    assert 'export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-32}"' in text


def test_bench_engines_are_sized_to_their_workloads():
    """The colocation and serving engines' max_model_len covers their longest request and is
    at most twice it: decode graphs and block tables are sized from it, not from 32k."""
    from bench.common import model_len_for
    from bench.serving import colocation as bc
    from bench.serving import serving as bs
    from bench.serving.colocation_load import BG_OUTPUT, BG_PROMPT
    from spaceserve.bench.prompts import image_grid
    from spaceserve.runtime.policy.analytic.model import qwen2_vl_7b_config
    from spaceserve.runtime.sim import Workload

    vision = qwen2_vl_7b_config().vision_config

    def tokens(res: str) -> int:
        t, h, w = image_grid(res, vision)
        return t * h * w // 4

    assert model_len_for(2723) == 4096 and model_len_for(10) == 256
    grids = {r: tuple(image_grid(f"{w}x{h}", vision)) for r, (h, w) in bc.IMAGE_SIZES.items()}
    load = Workload(image_rate=1.5, duration_s=5.0, image_mix=bc.IMAGE_MIX, text_rate=4.0,
                    text_tokens=16, output_tokens=16, seed=0)
    need = max(max(tokens(r) for r in bc.IMAGE_MIX) + 32, BG_PROMPT + BG_OUTPUT)
    assert need == 2691 + 32
    assert need <= bc.workload_len(grids, load) <= 2 * need
    plan = bs.Plan()
    longest = max(tokens(r) for r in plan.image_mix) + 4 * plan.input_words + plan.output_len
    assert longest <= plan.engine["max_model_len"] <= 2 * longest
    assert plan.engine["graph_reserve_bytes"] >= 1 << 30


@pytest.fixture
def fake_cuda_timing(monkeypatch):
    """`time_call`'s CUDA path without a GPU: no-op syncs, do_bench / do_bench_cudagraph fakes
    that log their calls (a capture of `fn` named "uncapturable" fails, as a graph capture of a
    host-synchronising op does)."""
    import triton.testing

    import bench.common as common

    log: list[str] = []

    def cudagraph(fn, rep, return_mode):
        log.append("cudagraph")
        if getattr(fn, "__name__", "") == "uncapturable":
            raise RuntimeError("operation not permitted when stream is capturing")
        fn()
        return 0.25

    def do_bench(fn, warmup_ms, rep_ms, device):
        log.append("do_bench")
        fn()
        return 0.75

    monkeypatch.setattr(common.torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", cudagraph)
    monkeypatch.setattr(common, "bench_ms", do_bench)
    return log


def test_time_call_on_cuda_replays_a_graph_or_says_why_not(fake_cuda_timing):
    """The CUDA path's columns: graph-timed calls come from do_bench_cudagraph (graph true),
    a call whose capture fails is timed eagerly with the reason, the rest by do_bench; host_us
    is one eager call's issue time either way."""
    import time

    log = fake_cuda_timing

    def slow_host() -> None:
        time.sleep(0.002)

    t = time_call(slow_host, graph=True, device="cuda", host_reps=3)
    assert (t["ms"], t["graph"], t["timing"]) == (0.25, True, "cuda-graph") and "graph_error" \
        not in t
    assert t["host_us"] >= 2000 and log == ["cudagraph"]

    def uncapturable() -> None:
        pass

    log.clear()
    t = time_call(uncapturable, graph=True, device="cuda", host_reps=3)
    assert (t["ms"], t["graph"], t["timing"]) == (0.75, False, "do_bench")
    assert "stream is capturing" in t["graph_error"] and log == ["cudagraph", "do_bench"]
    log.clear()
    t = time_call(slow_host, graph=False, device="cuda", host_reps=3)
    assert (t["ms"], t["graph"], t["timing"]) == (0.75, False, "do_bench") and log == ["do_bench"]
    assert t["host_us"] >= 2000


def test_paged_decode_rows_are_graph_timed_and_carry_host_us(monkeypatch):
    """A decode call (split-KV decode + merge: two launches) is graph-timed at any batch, a
    single launch only at decode batches; every decode row carries graph, timing, launches and
    host_us."""
    import torch

    from bench.kernels import paged_attention as bp
    from spaceserve.kernels import linear

    asked: list[bool] = []

    def fake_time_call(fn, *, graph, **kw):
        asked.append(graph)
        return {"ms": 0.5, "graph": graph, "host_us": 12.0,
                "timing": "cuda-graph" if graph else "do_bench"}

    monkeypatch.setattr(bp, "time_call", fake_time_call)
    w = torch.randn(32, 96)
    two = lambda: linear(torch.randn(2, 96), w)  # noqa: E731  split-K + reduce: two launches
    one = lambda: linear(torch.randn(96, 32), w.t().contiguous())  # noqa: E731
    t = bp._time_decode(two, 128)
    assert asked == [True] and t["launches"] == 2
    assert bp._time_decode(one, 128)["launches"] == 1 and asked[-1] is False
    assert bp._time_decode(one, 8)["launches"] == 1 and asked[-1] is True
    row = bp._decode_row(128, 4096, 66, t, copy_gbs=4000.0)
    assert {k: row[k] for k in ("ms", "graph", "timing", "launches", "host_us")} == {
        "ms": 0.5, "graph": True, "timing": "cuda-graph", "launches": 2, "host_us": 12.0}


class _Granting:
    """A PartitionSet whose "driver" rounds each split up to 8-SM groups (the granted counts),
    with a probe that passes: the green path's bookkeeping on a machine without CUDA."""

    @staticmethod
    def make(total: int):
        from spaceserve.runtime.spatial.partition import Partition, PartitionSet

        class Granting(PartitionSet):
            def __init__(self, device, splits=(), **kw):
                super().__init__(device, splits, probe=lambda part, dev: "probe: disjoint",
                                 **kw)

            def _support(self):
                return None

            def _green(self, e, programs_per_sm):
                granted = -(-e // 8) * 8
                return Partition(e, granted, self.total - granted, True,
                                 programs_per_sm=programs_per_sm)

        return Granting


def test_facts_green_streams_row_on_a_gpu_reports_measured_overlap_and_granted_sms(
        monkeypatch):
    """On a GPU the row's figures are what the split was granted (66 requested, 72 granted)
    and the overlap green_stream_facts measured; the headline says which checks passed."""
    import torch

    from bench.gpu import facts
    from spaceserve.kernels import budget
    from spaceserve.runtime.spatial import partition, partition_probe

    monkeypatch.setattr(budget, "device_num_sms", lambda dev=None: 132)
    monkeypatch.setattr(partition, "device_num_sms", lambda dev=None: 132)
    monkeypatch.setattr(partition, "PartitionSet", _Granting.make(132))
    seen = []

    def fake_facts(pset, split):
        part = pset.get(split)
        seen.append((split, part.encoder_sms, part.green))
        return {"ok": True, "overlap_fraction": 0.83, "wall_s": 1.9,
                "concurrent": {"ok": True}, "events": {"ok": True},
                "graph": {"ok": False, "error": "capture failed"}}

    monkeypatch.setattr(partition_probe, "green_stream_facts", fake_facts)
    row = facts.green_streams_row(torch.device("cuda"), 66)
    assert seen == [(66, 72, True)]
    assert row["figures"] == {"overlap_fraction": 0.83, "granted_encoder_sms": 72,
                              "granted_decoder_sms": 60, "green_split": True}
    assert row["probe"] == "probe: disjoint" and "skipped" not in row
    assert row["headline"] == ("split 66: encoder 72 / decoder 60 SMs granted (green); overlap "
                               "0.83; concurrent ok, events ok, graph FAILED")


def test_colocation_rows_and_simulator_take_the_granted_budgets(monkeypatch):
    """A spatial engine whose splits were granted more SMs than requested: its rows report
    the granted counts (and the requested ones beside them), and the simulator replays the
    granted splits."""
    from types import SimpleNamespace

    from bench.serving import colocation as bc
    from spaceserve.runtime.sim import Workload

    total = 132
    from spaceserve.runtime.spatial import partition

    monkeypatch.setattr(partition, "device_num_sms", lambda dev=None: total)
    Granting = _Granting.make(total)
    sims: list[tuple] = []

    def make_engine(mode):
        pset = Granting("cpu", [30, 60])
        if mode == "spatial-static":
            pset.switch(pset.get(60))
        return SimpleNamespace(spatial=SimpleNamespace(partitions=pset, sis=None,
                                                       graph_bytes={30: 2048, 0: 1000}),
                               close=pset.close, memory=SimpleNamespace(block_bytes=1024),
                               graph_batch_sizes=(32,))

    monkeypatch.setattr(bc, "drive", lambda *a, **k: {})
    monkeypatch.setattr(bc, "probe_partitions", lambda engine: {"probe": "faked"})
    monkeypatch.setattr(bc, "sim_prediction",
                        lambda curves, mode, workload, static, splits=None:
                        sims.append((mode, static, splits)) or {})
    workload = Workload(image_rate=1.0, duration_s=0.05, image_mix=bc.IMAGE_MIX)
    rows = bc.run_modes(make_engine, lambda eng: None, workload, None,
                        modes=("spatial-static", "spatial"))
    static, spatial = rows
    assert (static["encoder_sms"], static["decoder_sms"], static["green"]) == (64, 68, True)
    assert static["partitions"][60]["encoder_sms"] == 64
    assert spatial["splits"] == [32, 64] and spatial["splits_requested"] == [30, 60]
    assert spatial["graph_bytes"] == {0: 1000, 30: 2048} and spatial["graph_kv_blocks_total"] == 3
    assert sims == [("spatial-static", 64, None), ("spatial", None, [32, 64])]
