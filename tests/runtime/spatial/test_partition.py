"""SM partitions: the logged fallback to kernel budgets, split budgets and switching, programs per
SM inside a green partition (and nowhere else), and the SM probe (GPU; a clear skip on CPU)."""

import logging
import threading

import pytest
import torch

from spaceserve.kernels import record_launches, rms_norm
from spaceserve.kernels.budget import current_programs_per_sm, device_num_sms, programs_per_sm_scope
from spaceserve.kernels.smprobe import (
    SmProbeUnavailable,
    launch_smprobe,
    overlap_fraction,
    probe_available,
    probe_report,
    probe_sms,
    probe_times,
)
from spaceserve.kernels.testing import assert_within_budget
from spaceserve.runtime.spatial import partition
from spaceserve.runtime.spatial.partition import Partition, PartitionSet, default_splits
from spaceserve.runtime.spatial.partition_probe import green_stream_facts


@pytest.fixture
def fresh_log():
    """Forget that the fallback was logged, so this test sees its one line."""
    saved = set(partition._LOGGED)
    partition._LOGGED.clear()
    yield
    partition._LOGGED.clear()
    partition._LOGGED.update(saved)


def test_fallback_is_logged_once_and_budgets_are_the_requested_splits(caplog, fresh_log):
    total = device_num_sms("cpu")
    with caplog.at_level(logging.WARNING, logger="spaceserve.runtime"):
        a = PartitionSet("cpu", [64, 32, 96], programs_per_sm=2)
        b = PartitionSet("cpu", [48])
    lines = [r for r in caplog.records if "green contexts unavailable" in r.getMessage()]
    assert len(lines) == 1 and "kernel budgets" in lines[0].getMessage()
    assert a.reason == b.reason == "no CUDA device" and not a.green
    assert sorted(a.splits) == [32, 64, 96]
    for e, p in a.splits.items():
        assert (p.requested, p.encoder_sms, p.decoder_sms) == (e, e, total - e)
        assert not p.green and p.encoder_stream is None and p.decoder_stream is None
    assert a.full.decoder_sms == total and a.get(0) is a.full and a.current is a.full
    assert [p.requested for p in a.partitions()] == [0, 32, 64, 96]
    assert a.switch(a.get(64)) is a.full and a.current is a.get(64)
    assert a.decoder_streams() == []
    assert a.describe()["splits"][64] == {"encoder_sms": 64, "decoder_sms": total - 64,
                                          "green": False}


