"""Video inputs (spaceserve.runtime.inputs.media.video): PyAV decoding of real containers, frame
sampling and frame sizes as transformers' Qwen2-VL video processor, limits checked before
decoding, refusals with their kinds, content hashes, and chat messages with videos and images
becoming one engine prompt in prompt order."""

from __future__ import annotations

import base64
import io
import sys

import numpy as np
import pytest

from spaceserve.runtime.inputs import (
    ChatPreprocessor,
    ImageLimits,
    InputError,
    VideoLimits,
    VideoSampling,
    decode_video,
    load_video,
    load_video_url,
)
from tests.clips import encode_clip, flat_frames

pytest.importorskip("av")

SMALL = VideoSampling(min_frames=2, max_frames=8, min_pixels=4 * 784, max_pixels=16 * 784)


def which(frames: np.ndarray) -> list[int]:
    """Source frame index of each decoded flat frame (its grey level is 10 + 20 i)."""
    return [round((float(f.mean()) - 10) / 20) for f in frames]


def fails(kind: str, fn, *args, **kw) -> InputError:
    with pytest.raises(InputError) as info:
        fn(*args, **kw)
    assert info.value.kind == kind, (info.value.kind, str(info.value))
    return info.value


@pytest.mark.parametrize("fmt, codec", [("mp4", "mpeg4"), ("webm", "libvpx"),
                                        ("matroska", "ffv1"), ("avi", "mpeg4")])
def test_containers_decode_to_sampled_frames(fmt, codec) -> None:
    """12 frames at 4 fps = 3 s: 2 frames per second keeps 6, uniformly; webm and mkv hold no
    frame count in their header (packets are counted)."""
    raw = encode_clip(flat_frames(12, 60, 90), fps=4, fmt=fmt, codec=codec)
    v = decode_video(raw, VideoLimits(), SMALL, "v")
    assert v.indices == (0, 2, 4, 6, 8, 10) and which(v.frames) == list(v.indices)
    assert v.frames.shape == (6, 56, 84, 3) and v.frames.dtype == np.uint8
    assert (v.total_frames, v.source_fps) == (12, 4.0)
    assert v.second_per_grid_ts == pytest.approx(1.0)  # 2 frames per patch, 2 frames a second


def test_sampling_as_transformers() -> None:
    s = VideoSampling()
    assert s.sample(30, 10.0) == [0, 5, 10, 15, 20, 25]  # 3 s at 2 fps
    assert s.sample(6, 30.0) == [0, 1, 3, 4]  # min_frames=4 (transformers: arange(0, 6, 1.5))
    assert len(s.sample(100_000, 1.0)) == 768  # max_frames
    assert s.sample(3, 1.0) == [0, 1]  # an even count
    assert s.sample(1, 25.0) == [0]  # shorter than one temporal patch: the frame is repeated
    assert len(s.sample(9, 1.0)) % 2 == 0


