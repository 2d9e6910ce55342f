"""Bridges over gaps in the released megatron-core 0.19.2 wheel, one module per area.

A *gap* is a place where the stock wheel fails or costs needlessly in our runs; a *bridge* is the
smallest change that closes it, applied explicitly by the code path that needs it (importing
this package or any of its modules applies nothing); a *canary* is the unit test that exercises
the stock behaviour behind the gap and fails once a release closes it, so the bridge is noticed
and removed. :data:`GAPS` indexes them. Callers import the area they need, e.g.
``from megatron_plugins.compat import model_build``.

Which bridges a process installs depends on its layout (context parallelism, colocation, MoE,
...): each bridge calls :func:`record` with its gap once it has changed something, and
:func:`installed` says which gaps this process has bridged so far. The launch prints them with
the installed megatron-core version on rank 0 once the model is built, and warns when that
version is not :data:`MEGATRON_CORE_VERSION` (:mod:`megatron_plugins.compat.startup`).
"""

from __future__ import annotations

import dataclasses

__all__ = ["GAPS", "MEGATRON_CORE_VERSION", "Gap", "MegatronCompatError", "installed", "record"]

MEGATRON_CORE_VERSION = "0.19.2"
"""The megatron-core release the bridges and their canaries were written against."""


class MegatronCompatError(RuntimeError):
    """A bridge found the installed wheel, or a runtime invariant the bridge relies on (a static
    transfer shape, a settled rerun flag, an always-succeeding optimizer step), not as it
    expects."""


@dataclasses.dataclass(frozen=True)
class Gap:
    """One gap of the wheel and where it is handled.

    ``area`` is the compat module holding the bridge (its docstring explains the gap),
    ``installed_by`` the functions of ``megatron_plugins`` that apply it (comma-separated,
    relative to the package), ``canary`` the node id of the test that fails once the wheel
    closes the gap.
    """

    id: str
    summary: str
    area: str
    installed_by: str
    canary: str


def _canary(area: str, test: str) -> str:
    return f"tests/unit_tests/compat/test_{area}.py::{test}"


_BUILD = "model.builder.MimoModelBuilder.build_distributed_models"

