"""``outcore.init``: shard parameters as the model is built, so it never exists whole.

[Note: the seam is parameter registration, not ``__init__`` patching]
Every parameter reaches a module through ``register_parameter`` (``self.w = nn.Parameter(...)``
included), and PyTorch offers a global hook there. At that moment outcore cuts the tensor's
rank-local shard, sends it to its home tier, and leaves a shape-true placeholder (param.py).
No class is patched, so subclasses, ``ParameterList`` and models from any library are covered
the same way.

[Note: custom init sees the full tensor, and the same random numbers]
Initialization code runs after registration: ``reset_parameters``, ``nn.init.*``, a model's
own ``_init_weights``, ``p.data.mul_(...)``. A ``TorchFunctionMode`` catches the first torch
call that touches a placeholder and materializes that one parameter in full (empty for calls
that overwrite every element, gathered from the shards otherwise); the call then runs on the
real tensor and draws exactly the random numbers plain construction draws. The parameter stays
open until another one is touched or the context ends, then its shard is cut again. So memory
holds at most one full parameter, and with the same seed the weights equal plain PyTorch's.
All ranks must build the model with the same seed; ``init`` checks this.
"""

from __future__ import annotations

import hashlib
import os
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from outcore.config import Config
from outcore.errors import ConfigError
from outcore.runtime import Runtime
from outcore.zero.access_mode import ParamAccessMode
from outcore.zero.deferred import DeferredBuild
from outcore.zero.param import ShardedParam
from outcore.zero.registry import OVERWRITE_CALLS, managed, register
from outcore.zero.shardable import check_registered

if TYPE_CHECKING:
    from torch.utils.hooks import RemovableHandle


class init:  # noqa: N801  (a context manager named like the function users call)
    """``with outcore.init(cfg): model = build()`` builds a model whose parameters are shards."""

    _depth = 0  # open contexts in this process: one at a time

    def __init__(self, cfg: Config | dict[str, Any] | str | None = None, *,
                 frozen: bool = False, weights: str | os.PathLike[str] | None = None) -> None:
        """``frozen=True``: every parameter created here starts with ``requires_grad=False``
        and keeps only its training-dtype shard (param.py's [Note: a parameter born frozen]):
        for a base model that LoRA adapters will be trained over.

        ``weights``: a ``.safetensors`` file or a Hugging Face folder holding every parameter
        of the model built here; the build then computes no values and each parameter is
        read from the files when the context ends (deferred.py's [Note: build empty, then bind
        by name]). With ``frozen=True`` and parameters on NVMe the base is never copied: it
        is read from those files at every use (file_shard.py)."""
        self.cfg = Config.load(cfg)
        self.frozen = frozen
        self.runtime: Runtime | None = None
        self._open: ShardedParam | None = None
        self._mode = ParamAccessMode(self._materialize)
        self._handles: list[RemovableHandle] = []
        self._deferred = DeferredBuild(weights) if weights is not None else None
        self._modules: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # see _name_params
        self._children: weakref.WeakSet[nn.Module] = weakref.WeakSet()

    def __enter__(self) -> init:
        if init._depth:  # the inner one's parameters would be the outer one's as well
            raise ConfigError("outcore.init inside another outcore.init: build the whole "
                              "model under one (its config applies to every parameter)")
        init._depth += 1
        try:
            return self._enter()
        except BaseException:
            init._depth -= 1
            raise

    def _enter(self) -> init:
        self.runtime = Runtime(self.cfg, trainable_fraction=0.0 if self.frozen else 1.0)
        _check_same_rng(self.runtime)
        # torch's stub says the hook returns None; it may return a replacement (deferred.py)
        hook = register_module_parameter_registration_hook
        self._handles.append(hook(self._on_register))  # type: ignore[arg-type]
        self._handles.append(register_module_module_registration_hook(self._on_module))
        self._mode.__enter__()  # type: ignore[no-untyped-call]  # unannotated in torch
        return self

    def __exit__(self, kind: object, err: object, tb: object) -> None:
        init._depth -= 1
        failed = kind is not None
        try:
            if kind is None:
                with self._mode.suspended():
                    self._close_open()
        finally:
            self._mode.__exit__(kind, err, tb)  # type: ignore[no-untyped-call]  # as __enter__
            for handle in self._handles:
                handle.remove()
            self._handles = []
            try:
                if not failed and self._deferred is not None:
                    assert self.runtime is not None  # __exit__ follows __enter__
                    self._deferred.bind(self.runtime, self._roots())
                if not failed:
                    self._name_params()
            except BaseException:
                failed = True
                raise
            finally:
                if failed and self.runtime is not None:
                    self.runtime.close()  # the half-built model is gone: so are its swap files

    def _on_register(self, module: nn.Module, name: str, param: nn.Parameter | None
                     ) -> nn.Parameter | None:
        if param is None or managed(param) is not None:
            return None
        assert self.runtime is not None  # the hook is registered only inside the context
        check_registered(module, name, param)
        self._modules.add(module)
        if self._deferred is not None:
            if self.frozen:
                param.requires_grad_(False)
            return self._deferred.on_param(module, name, param)
        with self._mode.suspended():
            if self.frozen:
                param.requires_grad_(False)
            register(param, ShardedParam(param, self.runtime))
        return None

    def _on_module(self, parent: nn.Module, name: str, child: nn.Module | None) -> None:
        self._modules.add(parent)
        if child is not None:  # a module another holds is no model of its own
            self._children.add(child)

    def _roots(self) -> list[nn.Module]:
        """The modules built here that no other module built here holds: the models."""
        return [m for m in self._modules if m not in self._children]

    def _name_params(self) -> None:
        """[Note: parameters built here are named when the context ends]
        A parameter is sharded as it is registered, when only its attribute name is known;
        its dotted name is known to ``outcore.initialize`` (build.py). A refusal in between
        (``model.resize_token_embeddings`` assigning ``.data`` of a new shape) named it "of
        shape [256, 32]" only. So each model built here (a module no other built here holds)
        names its parameters when the context ends; initialize names them again."""
        for root in self._roots():
            for name, p in root.named_parameters():
                sp = managed(p)
                if sp is not None and not sp.name:
                    sp.name = name

    def _materialize(self, sp: ShardedParam, func: object) -> None:
        if self._open is sp:
            return
        self._close_open()
        sp.open_for_build(None if func in OVERWRITE_CALLS else sp.gather_values())
        self._open = sp

    def _close_open(self) -> None:
        sp, self._open = self._open, None
        if sp is None or not sp.alive:
            return
        sp.end_shown(write_back=True)  # .data may be new: ``model.to(torch.bfloat16)`` ran


def _check_same_rng(rt: Runtime) -> None:
    """Ranks drawing different random numbers would build inconsistent shards: refuse."""
    if rt.world_size == 1:
        return
    digest = hashlib.sha256(torch.get_rng_state().numpy().tobytes()).digest()[:8]
    if not rt.comm.alike([int.from_bytes(digest, "little")])[0]:
        raise ConfigError(
            "ranks entered outcore.init with different torch RNG states; call "
            "torch.manual_seed(seed) with the same seed on every rank before building the model"
        )
