"""Qwen2.5-VL on SpaceServe against transformers: window layout, vision tower, preemption, SM
budgets, M-RoPE (images and time-scaled videos), weight names, greedy generation (model and
engine), invalid input. Tiny random checkpoints saved with save_pretrained."""

import pytest
import torch

from spaceserve.kernels import record_launches
from spaceserve.kernels.testing import assert_close, assert_within_budget
from spaceserve.models import Qwen25VL, from_pretrained, weight_shapes, window_layout

from .conftest import BOS, EOS, IMAGE, VEND, VIDEO, VSTART, greedy, hf_inputs

PATCH_DIM = 3 * 2 * 14 * 14
# 6x10 patches = 3x5 merged tokens: windows of 2x2 merged tokens leave partial windows at the
# right and bottom; 4x4 is one whole window; the two-frame 4x6 grid has windows per frame.
GRID = [[1, 6, 10], [1, 4, 4], [2, 4, 6]]
MAX_TOKENS = 5


def tiny_config(**vision):
    from transformers import Qwen2_5_VLConfig

    vc = dict(depth=3, hidden_size=32, intermediate_size=54, num_heads=2, out_hidden_size=64,
              window_size=56, fullatt_block_indexes=[1], tokens_per_second=2,
              initializer_range=0.1)
    vc.update(vision)
    return Qwen2_5_VLConfig(
        text_config=dict(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         eos_token_id=EOS, bos_token_id=BOS, rms_norm_eps=1e-6,
                         initializer_range=0.15,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=vc, image_token_id=IMAGE, video_token_id=VIDEO,
        vision_start_token_id=VSTART, vision_end_token_id=VEND)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """(path, transformers model in fp32 with sdpa) of a tiny Qwen2.5-VL: blocks 0 and 2 attend
    in windows, block 1 over whole frames; biases and norm weights perturbed."""
    from transformers import Qwen2_5_VLForConditionalGeneration

    torch.manual_seed(25)
    hf = Qwen2_5_VLForConditionalGeneration(tiny_config()).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("qwen25vl")
    hf.save_pretrained(path)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="sdpa").eval()
    hf.generation_config.eos_token_id = None  # always MAX_TOKENS, as ignore_eos does
    return path, hf


@pytest.fixture(scope="module")
def load(checkpoint):
    cache = {}

    def get(backend: str) -> Qwen25VL:
        if backend not in cache:
            cache[backend] = from_pretrained(checkpoint[0], attention_backend=backend)
        return cache[backend]

    return get


@pytest.fixture(scope="module")
def pixels():
    grid = torch.tensor(GRID)
    gen = torch.Generator().manual_seed(3)
    return torch.randn(int(grid.prod(-1).sum()), PATCH_DIM, generator=gen), grid


@pytest.fixture(scope="module")
def encoded(load, pixels):
    """encoded(backend) -> the one-shot whole-device embeddings of `pixels`, computed once: the
    parity test checks them, the preempted and budgeted passes must equal them bitwise."""
    cache = {}

    def get(backend: str) -> torch.Tensor:
        if backend not in cache:
            cache[backend] = load(backend).encode_images(*pixels)
        return cache[backend]

    return get


@pytest.fixture(scope="module")
def reference(checkpoint, pixels):
    """transformers' vision tower in fp64: the merged embeddings (pooler_output)."""
    visual = checkpoint[1].model.visual.double()
    with torch.no_grad():
        out = visual(pixels[0].double(), grid_thw=pixels[1]).pooler_output
    visual.float()
    return out


@pytest.mark.parametrize("grid", [GRID, [[1, 8, 8]], [[3, 2, 14], [1, 16, 2]]])
@pytest.mark.parametrize("window", [1, 2, 3])
def test_window_layout_matches_transformers(grid, window):
    from transformers.vision_utils import get_vision_window_index

    index, cu = get_vision_window_index(torch.tensor(grid), spatial_merge_size=2,
                                        window_size=window * 28, patch_size=14)
    order, cu_win, cu_full = window_layout([tuple(g) for g in grid], 2, window)
    assert torch.equal(order, index)
    assert cu_win == cu.tolist()
    assert cu_full == [0, *torch.tensor([h * w for t, h, w in grid for _ in range(t)])
                       .cumsum(0).tolist()]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_encode_images_matches_transformers(load, encoded, reference, backend):
    model = load(backend)
    assert isinstance(model, Qwen25VL) and model.vision.window == 2
    out = encoded(backend)
    assert out.shape == (31, 64)
    assert_close(out, reference, rtol=2e-5)


