"""A checkpoint's tokenizer and processor, loaded from a local directory (no hub access):
transformers' processor where it loads, SpaceServe's `ChatPreprocessor` otherwise and for the
families in `OWN_PROCESSOR`."""

from __future__ import annotations

from typing import Any

from spaceserve.runtime.inputs.family import ProcessorMismatch, model_family

# Families whose prompts SpaceServe builds itself (`ChatPreprocessor`): Qwen3-VL's video path in
# transformers needs torchvision, and its timestamps need the sampled frames' source times.
OWN_PROCESSOR = ("qwen3_vl",)


def _own(path: str) -> Any:
    from spaceserve.runtime.inputs.chat import ChatPreprocessor

    try:
        return ChatPreprocessor.from_pretrained(path)
    except ProcessorMismatch:
        raise  # processor files that contradict the model: not a missing processor
    except (OSError, ValueError, KeyError, TypeError):
        return None


def load_processor(path: str) -> tuple[Any, Any]:
    """The checkpoint's tokenizer and processor from a local directory (None when absent);
    `family.ProcessorMismatch` when its processor files contradict its ``config.json``."""
    from transformers import AutoProcessor, AutoTokenizer

    tokenizer = processor = None
    if model_family(path) in OWN_PROCESSOR:
        processor = _own(path)
    else:
        try:
            processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        except ImportError:
            # transformers' Qwen2-VL processor wants torchvision for its video half; images
            # need only the image processor and the tokenizer, which SpaceServe's chat
            # preprocessor combines.
            processor = _own(path)
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
