"""Resource-utility curves: file format, validation, interpolation, and the analytic model."""

from __future__ import annotations

import copy
import json

import pytest

from spaceserve.runtime.policy.analytic.model import (
    PRESETS,
    ModelShape,
    Roofline,
    analytic_curves,
    qwen2_vl_7b_config,
)
from spaceserve.runtime.policy.contention import Contention, Pair, from_measurements
from spaceserve.runtime.policy.curves import FORMAT_V1, Curve, CurveSet

SMS = [8, 16, 32, 64, 132]


def _grid(fn, sms, *axes):
    def rec(prefix, rest):
        if not rest:
            return fn(*prefix)
        return [rec((*prefix, x), rest[1:]) for x in rest[0]]

    return [rec((n,), list(axes)) for n in sms]


PAIRS = (Pair(32, 100, encoder=0.05, decoder=0.30), Pair(64, 68, encoder=0.10),
         Pair(100, 32, encoder=0.20, decoder=0.02))


def synthetic(version: int = 2) -> CurveSet:
    """Small hand-made curves: compute-like encoder/prefill, memory-like decode. Version 2 has
    a contention table per SM pair; version 1 a co-running grid per stage (10% slower)."""
    patches, tokens, ctx, batch = [256, 1024, 4096], [16, 256, 2048], [0, 4096], [1, 32]
    enc = lambda n, p: p * 1e-7 * 132 / n
    pre = lambda n, t, c: (1e-3 + t * 2e-6 + t * c * 1e-10) * 132 / n
    dec = lambda n, b, c: (3e-3 + b * c * 1e-9) * max(1.0, 64 / n)
    v1 = version == 1

    def cor(fn, *axes):
        return _grid(lambda *a: 1.1 * fn(*a), SMS, *axes) if v1 else None

    curves = {
        "encoder": Curve(("patches",), {"patches": patches}, SMS, _grid(enc, SMS, patches),
                         cor(enc, patches)),
        "prefill": Curve(("tokens", "context"), {"tokens": tokens, "context": ctx}, SMS,
                         _grid(pre, SMS, tokens, ctx), cor(pre, tokens, ctx)),
        "decode": Curve(("batch", "context"), {"batch": batch, "context": ctx}, SMS,
                        _grid(dec, SMS, batch, ctx), cor(dec, batch, ctx)),
    }
    table = None if v1 else Contention({"encoder": 0.08, "decoder": 0.08}, PAIRS, "measured")
    return CurveSet("H200", 132, {"name": "synthetic", "vision_depth": 4}, "bfloat16",
                    "measured", curves["encoder"], curves["prefill"], curves["decode"], table)


@pytest.fixture(scope="module")
def h200() -> CurveSet:
    return analytic_curves(device="H200")


def test_round_trip(tmp_path) -> None:
    cs = synthetic()
    path = cs.save(tmp_path / "c.json")
    back = CurveSet.load(path)
    assert back.to_dict() == cs.to_dict()
    assert json.loads(path.read_text())["source"] == "measured"
    for n in (8, 20, 100, 132):
        assert back.decode(16, 1000, n, True) == cs.decode(16, 1000, n, True)
        assert back.encoder(3000, 2, n) == cs.encoder(3000, 2, n)


def test_host_bound_points_round_trip_and_are_optional(tmp_path) -> None:
    """Measured curves list their host-bound points; a file without the list (modelled curves,
    older files) loads with None (not known), and lookups ignore the marks."""
    cs = synthetic()
    assert cs.decode_curve.host_bound is None and "host_bound" not in cs.to_dict()["curves"][
        "decode"]
    marked = [{"sms": 8, "batch": 1, "context": 0, "corun": False},
              {"sms": 8, "batch": 1, "context": 0, "corun": True}]
    cs.decode_curve.host_bound = marked
    cs.encoder_curve.host_bound = []
    back = CurveSet.load(cs.save(tmp_path / "c.json"))
    assert back.decode_curve.host_bound == marked and back.encoder_curve.host_bound == []
    assert back.prefill_curve.host_bound is None
    assert back.decode(1, 0, 8) == synthetic().decode(1, 0, 8)


