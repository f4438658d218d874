"""Tiny random-weight Qwen2-VL and Qwen3-VL checkpoints, built offline, for demos, tests and
benchmarks (``--model tiny``, ``--model tiny-qwen3-vl``; the Qwen2-VL one is described here).

`spaceserve serve --model tiny` and the serving benchmark run on it on a fresh machine with no
hub access: the tokenizer is a byte-level BPE trained here on a few sentences (special tokens
as Qwen2-VL names them, a chat template of the same shape), the image processor is Qwen2-VL's
own with a small pixel budget, videos are sampled with a small pixel budget too, and the weights
are random. Everything is written with
`save_pretrained` into a cache directory, once; a finished build is marked by a stamp file and
installed by an atomic rename, so concurrent builders never see half a checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spaceserve.models.qwen3_vl.processing import CHAT_TEMPLATE, processor_settings

TINY_VERSION = 2
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
# Pixel budget of the tiny image processor: 4 to 256 LLM tokens per image (28x28 px each).
MIN_PIXELS, MAX_PIXELS = 4 * 28 * 28, 256 * 28 * 28
# ... and of a video frame: 4 to 16 LLM tokens per two frames, 2 frames per second, 2 to 8 frames.
VIDEO = {"size": {"shortest_edge": 4 * 28 * 28, "longest_edge": 16 * 28 * 28}, "fps": 2.0,
         "min_frames": 2, "max_frames": 8, "patch_size": 14, "temporal_patch_size": 2,
         "merge_size": 2}
_CORPUS = (
    "A small model answers questions about pictures. The encoder looks at the image in patches "
    "and the decoder writes one word at a time. Describe this image. What is in the picture? "
    "There is a red house beside a green tree under a blue sky, and a cat sleeps on the warm "
    "stone wall. Two people walk along the river with a dog. The street is busy with cars, "
    "bicycles and a yellow bus. A plate of bread, cheese and apples stands on the wooden table. "
    "You are a helpful assistant. Please count the birds on the roof and tell me their colours. "
    "The mountains are covered with snow; the lake below reflects the clouds."
)


def cache_root() -> Path:
    """Where tiny checkpoints live: ``$SPACESERVE_CACHE`` or ``~/.cache/spaceserve``."""
    return Path(os.environ.get("SPACESERVE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "spaceserve"))


def default_dir() -> Path:
    """Where `tiny` lives (under `cache_root`)."""
    return cache_root() / f"tiny-qwen2-vl-v{TINY_VERSION}"


def _build_tokenizer(vocab_size: int):
    """The tiny byte-level BPE tokenizer (Qwen-VL special tokens, chat template)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _write(path: Path, seed: int, vocab_size: int) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2VLConfig, Qwen2VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tokenizer = _build_tokenizer(vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = Qwen2VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=4096, bos_token_id=ids["<|endoftext|>"],
                         eos_token_id=ids["<|im_end|>"], initializer_range=0.1,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=64, num_heads=4, mlp_ratio=2),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    model = Qwen2VLForConditionalGeneration(config).eval()
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=ids["<|im_end|>"], bos_token_id=ids["<|endoftext|>"]
                     ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS).save_pretrained(path)
    # transformers' Qwen2VLVideoProcessor field names (it needs torchvision to write them itself)
    (path / "video_preprocessor_config.json").write_text(json.dumps(
        {"video_processor_type": "Qwen2VLVideoProcessor", **VIDEO}, indent=2))


def build_tiny_checkpoint(path: str | os.PathLike | None = None, *, seed: int = 0,
                          vocab_size: int = 512, force: bool = False) -> Path:
    """Build (or reuse) the tiny checkpoint at `path` (default: `default_dir()`); returns it."""
    target = Path(path) if path is not None else default_dir()
    want = {"version": TINY_VERSION, "seed": seed, "vocab_size": vocab_size}
    return install_once(target, want, lambda tmp: _write(tmp, seed, vocab_size), force=force)


def install_once(target: Path, want: dict, write: Callable[[Path], None], *,
                 force: bool = False) -> Path:
    """Write a checkpoint with ``write(tmp_dir)`` and install it at `target` by an atomic
    rename, stamped with `want`; a target already stamped `want` is reused as it is."""
    stamp = target / "spaceserve_tiny.json"
    if not force and stamp.is_file():
        try:
            if json.loads(stamp.read_text()) == want:
                return target
        except (OSError, ValueError):
            pass
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        write(tmp)
        (tmp / stamp.name).write_text(json.dumps(want))
        if target.exists():
            shutil.rmtree(target, ignore_errors=True)
        try:
            os.replace(tmp, target)
        except OSError:  # another builder won the race: its checkpoint is as good as ours
            if not stamp.is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


