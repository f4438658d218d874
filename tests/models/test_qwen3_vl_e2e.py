"""Qwen3-VL end to end on the tiny checkpoint: chat messages through SpaceServe's input path
(runtime/inputs: template, image processor, timestamped video) into the engine give
transformers' greedy tokens, where transformers' ``Qwen3VLProcessor`` built its inputs from the
same messages, media and checkpoint directory (the video also in temporal-chunked mode and
in spatial mode with prefill chunks cutting through its patches).

transformers' video processor resizes with torchvision, which this environment lacks: its video
half here is `qwen3_ref.HFVideos` (transformers' sampling, size rule, patch order and metadata;
PIL resizes), fed the frames PyAV decoded. Its prompt - the timestamps between temporal
patches, each patch's own ``<|vision_start|>`` run - is transformers' own. The M-RoPE positions
our model gives the timestamped prompt equal transformers' ``get_rope_index``.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from spaceserve import Engine, SamplingParams
from spaceserve.runtime.inputs import ChatPreprocessor, ImageLimits, VideoLimits
from tests.clips import encode_clip

from . import qwen3_ref as ref

pytest.importorskip("av")

STEPS = 6
GREEDY = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True)


def _png(h: int, w: int, seed: int) -> tuple[bytes, object]:
    from PIL import Image

    img = Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue(), img


def _clip(n: int, h: int, w: int) -> bytes:
    rng = np.random.default_rng(n)
    base = rng.integers(0, 255, (1, h, w, 3)).astype(np.int64)
    frames = ((base + 23 * np.arange(n)[:, None, None, None]) % 256).astype(np.uint8)
    return encode_clip(frames, fps=4, fmt="matroska", codec="ffv1")


def _decode(raw: bytes) -> tuple[np.ndarray, float]:
    import av

    with av.open(io.BytesIO(raw)) as c:
        stream = c.streams.video[0]
        fps = float(stream.average_rate)
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(stream)]), fps


def _url(kind: str, raw: bytes) -> dict:
    mime = "image/png" if kind == "image" else "video/x-matroska"
    return {"type": f"{kind}_url",
            f"{kind}_url": {"url": f"data:{mime};base64," + base64.b64encode(raw).decode()}}


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(checkpoint dir, transformers' model, our preprocessor, transformers' processor)."""
    torch.set_num_threads(1)
    path, hf = ref.build(tmp_path_factory.mktemp("qwen3vl_e2e"), tied=True)
    return path, hf, ChatPreprocessor.from_pretrained(path), ref.hf_processor(path)


def _request(kind: str) -> tuple[list[dict], list[dict], dict]:
    """(OpenAI-style messages, transformers-style messages, transformers' media kwargs)."""
    question = {"type": "text", "text": "Describe the picture."}
    if kind == "image":
        raw, img = _png(100, 70, 0)
        media, hf_media = _url("image", raw), {"images": [img]}
    else:
        raw = _clip(11, 70, 90)
        frames, fps = _decode(raw)
        media, hf_media = _url("video", raw), {"videos": [frames], "fps": [fps]}
    ours = [{"role": "user", "content": [media, question]}]
    theirs = [{"role": "user", "content": [{"type": kind}, question]}]
    return ours, theirs, hf_media


def _hf_inputs(case, kind: str) -> tuple[list[dict], dict]:
    _, _, _, proc = case
    ours, theirs, media = _request(kind)
    text = ref.chat_text(proc, theirs)
    fps = media.pop("fps", [])
    proc.video_processor.source_fps = fps
    enc = proc(text=[text], return_tensors="pt", **media)
    return ours, {k: v for k, v in enc.items() if k != "video_metadata"}


@pytest.mark.parametrize("kind, mode, extra", [
    ("image", "temporal", {}),
    ("video", "temporal", {}),
    ("video", "temporal-chunked", {}),
    ("video", "spatial", {"max_num_batched_tokens": 8}),  # prefill chunks cut through patches
])
def test_chat_to_engine_greedy_equals_transformers(case, kind: str, mode: str,
                                                   extra: dict) -> None:
    path, hf, pre, _ = case
    messages, hf_in = _hf_inputs(case, kind)
    prompt = pre.prepare(messages, ImageLimits(), VideoLimits())
    assert prompt["prompt_token_ids"] == hf_in["input_ids"][0].tolist()
    pv, grid = ("pixel_values", "image_grid_thw") if kind == "image" else \
        ("pixel_values_videos", "video_grid_thw")
    assert torch.equal(prompt[grid], hf_in[grid])
    torch.testing.assert_close(prompt[pv], hf_in[pv], rtol=0, atol=1e-5)
    if kind == "video":  # three temporal patches, each timed and in its own run
        assert prompt["video_grid_thw"].tolist()[0][0] == 3
        text = pre.tokenizer.decode(prompt["prompt_token_ids"])
        assert text.count(" seconds><|vision_start|>") == text.count("<|vision_start|>") == 3
    with torch.no_grad():
        out = hf.generate(**hf_in, max_new_tokens=STEPS, do_sample=False)
    expected = out[0, hf_in["input_ids"].shape[1]:].tolist()
    engine = Engine.from_pretrained(path, mode=mode, device="cpu", attention_backend="torch",
                                    block_size=4, num_kv_blocks=64, encoder_window_s=1e-9,
                                    **extra)
    got = engine.generate([prompt], GREEDY)[0]
    assert got.error is None and got.token_ids == expected
    engine.check_idle()


def test_timestamped_video_positions_equal_get_rope_index(case) -> None:
    """The positions of the prompt the input side builds (timestamp text advancing positions
    between temporal patches) are transformers' on the same ids and grid."""
    path, hf, pre, _ = case
    from spaceserve.models import from_pretrained

    messages, hf_in = _hf_inputs(case, "video")
    prompt = pre.prepare(messages, ImageLimits(), VideoLimits())
    ids = torch.tensor([prompt["prompt_token_ids"]])
    model = from_pretrained(path, attention_backend="torch", dtype=torch.float32, device="cpu")
    ours, delta = model.mrope_positions(ids[0], video_grid_thw=prompt["video_grid_thw"])
    theirs, their_delta = hf.model.get_rope_index(ids, hf_in["mm_token_type_ids"],
                                                  video_grid_thw=hf_in["video_grid_thw"])
    assert torch.equal(ours, theirs[:, 0]) and int(delta) == int(their_delta)


def test_one_source_of_processor_settings(case) -> None:
    """The tiny checkpoint's processor files, as the input side loads them, and the model's
    `image_processor` give Qwen3-VL's settings (`qwen3_vl.processing`): patch 16, temporal
    patch 2, merge 2, mean and std 0.5; videos are sampled the Qwen3-VL way."""
    path, _, pre, _ = case
    from spaceserve.models import from_pretrained
    from spaceserve.models.qwen3_vl.processing import processor_settings
    from spaceserve.runtime.inputs.media.frames_qwen3 import Qwen3VideoSampling

    want = processor_settings()
    assert want == {"patch_size": 16, "temporal_patch_size": 2, "merge_size": 2,
                    "image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    model = from_pretrained(path, attention_backend="torch", dtype=torch.float32, device="cpu")
    assert isinstance(pre.video_sampling, Qwen3VideoSampling)
    for proc in (pre.image_processor, pre.video_sampling, model.image_processor()):
        got = {k: getattr(proc, k) for k in want}
        assert {k: list(v) if isinstance(v, tuple) else v for k, v in got.items()} == want, proc
