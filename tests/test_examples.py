"""The example CLIs and the benchmark run end to end (--quick -d), plus the RFM
gradient mapping and the benchmark's torch formulas against independent oracles.

Each script runs in a subprocess with ``sys.executable``; on a machine without
CUDA they take the CPU reference path.  The kernel cache directory comes from
conftest's private ``KERMAC_LIKE_CACHE_DIR`` (inherited by the subprocesses).
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
BENCH = ROOT / "bench"

# script -> a line every successful run prints
KEY_LINES = {
    "cdist.py": "relative error vs float64",
    "cdist_grad.py": "relative error vs float64",
    "build_a_kernel.py": "worst relative error",
    "broadcast_kernel.py": "worst difference batched vs loop",
    "kernel_regression.py": "KernelRidge",
    "rfm.py": "relative test MSE",
    "linalg.py": "",
    "kernel_matvec.py": "relative error vs float64",
    "knn.py": "recall vs torch",
    "gp_regression.py": "same MLL",
    "sinkhorn.py": "Sinkhorn divergence",
    "kmeans.py": "same labels as scikit-learn: yes",
}
# script -> the optional packages it needs
NEEDS = {"gp_regression.py": ("gpytorch", "sklearn"), "kmeans.py": ("sklearn",)}


def _run(args, timeout=240, **kw):
    env = dict(os.environ)
    env.pop("KERMAC_LIKE_DEBUG", None)
    p = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=timeout, **kw)
    return p, p.stdout + p.stderr


def _sys_path_for_examples():
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


# Without CUDA, the examples run as forks of one process that imported torch, the package and
# scikit-learn once (each fork runs a script as __main__ with its argv, its own stdout and stderr,
# from the same untouched state): ~2.5 CPU-s of imports a script less than a process each. With CUDA
# each script is a process of its own (a process that has touched CUDA must not fork).
_FORK_SERVER = r"""
import json, os, runpy, signal, sys, traceback
import torch
import kermac_like
from kermac_like.runtime import store
try:
    import sklearn  # noqa: F401  (the examples' optional package, imported once)
except ImportError:
    pass
if store.prepare_thread is not None:
    store.prepare_thread.join()  # no thread of this process runs at a fork
todo, timeout = json.loads(sys.argv[1]), int(sys.argv[2])
running = {}


def start(job):
    name, script, out, err, argv, hidden = job
    pid = os.fork()
    if pid:
        running[pid] = name
        return
    try:
        signal.alarm(timeout)
        fo, fe = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fo, 1)
        os.dup2(fe, 2)
        for top in hidden:  # as if not installed: `import top` (and its submodules) raise ImportError
            for m in [m for m in sys.modules if m == top or m.startswith(top + ".")]:
                del sys.modules[m]
            sys.modules[top] = None
        sys.argv = [script, *argv]
        sys.path.insert(0, os.path.dirname(script))  # as `python script` puts it first
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, (int, type(None))):
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


jobs = list(todo)
while jobs or running:
    while jobs and len(running) < 2:
        start(jobs.pop(0))
    pid, status = os.wait()
    name = running.pop(pid)
    print(json.dumps([name, os.waitstatus_to_exitcode(status)]), flush=True)
