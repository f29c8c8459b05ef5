"""Cerebras' `.mdl` checkpoint format (HDF5, format version 0.5), read and written without Cerebras' packages.

The layout follows the published cerebras-pytorch 2.10.0 (`cerebras/pytorch/storage/save.py`, `load.py`,
`serializers.py`) and cerebras-appliance 2.10.0 (`cerebras/appliance/storage/h5_storage.py`, `context.py`,
`serializers.py`):

* The state is flattened with `torch.utils._pytree`; each leaf's key is its path joined by "." (Cerebras'
  `recurse_spec`: dict keys, else child indices), e.g. `model.embedding_layer.word_embeddings.weight`.
* Root attributes: `__spec__` = JSON of [the structure with "*" leaves (or null if that is not JSON), the
  `treespec_dumps` string], `__version__` = 0.5, `__cstorch_version__`, then for each leaf key
  `"{key}.__metadata__"` = JSON {"__spec__": [...of {key: leaf}], "__objects__": [key], "{key}.__metadata__":
  the leaf's serializer metadata}, and `__SUCCESS__` = True, written last (a file without it is partial).
* A tensor is a top-level dataset named by its key, LZ4-compressed through hdf5plugin (0-d ones uncompressed),
  bfloat16 stored as its int16 bits; its attributes (and its JSON metadata) are `__TORCH__`, `shapes`,
  `dtypes` ("torch.bfloat16"), `rtfx_dtypes`, `__TYPE__` = "TorchTensorSerializer", `__NUMPY__`, `compressed`.
* Python numbers and strings have no dataset: `scalar_value` / `string_value` in the JSON metadata
  (`ScalarSerializer` / `StringSerializer`, `__NONE__`). None is `NoneSerializer`. A value met again (the same
  object, as cstorch links CPython's shared small ints too; or a view of the same memory: tied weights) is a
  `LinkedObject` naming the first key.

Older formats (`__version__` below 0.5) are read by `mdl_legacy.py`. Not read: pickled Python objects
(`ObjectSerializer`): loading never unpickles them. Not written: anything but tensors, numpy arrays, numbers,
strings, None, dicts, lists and tuples.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import torch
import torch.utils._pytree as pytree

from waferscale.errors import CheckpointError
from waferscale.runtime.mdl_legacy import load_legacy
from waferscale.util.files import atomic_path

FORMAT_VERSION = 0.5
# The cstorch release whose format this mirrors; Cerebras' loader reads only __version__.
CSTORCH_VERSION = "2.10.0"

# torch dtype <-> RtFxProto.ElementType (cerebras/appliance/pb/ws/rtfx_pb2.py); cstorch refuses other dtypes.
RTFX_DTYPES = {torch.bool: 1, torch.int16: 3, torch.int32: 4, torch.int64: 5, torch.uint8: 6, torch.uint16: 7,
               torch.uint32: 8, torch.uint64: 9, torch.float16: 10, torch.float32: 11, torch.float64: 12,
               torch.bfloat16: 15}
_FROM_RTFX = {v: k for k, v in RTFX_DTYPES.items()}
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def is_mdl(path: str | os.PathLike) -> bool:
    """Whether `path` is an HDF5 file (what cstorch.load tells apart from a torch/safetensors file)."""
    try:
        with open(path, "rb") as f:
            return f.read(8) == HDF5_SIGNATURE
    except OSError:
        return False


def leaf_keys(spec: pytree.TreeSpec) -> list[str]:
    """The "."-joined key of each leaf, as Cerebras' `recurse_spec` names them."""
    out: list[str] = []

    def walk(s: pytree.TreeSpec, scope: list[str]) -> None:
        if s.num_leaves == 0:
            return
        children = s.children() if hasattr(s, "children") else s.children_specs
        context = s.context
        if context:
            if isinstance(context, type) and issubclass(context, tuple) and hasattr(context, "_fields"):
                context = range(len(context._fields))  # a namedtuple: its fields by position
            for key, child in zip(context, children):
                walk(child, [*scope, str(key)])
        elif not children:
            out.append(".".join(scope))
        else:
            for i, child in enumerate(children):
                walk(child, [*scope, str(i)])

    walk(spec, [])
    return out


