"""torch / numpy dtypes <-> KacheDB dtypes, and shape checks matching the descriptor.

The dtype table (codes, names, item sizes: docs/PROTOCOL.md, "DType codes") and
the block limits are the native module's (``kachedb-shm``'s ``DType``); this module
only says which torch and numpy dtype each of its names is.

Neither torch nor numpy is imported until a function needs it: ``import kachedb``
works without torch.
"""

from __future__ import annotations

import operator
import sys
from typing import TYPE_CHECKING, Any, Dict, Iterable, Tuple, Union

from . import _kachedb_rust as _native
from ._errors import InvalidArgument, TooLarge

if TYPE_CHECKING:  # pragma: no cover
    import numpy
    import torch

__all__ = [
    "DTYPE_CODES",
    "CODE_NAMES",
    "ITEMSIZES",
    "MAX_NDIM",
    "MAX_DIM",
    "MAX_NBYTES",
    "itemsize",
    "dtype_name",
    "torch_dtype",
    "torch_code",
    "numpy_dtype",
    "numpy_code",
    "dtype_code",
    "is_torch_dtype",
    "check_shape",
    "block_nbytes",
]

#: The torch (and numpy / ml_dtypes) name of each KacheDB dtype name.
_TORCH_NAMES: Dict[str, str] = {
    "u8": "uint8",
    "i8": "int8",
    "i16": "int16",
    "i32": "int32",
    "i64": "int64",
    "f16": "float16",
    "bf16": "bfloat16",
    "f32": "float32",
    "f64": "float64",
    "f8e4m3fn": "float8_e4m3fn",
    "f8e5m2": "float8_e5m2",
    "bool": "bool",
}

#: numpy (kind, itemsize) -> KacheDB dtype name, for the types numpy has natively.
_NUMPY_KINDS: Dict[Tuple[str, int], str] = {
    ("u", 1): "u8",
    ("i", 1): "i8",
    ("i", 2): "i16",
    ("i", 4): "i32",
    ("i", 8): "i64",
    ("f", 2): "f16",
    ("f", 4): "f32",
    ("f", 8): "f64",
    ("b", 1): "bool",
}

#: KacheDB dtypes numpy lacks; ``ml_dtypes`` (if installed) provides them.
_NOT_IN_NUMPY = ("bf16", "f8e4m3fn", "f8e5m2")

#: Code of each KacheDB dtype name (``"bf16"``, …).
_CODES: Dict[str, int] = {name: code for code, name, _ in _native.DTYPES}

#: Code of each dtype, by its torch name.
DTYPE_CODES: Dict[str, int] = {_TORCH_NAMES[name]: code for name, code in _CODES.items()}

#: The torch name of each code.
CODE_NAMES: Dict[int, str] = {code: name for name, code in DTYPE_CODES.items()}

#: Bytes per element, by code.
ITEMSIZES: Dict[int, int] = {code: size for code, _, size in _native.DTYPES}

_NUMPY_KIND_CODES: Dict[Tuple[str, int], int] = {kind: _CODES[name] for kind, name in _NUMPY_KINDS.items()}
_NOT_IN_NUMPY_CODES = frozenset(_CODES[name] for name in _NOT_IN_NUMPY)

#: Most dimensions a descriptor holds.
MAX_NDIM: int = _native.MAX_NDIM
#: Largest dimension a descriptor holds (``u32``).
MAX_DIM: int = _native.MAX_DIM
#: Largest block, in bytes, that a DLPack tensor (``int64`` shape) can describe.
MAX_NBYTES: int = _native.MAX_NBYTES

_SUPPORTED = ", ".join(DTYPE_CODES)


def _check_code(code: int) -> int:
    if isinstance(code, bool) or not isinstance(code, int):
        raise TypeError(f"a dtype code is an int, not {type(code).__name__}")
    if code not in ITEMSIZES:
        raise InvalidArgument(f"unknown dtype code {code}; known codes are {min(ITEMSIZES)}..{max(ITEMSIZES)} (docs/PROTOCOL.md)")
    return code


def itemsize(code: int) -> int:
    """Bytes per element of dtype ``code``."""
    return ITEMSIZES[_check_code(code)]


def dtype_name(code: int) -> str:
    """The torch name of dtype ``code`` (``"bfloat16"``, …)."""
    return CODE_NAMES[_check_code(code)]


# --- torch -------------------------------------------------------------------

_torch_tables: Tuple[Dict[int, Any], Dict[Any, int]] | None = None


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise ImportError(
            "this needs torch, which is not installed: `pip install 'kachedb-shm[torch]'` "
            "(or use the numpy API, e.g. get_numpy)"
        ) from None
    return torch


def _torch_table() -> Tuple[Dict[int, Any], Dict[Any, int]]:
    global _torch_tables
    if _torch_tables is None:
        torch = _torch()
        to_torch: Dict[int, Any] = {}
        for name, code in DTYPE_CODES.items():
            dt = getattr(torch, name, None)  # float8 types appeared in torch 2.1
            if dt is not None:
                to_torch[code] = dt
        _torch_tables = (to_torch, {dt: code for code, dt in to_torch.items()})
    return _torch_tables


