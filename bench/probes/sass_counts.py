"""SASS instruction counts of the distance / cdist_grad instantiations that the
NaN and sanitizer work touches, to check that a change leaves the hot loops alone.

    PYTHONPATH=. python3 bench/probes/sass_counts.py > before.json
    ... edit ...
    PYTHONPATH=. python3 bench/probes/sass_counts.py --diff before.json

Counts per kernel: all instructions, and the instructions of the innermost
loops (backward branches: the body between a BRA's target and the BRA), by
opcode. No GPU needed (NVRTC compiles cubin; cuobjdump from pip disassembles).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from kermac_like.runtime.compiler import compile_specs
from kermac_like.descriptor import PRESETS
from kermac_like.layout import Layout
from kermac_like.runtime.specs import (distance_spec, grad_mma_spec, grad_spec, mma_traits_spec, wgmma_prepare_spec,
                                wgmma_traits_spec)


def cuobjdump() -> str:
    try:
        import nvidia

        for root in nvidia.__path__:
            for sub in ("cu13", "cu12", "cuda_cuobjdump"):
                cand = Path(root) / sub / "bin" / "cuobjdump"
                if cand.exists():
                    return str(cand)
    except ImportError:
        pass
    return "cuobjdump"


def sass_functions(cubin: bytes) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        text = subprocess.run([cuobjdump(), "-sass", path], check=True, capture_output=True, text=True).stdout
    finally:
        os.unlink(path)
    funcs, name = {}, None
    for line in text.splitlines():
        m = re.match(r"\s+Function : (\S+)", line)
        if m:
            name = m.group(1)
            funcs[name] = []
            continue
        m = re.match(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m and name:
            funcs[name].append((int(m.group(1), 16), m.group(2)))
    return funcs


def opcode(ins: str) -> str:
    ins = re.sub(r"^@!?U?P\w+\s+", "", ins)
    return ins.split()[0] if ins.split() else ins


def counts(instrs) -> dict:
    total = collections.Counter(opcode(i) for _, i in instrs)
    loops = collections.Counter()
    for addr, ins in instrs:
        m = re.search(r"BRA\s+(?:`\(\.L_x_\d+\)|0x([0-9a-f]+))", ins)
        if "BRA" in opcode(ins) and m and m.group(1):
            target = int(m.group(1), 16)
            if target < addr:
                body = [i for a, i in instrs if target <= a <= addr]
                loops[f"loop@{target:x}"] = len(body)
    return {"total": sum(total.values()), "loops": dict(loops), "ops": dict(total)}


def specs():
    row, col = Layout.ROW_MAJOR, Layout.COL_MAJOR
    out = {
        "sm_90": [
            distance_spec(PRESETS["l1"], row, row, row, 1),
            distance_spec(PRESETS["p_norm"], row, row, row, 1),
            distance_spec(PRESETS["l2"], col, col, row, 4),
            distance_spec(PRESETS["laplace_l2"], row, row, row, 1),
            grad_spec("abs", 1), grad_spec("square", 1), grad_spec("pow", 1),
            grad_mma_spec("square", 1), grad_mma_spec("pow", 1),
        ],
        "sm_80": [
            mma_traits_spec(PRESETS["l2"], row, torch.float32),
            mma_traits_spec(PRESETS["laplace_l2"], row, torch.float32),
            mma_traits_spec(PRESETS["l2"], row, torch.float16),
        ],
        "sm_90a": [
            wgmma_traits_spec(PRESETS["l2"], row),
            wgmma_traits_spec(PRESETS["laplace_l2"], row),
            wgmma_traits_spec(PRESETS["gaussian_l2"], col),
            wgmma_prepare_spec(small=True, norms=True),
        ],
    }
    return out


def measure() -> dict:
    res = {}
    for arch, group in specs().items():
        base = arch.rstrip("a")
        by_suffix = collections.defaultdict(list)
        for s in group:
            by_suffix[s.arch_suffix].append(s)
        for suffix, ss in by_suffix.items():
            rec, _ = compile_specs(ss, base)
            funcs = sass_functions(rec.cubin)
            lowered = {expr: low for _, expr, low in rec.kernels}
            for s in ss:
                res[f"{arch}:{s.name_expression}"] = counts(funcs[lowered[s.name_expression]])
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--diff", help="earlier JSON output to compare with")
    args = ap.parse_args()
    now = measure()
    if not args.diff:
        json.dump(now, sys.stdout, indent=1)
        return
    before = json.loads(Path(args.diff).read_text())
    for k, v in now.items():
        b = before.get(k)
        short = re.sub(r"kermac_like::", "", k)[:150]
        if b is None:
            print(f"NEW   {short}: total {v['total']}")
            continue
        same_loops = b["loops"] == v["loops"]
        print(f"{'same ' if same_loops else 'LOOPS'} {short}\n      total {b['total']} -> {v['total']}; "
              f"inner loops {sorted(b['loops'].values())} -> {sorted(v['loops'].values())}")
        if b["ops"] != v["ops"]:
            d = {op: v["ops"].get(op, 0) - b["ops"].get(op, 0) for op in set(b["ops"]) | set(v["ops"])}
            print("      ops changed:", {k2: x for k2, x in sorted(d.items()) if x})


if __name__ == "__main__":
    main()
