# Stubs for the native module kachedb._kachedb_rust (bindings/python/src/).
# Private API: use the re-exports of `kachedb`.
from os import PathLike
from typing import Any, List, NoReturn, Optional, Sequence, Tuple, Union

__version__: str

class DLPackBuffer:
    """A byte range exportable as DLPack (1-D uint8, CPU): torch.from_dlpack(buf),
    numpy.from_dlpack(buf). It stays valid while this object or any tensor made from
    it is alive. Not constructible from Python."""

    @property
    def nbytes(self) -> int: ...
    @property
    def address(self) -> int: ...
    @property
    def readonly(self) -> bool: ...
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

class NativeClient:
    """A connection to the daemon: one channel (a pair of rings). Thread-safe
    (operations are serialised); the GIL is released while waiting on the ring.
    Keys are passed as their two 64-bit halves (``kachedb._keys.key_parts``).
    Not constructible from Python: use ``NativeClient.connect``."""

    @staticmethod
    def connect(socket: Union[str, "PathLike[str]", None] = None, instance: int = 0) -> NativeClient:
        """Connects, maps the region and takes a channel; ``Disconnected`` if no
        daemon answers at ``socket`` (default: the instance's socket)."""
    @property
    def socket(self) -> str: ...
    @property
    def channel(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    def region_span(self) -> Tuple[int, int]:
        """(address, bytes) of the whole mapped region in this process."""
    def ping(self) -> None: ...
    def put_raw(self, lo: int, hi: int, code: int, dims: Sequence[int], address: int, nbytes: int) -> None:
        """Copies ``nbytes`` at ``address`` into a new block. The caller keeps the
        source alive and unmodified during the call."""
    def put_many_raw(self, items: Sequence[Tuple[int, int, int, Sequence[int], int, int]]) -> None:
        """Many ``put_raw`` ``(lo, hi, code, dims, address, nbytes)`` items: one
        RESERVE batch, one COMMIT batch; all or nothing."""
    def reserve(self, lo: int, hi: int, code: int, dims: Sequence[int]) -> NativeReservation: ...
    def get(self, lo: int, hi: int) -> Optional[NativeBlock]:
        """Pins the block; ``None`` if absent."""
    def get_dlpack(self, lo: int, hi: int) -> Optional[Tuple[Any, int]]:
        """Pins the block and exports it as a legacy DLPack capsule of its dtype and
        shape (float8 as uint8 of the same shape) whose deleter releases the pin:
        ``(capsule, dtype_code)``, or ``None`` if absent. ``Client.get``'s fast path."""
    def get_many(self, keys: Sequence[Tuple[int, int]]) -> List[Optional[NativeBlock]]: ...
    def get_many_dlpack(self, keys: Sequence[Tuple[int, int]]) -> List[Optional[Tuple[Any, int]]]: ...
    def lookup(self, keys: Sequence[Tuple[int, int]]) -> int:
        """How many leading keys are present."""
    def delete(self, lo: int, hi: int) -> bool: ...
    def stats_json(self) -> str:
        """The daemon's stats, as a JSON object."""
    def close(self) -> None:
        """No new operations; live views keep their pins until they go."""
    def forget_after_fork(self) -> None:
        """In a forked child: drop the inherited connection, never touching the
        parent's rings."""

class NativeBlock:
    """A pinned block. The pin lasts while this object or any tensor made from
    ``buffer()`` is alive."""

    @property
    def dtype_code(self) -> int: ...
    @property
    def shape(self) -> List[int]: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def address(self) -> int: ...
    def buffer(self) -> DLPackBuffer:
        """A read-only DLPack exporter of the block's bytes that owns the pin."""

class NativeReservation:
    """An open reservation: write through ``buffer()``, then ``commit()`` or
    ``abort()`` (each at most once; a second raises ``InvalidArgument``)."""

    @property
    def nbytes(self) -> int: ...
    def buffer(self) -> DLPackBuffer:
        """A writable DLPack exporter of the reserved bytes (write before commit)."""
    def commit(self) -> None: ...
    def abort(self) -> None: ...

def cli_main(argv: Sequence[str]) -> int:
    """Runs the ``kachedb`` command line in this process (program name first)."""

def default_socket_path(instance: int = 0) -> str:
    """The default control socket path of ``instance`` (``$KACHEDB_SOCKET`` for 0)."""

# Test hooks.
def _test_buffer(n: int, fill: int = 0, *, py_owner: bool = False, readonly: bool = False) -> DLPackBuffer: ...
def _live_test_buffers() -> int: ...
def _raise_error(kind: str, msg: str) -> NoReturn: ...
def _raise_status(status: int, msg: str) -> NoReturn: ...