@pytest.mark.parametrize("hw", [(60, 90), (1080, 1920), (30, 3000), (2000, 50)])
def test_frame_size_is_smart_resize_under_the_token_budget(hw) -> None:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    s = VideoSampling()
    assert s.frame_size(*hw, 8) == smart_resize(*hw, factor=28, min_pixels=s.min_pixels,
                                                max_pixels=s.max_pixels)
    # 768 frames: each gets an even share of 128000 tokens' pixels (transformers'
    # cap_pixels_per_frame, qwen-vl-utils' total budget)
    share = max(min(s.max_pixels, int(128000 * 784 * 0.9) * 2 // 768), int(s.min_pixels * 1.05))
    assert s.frame_size(*hw, 768) == smart_resize(*hw, factor=28, min_pixels=s.min_pixels,
                                                  max_pixels=share)


def test_limits_are_checked_before_decoding(tmp_path) -> None:
    raw = encode_clip(flat_frames(12, 60, 90), fmt="mp4")
    webm = encode_clip(flat_frames(12, 60, 90), fmt="webm", codec="libvpx")
    url = "data:video/mp4;base64," + base64.b64encode(raw).decode()
    limits = ImageLimits(allowed_local_dir=str(tmp_path))
    err = fails("too_large", load_video_url, url, limits, VideoLimits(max_video_bytes=len(raw) - 1),
                SMALL, "m[0].video_url")
    assert err.param == "m[0].video_url" and "video larger than" in str(err)
    err = fails("too_large", decode_video, raw, VideoLimits(max_video_pixels=60 * 90 - 1), SMALL)
    assert "90x60 pixels" in str(err)
    for clip in (raw, webm):  # from the header, and by counting packets
        err = fails("too_large", decode_video, clip, VideoLimits(max_video_frames=11), SMALL)
        assert "more than 11 frames" in str(err)
    assert decode_video(webm, VideoLimits(max_video_frames=12), SMALL).total_frames == 12
    (tmp_path / "a.mp4").write_bytes(raw)
    v = load_video_url(f"file://{tmp_path}/a.mp4", limits, VideoLimits(), SMALL)
    assert v.indices == (0, 2, 4, 6, 8, 10)
    fails("not_allowed", load_video_url, f"file://{tmp_path}/a.mp4", ImageLimits(),
          VideoLimits(), SMALL)
    fails("not_allowed", load_video_url, "https://example.com/a.mp4", limits, VideoLimits(),
          SMALL)


def test_what_is_not_a_video_is_refused() -> None:
    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (8, 8)).save(png, format="PNG")
    for raw in (b"\x00" * 1000, png.getvalue(), b""):
        err = fails("bad_video", decode_video, raw, VideoLimits(), SMALL, "m[0]")
        assert str(err).startswith("m[0]: cannot open video") and err.param == "m[0]"
    url = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    fails("unsupported", load_video_url, url, ImageLimits(), VideoLimits(), SMALL)
    clip = bytearray(encode_clip(flat_frames(12, 60, 90)))  # damaged inside: fails cleanly
    third = len(clip) // 3
    clip[third:third + 200] = np.random.default_rng(0).integers(0, 255, 200, np.uint8).tobytes()
    fails("bad_video", decode_video, bytes(clip), VideoLimits(), SMALL)
    # an HLS playlist naming a local file: no nested opens, no playlist demuxer
    playlist = b"#EXTM3U\n#EXTINF:1.0,\nfile:///etc/hostname\n#EXT-X-ENDLIST\n"
    fails("bad_video", decode_video, playlist, VideoLimits(), SMALL)


def test_one_frame_and_frames_given_as_arrays() -> None:
    one = decode_video(encode_clip(flat_frames(1, 56, 56), fps=25), VideoLimits(), SMALL)
    assert one.indices == (0,) and one.frames.shape[0] == 1
    arr = load_video(flat_frames(4, 30, 40), 0, SMALL)
    assert arr.frames.shape[:1] == (4,) and arr.frames.shape[1] % 28 == 0
    assert arr.second_per_grid_ts == 1.0
    fails("bad_video", load_video, np.zeros((2, 3, 4), np.uint8), 1, SMALL)
    fails("not_found", load_video, "/no/such/clip.mp4", 2, SMALL)


def test_without_pyav_videos_are_refused_clearly(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "av", None)
    err = fails("unsupported", decode_video, b"x", VideoLimits(), SMALL, "m[0]")
    assert "spaceserve[video]" in str(err)


def test_content_hashes_are_stable_and_discriminating() -> None:
    a = encode_clip(flat_frames(12, 60, 90))
    b = encode_clip(flat_frames(12, 60, 90, base=12))
    h = decode_video(a, VideoLimits(), SMALL).content_hash
    assert len(h) == 32 and h == decode_video(a, VideoLimits(), SMALL).content_hash
    assert h != decode_video(b, VideoLimits(), SMALL).content_hash
    other = VideoSampling(min_frames=2, max_frames=8, min_pixels=4 * 784, max_pixels=20 * 784)
    assert h != decode_video(a, VideoLimits(), other).content_hash  # settings count


@pytest.fixture(scope="module")
def tiny_pre(tmp_path_factory):
    from spaceserve.models.tiny import build_tiny_checkpoint

    return ChatPreprocessor.from_pretrained(build_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny") / "ckpt"))


def _png(h: int, w: int) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(
        buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_chat_with_a_video_and_an_image_is_one_prompt(tiny_pre) -> None:
    import torch

    from spaceserve.runtime.inputs import process_prompt
    from spaceserve.runtime.worker.model_info import ModelInfo

    pre = tiny_pre
    clip = "data:video/mp4;base64," + base64.b64encode(encode_clip(flat_frames(12, 60, 90))
                                                       ).decode()
    msgs = [{"role": "user", "content": [
        {"type": "video_url", "video_url": {"url": clip}},
        {"type": "text", "text": "and"},
        {"type": "image_url", "image_url": {"url": _png(56, 56)}}]}]
    p = pre.prepare(msgs, ImageLimits(), VideoLimits())
    ids = p["prompt_token_ids"]
    # 6 frames of 56x84: 3 temporal patches of 4x6 patches = 18 tokens; the image 2x2 = 4
    assert p["video_grid_thw"].tolist() == [[3, 4, 6]] and ids.count(pre.video_token_id) == 18
    assert p["image_grid_thw"].tolist() == [[1, 4, 4]] and ids.count(pre.image_token_id) == 4
    assert p["second_per_grid_ts"].tolist() == [1.0]
    assert [len(p["mm_hashes"][k]) for k in ("image", "video")] == [1, 1]
    info = ModelInfo(len(pre.tokenizer), 4096, image_token_id=pre.image_token_id,
                     video_token_id=pre.video_token_id, patch_dim=1176)
    got, mm = process_prompt(p, info, context_len=4096, capacity=4096, max_images=4)
    assert got == ids and mm.video_items == (0,) and (mm.num_images, mm.num_videos) == (1, 1)
    assert mm.image_grid_thw.tolist() == [[3, 4, 6], [1, 4, 4]]  # prompt order
    assert torch.equal(mm.pixel_values, torch.cat([p["pixel_values_videos"],
                                                   p["pixel_values"]]))
    media = np.flatnonzero(np.isin(ids, [pre.image_token_id, pre.video_token_id]))
    assert np.array_equal(mm.positions, media)
    assert mm.content_hashes == (p["mm_hashes"]["video"][0], p["mm_hashes"]["image"][0])
    assert mm.second_per_grid_ts == (1.0,)
    # the same request again: the same hashes (an encoder cache's key)
    again = pre.prepare(msgs, ImageLimits(), VideoLimits())
    assert again["mm_hashes"] == p["mm_hashes"]
    # without given hashes they come from the patches, one per item
    del p["mm_hashes"]
    _, mm2 = process_prompt(p, info, context_len=4096, capacity=4096, max_images=4)
    assert len(set(mm2.content_hashes)) == 2


def test_chat_video_refusals(tiny_pre) -> None:
    clip = "data:video/mp4;base64," + base64.b64encode(encode_clip(flat_frames(4, 28, 28))
                                                       ).decode()
    two = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": clip}}] * 2}]
    err = fails("too_large", tiny_pre.prepare, two, ImageLimits(),
                VideoLimits(max_videos_per_request=1))
    assert str(err) == "messages: 2 videos; at most 1 per request"
    no_video = ChatPreprocessor(tiny_pre.tokenizer, tiny_pre.image_processor)  # no sampling
    err = fails("unsupported", no_video.prepare, two, ImageLimits())
    assert str(err) == "this model does not take videos"
    bad = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/"
                                                                           "mp4;base64,AAAA"}}]}]
    err = fails("bad_video", tiny_pre.prepare, bad, ImageLimits())
    assert err.param == "messages[0].content[0].video_url"


