"""Errors a new user meets first, each one line that names the argument: a CUDA device on a torch
without CUDA, empty inputs, the CUDA extra missing; the plain install's CPU path without any CUDA
package; debug records beside tqdm's bar, not on it."""

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import kermac_like as km
from kermac_like.runtime import compiler
from kermac_like.solvers import KernelRidge
from kermac_like.testing import args

ROOT = Path(__file__).resolve().parents[1]
no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")


@no_cuda
def test_cuda_device_without_cuda_is_one_value_error():
    why = "has no CUDA" if not torch.backends.cuda.is_built() else "sees no CUDA device"
    for device in ("cuda", "cuda:1", 0, torch.device("cuda")):
        with pytest.raises(ValueError, match=f"^device: 'cuda(:[01])?' asked for, but .*{why}"):
            args.check_device("device", device)
    assert args.check_device("device", "cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match="^device: 'nosuch' is not a torch device"):
        args.check_device("device", "nosuch")
    with pytest.raises(TypeError, match="^device: expected a torch.device"):
        args.check_device("device", 1.5)
    X, y = np.random.default_rng(0).random((20, 2)), np.zeros(20)
    with pytest.raises(ValueError, match=f"^device: 'cuda' asked for, but .*{why}"):
        KernelRidge(bandwidth=1.0, device="cuda").fit(X, y)
    with pytest.raises(ValueError, match=f"^device: 'cuda' asked for, .*{why}.*; pass arch="):
        km.precompile(km.preset("l1"))
    with pytest.raises(ValueError, match="^device: 'cpu' is not a CUDA device"):
        km.precompile(km.preset("l1"), device="cpu")


@no_cuda
def test_example_with_cuda_device_exits_2_with_one_line():
    r = subprocess.run([sys.executable, str(ROOT / "examples" / "cdist.py"), "--quick", "--device", "cuda"],
                       capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr.startswith("cdist.py: error: --device: 'cuda' asked for") and r.stderr.count("\n") == 1, r.stderr


def test_empty_inputs_have_their_own_message():
    x, empty = torch.randn(5, 3), torch.empty(0, 3)
    with pytest.raises(ValueError, match=r"^y: has no rows \(N = 0\)"):
        km.knn(x, empty, 2)
    with pytest.raises(ValueError, match=r"^y: has no rows \(N = 0\)"):
        km.knn(x, empty, 1, p=float("inf"))
    with pytest.raises(ValueError, match=r"^y: has no rows \(N = 0\)"):
        km.kernel_topk(km.preset("gaussian_l2"), x, empty, 1, bandwidth=1.0)
    assert km.knn(empty, x, 2)[1].shape == (0, 2)
    # an empty sum: -inf, as torch.logsumexp's
    lse = km.kernel_logsumexp(km.preset("gaussian_l2"), x, empty, bandwidth=1.0)
    assert torch.equal(lse, torch.logsumexp(torch.empty(5, 0), 1))
    assert km.kernel_logsumexp(km.preset("gaussian_l2"), empty, x, bandwidth=1.0).shape == (0,)


def test_cuda_call_without_the_extra_names_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.core", None)  # import cuda.core -> ImportError
    compiler.require_cuda_packages.cache_clear()
    compiler.nvrtc_version.cache_clear()
    try:
        with pytest.raises(ImportError, match=r"needs cuda-core.*kermac_like\[cu13\].*kermac_like\[cu12\]"):
            km.precompile(km.preset("l1"), arch="sm_90")
    finally:
        monkeypatch.undo()
        compiler.require_cuda_packages.cache_clear()
        compiler.nvrtc_version.cache_clear()


def test_plain_install_runs_the_cpu_path_without_cuda_packages():
    """Without cuda-core, cuda-bindings, NVRTC's bindings and nvmath-python (the plain install):
    the package imports and its CPU paths run; nothing imports them up front."""
    code = """
import sys
for m in ("cuda", "cuda.core", "cuda.bindings", "cuda.pathfinder", "nvmath", "nvmath.bindings"):
    sys.modules[m] = None
import numpy as np, torch
import kermac_like as km
from kermac_like.cluster import KMeans
from kermac_like.solvers import KernelRidge
x, y = torch.randn(30, 3), torch.randn(20, 3)
assert km.cdist(x, y).shape == (30, 20) and km.knn(x, y, 3)[1].shape == (30, 3)
g = km.preset("gaussian_l2")
assert km.kernel_matvec(g, x, y, torch.randn(20, 2), bandwidth=1.0).shape == (30, 2)
assert km.kernel_logsumexp(g, x, y, bandwidth=1.0).shape == (30,)
X = np.random.default_rng(0).random((40, 3))
assert KernelRidge("gaussian_l2", bandwidth=1.0, alpha=0.1).fit(X, X.sum(1)).predict(X[:2]).shape == (2,)
assert KMeans(3, random_state=0).fit(X).cluster_centers_.shape == (3, 3)
a = torch.eye(4, dtype=torch.float64) * 2
assert km.linalg.solve_cholesky(a, torch.ones(1, 4, dtype=torch.float64))[0].shape == (1, 4)
print("cpu ok")
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0 and "cpu ok" in r.stdout, r.stderr


@pytest.mark.filterwarnings("ignore::UserWarning")  # max_iter reached: the ConvergenceWarning
def test_debug_records_do_not_land_on_the_progress_bar(capsys):
    pytest.importorskip("tqdm")
    log = logging.getLogger("kermac_like")
    handler = logging.StreamHandler(sys.stderr)  # the captured stderr, where tqdm writes too
    handler.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
    log.addHandler(handler)
    old = log.level
    log.setLevel(logging.DEBUG)
    try:
        X = np.random.default_rng(0).random((200, 3))
        KernelRidge("gaussian_l2", bandwidth=0.5, alpha=1e-2, solver="cg", n_landmarks=0, tol=1e-30, max_iter=4,
                    verbose=True).fit(X, np.sin(X.sum(1)))
    finally:
        log.removeHandler(handler)
        log.setLevel(old)
    assert log.handlers == [] or handler not in log.handlers
    err = capsys.readouterr().err
    assert "KernelRidge cg" in err  # the bar was up
    records = [line for line in err.split("\n") if "cg iteration" in line]
    assert len(records) == 4, err
    for line in records:  # each record on a line of its own: nothing of the bar before it
        assert line.split("\r")[-1].startswith("[kermac_like.solvers] cg iteration"), repr(line)
