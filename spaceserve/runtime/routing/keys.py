"""What a router keys on: content hashes of a prompt's images and chained hashes of its blocks.

An image's hash covers its decoded, preprocessed pixels and its patch grid (the processor's
settings show in both), so the same picture sent twice, under any URL or encoding that decodes to
the same pixels, hashes the same. A prompt block's hash covers its parent block's hash, its
token ids and the hashes of the images whose tokens it holds (image tokens are one placeholder
id, so the ids alone cannot tell two pictures apart): two prompts share their first k block
hashes exactly when they share their first k blocks, images included, as a prefix cache sees it.

When the input module gave the prompt its ``mm_hashes`` (the chat preprocessor always does),
an image's key is that hash - the very key the replica's encoder output cache files the image's
embeddings under - so "this replica has seen the picture" means "its encoder cache may hold
it"; `image_hashes` (a hash of the patches) is the fallback for prompts without them.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from spaceserve.runtime.core.mm_hash import as_numpy, image_hashes
from spaceserve.runtime.routing.router import RouteRequest


def image_spans(token_ids: Sequence[int], image_token_id: int | None,
                image_tokens: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) prompt positions of each image's tokens (image i takes the next
    `image_tokens[i]` image-token positions)."""
    if image_token_id is None or not image_tokens:
        return []
    positions = [i for i, t in enumerate(token_ids) if t == image_token_id]
    if len(positions) != sum(image_tokens):
        raise ValueError(f"{len(positions)} image tokens in the prompt for images of "
                         f"{sum(image_tokens)} tokens")
    spans, k = [], 0
    for n in image_tokens:
        spans.append((positions[k], positions[k + n - 1] + 1) if n else (0, 0))
        k += n
    return spans


def prefix_block_hashes(token_ids: Sequence[int], block_tokens: int,
                        spans: Sequence[tuple[int, int]] = (),
                        hashes: Sequence[str] = ()) -> tuple[int, ...]:
    """Chained 64-bit hashes of the prompt's full blocks of `block_tokens` tokens; an image
    (`spans[i]`, `hashes[i]`) mixes its hash into every block holding some of its tokens."""
    if block_tokens < 1:
        raise ValueError(f"block_tokens={block_tokens} must be >= 1")
    ids = array("q", token_ids)
    out: list[int] = []
    parent = b""
    for s in range(0, len(ids) - block_tokens + 1, block_tokens):
        e = s + block_tokens
        digest = hashlib.blake2b(parent, digest_size=8)
        digest.update(memoryview(ids)[s:e].cast("B"))
        for (a, b), h in zip(spans, hashes, strict=False):
            if a < e and b > s:
                digest.update(h.encode())
        parent = digest.digest()
        out.append(int.from_bytes(parent, "little"))
    return tuple(out)


def route_request(request_id: str, prompt: Mapping[str, Any], *, image_token_id: int | None,
                  merge_size: int = 2, block_tokens: int = 64,
                  output_tokens: int = 128) -> RouteRequest:
    """The `RouteRequest` of an engine prompt ``{"prompt_token_ids", "pixel_values"?,
    "image_grid_thw"?}`` (image tokens already expanded, as the chat preprocessor gives it)."""
    ids = list(prompt["prompt_token_ids"])
    grid = prompt.get("image_grid_thw")
    tokens: tuple[int, ...] = ()
    hashes: tuple[str, ...] = ()
    if grid is not None and prompt.get("pixel_values") is not None:
        g = as_numpy(grid).astype(np.int64).reshape(-1, 3)
        tokens = tuple(int(t * h * w) // merge_size ** 2 for t, h, w in g.tolist())
        given = (prompt.get("mm_hashes") or {}).get("image")
        if given is not None and len(given) == len(tokens):
            hashes = tuple(str(h) for h in given)  # the engine's encoder-cache keys
        else:
            hashes = image_hashes(prompt["pixel_values"], g)
    spans = image_spans(ids, image_token_id, tokens)
    return RouteRequest(request_id, len(ids), tokens, hashes,
                        prefix_block_hashes(ids, block_tokens, spans, hashes),
                        block_tokens=block_tokens, output_tokens=max(0, int(output_tokens)))