def test_video_frames_count_against_pixel_budgets_before_decoding(tiny_pre) -> None:
    """A video's sampled frames count against the request's pixel budget from its header
    (each frame as large as its source, 60x90 here, above its resized 56x84), its decoding
    work counts every frame up to the last one kept, and decoding checks the deadline."""
    import time

    from spaceserve.runtime.inputs import DeadlineExceeded
    from spaceserve.runtime.inputs.media.video import OpenedVideo

    clip = "data:video/mp4;base64," + base64.b64encode(encode_clip(flat_frames(12, 60, 90))
                                                       ).decode()
    msgs = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": clip}},
                                         {"type": "image_url", "image_url": {"url": _png(28,
                                                                                         28)}}]}]
    plan = tiny_pre.plan(msgs, ImageLimits(), VideoLimits())
    assert isinstance(plan.items[0], OpenedVideo)  # the header only: nothing decoded
    assert plan.pixels == 6 * 60 * 90 + 28 * 28 and plan.work == 12 * 60 * 90 - 60 * 90 + 784
    err = fails("over_budget", tiny_pre.plan, msgs, ImageLimits(max_request_pixels=plan.pixels
                                                                - 1), VideoLimits())
    assert str(err) == (f"messages: the images and video frames decode to {plan.pixels} "
                        f"pixels; at most {plan.pixels - 1} per request")
    with pytest.raises(DeadlineExceeded):
        tiny_pre.finish(plan, deadline=time.monotonic() - 1)
    prompt = tiny_pre.finish(tiny_pre.plan(msgs, ImageLimits(max_request_pixels=plan.pixels),
                                           VideoLimits()), deadline=time.monotonic() + 60)
    assert prompt["video_grid_thw"].tolist() == [[3, 4, 6]]


