"""What a checkpoint's ``client_state`` may hold: JSON and a few more plain values, never
pickle.

A checkpoint is read back by whoever resumes, maybe another version of the script or another
machine's Python; pickle would run code from the file at load. So ``client_state`` is stored
as JSON, checked before any folder is made, naming the value that cannot be stored.

[Note: what JSON would change on the way]
``json.dumps`` takes more than it gives back: a dict's integer keys come back strings, a
tuple a list, a ``Counter`` a plain dict. torch's schedulers keep exactly such values in
their ``state_dict()`` (``MultiStepLR``'s milestones are a ``Counter`` of epochs; a tensor
learning rate puts tensors in ``base_lrs``), and one saved as JSON resumed without a word and
never decayed again. So ``encode`` writes those values tagged (an object whose ``TAG`` key
names the type: ``tuple``, ``dict`` with keys of any stored kind, ``Counter``,
``OrderedDict``, ``tensor`` with its dtype and shape) and ``decode`` makes them again, equal
to what was saved; a small tensor's numbers are a setting, not a weight (at most
``MAX_TENSOR_ELEMENTS``; a larger one belongs in a file, ``save_checkpoint(files=)``). A dict
of another type (a ``defaultdict``, a subclass) comes back a plain dict, as JSON gave it back
before; what has no faithful form (a function, a set, an object) is refused, naming where it
is. A plain JSON dict is stored as it is, so a manifest written before stays readable (one
that held the tag's key reads as it is unless it has exactly a tag's shape), and one a
person reads shows the values as they are.
"""

from __future__ import annotations

import collections
import numbers
from typing import Any

import torch

from outcore.errors import ConfigError

__all__ = ["check_client_state", "decode", "encode", "group_value", "json_value"]

TAG = "__outcore__"
MAX_TENSOR_ELEMENTS = 4096
_MAPPINGS: dict[type, str] = {dict: "dict", collections.Counter: "Counter",
                              collections.OrderedDict: "OrderedDict"}
_MADE: dict[str, Any] = {"dict": dict, "Counter": collections.Counter,
                         "OrderedDict": collections.OrderedDict}


def check_client_state(client_state: dict[str, Any]) -> dict[str, Any]:
    """``client_state`` as the manifest stores it (``encode``); a ``ConfigError`` names the
    key or value that cannot be stored."""
    if not isinstance(client_state, dict):
        said = type(client_state).__name__
        if isinstance(client_state, (str, int)):  # a DeepSpeed script's tag, in its place
            said = (f"{client_state!r}: DeepSpeed's save_checkpoint(save_dir, tag) is "
                    "save_checkpoint(os.path.join(save_dir, tag)) here")
        raise ConfigError(f"client_state must be a dict, got {said}")
    for key in client_state:
        if not isinstance(key, str):
            raise ConfigError(f"client_state key {key!r} is not a string (JSON keys are strings)")
    return {key: encode(value, f"client_state[{key!r}]") for key, value in client_state.items()}


def encode(value: Any, where: str) -> Any:
    """``value`` as JSON holds it, tagged where JSON would change it (see the note)."""
    if isinstance(value, torch.Tensor):
        return _tensor(value, where)
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a NumPy scalar
        value = value.item()  # (its bool_ a bool)
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, numbers.Real):  # a bool was taken above
        return int(value) if isinstance(value, numbers.Integral) else float(value)
    if isinstance(value, list):
        return [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
    if isinstance(value, tuple):
        return {TAG: "tuple", "items": [encode(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    kind = _MAPPINGS.get(type(value), "dict" if isinstance(value, dict) else None)
    if kind is None:
        raise ConfigError(f"{where} ({type(value).__name__}) cannot be stored in a checkpoint: "
                          "client_state holds numbers, strings, lists, tuples, dicts (a "
                          "Counter or OrderedDict too) and small tensors; checkpoints store "
                          "JSON, never pickle")
    if kind == "dict" and TAG not in value and all(isinstance(k, str) for k in value):
        # (a dict of another type, a defaultdict, comes back a plain dict, as JSON gave it)
        return {k: encode(v, f"{where}[{k!r}]") for k, v in value.items()}
    return {TAG: kind, "items": [[encode(k, f"{where} key {k!r}"), encode(v, f"{where}[{k!r}]")]
                                 for k, v in value.items()]}


def _tensor(t: torch.Tensor, where: str) -> dict[str, Any]:
    if t.numel() > MAX_TENSOR_ELEMENTS:
        raise ConfigError(f"{where} is a tensor of {t.numel()} elements; client_state keeps "
                          f"tensors of at most {MAX_TENSOR_ELEMENTS} (settings, not weights): "
                          "save a larger one in a file and pass save_checkpoint(files=...)")
    if t.is_complex() or t.dtype not in _DTYPES:
        raise ConfigError(f"{where} is a {t.dtype} tensor, which client_state does not store")
    return {TAG: "tensor", "dtype": _DTYPES[t.dtype], "shape": list(t.shape),
            "values": t.detach().cpu().reshape(-1).tolist()}


_DTYPES = {d: str(d).removeprefix("torch.") for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}
_NAMES = set(_DTYPES.values())


def decode(value: Any) -> Any:
    """What ``encode`` stored, made again (a CPU tensor for a tensor)."""
    if isinstance(value, list):
        return [decode(v) for v in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(TAG)
    if not _tagged(value, kind):  # a plain dict (one of an older outcore may hold the key)
        return {k: decode(v) for k, v in value.items()}
    if kind == "tuple":
        return tuple(decode(v) for v in value["items"])
    if kind == "tensor":
        dtype = getattr(torch, value["dtype"])
        return torch.tensor(value["values"], dtype=dtype).reshape(value["shape"])
    return _MADE[kind]({decode(k): decode(v) for k, v in value["items"]})


def _tagged(value: dict[str, Any], kind: object) -> bool:
    """Whether ``value`` is what ``encode`` writes for a ``kind`` it knows."""
    if kind == "tensor":
        return value.keys() == {TAG, "dtype", "shape", "values"} and value["dtype"] in _NAMES
    if not (isinstance(kind, str) and (kind in _MADE or kind == "tuple")
            and value.keys() == {TAG, "items"} and isinstance(value["items"], list)):
        return False
    return kind == "tuple" or all(isinstance(kv, list) and len(kv) == 2 for kv in value["items"])


def group_value(value: Any, where: str) -> Any:
    """A param group's setting as a manifest stores it: a small tensor (a learning rate) or a
    NumPy number as its numbers (``json_value``: readable, and a load makes a tensor again
    where the group holds one), anything else as ``encode`` stores it."""
    small = value.numel() <= 16 if isinstance(value, torch.Tensor) else (
        getattr(value, "ndim", None) == 0)
    return json_value(value) if small else encode(value, where)


def json_value(value: Any) -> Any:
    """``value`` as JSON can hold it: a real number of any kind (NumPy's ``float32``, which
    ``json.dumps`` refuses) as a float or an int, a tensor (torch takes a tensor ``lr``) as
    its numbers (a small one: a setting, not a weight someone keeps in a group), a tuple as a
    list; anything else unchanged. A param group's settings go through it into a manifest:
    one left out there is silently the loader's config value."""
    if isinstance(value, torch.Tensor) and value.numel() <= 16:
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (tuple, list)):
        return [json_value(v) for v in value]
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):  # a NumPy scalar, bool_
        value = value.item()  # included (not a numbers.Real), as its Python counterpart
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return value
    return int(value) if isinstance(value, numbers.Integral) else float(value)
