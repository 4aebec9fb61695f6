"""CPU seconds a step by what the CPU did, between two sample times of a perf script.

Lab script of the 2026-11-28 Zen 5 offload-CPU record:
    python3 catsum.py perf512.txt <sample Hz> <start> <end> <steps between them>
(start and end as perf's timestamps: the measured steps' window, from the first sample of
cpu_split's disk sampler, which starts with them, for the steps' wall time.)
"""

import collections
import re
import sys

LINE = re.compile(r"\s*(\d+)\s+([\d.]+):\s+[0-9a-f]+\s+(.*)\s+\((.*)\)\s*$")
PAGES = ("clear_page", "page_fault", "mm_fault", "anonymous_page", "memcg", "unmap", "freelist")
GC = ("gc_collect", "visit_", "dict_traverse", "subtype_traverse")


def category(sym: str, dso: str) -> str:
    """The kind of work a sample's symbol does (the first rule that matches)."""
    if "perf-" in dso or "gemm" in sym or "flash" in sym:
        return "compute-gemm/jit"
    if "libgomp" in dso:
        return "omp-spin"
    if "XXH" in sym:
        return "xxh3"
    if "adam" in sym:
        return "adam"
    if any(k in sym for k in GC):
        return "python-gc"
    if "libpython" in dso:
        return "python"
    if any(k in sym for k in PAGES):
        return "page-faults"
    if "kernel" in dso:
        return "kernel-other"
    if "copy" in sym:
        return "copy/cast"
    if "libtorch" in dso:
        return "torch-other"
    return "other:" + dso.split("/")[-1][:20]


def main() -> None:
    path = sys.argv[1]
    hz, start, end, steps = (float(v) for v in sys.argv[2:6])
    rows = []
    with open(path) as f:
        for line in f:
            m = LINE.match(line)
            if m:
                rows.append((float(m.group(2)), m.group(3), m.group(4)))
    cats: collections.Counter[str] = collections.Counter()
    syms: collections.Counter[tuple[str, str]] = collections.Counter()
    n = 0
    for t, sym, dso in rows:
        if not start <= t <= end:
            continue
        c = category(sym, dso)
        cats[c] += 1
        n += 1
        if c in ("kernel-other", "torch-other", "python"):
            syms[(c, re.sub(r"\+0x[0-9a-f]+", "", sym)[:50])] += 1
    print(f"{start}-{end} ({end - start:.2f} s), {n / hz:.2f} CPU-s, per step:")
    for c, v in cats.most_common():
        print(f"  {v / hz / steps:6.3f} {c}")
    for (c, s), v in syms.most_common(25):
        print(f"      {v / hz / steps:6.3f} {c}: {s}")


if __name__ == "__main__":
    main()
