"""Start-up bridges (Gaps 1 and 7): canaries that the stock wheel still has each gap, and the
bridges' tests; the version warning and the start-up line naming the gaps bridged."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import megatron.core.datasets

from megatron_plugins import compat
from megatron_plugins.compat import MEGATRON_CORE_VERSION, startup


def test_gap1_canary_wheel_ships_prebuilt_helpers_but_no_makefile():
    datasets = Path(megatron.core.datasets.__file__).parent
    assert not (datasets / "Makefile").exists()
    assert startup.prebuilt_dataset_helpers_available()


def test_gap7_canary_stock_help_breaks_argparse_and_the_bridge_escapes_only_that_string():
    import argparse

    import pytest
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(prog="p", allow_abbrev=False))
    with pytest.raises(ValueError, match="unsupported format character"):
        parser.format_help()
    untouched = [action.help for action in parser._actions]
    assert startup.escape_unformattable_help(parser) == [
        "--moe-paged-stash-buffer-size-factor-cuda"]
    help_text = parser.format_help()
    assert "--moe-paged-stash-buffer-size-factor-cuda" in help_text
    changed = [action.option_strings for action, before in zip(parser._actions, untouched)
               if action.help != before]
    assert changed == [["--moe-paged-stash-buffer-size-factor-cuda"]]
    assert startup.escape_unformattable_help(parser) == []  # idempotent


def test_another_megatron_core_gives_one_warning_naming_the_canary_tests(monkeypatch, capsys):
    import megatron.core.datasets.utils as dataset_utils

    assert startup.megatron_core_version() == MEGATRON_CORE_VERSION  # this environment's wheel
    assert startup.version_warning() is None
    monkeypatch.setattr(startup, "megatron_core_version", lambda: "0.20.0")
    monkeypatch.setattr(sys, "argv", ["examples/mimo/pretrain_mimo.py"])
    assert startup.version_warning() == (
        "pretrain_mimo.py: warning: megatron-core 0.20.0 is installed, but the bridges of "
        "megatron_plugins.compat were written for 0.19.2; run their canary tests "
        "(pytest tests/unit_tests/compat) to see which gaps this release still has")
    # install() says it once per process, on rank 0 only.
    monkeypatch.setattr(dataset_utils, "compile_helpers", dataset_utils.compile_helpers)
    for rank, lines in (("1", 0), ("0", 1)):
        monkeypatch.setattr(startup, "_bridged", False)
        monkeypatch.setenv("RANK", rank)
        startup.install()
        startup.install()
        assert capsys.readouterr().err.splitlines() == [startup.version_warning()] * lines


def test_the_start_up_line_names_the_version_and_the_gaps_bridged_once_the_model_is_built(
        monkeypatch, capsys):
    from megatron.training.models.base import compose_hooks

    monkeypatch.setattr(compat, "_recorded", set())
    monkeypatch.setattr(sys, "argv", ["examples/mimo/pretrain_mimo.py"])
    quiet, config = SimpleNamespace(post_wrap_hooks=[]), SimpleNamespace(post_wrap_hooks=[])
    startup.announce_bridged_gaps(quiet, rank=1)
    startup.announce_bridged_gaps(config, rank=0)
    assert quiet.post_wrap_hooks == [] and capsys.readouterr().err == ""
    compat.record("24", "1")  # installed by the model build, before the hooks run
    model = object()
    assert compose_hooks(config.post_wrap_hooks)([model]) == [model]
    assert capsys.readouterr().err.splitlines() == [
        "pretrain_mimo.py: megatron-core 0.19.2; gaps bridged on rank 0: 1, 24 "
        "(index: megatron_plugins.compat.GAPS)"]