def torch_dtype(code: int) -> "torch.dtype":
    """The ``torch.dtype`` of protocol dtype ``code``."""
    to_torch, _ = _torch_table()
    try:
        return to_torch[_check_code(code)]
    except KeyError:
        torch = _torch()
        raise TypeError(
            f"torch {torch.__version__} has no {CODE_NAMES[code]} dtype; torch >= 2.1 has it"
        ) from None


def torch_code(dtype: "torch.dtype") -> int:
    """The protocol code of a ``torch.dtype``; ``TypeError`` for dtypes KacheDB cannot store."""
    _, from_torch = _torch_table()
    try:
        return from_torch[dtype]
    except (KeyError, TypeError):
        raise TypeError(f"KacheDB cannot store torch dtype {dtype}; supported: {_SUPPORTED}") from None


def is_torch_dtype(obj: object) -> bool:
    """Whether ``obj`` is a ``torch.dtype`` (False, without importing torch, if torch
    was never imported: then no torch dtype can exist)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, getattr(torch, "dtype", ()))


# --- numpy -------------------------------------------------------------------


def _np() -> Any:
    import numpy

    return numpy


def numpy_dtype(code: int) -> "numpy.dtype":
    """The ``numpy.dtype`` of protocol dtype ``code``.

    numpy has no bfloat16 nor float8: those raise ``TypeError`` (read such blocks
    with torch), unless the ``ml_dtypes`` package is installed, which provides them.
    """
    np = _np()
    name = dtype_name(code)
    if code in _NOT_IN_NUMPY_CODES:
        try:
            import ml_dtypes
        except ImportError:
            raise TypeError(
                f"numpy has no {name} dtype: use torch for this block "
                f"(`pip install 'kachedb-shm[torch]'`, then kc.get(key)), or install ml_dtypes"
            ) from None
        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def numpy_code(dtype: Any) -> int:
    """The protocol code of a numpy dtype (or anything ``numpy.dtype()`` accepts,
    except ``None``); ``TypeError`` for dtypes KacheDB cannot store."""
    np = _np()
    if dtype is None:
        raise TypeError("dtype must be given (None would mean float64 to numpy)")
    try:
        dt = np.dtype(dtype)
    except (TypeError, ValueError) as e:
        raise TypeError(f"not a dtype: {dtype!r} ({e})") from None
    ml_code = DTYPE_CODES.get(dt.name)
    if ml_code in _NOT_IN_NUMPY_CODES and dt.itemsize == ITEMSIZES[ml_code]:
        return ml_code  # ml_dtypes' types
    if not dt.isnative:
        raise TypeError(
            f"numpy dtype {dt.str} is not in native byte order; KacheDB stores little-endian: "
            "convert with .astype(dtype.newbyteorder('='))"
        )
    code = _NUMPY_KIND_CODES.get((dt.kind, dt.itemsize))
    if code is None or dt.fields is not None or dt.subdtype is not None:
        raise TypeError(f"KacheDB cannot store numpy dtype {dt}; supported: {_SUPPORTED}")
    return code


# --- either --------------------------------------------------------------------


def dtype_code(dtype: Any) -> int:
    """The protocol code of ``dtype``: a ``torch.dtype``, a numpy dtype-like, or a
    name (``"bfloat16"``, ``"float32"``, KacheDB's ``"bf16"``, ``"f32"``, …)."""
    if is_torch_dtype(dtype):
        return torch_code(dtype)
    if isinstance(dtype, str):
        code = DTYPE_CODES.get(dtype, _CODES.get(dtype))
        if code is not None:
            return code
    return numpy_code(dtype)


# --- shapes -----------------------------------------------------------------------

ShapeLike = Union[int, Iterable[int]]


def check_shape(shape: ShapeLike) -> Tuple[int, ...]:
    """``shape`` as a tuple of ints, checked against what a descriptor holds:
    at most 6 dims, each in ``0 .. 2**32-1``. An int ``n`` means ``(n,)``.

    ``TypeError`` for a non-integer shape, ``InvalidArgument`` (a ``ValueError``)
    for out-of-range values.
    """
    if isinstance(shape, (str, bytes, bytearray)):
        raise TypeError(f"shape must be a sequence of ints, not {type(shape).__name__}")
    try:
        dims: Tuple[int, ...] = (operator.index(shape),)  # type: ignore[arg-type]
    except TypeError:
        try:
            dims = tuple(operator.index(d) for d in shape)  # type: ignore[union-attr]
        except TypeError:
            raise TypeError(f"shape must be an int or a sequence of ints, got {shape!r}") from None
    if len(dims) > MAX_NDIM:
        raise InvalidArgument(f"a KacheDB block has at most {MAX_NDIM} dimensions, shape {dims} has {len(dims)}")
    for d in dims:
        if d < 0 or d > MAX_DIM:
            raise InvalidArgument(f"each dimension must be in 0..{MAX_DIM}, shape {dims} has {d}")
    return dims


def block_nbytes(code: int, shape: ShapeLike) -> int:
    """Bytes of a block of dtype ``code`` and ``shape`` (``TooLarge`` past ``MAX_NBYTES``)."""
    n = itemsize(code)
    dims = check_shape(shape)
    for d in dims:
        n *= d
    if n > MAX_NBYTES:
        raise TooLarge(f"a {dtype_name(code)} block of shape {dims} is {n} bytes, more than any store holds")
    return n
