"""Every rank's answer to "did this part of a save or load fail?", in one collective.

[Note: agree before the next collective]
A checkpoint is written and read by every rank. A rank whose part failed (a full disk, a
bad file) must not simply raise: the others would wait for it in their next collective
until the timeout, and then blame a dead rank. So each part of a save or load ends here:
every rank adds a row (failed or not, and a few integers, such as a digest of the path it
was given) and all learn together whether any failed, and raise together.
"""

from __future__ import annotations

from typing import Any

import torch

from outcore.errors import StorageError


def agree(rt: Any, err: Exception | None, what: str,
          row: tuple[int, ...] = ()) -> torch.Tensor:
    """A barrier that tells every rank whether any rank failed, so none waits forever in a
    later collective; it also shares a small row of integers from each rank (W x len(row))."""
    table = torch.zeros(rt.world_size, 1 + len(row), dtype=torch.int64)
    table[rt.rank] = torch.tensor([int(err is not None), *row], dtype=torch.int64)
    dev = rt.accel.to_device(table)
    rt.comm.all_reduce_sum(dev)
    table = dev.cpu()
    if err is not None:
        raise err
    failed = table[:, 0].nonzero().flatten().tolist()
    if failed:
        raise StorageError(f"{what} failed on rank(s) {failed}; see their errors")
    return table[:, 1:]
