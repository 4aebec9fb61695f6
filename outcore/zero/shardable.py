"""Which parameters outcore can shard: refused up front, by name, with what to do instead.

[Note: refuse by name, before anything is built]
``ShardedParam`` knows a parameter's shape and dtype but not its name, so a refusal raised
there ("cannot shard a torch.complex64 parameter of shape (5, 3)") left the user to find
which of the model's parameters it was, and with no way out. Both places a parameter first
meets outcore know its name: ``outcore.initialize`` walks ``named_parameters`` (the dotted
name), and ``outcore.init``'s registration hook sees the module and the attribute. So each
asks here first, before a runtime or a shard exists for the model.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parameter import is_lazy

from outcore.errors import ConfigError
from outcore.zero.registry import managed
from outcore.zero.wrappers import refuse_wrapped


def check_model(model: object) -> None:
    """Refuse what ``outcore.initialize`` cannot shard: not a module, or a parameter of it
    that is not a floating-point tensor (``refusal``). Parameters already sharded (built
    under ``outcore.init``) passed there."""
    if not isinstance(model, nn.Module):  # a path or a state dict: load it into a model
        raise ConfigError(f"outcore.initialize: the model must be a torch.nn.Module, got "
                          f"{type(model).__name__}")
    refuse_wrapped(model)  # wrappers.py's note
    named = list(model.named_parameters())
    lazy = [name for name, p in named if is_lazy(p)]
    if lazy:
        shown = ", ".join(lazy[:3]) + (f" and {len(lazy) - 3} more" if len(lazy) > 3 else "")
        raise ConfigError(
            f"outcore.initialize: {'parameters' if len(lazy) > 1 else 'parameter'} {shown} "
            f"{'are' if len(lazy) > 1 else 'is'} not materialised yet (a lazy module, "
            "such as nn.LazyLinear, makes its parameters at its first forward) and outcore "
            "shards a parameter by its shape. Run the model once on a sample input "
            "(model(sample), or the lazy module's initialize_parameters(sample)) before "
            "outcore.initialize")
    for name, p in named:
        why = refusal(p) if managed(p) is None else None
        if why is not None:
            raise ConfigError(f"outcore cannot shard parameter {name} {why}")


def check_registered(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """``outcore.init``'s part: the same refusal for ``module.name`` as it is registered.

    [Note: no lazy modules under outcore.init]
    A lazy module registers a parameter with no shape; it gets one at the first forward,
    long after the hook would have had to cut its shard (torch's own error from there was
    about ``load_state_dict``). Materialising it later and sharding it then would hold the
    whole layer in memory, which outcore.init exists to avoid; so it is refused here."""
    if is_lazy(param):
        raise ConfigError(
            f"outcore.init cannot shard parameter {name} of {type(module).__name__}: a lazy "
            "module has no shape for it until its first forward, and outcore.init shards each "
            "parameter as it is created. Use the module's non-lazy form with its sizes (e.g. "
            "nn.Linear(in_features, out_features)) under outcore.init, or build the model "
            "without outcore.init, run it once on a sample input, then pass it to "
            "outcore.initialize")
    why = refusal(param)
    if why is not None:
        raise ConfigError(f"outcore.init cannot shard parameter {name} of "
                          f"{type(module).__name__} {why}")


def refusal(p: nn.Parameter) -> str | None:
    """Why ``p`` cannot be sharded and what to do, or None where it can.

    [Note: only floating-point parameters are sharded]
    Shards are kept in fp32 and computed in the training dtype: a complex tensor would lose
    its imaginary part in that cast and an integer one its meaning, so both are refused.
    An integer tensor gets no gradient, so it is state, which a buffer holds (and moves with
    the model, unsharded); a complex weight trains as its real and imaginary parts."""
    if p.is_floating_point():
        return None
    shape = list(p.shape)
    if p.is_complex():
        return (f"({p.dtype}, shape {shape}): outcore shards floating-point parameters only. "
                "Hold it as a real parameter, nn.Parameter(torch.view_as_real(t)), and use "
                "torch.view_as_complex(p) in forward; or, if it is not trained, register it "
                "as a buffer (module.register_buffer(name, t))")
    return (f"({p.dtype}, shape {shape}): outcore shards floating-point parameters only, and "
            "such a tensor is never trained; register it as a buffer instead "
            "(module.register_buffer(name, t))")

