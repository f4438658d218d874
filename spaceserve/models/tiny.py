"""A tiny random-weight Qwen2-VL checkpoint, built offline, for demos, tests and benchmarks.

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
from pathlib import Path

TINY_VERSION = 2
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                  "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
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


def default_dir() -> Path:
    """Where `tiny` lives: ``$SPACESERVE_CACHE`` or ``~/.cache/spaceserve``."""
    root = os.environ.get("SPACESERVE_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "spaceserve")
    return Path(root) / f"tiny-qwen2-vl-v{TINY_VERSION}"


def _build_tokenizer(vocab_size: int):
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
    stamp = target / "spaceserve_tiny.json"
    want = {"version": TINY_VERSION, "seed": seed, "vocab_size": vocab_size}
    if not force and stamp.is_file():
        try:
            if json.loads(stamp.read_text()) == want:
                return target
        except (OSError, ValueError):
            pass
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-", dir=target.parent))
    try:
        _write(tmp, seed, vocab_size)
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


def resolve_model(model: str) -> Path:
    """`--model` value to a checkpoint directory: ``tiny`` builds/reuses the tiny one."""
    if model == "tiny":
        return build_tiny_checkpoint()
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"--model {model!r}: not a checkpoint directory (no config.json); "
                         "pass a local directory or 'tiny'")
    return path
