"""Every Megatron-format MiMo case against its CPU goldens (tools/functional_tests.py rules)."""

from __future__ import annotations

import pytest

from tools.functional_tests import all_cases, check_case


@pytest.mark.parametrize("name", all_cases())
def test_case_matches_its_cpu_goldens(name: str, tmp_path) -> None:
    failures = check_case(name, platform="cpu", workdir=tmp_path)
    assert failures == [], "\n".join(failures)
