"""Tensor-parallel decoder at the model level: each rank of a group (threads meeting at a
barrier, `tp_threads.py`) loads its shards with safetensors slices; logits equal the unsplit
model's within fp32 tolerance and transformers', KV heads split or replicate, bad head counts
are refused, and a rank materialises about half the checkpoint at TP 2."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from spaceserve.kernels import record_launches
from spaceserve.kernels.testing import assert_close, assert_within_budget
from spaceserve.models import from_pretrained
from spaceserve.models.parallel import TensorParallel, check_text_config

from .conftest import BOS, EOS, IMAGE, VEND, VIDEO, VSTART, PagedRun, hf_inputs
from .tp_threads import run_ranks

RTOL_SPLIT = 2e-6  # TP against the unsplit model: fp32 partial sums in another order
RTOL_HF = 1e-4  # against transformers in fp64, as test_language
DECODE = [17, 29, 5]


def six_head_config():
    """A Qwen2-VL with 6 query / 2 KV heads (head dim 16) and a vocabulary of 130 (not a
    multiple of the group: the last vocabulary shard is padded)."""
    from transformers import Qwen2VLConfig

    return Qwen2VLConfig(
        text_config=dict(vocab_size=130, hidden_size=96, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=6, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [2, 3, 3]},
                         eos_token_id=EOS, bos_token_id=BOS, initializer_range=0.15),
        vision_config=dict(depth=2, embed_dim=32, hidden_size=96, num_heads=2, mlp_ratio=2),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART,
        vision_end_token_id=VEND)


@pytest.fixture(scope="module")
def six(tmp_path_factory):
    """(path, fp64 transformers model) of the 6/2-head checkpoint."""
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(77)
    hf = Qwen2VLForConditionalGeneration(six_head_config()).eval()
    with torch.no_grad():
        for p in hf.parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path_factory.mktemp("qwen2vl_six")
    hf.save_pretrained(path)
    return path, copy.deepcopy(hf).double()


def paths(checkpoints, six):
    return {"small": (checkpoints["small"][0], None), "six": six}


def run_split(path, size: int, ids, pixel_values, grid, backend: str = "torch",
              num_sms: int | None = None, decode: list[int] = DECODE):
    """Every rank's (prefill logits, logits of the `decode` tokens, model, cache) at TP
    `size`."""

    def rank(r, comm):
        model = from_pretrained(path, attention_backend=backend, device="cpu",
                                tp=TensorParallel(r, size), comm=comm)
        embeds = model.encode_images(pixel_values, grid) if pixel_values is not None else None
        positions, delta = model.mrope_positions(ids, grid)
        run = PagedRun(model)
        first = run.step(ids, positions=positions, delta=delta, image_embeds=embeds,
                         num_sms=num_sms)
        later = [run.step(torch.tensor([t]), positions=positions, delta=delta,
                          num_sms=num_sms) for t in decode]
        return first, torch.cat(later), model, run.cache

    if size == 1:
        from spaceserve.models.parallel import SingleRank

        return [rank(0, SingleRank())]
    return run_ranks(size, rank, serial=backend == "triton")


@pytest.mark.parametrize("name, size", [("small", 2), ("small", 4), ("six", 2)])
def test_split_logits_match_unsplit_and_transformers(checkpoints, six, images, name, size):
    path, hf64 = paths(checkpoints, six)[name]
    if hf64 is None:
        hf64 = copy.deepcopy(checkpoints[name][1]).double()
    pixel_values, grid, ids = images
    one = run_split(path, 1, ids, pixel_values, grid)[0]
    ranks = run_split(path, size, ids, pixel_values, grid)
    for first, later, _, _ in ranks[1:]:  # every rank returns the same full logits
        assert torch.equal(first, ranks[0][0]) and torch.equal(later, ranks[0][1])
    first, later, model, _ = ranks[0]
    vocab = model.config.text_config.vocab_size
    assert first.shape == (1, vocab) and later.shape == (len(DECODE), vocab)
    assert_close(first, one[0].double(), rtol=RTOL_SPLIT)
    assert_close(later, one[1].double(), rtol=RTOL_SPLIT)
    assert first.argmax(-1).tolist() == one[0].argmax(-1).tolist()
    assert later.argmax(-1).tolist() == one[1].argmax(-1).tolist()
    with torch.no_grad():
        full = torch.cat([ids, torch.tensor(DECODE)])
        ref = hf64(**hf_inputs(full, pixel_values.double(), grid)).logits[0]
    assert_close(first[0], ref[len(ids) - 1], rtol=RTOL_HF)
    assert_close(later, ref[len(ids):], rtol=RTOL_HF)


def test_kv_heads_replicate_beyond_their_count(checkpoints, images):
    """4 query / 2 KV heads at TP 4: one query head per rank, KV head r // 2 on rank r, so
    ranks 0-1 and 2-3 hold the same cache, equal to that head's slice of the unsplit cache."""
    path = checkpoints["small"][0]
    pixel_values, grid, ids = images
    one = run_split(path, 1, ids, pixel_values, grid)[0]
    ranks = run_split(path, 4, ids, pixel_values, grid)
    for r, (_, _, model, cache) in enumerate(ranks):
        lm = model.language
        assert (lm.num_heads, lm.num_kv_heads, lm.total_kv_heads) == (1, 1, 2)
        assert cache.k[0].shape[2] == 1
        for layer in range(lm.num_layers):
            for mine, full in ((cache.k[layer], one[3].k[layer]),
                               (cache.v[layer], one[3].v[layer])):
                assert_close(mine[..., 0, :], full[..., r // 2, :].double(), rtol=RTOL_SPLIT)
    for a, b in ((0, 1), (2, 3)):
        assert all(torch.equal(x, y) for x, y in zip(ranks[a][3].k, ranks[b][3].k, strict=True))


def test_triton_backend_split_under_budget(checkpoints):
    """The Triton kernels on a TP 2 shard: logits as the unsplit model's, every launch on
    every rank within the step's SM budget."""
    path = checkpoints["small"][0]
    ids = torch.tensor([BOS, 17, 33, 8, 91])
    one = run_split(path, 1, ids, None, None, backend="triton", num_sms=5, decode=DECODE[:1])[0]
    with record_launches() as recs:
        ranks = run_split(path, 2, ids, None, None, backend="triton", num_sms=5,
                          decode=DECODE[:1])
    assert_within_budget(recs, 5)
    assert_close(ranks[0][0], one[0].double(), rtol=RTOL_SPLIT)
    assert_close(ranks[1][1], one[1].double(), rtol=RTOL_SPLIT)


def test_bad_splits_are_refused(checkpoints):
    wide = checkpoints["wide"][0]  # 3 query heads / 1 KV head
    with pytest.raises(ValueError, match="num_attention_heads=3 is not divisible by "
                                         "tensor_parallel_size=2"):
        from_pretrained(wide, attention_backend="torch", device="cpu", tp=TensorParallel(0, 2))
    with pytest.raises(ValueError, match="num_key_value_heads=4 and tensor_parallel_size=6"):
        TensorParallel(1, 6).heads(12, 4)
    cfg = six_head_config().text_config
    cfg.intermediate_size = 129
    with pytest.raises(ValueError, match="intermediate_size=129 is not divisible"):
        check_text_config(cfg, TensorParallel(0, 2))
    with pytest.raises(ValueError, match="rank=2 must lie in 0..size-1"):
        TensorParallel(2, 2)


# -- sharded loading: bytes materialised per rank ------------------------------------------

def synthetic_checkpoint(path) -> int:
    """A random Qwen2-VL shaped like a scaled-down 72B (a small vision tower, a wide decoder
    with 8 query / 2 KV heads), saved in two safetensors files with an index; returns the
    bytes of its tensors."""
    from safetensors.torch import save_file
    from transformers import Qwen2VLConfig

    from spaceserve.models import random_state_dict

    config = Qwen2VLConfig(
        text_config=dict(vocab_size=512, hidden_size=128, intermediate_size=384, eos_token_id=EOS,
                         bos_token_id=BOS,
                         num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                         rope_parameters={"rope_type": "default", "rope_theta": 1e6,
                                          "mrope_section": [2, 3, 3]}),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=128, num_heads=2, mlp_ratio=2),
        image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=VSTART,
        vision_end_token_id=VEND)
    state = random_state_dict(config, seed=5)
    names = sorted(state)
    files = {"model-00001-of-00002.safetensors": names[::2],
             "model-00002-of-00002.safetensors": names[1::2]}
    os.makedirs(path, exist_ok=True)
    weight_map = {}
    for file, keys in files.items():
        save_file({k: state[k].contiguous() for k in keys}, os.path.join(path, file))
        weight_map.update({k: file for k in keys})
    import json

    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    config.save_pretrained(path)
    return sum(t.numel() * t.element_size() for t in state.values())


class CountingOpen:
    """Wraps safetensors' safe_open and counts the bytes of every tensor it materialises."""

    def __init__(self, real) -> None:
        self.real, self.bytes, self.whole_files = real, 0, 0

    def __call__(self, *args, **kwargs):
        counter = self

        class Handle:
            def __init__(self) -> None:
                self.inner = counter.real(*args, **kwargs)

            def __enter__(self):
                self.inner.__enter__()
                return self

            def __exit__(self, *exc):
                return self.inner.__exit__(*exc)

            def keys(self):
                return self.inner.keys()

            def get_tensor(self, key):
                t = self.inner.get_tensor(key)
                counter.bytes += t.numel() * t.element_size()
                return t

            def get_slice(self, key):
                inner = self.inner.get_slice(key)

                class Slice:
                    def get_shape(self):
                        return inner.get_shape()

                    def get_dtype(self):
                        return inner.get_dtype()

                    def __getitem__(self, index):
                        t = inner[index]
                        counter.bytes += t.numel() * t.element_size()
                        return t

                return Slice()

        return Handle()


def test_each_rank_reads_only_its_slices(tmp_path, monkeypatch):
    import safetensors
    import safetensors.torch

    total = synthetic_checkpoint(tmp_path)
    monkeypatch.setattr(safetensors.torch, "load_file", None)  # never a whole file
    counts = {}
    for size in (1, 2):
        for r in range(size):
            counter = CountingOpen(safetensors.safe_open)
            monkeypatch.setattr(safetensors, "safe_open", counter)
            model = from_pretrained(tmp_path, attention_backend="torch", device="cpu",
                                    tp=TensorParallel(r, size))
            monkeypatch.setattr(safetensors, "safe_open", counter.real)
            assert counter.bytes == model.load_stats.bytes
            counts[size, r] = counter.bytes
    assert counts[1, 0] == total  # the unsplit model reads every tensor once
    for r in range(2):
        assert counts[2, r] <= 0.6 * counts[1, 0], (counts[2, r], counts[1, 0])
