"""Qwen3-VL on SpaceServe's ops against transformers' Qwen3VLForConditionalGeneration on the
tiny random checkpoint (tied and untied): encoder rows (embeddings and DeepStack features),
jobs split at every layer boundary, M-RoPE positions with timestamped video, prefill and
decode logits, the per-head q/k norm on the Triton kernels, and what is refused."""

from __future__ import annotations

import pytest
import torch

from spaceserve.kernels import record_launches
from spaceserve.kernels.testing import assert_close, assert_within_budget
from spaceserve.models import from_pretrained
from spaceserve.models.ops import TorchOps, TritonOps

from . import qwen3_ref as ref
from .conftest import PagedRun


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3vl")
    return {tied: ref.build(root, tied=tied) for tied in (True, False)}


@pytest.fixture(scope="module")
def ours(ckpts):
    return {tied: from_pretrained(path, attention_backend="torch", dtype=torch.float32,
                                  device="cpu") for tied, (path, _) in ckpts.items()}


def test_encoder_rows_carry_embeddings_and_deepstack_features(ckpts, ours):
    _, hf = ckpts[True]
    model = ours[True]
    assert model.num_deepstack == 2 and model.language.embed_width == 3 * 64
    pv, grid = ref.pixels([[1, 4, 6], [1, 8, 4], [3, 4, 4]], 4)  # two images and a video
    rows = model.encode_images(pv, grid)
    with torch.no_grad():
        out = hf.model.get_image_features(pv, grid)
    def cat(t):  # a list of per-item tensors (transformers 5.24) or one tensor (5.17)
        return torch.cat(t) if isinstance(t, (list, tuple)) else t

    want = [cat(out.pooler_output)] + [cat(f) for f in out.deepstack_features]
    assert rows.shape == (6 + 8 + 12, 3 * 64)
    for k, w in enumerate(want):
        torch.testing.assert_close(rows[:, 64 * k:64 * (k + 1)], w, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("chunks", [[1, 1, 1], [2, 1], [1, 2], [3]])
def test_a_job_split_at_layer_boundaries_is_bitwise_the_one_shot_pass(ours, chunks):
    vision = ours[False].vision
    pv, grid = ref.pixels([[1, 4, 6], [2, 4, 4]], 5)
    whole = ours[False].encode_images(pv, grid)
    job = vision.start(pv, grid)
    taps = []
    for n in chunks:  # a resumed job keeps the taps it has taken
        assert vision.advance(job, n) == n
        taps.append(len(job.taps))
    assert taps == [min(2, sum(chunks[:i + 1])) for i in range(len(chunks))]
    assert torch.equal(vision.finish(job), whole)


def test_mrope_positions_match_get_rope_index(ckpts, ours):
    _, hf = ckpts[True]
    for p in ref.prompts(hf.config)[1:]:
        kw = ref.hf_kwargs(hf.config, p)
        want, delta = hf.model.get_rope_index(kw["input_ids"], kw["mm_token_type_ids"],
                                              image_grid_thw=kw.get("image_grid_thw"),
                                              video_grid_thw=kw.get("video_grid_thw"))
        got, d = ours[True].mrope_positions(p["prompt_token_ids"], p.get("image_grid_thw"),
                                            video_grid_thw=p.get("video_grid_thw"))
        assert torch.equal(got, want[:, 0]) and d == int(delta)


@pytest.mark.parametrize("tied", [True, False])
def test_prefill_and_decode_logits_match_transformers(ckpts, ours, tied):
    _, hf = ckpts[tied]
    model = ours[tied]
    decode = [70, 71]
    for p in ref.prompts(hf.config):
        ids = torch.tensor(p["prompt_token_ids"])
        grid = p.get("image_grid_thw", p.get("video_grid_thw"))
        pv = p.get("pixel_values", p.get("pixel_values_videos"))
        embeds = model.encode_images(pv, grid) if pv is not None else None
        positions, delta = model.mrope_positions(ids, p.get("image_grid_thw"),
                                                 video_grid_thw=p.get("video_grid_thw"))
        run = PagedRun(model)
        first = run.step(ids, positions=positions, delta=delta, image_embeds=embeds)
        later = torch.cat([run.step(torch.tensor([t]), positions=positions, delta=delta)
                           for t in decode])
        full = dict(p, prompt_token_ids=p["prompt_token_ids"] + decode)
        with torch.no_grad():
            logits = hf(**ref.hf_kwargs(hf.config, full)).logits[0]
        n = len(ids)
        torch.testing.assert_close(first[0], logits[n - 1], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(later, logits[n:n + len(decode)], atol=1e-4, rtol=1e-4)


def test_deepstack_features_reach_the_decoder(ours):
    """Zeroed DeepStack columns change the logits of an image prompt (the adds are live)."""
    model = ours[True]
    p = ref.prompts(model.config)[1]
    ids = torch.tensor(p["prompt_token_ids"])
    rows = model.encode_images(p["pixel_values"], p["image_grid_thw"])
    positions, delta = model.mrope_positions(ids, p["image_grid_thw"])
    plain = rows.clone()
    plain[:, 64:] = 0
    a = PagedRun(model).step(ids, positions=positions, delta=delta, image_embeds=rows)
    b = PagedRun(model).step(ids, positions=positions, delta=delta, image_embeds=plain)
    assert (a - b).abs().max() > 1e-3


def test_rows_without_their_deepstack_columns_are_refused(ours):
    model = ours[True]
    p = ref.prompts(model.config)[1]
    ids = torch.tensor(p["prompt_token_ids"])
    positions, delta = model.mrope_positions(ids, p["image_grid_thw"])
    with pytest.raises(ValueError, match="DeepStack"):
        PagedRun(model).step(ids, positions=positions, delta=delta,
                             image_embeds=torch.zeros(6, 64))


@pytest.mark.parametrize("heads, d", [(5, 80), (3, 32), (1, 24)])
def test_head_rms_norm_on_the_kernels_within_budget(heads, d):
    """Qwen3's per-head q/k norm on a strided view of a fused qkv output (fp32, D=80)."""
    g = torch.Generator().manual_seed(heads * d)
    t = 7
    qkv = torch.randn(t, (heads + 2) * d, generator=g)
    q = qkv[:, :heads * d].view(t, heads, d)
    w = 1 + 0.1 * torch.randn(d, generator=g)
    want = TorchOps().head_rms_norm(q.double(), w.double(), 1e-6)
    for budget in (1, 3):
        with record_launches() as recs:
            got = TritonOps().head_rms_norm(q, w, 1e-6, num_sms=budget)
        assert_within_budget(recs, budget)
        assert got.shape == (t, heads, d)
        assert_close(got, want)


@pytest.mark.parametrize("tied", [True, False])
def test_weight_shapes_are_transformers_and_random_weights_build(ckpts, tied):
    from spaceserve.models import from_config, weight_shapes

    _, hf = ckpts[tied]
    want = {k: tuple(v.shape) for k, v in hf.state_dict().items()}
    if tied:  # transformers' state dict lists the tied head; the checkpoint does not
        want.pop("lm_head.weight")
    assert weight_shapes(hf.config) == want
    model = from_config(hf.config, attention_backend="torch", device="cpu")
    assert model.num_deepstack == 2
    assert (model.language.lm_head is model.language.embed) == tied


def test_triton_backend_matches_torch_within_budget(ckpts, ours):
    """The whole Qwen3-VL path on SpaceServe's kernels (interpreted): encoder rows with their
    DeepStack features and a prefill over them, every launch under the stage's budget."""
    path, hf = ckpts[False]
    tri = from_pretrained(path, attention_backend="triton", dtype=torch.float32, device="cpu")
    p = {"prompt_token_ids": ref.prompt_ids(hf.config, [("image", (1, 4, 4))])}
    pv, grid = ref.pixels([[1, 4, 4]], 6)
    ids = torch.tensor(p["prompt_token_ids"])
    outs = []
    for model, budget in ((ours[False], None), (tri, 3)):
        with record_launches() as recs:
            rows = model.encode_images(pv, grid, num_sms=budget)
            positions, delta = model.mrope_positions(ids, grid)
            logits = PagedRun(model).step(ids, positions=positions, delta=delta,
                                          image_embeds=rows, num_sms=budget)
        outs.append((rows, logits, recs))
    assert_within_budget(outs[1][2], 3)
    assert_close(outs[1][0], outs[0][0].double())
    assert_close(outs[1][1], outs[0][1].double())


def test_model_tiny_qwen3_vl_names_resolve_to_built_checkpoints(tmp_path, monkeypatch):
    import json

    from spaceserve.models.tiny import resolve_model

    monkeypatch.setenv("SPACESERVE_CACHE", str(tmp_path))
    path = resolve_model("tiny-qwen3-vl-untied")
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "qwen3_vl" and config["tie_word_embeddings"] is False
    stamp = (path / "spaceserve_tiny.json").stat().st_mtime_ns
    assert resolve_model("tiny-qwen3-vl-untied") == path  # built once, then reused
    assert (path / "spaceserve_tiny.json").stat().st_mtime_ns == stamp
    with pytest.raises(ValueError, match="tiny-qwen3-vl"):
        resolve_model(str(tmp_path / "nowhere"))