"""


class _Done:
    """What a test reads of a finished run: returncode, stdout, stderr."""

    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


# The run of kernel_regression.py with scikit-learn hidden (test_kernel_regression_without_sklearn): its name
# among the fork server's runs, the script, its arguments, the packages hidden.
NO_SKLEARN = ("kernel_regression.py without sklearn", EXAMPLES / "kernel_regression.py", ["--quick"], ["sklearn"])
# The benchmark's quick run (test_bench_quick): its name, the script, its arguments but --out (one timed call
# of each workload, no warm-up call: the test reads the rows, the errors and the table, not the timings).
BENCH_QUICK = ("bench/run.py --quick", BENCH / "run.py", ["--quick", "--repeats", "1", "--warmup", "0"])


def _fork_runs(todo, tmp) -> dict:
    """{name: (run, output)}: every script of ``todo`` with --quick -d, NO_SKLEARN's run and BENCH_QUICK's
    (its --out: ``tmp``/bench), at most two at a time, the longest first."""
    name, script, argv = BENCH_QUICK
    todo = ([(name, script, [*argv, "--out", str(tmp / "bench")], [])]
            + [(s, EXAMPLES / s, ["--quick", "-d"], []) for s in todo] + [NO_SKLEARN])
    jobs = [(name, str(script), str(tmp / f"{i}.out"), str(tmp / f"{i}.err"), argv, hidden)
            for i, (name, script, argv, hidden) in enumerate(todo)]
    env = dict(os.environ)
    env.pop("KERMAC_LIKE_DEBUG", None)
    p = subprocess.run([sys.executable, "-c", _FORK_SERVER, json.dumps(jobs), "300"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300 * len(jobs))
    codes = dict(json.loads(line) for line in p.stdout.splitlines() if line.startswith("["))
    runs = {}
    for name, _, out, err, _, _ in jobs:
        o = pathlib.Path(out).read_text() if pathlib.Path(out).exists() else ""
        e = pathlib.Path(err).read_text() if pathlib.Path(err).exists() else ""
        done = _Done(codes.get(name, p.returncode or -1), o, e + ("" if name in codes else p.stderr))
        runs[name] = (done, o + e)
    return runs


@pytest.fixture(scope="module")
def example_runs(tmp_path_factory):
    """Every example that exists here and whose optional packages are installed, run with
    ``--quick -d``, two at a time (the pytest process only waits meanwhile): script -> (process, output)."""
    import importlib.util
    from concurrent.futures import ThreadPoolExecutor

    todo = [s for s in sorted(KEY_LINES) if (EXAMPLES / s).exists()
            and all(importlib.util.find_spec(m) is not None for m in NEEDS.get(s, ()))]
    if _forked():
        tmp = tmp_path_factory.mktemp("examples")
        runs = _fork_runs(todo, tmp)
        runs[BENCH_QUICK[0]] += (tmp / "bench",)
        return runs
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = dict(zip(todo, pool.map(lambda s: _run([str(EXAMPLES / s), "--quick", "-d"]), todo)))
    return runs


@pytest.mark.parametrize("script", sorted(KEY_LINES))
def test_example_quick_debug(script, example_runs):
    path = EXAMPLES / script
    if not path.exists():
        pytest.skip(f"examples/{script} is not in this checkout")
    for module in NEEDS.get(script, ()):
        pytest.importorskip(module)
    p, out = example_runs[script]
    assert p.returncode == 0, out[-4000:]
    assert KEY_LINES[script] in p.stdout, out[-4000:]
    if not torch.cuda.is_available():
        assert "CPU reference path" in p.stdout or script == "linalg.py", p.stdout[-2000:]
    # -d shows the library's activity (JIT/cache on a GPU, the chosen path on a CPU)
    assert "kermac_like" in p.stderr, p.stderr[-2000:]


def _forked() -> bool:
    """Whether example_runs runs the scripts as forks of one server (no CUDA), and so also NO_SKLEARN's and
    BENCH_QUICK's runs."""
    return not torch.cuda.is_available() and hasattr(os, "fork")


def test_kernel_regression_without_sklearn(request):
    """scikit-learn is an optional extra: the example must still run and say what it skipped. Without
    CUDA, one of the fork server's runs (example_runs), with sklearn and its submodules taken out of
    sys.modules and `import sklearn` made to fail; with CUDA, a process of its own."""
    name, script, argv, hidden = NO_SKLEARN
    if _forked():
        p, out = request.getfixturevalue("example_runs")[name]
    else:
        code = (
            "import sys, runpy; sys.modules['sklearn'] = None; "  # makes `import sklearn` fail
            f"sys.path.insert(0, {str(EXAMPLES)!r}); "
            f"sys.argv = [{script!r}, *{argv!r}]; "
            f"runpy.run_path({str(EXAMPLES / script)!r}, run_name='__main__')"
        )
        p, out = _run(["-c", code])
    assert p.returncode == 0, out[-4000:]
    assert "comparison skipped" in p.stdout, out[-4000:]
    assert "synthetic" in p.stdout


