"""Print ab.sh's runs as one table: setting, tokens, mode, peak RSS and median step per run."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def main(folder: str) -> None:
    rows: dict[tuple[str, int, str], list[tuple[int, float, int]]] = {}
    for path in sorted(Path(folder).glob("r*-b*.json")):
        try:
            run = json.loads(path.read_text())
        except json.JSONDecodeError:
            print(f"{path.name}: no JSON (see its .err)")
            continue
        setting = "lean" if run["settings"]["offload"].get("reuse_freed_memory") is False \
            else "defaults"
        mode = ("offloaded" if run.get("offloaded_blocks") else
                "checkpointed" if run["checkpointed_blocks"] else "as it came")
        step = statistics.median(run["steps_s"][1:])
        rows.setdefault((setting, run["tokens"], mode), []).append(
            (run["rss_MiB"]["steps_peak"], step, run["model_state_bytes"]))
    print("| setting | tokens | blocks | peak RSS MiB (runs) | ÷ model states | step s (runs) |")
    print("|---|---|---|---|---|---|")
    for (setting, tokens, mode), runs in sorted(rows.items()):
        peaks = " / ".join(str(p) for p, _, _ in runs)
        share = " / ".join(f"{p * 2**20 / states:.3f}" for p, _, states in runs)
        steps = " / ".join(f"{s:.2f}" for _, s, _ in runs)
        print(f"| {setting} | {tokens} | {mode} | {peaks} | {share} | {steps} |")


if __name__ == "__main__":
    main(sys.argv[1])
