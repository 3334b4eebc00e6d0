"""Strong scaling of the multi-GPU code paths (issue 47): in one call, every workload at 1, 2, 4, ..., G
ranks (torchrun, one process per GPU, NCCL; gloo on CPU processes with --device cpu), one table.

    bench/scale_out.sh --out $OUT/scale_out.json            # G = every visible GPU
    bench/scale_out.sh --ranks 8 --only knn --out r.json    # one workload
    bench/scale_out.sh --ranks 8 --out r.json --resume      # only the runs r.json lacks (a long job in parts)
    bench/scale_out.sh --device cpu --tiny --ranks 4        # gloo, tiny sizes: the script checked on a CPU

Workloads (full sizes; --tiny in brackets):

  falkon  examples/large_scale_krr.py's data (make_data: the same rows whatever the number of ranks, each
          rank generating only its chunks) and estimator: KernelRidge(solver="nystrom"), gaussian_l2,
          bandwidth 1.5, alpha = 1e-6 N [1e-4 N], D = 8, m = 20 000 centres, tol 1e-4, float32, N = 10^9
          [2 x 10^4, m = 200]. A rank count at which one rank's share does not fit (the free memory of
          the GPUs, measured first, against the per-rank bound of KernelRidge's docstring: X and y,
          8 m^2, the build's blocks, a pass's 0.54 GB and 2 GiB of slack) runs N = 10^8 [2 x 10^3]
          instead; the decision is printed and stored.
  knn     knn_d128 with y sharded: NearestNeighbors(n_neighbors=10).fit(shard).kneighbors(x) at
          M = N = 10^7, D = 128, float32 [M = N = 4000]; every rank makes the same x, and its shard is a
          contiguous block of one y (blocks of rows from fixed seeds) in rank order.
  cg      KernelRidge(solver="cg") on falkon's data at N = 10^6, 5 000 landmarks, tol 1e-4 [3000, 100].

Each (workload, N, ranks) is one torchrun call (NCCL_NVLS_ENABLE=0, NVLink multicast off), after a
small untimed warm-up in the same processes (JIT compilation). Columns: seconds (falkon, cg:
KernelRidge.fit_time_, the slowest rank; knn: the collective kneighbors call between a barrier
and a device synchronisation, the slowest rank, median of --knn-repeats), speed-up and parallel
efficiency against the fewest ranks that ran the same N, peak memory of a rank (CUDA:
max_memory_allocated over the whole run, the largest rank; CPU: the largest peak resident set),
and the check against the run of the fewest ranks: falkon and cg, R^2 on the test rows within 0.001
and the predictions on the first 1000 test rows within --pred-rtol (relative, L2); knn, identical
neighbour indices on SAMPLE_ROWS sampled rows (the first, the last, evenly spaced ones) and their
distances within 1e-6. Falkon runs at 10^9 whose reference ran at 10^8 compare R^2 only.

Every run goes to --out (JSON: the runs, the decisions, the table) with its log beside it
(OUT.logs/); the exit status is 1 when a run failed or a check did not hold.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKLOADS = ("falkon", "knn", "cg")
SAMPLE_ROWS = 512  # knn rows compared with the reference run
PRED_ROWS = 1000  # test rows whose predictions are compared
R2_TOL = 1e-3

FULL = dict(falkon_n=10**9, falkon_fallback_n=10**8, centers=20_000, knn_n=10**7, cg_n=10**6, landmarks=5000,
            n_test=10_000, knn_repeats=1, timeout=1800)
TINY = dict(falkon_n=20_000, falkon_fallback_n=2000, centers=200, knn_n=4000, cg_n=3000, landmarks=100,
            n_test=300, knn_repeats=3, timeout=600)
D_KRR, D_KNN, K_KNN = 8, 128, 10
# large_scale_krr.py's defaults: the ridge alpha = LAM N (its --quick's 1e-4 with --tiny: at 1e-6, 3000 rows
# and 100 landmarks, float32 cg stalls above tol)
BANDWIDTH, LAM, LAM_TINY, TOL = 1.5, 1e-6, 1e-4, 1e-4
KNN_BLOCK = 50_000  # rows of y per seeded block


# ------------------------------------------------------------------------------------------------
# The launcher: rank counts, memory decisions, torchrun calls, the table
# ------------------------------------------------------------------------------------------------

def rank_counts(spec: str, visible: int) -> list[int]:
    """'8' -> [1, 2, 4, 8]; '6' -> [1, 2, 4, 6]; '1,8' -> [1, 8]; '' -> every visible GPU."""
    if "," in spec:
        out = sorted({int(s) for s in spec.split(",") if s.strip()})
    else:
        g = int(spec) if spec else visible
        out = [r for r in (2 ** i for i in range(g.bit_length())) if r <= g]
        if out[-1] != g:
            out.append(g)
    if not out or out[0] < 1:
        raise ValueError(f"--ranks: expected a positive count or a list of them, got {spec!r}")
    return out


def falkon_rows_per_rank(n: int, ranks: int) -> int:
    """The largest share of examples/large_scale_krr.make_data's rows over ``ranks`` (contiguous runs
    of its chunks)."""
    from large_scale_krr import chunk_rows

    chunk = chunk_rows(n)
    chunks = -(-n // chunk)
    return max(sum(min(chunk, n - k * chunk) for k in range(r * chunks // ranks, (r + 1) * chunks // ranks))
               for r in range(ranks))


def falkon_bytes(n: int, ranks: int, m: int, device: str, d: int = D_KRR) -> int:
    """Bytes one rank of a float32 falkon fit needs (KernelRidge's per-rank bound): X and y, the m x m
    float64 factors, the preconditioner build's blocks (~0.15 GB at m = 20 000), a pass's
    temporaries (WORK_BYTES, 0.54 GB) and, on a GPU, 2 GiB for the CUDA context, cuSOLVER's
    workspace, the test rows and the data generation's chunk (on a CPU 0.5 GB: the process)."""
    rows = falkon_rows_per_rank(n, ranks)
    b = max(1, min(m, 1024, (1 << 27) // (8 * m)))
    slack = (2 << 30) if device == "cuda" else (1 << 29)
    return rows * (d + 1) * 4 + 8 * m * m + 16 * m + 8 * m * b + 24 * b * b + (1 << 29) + slack


def free_memory(device: str, ranks: int) -> int:
    """Free bytes of the smallest GPU (measured in a child process: no CUDA context stays in this
    one), or on a CPU the available host memory divided among the ranks."""
    if device == "cuda":
        code = ("import torch; print(min(torch.cuda.mem_get_info(i)[0] for i in range(torch.cuda.device_count())))")
        return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    return int(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")) // ranks


def plan_falkon(cfg, counts, device, mem_per_rank=None) -> tuple[dict, list[str]]:
    """{ranks: N} and the lines saying why: N = falkon_n where a rank's share fits 90 % of the free
    memory, else falkon_fallback_n where that fits, else nothing."""
    plan, why = {}, []
    gpu_free = free_memory(device, 1) if device == "cuda" and mem_per_rank is None else None
    for r in counts:
        free = mem_per_rank if mem_per_rank is not None else gpu_free or free_memory(device, r)
        for n in (cfg["falkon_n"], cfg["falkon_fallback_n"]):
            need = falkon_bytes(n, r, cfg["centers"], device)
            if need <= 0.9 * free:
                plan[r] = n
                why.append(f"falkon at {r} rank(s): N = {n:.0e} needs {need / 1e9:.1f} GB a rank, "
                           f"{free / 1e9:.1f} GB free a rank: runs at N = {n:.0e}")
                break
            why.append(f"falkon at {r} rank(s): N = {n:.0e} needs {need / 1e9:.1f} GB a rank, "
                       f"{free / 1e9:.1f} GB free a rank: does not fit")
        else:
            why.append(f"falkon at {r} rank(s): not run (no size fits)")
    return plan, why


def run_one(args, cfg, workload, n, ranks, log_dir: pathlib.Path) -> dict:
    """One torchrun call; the record rank 0 wrote, with rc, wall seconds and the log's path."""
    log = log_dir / f"{workload}-n{n}-r{ranks}.log"
    with tempfile.TemporaryDirectory() as tmp:
        rec_path = pathlib.Path(tmp) / "record.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
               f"--nproc_per_node={ranks}", str(pathlib.Path(__file__).resolve()), "--worker", workload,
               "--device", args.device, "--size", str(n), "--record", str(rec_path)]
        for key in ("centers", "landmarks", "n_test", "knn_repeats"):
            cmd += [f"--{key.replace('_', '-')}", str(cfg[key])]
        if args.tiny:
            cmd.append("--tiny")
        env = dict(os.environ, NCCL_NVLS_ENABLE="0",
                   PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "examples"), os.environ.get("PYTHONPATH", "")]))
        env["OMP_NUM_THREADS"] = str(args.threads if args.device == "cpu"
                                     else max(1, (os.cpu_count() or ranks) // ranks))
        t0 = time.perf_counter()
        try:
            with open(log, "w") as f:
                p = subprocess.run(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                   timeout=cfg["timeout"])
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = 124
        wall = time.perf_counter() - t0
        rec = json.loads(rec_path.read_text()) if rc == 0 and rec_path.exists() else {}
    tail = "" if rc == 0 else log.read_text()[-3000:]
    rec.update(workload=workload, n=n, ranks=ranks, rc=rc, wall_s=round(wall, 2), log=str(log))
    if tail:
        rec["error_tail"] = tail
    return rec


def _rel(a, b) -> float:
    num = math.sqrt(sum((x - y) ** 2 for x, y in zip(a, b)))
    den = math.sqrt(sum(y * y for y in b)) or 1.0
    return num / den


def compare(rec: dict, ref: dict, pred_rtol: float) -> tuple[bool, str]:
    """(ok, words): rec against the reference run of the same workload."""
    if rec is ref:
        return True, "reference" + (f" (R^2 {rec['r2']:.5f})" if "r2" in rec else "")
    if rec["workload"] == "knn":
        a, b = rec["sample_idx"], ref["sample_idx"]
        same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb)) / max(1, sum(len(r) for r in b))
        dd = max((abs(x - y) / max(abs(y), 1e-30) for ra, rb in zip(rec["sample_dist"], ref["sample_dist"])
                  for x, y in zip(ra, rb)), default=0.0)
        ok = same == 1.0 and dd <= 1e-6
        return ok, f"indices identical on {len(b)} rows: {same:.4f}, distances {dd:.1e}"
    dr2 = abs(rec["r2"] - ref["r2"])
    if rec["n"] != ref["n"]:
        return dr2 <= R2_TOL, f"R^2 {rec['r2']:.5f}, {dr2:.1e} from N = {ref['n']:.0e}'s"
    dp = _rel(rec["pred"], ref["pred"])
    return dr2 <= R2_TOL and dp <= pred_rtol, f"R^2 diff {dr2:.1e}, predictions {dp:.1e}"


