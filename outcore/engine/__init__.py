"""The engine layer: ``core.Engine`` wires the parts below it into forward, backward and
step; ``lifetime`` hands a model over to another engine or back to plain PyTorch;
``torch_optimizer`` is ``engine.optimizer``, torch's optimizer contract over the shards."""

from outcore.engine.core import Engine, initialize

__all__ = ["Engine", "initialize"]