def test_bench_quick(tmp_path, request):
    """bench/run.py --quick end to end: without CUDA one of the fork server's runs (example_runs), with CUDA a
    process of its own."""
    name, script, argv = BENCH_QUICK
    if _forked():
        p, out, tmp_path = request.getfixturevalue("example_runs")[name]
    else:
        p, out = _run([str(script), *argv, "--out", str(tmp_path)], timeout=300)
    assert p.returncode == 0, out[-4000:]
    res = json.loads((tmp_path / "results.json").read_text())
    names = [r["workload"] for r in res["rows"]]
    for w in ("cdist_p1", "cdist_p1.3", "cdist_p2", "laplace_l2_kernel", "cdist_grad_p2", "cdist_grad_p1",
              "cdist_grad_p1.3", "kmeans", "gauss_logsumexp_d3", "cold_compile", "warm_process"):
        assert w in names
    for r in res["rows"]:
        if r["workload"].startswith("cdist") or r["workload"] == "laplace_l2_kernel":
            assert r["ours_ms"] > 0 and r["error"] < 1e-5, r
        if r["workload"] == "gauss_logsumexp_d3":  # bandwidth 1e-3 against float64
            assert r["ours_ms"] > 0 and r["matvec_ms"] > 0 and r["error"] < 1e-5, r
        if r["workload"] == "kmeans":  # the inertia of our final centres against torch's loop
            assert r["ours_ms"] > 0 and r["torch_ms"] > 0 and r["error"] < 1e-4, r
    table = (tmp_path / "table.md").read_text()
    assert "| workload |" in table
    assert table.strip().splitlines()[-1] in p.stdout  # the table is printed last, as written
    if not torch.cuda.is_available():
        assert res["path"] == "CPU reference path"
        assert "CPU reference path" in p.stdout
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        assert (tmp_path / "speedup.png").stat().st_size > 0


def test_bench_rejects_unknown_workload(tmp_path, capsys):
    _sys_path_for_examples()  # in this process: the argument check runs before any workload
    from bench.run import main

    with pytest.raises(SystemExit) as e:
        main(["--quick", "--out", str(tmp_path), "--only", "nope"])
    assert e.value.code == 2 and "unknown workload" in capsys.readouterr().err


# -- pure-CPU checks of the formulas the examples and the benchmark rely on ---------------------
def _autograd_laplace_grad(x, alpha, z, mhalf, bw):
    """d/dz of f_o(z) = sum_i alpha[o,i] exp(-||(z - x_i) mhalf|| / bw), by torch.autograd (float64)."""
    zz = z.clone().requires_grad_(True)
    f = torch.exp(-((zz.unsqueeze(1) - x.unsqueeze(0)) @ mhalf).norm(dim=-1) / bw) @ alpha.T  # (m, O)
    return torch.stack([torch.autograd.grad(f[:, o].sum(), zz, retain_graph=True)[0] for o in range(f.shape[1])])


@pytest.mark.parametrize("n,m,D,O", [(30, 17, 5, 1), (41, 23, 7, 3)])
def test_rfm_gradient_matches_autograd(n, m, D, O):
    _sys_path_for_examples()
    import rfm

    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, D, generator=g, dtype=torch.float64)
    z = torch.randn(m, D, generator=g, dtype=torch.float64)
    alpha = torch.randn(O, n, generator=g, dtype=torch.float64)
    mhalf = torch.eye(D, dtype=torch.float64) + 0.4 * torch.randn(D, D, generator=g, dtype=torch.float64)
    want = _autograd_laplace_grad(x, alpha, z, mhalf, 1.7)
    got = rfm.laplace_gradients(x, alpha, z, mhalf, 1.7)
    assert got.shape == (O, m, D)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)