def table(runs: list[dict], pred_rtol: float) -> tuple[list[dict], bool]:
    """The rows of the strong-scaling table and whether every run passed."""
    rows, all_ok = [], True
    for w in WORKLOADS:
        mine = sorted((r for r in runs if r["workload"] == w), key=lambda r: (r["ranks"], -r["n"]))
        if not mine:
            continue
        ok_runs = [r for r in mine if r["rc"] == 0]
        check_ref = ok_runs[0] if ok_runs else None  # the fewest ranks (the largest N among them)
        for rec in mine:
            row = dict(workload=w, n=rec["n"], ranks=rec["ranks"])
            if rec["rc"] != 0:
                row.update(ok=False, check=f"failed (rc {rec['rc']}; {rec['log']})")
                rows.append(row)
                all_ok = False
                continue
            base = min((r for r in ok_runs if r["n"] == rec["n"]), key=lambda r: r["ranks"])
            speed = base["seconds"] / rec["seconds"] if rec["seconds"] > 0 else float("nan")
            ok, words = compare(rec, check_ref, pred_rtol)
            all_ok &= ok
            row.update(seconds=rec["seconds"], speedup=speed, efficiency=speed * base["ranks"] / rec["ranks"],
                       base_ranks=base["ranks"], peak_gb=max(rec["peak_gb"]), ok=ok, check=words)
            rows.append(row)
    return rows, all_ok


