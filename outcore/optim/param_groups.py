"""torch-style parameter groups for ``outcore.initialize(model, cfg, param_groups=...)``.

The engine's optimizer takes groups as ``torch.optim`` does: dicts with ``"params"`` and any
hyper-parameter that overrides the config's optimizer for that group (no weight decay on
biases, another learning rate for a head). They are checked before anything is sharded.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from outcore.errors import ConfigError

HP_KEYS = ("lr", "betas", "eps", "weight_decay", "momentum", "nesterov")
"""The hyper-parameters a group may set (the engine's optimizer's ``defaults``)."""


def check_param_groups(module: nn.Module, param_groups: Iterable[dict] | None
                        ) -> list[tuple[dict, list[nn.Parameter]]] | None:
    """Validate torch-style param groups before anything is sharded (a typo must not
    leave the model half converted); returns (overrides, parameters) per group."""
    if param_groups is None:
        return None
    names = {id(p): n for n, p in module.named_parameters()}
    out, seen = [], set()
    for i, spec in enumerate(param_groups):
        unknown = set(spec) - {"params", *HP_KEYS}
        if unknown:
            raise ConfigError(f"param_groups[{i}]: unknown keys {sorted(unknown)}; "
                              f"allowed: params, {', '.join(HP_KEYS)}")
        params = list(spec.get("params", []))
        for p in params:
            if id(p) not in names:
                raise ConfigError(f"param_groups[{i}] holds a tensor that is not a "
                                  "parameter of this model")
            if id(p) in seen:
                raise ConfigError(f"parameter {names[id(p)]} appears in two param groups")
            seen.add(id(p))
        out.append(({k: v for k, v in spec.items() if k != "params"}, params))
    missing = [n for n, p in module.named_parameters() if p.requires_grad and id(p) not in seen]
    if missing:
        raise ConfigError(f"trainable parameters in no param group: {missing[:5]}")
    return out