def test_analytic_round_trip(tmp_path, h200) -> None:
    back = CurveSet.load(h200.save(tmp_path / "h200.json"))
    assert back.source == "modelled" and back.device == "H200" and back.num_sms == 132
    assert back.model["vision_depth"] == 32 and back.dtype == "bfloat16"
    # the presets' contention is one documented entry: a flat 8% on both sides
    assert back.contention.flat_value == PRESETS["H200"].contention == 0.08
    assert back.contention.source == "modelled" and "8%" in back.contention.note
    for n in (8, 60, 72, 132):
        assert back.prefill(2755, 0, n) == h200.prefill(2755, 0, n)
        assert back.decode(32, 1100, n, True) == h200.decode(32, 1100, n, True)


def _set(d: dict, path: tuple, value) -> dict:
    d = copy.deepcopy(d)
    node = d
    for key in path[:-1]:
        node = node[key]
    if value is KeyError:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return d


BAD = [
    (("format",), "v0", "$.format"),
    (("device", "num_sms"), 0, "$.device.num_sms"),
    (("device", "name"), "", "$.device.name"),
    (("dtype",), KeyError, "$.dtype"),
    (("model",), [], "$.model"),
    (("source",), "guessed", "$.source"),
    (("curves", "decode"), KeyError, "$.curves.decode"),
    (("curves", "encoder", "axes"), ["tokens"], "$.curves.encoder.axes"),
    (("curves", "decode", "sms"), [8, 8, 32, 64, 132], "$.curves.decode.sms[1]"),
    (("curves", "encoder", "sms"), [8, 16, 32, 64, 140], "$.curves.encoder.sms[4]"),
    (("curves", "decode", "grid", "context"), [-1, 4096], "$.curves.decode.grid.context[0]"),
    (("curves", "prefill", "grid", "tokens"), [16, 256.5, 2048],
     "$.curves.prefill.grid.tokens[1]"),
    (("curves", "decode", "isolated", 1, 0, 1), -1.0, "$.curves.decode.isolated[1][0][1]"),
    (("curves", "encoder", "isolated", 0, 0), "fast", "$.curves.encoder.isolated[0][0]"),
    (("curves", "decode", "host_bound"), {"sms": 8}, "$.curves.decode.host_bound"),
    (("curves", "decode", "host_bound"), [{"sms": 8, "batch": 1, "corun": False}],
     "$.curves.decode.host_bound[0]"),
    (("curves", "decode", "host_bound"), [{"sms": 9, "batch": 1, "context": 0, "corun": False}],
     "$.curves.decode.host_bound[0].sms"),
    (("curves", "encoder", "host_bound"), [{"sms": 8, "patches": 300, "corun": True}],
     "$.curves.encoder.host_bound[0].patches"),
    (("curves", "encoder", "host_bound"), [{"sms": 8, "patches": 256, "corun": 1}],
     "$.curves.encoder.host_bound[0].corun"),
    (("curves", "encoder", "corun"), [[1.0]], "$.curves.encoder.corun"),
    (("contention",), KeyError, "$.contention"),
    (("contention", "source"), "guessed", "$.contention.source"),
    (("contention", "default"), {"encoder": 0.1}, "$.contention.default"),
    (("contention", "default", "decoder"), -0.1, "$.contention.default.decoder"),
    (("contention", "pairs", 1, "encoder_sms"), 0, "$.contention.pairs[1].encoder_sms"),
    (("contention", "pairs", 0, "decoder_sms"), 140, "$.contention.pairs[0].decoder_sms"),
    (("contention", "pairs", 2, "decoder"), float("inf"), "$.contention.pairs[2].decoder"),
    (("contention", "pairs", 1, "encoder"), KeyError, "$.contention.pairs[1]"),
]
BAD_V1 = [
    (("curves", "prefill", "corun", 0), [[1.0, 1.0]], "$.curves.prefill.corun[0]"),
    (("curves", "encoder", "corun", 2, 1), float("nan"), "$.curves.encoder.corun[2][1]"),
    (("curves", "decode", "corun"), KeyError, "$.curves.decode.corun"),
]


