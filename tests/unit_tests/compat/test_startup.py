"""Start-up bridges (Gaps 1 and 7): canaries that the stock wheel still has each gap, and the
bridges' tests."""

from __future__ import annotations

from pathlib import Path

import megatron.core.datasets

from megatron_plugins.compat import startup


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
