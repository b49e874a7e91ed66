"""Exported blocks -> torch tensors and numpy arrays of their dtype and shape,
sharing memory.

The native module exports every block as a DLPack tensor of its dtype and shape
(the views of ``NativeClient.get_view`` and its batch forms, ``DLPackBuffer.typed``). A dtype the reader cannot
import arrives as the unsigned integer of the same width (float8 for torch;
bfloat16 and float8 for numpy): these functions view it as its dtype, same
shape, no copy. Every view made from the result keeps the DLPack owner (the
block's pin) alive.
"""

from __future__ import annotations

from typing import Any, List, Optional

from . import _kachedb_rust as _native
from ._dtypes import ITEMSIZES, ShapeLike, _np, _torch, check_shape, dtype_name, numpy_dtype, torch_dtype

__all__ = ["writable_tensors", "torch_from_dlpack", "numpy_from_dlpack"]


def _make_view_class() -> Any:
    torch = _torch()

    class KVView(torch.Tensor):
        """A ``torch.Tensor`` that is a view of a pinned KacheDB block. Usable as a
        context manager (``with kc.get(k) as t``). Operations on it return plain
        tensors; the pin lasts while any tensor sharing its memory lives. Pickling
        (``torch.save``, multiprocessing queues) and ``copy.deepcopy`` give plain
        tensors holding a copy of the data."""

        __torch_function__ = torch._C._disabled_torch_function_impl

        def __enter__(self) -> "KVView":
            return self

        def __exit__(self, *exc: Any) -> None:
            return None

        def __reduce_ex__(self, protocol: Any) -> Any:
            # KVView is a local class (it needs torch): pickle as a plain tensor.
            return self.as_subclass(torch.Tensor).__reduce_ex__(protocol)

        def __deepcopy__(self, memo: dict) -> Any:
            out = self.as_subclass(torch.Tensor).clone()
            memo[id(self)] = out
            return out

    return KVView


#: In ``_torch_views``: this torch lacks the dtype.
_MISSING = object()

# Built on first use (they need torch): the view class, torch's DLPack import, and
# by code the torch dtype that an export arriving as unsigned ints is viewed as
# (None for the codes torch imports as themselves).
_view_class: Any = None
_from_dlpack: Any = None
_torch_views: List[Optional[Any]] = []


def _init_torch() -> None:
    global _view_class, _from_dlpack, _torch_views
    torch = _torch()
    # torch.from_dlpack(capsule) ends in torch._C._from_dlpack; call it directly
    # when it is there (saves ~0.3 us a get).
    _from_dlpack = getattr(torch._C, "_from_dlpack", None) or torch.from_dlpack
    table: List[Optional[Any]] = [None] * (max(ITEMSIZES) + 1)
    for code in _native.TORCH_AS_UINT:
        table[code] = getattr(torch, dtype_name(code), _MISSING)  # float8 types appeared in torch 2.1
    _torch_views = table
    _view_class = _make_view_class()


def _as_torch_dtype(t: Any, code: int) -> Any:
    """``t``, imported from an export of a block of dtype ``code``, as that dtype."""
    dt = _torch_views[code]
    if dt is None:
        return t
    if dt is _MISSING:
        torch_dtype(code)  # raises TypeError naming the torch version needed
    return t.view(dt)


def _view_factory() -> tuple:
    """What ``NativeClient.get_view`` makes a ``KVView`` with: torch's DLPack
    import, re-typed as ``KVView``, viewed as its dtype by ``_as_torch_dtype``
    unless ``direct[code]`` (torch imports the code's export as its own
    dtype): ``(from_dlpack, KVView, _as_torch_dtype, direct)``."""
    if _view_class is None:
        _init_torch()
    return _from_dlpack, _view_class, _as_torch_dtype, [dt is None for dt in _torch_views]


def writable_tensors(capsules: List[Any], code: int) -> List[Any]:
    """Capsules of ``NativeReservations.capsules`` (reserved blocks of dtype
    ``code``) as plain writable torch tensors."""
    if _view_class is None:
        _init_torch()
    dt = _torch_views[code]
    if dt is None:
        return [_from_dlpack(c) for c in capsules]
    return [_as_torch_dtype(_from_dlpack(c), code) for c in capsules]


def torch_from_dlpack(exporter: Any, code: int, shape: ShapeLike) -> Any:
    """The bytes of ``exporter`` (a ``DLPackBuffer``) as a torch tensor of dtype
    ``code`` and ``shape``, no copy. ``InvalidArgument`` if they do not take
    exactly its bytes."""
    if _view_class is None:
        _init_torch()
    dims = check_shape(shape)
    return _as_torch_dtype(_torch().from_dlpack(exporter.typed(code, list(dims))), code)


def numpy_from_dlpack(exporter: Any, code: int, shape: ShapeLike, *, writeable: bool = False) -> Any:
    """The bytes of ``exporter`` (a ``DLPackBuffer``) as a numpy array of dtype
    ``code`` and ``shape``, no copy. ``InvalidArgument`` if they do not take
    exactly its bytes; ``TypeError`` for bfloat16/float8 without ``ml_dtypes``.

    Unless ``writeable``, the imported array is made read-only and a view of it
    returned, so that neither the result nor any view of it can be made writeable
    again.
    """
    dims = check_shape(shape)
    dt = numpy_dtype(code)
    a = _np().from_dlpack(exporter.typed(code, list(dims), numpy=True))
    if not writeable:
        a.flags.writeable = False
    return a.view(dt)
