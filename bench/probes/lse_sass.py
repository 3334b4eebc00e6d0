"""SASS of kernel_logsumexp's pair loop (no GPU: NVRTC cubin + cuobjdump), with its opcode
counts by pipe, for the shipped instantiation and the variants (bench/notes/logsumexp.md).

    PYTHONPATH=. python3 bench/probes/lse_sass.py [--variant V ...] [--K 3] [--C 1] [--dump]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys

import torch

sys.path.insert(0, ".")
from bench.probes.sass_counts import opcode, sass_functions  # noqa: E402
from kermac_like.descriptor import PRESETS  # noqa: E402
from kermac_like.runtime.compiler import compile_specs  # noqa: E402
from kermac_like.runtime.specs import logsumexp as lse  # noqa: E402
from kermac_like.runtime.specs import matvec as mv  # noqa: E402

MUFU = {"MUFU"}
FP32 = {"FADD", "FMUL", "FFMA", "FMNMX", "FSETP", "FSEL", "FCHK"}


def loops(instrs):
    """[(start, end, body)] of the backward branches' bodies, innermost (shortest) first."""
    out = []
    for addr, ins in instrs:
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", ins)
        if "BRA" in opcode(ins) and m and m.group(1):
            target = int(m.group(1), 16)
            if target < addr:
                out.append((target, addr, [(a, i) for a, i in instrs if target <= a <= addr]))
    return sorted(out, key=lambda t: -len(t[2]))


def report(name, instrs, pairs_per_trip, dump, _nested=False):
    ls = loops(instrs)
    if not ls:
        print(name, ": no loop")
        return
    # The pair loop: the innermost backward branch (no other backward branch inside) with the
    # most MUFU.EX2. Forward-branched cold code inside its range (the lazy redo) is counted apart.
    inner = [t for t in ls if not any(o is not t and t[0] <= o[0] and o[1] < t[1] for o in ls)]
    hot = [t for t in inner if sum("MUFU.EX2" in i for _, i in t[2]) >= pairs_per_trip]
    if len(hot) > 1 and not _nested:  # several pair loops (variant 3: expanded, fold, plain): each
        for t in hot:
            report(name, [(a, i) for a, i in instrs if t[0] <= a <= t[1]], pairs_per_trip, dump, _nested=True)
        return
    start, end, body = max(inner, key=lambda t: sum("MUFU.EX2" in i for _, i in t[2]))
    # Cold: the ranges that forward branches of the loop skip when they hold MUFU.LG2 (the lazy
    # redo's log2 of the old sum; the hot path has none). The widest such range per branch.
    cold = set()
    for a, i in body:
        m = re.search(r"BRA\s+(?:\S+,\s*)?(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", i)
        if "BRA" in opcode(i) and m and m.group(1):
            tgt = int(m.group(1), 16)
            if a < tgt <= end:
                skipped = [b for b, j in body if a < b < tgt]
                if any("MUFU.LG2" in j for b, j in body if a < b < tgt):
                    cold |= set(skipped)
    body = [(a, i) for a, i in body if a not in cold]
    ops = collections.Counter(opcode(i) for _, i in body)
    n = len(body)
    n_cold = len(cold)
    mufu = sum(v for k, v in ops.items() if k.startswith("MUFU.EX2"))
    print(f"{name}: loop {start:x}..{end:x}: {n} instructions for {pairs_per_trip} pairs "
          f"(hot path; {n_cold} cold redo instructions left out) = {n / pairs_per_trip:.2f} issue/pair, MUFU {mufu / pairs_per_trip:.2f}/pair "
          f"({8 * mufu / pairs_per_trip:.2f} MUFU cycles/warp-pair)")
    print("   ", dict(sorted(ops.items(), key=lambda kv: -kv[1])))
    if dump:
        for a, i in body:
            print(f"      {a:05x}  {i}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", type=int, action="append")
    ap.add_argument("--K", type=int, default=3)
    ap.add_argument("--C", type=int, default=1)
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--dump", action="store_true")
    ap.add_argument("--matvec", action="store_true")
    args = ap.parse_args()
    g = PRESETS["gaussian_l2"]
    variants = args.variant or [None]
    for v in variants:
        kw = {} if v is None else {"variant": v}
        spec = lse.lse_spec(g, torch.float32, args.K, args.C, **kw)
        rec, res = compile_specs([spec], args.arch)
        funcs = sass_functions(rec.cubin)
        low = {e: l for _, e, l in rec.kernels}[spec.name_expression]
        u, r = lse.trip_shape(spec)
        print(f"== variant {v}: {spec.name_expression}\n   ptxas {res[spec.name_expression]}; "
              f"trip = {u} points x {r} rows")
        report("lse", funcs[low], u * r, args.dump)
    if args.matvec:
        spec = mv.matvec_spec(g, torch.float32, args.K, args.C)
        rec, res = compile_specs([spec], args.arch)
        funcs = sass_functions(rec.cubin)
        low = {e: l for _, e, l in rec.kernels}[spec.name_expression]
        print(f"== matvec {spec.name_expression}\n   ptxas {res[spec.name_expression]}")
        report("matvec (4 points x 8 rows)", funcs[low], 32, args.dump)


if __name__ == "__main__":
    main()