class FakeGreen(PartitionSet):
    """Green contexts as a driver would grant them (groups rounded up to 8 SMs, a group
    rounding past the device refused), with no driver: the per-split logic runs on CPU."""

    def _support(self):
        return None

    def _green(self, e, programs_per_sm):
        granted = -(-e // 8) * 8
        if granted >= self.total:
            raise RuntimeError(f"the driver granted {granted} + 0 SMs of {self.total}")
        return Partition(e, granted, self.total - granted, True,
                         programs_per_sm=programs_per_sm)


def test_a_failing_probe_falls_back_for_its_split_only(caplog, fresh_log):
    total = device_num_sms("cpu")
    probed = []

    def probe(part, device):
        probed.append(part.requested)
        if part.requested == 60:
            raise RuntimeError("SM probe: encoder: 70 SMs (budget 64); 6 SMs shared")
        return f"encoder: {part.encoder_sms} SMs; disjoint"

    with caplog.at_level(logging.WARNING, logger="spaceserve.runtime"):
        pset = FakeGreen("cpu", [30, 60, 100, total - 1], probe=probe, programs_per_sm=2)
    assert probed == [30, 60, 100]  # the split rounding past the device never got a partition
    assert pset.green and pset.reason is None
    ok = pset.get(30)
    # budgets are the granted counts, not the requested ones
    assert (ok.green, ok.encoder_sms, ok.decoder_sms) == (True, 32, total - 32)
    assert ok.programs_per_sm == 2 and ok.probe.startswith("encoder: 32")
    assert pset.get(100).green and pset.get(100).encoder_sms == 104
    for e in (60, total - 1):  # each falls back alone, to its requested budgets
        p = pset.get(e)
        assert (p.green, p.encoder_sms, p.decoder_sms) == (False, e, total - e)
        assert p.programs_per_sm == 1 and p.reason
    assert "shared" in pset.get(60).reason and "granted" in pset.get(total - 1).reason
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "split 60 " in lines[0] and "kernel budgets alone" in lines[0]
    assert f"split {total - 1} " in lines[1]
    desc = pset.describe()["splits"]
    assert desc[30]["encoder_sms"] == 32 and desc[30]["green"] and "probe" in desc[30]
    assert desc[60] == {"encoder_sms": 60, "decoder_sms": total - 60, "green": False,
                        "reason": "RuntimeError: SM probe: encoder: 70 SMs (budget 64); 6 SMs "
                                  "shared"}
    with pset.get(60).encoder_scope():
        assert current_programs_per_sm() == 1


def test_every_split_refused_says_so(fresh_log):
    def probe(part, device):
        raise RuntimeError("launch failed")

    pset = FakeGreen("cpu", [16, 32], probe=probe)
    assert not pset.green and "every split" in pset.reason
    assert all(not p.green and "launch failed" in p.reason for p in pset.splits.values())


@pytest.mark.parametrize("bad", [[0], [device_num_sms("cpu")], [8, "16"], [True]])
def test_bad_splits_raise_naming_the_argument(bad):
    with pytest.raises(ValueError, match="encoder_splits"):
        PartitionSet("cpu", bad)


def test_unknown_split_and_bad_programs_per_sm_raise():
    pset = PartitionSet("cpu", [32])
    with pytest.raises(ValueError, match="encoder_sms=40"):
        pset.get(40)
    with pytest.raises(ValueError, match="programs_per_sm"):
        PartitionSet("cpu", [32], programs_per_sm=0)
    with pytest.raises(ValueError, match="programs_per_sm"):
        with programs_per_sm_scope(0):
            pass


def test_default_splits_are_multiples_of_eight():
    assert default_splits(132) == (32, 64, 96)
    assert default_splits(114) == (32, 56, 88)
    assert all(0 < e < 16 for e in default_splits(16))


def test_shared_mode_is_one_whole_device_partition():
    pset = PartitionSet("cpu", shared=True)
    total = device_num_sms("cpu")
    assert pset.splits == {} and pset.get(64) is pset.full
    assert (pset.full.encoder_sms, pset.full.decoder_sms) == (total, total)


def _norm(x, w, budget):
    return rms_norm(x, w, 1e-6, num_sms=budget)


def test_programs_per_sm_only_inside_a_green_partition():
    x, w = torch.randn(224, 32), torch.randn(32)  # 7 row tiles
    ref = _norm(x, w, 2)
    green = Partition(16, 2, 4, green=True, programs_per_sm=3)
    plain = PartitionSet("cpu", [2], programs_per_sm=3).get(2)  # fallback: budgets alone
    with record_launches() as launches:
        with green.encoder_scope():
            a = _norm(x, w, 2)
            seen: list[int] = []
            t = threading.Thread(target=lambda: seen.append(current_programs_per_sm()))
            t.start()
            t.join()
        with plain.encoder_scope():
            b = _norm(x, w, 2)
        c = _norm(x, w, 2)
    assert seen == [1], "the scope leaked into another thread"
    assert current_programs_per_sm() == 1
    assert [(r.grid, r.programs_per_sm) for r in launches] == [((6,), 3), ((2,), 1), ((2,), 1)]
    assert_within_budget(launches, 2)
    assert torch.equal(a, ref) and torch.equal(b, ref) and torch.equal(c, ref)


def test_capture_scope_without_green_contexts_only_sets_the_scope():
    pset = PartitionSet("cpu", [32], programs_per_sm=2)
    with pset.capture_scope(pset.get(32)):
        assert current_programs_per_sm() == 1


def test_sm_probe_skips_clearly_on_cpu():
    if torch.cuda.is_available():
        pytest.skip("CPU-only check")
    why = probe_available("cpu")
    assert why is not None and "interpreter" in why and "inline" in why
    with pytest.raises(SmProbeUnavailable, match="inline"):
        probe_sms(8, device="cpu")
    with pytest.raises(SmProbeUnavailable):
        launch_smprobe(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(SmProbeUnavailable, match="inline"):
        probe_times(8, device="cpu")
    with pytest.raises(RuntimeError, match="CUDA"):
        green_stream_facts(PartitionSet("cpu", [32]), 32)


def test_overlap_fraction_of_two_time_probes():
    a = torch.tensor([[1000, 5000, 0], [1200, 4000, 1]])  # span 1000..5000 ns
    inside = [[2000, 3000, 7], [2500, 3500, 8]]  # 2000..3500: entirely while a ran
    assert overlap_fraction(a, inside)["overlap_fraction"] == 1.0
    after = [[5000, 9000, 7]]  # one after the other
    assert overlap_fraction(a, after)["overlap_fraction"] == 0.0
    half = overlap_fraction(a, [[3000, 7000, 7]])  # 2000 of 4000 ns together
    assert half == {"overlap_fraction": 0.5, "a_us": 4.0, "b_us": 4.0, "start_gap_us": 2.0}
    with pytest.raises(ValueError, match="unwritten"):
        overlap_fraction(a, [[-1, -1, -1]])


def test_probe_report_finds_shared_sms():
    rep = probe_report({"encoder": [0, 1, 1, 2], "decoder": torch.tensor([5, 6, 7])},
                       {"encoder": 3, "decoder": 2})
    assert rep.disjoint and rep.sms["encoder"] == (0, 1, 2)
    assert not rep.within_budgets()  # the decoder ran on 3 SMs under a budget of 2
    clash = probe_report({"encoder": [0, 1], "decoder": [1, 2]})
    assert clash.shared == (1,) and "1 SMs shared" in clash.summary()
    with pytest.raises(ValueError, match="unwritten"):
        probe_report({"encoder": [0, -1]})


@pytest.mark.gpu
def test_green_stream_facts_on_one_split():
    pset = PartitionSet("cuda", [64])
    try:
        facts = green_stream_facts(pset, 64)
        assert facts["ok"], facts
        part = pset.get(64)
        assert (facts["encoder_sms"], facts["decoder_sms"]) == (part.encoder_sms,
                                                                 part.decoder_sms)
        assert 0.0 <= facts["overlap_fraction"] <= 1.0
        if pset.green:
            assert facts["concurrent"]["disjoint"], facts
            assert facts["overlap_fraction"] > 0.5, facts  # two partitions run together
    finally:
        pset.close()


@pytest.mark.gpu
def test_green_partitions_never_share_an_sm():
    pset = PartitionSet("cuda", [32, 64])
    try:
        for e in (32, 64):
            part = pset.get(e)
            pset.switch(part)
            outs = {}
            for name, budget, scope in (("encoder", part.encoder_sms, part.encoder_scope),
                                        ("decoder", part.decoder_sms, part.decoder_scope)):
                with scope():
                    outs[name] = probe_sms(budget, spin=1 << 16)
            torch.cuda.synchronize()
            rep = probe_report(outs, {"encoder": part.encoder_sms, "decoder": part.decoder_sms})
            assert rep.within_budgets(), rep.summary()
            if pset.green:
                assert rep.disjoint, rep.summary()
    finally:
        pset.close()


def test_probe_partition_refuses_shared_or_over_budget_sms(monkeypatch):
    """The default probe's verdict on SM ids (the kernel itself needs a GPU: faked here)."""
    import contextlib

    from spaceserve.kernels import smprobe
    from spaceserve.runtime.spatial import partition_probe
    from spaceserve.runtime.spatial.partition_probe import probe_partition

    class Stream:
        synced = 0

        def synchronize(self):
            Stream.synced += 1

    class Part:
        encoder_sms, decoder_sms = 2, 3
        encoder_stream = decoder_stream = Stream()
        encoder_scope = decoder_scope = staticmethod(contextlib.nullcontext)

    sms, handed = {}, []
    monkeypatch.setattr(partition_probe, "_hand_offs", lambda part, device: handed.append(part))
    monkeypatch.setattr(smprobe, "probe_available", lambda device=None: None)
    monkeypatch.setattr(smprobe, "probe_sms", lambda budget, **kw: torch.tensor(sms[budget]))
    sms.update({2: [0, 1, 1, 0], 3: [4, 5, 6, 4, 5, 6]})
    assert probe_partition(Part(), torch.device("cpu")).endswith("disjoint")
    assert Stream.synced == 2 and len(handed) == 1  # event hand-offs exercised first
    sms[3] = [1, 5, 6, 5, 6, 6]  # an SM of the encoder's
    with pytest.raises(RuntimeError, match="1 SMs shared"):
        probe_partition(Part(), torch.device("cpu"))
    sms.update({2: [0, 1, 2, 0], 3: [4, 5, 6, 4, 5, 6]})  # 3 SMs under a budget of 2
    with pytest.raises(RuntimeError, match="budget 2"):
        probe_partition(Part(), torch.device("cpu"))
    sms[2] = [0, -1, 1, 0]  # a tile that never ran
    with pytest.raises(ValueError, match="unwritten"):
        probe_partition(Part(), torch.device("cpu"))
