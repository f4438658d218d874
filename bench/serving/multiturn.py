"""Multi-turn image chat through the real engine, caches on and off (CPU figures on the tiny
model unless --model names a checkpoint).

Conversations of --turns turns run one after another: the first turn brings an image, every
turn resends the whole conversation (system prompt, earlier questions, images and answers) with
a new question, as a chat client does. Per turn index it reports the mean TTFT, the prompt
tokens, the tokens the prefix cache held, and the encoder jobs and prefill tokens the turn cost
(from `Engine.counters()`), with both caches on (the default) and both off.

    PYTHONPATH=. python -m bench.serving.multiturn [--conversations 4] [--turns 4]
"""

from __future__ import annotations

import argparse
import io
import statistics

import numpy as np
import torch

from spaceserve.runtime.core.request import SamplingParams


def _image(seed: int, h: int, w: int):
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


def _data_url(img) -> str:
    import base64

    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


QUESTIONS = ("Describe this image.", "What colours do you see?", "Count the people in it.",
             "Is it day or night?", "What is in the background?", "Summarise our talk.")


def run(model: str, caching: bool, conversations: int, turns: int, max_tokens: int,
        size: tuple[int, int]) -> list[dict[str, float]]:
    """Per turn index: mean TTFT (ms), prompt, cached and prefilled tokens, encoder jobs."""
    from spaceserve.models.tiny import resolve_model
    from spaceserve.runtime.inputs import ImageLimits
    from spaceserve.server.engine_client import load_engine

    extra = {} if caching else {"encoder_cache_bytes": 0, "enable_prefix_caching": False}
    engine, pre, _ = load_engine(resolve_model(model), device="cpu", **extra)
    limits = ImageLimits(max_image_bytes=1 << 24, max_image_pixels=1 << 24,
                         max_images_per_request=8)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    rows: list[list[dict[str, float]]] = [[] for _ in range(turns)]
    try:
        for c in range(-1, conversations):  # conversation -1 warms the engine up, uncounted
            url = _data_url(_image(c + 1000 * (c < 0), *size))
            messages = [{"role": "system", "content": "You are a helpful assistant."}]
            for t in range(turns):
                content = [{"type": "text", "text": QUESTIONS[t % len(QUESTIONS)]}]
                if t == 0:
                    content.insert(0, {"type": "image_url", "image_url": {"url": url}})
                messages.append({"role": "user", "content": content})
                prompt = pre.prepare(messages, limits)
                before = engine.counters()
                (out,) = engine.generate([prompt], params)
                after = engine.counters()
                m = out.metrics
                row = {"ttft_ms": 1e3 * (m.first_token_time - m.arrival_time),
                       "prompt": len(out.prompt_token_ids), "cached": m.num_cached_tokens,
                       "prefilled": after["prefill_tokens"] - before["prefill_tokens"],
                       "encoder_jobs": after["encoder_jobs"] - before["encoder_jobs"]}
                if c >= 0:
                    rows[t].append(row)
                messages.append({"role": "assistant", "content": out.text or ""})
    finally:
        engine.close()
    return [{k: statistics.mean(r[k] for r in per) for k in per[0]} for per in rows]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--conversations", type=int, default=4)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--image", default="448x448", help="HxW of every conversation's image")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    h, w = (int(x) for x in args.image.split("x"))
    print(f"{args.model} on CPU, {args.conversations} conversations x {args.turns} turns, "
          f"{args.image} image in turn 1, {args.max_tokens} tokens per answer (greedy)")
    print(f"{'caches':>6} {'turn':>4} {'TTFT ms':>8} {'prompt':>7} {'cached':>7} "
          f"{'prefilled':>9} {'enc jobs':>8}")
    for caching in (False, True):
        for t, r in enumerate(run(args.model, caching, args.conversations, args.turns,
                                  args.max_tokens, (h, w))):
            print(f"{'on' if caching else 'off':>6} {t + 1:>4} {r['ttft_ms']:>8.1f} "
                  f"{r['prompt']:>7.0f} {r['cached']:>7.0f} {r['prefilled']:>9.0f} "
                  f"{r['encoder_jobs']:>8.2f}")


if __name__ == "__main__":
    main()