def test_window_blocks_really_attend_in_windows(load, pixels, reference):
    """Every block attending over whole frames misses transformers by far more than the parity
    tolerance (2e-5): the parity above depends on the window segmentation."""
    vision = load("torch").vision
    saved = vision.full_layers
    vision.full_layers = frozenset(range(vision.num_layers))
    try:
        out = vision.encode(*pixels)
    finally:
        vision.full_layers = saved
    assert (out.double() - reference).norm() > 1e-2 * reference.norm()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_preempted_jobs_equal_full_runs(load, encoded, pixels, backend):
    vis = load(backend).vision
    full = encoded(backend)
    a, b = vis.start(*pixels), vis.start(*pixels)
    assert (a.num_patches, a.num_tokens, a.remaining_layers) == (sum(g[0] * g[1] * g[2]
                                                                     for g in GRID), 31, 3)
    assert a.tokens_per_image == [15, 4, 12]
    assert vis.advance(a, 1) == 1
    with pytest.raises(ValueError, match="advance"):
        vis.finish(a)
    assert vis.advance(b, 2) == 2 and vis.advance(a, 0) == 0
    assert vis.advance(a, 1) == 1 and vis.advance(b, 7) == 1 and b.done
    assert vis.advance(a, 1) == 1 and a.done and vis.advance(a, 1) == 0
    assert torch.equal(vis.finish(b), full)
    assert torch.equal(vis.finish(a), full)


def test_vision_pass_under_budget_window_and_full_plans(load, encoded, pixels):
    model = load("triton")
    with record_launches() as rec:
        small = model.encode_images(*pixels, num_sms=3)
    assert_within_budget(rec, 3)
    assert {r.num_sms for r in rec} == {3} and max(r.programs for r in rec) == 3
    names = {r.name for r in rec}
    assert {"linear", "rms_norm", "rotary", "vit_attention", "gated_mlp.gate_up"} <= names
    assert "layer_norm" not in names
    attn = [r.num_tiles for r in rec if r.name == "vit_attention"]
    assert len(attn) == 3 and attn[0] == attn[2] != attn[1]  # window, full, window
    job = model.vision.start(*pixels)
    assert job.window_meta.cu_seqlens_host[-1] == job.meta.cu_seqlens_host[-1] == 124
    assert len(job.window_meta.cu_seqlens_host) - 1 == 6 + 1 + 2 * 2  # windows per frame
    assert torch.equal(small, encoded("triton"))  # any budget, same bits


