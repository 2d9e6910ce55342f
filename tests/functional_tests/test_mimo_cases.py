"""Every Megatron-format MiMo case against its goldens (tools/functional_tests/ rules)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from megatron_plugins.compat import MEGATRON_CORE_VERSION
from tests.harness.energon_data import SAMPLES, synthetic_dataset
from tests.harness.multiprocess import launch_preforked
from tools.functional_tests.comparison import compare
from tools.functional_tests.runner import (
    CASE_DATA,
    ENTRY_POINT,
    CaseError,
    all_cases,
    check_case,
    load_case,
    read_metrics,
    run_command,
    run_environment,
)
from tools.functional_tests.signature import platform_signature, signature_differences

pytestmark = pytest.mark.multirank

UPSTREAM_LAUNCH = Path(__file__).with_name("upstream_launch.sh")

DISPATCH_VARIANT = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"}
"""Other torch kernels and another BLAS code path on this very host: a stand-in for a CI host with
another CPU, whose low bits drift the same way (tests/functional_tests/data/cross_host)."""

STARTUP_LINE = re.compile(r"^pretrain_mimo\.py: megatron-core (\S+); gaps bridged on rank 0: "
                          r"(.+) \(index: megatron_plugins\.compat\.GAPS\)$", re.MULTILINE)
EVERY_LAUNCH_GAPS = {"1", "2", "5", "6", "7", "8", "10", "11", "12", "16", "27", "35"}
"""Gaps rank 0 bridges in every MiMo launch: start-up, checkpoints, step reductions, broadcasts,
synchronous saves."""
CP_GAPS = {"18", "22"}
"""Gaps rank 0 bridges only when the language model has context parallelism: a bridge into a CP
grid, MiMo optimizer replica ids over CP (19-21 are the language ranks' own)."""
COLOCATION_GAPS = {"23", "24", "25", "26"}
"""Gaps rank 0 bridges only when it hosts an encoder next to the language model."""


def gaps_bridged_on_rank_zero(log: Path) -> set[str]:
    """The gaps named by the one start-up line a launch's log holds, its version checked."""
    lines = STARTUP_LINE.findall(log.read_text())
    assert len(lines) == 1, f"{log}: {len(lines)} start-up lines naming the bridged gaps"
    [(version, gaps)] = lines
    assert version == MEGATRON_CORE_VERSION
    return set(gaps.split(", "))


def assert_bridged_gaps(log: Path, grids: str) -> None:
    """A launch names what it bridged, once: every launch's gaps, and CP's and colocation's
    exactly when its ``--grid`` value has them."""
    gaps = gaps_bridged_on_rank_zero(log)
    assert EVERY_LAUNCH_GAPS <= gaps, (log.name, sorted(EVERY_LAUNCH_GAPS - gaps))
    context_parallel = re.search(r"cp=(?!1\b)\d", grids) is not None
    assert gaps & CP_GAPS == (CP_GAPS if context_parallel else set()), (log.name, gaps)
    assert gaps & COLOCATION_GAPS == (COLOCATION_GAPS if "@" in grids else set()), (log.name,
                                                                                   gaps)


def preforked(nproc: int, argv: list[str], env: dict[str, str], log: Path, timeout: float,
              what: str) -> None:
    """The runner's launcher with each rank forked ready instead of importing torch and Megatron
    under torchrun (most of a small case's time); the upstream-style launch below keeps
    torchrun's."""
    try:
        code = launch_preforked(ENTRY_POINT, argv, nproc, env=env, log=log, timeout=timeout)
    except TimeoutError as error:
        raise CaseError(f"{what}: {error} (killed); log: {log}") from None
    if code != 0:
        raise CaseError(f"{what}: exited with {code}; log {log} ends:\n{log.read_text()[-3000:]}")


UPSTREAM_LAUNCHED = "mimo_hetero/language_tp2"
"""The case the upstream-style launch below runs: its goldens are checked on that run, not on a
second launch of the same flags and ranks."""


@pytest.mark.parametrize("name", [name for name in all_cases() if name != UPSTREAM_LAUNCHED])
def test_case_matches_its_goldens(name: str, tmp_path) -> None:
    data = None
    if load_case(name).reads_data:  # the run's shared copy of the README's generated set
        assert CASE_DATA == ("image_audio_caption", SAMPLES, 0), "synthetic_dataset() differs"
        data = synthetic_dataset(CASE_DATA[0])
    failures = check_case(name, workdir=tmp_path, launch=preforked, data=data)
    assert failures == [], "\n".join(failures)
    for log in sorted(tmp_path.glob("run_*.log")):
        assert_bridged_gaps(log, load_case(name).model_args["--grid"])


@pytest.mark.parametrize("name", ["mimo_hetero/two_encoders", "mimo_hetero/language_pp2"])
def test_case_under_another_kernel_dispatch_passes_by_the_cross_host_rule(name: str,
                                                                          tmp_path) -> None:
    report: list[str] = []
    failures = check_case(name, workdir=tmp_path, extra_env=DISPATCH_VARIANT, report=report,
                          launch=preforked)  # forks of a server loaded under the variant
    assert report[0].startswith("cross-host tolerance (signature differs in"), report
    assert failures == [], "\n".join(failures)


def test_a_case_launched_by_upstreams_flag_loop_matches_its_goldens(tmp_path) -> None:
    case = load_case(UPSTREAM_LAUNCHED)
    env = {name: value for name, value in run_environment(case).items()
           if name not in ("MASTER_ADDR", "MASTER_PORT")}  # the script's torchrun picks a port
    run_command(["bash", str(UPSTREAM_LAUNCH), str(case.path), str(tmp_path), sys.executable],
                env, tmp_path / "launch.log", 240.0, "upstream-style launch")
    actual = read_metrics(tmp_path / "tensorboard", case.metrics)
    recorded = json.loads(case.signature_path().read_text())
    same = not signature_differences(recorded, platform_signature(env))
    golden = json.loads(case.golden_path().read_text())
    assert compare(golden, actual, case.metrics, same_platform=same) == []
    assert_bridged_gaps(tmp_path / "launch.log", case.model_args["--grid"])
