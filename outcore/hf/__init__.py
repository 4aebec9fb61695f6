"""Hugging Face fine-tuning tools: ``OutcoreTrainer`` and LoRA over offloaded base weights.

Needs the ``hf`` extra (``pip install 'outcore[hf]'``: transformers, peft, accelerate); the
rest of outcore imports without it.
"""

from __future__ import annotations

from typing import Any

from outcore.errors import ConfigError

_EXTRA = "pip install 'outcore[hf]'"


def require(*modules: str) -> None:
    """Raise a ConfigError naming the extra if one of ``modules`` is not installed."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(f"outcore.hf needs {', '.join(missing)}, which is not installed: "
                          f"{_EXTRA}")


def __getattr__(name: str) -> Any:
    if name in ("OutcoreTrainer", "EngineOptimizer", "EngineModel"):
        require("transformers", "accelerate")
        from outcore.hf import trainer

        return getattr(trainer, name)
    if name in ("lora_config", "apply_lora"):
        require("peft")
        from outcore.hf import lora

        return getattr(lora, name)
    raise AttributeError(f"module 'outcore.hf' has no attribute {name!r}")


__all__ = ["OutcoreTrainer", "apply_lora", "lora_config", "require"]
