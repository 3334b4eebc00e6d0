"""Split a compute-sanitizer log into reports in our kernels and in others'.

    python3 bench/probes/sanitize_filter.py LOG     # prints: OURS FOREIGN SUMMARY
    python3 bench/probes/sanitize_filter.py LOG -v  # also our reports, grouped

A report starts at a line "========= Error..." / "========= Warning..." / "========= Invalid..."
and runs to the next; it is ours when a kernel named in it lives in namespace
kermac_like (the sanitizer prints "in <kernel>" for each access it reports).
"""

from __future__ import annotations

import collections
import re
import argparse

START = re.compile(r"^========= (Error|Warning|Invalid|Race|Barrier|Uninitialized)", re.I)
SUMMARY = re.compile(r"^========= (ERROR|RACECHECK|ERROR SUMMARY|LEAK).*SUMMARY.*$|^========= ERROR SUMMARY.*$")


def reports(text: str):
    cur = None
    for line in text.splitlines():
        if START.match(line) and "SUMMARY" not in line:
            if cur:
                yield cur
            cur = [line]
        elif cur is not None:
            if line.startswith("=========") and line.strip() != "=========":
                cur.append(line)
            else:
                yield cur
                cur = None
    if cur:
        yield cur


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", help="a compute-sanitizer log")
    parser.add_argument("-v", "--verbose", action="store_true", help="also our reports, grouped")
    args = parser.parse_args()
    text = open(args.log, errors="replace").read()
    ours, foreign = [], []
    for r in reports(text):
        (ours if any("kermac_like::" in line for line in r) else foreign).append(r)
    summary = " | ".join(m.group(0).strip("= ") for m in map(SUMMARY.match, text.splitlines()) if m) or "-"
    print(len(ours), len(foreign), summary)
    if args.verbose:
        groups = collections.Counter()
        for r in ours:
            head = re.sub(r"0x[0-9a-f]+|\(\d+,\d+,\d+\)", "#", r[0])
            where = tuple(re.sub(r"0x[0-9a-f]+|\(\d+,\d+,\d+\)", "#", l) for l in r[1:4])
            groups[(head, where)] += 1
        for (head, where), n in groups.most_common(20):
            print(f"{n:7d}  {head}")
            for w in where:
                print("         ", w)


if __name__ == "__main__":
    main()