def _spec_json(spec: pytree.TreeSpec) -> str:
    """Cerebras' `_serialize_spec`: [the structure with "*" leaves if JSON can hold it, the treespec string]."""
    unflattened = pytree.tree_unflatten(["*"] * spec.num_leaves, spec)
    try:
        json.dumps(unflattened)
    except TypeError:
        unflattened = None
    return json.dumps([unflattened, pytree.treespec_dumps(spec)], indent=4)


def _tensor_array(t: torch.Tensor, key: str) -> tuple[np.ndarray, dict[str, Any]]:
    if t.dtype not in RTFX_DTYPES:
        raise CheckpointError(f"cstorch.save(format='mdl'): {key} is {t.dtype}, which the .mdl format cannot hold; "
                              f"use one of {', '.join(str(d) for d in RTFX_DTYPES)}")
    t = t.detach().cpu().contiguous()
    array = t.view(torch.int16).numpy() if t.dtype == torch.bfloat16 else t.numpy()  # bf16 as its int16 bits
    meta = {"__TORCH__": True, "shapes": [list(t.shape)], "dtypes": [str(t.dtype)],
            "rtfx_dtypes": [RTFX_DTYPES[t.dtype]], "__TYPE__": "TorchTensorSerializer", "__NUMPY__": True,
            "compressed": False}  # cstorch's default (backends.csx.performance.compress_weights); LZ4 regardless
    return array, meta


def _leaf_metadata(key: str, value: Any, first_key: dict[Any, str]) -> tuple[np.ndarray | None, dict[str, Any]]:
    """(the dataset to write or None, the serializer metadata) of one leaf. As cstorch.save does, a value met
    again (the same object: tied weights, but also CPython's shared small ints and None) links to its first key.
    A tensor is also met again as another view of the same memory (`state_dict()` detaches each name of a tied
    weight into a new tensor object, which cstorch's identity test would store twice)."""
    ident: Any = id(value)
    if isinstance(value, torch.Tensor) and value.numel():
        ident = (value.untyped_storage().data_ptr(), value.storage_offset(), tuple(value.shape), value.stride(),
                 value.dtype)
    if ident in first_key:
        return None, {"key": first_key[ident], "__LINKED__": True, "__TYPE__": "LinkedObject", "__NONE__": True}
    first_key[ident] = key
    if isinstance(value, torch.Tensor):
        return _tensor_array(value, key)
    if isinstance(value, np.ndarray):
        return value, {"is_bfloat16": False, "__TYPE__": "NumpyArraySerializer", "__NUMPY__": True,
                       "compressed": False}
    if isinstance(value, (bool, int, float)):
        return None, {"scalar_value": value, "__TYPE__": "ScalarSerializer", "__NONE__": True}
    if isinstance(value, str):
        return None, {"string_value": value, "__TYPE__": "StringSerializer", "__NONE__": True}
    if value is None:
        return None, {"__TYPE__": "NoneSerializer", "__NONE__": True}
    raise CheckpointError(f"cstorch.save(format='mdl'): {key} is a {type(value).__name__}; the .mdl format holds "
                          f"tensors, numbers, strings, None, lists and dicts")