def test_process_prompt_checks_video_fields() -> None:
    import torch

    from spaceserve.runtime.inputs import process_prompt
    from spaceserve.runtime.worker.model_info import ModelInfo

    info = ModelInfo(100, 512, image_token_id=5, video_token_id=6, patch_dim=4)
    ids = [1, 6, 6, 2]
    grid = torch.tensor([[2, 2, 2]])  # 8 patches, 2 tokens
    ok = {"prompt_token_ids": ids, "pixel_values_videos": torch.zeros(8, 4),
          "video_grid_thw": grid}
    _, mm = process_prompt(ok, info, context_len=512, capacity=512, max_images=1)
    assert mm.video_items == (0,) and mm.second_per_grid_ts == (1.0,)
    kw = dict(context_len=512, capacity=512, max_images=1)
    for change, match in [
        ({"pixel_values_videos": None, "video_grid_thw": None}, "video tokens but no"),
        ({"pixel_values_videos": None}, "pixel_values_videos is missing"),
        ({"video_grid_thw": torch.tensor([[1, 2, 2]])}, "patch rows"),
        ({"second_per_grid_ts": [1.0, 2.0]}, "second_per_grid_ts"),
        ({"mm_hashes": {"video": []}}, "mm_hashes"),
        ({"prompt_token_ids": [1, 6, 2]}, "video tokens"),
    ]:
        with pytest.raises(ValueError, match=match):
            process_prompt({**ok, **change}, info, **kw)
    no_video = ModelInfo(100, 512, image_token_id=5, patch_dim=4)
    with pytest.raises(ValueError, match="takes no videos"):
        process_prompt(ok, no_video, **kw)


def animated_gif(n: int = 6, w: int = 56, h: int = 56) -> bytes:
    """An animated GIF of `n` flat frames at 10 fps (grey levels as `flat_frames`)."""
    from PIL import Image

    frames = [Image.new("RGB", (w, h), (10 + 20 * i,) * 3) for i in range(n)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:], duration=100,
                   loop=0)
    return buf.getvalue()


@pytest.mark.parametrize("mime", ["image/gif", "video/gif"])
def test_an_animated_gif_is_a_video_under_its_gif_types(mime) -> None:
    """The accepted containers include gif: its own media types must be accepted too."""
    raw = animated_gif()
    url = f"data:{mime};base64," + base64.b64encode(raw).decode()
    v = load_video_url(url, ImageLimits(), VideoLimits(), SMALL, "m[0].video_url")
    assert v.total_frames == 6 and v.num_frames >= 2
    # a GIF that says it is an mp4 is still refused, and an mp4 that says it is a GIF
    err = fails("bad_video", load_video_url, url.replace(mime, "video/mp4"), ImageLimits(),
                VideoLimits(), SMALL, "m[0].video_url")
    assert "says video/mp4 but the data is gif" in str(err)
    mp4 = encode_clip(flat_frames(4, 28, 28), fmt="mp4")
    err = fails("bad_video", load_video_url, f"data:{mime};base64,"
                + base64.b64encode(mp4).decode(), ImageLimits(), VideoLimits(), SMALL, "m")
    assert f"says {mime} but the data is mp4/mov" in str(err)
