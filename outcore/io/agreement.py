"""Every rank's answer to "did this part of a save or load fail?", in one collective.

[Note: agree before the next collective]
A checkpoint is written and read by every rank. A rank whose part failed (a full disk, a
bad file) must not simply raise: the others would wait for it in their next collective
until the timeout, and then blame a dead rank. So each part of a save or load ends here:
every rank adds a row (failed or not, and a few integers, such as a digest of the path it
was given) and all learn together whether any failed, and raise together.

[Note: every rank says what failed]
A rank whose part succeeded used to say only "failed on rank(s) [1]; see their errors". Under
torchrun the ranks' logs are interleaved or apart, and what the user reads first is rank 0's;
a caller that handles one kind of failure (``outcore train --resume``'s advice for a damaged
checkpoint) heard it on the damaged rank alone. So when any rank failed, a second collective,
only then, carries each failed rank's error kind and the start of its message, and every
other rank raises that kind, quoting it.
"""

from __future__ import annotations

from typing import Any

import torch

from outcore.errors import (
    ConfigError,
    CorruptCheckpointError,
    DataError,
    FolderInUseError,
    StorageError,
)

# the kinds another rank's error is raised as here (any other kind: StorageError)
_KINDS: tuple[type[Exception], ...] = (StorageError, CorruptCheckpointError, FolderInUseError,
                                       ConfigError, DataError)
_SAID = 2000  # bytes of a failed rank's message that the others quote


def agree(rt: Any, err: Exception | None, what: str,
          row: tuple[int, ...] = ()) -> torch.Tensor:
    """A barrier that tells every rank whether any rank failed, so none waits forever in a
    later collective; it also shares a small row of integers from each rank (W x len(row))."""
    table = torch.zeros(rt.world_size, 1 + len(row), dtype=torch.int64)
    table[rt.rank] = torch.tensor([int(err is not None), *row], dtype=torch.int64)
    dev = rt.accel.to_device(table)
    rt.comm.all_reduce_sum(dev)
    table = dev.cpu()
    failed = table[:, 0].nonzero().flatten().tolist()
    said = _errors(rt, err) if failed and rt.world_size > 1 else {}
    if err is not None:
        raise err
    if failed:
        first = failed[0]
        kind, text = said.get(first, (StorageError, "see its error"))
        others = f" (and rank(s) {failed[1:]})" if failed[1:] else ""
        raise kind(f"{what} failed on rank {first}{others}: {text}")
    return table[:, 1:]


def _errors(rt: Any, err: Exception | None) -> dict[int, tuple[type[Exception], str]]:
    """Each failed rank's error kind and message, on every rank (the second note)."""
    table = torch.zeros(rt.world_size, 2 + _SAID, dtype=torch.int32)
    if err is not None:
        kind = next((i for i, k in reversed(list(enumerate(_KINDS))) if isinstance(err, k)), 0)
        text = (str(err) or type(err).__name__).encode()[:_SAID]
        table[rt.rank, 0], table[rt.rank, 1] = kind + 1, len(text)
        table[rt.rank, 2 : 2 + len(text)] = torch.tensor(list(text), dtype=torch.int32)
    dev = rt.accel.to_device(table)
    rt.comm.all_reduce_sum(dev)
    table = dev.cpu()
    out = {}
    for r in table[:, 0].nonzero().flatten().tolist():
        n = int(table[r, 1])
        text = bytes(table[r, 2 : 2 + n].to(torch.uint8).tolist()).decode(errors="replace")
        out[r] = (_KINDS[int(table[r, 0]) - 1], text)
    return out
