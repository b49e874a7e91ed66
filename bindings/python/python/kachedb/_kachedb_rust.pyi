# Stubs for the native module kachedb._kachedb_rust (bindings/python/src/).
# Private API: use the re-exports of `kachedb`.
from os import PathLike
from typing import Any, Dict, Iterable, List, NoReturn, Optional, Sequence, Tuple, Union

__version__: str
#: The dtype table (docs/PROTOCOL.md, "DType codes"): (code, name, itemsize) rows.
DTYPES: List[Tuple[int, str, int]]
#: The dtype codes exported to torch as unsigned ints of their width (float8).
TORCH_AS_UINT: List[int]
#: Most dimensions a block has.
MAX_NDIM: int
#: Largest dimension of a block (u32).
MAX_DIM: int
#: Largest block, in bytes, that a DLPack tensor (int64 shape) describes.
MAX_NBYTES: int

class DLPackBuffer:
    """A byte range exportable as DLPack (CPU; 1-D uint8, or a block's dtype and
    shape once ``typed``): torch.from_dlpack(buf), numpy.from_dlpack(buf). It stays
    valid while this object or any tensor made from it is alive. Not constructible
    from Python."""

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
    def typed(self, code: int, shape: Sequence[int], *, numpy: bool = False) -> DLPackBuffer:
        """The same range and owner, exported as a block of dtype ``code`` and
        ``shape`` for numpy (``numpy=True``) or torch: dtypes the reader cannot import
        (float8 for torch; bfloat16, float8 for numpy) as the unsigned int of the same
        width. ``InvalidArgument`` if they do not take exactly its bytes."""