def save_mdl(state: Any, path: str | os.PathLike) -> None:
    """Write `state` as a Cerebras .mdl checkpoint (to a temporary file, renamed into place when complete)."""
    import hdf5plugin  # the LZ4 filter, loaded where a .mdl is written or read, not by every run

    leaves, spec = pytree.tree_flatten(state)
    keys = leaf_keys(spec)
    if len(set(keys)) != len(keys):
        twice = next(k for k in keys if keys.count(k) > 1)
        raise CheckpointError(f"cstorch.save(format='mdl'): two entries are both named {twice!r} once their "
                              f"path is joined with '.'; rename one")
    root: dict[str, Any] = {"__spec__": _spec_json(spec), "__version__": FORMAT_VERSION,
                            "__cstorch_version__": CSTORCH_VERSION}
    first_key: dict[Any, str] = {}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The HDF5 1.8 file format (readable by every HDF5 since 2008) stores many attributes indexed: a checkpoint
    # has one root attribute per leaf, which the earliest format (what Cerebras' writer leaves h5py's default at)
    # appends to by linear search, minutes for 15,000 leaves (75 s measured for 15,000 attributes, 1 s in 1.8's).
    with atomic_path(path) as tmp, h5py.File(tmp, "w", libver=("v108", "v108")) as f:
        f.attrs.update(root)  # the global metadata first, as cstorch writes it
        for key, value in zip(keys, leaves):
            array, meta = _leaf_metadata(key, value, first_key)
            if array is not None:
                dset = f.create_dataset(key, data=array, **(hdf5plugin.LZ4() if array.shape else {}))
                dset.attrs.update(meta)
            leaf_spec = pytree.tree_flatten({key: 0})[1]
            root[f"{key}.__metadata__"] = json.dumps({"__spec__": json.loads(_spec_json(leaf_spec)),
                                                      "__objects__": [key], f"{key}.__metadata__": meta}, indent=4)
        root["__SUCCESS__"] = True
        f.attrs.update(root)


# ---- reading --------------------------------------------------------------------------------------------

def _dtype(name: str, key: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"{key} has the unknown dtype {name!r}")
    return dtype


def _read_tensor(f: h5py.File, key: str, meta: dict[str, Any], where: str) -> torch.Tensor:
    if key not in f:
        raise CheckpointError(f"{where} is damaged: the tensor {key} named in its structure has no dataset")
    try:
        array = f[key][...]
    except OSError as e:  # e.g. a filter that is not available, or a truncated chunk
        raise CheckpointError(f"{where}: cannot read {key} ({e})") from None
    if "dtypes" in meta:
        dtype = _dtype(meta["dtypes"][0], key)
    elif meta.get("rtfx_dtypes", [None])[0] in _FROM_RTFX:
        dtype = _FROM_RTFX[meta["rtfx_dtypes"][0]]
    else:
        raise CheckpointError(f"{where}: {key} names no dtype")
    if dtype == torch.bfloat16:
        t = torch.from_numpy(array.view(np.int16)).view(torch.bfloat16)
    else:
        t = torch.from_numpy(array).to(dtype)
    shape = tuple(meta.get("shapes", [t.shape])[0])
    if tuple(t.shape) != shape:
        raise CheckpointError(f"{where} is damaged: {key} has shape {tuple(t.shape)}, its metadata says {shape}")
    return t


def _read_leaf(f: h5py.File, attrs: dict[str, Any], key: str, where: str) -> Any:
    raw = attrs.get(f"{key}.__metadata__")
    if raw is None:
        raise CheckpointError(f"{where} is damaged: no metadata for {key}")
    entry = json.loads(raw)
    meta = entry.get(f"{key}.__metadata__")
    kind = meta.get("__TYPE__") if isinstance(meta, dict) else None
    if kind is None:  # a value serialized as a nested object (e.g. a tensor defined by a JIT graph)
        kinds = sorted({m.get("__TYPE__") for k, m in entry.items() if k.endswith(".__metadata__")
                        and isinstance(m, dict) and m.get("__TYPE__")})
        raise CheckpointError(f"{where}: {key} is stored as {'/'.join(kinds) or 'an unknown object'}, which only "
                              f"Cerebras' own loader can rebuild; load and re-save it there with plain tensors")
    if kind == "TorchTensorSerializer":
        if meta.get("__RTFX__"):
            raise CheckpointError(f"{where}: {key} is an appliance-native (RtFx) buffer; re-save it with cstorch")
        return _read_tensor(f, key, meta, where)
    if kind == "NumpyArraySerializer":
        array = f[key][...]
        # numpy has no bfloat16: a bf16 array comes back as a torch tensor
        return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16) if meta.get("is_bfloat16") else array
    if kind == "ScalarSerializer":
        return meta["scalar_value"]
    if kind == "StringSerializer":
        return meta["string_value"]
    if kind == "NoneSerializer":
        return None
    if kind == "LinkedObject":
        return _Link(meta["key"])
    if kind == "DeferredFullTensor":  # a constant tensor (cstorch leaves it uninitialized when fill_value is None)
        return torch.full(tuple(meta["shape"]), meta["fill_value"] or 0, dtype=_dtype(meta["dtype"], key))
    if kind == "ObjectSerializer":
        raise CheckpointError(f"{where}: {key} is a pickled Python object; waferscale never unpickles checkpoint "
                              f"contents. Re-save the checkpoint without it (tensors, numbers and strings only)")
    raise CheckpointError(f"{where}: {key} was written by the serializer {kind!r}, which this reader does not know "
                          f"(known: TorchTensorSerializer, NumpyArraySerializer, ScalarSerializer, StringSerializer, "
                          f"NoneSerializer, LinkedObject, DeferredFullTensor)")


