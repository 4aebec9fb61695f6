"""CPU seconds per thread id and its top symbols, from ``perf script -F tid,time,ip,sym,dso``.

Lab script of the 2026-11-28 Zen 5 offload-CPU record:
    python3 perfsum.py perf512.txt <sample Hz> [threads shown]
"""

import collections
import re
import sys

LINE = re.compile(r"\s*(\d+)\s+([\d.]+):\s+[0-9a-f]+\s+(.*)\s+\((.*)\)\s*$")


def main() -> None:
    path, hz = sys.argv[1], float(sys.argv[2])
    shown = int(sys.argv[3]) if len(sys.argv) > 3 else 14
    by: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    with open(path) as f:
        for line in f:
            m = LINE.match(line)
            if not m:
                continue
            tid, t, sym, dso = m.group(1), float(m.group(2)), m.group(3), m.group(4)
            sym = re.sub(r"\+0x[0-9a-f]+", "", sym)[:60]
            by[tid][f"{sym} [{dso.split('/')[-1][:20]}]"] += 1
            first.setdefault(tid, t)
            last[tid] = t
    ranked = sorted(by.items(), key=lambda kv: -sum(kv[1].values()))
    for tid, counts in ranked[:shown]:
        n = sum(counts.values())
        print(f"tid {tid}: {n} samples ({n / hz:.2f} s) {first[tid]:.1f}-{last[tid]:.1f}")
        for key, v in counts.most_common(10):
            print(f"      {v / hz:6.3f} s  {key}")


if __name__ == "__main__":
    main()
