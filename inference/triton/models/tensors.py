"""Tensors into and out of the Python-backend models, zero-copy (imported inside the backend stub).

The wheel's stub was built for numpy < 2: with numpy 2 its as_numpy()/Tensor(ndarray) read the
array descriptor wrongly (garbage values, zero-byte outputs). DLPack carries dtype and shape
itself, so tensors cross through it, with either numpy.
"""

from __future__ import annotations

import ctypes
import json
from typing import Any

import numpy as np
import numpy.typing as npt
import triton_python_backend_utils as pb_utils

_set_capsule_name = ctypes.pythonapi.PyCapsule_SetName
_set_capsule_name.argtypes = (ctypes.py_object, ctypes.c_char_p)
_set_capsule_name.restype = ctypes.c_int
# The DLPack standard's name for a consumed capsule. A module constant: the capsule keeps the pointer.
_CONSUMED = b"used_dltensor"


def to_numpy(tensor: Any) -> npt.NDArray[Any]:
    """An input tensor as a numpy view."""
    return np.from_dlpack(tensor)


def output(name: str, array: npt.NDArray[Any]) -> Any:
    """`array` (C-contiguous) as the output tensor `name`.

    The stub marks the capsule it consumes "used_dlpack", a name numpy's capsule destructor does
    not know: it then reports an unraisable ValueError, a traceback in Triton's log for every output
    of every request (~3 lines each: gigabytes a day at typeahead traffic). Renamed to the standard's
    name, the destructor sees a consumed capsule and leaves it alone, as it should: the stub owns
    the tensor from here, exactly as before.
    """
    capsule = array.__dlpack__()
    tensor = pb_utils.Tensor.from_dlpack(name, capsule)
    _set_capsule_name(capsule, _CONSUMED)
    return tensor


def int_param(request: Any, name: str) -> int:
    """The request's integer parameter `name`; 0 when it carries none (most requests)."""
    raw = request.parameters()  # a JSON object as text
    if name not in raw:
        return 0
    value = json.loads(raw).get(name)
    return value if isinstance(value, int) else 0


def id_feed(request: Any, names: list[str]) -> dict[str, npt.NDArray[np.int64]]:
    """The request's id tensors among `names` as int64 (an optional one it does not carry left out)."""
    feed: dict[str, npt.NDArray[np.int64]] = {}
    for name in names:
        t = pb_utils.get_input_tensor_by_name(request, name)
        if t is not None:
            feed[name] = to_numpy(t).astype(np.int64, copy=False)
    return feed


def expired(request: Any, deadline_param: str, now_ns: int) -> bool:
    """The request carries its caller's deadline (wall clock, ns) and it has passed."""
    deadline = int_param(request, deadline_param)
    return deadline != 0 and now_ns > deadline
