"""Videos through the vision towers and the engine, against transformers: a video's embeddings
(``visual(pixel_values_videos, grid_thw=video_grid_thw).pooler_output``) for Qwen2-VL and
Qwen2.5-VL, preempted video jobs, video patches in the processor's order, and greedy engine
generation on prompts mixing videos and images (M-RoPE video positions, video tokens
embedded from encoder rows), whole and split at layer boundaries by TWSRFT."""

import numpy as np
import pytest
import torch

from spaceserve.kernels.testing import assert_close

from .conftest import BOS, IMAGE, VEND, VIDEO, VSTART
from .test_qwen2_5_vl import checkpoint as qwen25_checkpoint  # noqa: F401  (module fixture)

PATCH_DIM = 3 * 2 * 14 * 14
# odd temporal and spatial sizes; a two-patch clip; 2x2 windows cut partial ones per frame
VIDEO_GRID = [[3, 4, 6], [1, 2, 2], [2, 6, 4]]
IMAGE_GRID = [[1, 4, 4]]
MAX_TOKENS = 5


def _pixels(grid, seed):
    g = torch.Generator().manual_seed(seed)
    grid = torch.tensor(grid)
    return torch.randn(int(grid.prod(-1).sum()), PATCH_DIM, generator=g), grid


@pytest.fixture(scope="module")
def videos():
    return _pixels(VIDEO_GRID, 5)


def _visual_reference(hf, pv, grid):
    visual = hf.model.visual.double()
    with torch.no_grad():
        out = visual(pv.double(), grid_thw=grid).pooler_output
    visual.float()
    return out


