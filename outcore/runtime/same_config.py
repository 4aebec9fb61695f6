"""Every rank runs with one config, checked where the ranks first meet.

[Note: every rank runs one config]
Each rank reads its own config (a file per node, a flag given to one rank, ``dtype: auto``
resolved on another kind of host), and outcore's ranks act on theirs alone: each updates its
slice of every parameter with its own learning rate, optimizer and clipping, computes in its
own dtype, and places its shards in its own tiers. A user's probe at 2 ranks found a learning
rate given to one rank train a model whose halves followed two runs without a word, and a
dtype, an offload tier or a clipping setting given to one rank abort gloo in the first
forward with no word of the config. So the runtime, once it has joined the world, compares a
digest of each setting (the schema's sections and keys, a fixed set on every rank) in one
collective, and every rank refuses together, naming the settings that differ. The settings
of a rank's own host are left out (``_OWN``): its swap folder, memory and I/O. The groups
given to ``initialize`` (``param_groups``, or an adopted optimizer's) are compared the same
way once their parameters are known (optim/param_groups.py's ``check_same_groups``): their
number, each group's hyper-parameters and which parameters it holds, as a learning rate per
group given to one rank trains two runs' halves just as the config's does.
"""

from __future__ import annotations

import json
from typing import Any

import xxhash
from pydantic import BaseModel

from outcore.config import Config
from outcore.errors import ConfigError

# what each rank may set for its own host: where its swap lives and how much of its memory
# and I/O it spends (reads ahead are local stages, never collectives: overlap/schedule.py's
# [Note: why the all-gather is never prefetched]); a seed per rank (dropout's masks); how long
# it waits for the others
# (the optimizer state's tier too: each rank updates its own slice wherever it keeps it;
# the parameters' is not, as a rank gathering from NVMe and one keeping them whole part ways)
_OWN = {"offload.nvme_path", "offload.host_buffer_bytes", "offload.io_block_bytes",
        "offload.io_threads", "offload.verify_swap", "offload.reuse_freed_memory",
        "offload.optimizer", "zero.prefetch_bytes", "zero.resident_copies", "seed",
        "comm.timeout_s"}


def settings(cfg: Config) -> dict[str, Any]:
    """Each setting by its dotted name (``optimizer.lr``), sections to one level."""
    out: dict[str, Any] = {}
    for name in type(cfg).model_fields:
        value = getattr(cfg, name)
        if isinstance(value, BaseModel):
            for key in type(value).model_fields:
                out[f"{name}.{key}"] = getattr(value, key)
        else:
            out[name] = value
    fp16 = cfg.dtype == "fp16"  # the loss scale is read in fp16 only
    return {k: v for k, v in out.items()
            if k not in _OWN and (fp16 or not k.startswith("loss_scale."))}


def digest_of(value: Any) -> int:
    """A setting's digest, as the ranks compare it."""
    return xxhash.xxh3_64_intdigest(json.dumps(value, sort_keys=True, default=str).encode())


def check_same_config(cfg: Config, comm: Any) -> None:
    """Refuse, on every rank together, a config that differs between ranks (see the note)."""
    if comm.world_size == 1:
        return
    mine = settings(cfg)
    names = sorted(mine)
    digests = [digest_of(mine[k]) for k in names]
    differ = [k for k, same in zip(names, comm.alike(digests), strict=True) if not same]
    if differ:
        shown = ", ".join(f"{k}={mine[k]!r}" for k in differ[:4])
        raise ConfigError(f"the ranks run with different configs: {shown} on this rank "
                          f"(rank {comm.rank}) differ{'s' if len(differ) == 1 else ''} on "
                          "another; give every rank the same config" + (
                              " (dtype: auto picks by the host: name the dtype where the "
                              "hosts differ)" if "dtype" in differ else "") + (
                              " (an automatic placement plans by each host's free memory: "
                              "name the tiers where the hosts differ)"
                              if "offload.params" in differ else ""))