@pytest.mark.parametrize("version,path,value,named",
                         [(2, *b) for b in BAD] + [(1, *b) for b in BAD_V1],
                         ids=[b[2] for b in BAD] + [f"v1 {b[2]}" for b in BAD_V1])
def test_malformed_rejected_with_field_named(version, path, value, named) -> None:
    good = synthetic(version).to_dict()
    CurveSet.from_dict(good)
    with pytest.raises(ValueError) as exc:
        CurveSet.from_dict(_set(good, path, value))
    assert f"{named}:" in str(exc.value)


def test_version_1_files_still_load(tmp_path) -> None:
    """An old file keeps its measured co-running grids until a table replaces them."""
    old = synthetic(1)
    path = old.save(tmp_path / "v1.json")
    assert json.loads(path.read_text())["format"] == FORMAT_V1
    back = CurveSet.load(path)
    assert back.contention is None and back.to_dict() == old.to_dict()
    assert back.decode(16, 1000, 64, True) == pytest.approx(1.1 * back.decode(16, 1000, 64))
    assert back.encoder(1024, 2, 32, 100) == pytest.approx(1.1 * back.encoder(1024, 2, 32))
    flat = back.with_contention(Contention.flat(0.35))
    assert flat.decode(16, 1000, 64, True) == pytest.approx(1.35 * back.decode(16, 1000, 64))
    assert flat.to_dict()["format"] == "spaceserve-curves-v2"
    with pytest.raises(ValueError, match="contention table"):
        back.slowdown("encoder", 64, 68)


def test_contention_per_sm_pair() -> None:
    cs = synthetic()
    iso_e, iso_d = cs.encoder(1024, 1, 32), cs.decode(16, 1000, 100)
    # exact at a measured pair; the encoder side by (own, other), the decoder by (other, own)
    assert cs.encoder(1024, 1, 32, 100) == pytest.approx(1.05 * iso_e)
    assert cs.decode(16, 1000, 100, 32) == pytest.approx(1.30 * iso_d)
    assert cs.decode(16, 1000, 32, 100) == pytest.approx(1.02 * cs.decode(16, 1000, 32))
    # True: beside the rest of the device
    assert cs.encoder(1024, 1, 64, True) == pytest.approx(1.10 * cs.encoder(1024, 1, 64))
    # between pairs: inverse squared distance, so within the neighbours' range
    mid = cs.slowdown("encoder", 48, 84)
    assert 0.05 < mid < 0.10 and mid < cs.slowdown("encoder", 56, 76)
    # a side whose pairs are the only data: every lookup stays within them
    assert all(0.02 <= cs.slowdown("decoder", e, 132 - e) <= 0.30 for e in range(8, 128, 8))
    # mixed steps run on the decode side: the decoder slowdown applies to their chunk too
    alone = cs.mixed_step(16, 1000, 256, 0, 100)
    assert cs.mixed_step(16, 1000, 256, 0, 100, 32) == pytest.approx(1.30 * alone)
    flat = Contention.flat(0.2)
    assert flat.flat_value == 0.2 and flat.slowdown("encoder", 1, 131) == 0.2
    assert Contention({"encoder": 0.1, "decoder": 0.2}).slowdown("decoder", 64, 68) == 0.2
    with pytest.raises(ValueError, match="slowdown >= 0"):
        Contention.flat(-0.1)


def test_contention_from_measurements() -> None:
    rows = [("encoder", 64, 68, 1.0, 1.1), ("encoder", 64, 68, 2.0, 2.4),
            ("encoder", 64, 68, 1.0, 1.3), ("decoder", 68, 64, 1.0, 0.9),
            ("decoder", 32, 100, 4.0, 5.0)]
    table = from_measurements(rows)
    pairs = {(p.encoder_sms, p.decoder_sms): p for p in table.pairs}
    assert pairs[(64, 68)].encoder == pytest.approx(0.2) and pairs[(64, 68)].decoder is None
    assert pairs[(68, 64)].decoder == 0.0  # faster beside the other stage: noise, clamped
    assert pairs[(32, 100)].decoder == pytest.approx(0.25)
    assert table.source == "measured" and table.default["encoder"] == pytest.approx(0.2)


def test_not_json_rejected(tmp_path) -> None:
    p = tmp_path / "bad.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match=r"\$: not valid JSON"):
        CurveSet.load(p)