def test_rfm_gradient_at_training_points_is_finite():
    """Evaluated at the training points themselves (as RFM does) the self term contributes 0."""
    _sys_path_for_examples()
    import rfm

    g = torch.Generator().manual_seed(3)
    x = torch.randn(25, 4, generator=g, dtype=torch.float64)
    alpha = torch.randn(1, 25, generator=g, dtype=torch.float64)
    mhalf = torch.eye(4, dtype=torch.float64)
    got = rfm.laplace_gradients(x, alpha, x, mhalf, 2.0)
    assert torch.isfinite(got).all()
    # oracle: autograd with the self term removed (its cusp has no gradient)
    for j in range(3):
        keep = torch.arange(25) != j
        want = _autograd_laplace_grad(x[keep], alpha[:, keep], x[j:j + 1], mhalf, 2.0)
        torch.testing.assert_close(got[:, j:j + 1], want, rtol=1e-9, atol=1e-12)


@pytest.mark.gpu
def test_rfm_gradient_on_gpu():
    _sys_path_for_examples()
    import rfm

    assert rfm.gradient_check(torch.device("cuda")) < 1e-4


def test_bench_torch_cdist_grad_formulas():
    _sys_path_for_examples()
    from bench.run import grad_formula_float64, torch_cdist_grad_p2
    from kermac_like.reference import cdist_grad_reference

    g = torch.Generator().manual_seed(0)
    L, K, M, N, O = 2, 13, 11, 5, 3
    a = torch.rand(L, K, M, generator=g, dtype=torch.float64)
    b = torch.randn(L, N, K, generator=g, dtype=torch.float64)
    c = torch.randn(L, O, K, generator=g, dtype=torch.float64)
    d = torch.randn(L, N, M, generator=g, dtype=torch.float64)
    want = cdist_grad_reference(a, b, c, d, 2.0)
    torch.testing.assert_close(torch_cdist_grad_p2(a, b, c, d), want)
    for p in (1.0, 1.3, 2.0):
        ref = cdist_grad_reference(a, b, c, d, p)
        torch.testing.assert_close(grad_formula_float64(a, b, c, d, p, 4, 7), ref[..., :4, :7])


def test_bench_lowk_targets():
    """bench/run.py's reading of issue #16's targets off the lowk rows: the worst K <= 8 ratio
    to the write floor (the batch row is not a sweep point), the K = 37 times, torch."""
    _sys_path_for_examples()
    from bench.run import lowk_targets

    def row(op, K, ours, torch_ms=10.0, floor=0.5):
        return dict(op=op, K=K, ours_ms=ours, torch_ms=torch_ms, floor_ms=floor)

    rows = [row("cdist_p1", 1, 0.70), row("laplace_l2", 8, 0.74), row("cdist_p1", 37, 1.39),
            row("cdist_p2", 37, 0.9), row("laplace_l2", 37, 0.95), row("gaussian_l2", 64, 1.0),
            dict(op="batch_laplace_l2", K=3, ours_ms=0.2, torch_ms=1.0, floor_ms=0.05)]
    text = lowk_targets(rows)
    assert "worst laplace_l2 K=8 0.740 ms = 1.48x of 0.500 ms: met" in text
    assert "cdist_p1 1.390 / cdist_p2 0.900 / laplace_l2 0.950: met" in text
    assert text.endswith("faster than torch at every point: yes")
    rows[1]["ours_ms"], rows[2]["ours_ms"], rows[5]["torch_ms"] = 0.76, 1.41, 0.9
    text = lowk_targets(rows)
    assert "1.52x of 0.500 ms: NOT met" in text and "laplace_l2 0.950: NOT met" in text
    assert text.endswith("NO: gaussian_l2 K=64")
    assert lowk_targets([rows[-1]]) == "lowk targets: no lowk rows"