GAPS: tuple[Gap, ...] = (
    Gap("1", "stock pretrain() runs make for the dataset helpers; the wheel ships no Makefile",
        "startup", "launch.pretrain.train",
        _canary("startup", "test_gap1_canary_wheel_ships_prebuilt_helpers_but_no_makefile")),
    Gap("2", "local attention needs the global memory buffer only initialize_model_parallel makes",
        "model_build", "launch.pretrain.start",
        _canary("model_build", "test_gap2_canary_stock_local_attention_needs_the_buffer_only_"
                               "model_parallel_init_creates")),
    Gap("3", "modules without their own tp_group shard checkpoints on parallel_state's TP group",
        "model_build", "model.lifecycle.prepare_module, weights.megatron_init.load_module",
        _canary("model_build", "test_gap3_canary_vit_has_no_explicit_tp_group_and_the_bridge_"
                               "binds_one")),
    Gap("4", "the stock MoE GPT block spec reads parallel_state's pipeline rank",
        "model_build", "model.language.StockLanguageModel.__new__",
        _canary("model_build", "test_gap4_canary_stock_moe_spec_consults_the_global_pipeline_"
                               "rank")),
    Gap("4a", "expert bias added in place into the identity TP reduce's view (one expert rank)",
        "model_build", "model.language.StockLanguageModel.__new__",
        _canary("model_build", "test_gap4a_canary_expert_bias_add_on_one_expert_rank_hits_the_"
                               "identity_reduce_view")),
    Gap("4b", "CPU initialization gives every expert-parallel rank the same expert weights",
        "model_build", "model.language.StockLanguageModel.__new__",
        _canary("model_build", "test_gap4b_canary_stock_cpu_init_copies_the_experts_of_every_"
                               "expert_rank")),
    Gap("4c", "the stock hybrid stack spec and final norm are Transformer Engine only",
        "model_build", "model.language.StockLanguageModel.__new__",
        _canary("model_build", "test_gap4c_canary_stock_hybrid_stack_is_transformer_engine_"
                               "only")),
    Gap("5", "plain optimizer values of every module but rank 0's are lost in MiMo checkpoints",
        "checkpointing", _BUILD,
        _canary("checkpointing", "test_gap5_canary_mimo_optimizer_keeps_plain_state_in_rank_"
                                 "zero_common_state")),
    Gap("6", "distributed-optimizer resume on torch Adam asserts, shares, resets or lacks the step",
        "checkpointing", _BUILD,
        _canary("checkpointing", "test_gap6_canary_stock_distributed_optimizer_resume_without_"
                                 "te_or_apex")),
    Gap("7", "a bare % in one stock help string makes --help raise",
        "startup", "launch.pretrain._parse_flags",
        _canary("startup", "test_gap7_canary_stock_help_breaks_argparse_and_the_bridge_"
                           "escapes_only_that_string")),
    Gap("8", "MimoOptimizer.step makes three world-wide all-reduces per step",
        "step_reductions", _BUILD,
        _canary("step_reductions", "test_gap8_canary_mimo_optimizer_issues_separate_world_"
                                 "reductions")),
    Gap("9", "cross-grid bridges exchange shapes before every transfer",
        "communication", "parallel.topology.pipeline_communicator",
        _canary("communication", "test_gap9_canary_bridge_exchanges_shapes_on_every_"
                                 "transfer")),
    Gap("10", "every module's DP rank writes the same data loader state file",
        "checkpointing", _BUILD,
        _canary("checkpointing", "test_gap10_canary_stock_names_dataloader_state_by_dp_rank_"
                                 "only")),
    Gap("11", "the rerun state machine all-reduces its flag over the world every step",
        "step_reductions", f"{_BUILD}, step.grad_sync.CrossGridGradSync.global_token_count",
        _canary("step_reductions", "test_gap11_canary_stock_rerun_check_is_a_world_all_reduce_"
                                 "after_the_result_checks")),
    Gap("12", "bridges broadcast received tensors inside one-rank grids",
        "communication", "parallel.topology.pipeline_communicator",
        _canary("communication", "test_gap12_canary_bridge_broadcasts_after_every_transfer_in_"
                                 "its_grid_group")),
    Gap("13", "pipeline-stage links exchange shapes before every transfer",
        "communication", "parallel.topology.pipeline_communicator",
        _canary("communication", "test_gap13_canary_stage_links_exchange_shapes_on_every_"
                                 "transfer")),
    Gap("14", "the precision wrapper rounds fp32 router buffers set before the wrap",
        "model_build", "model.lifecycle.prepare_module",
        _canary("model_build", "test_gap14_canary_float16_module_rounds_a_router_bias_set_"
                               "before_the_wrap")),
    Gap("15", "a fan-in bridge splits gradients equally, not as it received variable outputs",
        "communication", "parallel.topology.pipeline_communicator",
        _canary("communication", "test_gap15_canary_fan_in_gradients_split_equally_whatever_"
                                 "was_received")),
    Gap("16", "checkpoints keep data-parallel replica 0's RNG state for every replica",
        "checkpointing", _BUILD,
        _canary("checkpointing", "test_gap16_canary_stock_saves_one_rng_state_replicated_over_"
                                 "data_parallel_ranks")),
    Gap("17", "multimodal RoPE has only contiguous per-axis sections, not Qwen3-VL's interleaved",
        "model_build", "model.language.StockLanguageModel.__new__",
        _canary("model_build", "test_gap17_canary_stock_mrope_has_no_interleaved_layout")),
    Gap("18", "bridges refuse a CP destination grid and send back only its leader's gradient",
        "communication", "parallel.topology.pipeline_communicator",
        _canary("communication", "test_gap18_canary_bridge_refuses_a_destination_grid_with_"
                                 "context_parallelism")),
    Gap("19", "MiMo's context-parallel split of packed (THD) rows needs Transformer Engine",
        "context_parallel", "model.builder.MimoModelBuilder.build_model",
        _canary("context_parallel", "test_gap19_canary_stock_thd_split_asserts_without_"
                                    "transformer_engine")),
    Gap("20", "GPT builds its multimodal RoPE without the model's context parallel group",
        "context_parallel", "model.language.StockLanguageModel.__new__",
        _canary("context_parallel", "test_gap20_canary_gpt_mrope_falls_back_to_parallel_"
                                    "state_cp_group")),
    Gap("21", "multimodal RoPE splits a packed row over CP ranks as one sequence",
        "context_parallel", "model.language.StockLanguageModel.__new__",
        _canary("context_parallel", "test_gap21_canary_stock_mrope_splits_every_row_it_has_a_"
                                    "cp_group_for")),
    Gap("22", "MiMo optimizer checkpoint objects are main replicas on every context-parallel rank",
        "checkpointing", _BUILD,
        _canary("checkpointing", "test_gap22_canary_stock_mimo_replica_id_ignores_context_"
                                 "parallel_rank")),
    Gap("23", "MiMo calls an encoder on the language ranks colocated, or encoder-only if mixed",
        "colocation", "model.builder.MimoModelBuilder.build_model",
        _canary("colocation", "test_gap23_canary_stock_role_is_colocated_or_encoder_only_for_an_"
                              "encoder_on_the_language_ranks")),
    Gap("24", "stock train() runs the plain pipelining schedule for a multi-module collection",
        "colocation", "launch.pretrain.start",
        _canary("colocation", "test_gap24_canary_stock_train_takes_the_plain_pipelining_schedule_"
                              "for_a_multi_module_collection")),
    Gap("25", "each module's optimizer build gathers group keys over the world (hangs if uneven)",
        "colocation", _BUILD,
        _canary("colocation", "test_gap25_canary_stock_optimizer_build_gathers_group_keys_over_"
                              "the_world_twice")),
    Gap("26", "checkpoints hold one RNG state per rank, not a colocated rank's hosted encoders'",
        "checkpointing", _BUILD,
        _canary("checkpointing", "test_gap26_canary_stock_rng_state_holds_the_process_"
                                 "generators_only")),
    Gap("27", "checkpoint save/load read a GTP-inclusive DP x CP group only parallel_state makes",
        "checkpointing", "parallel.topology._collection",
        _canary("checkpointing", "test_gap27_canary_stock_checkpoints_read_the_gtp_remat_group_"
                                 "and_fall_back_to_parallel_state")),
    Gap("28", "--log-throughput counts a GPT of the language flags over every rank of the world",
        "throughput", "performance.measurement.install",
        _canary("throughput", "test_gap28_canary_stock_throughput_counts_a_gpt_of_the_flags_"
                              "over_the_world")),
    Gap("29", "the MiMo optimizer builds every module without parameter-group overrides",
        "optimizer", "peft.optimizer.install",
        _canary("optimizer", "test_gap29_canary_mimo_optimizer_builds_each_module_without_"
                             "config_overrides")),
    Gap("30", "Gated DeltaNet layers need flash-linear-attention's Triton kernels (GPU only)",
        "gated_delta_net", "model.language.StockLanguageModel.__new__",
        _canary("gated_delta_net", "test_gap30_canary_stock_gated_delta_net_refuses_to_build_"
                                   "without_flash_linear_attention")),
    Gap("31", "the Gated DeltaNet block spec asserts Transformer Engine; no local spec",
        "gdn_spec", "model.language.StockLanguageModel.__new__",
        _canary("gdn_spec", "test_gap31_canary_linear_attention_spec_asserts_transformer_engine")),
    Gap("32", "the local norm refuses 1-centred weights (--apply-layernorm-1p)",
        "gdn_spec", "model.language.StockLanguageModel.__new__",
        _canary("gdn_spec", "test_gap32_canary_local_norm_refuses_zero_centered_gamma")),
    Gap("33", "Gated DeltaNet's output norm weight is replicated over TP, its gradient summed "
              "only under sequence parallelism",
        "gdn_spec", "model.language.StockLanguageModel.__new__",
        _canary("gdn_spec", "test_gap33_canary_stock_sums_replicated_grads_only_under_sequence_"
                            "parallelism")),
    Gap("34", "stock's flag checks ask the machine they run on for Transformer Engine, so a GPU "
              "command line cannot be planned without it",
        "planning", "launch.advise.layout_memory, launch.advise.advise_main",
        _canary("planning", "test_gap34_canary_stock_config_checks_ask_this_machine_for_"
                            "transformer_engine")),
    Gap("35", "every rank's first checkpoint save spawns a results-queue process that re-imports "
              "the training script, though a synchronous save never leaves the rank",
        "checkpointing", "launch.pretrain.train",
        _canary("checkpointing", "test_gap35_canary_stock_save_results_queue_spawns_a_manager_"
                                 "process")),
    Gap("36", "the GPT builder makes multi-token-prediction layers from stock's layer spec, not "
              "the given one (their core attention stays stock's)",
        "model_build", "model.language.StockLanguageModel.__new__",
        _canary("model_build", "test_gap36_canary_stock_mtp_layers_take_stocks_decoder_layer_"
                               "spec")),
    Gap("37", "the local spec's norm refuses sequence parallelism, though a torch norm needs only "
              "its weight's gradient summed over TP, as stock sums TE's",
        "model_build", "model.language.StockLanguageModel.__new__",
        _canary("model_build", "test_gap37_canary_stock_local_norm_refuses_sequence_"
                               "parallelism")),
    Gap("38", "expert biases are marked sequence-parallel, so the TP all-reduce of norm "
              "gradients sums each expert's bias gradient with another expert's",
        "model_build", "model.language.StockLanguageModel.__new__",
        _canary("model_build", "test_gap38_canary_stock_sums_expert_bias_grads_over_tensor_"
                               "parallel_ranks")),
    Gap("39", "the MiMo optimizer's groups lack the expert TP group, so the gradient norm drops "
              "the expert biases of expert ranks off TP rank 0",
        "optimizer", "model.builder.MimoModelBuilder.build_distributed_models",
        _canary("optimizer", "test_gap39_canary_mimo_optimizer_groups_have_no_expert_tensor_"
                             "parallel_group")),
    Gap("40", "the hybrid model builder cannot turn off the embedding's sequence-parallel "
              "scatter, which MiMo refuses",
        "model_build", "model.language.StockLanguageModel.__new__",
        _canary("model_build", "test_gap40_canary_hybrid_builder_scatters_the_embedding_under_"
                               "sequence_parallelism")),
)
"""Every gap in the order the bridges were added."""


_recorded: set[str] = set()
"""Ids of the gaps this process has bridged."""


def record(*gap_ids: str) -> None:
    """Note that this process bridged ``gap_ids``; each bridge calls it once it has changed
    something, and a gap counts once per process however often its bridge is applied."""
    unknown = sorted(set(gap_ids) - {gap.id for gap in GAPS})
    if unknown:
        raise MegatronCompatError(f"no gap {', '.join(unknown)} in megatron_plugins.compat.GAPS")
    _recorded.update(gap_ids)


def installed() -> tuple[str, ...]:
    """The gaps this process has bridged so far, in :data:`GAPS` order."""
    return tuple(gap.id for gap in GAPS if gap.id in _recorded)
