"""The transports: one ``Side`` class per transport (producer and consumer
ends, each in its own process), the child processes' entry point and the
parent's handle on them (``Peer``)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import struct
import time
import traceback
import warnings
from typing import Any, Dict, Optional, Tuple

from .cases import Case, MIB, Payload, digest, import_torch, usable


#: The transports, in the order they run (KacheDB first: the others are compared with it).
TRANSPORTS = ["kachedb", "tcp", "uds", "shm", "torch_mp", "ray", "redis"]
TITLES = {
    "kachedb": "KacheDB",
    "tcp": "TCP loopback",
    "uds": "Unix socket",
    "shm": "mp.shared_memory",
    "torch_mp": "torch.multiprocessing",
    "ray": "Ray object store",
    "redis": "Redis",
}
REDIS_CHUNK = 1 * MIB  # values above this are split into 1 MiB keys
REDIS_BATCH_BYTES = 64 * MIB
TORCH_MP_BATCH = 2000  # tensors per Queue.put (2 fds each in flight; RLIMIT_NOFILE is often 20000)
SHM_PREFIX = "kcmp"
RPC_TIMEOUT = 300.0


def single_threaded_torch() -> None:
    """One intra-op thread per process: producer and consumer already share the
    cores, and torch's default (an OpenMP thread per core, spinning) made small
    copies 10-100x slower on a busy 2-core machine."""
    with contextlib.suppress(Exception):
        import_torch().set_num_threads(1)


def quiet_warnings() -> None:
    warnings.filterwarnings("ignore", message=".*not writable.*")
    warnings.filterwarnings("ignore", message=".*non-writable.*")
    warnings.filterwarnings("ignore", category=UserWarning, module="torch")


def _recv_exact(sock: socket.socket, mv: memoryview) -> None:
    got, n = 0, len(mv)
    while got < n:
        k = sock.recv_into(mv[got:])
        if k == 0:
            raise ConnectionError("peer closed the socket mid-transfer")
        got += k


def _u8(t: Any) -> Any:
    return t.reshape(-1).view(import_torch().uint8)


class Side:
    """One end (role ``producer`` or ``consumer``) of one transport, living in its
    own process. ``link`` is a duplex pipe between the producer and the consumer
    (side channel for keys/metadata/acks); ``queue`` is a torch.multiprocessing
    Queue (torch_mp only)."""

    def __init__(self, role: str, cfg: dict, link: Any, queue: Any) -> None:
        self.role, self.cfg, self.link, self.queue = role, cfg, link, queue
        self.case: Optional[Case] = None
        self.hold: Any = None

    # lifecycle
    def open(self) -> dict:
        return {}

    private_copies = False  # the producer hands over new private tensors each repetition

    def set_case(self, d: dict) -> None:
        self.case = Case.from_dict(d)
        if self.role == "producer":
            self.payload = Payload(self.case)

    def end_case(self) -> None:
        self.case = None
        self.payload = None

    def close(self) -> None:
        pass

    # one repetition
    def rep(self, rep: int) -> dict:
        if self.role == "producer":
            ts = self.payload.next(self.private_copies)
            expect = digest(ts)
            t0 = time.perf_counter()
            self.send(ts, rep)
            tp = time.perf_counter()
            self.notify(rep)
            self.hold = ts
            return {"t0": t0, "tp": tp, "digest": expect}
        tc0, outs = self.recv(rep)
        t1 = time.perf_counter()
        usable(outs, self.case)
        d0 = time.perf_counter()
        got = digest(outs)
        touch = time.perf_counter() - d0
        del outs
        self.release()
        return {"tc0": tc0, "t1": t1, "digest": got, "touch_s": touch}

    def end_rep(self) -> None:
        self.hold = None

    # per transport
    def send(self, ts: list, rep: int) -> None:
        raise NotImplementedError

    def notify(self, rep: int) -> None:
        pass

    def recv(self, rep: int) -> Tuple[float, list]:
        raise NotImplementedError

    def release(self) -> None:
        pass


class KacheDBSide(Side):
    def open(self) -> dict:
        import kachedb

        self.kc = kachedb.connect(socket=self.cfg["socket"])
        return {}

    def set_case(self, d: dict) -> None:
        super().set_case(d)
        self.keys = [f"compare/{self.case.label}/{i}" for i in range(self.case.count)]

    def send(self, ts: list, rep: int) -> None:
        # put_many: one native call for the batch (one RESERVE batch, the copies
        # split between threads with the GIL released, one COMMIT batch).
        if len(ts) == 1:
            self.kc.put(self.keys[0], ts[0])
        else:
            self.kc.put_many(self.keys, ts)

    def notify(self, rep: int) -> None:
        self.link.send(rep)  # KacheDB has no "wait for key": tell the consumer over a pipe

    def recv(self, rep: int) -> Tuple[float, list]:
        got = self.link.recv()
        tc0 = time.perf_counter()
        if got != rep:
            raise AssertionError(f"notification for rep {got}, expected {rep}")
        if len(self.keys) == 1:
            return tc0, [self.kc.get(self.keys[0])]
        # One round trip of GETs, every view pinned (all keys are present).
        outs = self.kc.get_prefix(self.keys)
        if len(outs) != len(self.keys):
            raise AssertionError(f"{len(outs)} of {len(self.keys)} blocks present")
        return tc0, outs

    def end_case(self) -> None:
        if self.role == "producer":
            self.kc.delete_many(self.keys)
        super().end_case()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.kc.close()


class StreamSide(Side):
    """Raw bytes plus a 24-byte header over a stream socket; the receiver copies
    into preallocated tensors (allocated and faulted in once per size)."""

    HDR = struct.Struct("<QQQ")

    def _family(self) -> int:
        return socket.AF_INET

    def open(self) -> dict:
        self.conn: Optional[socket.socket] = None
        if self.role == "consumer":
            self.lsock = socket.socket(self._family(), socket.SOCK_STREAM)
            self.lsock.bind(self._bind_addr())
            self.lsock.listen(1)
            return {"addr": self.lsock.getsockname()}
        return {}

    def _bind_addr(self) -> Any:
        return ("127.0.0.1", 0)

    def connect(self, addr: Any) -> None:
        s = socket.socket(self._family(), socket.SOCK_STREAM)
        s.connect(tuple(addr) if isinstance(addr, list) else addr)
        if self._family() == socket.AF_INET:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.conn = s

    def set_case(self, d: dict) -> None:
        super().set_case(d)
        if self.role == "consumer":
            if self.conn is None:
                self.conn, _ = self.lsock.accept()
                if self._family() == socket.AF_INET:
                    self.conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            torch = import_torch()
            self.bufs = [torch.zeros(self.case.shape, dtype=torch.float16) for _ in range(self.case.count)]
            self.views = [memoryview(_u8(b).numpy()) for b in self.bufs]
            self.hdr = bytearray(self.HDR.size)

    def end_case(self) -> None:
        self.bufs = self.views = None
        super().end_case()

    def send(self, ts: list, rep: int) -> None:
        c = self.conn
        c.sendall(self.HDR.pack(rep, len(ts), self.case.nbytes))
        for t in ts:
            c.sendall(_u8(t).numpy())

    def recv(self, rep: int) -> Tuple[float, list]:
        _recv_exact(self.conn, memoryview(self.hdr))
        tc0 = time.perf_counter()
        r, n, nb = self.HDR.unpack(self.hdr)
        if (r, n, nb) != (rep, self.case.count, self.case.nbytes):
            raise AssertionError(f"header {(r, n, nb)}")
        for v in self.views:
            _recv_exact(self.conn, v)
        return tc0, list(self.bufs)

    def close(self) -> None:
        for s in (getattr(self, "conn", None), getattr(self, "lsock", None)):
            if s is not None:
                with contextlib.suppress(Exception):
                    s.close()


class UdsSide(StreamSide):
    def _family(self) -> int:
        return socket.AF_UNIX

    def _bind_addr(self) -> Any:
        return self.cfg["uds_path"]


class ShmSide(Side):
    """multiprocessing.shared_memory: the producer creates one segment per handoff
    (all blocks of a batch packed in it) and copies in; (name, shape, dtype,
    count) pickled over a pipe; the consumer attaches and wraps it with
    torch.frombuffer (zero-copy)."""

    def send(self, ts: list, rep: int) -> None:
        from multiprocessing import shared_memory

        torch = import_torch()
        nb = self.case.nbytes
        self.seg = shared_memory.SharedMemory(name=f"{SHM_PREFIX}_{os.getpid()}_{rep}", create=True, size=nb * len(ts))
        dst = torch.frombuffer(self.seg.buf, dtype=torch.uint8)
        for i, t in enumerate(ts):
            dst[i * nb:(i + 1) * nb].copy_(_u8(t))
        del dst

    def notify(self, rep: int) -> None:
        self.link.send((self.seg.name, rep, self.case.count, self.case.shape, "float16"))

    def recv(self, rep: int) -> Tuple[float, list]:
        from multiprocessing import shared_memory

        meta = self.link.recv()
        tc0 = time.perf_counter()
        name, r, count, shape, dtype = meta
        if r != rep:
            raise AssertionError(f"metadata for rep {r}, expected {rep}")
        torch = import_torch()
        self.seg = shared_memory.SharedMemory(name=name)
        base = torch.frombuffer(self.seg.buf, dtype=getattr(torch, dtype))
        per = base.numel() // count
        return tc0, [base[i * per:(i + 1) * per].view(shape) for i in range(count)]

    def release(self) -> None:
        seg, self.seg = self.seg, None
        seg.close()

    def end_rep(self) -> None:
        super().end_rep()
        seg = getattr(self, "seg", None)
        if seg is not None and self.role == "producer":
            self.seg = None
            seg.close()
            seg.unlink()

    def close(self) -> None:
        seg = getattr(self, "seg", None)
        if seg is not None:
            with contextlib.suppress(Exception):
                seg.close()
            if self.role == "producer":
                with contextlib.suppress(Exception):
                    seg.unlink()


class TorchMpSide(Side):
    """torch.multiprocessing Queue: the producer moves each tensor's storage to
    shared memory (``share_memory_()``, what ``Queue.put`` would do in its feeder
    thread) and puts it; the consumer's ``get`` maps the storages. Default sharing
    strategy (file_descriptor): two fds per tensor in flight, so more than
    TORCH_MP_BATCH tensors go in batches, each acknowledged over the pipe.
    ``share_memory_`` moves a storage once, so each repetition hands over new
    private copies (made untimed)."""

    private_copies = True

    def send(self, ts: list, rep: int) -> None:
        for t in ts:
            t.share_memory_()
        if len(ts) == 1:
            self.queue.put(ts[0])
            return
        for i in range(0, len(ts), TORCH_MP_BATCH):
            if i:
                self.link.recv()  # ack of the previous batch: bounds fds in flight
            self.queue.put(ts[i:i + TORCH_MP_BATCH])

    def recv(self, rep: int) -> Tuple[float, list]:
        q = self.queue
        q._reader.poll(None)  # wait for the first item; its unpickling is consumer time
        tc0 = time.perf_counter()
        first = q.get()
        if not isinstance(first, list):
            return tc0, [first]
        outs = list(first)
        while len(outs) < self.case.count:
            self.link.send(len(outs))
            outs.extend(q.get())
        return tc0, outs


class RedisSide(Side):
    """redis-py SET/GET against a local redis-server. A tensor above 1 MiB is split
    into 1 MiB keys (pipelined SETs; MGET copied into a preallocated tensor); a
    smaller one is one key (pipelined SETs; MGET, then torch.frombuffer over the
    returned bytes, no further copy)."""

    def open(self) -> dict:
        import redis
        from redis.utils import HIREDIS_AVAILABLE

        self.r = redis.Redis(host="127.0.0.1", port=self.cfg["redis_port"])
        self.r.ping()
        return {"hiredis": bool(HIREDIS_AVAILABLE)}

    def set_case(self, d: dict) -> None:
        super().set_case(d)
        c = self.case
        self.chunks = -(-c.nbytes // REDIS_CHUNK)  # keys per tensor
        self.keys = [f"cmp:{c.label}:{i}:{j}" for i in range(c.count) for j in range(self.chunks)]
        if self.chunks > 1 and self.role == "consumer":
            torch = import_torch()
            self.bufs = [torch.zeros(c.shape, dtype=torch.float16) for _ in range(c.count)]
            self.bufvs = [_u8(b).numpy() for b in self.bufs]
        self.per_batch = max(1, min(1000, REDIS_BATCH_BYTES // min(c.nbytes, REDIS_CHUNK)))

    def send(self, ts: list, rep: int) -> None:
        pipe = self.r.pipeline(transaction=False)
        n, k = 0, 0
        for t in ts:
            mv = memoryview(_u8(t).numpy())
            for j in range(self.chunks):
                pipe.set(self.keys[k], mv[j * REDIS_CHUNK:(j + 1) * REDIS_CHUNK])
                k += 1
                n += 1
                if n == self.per_batch:
                    pipe.execute()
                    n = 0
        if n:
            pipe.execute()

    def notify(self, rep: int) -> None:
        self.link.send(rep)

    def recv(self, rep: int) -> Tuple[float, list]:
        got = self.link.recv()
        tc0 = time.perf_counter()
        if got != rep:
            raise AssertionError(f"notification for rep {got}, expected {rep}")
        torch = import_torch()
        keys, b, shape = self.keys, self.per_batch, self.case.shape
        if self.chunks == 1:
            outs = []
            for i in range(0, len(keys), b):
                for v in self.r.mget(keys[i:i + b]):
                    outs.append(torch.frombuffer(v, dtype=torch.float16).view(shape))
            return tc0, outs
        nb, k, off = self.case.nbytes, 0, 0
        for i in range(0, len(keys), b):
            for v in self.r.mget(keys[i:i + b]):
                dst = self.bufvs[k // self.chunks]
                dst[off:off + len(v)] = memoryview(v)
                off += len(v)
                k += 1
                if k % self.chunks == 0:
                    if off != nb:
                        raise AssertionError(f"redis returned {off} bytes for a tensor of {nb}")
                    off = 0
        return tc0, list(self.bufs)

    def end_case(self) -> None:
        if self.role == "producer":
            for i in range(0, len(self.keys), 1000):
                self.r.unlink(*self.keys[i:i + 1000])
        self.bufs = self.bufvs = None
        super().end_case()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.r.close()


SIDES: Dict[str, type] = {
    "kachedb": KacheDBSide,
    "tcp": StreamSide,
    "uds": UdsSide,
    "shm": ShmSide,
    "torch_mp": TorchMpSide,
    "redis": RedisSide,
}


def _child_main(role: str, tname: str, cfg: dict, ctl: Any, link: Any, queue: Any) -> None:
    """Entry point of a producer/consumer process: serves ``ctl`` requests."""
    quiet_warnings()
    single_threaded_torch()
    with contextlib.suppress(Exception):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    set_pdeathsig()
    side = SIDES[tname](role, cfg, link, queue)
    try:
        try:
            ctl.send(("ok", side.open()))
        except BaseException:
            ctl.send(("err", traceback.format_exc()))
            return
        while True:
            try:
                msg = ctl.recv()
            except EOFError:
                return
            op, args = msg[0], msg[1:]
            if op == "quit":
                ctl.send(("ok", None))
                return
            try:
                fn = {"case": side.set_case, "rep": side.rep, "end_rep": side.end_rep,
                      "end_case": side.end_case, "connect": getattr(side, "connect", None)}[op]
                ctl.send(("ok", fn(*args)))
            except BaseException:
                ctl.send(("err", traceback.format_exc()))
    finally:
        side.close()


def set_pdeathsig() -> None:
    """Linux: get SIGTERM when the parent dies, so nothing outlives a killed run."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # PR_SET_PDEATHSIG


