"""Cerebras .mdl checkpoints of the older formats (`__version__` 0.1 to 0.4; 0.4 is cstorch release 2.0), read
without unpickling anything but the structure, and that through a whitelist.

The layout follows the loader the published cerebras-pytorch 2.10.0 keeps for them
(`cerebras/pytorch/storage/_legacy/pt_h5_saver.py`, `checkpoint_reader.py`, `storage.py`) and cerebras-appliance's
`saver/h5_saver.py`:

* The root attribute `__spec__` is the hex of a `dill` pickle of the `torch.utils._pytree.TreeSpec` of the saved
  state. It is read here by a restricted unpickler that knows only TreeSpec / LeafSpec (as inert stand-ins), the
  container types dict, list, tuple and OrderedDict, and dill's `_load_type` for those names; any other object in
  the pickle refuses the file.
* Each leaf is a top-level dataset named by its "."-joined key, URL-quoted (`quote(key, safe='')`), whose
  `__H5_TYPE__` attribute says how it was stored: TorchTensorH5Type (the data; `is_bfloat16`: int16 bits),
  NumpyArrayH5Type (a numpy array; a torch tensor in format 0.3 and below), ScalarH5Type (a 0-d dataset),
  StringH5Type (`string_value`), NoneH5Type, FullTensorH5Type / DeferredFullTensor (`shape`, `fill_value`),
  DeferredH5Tensor (a link to another dataset of the file, `link_to_self`). Release 1.8 and below wrote no
  `__H5_TYPE__`: the `is_none` / `is_string` (`string_val`) / `is_constructible` / `is_scalar` attributes say it.
  Pickled objects (ObjectH5Type) and tensors kept in other files are refused. A key of the structure without a
  dataset loads as None, as Cerebras' loader does (it warns).
"""

from __future__ import annotations

import io
import pickle
from collections import OrderedDict
from typing import Any
from urllib.parse import quote

import h5py
import numpy as np
import torch

from waferscale.errors import CheckpointError

_CONTAINERS = {"dict": dict, "list": list, "tuple": tuple}


class _Spec:
    """Stand-in for a pickled TreeSpec: its node type, context and children, whichever torch wrote it (a state
    dict in older torch, a list [type, context, children, ...] in newer)."""

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.type = state.get("type")
            self.context = state.get("context", state.get("_context"))
            self.children = state.get("children_specs", state.get("_children", []))
        else:
            self.type, self.context, self.children = state[0], state[1], state[2]


class _Leaf(_Spec):
    pass


def _load_type(name: str) -> type:
    if name not in _CONTAINERS:
        raise pickle.UnpicklingError(f"type {name!r}")
    return _CONTAINERS[name]


class _SpecUnpickler(pickle.Unpickler):
    _ALLOWED = {("torch.utils._pytree", "TreeSpec"): _Spec, ("torch.utils._pytree", "LeafSpec"): _Leaf,
                ("dill._dill", "_load_type"): _load_type, ("collections", "OrderedDict"): OrderedDict,
                **{("builtins", n): t for n, t in _CONTAINERS.items()}}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in self._ALLOWED:
            raise pickle.UnpicklingError(f"{module}.{name}")
        return self._ALLOWED[(module, name)]


def _read_spec(f: h5py.File, where: str) -> _Spec:
    raw = f.attrs.get("__spec__")
    if raw is None:
        raise CheckpointError(f"{where} is an HDF5 file without a __spec__ attribute: not a checkpoint written by "
                              f"cstorch.save")
    try:
        spec = _SpecUnpickler(io.BytesIO(bytes.fromhex(str(raw)))).load()
    except (pickle.UnpicklingError, ValueError, EOFError, IndexError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{where}: its structure (__spec__) holds something other than a tree of dicts, "
                              f"lists and tuples ({e}); waferscale does not unpickle it") from None
    if not isinstance(spec, _Spec):
        raise CheckpointError(f"{where}: its __spec__ is not a pytree structure")
    return spec


def _keys(spec: _Spec, scope: tuple[str, ...] = ()) -> list[str]:
    """Cerebras' recurse_spec: dict keys, else child positions, joined by '.'."""
    if isinstance(spec, _Leaf) or (not spec.children and spec.type is None):
        return [".".join(scope)]
    names = spec.context if isinstance(spec.context, list) and spec.context else range(len(spec.children))
    return [k for name, child in zip(names, spec.children) for k in _keys(child, (*scope, str(name)))]


def _rebuild(spec: _Spec, values: list[Any]) -> Any:
    """The nested state, taking the leaves from the front of `values`."""
    if isinstance(spec, _Leaf) or (not spec.children and spec.type is None):
        return values.pop(0)
    children = [_rebuild(c, values) for c in spec.children]
    if spec.type in (dict, OrderedDict):
        return spec.type(zip(spec.context, children))
    if spec.type in (list, tuple):
        return spec.type(children)
    raise CheckpointError(f"a checkpoint node of type {spec.type!r} is not a dict, list or tuple")


def _tensor(dset: h5py.Dataset, bf16: bool) -> torch.Tensor:
    array = dset[...]
    return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16) if bf16 else torch.from_numpy(array)


def _full(dset: h5py.Dataset) -> torch.Tensor:
    dtype = torch.bfloat16 if dset.attrs.get("is_bfloat16") else torch.from_numpy(np.empty(0, dset.dtype)).dtype
    return torch.full(tuple(int(n) for n in dset.attrs["shape"]), np.asarray(dset.attrs["fill_value"]).item(),
                      dtype=dtype)


def _value(f: h5py.File, key: str, version: float, where: str) -> Any:
    dset = f[quote(key, safe="")]
    a = dset.attrs
    kind = a.get("__H5_TYPE__")
    if kind == "TorchTensorH5Type" or (kind == "NumpyArrayH5Type" and version <= 0.3):
        return _tensor(dset, bool(a.get("is_bfloat16")))
    if kind == "NumpyArrayH5Type":
        return _tensor(dset, True) if a.get("is_bfloat16") else dset[...]
    if kind == "ScalarH5Type":
        return dset[...].item()
    if kind == "StringH5Type":
        return str(a["string_value"])
    if kind == "NoneH5Type":
        return None
    if kind in ("FullTensorH5Type", "DeferredFullTensor"):
        return _full(dset)
    if kind in ("DeferredH5Tensor", "StoredTensorH5Type") and a.get("link_to_self"):
        target = f[str(a["key"])]
        return _tensor(target, bool(target.attrs.get("is_bfloat16")))
    if kind is None:  # release 1.8 and below
        if a.get("filepath") is None:
            if a.get("is_none", False):
                return None
            if a.get("is_string", False):
                return str(a.get("string_val"))
            if a.get("is_constructible", False):
                return _full(dset)
            t = _tensor(dset, bool(a.get("is_bfloat16")))
            return t.item() if a.get("is_scalar", False) else t
    what = "a pickled Python object" if kind == "ObjectH5Type" else \
        f"a tensor kept in another file ({a['filepath']})" if a.get("filepath") is not None else f"stored as {kind}"
    raise CheckpointError(f"{where}: {key} is {what}, which this reader does not load; load and re-save the "
                          f"checkpoint with a current cstorch")


def load_legacy(f: h5py.File, version: float, where: str) -> Any:
    """The state of an open legacy-format checkpoint."""
    spec = _read_spec(f, where)
    present = set(f.keys())
    values = [_value(f, k, version, where) if quote(k, safe="") in present else None for k in _keys(spec)]
    return _rebuild(spec, values)
