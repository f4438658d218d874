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


SM_BUDGET_FLAGS = ("--encoder-sms", "--encoder-splits", "--curves", "--sis-objective",
                   "--green-contexts")


def test_serve_help_lists_the_sm_budget_flags_and_defaults_in_their_own_sense() -> None:
    from spaceserve.server.flags import build_parser

    text = build_parser().format_help()
    for flag in SM_BUDGET_FLAGS:
        assert flag in text, flag
    assert "{auto,on,off}" in text and "{goodput,tpot}" in text
    prefix = text[text.index("  --no-prefix-caching"):]
    assert "(default: prefix caching on)" in prefix[:200], prefix[:200]
    assert "(default: True)" not in text and "(default: False)" not in text


def test_one_engine_and_replicas_get_the_same_engine_keywords(monkeypatch, capsys) -> None:
    """app.py and replicas/deploy.py build the engine's keywords with the one function."""
    from spaceserve.server import app, engine_client, flags
    from spaceserve.server.replicas import deploy

    argv = ["--mode", "spatial-static", "--encoder-sms", "48", "--green-contexts", "off",
            "--encoder-splits", "32,64", "--sis-objective", "tpot", "--max-num-seqs", "6",
            "--encoder-window-ms", "7", "--no-prefix-caching", "--max-images-per-request", "3"]
    one, replicas = {}, {}

    def fake_load(model, **kw):
        one.update(kw)
        raise ValueError("stop here")

    class FakeServer:
        def __init__(self, model, **kw):
            replicas.update(kw)
            raise ValueError("stop here")

    monkeypatch.setattr(engine_client, "load_engine", fake_load)
    monkeypatch.setattr(deploy, "DataParallelServer", FakeServer)
    assert app.main(argv) == 2
    assert deploy.main(flags.build_parser().parse_args(argv + ["-dp", "2"])) == 2
    assert one == {k: replicas[k] for k in one}
    assert (one["mode"], one["encoder_sms"], one["encoder_splits"]) == ("spatial-static", 48,
                                                                        (32, 64))
    assert (one["green_contexts"], one["sis_objective"], one["max_num_seqs"]) == ("off", "tpot",
                                                                                  6)
    assert one["encoder_window_s"] == 0.007 and one["enable_prefix_caching"] is False
    assert one["max_images_per_prompt"] == 3
    capsys.readouterr()


def _served(tiny_path, *argv: str):
    """(engine, client, app) of `spaceserve serve` flags on the tiny checkpoint, on CPU."""
    pytest.importorskip("fastapi", reason="the serve extra is not installed")
    from spaceserve.server.app import build_server
    from spaceserve.server.flags import build_parser

    args = build_parser().parse_args(["--model", str(tiny_path), "--device", "cpu",
                                      "--num-kv-blocks", "64", "--max-num-seqs", "4", *argv])
    engine, client, app, _ = build_server(args)
    return engine, client, app


def test_spatial_static_with_encoder_sms_48_reports_the_split_in_metrics(tiny_path) -> None:
    pytest.importorskip("uvicorn", reason="the serve extra is not installed")
    import httpx

    from spaceserve.server.app import ServerThread

    engine, client, app = _served(tiny_path, "--mode", "spatial-static", "--encoder-sms", "48")
    try:
        assert engine.config.encoder_sms == 48
        with ServerThread(app) as server:
            text = httpx.get(f"{server.url}/metrics", timeout=30).text
    finally:
        client.close()
        engine.close()
    total = engine.device_sms
    assert "spaceserve:encoder_sms 48.0" in text, text
    assert f"spaceserve:decoder_sms {float(total - 48)!r}" in text
    assert 'spaceserve:mode_info{mode="spatial-static"} 1' in text


@pytest.fixture(scope="module")
def profiled_curves(tmp_path_factory):
    """A curves file as `spaceserve profile` writes it: the tiny model on the CPU, two SM
    counts (a few seconds)."""
    from autotune.profile import main as profile

    out = tmp_path_factory.mktemp("profile")
    assert profile(["--model", "tiny", "--out", str(out), "--sms", "8,132", "--no-progress",
                    "--device", "cpu"]) == 0
    return out / "curves.json"


def test_a_profiled_curves_file_is_accepted(tiny_path, profiled_curves, capsys) -> None:
    engine, client, _ = _served(tiny_path, "--mode", "spatial", "--curves", str(profiled_curves),
                                "--encoder-splits", "32,64", "--green-contexts", "auto")
    try:
        assert engine.config.curves == str(profiled_curves.resolve())
        assert engine.config.encoder_splits == (32, 64)
    finally:
        client.close()
        engine.close()


@pytest.mark.parametrize("field,spoil", [
    ("$.device.num_sms", lambda d: d["device"].update(num_sms="many")),
    ("$.contention", lambda d: d.pop("contention")),
    ("$.curves.decode.sms", lambda d: d["curves"]["decode"].update(sms=[])),
])
def test_a_malformed_curves_file_is_refused_at_start_naming_file_and_field(
        tmp_path, profiled_curves, field, spoil, monkeypatch, capsys) -> None:
    import json

    from spaceserve.server import app, engine_client, flags
    from spaceserve.server.replicas import deploy

    data = json.loads(profiled_curves.read_text())
    spoil(data)
    bad = tmp_path / "bad-curves.json"
    bad.write_text(json.dumps(data))
    loaded = []

    def reached(*a, **k):
        loaded.append(1)
        raise ValueError("an engine was about to be loaded")

    monkeypatch.setattr(engine_client, "load_engine", reached)
    monkeypatch.setattr(deploy, "DataParallelServer", reached)
    argv = ["--mode", "spatial", "--curves", str(bad)]
    assert app.main(argv) == 2
    err = capsys.readouterr().err
    assert f"--curves {bad}" in err and field in err, err
    assert deploy.main(flags.build_parser().parse_args(argv + ["-dp", "2"])) == 2
    err = capsys.readouterr().err
    assert f"--curves {bad}" in err and field in err, err
    assert not loaded  # refused before any engine is loaded


def test_a_missing_curves_file_is_refused(tmp_path, capsys) -> None:
    from spaceserve.server import app

    missing = tmp_path / "nowhere.json"
    assert app.main(["--curves", str(missing)]) == 2
    assert f"--curves {missing}: cannot read it" in capsys.readouterr().err


def test_green_contexts_on_is_refused_at_start_without_them(tiny_path, capsys) -> None:
    from spaceserve.server import app

    assert app.main(["--model", str(tiny_path), "--device", "cpu", "--mode", "spatial-static",
                     "--green-contexts", "on"]) == 2
    assert "green_contexts='on'" in capsys.readouterr().err