class TransportError(RuntimeError):
    pass


class Peer:
    """The parent's handle on one child process."""

    def __init__(self, ctx: Any, role: str, tname: str, cfg: dict, link: Any, queue: Any) -> None:
        self.role = role
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_child_main, args=(role, tname, cfg, child_conn, link, queue),
                                name=f"kachedb-compare-{tname}-{role}", daemon=True)
        self.proc.start()
        child_conn.close()

    def send(self, *msg: Any) -> None:
        self.conn.send(msg)

    def result(self, timeout: float = RPC_TIMEOUT) -> Any:
        if not self.conn.poll(timeout):
            raise TransportError(f"{self.role} did not answer within {timeout:.0f} s")
        try:
            status, val = self.conn.recv()
        except EOFError:
            raise TransportError(f"{self.role} died (exit code {self.proc.exitcode})") from None
        if status != "ok":
            raise TransportError(f"{self.role} failed:\n{val}")
        return val

    def call(self, *msg: Any, timeout: float = RPC_TIMEOUT) -> Any:
        self.send(*msg)
        return self.result(timeout)

    def stop(self) -> None:
        if self.proc.is_alive():
            with contextlib.suppress(Exception):
                self.conn.send(("quit",))
                if self.conn.poll(20):
                    self.conn.recv()
            self.proc.join(20)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)
        self.conn.close()
