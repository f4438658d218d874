"""A checkpoint's tokenizer and processor, loaded from a local directory (no hub access)."""

from __future__ import annotations

from typing import Any


def load_processor(path: str) -> tuple[Any, Any]:
    """The checkpoint's tokenizer and processor from a local directory (None when absent)."""
    from transformers import AutoProcessor, AutoTokenizer

    tokenizer = processor = None
    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
    except ImportError:
        # transformers' Qwen2-VL processor wants torchvision for its video half; images need only
        # the image processor and the tokenizer, which SpaceServe's chat preprocessor combines.
        from spaceserve.runtime.inputs.chat import ChatPreprocessor

        try:
            processor = ChatPreprocessor.from_pretrained(path)
        except (OSError, ValueError, KeyError, TypeError):
            processor = None
    except (OSError, ValueError, KeyError, TypeError):
        processor = None
    try:
        tokenizer = getattr(processor, "tokenizer", None) or AutoTokenizer.from_pretrained(
            path, local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError):
        tokenizer = None
    if processor is not None and not hasattr(processor, "image_processor"):
        processor = None  # a bare tokenizer cannot take images
    return tokenizer, processor