def _prompt(grids, text=(7, 9)):
    ids = [BOS, *text]
    for j, (t, h, w) in enumerate(grids):
        ids += [VSTART] + [IMAGE] * (t * h * w // 4) + [VEND, 10 + j]
    return torch.tensor(ids)


def _video_positions(ids, grids, seconds, per_second, merge=2):
    """Qwen2.5-VL's M-RoPE written out for text and videos: text advances all three rows by one;
    frame f of a video sits at start + int(f * seconds * tokens_per_second) in time and at
    start + row / col of its merged grid; the next text follows at start + max(rows, cols)."""
    pos: list[list[int]] = []
    nxt = i = j = 0
    ids = ids.tolist()
    while i < len(ids):
        if ids[i] != VIDEO:
            pos.append([nxt] * 3)
            nxt, i = nxt + 1, i + 1
            continue
        t, h, w = grids[j][0], grids[j][1] // merge, grids[j][2] // merge
        sec = 1.0 if seconds is None else float(seconds[j])
        frames = [[nxt + int(f * sec * per_second), nxt + r, nxt + c]
                  for f in range(t) for r in range(h) for c in range(w)]
        pos += frames
        nxt, i, j = nxt + max(h, w), i + len(frames), j + 1
    return torch.tensor(pos).T


def test_mrope_matches_get_rope_index(checkpoint, load):
    hf, model = checkpoint[1], load("torch")
    images = torch.tensor([[1, 6, 10], [1, 4, 4]])
    ids = _prompt(images.tolist())
    pos, delta = model.mrope_positions(ids, images)
    ref, ref_delta = hf.model.get_rope_index(ids[None], (ids == IMAGE).int()[None],
                                             image_grid_thw=images)
    assert torch.equal(pos, ref[:, 0]) and delta == int(ref_delta)
    first = (ids == IMAGE).nonzero()[0, 0]
    assert (pos[0, first:first + 15] == pos[0, first]).all()  # a still image: constant time
    videos = torch.tensor([[3, 4, 4], [2, 2, 4]])
    vid = [BOS, 5, VSTART] + [VIDEO] * 12 + [VEND, 6, VSTART] + [VIDEO] * 4 + [VEND, 8]
    vid = torch.tensor(vid)
    for seconds in (None, torch.tensor([0.5, 1.3]), [1.0, 0.25]):
        pos, delta = model.mrope_positions(vid, video_grid_thw=videos, second_per_grid_ts=seconds)
        want = _video_positions(vid, videos.tolist(), seconds, per_second=2)
        assert torch.equal(pos, want) and delta == int(want.max()) + 1 - len(vid), seconds
        kw = {} if seconds is None else {"second_per_grid_ts": seconds}
        ref, ref_delta = hf.model.get_rope_index(vid[None], (vid == VIDEO).int()[None] * 2,
                                                 video_grid_thw=videos, **kw)
        # transformers 5.17 truncates each second_per_grid_t to an int before scaling it
        # (0.5 s -> 0); later versions scale first, as Qwen2.5-VL's reference code does.
        whole = None if seconds is None else [float(int(s)) for s in seconds]
        assert torch.equal(ref[:, 0], want) or torch.equal(
            ref[:, 0], _video_positions(vid, videos.tolist(), whole, per_second=2)), seconds
    # 1 s per temporal patch x tokens_per_second=2: frames 2 apart (Qwen2-VL: 1 apart)
    assert pos[0, 3:15].unique().diff().tolist() == [2, 2]
    with pytest.raises(ValueError, match="second_per_grid_ts"):
        model.mrope_positions(vid, video_grid_thw=videos, second_per_grid_ts=[1.0])


def test_weight_shapes_and_random_weights_match_transformers(checkpoint):
    from spaceserve.models import from_config
    from spaceserve.models.loading.loader import canonical_name

    hf = checkpoint[1]
    ours = {canonical_name(k): v for k, v in weight_shapes(hf.config).items()}
    theirs = {canonical_name(k): tuple(t.shape) for k, t in hf.state_dict().items()}
    assert ours == theirs
    model = from_config(hf.config.to_dict(), attention_backend="torch")
    assert isinstance(model, Qwen25VL) and model.vision.out_dim == 64


def test_greedy_generation_matches_transformers(checkpoint, load, pixels):
    pv, grid = pixels[0][:76], pixels[1][:2]
    ids = _prompt(grid.tolist())
    with torch.no_grad():
        out = checkpoint[1].generate(**hf_inputs(ids, pv, grid), max_new_tokens=MAX_TOKENS,
                                     do_sample=False)
    expected = out[0, len(ids):].tolist()
    assert greedy(load("triton"), ids, pv, grid, MAX_TOKENS, chunk=9, num_sms=5) == expected


def _engine_modes() -> list[str]:
    from spaceserve.runtime.engine.engine import MODES

    return list(MODES)


@pytest.mark.parametrize("mode", _engine_modes())
def test_engine_generate_matches_transformers(checkpoint, pixels, mode):
    from spaceserve import Engine, SamplingParams

    path, hf = checkpoint
    pv, grid = pixels
    prompts = [{"prompt_token_ids": [BOS, 17, 33, 8, 91]}]
    for lo, hi in ((0, 1), (1, 2), (0, 2)):
        rows = slice(int(grid[:lo].prod(-1).sum()), int(grid[:hi].prod(-1).sum()))
        ids = _prompt(grid[lo:hi].tolist(), text=(7 + lo,))
        prompts.append({"prompt_token_ids": ids.tolist(), "pixel_values": pv[rows],
                        "image_grid_thw": grid[lo:hi]})
    expected = []
    for p in prompts:
        ids = torch.tensor(p["prompt_token_ids"])
        kw = hf_inputs(ids, p["pixel_values"], p["image_grid_thw"]) if "pixel_values" in p \
            else dict(input_ids=ids[None], attention_mask=torch.ones_like(ids[None]),
                      mm_token_type_ids=torch.zeros_like(ids[None]))
        with torch.no_grad():
            out = hf.generate(**kw, max_new_tokens=MAX_TOKENS, do_sample=False)
        expected.append(out[0, len(ids):].tolist())
    # co-located modes: one vision block per TWSRFT grant, so jobs are preempted between blocks
    engine = Engine.from_pretrained(path, mode=mode, attention_backend="torch", device="cpu",
                                    num_kv_blocks=48, block_size=4, max_num_batched_tokens=16,
                                    encoder_window_s=1e-9)
    assert isinstance(engine.runner.model, Qwen25VL)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                   ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    engine.check_idle()


@pytest.mark.parametrize("change, match", [
    (dict(window_size=20), "window_size"),
    (dict(hidden_size=30, num_heads=2), "hidden_size"),
    (dict(hidden_act="relu6"), "activation"),
])
def test_bad_vision_configs_raise(change, match):
    from spaceserve.models import from_config

    with pytest.raises(ValueError, match=match):
        from_config(tiny_config(**change), attention_backend="torch")


@pytest.mark.parametrize("mutate, match", [
    (lambda pv, g: (pv[:-1], g), "pixel_values"),
    (lambda pv, g: (pv[:, :-2], g), "pixel_values"),
    (lambda pv, g: (pv, torch.tensor([[1, 6, 10], [1, 4, 4], [2, 4, 5]])), "image_grid_thw"),
    (lambda pv, g: (pv, g[:0]), "image_grid_thw"),
])
def test_bad_inputs_raise(load, pixels, mutate, match):
    with pytest.raises(ValueError, match=match):
        load("torch").encode_images(*mutate(*pixels))


@pytest.mark.gpu
def test_bf16_vision_on_cuda(checkpoint, pixels, reference):
    """bf16 tower on the GPU (the gated-MLP pointer path: 54-wide rows are not 16-byte
    aligned), under a budget and chunked, against transformers in fp64."""
    dev = torch.device("cuda")
    model = from_pretrained(checkpoint[0], attention_backend="triton", dtype=torch.bfloat16,
                            device=dev)
    pv, grid = pixels[0].to(dev), pixels[1]
    full = model.encode_images(pv, grid, num_sms=16)
    assert_close(full, reference, rtol=2e-2)
    job = model.vision.start(pv, grid)
    while not job.done:
        model.vision.advance(job, 1, num_sms=8)
    assert torch.equal(model.vision.finish(job, num_sms=8), full)
