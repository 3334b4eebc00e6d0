"""bench/probes/sanitize_filter.py: compute-sanitizer reports in our kernels are told
apart from reports in cuBLAS / cuSOLVER / torch kernels (bench/sanitize.sh fails only on
ours), on log excerpts in the tool's format."""

import subprocess
import sys
from pathlib import Path

FILTER = Path(__file__).resolve().parents[1] / "bench" / "probes" / "sanitize_filter.py"

LOG = """========= COMPUTE-SANITIZER
simt: ok
========= Error: Potential RAW hazard detected at __shared__ 0x8440 in block (0,1,0) :
=========     Write Thread (36,0,0) at 0x1a90 in void kermac_like::distance_kernel<kermac_like::DistanceTraits<(kermac_like::Inner)0, (kermac_like::Power)1>>(const float *)
=========     Read Thread (100,0,0) at 0x2c30 in void kermac_like::distance_kernel<kermac_like::DistanceTraits<(kermac_like::Inner)0, (kermac_like::Power)1>>(const float *)
=========     Current Value : 0, Incoming Value : 1065353216
=========
========= Error: Potential WAR hazard detected at __shared__ 0x40 in block (0,0,0) :
=========     Read Thread (3,0,0) at 0x900 in void potrf_lower_kernel<double, 32>(int, double *)
=========     Write Thread (7,0,0) at 0x980 in void potrf_lower_kernel<double, 32>(int, double *)
=========     Current Value : 0
=========
========= Invalid __global__ read of size 4 bytes
=========     at kermac_like::cdist_grad_kernel<kermac_like::CdistGradTraits<(kermac_like::Power)2, 1>>(const float *)+0x1230
=========     by thread (5,0,0) in block (0,0,0)
=========
========= RACECHECK SUMMARY: 2 hazards displayed (2 errors, 0 warnings)
"""


def run(tmp_path, text, *extra):
    log = tmp_path / "x.log"
    log.write_text(text)
    r = subprocess.run([sys.executable, str(FILTER), str(log), *extra], capture_output=True, text=True, check=True)
    return r.stdout.splitlines()


def test_ours_and_foreign_are_counted_apart(tmp_path):
    ours, foreign, summary = run(tmp_path, LOG)[0].split(" ", 2)
    assert (ours, foreign) == ("2", "1")
    assert summary.startswith("RACECHECK SUMMARY: 2 hazards")


def test_clean_log(tmp_path):
    text = "========= COMPUTE-SANITIZER\nsimt: ok\n========= ERROR SUMMARY: 0 errors\n"
    assert run(tmp_path, text)[0] == "0 0 ERROR SUMMARY: 0 errors"


def test_verbose_groups_our_reports(tmp_path):
    lines = run(tmp_path, LOG, "-v")
    assert "Potential RAW hazard" in lines[1] and "distance_kernel" in lines[2]
    assert not any("potrf" in line for line in lines)
