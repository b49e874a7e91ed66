"""Raw bytes -> typed, shaped views, sharing memory.

A block travels from Rust as a 1-D ``uint8`` DLPack tensor (every consumer can
import that, whatever the block's dtype: DLPack has no float8 code, numpy has no
bfloat16); these functions give it its dtype and shape without copying. Every
view made from the result keeps the DLPack owner (the block's pin) alive.
"""

from __future__ import annotations

from typing import Any

from ._dtypes import ShapeLike, _np, _torch, block_nbytes, check_shape, dtype_name, numpy_dtype, torch_dtype
from ._errors import InvalidArgument

__all__ = ["torch_view", "numpy_view", "torch_from_dlpack", "numpy_from_dlpack"]


def _check_nbytes(got: int, code: int, dims: tuple, what: str) -> None:
    want = block_nbytes(code, dims)
    if got != want:
        raise InvalidArgument(
            f"{what} has {got} bytes, but a {dtype_name(code)} block of shape {dims} needs {want}"
        )


def torch_view(raw: Any, code: int, shape: ShapeLike) -> Any:
    """``raw`` (a 1-D ``torch.uint8`` tensor of exactly the block's bytes) seen as
    dtype ``code`` and ``shape``: ``raw.view(dtype).view(shape)``, no copy."""
    torch = _torch()
    if not isinstance(raw, torch.Tensor) or raw.dtype != torch.uint8 or raw.dim() != 1:
        raise TypeError(f"expected a 1-D torch.uint8 tensor, got {type(raw).__name__} "
                        f"{getattr(raw, 'dtype', '')} {tuple(getattr(raw, 'shape', ()))}")
    dims = check_shape(shape)
    _check_nbytes(raw.numel(), code, dims, "the raw tensor")
    return raw.view(torch_dtype(code)).view(dims)


def numpy_view(raw: Any, code: int, shape: ShapeLike, *, writeable: bool = False) -> Any:
    """``raw`` (a 1-D ``numpy.uint8`` array of exactly the block's bytes) seen as
    dtype ``code`` and ``shape``: ``raw.view(dtype).reshape(shape)``, no copy.

    Unless ``writeable``, ``raw`` itself is made read-only first, so that neither the
    result nor any view of it can be made writeable again.
    """
    np = _np()
    if not isinstance(raw, np.ndarray) or raw.dtype != np.uint8 or raw.ndim != 1:
        raise TypeError(f"expected a 1-D numpy.uint8 array, got {type(raw).__name__} "
                        f"{getattr(raw, 'dtype', '')} {tuple(getattr(raw, 'shape', ()))}")
    dims = check_shape(shape)
    _check_nbytes(raw.nbytes, code, dims, "the raw array")
    dt = numpy_dtype(code)  # TypeError for bfloat16/float8 without ml_dtypes
    if not writeable:
        raw.flags.writeable = False
    # raw is 1-D and C-contiguous, so this reshape is always a view, never a copy.
    return raw.view(dt).reshape(dims)


def torch_from_dlpack(exporter: Any, code: int, shape: ShapeLike) -> Any:
    """``torch.from_dlpack(exporter)`` (raw bytes), then :func:`torch_view`."""
    return torch_view(_torch().from_dlpack(exporter), code, shape)


def numpy_from_dlpack(exporter: Any, code: int, shape: ShapeLike, *, writeable: bool = False) -> Any:
    """``numpy.from_dlpack(exporter)`` (raw bytes), then :func:`numpy_view`."""
    return numpy_view(_np().from_dlpack(exporter), code, shape, writeable=writeable)
