"""Engine arguments declared once (`runtime/engine/args.py`): flags built from `EngineConfig`'s
fields, read back into the same config, one default-backend rule, green contexts auto/on/off."""

from __future__ import annotations

import argparse
from dataclasses import fields

import pytest
import torch

from spaceserve.cli_args import HelpFormatter
from spaceserve.runtime.engine.args import (
    SERVE_FIELDS,
    SM_BUDGET_FIELDS,
    add_engine_args,
    engine_config,
    engine_fields,
    engine_kwargs,
)
from spaceserve.runtime.engine.assemble import (
    attention_backend_for,
    check_green_contexts,
    check_green_partitions,
)
from spaceserve.runtime.engine.config import EngineConfig, default_attention_backend

ALL = tuple(engine_fields())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t", formatter_class=HelpFormatter)
    add_engine_args(p, ALL)
    return p


def test_every_field_is_documented_once_and_every_flag_declared_beside_it() -> None:
    for f in fields(EngineConfig):
        assert f.metadata.get("doc"), f"EngineConfig.{f.name} has no doc"
    assert set(SERVE_FIELDS + SM_BUDGET_FIELDS) <= set(ALL)


def test_no_flag_given_builds_the_default_config() -> None:
    """The flags' defaults are the fields' (in the flag's unit): nothing restated."""
    args = parser().parse_args([])
    assert engine_config(args, ALL) == EngineConfig()
    assert args.encoder_window_ms == EngineConfig.encoder_window_s * 1e3
    assert args.prefix_caching is True and args.green_contexts == "auto"


def test_flags_reach_the_config_in_the_fields_units() -> None:
    args = parser().parse_args([
        "--mode", "spatial", "--encoder-sms", "48", "--encoder-splits", "32, 64,96",
        "--sis-objective", "tpot", "--green-contexts", "off", "--encoder-window-ms", "5",
        "--no-prefix-caching", "-tp", "1", "--slo", "ttft:900"])
    cfg = engine_config(args, ALL)
    assert (cfg.mode, cfg.encoder_sms, cfg.encoder_splits) == ("spatial", 48, (32, 64, 96))
    assert (cfg.sis_objective, cfg.green_contexts, cfg.encoder_window_s) == ("tpot", False, 0.005)
    assert cfg.enable_prefix_caching is False and cfg.slo.ttft == 900
    # only the fields asked for
    assert set(engine_kwargs(args, ("encoder_sms",))) == {"encoder_sms"}


def test_bad_flag_values_are_refused_by_name(capsys) -> None:
    for argv, needle in ((["--encoder-splits", "32,x"], "'x' is not an integer"),
                         (["--green-contexts", "maybe"], "--green-contexts"),
                         (["--sis-objective", "speed"], "--sis-objective")):
        with pytest.raises(SystemExit):
            parser().parse_args(argv)
        assert needle in capsys.readouterr().err
    with pytest.raises(ValueError, match="encoder_sms"):
        engine_config(parser().parse_args(["--encoder-sms", "0"]), ALL)


def test_green_contexts_auto_on_off_and_the_old_bools() -> None:
    assert EngineConfig().green_contexts is True and EngineConfig().green_contexts_mode == "auto"
    assert EngineConfig(green_contexts="auto").green_contexts is True
    assert EngineConfig(green_contexts="off").green_contexts is False
    assert EngineConfig(green_contexts=False).green_contexts_mode == "off"
    assert EngineConfig(green_contexts="on").green_contexts_mode == "on"
    with pytest.raises(ValueError, match="green_contexts"):
        EngineConfig(green_contexts="sometimes")


def test_green_contexts_on_is_refused_where_there_are_none() -> None:
    cpu = torch.device("cpu")
    for mode in ("spatial", "spatial-static"):
        with pytest.raises(ValueError, match="green_contexts='on'.*no green contexts"):
            check_green_contexts(EngineConfig(mode=mode, green_contexts="on"), cpu)
        check_green_contexts(EngineConfig(mode=mode), cpu)  # auto: falls back
    check_green_contexts(EngineConfig(mode="temporal", green_contexts="on"), cpu)  # unpartitioned


def test_green_contexts_on_is_refused_when_every_split_fell_back() -> None:
    from types import SimpleNamespace as NS

    def engine(green: bool, shared: bool = False):
        pset = NS(green=green, shared=shared, reason="probe refused split 48")
        return NS(spatial=NS(partitions=pset))

    on = EngineConfig(mode="spatial-static", green_contexts="on")
    with pytest.raises(ValueError, match="no split became a green context: probe refused"):
        check_green_partitions(on, engine(False))
    check_green_partitions(on, engine(True))
    check_green_partitions(EngineConfig(mode="spatial-static"), engine(False))  # auto
    check_green_partitions(on, NS(spatial=None))  # no partitions (a temporal engine)


def test_one_default_attention_backend_rule() -> None:
    assert default_attention_backend("spatial", "cuda") == "triton"
    assert default_attention_backend("temporal", "cuda") == "triton"
    assert default_attention_backend("shared", "cuda") == "torch"
    assert default_attention_backend("spatial", "cpu") == "torch"
    assert attention_backend_for("temporal", torch.device("cpu")) == "torch"
    assert attention_backend_for("temporal", torch.device("cpu"), "triton") == "triton"
    with pytest.raises(ValueError, match="attention_backend"):
        attention_backend_for("temporal", torch.device("cpu"), "magic")
