"""The launch's settled flags: bad input that stock or the mock data would fail on without a word
is one line naming the flag, before any process group."""

from __future__ import annotations

import pytest

from megatron_plugins.errors import UsageError
from tests.harness.mimo_runs import TINY_MIMO

LAYOUT = ["--encoder", "vision=vit", "--grid", "vision:dp=1", "--grid", "language:dp=2"]
NO_TOKENIZER = [flag for flag in TINY_MIMO if flag not in ("--tokenizer-type", "NullTokenizer")]


def _error(monkeypatch, flags: list[str]) -> str:
    from megatron_plugins.launch.pretrain import parse_mimo_args

    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(UsageError) as error:
        parse_mimo_args([*flags, *LAYOUT])
    assert "\n" not in str(error.value)
    return str(error.value)


def test_a_missing_tokenizer_folder_with_mock_data_names_the_flag(monkeypatch, tmp_path):
    message = _error(monkeypatch, [*NO_TOKENIZER, "--tokenizer-type", "HuggingFaceTokenizer",
                                   "--tokenizer-model", str(tmp_path / "none")])
    assert message.startswith(f"--tokenizer-model {tmp_path / 'none'}: no such folder")


@pytest.mark.parametrize("flag", ["--lr", "--min-lr"])
def test_a_non_finite_learning_rate_names_the_flag(monkeypatch, flag):
    message = _error(monkeypatch, [*TINY_MIMO, flag, "nan"])
    assert message == f"{flag} nan is not a finite number; give a learning rate such as {flag} 1e-4"


def test_a_stock_check_without_a_message_names_its_source_line(monkeypatch):
    """One that ``launch.stock_checks`` does not explain (tests/unit_tests/test_stock_checks.py
    walks those it does)."""
    message = _error(monkeypatch, [*TINY_MIMO, "--decoder-seq-length", "64"])
    assert message.startswith("stock Megatron argument check failed: assert "
                              "args.max_position_embeddings >= args.decoder_seq_length "
                              "(arguments.py:")


def test_language_cp_on_the_simulation_defaults_attention_dropout_to_zero(monkeypatch, capsys):
    """Stock's default attention dropout (0.1) would stop every CPU CP launch; unless given, it
    becomes 0 with a notice, while an explicit dropout is refused naming the flag."""
    from megatron_plugins.cpu_simulation import patches
    from megatron_plugins.launch.pretrain import parse_mimo_args

    patches.activate()  # stock validate_args reads the device's architecture at cp > 1
    monkeypatch.setenv("WORLD_SIZE", "3")
    at = TINY_MIMO.index("--attention-dropout")
    stock_dropout = TINY_MIMO[:at] + TINY_MIMO[at + 2:]
    cp2 = ["--encoder", "vision=vit", "--grid", "vision:", "--grid", "language:cp=2"]
    assert parse_mimo_args([*stock_dropout, *cp2]).args.attention_dropout == 0.0
    assert "--attention-dropout 0" in capsys.readouterr().err.split("defaults set")[1]
    at_cp1 = parse_mimo_args([*stock_dropout, *LAYOUT]).args
    assert at_cp1.attention_dropout == 0.1
    with pytest.raises(UsageError, match=r"^--attention-dropout 0.1: the context parallel "
                                         r"attention of .* pass --attention-dropout 0"):
        parse_mimo_args([*stock_dropout, *cp2, "--attention-dropout", "0.1"])


def test_the_documented_settle_steps_are_the_codes_in_order():
    import re

    from megatron_plugins.launch.settle import STEPS
    from tests.harness.multiprocess import REPO_ROOT

    text = (REPO_ROOT / "docs" / "architecture.md").read_text()
    section = text[text.index("## The path of one launch"):text.index("## Rooms")]
    documented = re.findall(r"^\d+\. `(\w+)`:", section, flags=re.M)
    assert documented == [step.__name__ for step in STEPS]


def test_the_padded_vocabulary_is_settled_and_in_the_language_config(monkeypatch):
    """Stock's tokenizer build set ``padded_vocab_size`` only at start-up, outside the record;
    the language config the run carries is built from the settled value."""
    from megatron_plugins.launch.pretrain import parse_mimo_args

    monkeypatch.setenv("WORLD_SIZE", "3")
    run = parse_mimo_args([*TINY_MIMO, *LAYOUT])
    assert run.args.padded_vocab_size == 128
    assert run.language.vocab_size == 128 and run.language.should_pad_vocab is False


def test_what_the_pre_import_checks_built_is_the_runs(monkeypatch):
    """An encoder at tp > 1 is built once, for its head count, on the namespace that becomes the
    run's args; the layout and the command line are not read again."""
    from megatron_plugins.launch.preflight import check_run
    from megatron_plugins.launch.pretrain import parse_mimo_args

    monkeypatch.setenv("WORLD_SIZE", "4")
    argv = [*TINY_MIMO, "--encoder", "vision=vit", "--grid", "vision:tp=2", "--grid",
            "language:dp=2"]
    checked = check_run(argv, 4)
    run = parse_mimo_args(checked=checked)
    assert run.plugins["vision"] is checked.plugins["vision"]
    assert run.plugins["vision"].args is run.args is checked.command_line.flags
    assert run.layout is checked.layout
