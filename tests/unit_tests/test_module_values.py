"""The per-module ``NAME=VALUE`` flags are parsed into a dict once, by one parser, and a bad
value is one line naming the flag, whichever flag it is."""

from __future__ import annotations

import argparse

import pytest

from megatron_plugins.errors import FlagError
from megatron_plugins.launch.preflight import read_command_line
from megatron_plugins.parallel.layout import LayoutError
from megatron_plugins.parallel.module_values import ModuleValues, module_values

FLAGS = ["--encoder-hf-weights", "--encoder-megatron-checkpoint"]


def test_the_launch_reads_every_per_module_flag_into_a_dict():
    flags = read_command_line([
        "--encoder", "vision=vit audio=audio", "--encoder-hf-weights", "vision=/hf/a",
        "--encoder-hf-weights=audio=/hf/b", "--encoder-megatron-checkpoint", "vision=/ckpt",
        "--lr", "1e-3"]).flags
    assert flags.mimo_encoders == {"vision": "vit", "audio": "audio"}
    assert flags.encoder_hf_weights == {"vision": "/hf/a", "audio": "/hf/b"}
    assert flags.encoder_megatron_checkpoint == {"vision": "/ckpt"}
    assert read_command_line([]).flags.encoder_hf_weights == {}


@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize("value, message", [
    ("vision", "{flag} vision: expected NAME=DIR"),
    ("=/hf", "{flag} =/hf: no name before '='; expected NAME=DIR"),
    ("vision=", "{flag} vision=: nothing after '='; expected NAME=DIR"),
], ids=["no-equals", "no-name", "no-value"])
def test_a_bad_value_is_one_line_naming_the_flag(flag, value, message):
    with pytest.raises(FlagError) as error:
        read_command_line([flag, value])
    assert str(error.value) == message.format(flag=flag)


@pytest.mark.parametrize("flag", FLAGS)
def test_a_name_given_twice_is_refused(flag):
    with pytest.raises(FlagError) as error:
        read_command_line([flag, "vision=/a", flag, "vision=/b"])
    assert str(error.value) == f"{flag} vision given twice; give each encoder once"


def test_the_encoder_flag_takes_words_and_raises_layout_errors():
    with pytest.raises(LayoutError, match="^--encoder a given twice; give each encoder once$"):
        read_command_line(["--encoder", "a=vit a=audio"])
    with pytest.raises(LayoutError, match="^--encoder vit: expected NAME=PROVIDER \\(e.g. "):
        read_command_line(["--encoder", "vit"])


def test_an_action_of_ones_own_parser_gives_the_same_dict_and_errors():
    parser = argparse.ArgumentParser()
    parser.add_argument("--weights", action=ModuleValues, metavar="NAME=DIR")
    assert parser.parse_args(["--weights", "a=x y", "--weights", "b=z"]).weights == {
        "a": "x y", "b": "z"}  # without words=True a value keeps its spaces
    assert parser.parse_args([]).weights == {}
    with pytest.raises(FlagError, match="^--weights a given twice"):
        parser.parse_args(["--weights", "a=x", "--weights", "a=y"])


def test_older_runs_saved_name_value_strings_and_read_the_same():
    assert module_values(["vision=vit", "audio=audio"], "--encoder") == {
        "vision": "vit", "audio": "audio"}
    assert module_values({"vision": "vit"}, "--encoder") == {"vision": "vit"}
    assert module_values(None, "--encoder") == {}
    with pytest.raises(LayoutError, match="^--encoder vision given twice"):
        module_values(["vision=vit", "vision=audio"], "--encoder", LayoutError)
