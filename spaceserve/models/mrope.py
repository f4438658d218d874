"""Qwen2-VL M-RoPE positions: three position rows (temporal, height, width) per LLM token.

Text tokens advance all three rows together. The tokens of one image (or video) get a 3D grid
of positions starting at the running position, and the running position then advances by the
larger of the merged grid's height and width, so positions grow more slowly than token indices.
The difference at the end of the prompt is the *rope delta*: a token at cache index ``p`` after
the prompt has position ``p + delta`` on all three rows. This is what transformers'
``get_rope_index`` computes; it is reproduced here on host tensors so the planner can slice it.

Qwen2.5-VL (a vision config with ``tokens_per_second``) spaces a video's temporal positions by
``tokens_per_second * second_per_grid_ts`` per temporal patch (truncated to integers); images
keep a temporal step of 1 (a still image has one frame, so its temporal row is constant).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


def _grid_rows(grid_thw: Any) -> list[tuple[int, int, int]]:
    if grid_thw is None:
        return []
    rows = grid_thw.tolist() if isinstance(grid_thw, torch.Tensor) else list(grid_thw)
    out = []
    for row in rows:
        if len(row) != 3:
            raise ValueError(f"image_grid_thw rows must be (t, h, w), got {row!r}")
        out.append((int(row[0]), int(row[1]), int(row[2])))
    return out


def _runs(ids: list[int], wanted: dict[int, int]) -> list[tuple[int, int, int]]:
    """Maximal runs of equal modality: (modality, start, end); modality 0 is text."""
    runs: list[tuple[int, int, int]] = []
    for i, tok in enumerate(ids):
        kind = wanted.get(tok, 0)
        if runs and runs[-1][0] == kind:
            runs[-1] = (kind, runs[-1][1], i + 1)
        else:
            runs.append((kind, i, i + 1))
    return runs


def mrope_positions(
    input_ids: torch.Tensor | Sequence[int],
    image_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None,
    config: Any,
    *,
    video_grid_thw: torch.Tensor | Sequence[Sequence[int]] | None = None,
    second_per_grid_ts: torch.Tensor | Sequence[float] | None = None,
) -> tuple[torch.Tensor, int]:
    """M-RoPE positions of one prompt: (positions ``[3, L]`` int64 on CPU, rope delta).

    `input_ids` is one prompt (1-D); `config` is a Qwen2VLConfig (its image/video token ids and
    the vision merge size are read). Each maximal run of image tokens is one image and takes the
    next row of `image_grid_thw` (patch grid, before the 2x2 merge), as transformers does.
    Raises ValueError when the runs and the grids disagree. `second_per_grid_ts` (one value per
    video, default 1) only matters for Qwen2.5-VL videos.
    """
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 1:
            raise ValueError(
                f"input_ids must be 1-D (one prompt), got shape {tuple(input_ids.shape)}"
            )
        ids = input_ids.tolist()
    else:
        ids = [int(t) for t in input_ids]
    merge = int(config.vision_config.spatial_merge_size)
    grids = {1: _grid_rows(image_grid_thw), 2: _grid_rows(video_grid_thw)}
    used = {1: 0, 2: 0}
    names = {1: "image_grid_thw", 2: "video_grid_thw"}
    wanted = {int(config.image_token_id): 1, int(config.video_token_id): 2}
    per_second = getattr(config.vision_config, "tokens_per_second", None)
    if second_per_grid_ts is not None and len(second_per_grid_ts) != len(grids[2]):
        raise ValueError(f"second_per_grid_ts has {len(second_per_grid_ts)} values for "
                         f"{len(grids[2])} videos")

    pieces: list[torch.Tensor] = []
    pos = 0
    for kind, start, end in _runs(ids, wanted):
        n = end - start
        if kind == 0:
            pieces.append(torch.arange(pos, pos + n, dtype=torch.long).expand(3, n))
            pos += n
            continue
        if used[kind] >= len(grids[kind]):
            raise ValueError(f"input_ids hold more media runs than {names[kind]} has rows")
        t, h, w = grids[kind][used[kind]]
        used[kind] += 1
        if h % merge or w % merge:
            raise ValueError(f"{names[kind]} row {(t, h, w)} is not a multiple of merge {merge}")
        gh, gw = h // merge, w // merge
        if t * gh * gw != n:
            raise ValueError(
                f"{names[kind]} row {(t, h, w)} gives {t * gh * gw} tokens, input_ids hold {n}"
            )
        steps = torch.arange(t, dtype=torch.long)
        if kind == 2 and per_second is not None:  # as transformers: (arange * interval).long()
            seconds = 1 if second_per_grid_ts is None else second_per_grid_ts[used[2] - 1]
            steps = (steps * (per_second * seconds)).long()
        tt = steps.view(t, 1, 1).expand(t, gh, gw)
        hh = torch.arange(gh, dtype=torch.long).view(1, gh, 1).expand(t, gh, gw)
        ww = torch.arange(gw, dtype=torch.long).view(1, 1, gw).expand(t, gh, gw)
        pieces.append(torch.stack([tt, hh, ww]).reshape(3, n) + pos)
        pos += max(h, w) // merge
    for kind in (1, 2):
        if used[kind] != len(grids[kind]):
            raise ValueError(
                f"{names[kind]} has {len(grids[kind])} rows, input_ids hold {used[kind]} media runs"
            )
    if not pieces:
        return torch.zeros(3, 0, dtype=torch.long), 0
    positions = torch.cat(pieces, dim=1)
    delta = int(positions.max()) + 1 - len(ids)
    return positions, delta


def text_positions(start: int, count: int, delta: int = 0) -> torch.Tensor:
    """Positions ``[3, count]`` of the tokens at cache indices ``start..start+count-1`` that
    follow a prompt with rope delta `delta` (decode tokens, text-only prompts)."""
    return (torch.arange(start, start + count, dtype=torch.long) + delta).expand(3, count)