def test_interpolation_exact_and_linear() -> None:
    cs = synthetic()
    c = cs.encoder_curve
    assert c(16, 1024) == pytest.approx(1024 * 1e-7 * 132 / 16, rel=1e-12)
    mid = c(16, 2560)  # halfway between 1024 and 4096 patches
    assert mid == pytest.approx(0.5 * (c(16, 1024) + c(16, 4096)), rel=1e-12)
    between = c(24, 1024)  # halfway between 16 and 32 SMs
    assert between == pytest.approx(0.5 * (c(16, 1024) + c(32, 1024)), rel=1e-12)
    # outside the grid: fewer SMs scale up, more work scales proportionally, less work clamps
    assert c(4, 1024) == pytest.approx(2 * c(8, 1024), rel=1e-12)
    assert c(16, 8192) == pytest.approx(2 * c(16, 4096), rel=1e-12)
    assert c(16, 100) == c(16, 256)
    assert cs.encoder(1024, 3, 16) == pytest.approx(3 * c(16, 1024), rel=1e-12)
    assert cs.decode(0, 100, 16) == 0.0 and cs.encoder(0, 4, 16) == 0.0


def test_envelope_makes_noisy_data_monotone() -> None:
    sms, xs = [8, 16, 32, 64], [100, 200, 400]
    noisy = [[4.0, 5.0, 9.0], [2.0, 1.5, 5.0], [2.5, 2.6, 2.0], [0.9, 1.0, 1.1]]
    c = Curve(("patches",), {"patches": xs}, sms, noisy)
    points = [8, 10, 12, 16, 20, 24, 32, 40, 64, 100]
    for x in (100, 150, 200, 300, 400, 500):
        vals = [c(n, x) for n in points]
        assert all(a >= b for a, b in zip(vals, vals[1:], strict=False)), (x, vals)
    for n in points:
        vals = [c(n, x) for x in (50, 100, 150, 200, 300, 400, 500)]
        assert all(a <= b for a, b in zip(vals, vals[1:], strict=False)), (n, vals)
    assert c(32, 400) == pytest.approx(2.6)  # raised to the neighbour with less work
    assert c(16, 200) == pytest.approx(2.0)  # 1.5 < 2.0 at less work


def test_qwen2_vl_7b_config_shape() -> None:
    s = ModelShape.from_config(qwen2_vl_7b_config(), "Qwen2-VL-7B")
    assert (s.vision_depth, s.vision_embed, s.vision_heads, s.vision_mlp) == (32, 1280, 16, 5120)
    assert (s.vision_out, s.merge, s.patch_dim, s.vision_gated) == (3584, 2, 1176, False)
    assert (s.text_layers, s.hidden, s.intermediate) == (28, 3584, 18944)
    assert (s.heads, s.kv_heads, s.head_dim, s.vocab) == (28, 4, 128, 152064)


WORK = {
    "encoder": [(64,), (1000,), (4096,), (10764,), (42196,)],
    "prefill": [(16, 0), (320, 0), (2755, 0), (512, 3000), (9000, 12000)],
    "decode": [(1, 0), (8, 500), (32, 1100), (64, 4000), (200, 20000)],
}


@pytest.mark.parametrize("stage", list(WORK))
def test_analytic_more_sms_never_slower(stage, h200) -> None:
    model = Roofline(ModelShape.from_config(qwen2_vl_7b_config()), PRESETS["H200"])
    raw = {"encoder": model.encoder_layer, "prefill": model.prefill, "decode": model.decode}
    curve = getattr(h200, f"{stage}_curve")
    lookup = {"encoder": lambda n, p, corun: h200.encoder(p, 1, n, corun),
              "prefill": lambda n, t, c, corun: h200.prefill(t, c, n, corun),
              "decode": lambda n, b, c, corun: h200.decode(b, c, n, corun)}[stage]
    for work in WORK[stage]:
        direct = [raw[stage](*work, n) for n in range(1, 133)]
        looked = [curve(n, *work) for n in range(1, 133)]
        for vals in (direct, looked):
            assert all(a >= b for a, b in zip(vals, vals[1:], strict=False)), work
        for n in range(4, 133, 4):
            assert lookup(n, *work, True) == pytest.approx(1.08 * lookup(n, *work, False))