class _Link:
    """A tied tensor: the value stored under another key."""

    def __init__(self, key: str):
        self.key = key


def load_mdl(path: str | os.PathLike, map_location: Any = None) -> Any:
    """Read a Cerebras .mdl checkpoint (format 0.5) into the nested state it was saved from."""
    import hdf5plugin  # noqa: F401 - registers the LZ4 filter its datasets are read through

    path = Path(path)
    where = str(path)
    try:
        f = h5py.File(path, "r")
    except OSError as e:
        raise CheckpointError(f"{where} is not a readable HDF5 checkpoint ({str(e).splitlines()[0][:120]}); it "
                              f"was partially written or is another format") from None
    with f:
        attrs = dict(f.attrs)  # read once: a file in HDF5's earliest format finds each attribute by linear search
        if "__version__" not in attrs and "__spec__" not in attrs:
            raise CheckpointError(f"{where} is an HDF5 file but not a Cerebras checkpoint (no __version__ or "
                                  f"__spec__ attribute); was it written by cstorch.save?")
        version = float(attrs.get("__version__", 0.1))  # (release 1.8 and below wrote none: 0.1 to cstorch)
        if version < FORMAT_VERSION:
            state = load_legacy(f, version, where)
            return _map(state, map_location)
        if version > FORMAT_VERSION:
            raise CheckpointError(f"{where} has format {version}, newer than the {FORMAT_VERSION} this reader "
                                  f"follows")
        if not bool(attrs.get("__SUCCESS__", False)):
            raise CheckpointError(f"{where} is a partially written checkpoint (no __SUCCESS__ mark); use an "
                                  f"earlier one")
        try:
            spec = pytree.treespec_loads(json.loads(attrs["__spec__"])[1])
        except (KeyError, ValueError, TypeError, NotImplementedError) as e:
            raise CheckpointError(f"{where}: its structure (__spec__) cannot be read: {e}") from None
        keys = leaf_keys(spec)
        values = {k: _read_leaf(f, attrs, k, where) for k in keys}
    for k, v in values.items():  # re-tie: the same tensor object under both keys
        if isinstance(v, _Link):
            if v.key not in values or isinstance(values[v.key], _Link):
                raise CheckpointError(f"{where} is damaged: {k} is tied to {v.key}, which it does not hold")
            values[k] = values[v.key]
    return _map(pytree.tree_unflatten([values[k] for k in keys], spec), map_location)


def _map(state: Any, map_location: Any) -> Any:
    """Tensors moved to `map_location` (each object once, so ties stay ties)."""
    if map_location is None:
        return state
    moved: dict[int, torch.Tensor] = {}

    def move(v: Any) -> Any:
        if not isinstance(v, torch.Tensor):
            return v
        if id(v) not in moved:
            moved[id(v)] = v.to(map_location)
        return moved[id(v)]

    return pytree.tree_map(move, state)
