"""The package's layers, kept: core <- runtime <- plan <- ops <- estimators and integrations, no
import circles (the contracts of pyproject.toml's [tool.importlinter], checked by import-linter's
lint-imports), and each module's imports of the package at its top."""

import ast
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kermac_like"


def test_import_contracts_are_kept():
    """lint-imports (the test extra installs import-linter) keeps every contract."""
    pytest.importorskip("importlinter")
    bindir = os.path.dirname(sys.executable)
    exe = shutil.which("lint-imports", path=os.pathsep.join([bindir, os.environ.get("PATH", "")]))
    assert exe, "import-linter is installed but its lint-imports command is not on PATH"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([exe, "--no-cache"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert "0 broken" in run.stdout, run.stdout[-6000:]


def _own_imports_in_functions(path: pathlib.Path) -> list:
    """(line, statement) of every import of the package inside a function of ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom):
                own = node.level > 0 or (node.module or "").split(".")[0] == "kermac_like"
            elif isinstance(node, ast.Import):
                own = any(a.name.split(".")[0] == "kermac_like" for a in node.names)
            else:
                continue
            if own:
                found.append((node.lineno, ast.unparse(node)))
    return sorted(set(found))


def test_modules_import_the_package_at_their_top():
    """No import of the package's own modules inside a function (imports there only for optional or
    heavy third-party packages: scikit-learn, GPyTorch, torch.distributed, nvmath, cuda.core, SymPy)."""
    checked, bad = 0, []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        checked += 1
        bad += [f"kermac_like/{rel}:{line}: {stmt}" for line, stmt in _own_imports_in_functions(path)]
    assert checked > 40  # the walk found the package
    assert not bad, "imports of the package inside functions:\n" + "\n".join(bad)


def test_the_check_finds_an_import_inside_a_function(tmp_path):
    """The walk above sees relative, absolute and nested imports of the package, not third-party ones."""
    f = tmp_path / "m.py"
    f.write_text("from . import config\n\ndef f():\n    import numpy\n    from .plan import core\n\n"
                 "class C:\n    def g(self):\n        def h():\n            import kermac_like.ops\n        return h\n")
    assert [line for line, _ in _own_imports_in_functions(f)] == [5, 10]