# -- the tiny Qwen3-VL (``--model tiny-qwen3-vl``): patch 16 with temporal patch 2 and merge 2,
# a 4x4 learned position table, two DeepStack taps (vision layers 0 and 1) over a 3-layer
# decoder, GQA (4 query / 2 KV heads), an explicit head_dim (32, not hidden / heads) with
# interleaved M-RoPE, tied or untied word embeddings; transformers loads it back.
QWEN3_TINY_VERSION = 1
# Pixel budget of its image processor: 4 to 64 LLM tokens per image (32x32 px each).
QWEN3_MIN_PIXELS, QWEN3_MAX_PIXELS = 4 * 32 * 32, 64 * 32 * 32
# Patch geometry and normalisation: `qwen3_vl.processing` (the input side's, the model's).
QWEN3_VIDEO = {"size": {"shortest_edge": 4 * 32 * 32, "longest_edge": 16 * 32 * 32},
               "fps": 2.0, "min_frames": 2, "max_frames": 8, **processor_settings()}


def qwen3_tiny_config(ids: dict[str, int], vocab_size: int, *, tied: bool) -> Any:
    """The tiny Qwen3VLConfig (`ids`: the special tokens' ids)."""
    from transformers import Qwen3VLConfig

    return Qwen3VLConfig(
        text_config=dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=32, max_position_embeddings=4096,
                         bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"],
                         initializer_range=0.3, tie_word_embeddings=tied,
                         rope_parameters={"rope_type": "default", "rope_theta": 5e5,
                                          "mrope_section": [6, 5, 5],
                                          "mrope_interleaved": True}),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=64, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 1], patch_size=16,
                           temporal_patch_size=2, spatial_merge_size=2, initializer_range=0.3),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=tied)


def _write_qwen3(path: Path, seed: int, vocab_size: int, *, tied: bool = True) -> None:
    """Write the tiny checkpoint into the existing directory `path`."""
    import torch
    from transformers import GenerationConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    tokenizer = _build_tokenizer(vocab_size)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    config = qwen3_tiny_config(ids, len(tokenizer), tied=tied)
    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # the default init leaves norms at 1 and biases at 0: vary them
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    GenerationConfig(eos_token_id=ids["<|im_end|>"], bos_token_id=ids["<|endoftext|>"]
                     ).save_pretrained(path)
    tokenizer.save_pretrained(path)
    settings = processor_settings(config.vision_config)
    Qwen2VLImageProcessorPil(min_pixels=QWEN3_MIN_PIXELS, max_pixels=QWEN3_MAX_PIXELS,
                             **settings).save_pretrained(path)
    (path / "video_preprocessor_config.json").write_text(json.dumps(
        {"video_processor_type": "Qwen3VLVideoProcessor", **QWEN3_VIDEO, **settings},
        indent=2))


def qwen3_dir(tied: bool = True) -> Path:
    """Where ``tiny-qwen3-vl`` (tied) / ``tiny-qwen3-vl-untied`` live, beside ``tiny``."""
    name = "tiny-qwen3-vl" if tied else "tiny-qwen3-vl-untied"
    return cache_root() / f"{name}-v{QWEN3_TINY_VERSION}"


def build_tiny_qwen3_checkpoint(path: str | os.PathLike | None = None, *, seed: int = 0,
                                vocab_size: int = 512, tied: bool = True,
                                force: bool = False) -> Path:
    """Build (or reuse) the tiny Qwen3-VL checkpoint at `path` (default `qwen3_dir`)."""
    target = Path(path) if path is not None else qwen3_dir(tied)
    want = {"model": "qwen3_vl", "version": QWEN3_TINY_VERSION, "seed": seed,
            "vocab_size": vocab_size, "tied": tied}
    return install_once(target, want, lambda tmp: _write_qwen3(tmp, seed, vocab_size, tied=tied),
                        force=force)


# The `--model` names the tiny checkpoints are built under (`resolve_model`).
TINY_MODELS = ("tiny", "tiny-qwen3-vl", "tiny-qwen3-vl-untied")


def resolve_model(model: str) -> Path:
    """`--model` value to a checkpoint directory: ``tiny`` builds/reuses the tiny Qwen2-VL
    one, ``tiny-qwen3-vl`` (``-untied``) the tiny Qwen3-VL one."""
    if model == "tiny":
        return build_tiny_checkpoint()
    if model in ("tiny-qwen3-vl", "tiny-qwen3-vl-untied"):
        return build_tiny_qwen3_checkpoint(tied=not model.endswith("untied"))
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {model!r}: not a checkpoint directory (no config.json); "
                         "pass a local directory, 'tiny' or 'tiny-qwen3-vl'")
    return path
