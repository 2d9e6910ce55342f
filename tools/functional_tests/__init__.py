"""Megatron-style functional tests for heterogeneous MiMo: run cases, compare with goldens, record.

A case is ``tests/functional_tests/test_cases/<model>/<case>/model_config.yaml`` in upstream
Megatron-LM's format: ``ENV_VARS``, ``MODEL_ARGS`` (one value per flag, ``true`` for a bare flag,
``${TENSORBOARD_PATH}``-style variables filled in per run), ``TEST_TYPE`` (regular or ckpt-resume),
``METRICS``, and optionally ``MODEL_ARGS_2`` for the resumed run; upstream's other keys (``MODE``,
``LAUNCHER``, ...) are accepted and not used. Goldens are upstream's
``golden_values_{environment}_{platform}.json`` (``{metric: {start_step, end_step, step_interval,
values}}``, values rounded to 5 decimals as upstream records them); beside each lies
``golden_signature_{environment}_{platform}.json``: what the values depend on (CPU, instruction set
torch dispatches to, math libraries, versions, threads, dispatch switches).

``runner`` loads, launches and checks cases; ``comparison`` holds the rules against goldens
(exact on the recording host, the cross-host rule elsewhere); ``signature`` probes the host.

    python -m tools.functional_tests run mimo_hetero/language_tp2   # one case
    python -m tools.functional_tests run --all [--record]           # every case
"""
