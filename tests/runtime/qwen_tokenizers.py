"""Offline stand-ins for the Qwen2-VL and Qwen2.5-VL tokenizers: a small byte-level BPE with
the added tokens those checkpoints declare (the same names, and the same special / non-special
split: Qwen2.5-VL's tool and fill-in-the-middle tokens are added but not special) and chat
templates of the same shape (a default system turn, an image part written as
``<|vision_start|><|image_pad|><|vision_end|>``, a video part with ``<|video_pad|>``)."""

from __future__ import annotations

from functools import cache

QWEN2_VL_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
                    "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>",
                    "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
                    "<|image_pad|>", "<|video_pad|>")
QWEN25_VL_ADDED = ("<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
                   "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")

_TEMPLATE = (
    "{% for m in messages %}"
    "{% if loop.first and m['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}<|im_end|>\n"
    "{% else %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' or 'image' in c %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in c %}{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_CORPUS = ("You are a helpful assistant. Describe this image in detail. What is in the video? "
           "system user assistant the quick brown fox jumps over the lazy dog 0123456789 "
           "def main(): return tool call <>|/_ ") * 8


@cache
def qwen_tokenizer(flavour: str):
    """A fast tokenizer shaped like ``"qwen2-vl"``'s or ``"qwen2.5-vl"``'s."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, trainers
    from tokenizers import pre_tokenizers as pt
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    # split words, single digits, punctuation runs and whitespace, then map bytes (as Qwen2)
    split = Regex(r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"""
                  r"""| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
    tok.pre_tokenizer = pt.Sequence([pt.Split(split, behavior="isolated"),
                                     pt.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                  initial_alphabet=pt.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS], trainer)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in QWEN2_VL_SPECIAL])
    if flavour == "qwen2.5-vl":
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN25_VL_ADDED])
    elif flavour != "qwen2-vl":
        raise ValueError(flavour)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")
    fast.chat_template = _TEMPLATE
    return fast
