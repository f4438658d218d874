"""Qwen3-VL inputs (runtime/inputs/family.py, media/frames_qwen3.py): the family read from
config.json, video sampling, frame sizes and timestamps as transformers' Qwen3-VL video processor
and processor compute them, and whole prompts (token ids, pixel values, grids) equal to
transformers' ``Qwen3VLProcessor``'s for an image, two images of different sizes and a video.

transformers' video processor resizes and converts frames with torchvision, which this
environment lacks; the reference (`tests.models.qwen3_ref.HFVideos`) runs transformers' own
sampling (``sample_frames``), size rule (``smart_resize``), patch order (``patchify``) and
normalisation (its fused form), timestamps and prompt expansion (``Qwen3VLProcessor``), with
the one resize done by PIL, as SpaceServe does it.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from spaceserve.runtime.inputs import ChatPreprocessor, ImageLimits, VideoLimits, load_processor
from spaceserve.runtime.inputs.family import model_family, sampling_class
from spaceserve.runtime.inputs.media.frames import VideoSampling
from spaceserve.runtime.inputs.media.frames_qwen3 import Qwen3VideoSampling
from tests.clips import encode_clip
from tests.models.qwen3_ref import VIDEO_WRAPPER, HFVideos

pytest.importorskip("av")

SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>",
           "<|image_pad|>", "<|video_pad|>")
IMAGE_SIZE = {"shortest_edge": 4 * 32 * 32, "longest_edge": 64 * 32 * 32}
VIDEO = {"size": {"shortest_edge": 2 * 32 * 32, "longest_edge": 24 * 32 * 32}, "fps": 2,
         "min_frames": 2, "max_frames": 8, "patch_size": 16, "temporal_patch_size": 2,
         "merge_size": 2, "image_mean": [0.5] * 3, "image_std": [0.5] * 3,
         "video_processor_type": "Qwen3VLVideoProcessor"}


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=list(SPECIAL),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    corpus = "Describe the picture. What happens at 1.5 seconds? <0.5 seconds> the video shows"
    tok.train_from_iterator([corpus] * 8, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A Qwen3-VL processor directory: tokenizer (no chat template of its own), Qwen2-VL's
    image processor with 16-px patches, Qwen3-VL's video settings, config.json's model_type."""
    from transformers import Qwen2VLImageProcessorPil

    root = tmp_path_factory.mktemp("qwen3") / "ckpt"
    _tokenizer().save_pretrained(root)
    Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2,
                             image_mean=[0.5] * 3, image_std=[0.5] * 3,
                             size=IMAGE_SIZE).save_pretrained(root)
    (root / "video_preprocessor_config.json").write_text(json.dumps(VIDEO))
    (root / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    return root


def _video_processor():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    return Qwen3VLVideoProcessor(**{k: v for k, v in VIDEO.items()
                                    if k != "video_processor_type"})


def _reference(tokenizer, image_processor):
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    class Reference(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, *args, **kwargs):  # our stand-in video part
            return None

    return Reference(image_processor=image_processor, tokenizer=tokenizer,
                     video_processor=HFVideos(VIDEO))


def _decoded(raw: bytes) -> tuple[np.ndarray, float]:
    import av

    with av.open(__import__("io").BytesIO(raw)) as c:
        stream = c.streams.video[0]
        fps = float(stream.average_rate)
        return np.stack([f.to_ndarray(format="rgb24") for f in c.decode(stream)]), fps


def _image(h: int, w: int, seed: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


def _clip(n: int, h: int, w: int) -> bytes:
    rng = np.random.default_rng(n)
    base = rng.integers(0, 255, (1, h, w, 3)).astype(np.int64)
    frames = ((base + 23 * np.arange(n)[:, None, None, None]) % 256).astype(np.uint8)
    return encode_clip(frames, fps=4, fmt="matroska", codec="ffv1")


def test_family_from_config_json(qwen3_dir, tmp_path) -> None:
    assert model_family(qwen3_dir) == "qwen3_vl" and model_family(tmp_path) is None
    assert sampling_class("qwen3_vl") is Qwen3VideoSampling
    assert sampling_class("qwen2_5_vl") is VideoSampling and sampling_class(None) is VideoSampling
    pre = ChatPreprocessor.from_pretrained(qwen3_dir)
    s = pre.video_sampling
    assert isinstance(s, Qwen3VideoSampling)
    assert (s.patch_size, s.min_pixels, s.max_pixels, s.image_mean) == (16, 2048, 24576, (.5,) * 3)
    assert pre.tokenizer.chat_template  # the family's template: the tokenizer has none
    tok, proc = load_processor(str(qwen3_dir))
    assert isinstance(proc, ChatPreprocessor) and tok is proc.tokenizer
    from spaceserve.server.engine_client import cap_video_tokens

    cap_video_tokens(pre, 16)  # the server's cap at its context: the clip's pixels shrink
    assert pre.video_sampling.max_pixels == max(16 * 32 * 32, s.min_pixels) < s.max_pixels


@pytest.mark.parametrize("total, fps", [(13, 4.0), (11, 4.0), (3, 30.0), (300, 24.0),
                                        (5000, 25.0), (7, 1.0)])
def test_sampling_as_transformers(total: int, fps: float) -> None:
    from transformers.video_utils import VideoMetadata

    vp = _video_processor()
    ours = Qwen3VideoSampling(**{k: v for k, v in VIDEO.items() if k in ("fps", "min_frames",
                                                                      "max_frames")})
    md = VideoMetadata(total_num_frames=total, fps=fps)
    assert ours.sample(total, fps) == vp.sample_frames(md).tolist()


@pytest.mark.parametrize("frames, h, w", [(6, 70, 90), (8, 1080, 1920), (2, 20, 300),
                                          (768, 480, 640), (3, 33, 33)])
@pytest.mark.parametrize("cap", [False, True])
def test_frame_size_as_transformers(frames: int, h: int, w: int, cap: bool) -> None:
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    vp = Qwen3VLVideoProcessor(cap_pixels_per_frame=cap)
    s = Qwen3VideoSampling(cap_pixels_per_frame=cap)  # both with transformers' defaults
    gh, gw = (x // 16 for x in s.frame_size(h, w, frames))
    assert gh * gw * -(-frames // 2) == vp.get_num_of_video_patches(frames, h, w)


def test_timestamps_as_transformers() -> None:
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor

    s = Qwen3VideoSampling()
    for idx, fps in (([0, 2, 5, 7, 10, 12], 4.0), ([0, 3, 6], 2.5), ([4], 30.0)):
        assert s.timestamps(idx, fps) == Qwen3VLProcessor._calculate_timestamps(
            None, list(idx), fps, 2)
    assert VideoSampling().timestamps([0, 1], 2.0) is None  # Qwen2-VL: untimed


def _compare(ours: dict, ref) -> None:
    assert ours["prompt_token_ids"] == ref["input_ids"][0].tolist()
    for pv, grid in (("pixel_values", "image_grid_thw"),
                     ("pixel_values_videos", "video_grid_thw")):
        assert (pv in ours) == (pv in ref)
        if pv in ref:
            assert torch.equal(ours[grid], ref[grid])
            torch.testing.assert_close(ours[pv], ref[pv], rtol=0, atol=1e-5)


@pytest.mark.parametrize("case", ["one image", "two images", "video", "video and image"])
def test_prompts_equal_transformers_processor(qwen3_dir, case: str) -> None:
    import base64

    pre = ChatPreprocessor.from_pretrained(qwen3_dir)
    ref = _reference(pre.tokenizer, pre.image_processor)
    images = {"one image": [_image(100, 70, 0)], "two images": [_image(64, 200, 1),
                                                                _image(150, 90, 2)],
              "video": [], "video and image": [_image(40, 40, 3)]}[case]
    clips = [_clip(11, 70, 90)] if "video" in case else []
    content = [{"type": "video_url", "video_url": {"url": "data:video/x-matroska;base64,"
                                                   + base64.b64encode(c).decode()}}
               for c in clips]
    for img in images:
        import io

        buf = io.BytesIO()
        img.save(buf, format="PNG")
        content.append({"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}})
    content.append({"type": "text", "text": "Describe the picture."})
    msgs = [{"role": "user", "content": content}]
    ours = pre.prepare(msgs, ImageLimits(), VideoLimits())
    text, _ = pre.render(msgs)
    decoded = [_decoded(c) for c in clips]
    ref.video_processor.source_fps = [fps for _, fps in decoded]
    kw = {"videos": [frames for frames, _ in decoded]} if clips else {}
    text = text.replace(VIDEO_WRAPPER, "<|video_pad|>")  # as transformers >= 5.25 and we do
    got = ref(text=[text], images=images or None, return_tensors="pt", **kw)
    _compare(ours, got)
    if clips:  # 5 frames kept of 11: 3 temporal patches, each timed and wrapped on its own
        grid = ours["video_grid_thw"].tolist()[0]
        assert grid[0] == 3
        decoded = pre.tokenizer.decode(ours["prompt_token_ids"])
        assert decoded.count("<|vision_start|>") == 3 + len(images)  # no pair around all
        assert decoded.count(" seconds><|vision_start|>") == 3
    assert ours["prompt_token_ids"].count(pre.image_token_id) == \
        sum(int(g.prod()) // 4 for g in ours.get("image_grid_thw", torch.zeros(0, 3)))


def test_a_timed_video_is_one_engine_item(qwen3_dir) -> None:
    """process_prompt takes the split video: its tokens in three runs, one item, one grid."""
    from spaceserve.runtime.inputs import process_prompt
    from spaceserve.runtime.worker.model_info import ModelInfo

    pre = ChatPreprocessor.from_pretrained(qwen3_dir)
    frames = np.random.default_rng(0).integers(0, 255, (6, 64, 64, 3), dtype=np.uint8)
    enc = pre(text=["<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>hi"],
              videos=[frames])
    info = ModelInfo(len(pre.tokenizer), 4096, image_token_id=pre.image_token_id,
                     video_token_id=pre.video_token_id, patch_dim=3 * 2 * 16 * 16)
    ids, mm = process_prompt({"prompt_token_ids": enc["input_ids"][0].tolist(),
                              **{k: v for k, v in enc.items() if k != "input_ids"}},
                             info, context_len=4096, capacity=4096, max_images=4)
    assert mm.video_items == (0,) and mm.image_grid_thw.tolist() == [[3, 4, 4]]
    runs = np.split(mm.positions, np.flatnonzero(np.diff(mm.positions) > 1) + 1)
    assert [len(r) for r in runs] == [4, 4, 4]
    assert ids[runs[0][0] - 1] == pre.vision_start_id and ids[runs[0][-1] + 1] == \
        pre.vision_end_id


def _tokens(s: Qwen3VideoSampling, h: int, w: int, frames: int) -> int:
    gh, gw = (x // 32 for x in s.frame_size(h, w, frames))
    return gh * gw


@pytest.mark.parametrize("frames, h, w", [(8, 1080, 1920), (7, 480, 640), (768, 720, 1280)])
def test_a_video_fits_the_context(frames: int, h: int, w: int) -> None:
    """`within_tokens` (the server's cap at its context length) bounds one video's tokens; with
    ``cap_pixels_per_frame`` its per-frame floor (1.05 x min_pixels, qwen-vl-utils' rule) wins
    for a long clip, whose prompt the context check then refuses."""
    for cap in (False, True) if frames <= 8 else (False,):
        s = Qwen3VideoSampling(max_pixels=32 * 32 * 768 * 64, cap_pixels_per_frame=cap)
        for context in (1024, 4096, 32768):
            gh, gw = (x // 32 for x in s.within_tokens(context).frame_size(h, w, frames))
            assert -(-frames // 2) * gh * gw <= context
    big = Qwen3VideoSampling(max_pixels=32 * 32 * 768 * 64)
    assert 384 * _tokens(big, 720, 1280, 768) > 1024 >= 384 * _tokens(big.within_tokens(1024),
                                                                    720, 1280, 768)
    assert VideoSampling().within_tokens(1000).max_video_tokens == 1000


def test_missing_processor_fields_are_qwen3s_and_a_wrong_patch_is_refused(qwen3_dir,
                                                                         tmp_path) -> None:
    """A Qwen3-VL ``preprocessor_config.json`` without patch geometry or normalisation gets
    Qwen3-VL's (not the Qwen2-VL processor's 14-px patches and CLIP mean); a processor whose
    patch size is not config.json's vision_config's is refused by name."""
    import shutil

    from spaceserve.runtime.inputs.prompt_encoder import PromptEncoder

    root = tmp_path / "ckpt"
    shutil.copytree(qwen3_dir, root)
    cfg = json.loads((root / "preprocessor_config.json").read_text())
    for key in ("patch_size", "merge_size", "image_mean", "image_std"):
        cfg.pop(key)
    (root / "preprocessor_config.json").write_text(json.dumps(cfg))
    (root / "video_preprocessor_config.json").write_text(json.dumps({"fps": 2}))
    (root / "config.json").write_text(json.dumps({"model_type": "qwen3_vl", "vision_config": {
        "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2}}))
    enc = PromptEncoder.from_pretrained(root)
    for proc in (enc.image_processor, enc.video_sampling):
        assert (proc.patch_size, proc.merge_size) == (16, 2)
        assert list(proc.image_mean) == list(proc.image_std) == [0.5] * 3
    shutil.copy(qwen3_dir / "preprocessor_config.json", root)  # it says patch_size 16
    (root / "config.json").write_text(json.dumps({"model_type": "qwen3_vl", "vision_config": {
        "patch_size": 14}}))
    for load in (PromptEncoder.from_pretrained, load_processor):  # the server's, the engine's
        with pytest.raises(ValueError, match="patch_size=16, but config.json's vision_config "
                                             "has patch_size=14"):
            load(str(root))
