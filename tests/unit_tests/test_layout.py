"""Layout flags, parsing and validation: a bad layout fails with one LayoutError naming its flag."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import shlex

import pytest

from megatron_plugins.parallel.layout import LANGUAGE, LayoutError, ModulePlacement, ParallelLayout
from megatron_plugins.parallel.flags import (
    add_layout_args,
    language_grid_flags,
    language_world_size,
    layout_from_args,
    required_world_size,
)
from tests.harness.multiprocess import run_in_processes


def parse(command: str, **model: object) -> argparse.Namespace:
    """Layout flags from a command line, plus stock model attributes given as keywords."""
    parser = add_layout_args(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args(shlex.split(command))
    for name, value in model.items():
        setattr(args, name, value)
    return args


TWO_BY_TWO = "--encoder vision=vit --grid vision:dp=2 --grid language:tp=2"

# (id, flags, world size, stock model attributes, encoder heads, text the message must contain)
BAD_LAYOUTS = [
    ("world-size", TWO_BY_TWO, 6, {}, None, "WORLD_SIZE / --nproc-per-node is 6"),
    ("zero", "--grid language:tp=0", 1, {}, None, "--grid language:tp=0: tp=0"),
    ("fraction", "--grid language:dp=1.5", 1, {}, None, "--grid language:dp=1.5: dp=1.5"),
    ("negative", "--grid language:pp=-1", 1, {}, None, "--grid language:pp=-1: pp=-1"),
    ("not-a-number", "--grid language:tp=two", 1, {}, None, "--grid language:tp=two: tp=two"),
    ("unknown-key", "--grid language:tp=1,xp=2", 1, {}, None, "unknown key 'xp'"),
    ("no-colon", "--grid language", 1, {}, None, "--grid language: expected NAME:"),
    ("no-equals", "--grid language:tp2", 1, {}, None, "--grid language:tp2: expected key=value"),
    ("repeated-key", "--grid language:tp=1,tp=2", 1, {}, None, "tp given twice"),
    ("bad-name", "--grid 1st:tp=1 --grid language:", 2, {}, None, "--grid 1st:tp=1"),
    ("encoder-syntax", "--encoder vit --grid language:", 1, {}, None, "--encoder vit: expected"),
    ("encoder-provider", "--encoder 'v=my-pkg' --grid language:", 1, {}, None,
     "--encoder v=my-pkg"),
    ("encoder-twice", "--encoder v=vit --encoder v=audio --grid v: --grid language:", 2, {}, None,
     "--encoder v given twice"),
    ("grid-twice", "--encoder v=vit --grid v: --grid v:dp=2 --grid language:", 4, {}, None,
     "--grid v given twice"),
    ("encoder-without-grid", "--encoder v=vit --encoder a=audio --grid v: --grid language:", 2, {},
     None, "--encoder a has no --grid"),
    ("grid-without-encoder", "--encoder v=vit --grid v: --grid a: --grid language:", 3, {}, None,
     "--grid a has no --encoder"),
    ("no-language", "--encoder v=vit --grid v:dp=2", 2, {}, None, "--grid language is missing"),
    ("language-not-last", "--encoder v=vit --grid language: --grid v:", 2, {}, None,
     "--grid language must come last"),
    ("encoder-called-language", "--encoder language=vit --grid language:", 1, {}, None,
     "--encoder language=vit"),
    ("expert-tiling", "--grid language:tp=2,ep=4", 2, {"num_experts": 8}, None,
     "--grid language: ep=4 x etp=1 = 4 does not divide tp*cp*dp = 2"),
    ("expert-tiling-etp", "--grid language:dp=2,ep=2,etp=2", 2, {"num_experts": 8}, None,
     "--grid language: ep=2 x etp=2 = 4"),
    ("ep-without-experts", "--grid language:dp=2,ep=2", 2, {}, None,
     "--grid language: ep=2 needs an MoE language model; add --num-experts"),
    ("experts-not-divisible", "--grid language:dp=4,ep=4", 4, {"num_experts": 6}, None,
     "--num-experts 6 is not divisible by --grid language: ep=4"),
    ("heads", "--grid language:tp=3", 3, {"num_attention_heads": 4}, None,
     "--grid language: tp=3 does not divide --num-attention-heads 4; choose tp in {1, 2, 4}"),
    ("query-groups", "--grid language:tp=4", 4,
     {"num_attention_heads": 8, "num_query_groups": 3, "group_query_attention": True}, None,
     "--grid language: tp=4 is neither a multiple nor a divisor of --num-query-groups 3"),
    ("encoder-heads", "--encoder v=vit --grid v:tp=3 --grid language:", 4, {}, {"v": 16},
     "--grid v: tp=3 does not divide the v encoder's attention heads 16; choose tp in "
     "{1, 2, 4, 8, 16}"),
    ("encoder-pp", "--encoder v=vit --grid v:pp=2 --grid language:", 3, {}, None,
     "--grid v: pp=2: encoder pipeline parallelism is not supported yet"),
    ("encoder-cp", "--encoder v=vit --grid v:cp=2 --grid language:", 3, {}, None,
     "--grid v: cp=2: encoder context parallelism is not supported yet"),
    ("cp-seq-length", "--grid language:cp=2", 2, {"seq_length": 30}, None,
     "--seq-length 30 is not a multiple of 4: --grid language: cp=2 cuts every row into 2 x cp "
     "= 4 equal context-parallel chunks; choose --seq-length 28 or 32"),
    ("cp-seq-length-short", "--grid language:cp=4", 4, {"seq_length": 6}, None,
     "--seq-length 6 is not a multiple of 8: --grid language: cp=4 cuts every row into 2 x cp "
     "= 8 equal context-parallel chunks; choose --seq-length 8"),
    ("cp-sequence-parallel", "--grid language:tp=2,cp=2", 4,
     {"seq_length": 36, "sequence_parallel": True}, None,
     "--seq-length 36 is not a multiple of 8: --grid language: cp=2 cuts every row into 2 x cp "
     "= 4 equal context-parallel chunks and --sequence-parallel splits each CP rank's share "
     "over tp=2; choose --seq-length 32 or 40"),
    ("sequence-parallel", "--grid language:tp=2,dp=2", 4,
     {"seq_length": 33, "sequence_parallel": True}, None,
     "--seq-length 33 is not a multiple of 2: --sequence-parallel splits every row over the 2 "
     "tensor-parallel ranks of --grid language: tp=2; choose --seq-length 32 or 34"),
    ("sequence-parallel-packed", "--grid language:tp=4", 4,
     {"seq_length": 66, "sequence_parallel": True, "pack_sequences": True}, None,
     "--seq-length 66 is not a multiple of 4: --sequence-parallel splits every row over the 4 "
     "tensor-parallel ranks of --grid language: tp=4; choose --seq-length 64 or 68"),
    ("cp-packed", "--grid language:cp=2", 2, {"seq_length": 66, "pack_sequences": True}, None,
     "--seq-length 66 is not a multiple of 4: --grid language: cp=2 cuts every row into 2 x cp "
     "= 4 equal context-parallel chunks (--pack-sequences pads each packed sample to a multiple "
     "of 4 too); choose --seq-length 64 or 68"),
    ("cp-a2a+p2p", "--grid language:cp=2", 2, {"cp_comm_type": ["p2p", "a2a+p2p"]}, None,
     "--cp-comm-type a2a+p2p with --grid language: cp=2 needs Megatron's global hierarchical CP "
     "groups, which disjoint grids do not create; use p2p, all_gather or a2a"),
    ("cp-hybrid", "--grid language:cp=2", 2, {"hybrid_context_parallel": True}, None,
     "--hybrid-context-parallel with --grid language: cp=2 needs Megatron's global hybrid DP x "
     "CP groups"),
    ("cp-alias-seq-length", "--llm-cp 2", 3, {"seq_length": 10}, None,
     "--seq-length 10 is not a multiple of 4: --grid language (from --llm-"),
    ("encoder-ep", "--encoder v=vit --grid v:dp=2,ep=2 --grid language:", 3, {}, None,
     "--grid v: ep=2: expert parallelism is only supported for the language model"),
    ("bridge-dp", "--encoder v=vit --grid v:dp=3 --grid language:dp=2", 5, {}, None,
     "--grid v: dp=3 and --grid language: dp=2 must be multiples of one another"),
    ("gtp", "--grid language:tp=2", 2, {"tensor_parallel_num_weight_shards": 4}, None,
     "--tensor-parallel-num-weight-shards 4 enables GTP weight sharding"),
    ("expert-gtp", "--grid language:dp=2,ep=2", 2,
     {"num_experts": 4, "expert_tensor_parallel_num_weight_shards": 2}, None,
     "--expert-tensor-parallel-num-weight-shards 2 enables GTP"),
    ("alias-with-grid", "--llm-tp 2 --grid language:tp=2", 2, {}, None,
     "--llm-tp cannot be combined with --grid"),
    ("alias-two-encoders", "--encoder a=vit --encoder b=audio --llm-tp 2", 4, {}, None,
     "--llm-tp describes a single encoder"),
    ("alias-value", "--llm-tp x", 2, {}, None, "--llm-tp x must be a positive integer"),
    ("alias-heads", "--llm-tp 3", 4, {"num_attention_heads": 4}, None,
     "--grid language (from --llm-tp/"),
    # Colocated (hosted) encoders, issue 28: every rule names the whole --grid value.
    ("host-not-language", "--encoder v=vit --encoder a=audio --grid v:dp=1@a --grid a: "
     "--grid language:", 2, {}, None,
     "--grid v:dp=1@a: an encoder can share only the language model's ranks; use @language or "
     "drop @a"),
    ("host-unknown", "--encoder v=vit --grid v:@nowhere --grid language:", 1, {}, None,
     "--grid v:@nowhere: an encoder can share only the language model's ranks; use @language "
     "or drop @nowhere"),
    ("host-itself", "--encoder v=vit --grid v:@v --grid language:", 1, {}, None,
     "--grid v:@v: an encoder can share only the language model's ranks; use @language or "
     "drop @v"),
    ("language-hosted", "--encoder v=vit --grid v:dp=2 --grid language:dp=2@v", 4, {}, None,
     "--grid language:dp=2@v: the language model hosts colocated encoders; it cannot be placed "
     "on another module; drop @v"),
    ("host-empty", "--encoder v=vit --grid v:dp=2@ --grid language:dp=2", 2, {}, None,
     "--grid v:dp=2@: expected NAME:key=value,...@HOST, HOST a module name (e.g. --grid "
     "v:dp=2@language)"),
    ("host-before-sizes", "--encoder v=vit --grid v@language:dp=2 --grid language:dp=2", 2, {},
     None, "--grid v@language:dp=2: expected NAME:key=value,...@HOST, HOST a module name (e.g. "
     "--grid v:dp=2@language)"),
    ("hosted-size", "--encoder vision=vit --grid vision:dp=2@language --grid language:tp=2,dp=2",
     4, {}, None,
     "--grid vision:dp=2@language: colocated on language's 4 ranks, tp x dp must be 4 (is 2); "
     "e.g. vision:dp=4@language or vision:tp=2,dp=2@language"),
    ("hosted-size-odd", "--encoder v=vit --grid v:dp=1@language --grid language:dp=3", 3, {},
     None, "--grid v:dp=1@language: colocated on language's 3 ranks, tp x dp must be 3 (is 1); "
     "e.g. v:dp=3@language"),
    ("hosted-pp", "--encoder v=vit --grid v:pp=2,dp=2@language --grid language:dp=4", 4, {}, None,
     "--grid v:pp=2,dp=2@language: pp=2: encoder pipeline parallelism is not supported yet; use "
     "pp=1 and scale the encoder with tp or dp"),
    ("hosted-ep", "--encoder v=vit --grid v:dp=2,ep=2@language --grid language:dp=2", 2, {}, None,
     "--grid v:dp=2,ep=2@language: ep=2: expert parallelism is only supported for the language "
     "model; use ep=1"),
    ("hosted-world-size", "--encoder v=vit --grid v:dp=4@language --grid language:tp=2,dp=2", 8,
     {}, None,
     "WORLD_SIZE / --nproc-per-node is 8 but the --grid sizes sum to 4 (language 4; v on "
     "language); launch 4 ranks or change the grids"),
    ("mixed-world-size", "--encoder v=vit --encoder a=audio --grid v:dp=2@language --grid a:dp=1 "
     "--grid language:dp=2", 5, {}, None,
     "WORLD_SIZE / --nproc-per-node is 5 but the --grid sizes sum to 3 (a 1 + language 2; v on "
     "language); launch 3 ranks or change the grids"),
    ("hosted-heads", "--encoder v=vit --grid v:tp=3@language --grid language:dp=3", 3, {},
     {"v": 16}, "--grid v:tp=3@language: tp=3 does not divide the v encoder's attention heads 16"),
    ("hosted-bridge-dp", "--encoder v=vit --grid v:tp=2,dp=3@language --grid language:tp=3,dp=2",
     6, {}, None, "--grid v:tp=2,dp=3@language: dp=3 and --grid language: dp=2 must be multiples"),
    ("hosted-language-cp", "--encoder v=vit --grid v:dp=2@language --grid language:cp=2", 2,
     {"seq_length": 32}, None,
     "--grid v:dp=2@language with --grid language: cp=2: colocated encoders with language cp>1 "
     "are not supported yet; use cp=1 or place v on its own ranks"),
    ("hosted-balance", "--encoder v=vit --grid v:dp=2@language --grid language:dp=2", 2,
     {"balance_encoder_work": True}, None,
     "--balance-encoder-work with --grid v:dp=2@language: colocated encoders cannot balance work "
     "yet; drop --balance-encoder-work or place v on its own ranks"),
    ("alias-host", "--encoder-dp 2@language --llm-dp 2", 2, {}, None,
     "--encoder-dp 2@language: the alias flags describe an encoder on its own ranks; for a "
     "colocated encoder give every module a --grid (e.g. --grid vision:dp=2@language --grid "
     "language:dp=2)"),
]


@pytest.mark.parametrize(
    "flags, world_size, model, encoder_heads, expected",
    [case[1:] for case in BAD_LAYOUTS],
    ids=[case[0] for case in BAD_LAYOUTS],
)
def test_bad_layout_names_the_flag(flags, world_size, model, encoder_heads, expected):
    with pytest.raises(LayoutError) as first:
        layout_from_args(parse(flags, **model), world_size, encoder_heads)
    message = str(first.value)
    assert expected in message
    assert "\n" not in message
    # Identical on every rank: the same inputs give the same message.
    with pytest.raises(LayoutError) as second:
        layout_from_args(parse(flags, **model), world_size, encoder_heads)
    assert str(second.value) == message


@pytest.mark.parametrize("flags, world_size, model, cp", [
    ("--grid language:cp=2", 2, {"seq_length": 32}, 2),
    ("--encoder v=vit --grid v:dp=2 --grid language:cp=2,dp=2", 6,
     {"seq_length": 64, "pack_sequences": True, "cp_comm_type": ["p2p"]}, 2),
    ("--grid language:tp=2,cp=2,pp=2", 8, {"seq_length": 24, "sequence_parallel": True}, 2),
    ("--grid language:cp=4", 4, {"cp_comm_type": ["a2a", "all_gather", "p2p"]}, 4),
    # Without CP the CP flags are stock's business, and without sequence parallelism the row's
    # length (stock turns --sequence-parallel off at tp=1).
    ("--grid language:tp=2", 2, {"seq_length": 31, "cp_comm_type": ["a2a+p2p"],
                                 "hybrid_context_parallel": True}, 1),
    ("--grid language:dp=2", 2, {"seq_length": 31, "sequence_parallel": True}, 1),
    ("--grid language:tp=2", 2, {"seq_length": 32, "sequence_parallel": True}, 1),
], ids=["cp2", "cp2-packed-dp2", "cp2-tp2-sp-pp2", "cp4-comm-types", "cp1", "cp1-tp1-sp",
        "cp1-tp2-sp"])
def test_language_context_parallelism_is_accepted(flags, world_size, model, cp):
    layout = layout_from_args(parse(flags, **model), world_size)
    assert layout.language.cp == cp and layout.world_size == world_size


def test_layout_error_is_a_value_error():
    assert issubclass(LayoutError, ValueError)


def test_grids_take_consecutive_ranks_in_flag_order():
    layout = layout_from_args(
        parse("--encoder a=audio --encoder v=pkg.enc:build --grid v:dp=2 "
              "--grid a:tp=2,dp=2 --grid language:tp=2,pp=2", num_attention_heads=4),
        10,
    )
    assert [m.name for m in layout.modules] == ["v", "a", LANGUAGE]
    assert [(m.rank_offset, m.size) for m in layout.modules] == [(0, 2), (2, 4), (6, 4)]
    assert layout.world_size == 10
    assert layout.language is layout.modules[-1]
    assert [m.name for m in layout.encoders] == ["v", "a"]
    assert layout.module("v").provider == "pkg.enc:build"
    assert layout.language.provider is None
    assert [layout.module_of_rank(r).name for r in range(10)] == (
        ["v"] * 2 + ["a"] * 4 + [LANGUAGE] * 4
    )
    assert layout.most_modules_per_rank == 1  # disjoint grids: one module a rank
    with pytest.raises(ValueError):
        layout.module_of_rank(10)


def test_world_size_message_of_separate_grids_is_unchanged():
    with pytest.raises(LayoutError) as error:
        layout_from_args(parse(TWO_BY_TWO), 6)
    assert str(error.value) == (
        "WORLD_SIZE / --nproc-per-node is 6 but the --grid sizes sum to 4 (vision 2 + language "
        "2); launch 4 ranks or change the grids")


def _coordinates(layout: ParallelLayout, rank: int) -> dict[str, tuple[int, int, int, int]]:
    """(tp, cp, dp, pp) of every module ``rank`` runs."""
    return {m.name: tuple(m.coordinates(rank)[d] for d in ("tp", "cp", "dp", "pp"))
            for m in layout.modules_of_rank(rank)}


def test_encoder_dp4_colocated_with_language_tp2_dp2_on_four_ranks():
    flags = "--encoder vision=vit --grid vision:dp=4@language --grid language:tp=2,dp=2"
    layout = layout_from_args(parse(flags), 4)
    assert required_world_size(parse(flags)) == layout.world_size == 4
    vision = layout.module("vision")
    assert (vision.host, vision.rank_offset, vision.size, layout.language.rank_offset) == (
        LANGUAGE, 0, 4, 0)
    assert layout.hosted == (vision,) and layout.encoders == (vision,)
    assert vision.source == "--grid vision:dp=4@language"
    assert [layout.module_of_rank(r).name for r in range(4)] == [LANGUAGE] * 4
    assert [[m.name for m in layout.modules_of_rank(r)] for r in range(4)] == [
        [LANGUAGE, "vision"]] * 4
    # Rank 1 is encoder replica 1 but language replica 0: the routing (block B) pairs them.
    assert _coordinates(layout, 1) == {LANGUAGE: (1, 0, 0, 0), "vision": (0, 0, 1, 0)}
    with pytest.raises(ValueError, match="rank 4 is outside the layout's 4 ranks"):
        layout.modules_of_rank(4)


@pytest.mark.parametrize("language, coordinates", [
    ("tp=2,pp=2", {LANGUAGE: (0, 0, 0, 1), "vision": (0, 0, 1, 0)}),
    ("dp=2,pp=2", {LANGUAGE: (0, 0, 0, 1), "vision": (0, 0, 1, 0)}),
], ids=["language-tp2-pp2", "language-dp2-pp2"])
def test_encoder_tp2_colocated_with_pipelined_language_on_four_ranks(language, coordinates):
    flags = f"--encoder vision=vit --grid vision:tp=2,dp=2@language --grid language:{language}"
    layout = layout_from_args(parse(flags), 4, {"vision": 4})
    assert required_world_size(parse(flags)) == layout.world_size == 4
    assert {m.rank_offset for m in layout.modules} == {0}
    # Rank 2: first rank of encoder replica 1, on language stage 1 (no rows needed there).
    assert _coordinates(layout, 2) == coordinates


def test_one_colocated_and_one_separate_encoder_on_three_ranks():
    flags = ("--encoder vision=vit --encoder audio=audio --grid vision:dp=2@language "
             "--grid audio:dp=1 --grid language:dp=2")
    layout = layout_from_args(parse(flags), 3)
    assert required_world_size(parse(flags)) == layout.world_size == 3
    assert [(m.name, m.rank_offset, m.size, m.host) for m in layout.modules] == [
        ("vision", 1, 2, LANGUAGE), ("audio", 0, 1, None), (LANGUAGE, 1, 2, None)]
    assert [[m.name for m in layout.modules_of_rank(r)] for r in range(3)] == [
        ["audio"], [LANGUAGE, "vision"], [LANGUAGE, "vision"]]
    assert [layout.module_of_rank(r).name for r in range(3)] == ["audio", LANGUAGE, LANGUAGE]
    assert layout.most_modules_per_rank == 2  # the language ranks also run vision
    # A hosted grid takes no ranks, so it may also follow the language model's --grid.
    after = layout_from_args(parse("--encoder vision=vit --encoder audio=audio --grid audio:dp=1 "
                                   "--grid language:dp=2 --grid vision:dp=2@language"), 3)
    assert [(m.name, m.rank_offset) for m in after.modules] == [
        ("audio", 0), (LANGUAGE, 1), ("vision", 1)]


def test_a_hosted_module_must_start_on_its_host():
    language = ModulePlacement(name=LANGUAGE, tp=1, pp=1, cp=1, dp=2, rank_offset=1)
    audio = ModulePlacement(name="audio", tp=1, pp=1, cp=1, dp=1, rank_offset=0, provider="audio")
    vision = ModulePlacement(name="vision", tp=1, pp=1, cp=1, dp=2, rank_offset=0,
                             provider="vit", host=LANGUAGE)
    assert vision.source == "--grid vision@language"
    with pytest.raises(LayoutError, match="^--grid vision@language: starts at rank 0, expected 1: "
                                          "a colocated module takes its host's ranks$"):
        ParallelLayout((audio, vision, language))
    assert ParallelLayout((audio, dataclasses.replace(vision, rank_offset=1), language)
                          ).world_size == 3
    assert dataclasses.replace(vision, rank_offset=1) != dataclasses.replace(
        vision, rank_offset=1, host=None)


def test_repeated_layout_flags_have_a_single_string_form():
    """Upstream's case files give each flag one value: several grids share one ``--grid``."""
    repeated = layout_from_args(parse("--encoder a=audio --encoder v=vit --grid v:dp=2 "
                                      "--grid a:tp=2 --grid language:dp=2"), 6)
    single = layout_from_args(parse("--encoder 'a=audio v=vit' "
                                    "--grid 'v:dp=2 a:tp=2' --grid language:dp=2"), 6)
    assert single == repeated
    assert [(m.name, m.provider, m.rank_offset) for m in single.modules] == [
        ("v", "vit", 0), ("a", "audio", 2), (LANGUAGE, None, 4)]