class NativeClient:
    """A connection to the daemon: one channel (a pair of rings). Thread-safe
    (operations are serialised); the GIL is released while waiting on the ring.
    Keys are what ``key_of`` takes (bytes, bytearray, memoryview, str, int),
    mapped natively.
    Not constructible from Python: use ``NativeClient.connect``."""

    @staticmethod
    def connect(
        socket: Union[str, "PathLike[str]", None] = None,
        instance: int = 0,
        trust_uid: Optional[int] = None,
        tenant: Optional[str] = None,
    ) -> NativeClient:
        """Connects, maps the region and takes a channel; ``Disconnected`` if no
        daemon answers at ``socket`` (default: the instance's socket);
        ``KacheDBError`` if the socket's directory or the daemon's uid is not
        trusted (own uid, root, ``trust_uid`` or ``$KACHEDB_TRUST_UID``);
        ``InvalidArgument`` for a ``tenant`` name the daemon would refuse.
        The client counts for ``tenant`` (default: the daemon's default tenant)."""
    @property
    def socket(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    def region_span(self) -> Tuple[int, int]:
        """(address, bytes) of the whole mapped region in this process."""
    def ping(self) -> None: ...
    def put(
        self,
        key: Any,
        code: int,
        dims: Sequence[int],
        address: int,
        nbytes: int,
        parent: Optional[Any] = None,
    ) -> None:
        """Copies ``nbytes`` at ``address`` into a new block (by several threads for
        large blocks), naming the key ``parent`` as the block it follows. The
        caller keeps the source alive and unmodified during the call."""
    def reserve_each(self, count: int, code: int, dims: Sequence[int]) -> List[NativeReservation]:
        """``count`` reservations of key 0 in one batch, each finished on its own."""
    def reserve(self, key: Any, code: int, dims: Sequence[int], parent: Optional[Any] = None) -> NativeReservation:
        """Reserves a block; the key ``parent`` is named at its COMMIT."""
    def get(self, key: Any) -> Optional[NativeBlock]:
        """Pins the block; ``None`` if absent (``Client.get_numpy``'s path)."""
    def get_view(self, key: Any) -> Optional[Any]:
        """``Client.get``'s fast path in one call: the key mapped here, the block
        pinned and returned as a ``kachedb._views.KVView`` whose last view
        releases the pin; ``None`` if absent."""
    def get_many_views(self, keys: Iterable[Any]) -> List[Optional[Any]]:
        """``get_view`` of many keys in one batch; ``None`` for each absent key."""
    def get_prefix_views(self, keys: Iterable[Any], pin_each: bool = False) -> List[Any]:
        """Pins the leading present keys in one round trip; each a ``KVView``.
        With ``pin_each``, each as ``get_view`` makes it (its own pin); else the
        views share their pins, released together when the last of them goes."""
    def put_ranges(
        self,
        keys: Iterable[Any],
        code: int,
        dims: List[int],
        addresses: List[int],
        lengths: List[int],
        parents: Optional[Iterable[Any]] = None,
    ) -> None:
        """One block per key gathered from ``len(addresses) // len(keys)`` raw
        byte ranges in order: one RESERVE batch, the copies, one COMMIT batch."""
    def get_prefix_into(
        self, keys: Iterable[Any], code: int, block_len: int, addresses: List[int], lengths: List[int]
    ) -> int:
        """The leading present blocks copied into raw byte ranges, pins released;
        how many were copied."""
    def wait_for_view(self, key: Any, timeout: Optional[float] = None) -> Any:
        """Waits (GIL released) until ``key`` is committed, then returns it as
        ``get_view`` does; ``TimedOut`` after ``timeout`` seconds (``None``: never)."""
    def put_many(
        self,
        keys: Iterable[Any],
        values: Iterable[Any],
        codes: Dict[Any, int],
        source: Any,
        parents: Optional[Iterable[Any]] = None,
    ) -> None:
        """``Client.put_many`` in one call: contiguous CPU torch tensors are read
        natively (``codes``: torch dtype -> code), other values through
        ``source(value) -> (code, shape, address, nbytes, keepalive)``.
        ``parents``: one key (or ``None``) per block."""
    def reserve_many(
        self, keys: Iterable[Any], code: int, dims: Sequence[int], parents: Optional[Iterable[Any]] = None
    ) -> NativeReservations:
        """One reservation of ``dims`` of dtype ``code`` per key, in one batch; all or
        nothing. ``parents``: one key (or ``None``) per block, named at the COMMITs."""
    def delete_many(self, keys: Iterable[Any]) -> int:
        """Unlinks the keys in one batch; how many were present."""
    def lookup(self, keys: Iterable[Any]) -> int:
        """How many leading keys are present."""
    def delete(self, key: Any) -> bool:
        """Unlinks the key; whether it was present."""
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
        """A read-only DLPack exporter of the block's bytes that owns the pin
        (``.typed(dtype_code, shape)`` exports it as the block)."""

#: ``(block_hash, parent_hash, block_size, token_ids, lora_id, lora_name)`` (``kachedb.BlockMeta``).
MetaTuple = Tuple[int, Optional[int], int, List[int], Optional[int], Optional[str]]

class NativeReservation:
    """An open reservation: write through ``buffer()``, then ``commit()`` or
    ``abort()`` (each at most once; a second raises ``InvalidArgument``)."""

    @property
    def nbytes(self) -> int: ...
    def buffer(self) -> DLPackBuffer:
        """A writable DLPack exporter of the reserved bytes (write before commit;
        ``.typed(code, shape)`` exports them as the block)."""
    def commit(self, key: Optional[Any] = None) -> None:
        """Commits (under ``key``, in place of the reserved key, when given)."""
    def abort(self) -> None: ...
    def attach_meta(self, meta: MetaTuple) -> None:
        """Attaches a block metadata record, before the commit."""

class NativeReservations:
    """The reservations of one ``reserve_many`` batch."""

    def __len__(self) -> int: ...
    def fill_gathered(self, addresses: Sequence[int], lengths: Sequence[int], threads: int = 0) -> None:
        """Copies raw byte ranges into the reservations, ``len(addresses) // len(self)`` each, in order."""
    def capsules(self) -> List[Any]:
        """One writable legacy DLPack capsule per reservation (dtype and shape of the batch)."""
    def commit(self) -> None:
        """Commits all of them in one batch (at most once)."""
    def abort(self) -> None:
        """Aborts all of them in one batch (at most once)."""
    def attach_meta(self, metas: Sequence[Optional[MetaTuple]]) -> None:
        """Attaches one block metadata record (or None) per reservation, before the commit."""

def default_socket_path(instance: int = 0) -> str:
    """The default control socket path of ``instance`` (``$KACHEDB_SOCKET`` for 0)."""

def commit_reservations(
    reservations: Sequence[NativeReservation],
    keys: Sequence[Any],
    metas: Optional[Sequence[Optional[Any]]] = None,
    parents: Optional[Sequence[Optional[Any]]] = None,
) -> List[bool]:
    """Commits open reservations of one client in one batch, each under its key
    (COMMIT_PIN with COMMIT_NAMES_KEY; the pin goes with the last tensor) and
    naming its parent in ``parents`` if given: one bool per reservation,
    whether it was committed."""

def key_of(key: Union[bytes, bytearray, memoryview, str, int]) -> int:
    """The 128-bit key ``key`` is stored under (docs/PROTOCOL.md, "Keys")."""

# Test hooks: only in a build with the `testing` feature (`make python`; not the shipped wheel).
def _test_buffer(n: int, fill: int = 0, *, readonly: bool = False) -> DLPackBuffer: ...
def _live_test_buffers() -> int: ...
def _raise_error(kind: str, msg: str) -> NoReturn:
    """Raises the kachedb exception class named ``kind`` (else KacheDBError)."""
def _raise_status(status: int, msg: str) -> NoReturn:
    """Raises what an operation answered with completion ``status`` raises."""
