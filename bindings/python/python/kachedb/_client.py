"""The user-facing client: ``kachedb.connect()`` and ``Client``.

Blocks come back as zero-copy views of the daemon's shared memory. A view keeps
its block pinned (never evicted, moved or reused) for as long as it, or any
tensor or array made from it (slices, ``.view``, ``as_strided``…), is alive;
when the last one is garbage-collected the pin is released. ``close()`` stops new
operations but keeps live views valid (and pinned) until they go.

Blocks of a prefix chain (block i useful only after blocks 0..i-1) should name
their ``parent``, the key of the block before them (``put(..., parent=)``,
``put_many(..., chain=True)``, ``reserve``/``reserve_many`` alike): the daemon's
default eviction then never evicts a block before the blocks that follow it, so
a lookup of a chain never stops at a hole that eviction made (docs/eviction.md).
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
import weakref
from typing import Any, List, Optional, Sequence, Union

from . import _kachedb_rust as _native
from ._daemon_bin import daemon_binary
from ._dtypes import ShapeLike, _np, _torch, _torch_table, check_shape, dtype_code, is_torch_dtype
from ._errors import Disconnected, InvalidArgument, KacheDBError, NotFound
from ._meta import BlockMeta, native_metas
from ._keys import KeyLike
from ._views import numpy_from_dlpack, torch_from_dlpack, writable_tensors

__all__ = ["connect", "Client", "Reservation", "Reservations", "default_socket_path"]

_live_clients: "weakref.WeakSet[Client]" = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # A forked child shares the parent's rings and socket; it must never touch
    # them. Each inherited client forgets its connection (closing the child's
    # copy of the socket, so the daemon still sees the parent's exit).
    for c in list(_live_clients):
        c._forked = True
        c._native.forget_after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def default_socket_path(instance: int = 0) -> str:
    """The socket a daemon of ``instance`` listens on by default
    (``$KACHEDB_SOCKET`` overrides it for instance 0)."""
    return _native.default_socket_path(instance)


def _parse_size(size: Union[int, str, None]) -> Optional[str]:
    if size is None:
        return None
    if isinstance(size, int):
        if size <= 0:
            raise InvalidArgument(f"size must be positive, got {size}")
        return str(size)
    if isinstance(size, str):
        return size
    raise TypeError(f"size must be an int (bytes) or a str like '8GiB', got {type(size).__name__}")


def _open_log(log_dir: str, log_path: str) -> Any:
    """Opens the spawned daemon's log for appending without following a
    symlink or writing into a file someone else planted there: the directory
    must be ours (or root's) and not writable by others unless sticky, and the
    log a regular file of ours with one link."""
    st = os.stat(log_dir)
    if st.st_uid not in (os.geteuid(), 0):
        raise KacheDBError(f"refusing to write the daemon's log in {log_dir}: it belongs to uid {st.st_uid}; pass a socket in a directory of yours")
    if st.st_mode & 0o022 and not st.st_mode & 0o1000:
        raise KacheDBError(
            f"refusing to write the daemon's log in {log_dir}: its mode {st.st_mode & 0o7777:o} lets others write to it; "
            "pass a socket in a private directory (mode 0700)"
        )
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(log_path, flags, 0o600)
    except OSError as e:
        raise KacheDBError(f"cannot open the daemon's log {log_path} ({e}); a symlink there is refused: remove it") from e
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        os.close(fd)
        raise KacheDBError(f"refusing to append to the daemon's log {log_path}: it is not a regular file of yours with one link; remove it")
    return os.fdopen(fd, "ab")


def _spawn_daemon(socket: str, instance: int, size: Union[int, str, None], timeout: float) -> subprocess.Popen:
    try:
        binary = daemon_binary()
    except FileNotFoundError as e:
        raise KacheDBError(f"connect(start=True) cannot start a daemon: {e}") from None
    argv = [binary, "serve", "--socket", socket, "--instance", str(instance)]
    s = _parse_size(size)
    if s is not None:
        argv += ["--size", s]
    log_dir = os.path.dirname(socket) or "."
    os.makedirs(log_dir, mode=0o700, exist_ok=True)
    log_path = os.path.join(log_dir, f"kachedb_{instance}.log")
    log = _open_log(log_dir, log_path)
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    finally:
        log.close()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = ""
            try:
                with open(log_path, "rb") as f:
                    tail = f.read()[-2000:].decode(errors="replace")
            except OSError:
                pass
            raise KacheDBError(f"the daemon started by connect(start=True) exited with code {proc.returncode}:\n{tail}")
        if os.path.exists(socket):
            try:
                _native.NativeClient.connect(socket).close()
                return proc
            except Disconnected:
                pass
        time.sleep(0.02)
    proc.kill()
    raise KacheDBError(f"the daemon did not accept connections on {socket} within {timeout:.0f} s (log: {log_path})")


def connect(
    socket: Optional[str] = None,
    start: bool = False,
    *,
    instance: int = 0,
    size: Union[int, str, None] = None,
    timeout: float = 60.0,
    trust_uid: Optional[int] = None,
    tenant: Optional[str] = None,
) -> "Client":
    """Connects to the KacheDB daemon.

    ``socket``: the control socket (default: ``$KACHEDB_SOCKET``, else the
    instance's default path). ``start=True``: if no daemon answers there, spawn
    one (``python -m kachedb serve``, detached, logging next to the socket) with
    a megaslab of ``size`` (bytes or ``"8GiB"``; default: a quarter of available
    memory, at most 4 GiB) and wait up to ``timeout`` seconds for it. The spawned
    daemon outlives this client (other workers share it); ``Client.stop_daemon()``
    stops it.

    The client trusts only a daemon running as its own uid or root, in a socket
    directory nobody else can write to; ``trust_uid`` (or ``$KACHEDB_TRUST_UID``)
    also trusts a daemon of that uid (one shared with ``--allow-gid``). An
    untrusted socket, or one that does not answer within 10 s, raises
    ``KacheDBError`` saying why.

    ``tenant``: the tenant this client's blocks and requests count for (1 to
    64 ASCII letters, digits, ``_``, ``-``, ``.``, starting with a letter or
    digit; default: the daemon's ``default`` tenant). The daemon's limit for
    it (``kachedb serve --tenant-limit``) bounds what its clients hold; a put
    that cannot fit within it raises ``OutOfMemory`` naming the limit.
    """
    path = socket or default_socket_path(instance)
    proc = None
    try:
        native = _native.NativeClient.connect(path, instance, trust_uid, tenant)
    except Disconnected:
        if not start:
            raise
        proc = _spawn_daemon(path, instance, size, timeout)
        native = _native.NativeClient.connect(path, instance, trust_uid, tenant)
    return Client(native, proc)


def _torch_module_or_none() -> Any:
    return sys.modules.get("torch")


def _is_tensor(x: Any) -> bool:
    torch = _torch_module_or_none()
    return torch is not None and isinstance(x, torch.Tensor)


def _is_ndarray(x: Any) -> bool:
    np = sys.modules.get("numpy")
    return np is not None and isinstance(x, np.ndarray)


class _Pending:
    """What ``Reservation`` and ``Reservations`` share: one native handle,
    committed on normal exit of ``with``, aborted if the block raises or if the
    object is collected unfinished.

    The tensors in ``out`` (and every tensor made from them) keep the reserved
    extent out of reuse for as long as they live: after a commit the block
    stays pinned until the last of them is gone, and an abort frees the extent
    only then (at once if none is kept)."""

    _native: Any
    _done: bool
    out: Any
    #: made with no key (``Client.reserve(None, ...)``): committed only under a
    #: key given then; leaving ``with`` without one aborts it
    _keyless: bool = False

    @property
    def finished(self) -> bool:
        """Whether it was committed or aborted (by this object)."""
        return self._done

    def commit(self) -> None:
        if self._keyless:
            raise InvalidArgument("a reservation made without a key is committed with commit_as(key)")
        self._done = True
        self._native.commit()

    def abort(self) -> None:
        self._done = True
        # ``out`` is meaningless once aborted: let go of it first, so that the
        # extent is freed now unless the caller still holds a tensor of it.
        self.out = self._no_out
        self._native.abort()

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self._done:
            return
        if exc_type is None and not self._keyless:
            self.commit()
        else:
            self.abort()

    def __del__(self) -> None:
        if not getattr(self, "_done", True):
            try:
                self.abort()
            except Exception:
                pass


class Reservation(_Pending):
    """A reserved block being written: ``out`` is a writable tensor (or numpy
    array) of the block. Committed on normal exit of ``with``, aborted if the
    block raises. Do not write ``out`` after the ``with`` block: once committed
    the block is visible to readers (``out`` keeps it pinned while it lives);
    once aborted ``out`` is ``None``."""

    _no_out: Any = None

    def __init__(self, native: Any, code: int, shape: tuple, as_numpy: bool, keyless: bool = False) -> None:
        self._native = native
        buf = native.buffer()
        if as_numpy:
            self.out = numpy_from_dlpack(buf, code, shape, writeable=True)
        else:
            self.out = torch_from_dlpack(buf, code, shape)
        self._keyless = keyless
        self._done = False

    def __enter__(self) -> Any:
        return self.out

    def attach_meta(self, meta: "BlockMeta") -> None:
        """Tells the daemon what the engine knows of this block (its hash,
        parent, tokens: ``kachedb.BlockMeta``), for the KV events; before the
        commit. ``InvalidArgument`` (nothing attached) for a record out of
        bounds."""
        self._native.attach_meta(native_metas([meta])[0])

    def commit_as(self, key: KeyLike) -> None:
        """Commits the block under ``key``, whatever key it was reserved with
        (docs/PROTOCOL.md, "COMMIT and the key"), following the parent named
        at ``reserve`` if any. Pinned
        (COMMIT_PIN) while ``out`` or a tensor made from it lives, as
        ``commit``. ``Client.commit_as`` does this for many in one batch."""
        self._done = True
        self._native.commit(key)


class Reservations(_Pending):
    """Blocks reserved together by ``Client.reserve_many``: ``out`` is the list
    of writable tensors, one per key. All committed (one batch) on normal exit of
    ``with``, all aborted if the block raises. Do not write them after the
    ``with`` block."""

    _no_out: Any = ()

    def __init__(self, native: Any, code: int) -> None:
        self._native = native
        self._done = False
        self._code = code
        self._out: Any = None

    @property
    def out(self) -> Any:
        """The writable tensors, made at the first use (a batch written with
        ``write_ranges`` alone makes none)."""
        if self._out is None:
            self._out = self._no_out if self._done else writable_tensors(self._native.capsules(), self._code)
        return self._out

    @out.setter
    def out(self, value: Any) -> None:
        self._out = value

    def __len__(self) -> int:
        return len(self._native) if not self._done else len(self.out)

    def __enter__(self) -> List[Any]:
        return self.out

    def attach_meta(self, metas: Sequence[Optional["BlockMeta"]]) -> None:
        """Tells the daemon what the engine knows of each block (``metas[i]``
        for block ``i``, ``None`` for none: ``kachedb.BlockMeta``), for the KV
        events, in one native call (the records go through one scratch block
        and one batch of META frames); before the commit. ``InvalidArgument``
        (nothing attached) for a record out of bounds or a count other than
        the blocks'."""
        self._native.attach_meta(native_metas(list(metas)))

    def write_ranges(self, addresses: Sequence[int], lengths: Sequence[int], *, threads: Optional[int] = None) -> None:
        """Writes the blocks from byte ranges of this process's memory, without
        making a tensor: block ``i`` gets ``len(addresses) // len(self)``
        ranges, ``i * per`` to ``(i + 1) * per - 1``, in order (as
        ``Client.put_ranges``), in one native call with the GIL released;
        commit (or abort) as usual afterwards. ``threads``: most copying
        threads (``None``: by size, up to one per core; ``1``: the calling
        thread alone, for a copy that runs beside other work and should take
        one core).

        Raw memory: the caller vouches that each ``(addresses[i], lengths[i])``
        is readable memory of this process that stays alive and unchanged
        during the call. ``InvalidArgument`` (nothing written) for ranges that
        do not divide evenly between the blocks or add up to other than a
        block's bytes, a range overlapping one of these blocks, or blocks
        already committed or aborted."""
        if threads is not None and threads < 1:
            raise InvalidArgument(f"threads={threads}: give 1 or more, or None")
        addresses, lengths = list(addresses), list(lengths)
        if lengths and min(lengths) < 0:
            raise InvalidArgument(f"a byte range of {min(lengths)} bytes")
        self._native.fill_gathered(addresses, lengths, threads or 0)


def _batch_source(value: Any) -> tuple:
    """``put_many``'s path for a value the native layer does not read itself
    (numpy, bytes, non-contiguous or CUDA tensors): ``(code, shape, address,
    nbytes, keepalive)``."""
    if _is_tensor(value) and value.device.type != "cpu":
        value = value.detach().cpu()
    code, shape, addr, nbytes, keep = Client._source(value)
    return code, list(check_shape(shape)), addr, nbytes, keep


def _parents(keys: Sequence[KeyLike], parent: Optional[KeyLike], chain: bool) -> tuple:
    """``(keys, parents)`` of a batch: with ``chain`` each key's parent is the key
    before it (the first one's ``parent``); else every key's is ``parent``.
    ``parents`` is ``None`` when no key has one."""
    if not chain and parent is None:
        return keys, None
    keys = list(keys)
    if chain:
        return keys, [parent] + keys[:-1]
    return keys, [parent] * len(keys)


def _block_len(blocks: int, lengths: List[int]) -> int:
    """The bytes of each of ``blocks`` blocks whose byte ranges have
    ``lengths`` (shared evenly, in order): ``InvalidArgument`` if they are not
    shared evenly or the blocks' totals differ."""
    if not lengths or len(lengths) % blocks:
        raise InvalidArgument(
            f"{len(lengths)} byte ranges for {blocks} blocks: give each block the same number of ranges (at least one)"
        )
    if min(lengths) < 0:
        raise InvalidArgument(f"a byte range of {min(lengths)} bytes")
    per = len(lengths) // blocks
    totals = {sum(lengths[i : i + per]) for i in range(0, len(lengths), per)}
    if len(totals) != 1:
        raise InvalidArgument(f"the blocks' byte ranges add up to different sizes: {sorted(totals)}")
    (total,) = totals
    if total <= 0:
        raise InvalidArgument("a block of no bytes")
    return total


def _torch_codes() -> dict:
    """torch dtype -> code, for the native ``put_many`` ({} without torch)."""
    if "torch" not in sys.modules:
        return {}
    return _torch_table()[1]


class Client:
    """A connection to the daemon. Thread-safe: operations from several threads
    are serialised (the GIL is released while waiting on the daemon); use one
    client per thread for parallel throughput. A client inherited by a forked
    child raises ``Disconnected`` there: connect again in the child."""

    def __init__(self, native: Any, daemon: Optional[subprocess.Popen] = None) -> None:
        self._native = native
        self._daemon = daemon
        self._forked = False
        self._pid = os.getpid()
        _live_clients.add(self)

    # -- lifecycle ---------------------------------------------------------
    @property
    def socket(self) -> str:
        """The control socket this client is connected to."""
        return self._native.socket

    @property
    def closed(self) -> bool:
        return self._native.closed

    def close(self) -> None:
        """No new operations. Live views stay valid and pinned until collected."""
        self._native.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def started_daemon(self) -> bool:
        """Whether ``connect(start=True)`` spawned the daemon for this client."""
        return self._daemon is not None

    def stop_daemon(self, timeout: float = 10.0) -> None:
        """Stops the daemon this client started with ``connect(start=True)``."""
        if self._daemon is None:
            raise KacheDBError("this client did not start a daemon (connect(start=True) found one running)")
        self._daemon.terminate()
        try:
            self._daemon.wait(timeout)
        except subprocess.TimeoutExpired:
            self._daemon.kill()
            self._daemon.wait()

    def _check(self) -> Any:
        if self._forked or os.getpid() != self._pid:
            raise Disconnected("this client was inherited through fork(): call kachedb.connect() again in the child")
        return self._native

    def ping(self) -> None:
        self._check().ping()

    # -- writes ------------------------------------------------------------
    @staticmethod
    def _source(value: Any) -> tuple:
        """(code, shape, address, nbytes, keepalive) of a CPU tensor or array."""
        if _is_tensor(value):
            if value.device.type != "cpu":
                raise InvalidArgument("internal: non-CPU tensor reached _source")
            t = value.detach()
            if not t.is_contiguous():
                t = t.contiguous()
            code = dtype_code(t.dtype)
            return code, tuple(t.shape), t.data_ptr(), t.numel() * t.element_size(), t
        if _is_ndarray(value):
            np = _np()
            # (not np.ascontiguousarray alone: it turns a 0-D array into shape (1,))
            a = value if value.flags.c_contiguous else np.ascontiguousarray(value)
            code = dtype_code(a.dtype)
            return code, tuple(a.shape), a.ctypes.data, a.nbytes, a
        if isinstance(value, (bytes, bytearray, memoryview)):
            np = _np()
            a = np.frombuffer(value, dtype=np.uint8)
            return dtype_code("u8"), (a.nbytes,), a.ctypes.data if a.nbytes else 0, a.nbytes, a
        raise TypeError(
            f"put() takes a torch.Tensor, a numpy.ndarray or bytes, not {type(value).__name__}"
        )

    def put(self, key: KeyLike, value: Any, *, parent: Optional[KeyLike] = None) -> None:
        """Stores ``value`` (CPU or CUDA torch tensor, numpy array, or bytes)
        under ``key``: one copy into shared memory (device->shm for CUDA).
        Replaces an existing block with that key. ``parent``: the key of the
        block this one follows in a prefix chain (it must be stored first; one
        that is not there is ignored)."""
        native = self._check()
        if _is_tensor(value) and (value.device.type != "cpu" or not value.is_contiguous()):
            # torch's copy straight into the block: device->shm for CUDA, and a
            # strided CPU source without a contiguous temporary (still one copy).
            with self.reserve(key, tuple(value.shape), value.dtype, parent=parent) as out:
                out.copy_(value.detach())
            return
        code, shape, addr, nbytes, keep = self._source(value)
        check_shape(shape)
        native.put(key, code, list(shape), addr, nbytes, parent)
        del keep

    def put_many(
        self,
        keys: Sequence[KeyLike],
        values: Sequence[Any],
        *,
        parent: Optional[KeyLike] = None,
        chain: bool = False,
    ) -> None:
        """``put`` of many blocks in one native call: one batch of reservations,
        the copies (GIL released, split between threads for large batches), one
        batch of commits, in order. All or nothing: if one reservation fails,
        none is committed. ``chain=True``: the keys are a prefix chain, each
        block's parent the one before it (the first one's ``parent``); without
        it, ``parent`` is every block's parent."""
        keys, parents = _parents(keys, parent, chain)
        self._check().put_many(keys, values, _torch_codes(), _batch_source, parents)

    def reserve(
        self, key: Optional[KeyLike], shape: ShapeLike, dtype: Any, *, parent: Optional[KeyLike] = None
    ) -> Reservation:
        """Reserves a block to be written in place: ``with kc.reserve(k, shape,
        torch.float16) as out: out.copy_(src)``. ``out`` is a torch tensor, or a
        numpy array when ``dtype`` is a numpy dtype. Invisible to readers until
        committed (normal exit of ``with``); aborted if the block raises.
        ``parent`` as for ``put`` (named when the block is committed).

        ``key=None``: the key is not known yet; the block is committed with
        ``Reservation.commit_as(key)`` or ``Client.commit_as`` once it is
        (naming ``parent``, or the parent given there), and leaving ``with``
        without that aborts it."""
        native = self._check()
        dims = check_shape(shape)
        code = dtype_code(dtype)
        as_numpy = not is_torch_dtype(dtype) and not isinstance(dtype, str)
        r = native.reserve(0 if key is None else key, code, list(dims), parent)
        return Reservation(r, code, dims, as_numpy, keyless=key is None)

    def reserve_each(self, count: int, shape: ShapeLike, dtype: Any) -> List[Reservation]:
        """``count`` reservations of ``shape`` and ``dtype`` (torch) made
        without a key, in one batch (all or nothing), each finished on its own:
        ``commit_as`` names their keys (one batch for many), ``abort`` or
        dropping one gives it back."""
        native = self._check()
        dims = check_shape(shape)
        if not is_torch_dtype(dtype) and not isinstance(dtype, str):
            raise TypeError(f"reserve_each yields torch tensors: pass a torch dtype or a dtype name, not {dtype!r}")
        if count < 0:
            raise InvalidArgument(f"count must be >= 0, not {count}")
        code = dtype_code(dtype)
        return [Reservation(r, code, dims, False, keyless=True) for r in native.reserve_each(count, code, list(dims))]

    def commit_as(
        self,
        reservations: Sequence[Reservation],
        keys: Sequence[KeyLike],
        metas: Optional[Sequence[Optional["BlockMeta"]]] = None,
        parents: Optional[Sequence[Optional[KeyLike]]] = None,
    ) -> List[bool]:
        """Commits reservations of this client (from separate ``reserve``
        calls, ``key=None`` ones included) in one batch, each under its key in
        ``keys``, the key it was reserved with set aside; each is pinned while
        its ``out`` or a tensor made from it lives (COMMIT_PIN). One bool per
        reservation: committed, or refused by the daemon (it then stays
        reserved until its tensors go, and is aborted); ``Disconnected`` when
        the daemon is gone. ``InvalidArgument`` (nothing committed) if one is
        not open or the counts differ. ``metas``: each block's record
        (``kachedb.BlockMeta`` or ``None``), attached in one batch before the
        commits (a record the daemon refuses leaves its block without one).
        ``parents``: the key of the block each one follows in a prefix chain
        (or ``None``), for the daemon's chain-aware eviction (a daemon older
        than this commits them without one)."""
        self._check()
        reservations = list(reservations)
        if any(not isinstance(r, Reservation) or r._done for r in reservations):
            raise InvalidArgument("commit_as takes open reservations of Client.reserve")
        natives, keys = [r._native for r in reservations], list(keys)
        if len(keys) != len(natives):
            raise InvalidArgument(f"{len(keys)} keys to commit {len(natives)} reservations under")
        records = None
        if metas is not None:
            metas = list(metas)
            if len(metas) != len(natives):
                raise InvalidArgument(f"{len(metas)} block metadata records for {len(natives)} reservations")
            records = native_metas(metas) if any(m is not None for m in metas) else None
        if parents is not None:
            parents = list(parents)
            if len(parents) != len(natives):
                raise InvalidArgument(f"{len(parents)} parents for {len(natives)} reservations")
            if all(p is None for p in parents):
                parents = None
        try:
            done = _native.commit_reservations(natives, keys, records, parents)
        except (TypeError, InvalidArgument):
            raise  # refused before anything was sent: still open
        except BaseException:
            for r in reservations:
                r._done = True  # handed to the native side (aborted with their tensors)
            raise
        for r in reservations:
            r._done = True
        return done

    def reserve_many(
        self,
        keys: Sequence[KeyLike],
        shape: ShapeLike,
        dtype: Any,
        *,
        parent: Optional[KeyLike] = None,
        chain: bool = False,
        parents: Optional[Sequence[Optional[KeyLike]]] = None,
    ) -> Reservations:
        """Reserves one block of ``shape`` and ``dtype`` (a torch dtype or a
        name) per key in one batch: ``with kc.reserve_many(keys, shape,
        torch.float16) as outs: ...`` yields a list of writable torch tensors,
        committed together (one batch, in order) on normal exit, all aborted if
        the block raises. All or nothing: if one reservation fails
        (``OutOfMemory``…), none is kept. ``parent`` and ``chain`` as for
        ``put_many``; or ``parents``: each block's own (a key or ``None``),
        named at its COMMIT (a parent links only if the daemon holds it then)."""
        native = self._check()
        if parents is not None:
            if parent is not None or chain:
                raise InvalidArgument("give parents, or parent and chain, not both")
            keys, parents = list(keys), list(parents)
            if len(parents) != len(keys):
                raise InvalidArgument(f"{len(parents)} parents for {len(keys)} keys")
        else:
            keys, parents = _parents(keys, parent, chain)
        dims = check_shape(shape)
        if not is_torch_dtype(dtype) and not isinstance(dtype, str):
            raise TypeError(
                f"reserve_many yields torch tensors: pass a torch dtype or a dtype name, not {dtype!r}"
            )
        code = dtype_code(dtype)
        return Reservations(native.reserve_many(keys, code, list(dims), parents), code)

    def put_ranges(
        self,
        keys: Sequence[KeyLike],
        addresses: Sequence[int],
        lengths: Sequence[int],
        *,
        parent: Optional[KeyLike] = None,
        chain: bool = False,
    ) -> None:
        """Stores one flat ``uint8`` block per key, each gathered from
        ``len(addresses) // len(keys)`` byte ranges of this process's memory in
        order (block ``i`` is ranges ``i * per`` to ``(i + 1) * per - 1``): one
        batch, one copy of each byte (threads for large batches, GIL released),
        no staging buffer. For an engine's KV pages whose bytes lie in pieces
        (one range per layer). All or nothing, as ``put_many``; ``parent`` and
        ``chain`` as there.

        Raw memory: the caller vouches that each ``(addresses[i], lengths[i])``
        is readable memory of this process (a CPU tensor's ``data_ptr()`` and
        bytes) that stays alive and unchanged during the call.
        ``InvalidArgument`` (nothing stored) for uneven ranges or a block whose
        ranges differ in total from the others'. Each block is under 4 GiB."""
        native = self._check()
        keys, parents = _parents(keys, parent, chain)
        keys, addresses, lengths = list(keys), list(addresses), list(lengths)
        if not keys:
            if addresses:
                raise InvalidArgument(f"{len(addresses)} byte ranges for 0 blocks")
            return
        block_len = _block_len(len(keys), lengths)
        native.put_ranges(keys, dtype_code("uint8"), [block_len], addresses, lengths, parents)

    def get_prefix_into(self, keys: Sequence[KeyLike], addresses: Sequence[int], lengths: Sequence[int]) -> int:
        """Copies the leading present keys of ``keys`` (as ``get_prefix``, one
        round trip, each pinned while it is read) into ``len(addresses) //
        len(keys)`` byte ranges each, in order, and releases the pins at once:
        ``put_ranges``'s inverse. Stops at the first missing key, or at the
        first block that is not ``uint8`` of the ranges' total bytes (its
        ranges are left as they were). Returns how many blocks were copied.

        Raw memory: the caller vouches that each range is writable memory of
        this process that nothing else reads or writes during the call, and
        none of it another client's mapping of a store. Ranges that overlap one
        another or this client's mapping of the shared region are refused
        (``InvalidArgument``, nothing read)."""
        native = self._check() if self._forked else self._native
        keys, addresses, lengths = list(keys), list(addresses), list(lengths)
        if not keys:
            if addresses:
                raise InvalidArgument(f"{len(addresses)} byte ranges for 0 blocks")
            return 0
        block_len = _block_len(len(keys), lengths)
        return native.get_prefix_into(keys, dtype_code("uint8"), block_len, addresses, lengths)

    # -- reads -------------------------------------------------------------
    @staticmethod
    def _on(view: Any, device: Any) -> Any:
        """``view`` (a ``KVView``), or a copy of it on ``device``."""
        if device is not None and str(device) != "cpu":
            # The copy holds no pin: the view's goes with it, as soon as it is made.
            return view.as_subclass(_torch().Tensor).to(device)
        return view

    def get(self, key: KeyLike, *, device: Any = None) -> Any:
        """The block under ``key`` as a read-only-by-contract ``torch.Tensor`` view
        of shared memory (no copy), pinned while it (or anything made from it)
        lives; usable as ``with kc.get(k) as t``. With ``device="cuda"`` the block
        is copied to the device and the pin dropped at once. Raises ``NotFound``."""
        # One native call: the key mapped, the round trip, the view. (A fork
        # that bypassed the at-fork handler is caught natively too.)
        t = (self._check() if self._forked else self._native).get_view(key)
        if t is None:
            raise NotFound(f"no block with key {key!r}")
        return self._on(t, device)

    def get_numpy(self, key: KeyLike) -> Any:
        """The block as a read-only numpy array view (no copy); the array holds the
        pin. bfloat16/float8 blocks need torch (``get``). Raises ``NotFound``."""
        block = self._check().get(key)
        if block is None:
            raise NotFound(f"no block with key {key!r}")
        return numpy_from_dlpack(block.buffer(), block.dtype_code, block.shape)

    def get_many(self, keys: Sequence[KeyLike], *, device: Any = None) -> List[Any]:
        """``get`` of many keys in one batch; ``None`` for each missing key."""
        views = (self._check() if self._forked else self._native).get_many_views(keys)
        return views if device is None else [None if v is None else self._on(v, device) for v in views]

    def get_prefix(self, keys: Sequence[KeyLike], *, device: Any = None, pin_each: bool = False) -> List[Any]:
        """Views of the leading present keys of ``keys`` (a prefix hash chain),
        in one round trip: each key is looked up and pinned at once, so no block
        can be evicted in between. Stops at the first missing key (the pins
        taken past it are released).

        The views of one call share their pins: every block of the call stays
        pinned while any of its views, or any tensor derived from one, lives;
        the last one gone releases them all at once (one post to the daemon,
        not one per view). A view is thus never left unpinned, but holding one
        keeps the call's other blocks pinned too. ``pin_each=True``: each view
        holds only its own block's pin, as ``get``'s does (released one by
        one: slower), for a caller that keeps some views long and drops
        others."""
        native = self._check() if self._forked else self._native
        views = native.get_prefix_views(keys, bool(pin_each))
        return views if device is None else [self._on(v, device) for v in views]

    def wait_for(self, key: KeyLike, timeout: Optional[float] = None, *, device: Any = None) -> Any:
        """The block under ``key`` as ``get`` returns it, once it is committed
        (by this or another process): at once if it is there. The daemon parks
        the request until a commit of ``key`` (no polling); ``timeout`` seconds
        (``None``: forever) raise ``TimedOut`` (a ``KacheDBError`` and a
        ``TimeoutError``). While it waits, this client's other operations (from
        other threads) wait too; the wait is not interrupted by Ctrl-C before its
        timeout."""
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
                raise TypeError(f"timeout must be a number of seconds or None, not {type(timeout).__name__}")
            if not timeout >= 0:
                raise InvalidArgument(f"timeout must be >= 0 seconds or None, got {timeout}")
        view = self._check().wait_for_view(key, None if timeout is None else float(timeout))
        return self._on(view, device)

    def lookup(self, keys: Sequence[KeyLike]) -> int:
        """How many leading keys of ``keys`` are present (a prefix hash chain)."""
        return self._check().lookup(keys)

    def contains(self, key: KeyLike) -> bool:
        return self.lookup([key]) == 1

    def __contains__(self, key: KeyLike) -> bool:
        return self.contains(key)

    def delete(self, key: KeyLike) -> bool:
        """Unlinks ``key``; returns whether it was present. Live views of it stay
        valid; its memory is freed when the last goes."""
        return self._check().delete(key)

    def delete_many(self, keys: Sequence[KeyLike]) -> int:
        """``delete`` of many keys in one batch; returns how many were present."""
        return self._check().delete_many(keys)

    def stats(self) -> dict:
        """The daemon's counters: blocks, bytes_used/free/total, pins, reserved,
        clients_connected, evictions, rejected_frames, ops_per_s, …"""
        import json

        native = self._check()
        if native.closed:  # stats go over the control socket, not the closed channel
            raise Disconnected("disconnected: the client is closed: connect again")
        return json.loads(native.stats_json())

    # -- CUDA --------------------------------------------------------------
    def register_cuda(self) -> None:
        """Registers the whole shared-memory region with CUDA (``cudaHostRegister``
        through torch) so device<->shm copies run as pinned-memory DMA."""
        torch = _torch()
        if not torch.cuda.is_available():
            raise KacheDBError("register_cuda() needs a CUDA device; torch.cuda.is_available() is False")
        addr, nbytes = self._check().region_span()
        err = torch.cuda.cudart().cudaHostRegister(addr, nbytes, 0)
        if int(err) != 0:
            raise KacheDBError(f"cudaHostRegister of {nbytes} bytes failed with CUDA error {int(err)}")

    def __repr__(self) -> str:
        return f"<kachedb.Client socket={self.socket!r} closed={self.closed}>"