def test_omitted_keys_default_to_one():
    layout = layout_from_args(parse("--grid language:dp=2"), 2)
    language = layout.language
    assert (language.tp, language.pp, language.cp, language.dp, language.ep, language.etp) == (
        1, 1, 1, 2, 1, 1
    )
    assert language.expt_dp == 2


def test_alias_flags_describe_one_encoder_and_the_language_model():
    layout = layout_from_args(
        parse("--encoder-tp 2 --encoder-dp 2 --llm-tp 2 --llm-pp 2 --llm-dp 2 --llm-ep 2 "
              "--llm-expt-tp 1", num_experts=4),
        12,
    )
    encoder, language = layout.modules
    assert (encoder.name, encoder.provider) == ("vision", "vit")
    assert (encoder.tp, encoder.dp, encoder.pp, encoder.cp, encoder.rank_offset) == (2, 2, 1, 1, 0)
    assert (language.tp, language.pp, language.dp, language.ep, language.etp) == (2, 2, 2, 2, 1)
    assert language.rank_offset == 4
    assert language.expt_dp == 2

    named = layout_from_args(parse("--encoder audio=whisper_pkg:build --encoder-dp 2"), 3)
    assert [(m.name, m.provider, m.size) for m in named.modules] == [
        ("audio", "whisper_pkg:build", 2), (LANGUAGE, None, 1)
    ]


