"""The sweep's rows side by side: step, phases, CPU, faults, CPU-s per GB, peak RSS.

Run from this folder: python table2.py (reads the four runs' JSON beside it).
"""

from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
GIB = 2**30
for side in ["old-1", "new-1", "old-2", "new-2"]:
    d = json.loads((HERE / f"{side}.json").read_text())
    for pair in d["sweep_rows"]:
        by_name = {x["name"]: x for x in pair}
        n, o = by_name["none"]["result"], by_name["nvme+opt"]["result"]
        tokens = pair[0]["batch"] * pair[0]["seq"]
        cpu_none = n["user_s_per_step"] + n["sys_s_per_step"]
        cpu_off = o["user_s_per_step"] + o["sys_s_per_step"]
        gb = (o["proc_read_per_step"] + o["proc_write_per_step"]) / 1e9
        peak = o.get("peak_rss") or o["memory_report"]["rss"]
        print(f"{side} {tokens:5d} none {n['step_s']:.2f}s cpu {cpu_none:.2f} | nvme+opt "
              f"{o['step_s']:.2f}s (fwd {o['fwd_s']:.2f} bwd {o['bwd_s']:.2f} "
              f"opt {o['opt_s']:.2f}) user {o['user_s_per_step']:.2f} "
              f"sys {o['sys_s_per_step']:.2f} flt {o['minflt_per_step'] / 1e3:.0f}k "
              f"+cpu/GB {(cpu_off - cpu_none) / gb:.3f} rss {peak / GIB:.2f}")
