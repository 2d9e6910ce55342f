"""The compat package as a whole: importing it changes nothing, its index of gaps names real
bridges and canaries, and every bridge records itself."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path
from types import ModuleType

import pytest

from megatron_plugins import compat
from megatron_plugins.compat import GAPS, MegatronCompatError, installed, record
from tests.harness.multiprocess import REPO_ROOT, run_python


SNAPSHOT = """
import importlib, pkgutil, sys, torch, torch.cuda, torch.distributed
import megatron.core.datasets.utils, megatron.core.parallel_state, megatron.training.initialize
import megatron.training.training, megatron.core.tensor_parallel.random
watched = [torch, torch.cuda, torch.cuda.random, torch.distributed,
           torch.distributed.distributed_c10d, torch.Tensor] + [
    module for name, module in sorted(sys.modules.items()) if name.startswith("megatron.")]
def snapshot():
    return {(getattr(w, "__name__", str(w)), name): id(value)
            for w in watched for name, value in list(vars(w).items())}
before = snapshot()
import megatron_plugins
names = sorted(m.name for m in pkgutil.walk_packages(megatron_plugins.__path__, "megatron_plugins."))
for name in names:
    importlib.import_module(name)
changed = sorted(key for key, value in snapshot().items() if before.get(key, value) != value)
print(len(names), changed)
"""


@pytest.mark.multirank
def test_importing_every_plugin_module_changes_nothing_in_torch_or_megatron():
    result = run_python(SNAPSHOT, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    count, changed = result.stdout.strip().splitlines()[-1].split(" ", 1)
    assert int(count) >= 15  # every module of the package was imported
    assert changed == "[]"


def _test_module(path: str) -> ModuleType:
    """The test module at ``path`` (relative to the repository root), imported."""
    return importlib.import_module(path.removesuffix(".py").replace("/", "."))


def _defines_bridge(module: ModuleType, gap_id: str) -> bool:
    """Whether a function or class of ``module`` explains gap ``gap_id`` in its docstring."""
    pattern = re.compile(rf"Gap {re.escape(gap_id)}\b")
    return any(pattern.search(inspect.getdoc(value) or "")
               for _, value in inspect.getmembers(module, lambda v: inspect.isfunction(v) or inspect.isclass(v))
               if getattr(value, "__module__", None) == module.__name__)


def _resolve(caller: str) -> object:
    """The object ``caller`` (a dotted path inside ``megatron_plugins``) names."""
    parts = caller.split(".")
    for split in range(len(parts) - 1, 0, -1):
        try:
            value = importlib.import_module(f"megatron_plugins.{'.'.join(parts[:split])}")
        except ModuleNotFoundError:
            continue
        for attr in parts[split:]:
            value = getattr(value, attr)
        return value
    raise AssertionError(f"no module of megatron_plugins in {caller!r}")


def test_every_gap_names_its_bridge_its_callers_and_an_existing_canary():
    ids = [gap.id for gap in GAPS]
    assert len(ids) == len(set(ids)), ids
    for gap in GAPS:
        area = importlib.import_module(f"megatron_plugins.compat.{gap.area}")
        assert _defines_bridge(area, gap.id), (gap.id, gap.area)
        for caller in gap.installed_by.split(", "):
            assert f"{gap.area}." in inspect.getsource(_resolve(caller)), (gap.id, caller)
        path, _, test = gap.canary.partition("::")
        assert test.startswith(f"test_gap{gap.id}_canary_"), gap.canary
        assert inspect.isfunction(getattr(_test_module(path), test, None)), gap.canary


def test_every_canary_in_the_compat_tests_is_indexed():
    folder = Path(__file__).parent
    found = {f"{path.relative_to(REPO_ROOT)}::{name}"
             for path in sorted(folder.glob("test_*.py"))
             for name, value in vars(_test_module(str(path.relative_to(REPO_ROOT)))).items()
             if re.fullmatch(r"test_gap\w+_canary_\w+", name) and inspect.isfunction(value)}
    assert found == {gap.canary for gap in GAPS}


def _recorded_ids(module: ModuleType) -> set[str]:
    """The gap ids ``module``'s code passes to :func:`megatron_plugins.compat.record`."""
    calls = [node for node in ast.walk(ast.parse(inspect.getsource(module)))
             if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id == "record"]
    return {arg.value for call in calls for arg in call.args if isinstance(arg, ast.Constant)}


def test_every_gaps_bridge_records_it_in_its_area_and_only_its_areas_gaps():
    areas = sorted({gap.area for gap in GAPS})
    for area in areas:
        module = importlib.import_module(f"megatron_plugins.compat.{area}")
        assert _recorded_ids(module) == {gap.id for gap in GAPS if gap.area == area}, area


def test_a_gap_is_recorded_once_per_process_and_listed_in_index_order(monkeypatch):
    monkeypatch.setattr(compat, "_recorded", set())
    assert installed() == ()
    record("18")
    record("4a", "2")
    record("18")  # a second install of the same bridge
    assert installed() == ("2", "4a", "18")
    with pytest.raises(MegatronCompatError, match="no gap 99 in megatron_plugins.compat.GAPS"):
        record("99")
    assert installed() == ("2", "4a", "18")
