# Stubs for the native module kachedb._kachedb_rust (bindings/python/src/).
# Private API: use the re-exports of `kachedb`.
from typing import Any, NoReturn, Optional, Tuple

__version__: str

class DLPackBuffer:
    """A byte range exportable as DLPack (1-D uint8, CPU): torch.from_dlpack(buf),
    numpy.from_dlpack(buf). It stays valid while this object or any tensor made from
    it is alive. Not constructible from Python."""

    @property
    def nbytes(self) -> int: ...
    @property
    def address(self) -> int: ...
    def __len__(self) -> int: ...
    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Optional[Tuple[int, int]] = None,
        dl_device: Optional[Tuple[int, int]] = None,
        copy: Optional[bool] = None,
    ) -> Any: ...
    def __dlpack_device__(self) -> Tuple[int, int]: ...

# Test hooks.
def _test_buffer(n: int, fill: int = 0, *, py_owner: bool = False) -> DLPackBuffer: ...
def _live_test_buffers() -> int: ...
def _raise_error(kind: str, msg: str) -> NoReturn: ...
def _raise_status(status: int, msg: str) -> NoReturn: ...
