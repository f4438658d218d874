"""Qwen3-VL language model: the Qwen2-VL decoder (paged KV, fused QKV and gate/up, tensor
parallelism) with Qwen3's differences and DeepStack.

- q/k projections have no bias; q and k are RMS-normalised per head (``q_norm``/``k_norm``
  over ``head_dim``, which the config gives explicitly) before the rotary;
- M-RoPE is *interleaved*: frequency ``j`` follows height when ``j % 3 == 1`` and
  ``j < 3 * section[1]``, width when ``j % 3 == 2`` and ``j < 3 * section[2]``, else time;
- DeepStack: each media token's encoder row is ``[(1 + taps) * hidden]``; the first
  ``hidden`` columns are spliced in at the embeddings, and tap ``i``'s columns are added to
  that token's hidden state after decoder layer ``i`` (``i < taps``). A step adds only the
  rows it is given, so a prefill chunk adds exactly the features of its own media tokens and
  a cached prefix (whose KV already holds their effect) adds none.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from spaceserve.models.qwen2_vl_text import LanguageModel

Tensor = torch.Tensor


def interleaved_section_index(section: list[int], half: int) -> Tensor:
    """Which position row (0 t, 1 h, 2 w) drives each of the ``head_dim / 2`` frequencies
    under interleaved M-RoPE (transformers' Qwen3-VL ``recomposition_frequencies``)."""
    if len(section) != 3 or sum(section) != half:
        raise ValueError(f"mrope_section {section} must be 3 numbers summing to "
                         f"head_dim / 2 = {half}")
    index = torch.zeros(half, dtype=torch.long)
    for row in (1, 2):
        index[row:3 * section[row]:3] = row
    return index


class Qwen3LanguageModel(LanguageModel):
    """The Qwen3-VL decoder; `num_deepstack` is the vision tower's tap count (the media rows
    it is given are ``(1 + num_deepstack) * hidden`` wide)."""

    qkv_bias = False

    def __init__(self, config: Any, weight: Callable[[str], Tensor], *args: Any,
                 num_deepstack: int = 0, **kwargs: Any) -> None:
        super().__init__(config, weight, *args, **kwargs)
        rope = dict(getattr(config, "rope_parameters", None) or {})
        section = list(rope.get("mrope_section", [24, 20, 20]))
        # always interleaved, as transformers' Qwen3-VL (its `mrope_interleaved` is not read)
        self.section_index = interleaved_section_index(section, self.head_dim // 2) \
            .to(self.device)
        self.qk_norms = [(weight(f"layers.{i}.self_attn.q_norm.weight"),
                          weight(f"layers.{i}.self_attn.k_norm.weight"))
                         for i in range(self.num_layers)]
        self.num_deepstack = int(num_deepstack)
        if self.num_deepstack:  # a generated media token adds nothing after the embeddings
            pad = self.num_deepstack * self.hidden
            self.media_token_rows = {t: torch.cat([r, r.new_zeros(pad)])
                                     for t, r in self.media_token_rows.items()}

    @property
    def embed_width(self) -> int:
        return (1 + self.num_deepstack) * self.hidden

    def qk_norm(self, i: int, q: Tensor, k: Tensor, num_sms: int | None
                ) -> tuple[Tensor, Tensor]:
        qw, kw = self.qk_norms[i]
        return self.ops.head_rms_norm(q, qw, self.eps, num_sms=num_sms), \
            self.ops.head_rms_norm(k, kw, self.eps, num_sms=num_sms)

    def split_media(self, input_ids: Tensor, image_embeds: Tensor | None
                    ) -> tuple[Tensor | None, Any]:
        """(embedding rows, (media row indices, per-tap features)); ValueError when the rows
        are not ``(1 + taps) * hidden`` wide."""
        if image_embeds is None:
            return None, None
        if image_embeds.dim() != 2 or image_embeds.shape[1] != self.embed_width:
            raise ValueError(f"image_embeds must be [media_tokens, {self.embed_width}] "
                             f"(embeddings and {self.num_deepstack} DeepStack features), got "
                             f"{tuple(image_embeds.shape)}")
        main = image_embeds[:, :self.hidden]
        if not self.num_deepstack:
            return main, None
        mask = input_ids == self.image_token_id
        if self.video_token_id is not None:
            mask |= input_ids == self.video_token_id
        rows = mask.nonzero().flatten()
        taps = image_embeds[:, self.hidden:].split(self.hidden, dim=1)
        return main, (rows, taps)

    def after_layer(self, i: int, h: Tensor, residual: Tensor | None, extra: Any
                    ) -> tuple[Tensor, Tensor | None]:
        """After layer ``i < taps``: fold the residual in and add tap ``i`` at media rows."""
        rows, taps = extra
        if i >= len(taps):
            return h, residual
        if residual is not None:
            h = residual + h
        h.index_copy_(0, rows, h.index_select(0, rows) + taps[i].to(h.dtype))
        return h, None


def text_weight_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Hub names and shapes of a Qwen3-VL decoder's weights (`config` the top-level config:
    ``lm_head`` is left out when it ties word embeddings)."""
    t = config.text_config
    h, n_q = int(t.hidden_size), int(t.num_attention_heads)
    n_kv = int(t.num_key_value_heads or n_q)
    d = int(getattr(t, "head_dim", None) or h // n_q)
    inter, vocab = int(t.intermediate_size), int(t.vocab_size)
    p = "model.language_model."
    shapes: dict[str, tuple[int, ...]] = {p + "embed_tokens.weight": (vocab, h)}
    for i in range(int(t.num_hidden_layers)):
        q = f"{p}layers.{i}."
        shapes.update({q + "input_layernorm.weight": (h,),
                       q + "post_attention_layernorm.weight": (h,),
                       q + "self_attn.q_proj.weight": (n_q * d, h),
                       q + "self_attn.k_proj.weight": (n_kv * d, h),
                       q + "self_attn.v_proj.weight": (n_kv * d, h),
                       q + "self_attn.o_proj.weight": (h, n_q * d),
                       q + "self_attn.q_norm.weight": (d,), q + "self_attn.k_norm.weight": (d,),
                       q + "mlp.gate_proj.weight": (inter, h), q + "mlp.up_proj.weight": (inter, h),
                       q + "mlp.down_proj.weight": (h, inter)})
    shapes[p + "norm.weight"] = (h,)
    if not (getattr(config, "tie_word_embeddings", False)
            or getattr(t, "tie_word_embeddings", False)):
        shapes["lm_head.weight"] = (vocab, h)
    return shapes
