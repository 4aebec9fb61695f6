"""Where the peak RSS of a run with everything on NVMe goes: Python and torch, the ledger's
host kinds (gradients waiting for their update, I/O buffers, the parameter cache, and on a
CPU device the full layers kept from forward for backward), and the rest (activations, the
loss's logits, freed memory kept for reuse).

    .venv/bin/python bench/rss_split.py --model gpt-335m
    .venv/bin/python bench/rss_split.py --model gpt-335m --lean --checkpoint

``--lean`` is the small-footprint setting: ``offload.reuse_freed_memory: false`` and 64 MiB
each of host buffers and prefetch; ``--reuse``, ``--host-buffer-mib`` and ``--prefetch-mib``
given beside it take precedence. ``--checkpoint`` checkpoints every block's activations (as
``outcore train --checkpoint-activations on`` does); ``--offload-activations`` keeps every
block's saved tensors on NVMe instead (as ``--offload-activations nvme`` does). Prints one
JSON object with the machine; the peaks are ``VmHWM``, reset before the build and before the
measured steps (bench/cpu_split.py's helpers), and so are the ledger's peaks.
The rest is the peak's growth above the imports less the ledger's peaks. The ledger counts
bytes reserved, and its peaks need not fall at the same moment; on a small model whose I/O
buffers are never filled, the rest can come out negative.
Run by hand; memory, not time, is what it reports (the step times are there only as a sign
of what the setting costs).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import psutil
import torch

MIB = 1 << 20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt-335m")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lean", action="store_true",
                    help="reuse off, 64 MiB buffers and prefetch (each unless set by its flag)")
    ap.add_argument("--reuse", choices=["auto", "true", "false"], default=None,
                    help="offload.reuse_freed_memory (auto: unset)")
    ap.add_argument("--host-buffer-mib", type=int, help="offload.host_buffer_bytes in MiB")
    ap.add_argument("--prefetch-mib", type=int, help="zero.prefetch_bytes in MiB")
    ap.add_argument("--checkpoint", action="store_true", help="checkpoint every block")
    ap.add_argument("--offload-activations", action="store_true",
                    help="every block's saved tensors on NVMe (outcore.offload_activations)")
    ap.add_argument("--nvme-path", default="bench/out/rss-swap")
    args = ap.parse_args(argv)

    proc = psutil.Process()
    torch_rss = proc.memory_info().rss
    import outcore
    from outcore.app.blocks import checkpoint_blocks, offload_blocks
    from outcore.app.models import build_model, num_params, resolve_config
    from outcore.device.machine import describe

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cpu_split import peak_rss_bytes, reset_peak_rss

    base_rss = proc.memory_info().rss
    reset_peak_rss()
    if args.lean:  # the smallest footprint, except where a flag says otherwise
        args.reuse = args.reuse or "false"
        args.host_buffer_mib = 64 if args.host_buffer_mib is None else args.host_buffer_mib
        args.prefetch_mib = 64 if args.prefetch_mib is None else args.prefetch_mib
    offload: dict = {} if args.reuse in (None, "auto") else {
        "reuse_freed_memory": args.reuse == "true"}
    if args.host_buffer_mib is not None:
        offload["host_buffer_bytes"] = args.host_buffer_mib * MIB
    zero = {} if args.prefetch_mib is None else {"prefetch_bytes": args.prefetch_mib * MIB}
    cfg = outcore.Config.from_dict({
        "dtype": "bf16", "seed": 0, "optimizer": {"type": "adamw", "lr": 1e-4},
        "offload": {"params": "nvme", "optimizer": "nvme", "nvme_path": args.nvme_path,
                    **offload},
        "zero": zero})
    torch.manual_seed(0)
    with outcore.init(cfg):
        model = build_model(args.model)
    offloaded = offload_blocks(model, "nvme") if args.offload_activations else 0
    blocks = checkpoint_blocks(model, "on", args.batch, args.seq) if args.checkpoint else 0
    engine = outcore.initialize(model, cfg)
    build_peak = peak_rss_bytes()
    reset_peak_rss()
    # the ledger's peaks too: the build fills and frees every full tensor once (the parameter
    # cache peaks there), and a build-time peak beside the steps' RSS peak overstates what the
    # steps hold and understates the rest
    engine.rt.ledger.reset_peaks()
    shape = resolve_config(args.model)
    ids = torch.randint(0, shape.vocab, (args.batch, args.seq + 1),
                        generator=torch.Generator().manual_seed(0))
    steps = []
    for _ in range(args.steps):
        t = time.perf_counter()
        engine.backward(engine(ids[:, :-1], ids[:, 1:]))
        engine.step()
        engine.synchronize()
        steps.append(round(time.perf_counter() - t, 2))
    step_peak = peak_rss_bytes()
    by_kind = engine.memory_report()["by_kind"]
    # on a CPU device the device tier is host memory too (full layers kept for backward)
    tiers = ("peak.host.", "peak.device.") if engine.device.type == "cpu" else ("peak.host.",)
    ledger = {k.removeprefix("peak."): v // MIB for k, v in by_kind.items()
              if k.startswith(tiers) and v}
    engine.close(keep_values=False)  # no hand-back: it would count in the peak
    states = 16 * num_params(shape)
    print(json.dumps({
        "model": args.model, "tokens": args.batch * args.seq,
        "settings": {"offload": offload, "zero": zero},
        "checkpointed_blocks": blocks, "offloaded_blocks": offloaded,
        "model_state_bytes": states,
        "rss_MiB": {"python_torch": torch_rss // MIB, "outcore_imported": base_rss // MIB,
                    "build_peak": build_peak // MIB, "steps_peak": step_peak // MIB,
                    "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024},
        "ledger_peaks_MiB": ledger,
        "rest_MiB": (step_peak - base_rss) // MIB - sum(ledger.values()),
        "peak_over_model_states": round(step_peak / states, 3), "steps_s": steps,
        "machine": describe("bf16")}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