def test_layout_is_immutable_and_checks_its_own_invariants():
    layout = layout_from_args(parse(TWO_BY_TWO), 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.language.tp = 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        layout.modules = ()
    language = ModulePlacement(name=LANGUAGE, tp=1, pp=1, cp=1, dp=1, rank_offset=1)
    with pytest.raises(LayoutError, match="starts at rank 1, expected 0"):
        ParallelLayout((language,))
    with pytest.raises(LayoutError, match="--grid language: tp=0 must be a positive integer"):
        ModulePlacement(name=LANGUAGE, tp=0, pp=1, cp=1, dp=1, rank_offset=0)
    with pytest.raises(LayoutError, match="needs a provider"):
        ParallelLayout((ModulePlacement(name="v", tp=1, pp=1, cp=1, dp=1, rank_offset=0),
                        ModulePlacement(name=LANGUAGE, tp=1, pp=1, cp=1, dp=1, rank_offset=1)))


@pytest.mark.parametrize("tp, cp, dp, pp, ep, etp", [
    (2, 1, 2, 2, 2, 1), (1, 1, 4, 1, 2, 2), (2, 2, 1, 3, 1, 1), (4, 1, 2, 1, 4, 2),
])
def test_coordinates_follow_hyper_comm_grid_order(tp, cp, dp, pp, ep, etp):
    """Ranks count up with tp fastest, then cp, dp, pp (experts: expt_tp, ep, expt_dp, pp)."""
    module = ModulePlacement(name=LANGUAGE, tp=tp, cp=cp, dp=dp, pp=pp, ep=ep, etp=etp, rank_offset=3)
    rank = 3
    for p, d, c, t in itertools.product(range(pp), range(dp), range(cp), range(tp)):
        coords = module.coordinates(rank)
        assert (coords["tp"], coords["cp"], coords["dp"], coords["pp"]) == (t, c, d, p)
        rank += 1
    edp = tp * cp * dp // (ep * etp)
    rank = 3
    for p, d, e, t in itertools.product(range(pp), range(edp), range(ep), range(etp)):
        coords = module.coordinates(rank)
        assert (coords["expt_tp"], coords["ep"], coords["expt_dp"], coords["pp"]) == (t, e, d, p)
        rank += 1
    assert rank == 3 + module.size


def test_apply_language_grid_sets_stock_parallel_args():
    layout = layout_from_args(parse("--encoder v=vit --grid v:dp=2 --grid language:tp=2,pp=2,"
                                    "dp=2,ep=2", num_experts=4), 10)
    args = argparse.Namespace(tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                              context_parallel_size=1, expert_model_parallel_size=1,
                              expert_tensor_parallel_size=None, world_size=10)
    for attr, _, value in language_grid_flags(args, layout):
        setattr(args, attr, value)
    with language_world_size(args, layout):
        assert args.world_size == 8  # stock validate_args derives data_parallel_size from it
    assert args.world_size == 10  # stock init_process_group needs the real one
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
            args.context_parallel_size, args.expert_model_parallel_size,
            args.expert_tensor_parallel_size) == (2, 2, 1, 2, 1)


