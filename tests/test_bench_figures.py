"""What the GPU harness's figures mean, checked on CPU: which calls are graph-timed and what a
timed call reports, the kernels section's rows (every kernel row says how it was timed and what
its launcher costs the host), the facts' green-streams row (overlap fraction and granted
budgets) and the environment run.sh gives the sections."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.common import GRAPH_MAX_M, graph_timed, launch_count, time_call

ROOT = Path(__file__).resolve().parents[1]


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
    from bench import bench_colocation as bc
    from bench import bench_serving as bs
    from bench.colocation_load import BG_OUTPUT, BG_PROMPT
    from bench.common import model_len_for
    from spaceserve.bench.prompts import image_grid
    from spaceserve.runtime.analytic import qwen2_vl_7b_config
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
