"""`spaceserve serve` engine flags reach the engine's config."""

from __future__ import annotations

import pytest


def test_mm_encoder_tp_mode_reaches_the_engine(monkeypatch, capsys):
    from spaceserve.server import app, engine_client, flags

    seen = {}

    def fake_load(model, **kw):
        seen.update(kw)
        raise ValueError("stop here")

    monkeypatch.setattr(engine_client, "load_engine", fake_load)
    assert app.main(["-tp", "2", "--mm-encoder-tp-mode", "replicate"]) == 2
    assert (seen["tensor_parallel_size"], seen["mm_encoder_tp_mode"]) == (2, "replicate")
    assert app.main([]) == 2 and seen["mm_encoder_tp_mode"] == "data"
    assert "stop here" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        flags.build_parser().parse_args(["--mm-encoder-tp-mode", "weights"])