def test_analytic_more_work_never_faster(h200) -> None:
    for n in (8, 60, 72, 132):
        enc = [h200.encoder(p, 1, n) for p in (64, 500, 1024, 5000, 10764, 70000)]
        dec = [h200.decode(b, 1024, n) for b in (1, 3, 32, 100, 300)]
        ctx = [h200.decode(32, c, n) for c in (0, 100, 1024, 5000, 40000)]
        for vals in (enc, dec, ctx):
            assert all(a <= b for a, b in zip(vals, vals[1:], strict=False))


def _saturation(fn, tol: float = 0.05) -> int:
    full = fn(132)
    return next(n for n in range(4, 133, 4) if fn(n) <= (1 + tol) * full)


def test_memory_bound_decode_saturates_before_compute_bound_encoder(h200) -> None:
    dec = _saturation(lambda n: h200.decode(32, 1024, n))
    enc = _saturation(lambda n: h200.encoder(4 * 2691, 32, n))
    pre = _saturation(lambda n: h200.prefill(2755, 0, n))
    assert dec <= 72 < 120 <= min(enc, pre), (dec, enc, pre)
    # the H200 roofline: decode at 132 SMs is bandwidth-bound (~4.3 TB/s over ~15 GB of bf16
    # weights and KV), a 1080p encoder pass is compute-bound (tens of ms)
    assert 3e-3 < h200.decode(32, 1024, 132) < 6e-3
    assert 0.03 < h200.encoder(4 * 2691, 32, 132) < 0.15


def test_analytic_invalid_inputs() -> None:
    with pytest.raises(ValueError, match="device"):
        analytic_curves(device="B300")
    with pytest.raises(ValueError, match="dtype"):
        analytic_curves(qwen2_vl_7b_config(), dtype="int3")
    with pytest.raises(ValueError, match="config"):
        ModelShape.from_config(object())


def test_model_curves_of_a_qwen3_vl_config() -> None:
    """An engine running Qwen3-VL schedules by its own analytic curves, at TP too, where the
    data-parallel encoder also ships the DeepStack features (3 more tensors per image)."""
    from spaceserve.runtime.policy.analytic.model import qwen3_vl_8b_config
    from spaceserve.runtime.policy.model_curves import model_curves

    config = qwen3_vl_8b_config()
    one = model_curves(None, config)
    assert one.model["vision_deepstack"] == 3 and one.encoder_depth == 27
    assert one.model["head_dim"] == 128 and one.model["qk_norm"] is True
    two = model_curves(None, config, tp=2)
    assert two.model["tp"] == 2 and two.model["encoder_ranks"] == 2
    sharded = model_curves(None, config, tp=2, mm_encoder_tp_mode="weights")
    assert sharded.encoder(4096, 27, 132) != two.encoder(4096, 27, 132)


@pytest.mark.parametrize("mode", ["data", "weights"])
def test_tp_encoder_charges_each_deepstack_merger(mode: str) -> None:
    """At TP the DeepStack mergers' outputs are broadcast (data) or their GEMMs split with an
    all-reduce each (weights), like the final merger's: a tower without them is cheaper."""
    import dataclasses

    from spaceserve.models.presets import get_preset
    from spaceserve.runtime.policy.analytic.model import PRESETS as DEVICES
    from spaceserve.runtime.policy.analytic.model import ModelShape
    from spaceserve.runtime.policy.analytic.tp import LINKS, TensorParallelRoofline

    shape = ModelShape.from_preset(get_preset("qwen3-vl-8b"))
    bare = dataclasses.replace(shape, vision_deepstack=0)

    def layer(s: ModelShape) -> float:
        rank = TensorParallelRoofline(s, DEVICES["H200"], tp=2, link=LINKS["H200"],
                                      mm_encoder_tp_mode=mode)
        return rank.encoder_layer(4096, 132) - super(TensorParallelRoofline, rank
                                                     ).encoder_layer(4096, 132)

    assert layer(shape) > layer(bare) > 0 if mode == "data" else layer(shape) != layer(bare)