@pytest.mark.parametrize("attr, value, flag, grid", [
    ("tensor_model_parallel_size", 4, "--tensor-model-parallel-size 4", "tp=2"),
    ("pipeline_model_parallel_size", 4, "--pipeline-model-parallel-size 4", "pp=1"),
    ("expert_tensor_parallel_size", 2, "--expert-tensor-parallel-size 2", "etp=1"),
])
def test_apply_language_grid_rejects_disagreeing_stock_flags(attr, value, flag, grid):
    layout = layout_from_args(parse("--grid language:tp=2"), 2)
    args = argparse.Namespace(world_size=2, **{attr: value})
    with pytest.raises(LayoutError) as error:
        language_grid_flags(args, layout)
    assert flag in str(error.value)
    assert f"--grid language: {grid}" in str(error.value)


def _with_stock_parser(command: str) -> dict[str, object]:
    """Stock parser + layout flags: dest clashes, then the language grid through validate_args."""
    from megatron_plugins.cpu_simulation import patches

    patches.activate()  # stock validate_args reads device properties
    from megatron.training.arguments import add_megatron_arguments, validate_args

    stock = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    stock_dests = {action.dest for action in stock._actions}
    ours = add_layout_args(argparse.ArgumentParser(allow_abbrev=False))
    clashes = sorted(({action.dest for action in ours._actions} - {"help"}) & stock_dests)
    parser = add_layout_args(stock)  # argparse raises on a clashing option string
    args = parser.parse_args(shlex.split(command))
    args.rank, args.world_size = 0, 10
    unvalidated_dp = args.world_size // args.tensor_model_parallel_size
    layout = layout_from_args(args, args.world_size)
    for attr, _, value in language_grid_flags(args, layout):
        setattr(args, attr, value)
    with language_world_size(args, layout):
        validate_args(args)
    return {
        "clashes": clashes,
        "unvalidated_dp": unvalidated_dp,
        "parallel": (args.world_size, args.data_parallel_size, args.tensor_model_parallel_size,
                     args.pipeline_model_parallel_size, args.expert_tensor_parallel_size),
    }


@pytest.mark.multirank
def test_layout_flags_work_with_stock_parser_and_validation():
    command = (
        "--encoder vision=vit --grid vision:dp=2 --grid language:tp=2,pp=2,dp=2 --num-layers 4 "
        "--hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
        "--micro-batch-size 1 --global-batch-size 4 --train-iters 2 "
        "--tensor-model-parallel-size 2"
    )
    [result] = run_in_processes(_with_stock_parser, 1, args=(command,), timeout=120,
                                simulated=True)
    assert result["clashes"] == []
    assert result["unvalidated_dp"] == 5  # what stock would derive from the whole world
    assert result["parallel"] == (10, 2, 2, 2, 1)