def format_table(rows: list[dict], mem_label: str) -> str:
    head = f"| workload | N | ranks | seconds | speed-up | efficiency | {mem_label} | check |"
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "seconds" not in r:
            lines.append(f"| {r['workload']} | {r['n']:.0e} | {r['ranks']} | - | - | - | - | {r['check']} |")
            continue
        base = "" if r["base_ranks"] == 1 else f" (vs {r['base_ranks']})"
        lines.append(f"| {r['workload']} | {r['n']:.0e} | {r['ranks']} | {r['seconds']:.3f} | {r['speedup']:.2f}{base} "
                     f"| {r['efficiency']:.2f} | {r['peak_gb']:.2f} | {'ok' if r['ok'] else 'FAIL'}: {r['check']} |")
    return "\n".join(lines)


def launcher(args) -> int:
    cfg = dict(TINY if args.tiny else FULL)
    for key in cfg:
        v = getattr(args, key, None)
        if v is not None:
            cfg[key] = v
    if args.device == "cuda":
        import torch

        visible = torch.cuda.device_count()
        if visible == 0:
            print("scale_out: no CUDA device visible; pass --device cpu", file=sys.stderr)
            return 2
    else:
        visible = 2
    counts = rank_counts(args.ranks, visible)
    if args.device == "cuda" and counts[-1] > visible:
        print(f"scale_out: --ranks asks for {counts[-1]} ranks, {visible} GPU(s) visible", file=sys.stderr)
        return 2
    only = args.only or list(WORKLOADS)
    out = pathlib.Path(args.out or pathlib.Path(tempfile.gettempdir()) /
                       f"scale_out-{args.device}{'-tiny' if args.tiny else ''}.json")
    log_dir = out.with_name(out.name + ".logs")
    log_dir.mkdir(parents=True, exist_ok=True)
    old = json.loads(out.read_text()) if args.resume and out.exists() else {}
    runs = [r for r in old.get("runs", []) if r["rc"] == 0]
    done = {(r["workload"], r["n"], r["ranks"]) for r in runs}

    decisions = []
    plan = {"knn": {r: cfg["knn_n"] for r in counts}, "cg": {r: cfg["cg_n"] for r in counts}}
    if "falkon" in only:
        plan["falkon"], why = plan_falkon(cfg, counts, args.device, args.mem_per_rank)
        decisions += why
        for line in why:
            print(line, flush=True)
    for w in only:
        for r, n in plan[w].items():
            if (w, n, r) in done:
                print(f"{w} N = {n:.0e} at {r} rank(s): in {out} already", flush=True)
                continue
            print(f"{w} N = {n:.0e} at {r} rank(s) ...", end=" ", flush=True)
            rec = run_one(args, cfg, w, n, r, log_dir)
            print(f"rc {rec['rc']}, {rec.get('seconds', float('nan')):.3f} s (wall {rec['wall_s']:.1f} s)", flush=True)
            runs = [x for x in runs if (x["workload"], x["n"], x["ranks"]) != (w, n, r)] + [rec]
            _write(out, args, cfg, counts, decisions + old.get("decisions", []), runs)

    rows, ok = table(runs, args.pred_rtol)
    mem_label = "peak GB a rank (allocated)" if args.device == "cuda" else "peak GB a rank (RSS)"
    text = format_table(rows, mem_label)
    print(text)
    _write(out, args, cfg, counts, decisions + old.get("decisions", []), runs, rows)
    print(f"scale_out: {len(runs)} run(s) in {out} (logs in {log_dir}); {'all checks hold' if ok else 'FAILED'}")
    return 0 if ok else 1


