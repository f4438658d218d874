"""The server on the tiny Qwen3-VL, live on loopback: the official openai client gets an answer
to an image request and to a video request, usage counts the media tokens (prompt_tokens is the
length of the prompt transformers' ``Qwen3VLProcessor`` expands from the same messages: the
image's merged patches; per temporal patch of the video its timestamp text,
``<|vision_start|>``, its tokens and ``<|vision_end|>``), and the tokens are the engine's."""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
import torch

from spaceserve import SamplingParams
from spaceserve.runtime.inputs import ImageLimits, VideoLimits
from tests.clips import encode_clip
from tests.models import qwen3_ref as ref

from .conftest import MODEL, make_app, png

pytest.importorskip("av")

IMAGE = png(100, 70, seed=3)
PARAMS = dict(max_tokens=5, temperature=0.0)


def _clip() -> bytes:
    rng = np.random.default_rng(11)
    base = rng.integers(0, 255, (1, 70, 90, 3)).astype(np.int64)
    frames = ((base + 23 * np.arange(11)[:, None, None, None]) % 256).astype(np.uint8)
    return encode_clip(frames, fps=4, fmt="matroska", codec="ffv1")


VIDEO = _clip()
MEDIA = {"image": {"type": "image_url", "image_url": {
             "url": "data:image/png;base64," + base64.b64encode(IMAGE).decode()}},
         "video": {"type": "video_url", "video_url": {
             "url": "data:video/x-matroska;base64," + base64.b64encode(VIDEO).decode()}}}


def _messages(kind: str) -> list[dict]:
    return [{"role": "user", "content": [MEDIA[kind],
                                         {"type": "text", "text": "Describe the picture."}]}]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    """(checkpoint dir, engine, preprocessor) of the tiny Qwen3-VL."""
    from spaceserve.models.tiny import build_tiny_qwen3_checkpoint
    from spaceserve.server.engine_client import load_engine

    path = build_tiny_qwen3_checkpoint(tmp_path_factory.mktemp("qwen3") / "ckpt")
    engine, pre, note = load_engine(str(path), device="cpu", attention_backend="torch",
                                    num_kv_blocks=128, block_size=8, max_num_seqs=8)
    assert note is None
    return path, engine, pre


@pytest.fixture(scope="module")
def client(qwen3):
    openai = pytest.importorskip("openai", reason="the serve extra is not installed")
    pytest.importorskip("uvicorn", reason="the serve extra is not installed")
    from spaceserve.server.app import ServerThread

    _, engine, pre = qwen3
    engine_client, app = make_app(engine, pre)
    with ServerThread(app) as server:
        yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    engine_client.close()


def _transformers_prompt_len(path, kind: str) -> int:
    """Length of the prompt transformers' processor builds for `_messages(kind)` (its video
    half `qwen3_ref.HFVideos`, on the frames PyAV decodes: no torchvision here)."""
    import av
    from PIL import Image

    proc = ref.hf_processor(path)
    theirs = [{"role": "user", "content": [{"type": kind},
                                           {"type": "text", "text": "Describe the picture."}]}]
    text = ref.chat_text(proc, theirs)
    if kind == "image":
        media = {"images": [Image.open(io.BytesIO(IMAGE)).convert("RGB")]}
    else:
        with av.open(io.BytesIO(VIDEO)) as c:
            stream = c.streams.video[0]
            proc.video_processor.source_fps = [float(stream.average_rate)]
            media = {"videos": [np.stack([f.to_ndarray(format="rgb24")
                                          for f in c.decode(stream)])]}
    return int(proc(text=[text], return_tensors="pt", **media)["input_ids"].shape[1])


@pytest.mark.parametrize("kind", ["image", "video"])
def test_openai_client_answers_with_media_token_usage(qwen3, client, kind: str) -> None:
    path, engine, pre = qwen3
    r = client.chat.completions.create(model=MODEL, messages=_messages(kind), **PARAMS,
                                       extra_body={"ignore_eos": True,
                                                   "return_token_ids": True})
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 5 and len(r.choices[0].token_ids) == 5
    assert r.usage.prompt_tokens == _transformers_prompt_len(path, kind)
    ids = r.prompt_token_ids
    assert r.usage.prompt_tokens == len(ids)
    media_id = pre.image_token_id if kind == "image" else pre.video_token_id
    prompt = pre.prepare(_messages(kind), ImageLimits(), VideoLimits())
    grid = prompt["image_grid_thw" if kind == "image" else "video_grid_thw"][0]
    assert ids.count(media_id) == int(torch.prod(grid)) // 4 > 0
    if kind == "video":  # one <|vision_start|> per temporal patch, each after its time
        assert pre.tokenizer.decode(ids).count(" seconds><|vision_start|>") == int(grid[0]) > 1
    # the answer is the engine's own greedy answer to the same prompt
    out = engine.generate([prompt], SamplingParams(ignore_eos=True, **PARAMS))[0]
    assert r.choices[0].token_ids == out.token_ids and r.choices[0].message.content == out.text


def test_bench_serve_takes_the_tiny_qwen3_vl_name() -> None:
    """`spaceserve bench serve --model tiny-qwen3-vl` is accepted (as `spaceserve serve`
    takes it) and its modelled prediction stands for Qwen3-VL-8B."""
    from spaceserve.bench.modelled import target_config
    from spaceserve.bench.serve import build_parser, check_model_args

    for name in ("tiny-qwen3-vl", "tiny-qwen3-vl-untied"):
        check_model_args(build_parser().parse_args(["--model", name]))
        config, label = target_config(name)
        assert config.model_type == "qwen3_vl" and label.startswith("Qwen3-VL-8B")
    with pytest.raises(ValueError, match="not a checkpoint directory"):
        check_model_args(build_parser().parse_args(["--model", "tiny-qwen3"]))
