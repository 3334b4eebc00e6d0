"""kermac_like.testing: the plan recorder, the cache helpers, the optional modules; and the rule that
tests/ and bench/ import no private name of the package (they go through kermac_like.testing)."""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest
import torch

import kermac_like as km
from kermac_like import config, testing
from kermac_like.ops.distance import COMPUTE_MODES, prepare_call
from kermac_like.plan import plan_distance
from kermac_like.runtime import launcher

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_record_plans_names_the_plans_that_ran(as_gpu, monkeypatch):
    """Planned as on sm_90 (nothing launched): each record is the plan's family, its main spec and every
    launch's spec; nested blocks see their own span; nothing is recorded outside a block."""
    monkeypatch.setattr(launcher, "launch", lambda *a, **k: None)
    a, b = torch.randn(300, 32), torch.randn(200, 32)
    call = prepare_call(km.preset("l2"), a, b)
    plan = plan_distance(call, torch.empty(call.out_shape), COMPUTE_MODES[0], False)
    assert plan.family != "reference"
    with testing.record_plans() as outer:
        plan.run()
        with testing.record_plans() as inner:
            plan.run()
    plan.run()
    assert len(outer) == 2 and len(inner) == 1
    rec = inner[0]
    assert rec == outer[0] and rec.family == plan.family and rec.spec == plan.spec
    assert rec.kernels == tuple(ln.kernel.spec for ln in plan.launches)
    assert outer.families == [plan.family] * 2 and rec.name == plan.spec.kernel.rpartition("::")[2]


def test_record_plans_on_the_cpu_path():
    x, y, v = torch.randn(40, 3), torch.randn(30, 3), torch.randn(30, 2)
    with testing.record_plans() as plans:
        km.kernel_matvec(km.preset("gaussian_l2"), x, y, v, bandwidth=1.0)
    assert plans.families == ["reference"] and plans[0].spec is None and plans.names == ["reference"]


def test_clear_caches_empties_the_plan_caches(as_gpu):
    a = torch.randn(300, 32)
    call = prepare_call(km.preset("l2"), a, a)
    plan_distance(call, torch.empty(call.out_shape), COMPUTE_MODES[0], False)
    assert testing.plan_cache_info()["templates"] == 1
    testing.clear_caches()
    assert testing.plan_cache_info() == {"templates": 0, "calls": 0}
    assert testing.wait_for_compiles() == 0  # nothing compiles on the CPU


def test_clear_caches_on_disk(tmp_path, monkeypatch):
    from kermac_like.runtime.cache import get_cache
    from kermac_like.runtime.cache.schema import ModuleRecord

    monkeypatch.setenv("KERMAC_LIKE_CACHE_DIR", str(tmp_path))
    testing.clear_caches()
    get_cache().put(ModuleRecord(b"\x7fELF module", "sm_80", 1.0, "13.0", "", (("a" * 64, "k<1>", "_Z1kILi1EEvv"),)))
    testing.clear_caches()  # in-process only: the kernel stays on disk
    assert get_cache().info()["n_kernels"] == 1
    testing.clear_caches(disk=True)
    assert get_cache().info()["n_kernels"] == 0


def test_overrides_and_optional_modules():
    assert testing.override is config.override
    with testing.override(wgmma="off"):
        assert config.get("wgmma") == "off"
    with pytest.raises(AttributeError):
        testing.no_such_name  # noqa: B018
    pytest.importorskip("linear_operator")
    assert callable(testing.gp_cg.linear_cg)


def test_import_does_not_load_the_testing_module():
    code = "import sys, kermac_like; assert 'kermac_like.testing' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# -- no private names of the package in tests/ and bench/ ------------------------------------------
_DOTTED = re.compile(r"\bkermac_like(?:\.\w+)*\.(_(?!_)\w*)")


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def private_imports(path: pathlib.Path) -> list:
    """(line, what) of each import of a private module or name of the package in ``path``, and of each
    dotted private name of it in a string (monkeypatch.setattr("...") and import_module too)."""
    text = path.read_text()
    if path.suffix != ".py":  # shell scripts: their inline Python
        return [(i, line.strip()) for i, line in enumerate(text.splitlines(), 1)
                if _DOTTED.search(line) or re.search(r"from kermac_like[\w.]* import .*\b_[a-z]", line)]
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names
                      if a.name.split(".")[0] == "kermac_like" and any(map(_private, a.name.split(".")))]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "kermac_like":
            if any(map(_private, node.module.split("."))):
                found.append((node.lineno, node.module))
            found += [(node.lineno, f"{node.module} import {a.name}") for a in node.names if _private(a.name)]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _DOTTED.search(node.value):
            found.append((node.lineno, _DOTTED.search(node.value).group(0)))
    return found


def test_the_scan_finds_private_imports(tmp_path):
    f = tmp_path / "probe.py"
    f.write_text("from PKG.ops._library import x\nfrom PKG.plan import _TEMPLATES\nimport PKG.solvers._cg as c\n"
                 "from PKG.testing import solver_cg as _cg\nimport PKG.__main__\n"
                 "m.setattr('PKG.gpytorch._products.MIN', 1)\n".replace("PKG", "kermac_like"))
    assert [line for line, _ in private_imports(f)] == [1, 2, 3, 6]


def test_tests_and_bench_import_no_private_name():
    files = [p for d in ("tests", "bench") for p in sorted((ROOT / d).rglob("*"))
             if p.suffix in (".py", ".sh") and "results" not in p.parts and "__pycache__" not in p.parts]
    assert len(files) > 50
    found = [f"{p.relative_to(ROOT)}:{line}: {what}" for p in files for line, what in private_imports(p)]
    assert not found, "private names of the package (use the public API or kermac_like.testing):\n" + "\n".join(found)