def _write(out, args, cfg, counts, decisions, runs, rows=None):
    import torch

    meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"), device=args.device, tiny=args.tiny,
                torch=torch.__version__, rank_counts=counts, sizes=cfg, pred_rtol=args.pred_rtol,
                decisions=sorted(set(decisions)), runs=runs)
    try:
        meta["git"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                                     text=True).stdout.strip()
    except OSError:
        pass
    if rows is not None:
        meta["table"] = rows
    out.write_text(json.dumps(meta, indent=1))


# ------------------------------------------------------------------------------------------------
# The worker: one torchrun process
# ------------------------------------------------------------------------------------------------

def _sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _barrier(world):
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _krr_data(args, rank, world, dev):
    import torch
    from large_scale_krr import make_data, make_test

    x, y = make_data(args.size, D_KRR, rank=rank, world=world, seed=0, dtype=torch.float32, device=dev)
    xt, yt, _ = make_test(args.n_test, D_KRR, seed=0, dtype=torch.float32, device=dev)
    return x, y, xt, yt


def _krr_warmup(solver, rank, dev):
    """A small fit and predict on every rank (JIT compilation), as large_scale_krr.py's warm-up."""
    import warnings

    import torch
    from large_scale_krr import make_data, make_test

    from kermac_like.solvers import KernelRidge

    xw, yw = make_data(2048, D_KRR, seed=1 + rank, dtype=torch.float32, device=dev)
    xq = make_test(16, D_KRR, seed=1, dtype=torch.float32, device=dev)[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # max_iter=3's ConvergenceWarning
        KernelRidge("gaussian_l2", bandwidth=BANDWIDTH, alpha=1.0, solver=solver, n_landmarks=64,
                    n_centers=64 if solver == "nystrom" else None, random_state=0, max_iter=3,
                    tol=1e-30).fit(xw, yw).predict(xq)


def work_krr(args, rank, world, dev, solver):
    import warnings

    from kermac_like.solvers import KernelRidge

    x, y, xt, yt = _krr_data(args, rank, world, dev)
    if dev.type == "cuda":  # nothing compiles on a CPU
        _krr_warmup(solver, rank, dev)
    kw = dict(n_centers=args.centers) if solver == "nystrom" else dict(n_landmarks=args.landmarks)
    lam = LAM_TINY if args.tiny else LAM
    model = KernelRidge("gaussian_l2", bandwidth=BANDWIDTH, alpha=lam * args.size, solver=solver, tol=TOL,
                        random_state=0, device=dev, **kw)
    _barrier(world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x, y)
    t0 = time.perf_counter()
    pred = model.predict(xt)
    _sync(dev)
    t_pred = time.perf_counter() - t0
    r2 = model.score(xt, yt)
    mine = dict(seconds=model.fit_time_, rows=int(x.shape[0]), predict_s=t_pred)
    shared = dict(n_iter=model.n_iter_, residual=model.residual_, r2=r2, warnings=[str(w.message) for w in caught],
                  pred=pred[:PRED_ROWS].double().cpu().tolist(), solver=model.solver_,
                  data_mode=getattr(model, "data_mode_", None))
    return mine, shared


def _knn_rows(lo, hi, dev):
    """Rows lo..hi of the global y, the same whatever the shard boundaries."""
    import torch

    parts = []
    for b in range(lo // KNN_BLOCK, -(-hi // KNN_BLOCK)):
        g = torch.Generator(device=dev).manual_seed(1000 + b)
        blk = torch.randn(KNN_BLOCK, D_KNN, device=dev, generator=g)
        s, e = max(lo, b * KNN_BLOCK) - b * KNN_BLOCK, min(hi, (b + 1) * KNN_BLOCK) - b * KNN_BLOCK
        parts.append(blk[s:e])
    return torch.cat(parts) if parts else torch.empty((0, D_KNN), device=dev)


def sample_rows(m: int) -> list[int]:
    """The first and the last SAMPLE_ROWS / 4 rows and SAMPLE_ROWS / 2 evenly spaced ones."""
    q = SAMPLE_ROWS // 4
    spaced = [int(i * (m - 1) / max(1, 2 * q - 1)) for i in range(2 * q)]
    return sorted(set(range(min(q, m))) | set(range(max(0, m - q), m)) | set(spaced))


def work_knn(args, rank, world, dev):
    import torch

    from kermac_like.neighbors import NearestNeighbors

    m = n = args.size
    x = torch.randn(m, D_KNN, device=dev, generator=torch.Generator(device=dev).manual_seed(7))
    lo, hi = rank * n // world, (rank + 1) * n // world
    nn = NearestNeighbors(n_neighbors=K_KNN).fit(_knn_rows(lo, hi, dev))
    nn.kneighbors(x[:4096])  # warm-up (JIT compilation)
    times = []
    for _ in range(args.knn_repeats):
        _barrier(world)
        _sync(dev)
        t0 = time.perf_counter()
        d, i = nn.kneighbors(x)
        _sync(dev)
        times.append(time.perf_counter() - t0)
    rows = torch.tensor(sample_rows(m), device=dev)
    mine = dict(seconds=statistics.median(times), all_s=times, rows=hi - lo)
    shared = dict(sample_idx=i[rows].cpu().tolist(), sample_dist=d[rows].double().cpu().tolist())
    return mine, shared


def worker(args) -> None:
    import resource

    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    if world > 1:
        if dev.type == "cuda":
            dist.init_process_group("nccl", device_id=dev)
        else:
            dist.init_process_group("gloo")
    try:
        with torch.no_grad():
            if args.worker == "knn":
                mine, shared = work_knn(args, rank, world, dev)
            else:
                mine, shared = work_krr(args, rank, world, dev, "nystrom" if args.worker == "falkon" else "cg")
        if dev.type == "cuda":
            mine["peak_gb"] = torch.cuda.max_memory_allocated(dev) / 1e9
        else:
            mine["peak_gb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9
        everyone = [mine]
        if world > 1:
            everyone = [None] * world
            dist.all_gather_object(everyone, mine)
        if rank == 0:
            rec = dict(shared, seconds=max(e["seconds"] for e in everyone), peak_gb=[e["peak_gb"] for e in everyone],
                       per_rank=everyone, backend=dist.get_backend() if world > 1 else None,
                       device_name=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu")
            pathlib.Path(args.record).write_text(json.dumps(rec))
            print(f"{args.worker} N = {args.size} ranks {world}: {rec['seconds']:.3f} s, peak "
                  f"{max(rec['peak_gb']):.2f} GB", flush=True)
    finally:
        if world > 1:
            dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default=None,
                   help="cuda (NCCL, one GPU per rank; the default with a GPU) or cpu (gloo processes)")
    p.add_argument("--ranks", default="", help="G: runs at 1, 2, 4, ..., G ranks (default: every visible GPU; "
                   "2 on a CPU); or a list, 1,8")
    p.add_argument("--only", action="append", choices=WORKLOADS, help="a workload (repeatable; default all)")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (seconds on a CPU)")
    p.add_argument("--out", default=None, help="the JSON of the runs (default: $TMPDIR/scale_out-DEVICE.json)")
    p.add_argument("--resume", action="store_true", help="keep --out's successful runs and run only the others")
    p.add_argument("--threads", type=int, default=1, help="CPU threads a rank (--device cpu)")
    p.add_argument("--pred-rtol", type=float, default=10 * TOL,
                   help="relative L2 difference of the predictions allowed against the reference run")
    p.add_argument("--mem-per-rank", type=float, default=None,
                   help="bytes free a rank for falkon's size decision instead of the measured ones (a check of the "
                        "10^8 fallback)")
    for key in ("falkon_n", "falkon_fallback_n", "centers", "knn_n", "cg_n", "landmarks", "n_test", "knn_repeats",
                "timeout"):
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None, help=f"default {FULL[key]} ({TINY[key]} "
                       "with --tiny)")
    p.add_argument("--worker", choices=WORKLOADS, help=argparse.SUPPRESS)
    p.add_argument("--size", type=int, help=argparse.SUPPRESS)
    p.add_argument("--record", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    sys.path[:0] = [str(ROOT), str(ROOT / "examples")]
    if args.worker:
        worker(args)
        return 0
    return launcher(args)


if __name__ == "__main__":
    sys.exit(main())
