"""cuda_templates/ABI.md against the headers: every kernel's __global__ parameter list,
name by name and in order, is the one the document gives (CPU only, reads text)."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
TEMPLATES = ROOT / "cuda_templates"


def _tables(md: str) -> list:
    """The argument names of each table of ABI.md, in order (one list per table)."""
    tables, cur = [], None
    for line in md.splitlines():
        if re.match(r"\|\s*#\s*\|", line):  # a table header starts a new table
            cur = []
            tables.append(cur)
            continue
        if cur is None or not line.startswith("|"):
            cur = None if not line.startswith("|") else cur
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if set(cells[0]) <= {"-", " "}:
            continue
        cur.extend(re.findall(r"`([A-Za-z_][A-Za-z_0-9]*)`", cells[1]))
    return tables


def _signature(name: str) -> list:
    """Parameter names of ``__global__ ... name(...)`` in the headers."""
    for header in sorted(TEMPLATES.glob("*.cuh")):
        text = re.sub(r"//[^\n]*", "", header.read_text())
        m = re.search(r"__global__[^;{]*?\b" + name + r"\s*\(", text)
        if not m:
            continue
        depth, i = 1, m.end()
        while depth:
            depth += {"(": 1, ")": -1}.get(text[i], 0)
            i += 1
        params = text[m.end() : i - 1].split(",")
        return [re.findall(r"[A-Za-z_][A-Za-z_0-9]*", p.split("=")[0])[-1] for p in params]  # defaults dropped
    raise AssertionError(f"no __global__ {name} in {TEMPLATES}")


TABLES = _tables((TEMPLATES / "ABI.md").read_text())
EXPECTED = {
    "distance_kernel": TABLES[0],
    "distance_lowk_kernel": TABLES[0],
    "distance_mma_kernel": TABLES[0] + TABLES[2],
    "distance_wgmma_kernel": TABLES[0] + TABLES[1] + TABLES[2],
    "wgmma_prepare_b_kernel": TABLES[3],
    "cdist_grad_kernel": TABLES[4],
    "cdist_grad_mma_kernel": TABLES[4],
    "matvec_grad_kernel": TABLES[5],
    "matvec_kernel": TABLES[6],
    "matvec_combine_kernel": TABLES[7],
    "topk_kernel": TABLES[8],
    "topk_combine_kernel": TABLES[9],
    "topk_mma_kernel": TABLES[10],
    "topk_rescore_kernel": TABLES[11],
    "lse_kernel": TABLES[12],
    "lse_combine_kernel": TABLES[13],
    "kmeans_update_kernel": TABLES[14],
    "kmeans_gap_kernel": TABLES[15],
    "kmeans_draw_kernel": TABLES[16],
    "kmeans_segsum_kernel": TABLES[17],
    "kmeans_segsum_combine_kernel": TABLES[18],
    "kmeans_assign_prep_kernel": TABLES[19],
    "kmeans_assign_mma_kernel": TABLES[20],
    "kmeans_bounds_kernel": TABLES[21],
    "falkon_prep_kernel": TABLES[22],
    "falkon_rows_kernel": TABLES[23],
    "falkon_cols_kernel": TABLES[24],
    "falkon_vprep_kernel": TABLES[25],
    "falkon_rows_pv_kernel": TABLES[26],
    "centring_flags_kernel": TABLES[27],
    "centring_point_kernel": TABLES[28],
    "centring_shift_kernel": TABLES[29],
}


def test_document_has_the_tables():
    assert len(TABLES) == 30 and [len(t) for t in TABLES] == [43, 5, 13, 13, 24, 21, 57, 26, 48, 24, 19, 22, 50, 13, 14, 6,
                                                              18, 11, 6, 7, 23, 21, 9, 14, 15, 8, 16, 13, 14, 13]


@pytest.mark.parametrize("kernel", sorted(EXPECTED))
def test_signature_matches_the_document(kernel):
    assert _signature(kernel) == EXPECTED[kernel]


def test_index_column_counts_the_arguments():
    """Each row's "#" cell (``i`` or ``i-j``) covers as many positions as the row names arguments, and the rows of
    a table follow one another without gaps or overlaps."""
    bad = []
    nxt = None
    for line in (TEMPLATES / "ABI.md").read_text().splitlines():
        if re.match(r"\|\s*#\s*\|", line):
            nxt = None
            continue
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", cells[0])
        if not m:
            continue
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        names = re.findall(r"`([A-Za-z_][A-Za-z_0-9]*)`", cells[1])
        if hi - lo + 1 != len(names) or (nxt is not None and lo != nxt):
            bad.append(line)
        nxt = hi + 1
    assert not bad, bad