def test_qwen2_vl_video_embeddings_match_transformers(checkpoints, load, videos):
    pv, grid = videos
    for name in ("small", "wide"):
        ref = _visual_reference(checkpoints[name][1], pv, grid)
        out = load(name, "torch").encode_images(pv, grid)
        assert out.shape == (int(grid.prod(-1).sum()) // 4, ref.shape[1])
        assert_close(out, ref, rtol=2e-5)


def test_qwen2_vl_video_embeddings_triton(checkpoints, load):
    pv, grid = _pixels([[2, 2, 4]], 6)  # small: the interpreter is slow
    ref = _visual_reference(checkpoints["small"][1], pv, grid)
    assert_close(load("small", "triton").encode_images(pv, grid), ref, rtol=2e-5)


def test_qwen25_vl_video_embeddings_match_transformers(qwen25_checkpoint, videos):  # noqa: F811
    from spaceserve.models import from_pretrained

    path, hf = qwen25_checkpoint
    pv, grid = videos
    ref = _visual_reference(hf, pv, grid)
    model = from_pretrained(path, attention_backend="torch")
    assert_close(model.encode_images(pv, grid), ref, rtol=2e-5)
    # a video is one job split at layer boundaries like an image: same bits in any chunking
    job = model.vision.start(pv, grid)
    assert job.num_patches == sum(t * h * w for t, h, w in VIDEO_GRID)
    while not job.done:
        model.vision.advance(job, 1)
    assert torch.equal(model.vision.finish(job), model.encode_images(pv, grid))


def test_video_patches_follow_the_processor_order():
    """Two equal frames as a video give the image processor's patches of that frame (it repeats
    a still image to fill the temporal patch), in the same order."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    from spaceserve.runtime.inputs.media.video import DecodedVideo, VideoSampling, video_patches

    frame = np.random.default_rng(1).integers(0, 255, (56, 84, 3), dtype=np.uint8)
    sampling = VideoSampling(min_pixels=56 * 56, max_pixels=56 * 84)
    one = DecodedVideo(frame[None], 2.0, 1, (0,), 1.0, "x")  # padded by repeating the frame
    two = DecodedVideo(np.stack([frame, frame]), 2.0, 2, (0, 1), 1.0, "x")
    ref = Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 84)(
        images=[frame], return_tensors="pt")
    for video in (one, two):
        pv, grid = video_patches(video, sampling)
        assert grid == tuple(ref["image_grid_thw"][0].tolist()) == (1, 4, 6)
        torch.testing.assert_close(pv, ref["pixel_values"], atol=1e-5, rtol=1e-5)


def _prompt(items) -> torch.Tensor:
    """BOS, text, then each (kind, grid) as vision_start, its tokens, vision_end, a word."""
    ids = [BOS, 7, 9]
    for j, (kind, (t, h, w)) in enumerate(items):
        ids += [VSTART] + [VIDEO if kind == "video" else IMAGE] * (t * h * w // 4) + [VEND, 10 + j]
    return torch.tensor(ids + [44])


@pytest.mark.parametrize("mode", ["temporal", "spatial"])  # whole, and split by TWSRFT
def test_engine_generates_from_videos_as_transformers(qwen25_checkpoint, mode):  # noqa: F811
    """Qwen2.5-VL (time-scaled video positions): a video alone, and an image between two
    videos, greedy through the engine equal transformers' generate."""
    from spaceserve import Engine, SamplingParams

    path, hf = qwen25_checkpoint
    vpv, vgrid = _pixels([[3, 4, 6], [2, 2, 4]], 7)
    ipv, igrid = _pixels(IMAGE_GRID, 8)
    n0 = 3 * 4 * 6
    cases = [
        (_prompt([("video", (3, 4, 6))]), vpv[:n0], vgrid[:1], [0.5], None, None),
        (_prompt([("video", (3, 4, 6)), ("image", (1, 4, 4)), ("video", (2, 2, 4))]),
         vpv, vgrid, [1.0, 0.75], ipv, igrid),
    ]
    prompts, expected = [], []
    for ids, pvv, vg, seconds, pv, ig in cases:
        types = (ids == IMAGE).int() + 2 * (ids == VIDEO).int()
        kw = dict(input_ids=ids[None], pixel_values_videos=pvv, video_grid_thw=vg,
                  second_per_grid_ts=torch.tensor(seconds), mm_token_type_ids=types[None],
                  attention_mask=torch.ones_like(ids[None]))
        prompt = {"prompt_token_ids": ids.tolist(), "pixel_values_videos": pvv,
                  "video_grid_thw": vg, "second_per_grid_ts": seconds}
        if pv is not None:
            kw.update(pixel_values=pv, image_grid_thw=ig)
            prompt.update(pixel_values=pv, image_grid_thw=ig)
        with torch.no_grad():
            out = hf.generate(**kw, max_new_tokens=MAX_TOKENS, do_sample=False)
        expected.append(out[0, len(ids):].tolist())
        prompts.append(prompt)
    engine = Engine.from_pretrained(path, mode=mode, attention_backend="torch", device="cpu",
                                    num_kv_blocks=48, block_size=4, max_num_batched_tokens=16,
                                    encoder_window_s=1e-9)
    outs = engine.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                   ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    assert [o.error for o in outs] == [None, None]
    engine.check_idle()


def test_qwen2_vl_engine_video_matches_transformers(checkpoints):
    """Qwen2-VL (frames one position apart), a chunked prefill through the video."""
    from spaceserve import Engine, SamplingParams

    path, hf = checkpoints["small"]
    pv, grid = _pixels([[3, 4, 6]], 9)
    ids = _prompt([("video", (3, 4, 6))])
    with torch.no_grad():
        out = hf.generate(input_ids=ids[None], pixel_values_videos=pv, video_grid_thw=grid,
                          mm_token_type_ids=(2 * (ids == VIDEO).int())[None],
                          attention_mask=torch.ones_like(ids[None]),
                          max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None)
    engine = Engine.from_pretrained(path, attention_backend="torch", device="cpu",
                                    num_kv_blocks=48, block_size=4, max_num_batched_tokens=8)
    got = engine.generate([{"prompt_token_ids": ids.tolist(), "pixel_values_videos": pv,
                            "video_grid_thw": grid}],
                          SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                         ignore_eos=True))[0]
    assert got.token_ids == out[0, len(ids):].tolist()
