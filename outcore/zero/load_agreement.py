"""``model.load_state_dict`` at more ranks: every rank loads, or none does.

[Note: a load refused on one rank is refused on every rank]
Each rank writes only its own slice of each parameter, so a load that fails on one rank
(another state dict there: a shape that differs, a key missing) and succeeds on another
left a parameter half new and half old, one rank reporting success, and training went on
with the mix (a user's probe at 2 ranks: a weight whose first rows were the new values and
whose last were the old). The optimizer's ``load_state_dict`` already agrees across ranks
(engine/torch_optimizer.py); the model's is torch's own, which checks and writes module by
module, so it cannot be checked first from outside without re-doing torch's rules (key
renames in a model's own pre-hooks, extra state, strictness). So the model's load runs
twice at more ranks: first a trial, torch's whole ``load_state_dict`` with every write to a
sharded parameter checked but not made (``Runtime.trial_load``, zero/access.py), then one
collective that tells every rank whether any rank's trial raised, whether the keys it
left missing or unexpected are the same everywhere, and whether the values it gives the
sharded parameters are (an xxh3 digest of each, as ``initialize`` compares the model's:
different values would leave each rank its slice of its own, a mix equal to none; a second
collective names them); only then the load itself, on every
rank, or the error on every rank: the rank whose trial failed raises what torch raised, the
others a ``ConfigError`` saying so. The trial is never strict, since torch tells its hooks
``strict=True`` whatever the caller passed: keys that differ between ranks are refused
either way (strict, some ranks would fail; lenient, the ranks would load different
parameters), and keys missing alike on every rank are left to the load itself, which then
fails or passes alike. The cost is torch's checks twice (the trial builds no full-size
values: ``access._write`` returns before), one pass of xxh3 over each value given to a
sharded parameter (gigabytes a second on one core) and one small collective (a second
only when the values differ, to name them), so a load is a
collective: every rank calls it (as it already had to, each writing its own slices). What
is not a sharded parameter sees the load twice: a load hook of the model's own runs twice.
Buffers, which every rank holds whole and torch writes in place, are not sharded parameters
either: the trial writes them into copies put in their place (the persistent ones, those a
state dict holds; the copies live only for the trial), so a refused load leaves them as they
were. One rank alone (and a closed engine) loads as torch does.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
import xxhash
from torch import nn

from outcore.errors import ConfigError
from outcore.zero.build import value_digest
from outcore.zero.registry import managed


def agree_on_load(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                  local_metadata: dict[str, Any], *_: object) -> None:
    """A ``load_state_dict`` pre-hook on every module of an engine's model (see the note).
    A plain function, not a closure over the runtime: ``torch.save(model)`` pickles the
    hooks with the module."""
    if prefix:
        return  # a submodule of the load: its root decided
    sp = next((s for s in map(managed, module.parameters()) if s is not None), None)
    if sp is None or sp.rt.world_size == 1 or sp.rt.trial_load:
        return  # nothing sharded, one rank, or the trial itself
    rt = sp.rt
    error: BaseException | None = None
    keys = ""
    values: dict[str, int] = {}
    rt.trial_load = True
    originals = _stand_in_buffers(module)
    try:
        values = _sharded_values(module, state_dict)  # (what it cannot read fails the load)
        got = module.load_state_dict(
            state_dict, strict=False,
            assign=bool(local_metadata.get("assign_to_params_buffers")))
        keys = f"missing {sorted(got.missing_keys)}, unexpected {sorted(got.unexpected_keys)}"
    except Exception as e:  # noqa: BLE001 - raised below, once every rank knows
        error = e
    finally:
        rt.trial_load = False
        for buffers, name, buffer in originals:
            buffers[name] = buffer
    # one collective: a failure flag that differs means some rank failed
    same_outcome, same_keys, same_values = rt.comm.alike([
        int(error is not None), zlib.crc32(keys.encode()),
        xxhash.xxh3_64_intdigest(b"".join(d.to_bytes(8, "little") for d in values.values()))])
    if error is not None:
        raise error
    if not same_outcome:
        raise ConfigError("model load_state_dict() was refused on another rank (its error "
                          "says why); this rank loaded nothing either, so the ranks' "
                          "slices stay one model")
    if not same_keys:
        raise ConfigError(f"model load_state_dict(): the ranks' state dicts hold different "
                          f"keys (this rank's: {keys[:300]}); every rank loads the same "
                          "keys, or the ranks' slices would come from different models. "
                          "Nothing was loaded")
    if not same_values and same_outcome:  # the same keys, so the same count on every rank
        differ = [k for k, same in zip(values, rt.comm.alike(list(values.values())),
                                       strict=True) if not same]
        raise ConfigError(f"model load_state_dict(): the ranks' state dicts hold different "
                          f"values for {', '.join(differ[:3])}"
                          f"{f' and {len(differ) - 3} more' if len(differ) > 3 else ''}: each "
                          "rank would keep its slice of its own values, a mix equal to none of "
                          "them. Load the same state dict on every rank. Nothing was loaded")


def _stand_in_buffers(module: nn.Module) -> list[tuple[dict[str, torch.Tensor | None], str,
                                                      torch.Tensor]]:
    """Put a copy in place of every persistent buffer for the trial, which writes into it;
    return where each original goes back."""
    originals: list[tuple[dict[str, torch.Tensor | None], str, torch.Tensor]] = []
    for m in module.modules():
        for name, buffer in m._buffers.items():
            if buffer is not None and name not in m._non_persistent_buffers_set:
                originals.append((m._buffers, name, buffer))
    for buffers, name, buffer in originals:
        buffers[name] = buffer.detach().clone()
    return originals


def _sharded_values(module: nn.Module, state_dict: dict[str, Any]) -> dict[str, int]:
    """The digest of each value ``state_dict`` holds for a sharded parameter, by key in
    sorted order (the same dict built in another order on another rank is the same load):
    what every rank must load alike (buffers every rank holds whole may differ, as in DDP
    without their broadcast)."""
    params = dict(module.named_parameters(remove_duplicate=False))
    return {k: value_digest(state_dict[k]) for k in sorted(state_dict, key=str)
            if isinstance(state_dict[k], torch.Tensor) and k in params
            and managed(params[k]) is not None}
