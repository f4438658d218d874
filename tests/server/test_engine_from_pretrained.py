"""`Engine.from_pretrained` on a checkpoint with a tokenizer and an image processor: text and
image prompts go through the checkpoint's own preprocessing (no torchvision needed)."""

from __future__ import annotations

import io

from PIL import Image

from spaceserve import Engine, SamplingParams

from .conftest import png


def test_prompt_with_images_through_from_pretrained(tiny_path, preprocessor):
    engine = Engine.from_pretrained(str(tiny_path), attention_backend="torch")
    assert engine.processor is not None and engine.tokenizer is not None
    image = Image.open(io.BytesIO(png(60, 90, seed=3))).convert("RGB")
    prompt = "look <|vision_start|><|image_pad|><|vision_end|> here"
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    with_image, text_only = engine.generate(
        [{"prompt": prompt, "images": [image]}, {"prompt": "just text"}], params)
    assert with_image.error is None and text_only.error is None
    # The image's tokens are expanded from its grid: the preprocessor gives the same ids.
    expected = preprocessor(text=[prompt], images=[image], return_tensors="pt")
    assert with_image.prompt_token_ids == expected["input_ids"][0].tolist()
    assert len(with_image.prompt_token_ids) > len(engine.tokenizer(prompt)["input_ids"])
    assert len(with_image.token_ids) == 3 and len(text_only.token_ids) == 3
