"""Profiler ranges that show the overlap in a trace, and a profiler that sees every thread.

[Note: ranges, not claims]
Whether reads, collectives and updates really run behind compute is a fact of one run on one
machine, so outcore marks each phase with ``torch.profiler.record_function`` and lets a trace
show it. The ranges (names below) mark a group's fetch (``unshard``: its reads issued, then
``wait_unshard``: reads finished, all-gather, full tensors shown), the all-gather and the
reduce-scatter, every NVMe read and write on an I/O thread, and the optimizer's phases
(sub-group read, update, write-back) on its worker thread. A range costs a few microseconds
when no profiler runs, and each marks work of at least one block or one module.

torch's profiler records only the thread that started it unless asked for all threads;
``profile()`` asks, where this torch supports it, so the I/O and optimizer threads show up.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.profiler import record_function

__all__ = ["ALL_GATHER", "FETCH", "NVME_READ", "NVME_WRITE", "OPTIM_READ", "OPTIM_UPDATE",
           "OPTIM_WRITE", "REDUCE_SCATTER", "STEP", "UNSHARD", "profile", "record_function"]

UNSHARD = "outcore::unshard"  # a group's shard reads issued (prefetch or on demand)
FETCH = "outcore::wait_unshard"  # a group's reads finished, gathered, shown full
ALL_GATHER = "outcore::all_gather"
REDUCE_SCATTER = "outcore::reduce_scatter"
NVME_READ = "outcore::nvme_read"  # one block, on an I/O thread
NVME_WRITE = "outcore::nvme_write"
OPTIM_READ = "outcore::optim_read"  # a sub-group's master and moments brought in
OPTIM_UPDATE = "outcore::optim_update"  # the AdamW/SGD kernel over a sub-group
OPTIM_WRITE = "outcore::optim_write"  # write-back of what lives on disk, cast of the params
STEP = "outcore::step"  # Engine.step: unscale, clip, the updates not already done


def profile(**kwargs: Any) -> torch.profiler.profile:
    """``torch.profiler.profile(**kwargs)`` recording every thread (the I/O and optimizer
    threads included) where this torch can; see the note above."""
    if "experimental_config" not in kwargs:
        config_type = torch._C._profiler._ExperimentalConfig
        if "profile_all_threads" in (config_type.__init__.__doc__ or ""):
            kwargs["experimental_config"] = config_type(profile_all_threads=True)
    return torch.profiler.profile(**kwargs)

