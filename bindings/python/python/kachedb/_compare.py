"""``python -m kachedb bench compare`` (also ``benchmarks/compare.py``): hand a KV
tensor from one process to another through KacheDB and through the transports a
user would otherwise pick, on the same machine, with the same tensors.

For every transport and size, a long-lived *producer* process makes a fresh
private tensor (untimed), then hands it over; a long-lived *consumer* process
ends up with a usable ``torch.Tensor`` of it and verifies it (a strided checksum
over every page plus the first and last words, compared with the producer's).
Times come from ``time.perf_counter`` (CLOCK_MONOTONIC, system-wide on Linux):

* ``producer_s``: producer start -> its handoff call(s) returned;
* ``consumer_s``: the consumer saw the first sign of the data (metadata or
  header arrived, ref/queue item ready) -> it holds the tensor(s);
* ``handoff_s``: producer start -> consumer holds the tensor(s) (end to end);
* ``touch_s``: the consumer's first read of every page afterwards (page faults
  of a fresh mapping land here, not in ``handoff_s``).

Medians over several repetitions after a warm-up. The run cleans up every
process and shared-memory segment it made and checks that it did.
``KACHEDB_COMPARE_DEBUG=1`` prints every repetition's times.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import platform
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30

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
FULL_SIZES = "64KiBx10000,64MiB,512MiB,2GiB"
QUICK_SIZES = "64KiBx200,64MiB"
SAMPLE_STRIDE = 509  # int64 words: 4072 bytes, so every 4 KiB page is read
REDIS_CHUNK = 1 * MIB  # values above this are split into 1 MiB keys
REDIS_BATCH_BYTES = 64 * MIB
TORCH_MP_BATCH = 2000  # tensors per Queue.put (2 fds each in flight; RLIMIT_NOFILE is often 20000)
SHM_PREFIX = "kcmp"
RPC_TIMEOUT = 300.0


# --------------------------------------------------------------------------- cases
class Case:
    """``count`` tensors of ``nbytes`` each, f16 KV-shaped (k/v, layers, kv heads,
    tokens, head dim) like a Llama-3-8B cache: 4 KiB per token per layer."""

    def __init__(self, label: str, nbytes: int, count: int) -> None:
        if nbytes <= 0 or nbytes % 4096:
            raise ValueError(f"size {label!r}: bytes per tensor must be a positive multiple of 4 KiB")
        if count <= 0:
            raise ValueError(f"size {label!r}: count must be positive")
        self.label, self.nbytes, self.count = label, nbytes, count
        pages = nbytes // 4096
        layers = 32 if pages % 32 == 0 and pages >= 32 * 16 else 1
        self.shape = (2, layers, 8, pages // layers, 128)

    @property
    def total(self) -> int:
        return self.nbytes * self.count

    def to_dict(self) -> dict:
        return {"label": self.label, "nbytes": self.nbytes, "count": self.count}

    @classmethod
    def from_dict(cls, d: dict) -> "Case":
        return cls(d["label"], d["nbytes"], d["count"])


_UNITS = {"": 1, "b": 1, "k": KIB, "kb": KIB, "kib": KIB, "m": MIB, "mb": MIB, "mib": MIB, "g": GIB, "gb": GIB, "gib": GIB}


def parse_size(spec: str) -> Case:
    """``64MiB``, ``2GiB``, ``64KiBx10000`` (10 000 tensors of 64 KiB)."""
    s = spec.strip()
    count = 1
    if "x" in s.lower():
        s, c = s.lower().split("x", 1)
        count = int(c.replace("_", ""))
    num = s.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = s[len(num):].lower()
    if unit not in _UNITS or not num:
        raise ValueError(f"cannot parse size {spec!r} (e.g. 64MiB, 2GiB, 64KiBx10000)")
    nbytes = int(float(num) * _UNITS[unit])
    return Case(spec.strip(), nbytes, count)


def fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= div:
            v = n / div
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_time(s: Optional[float]) -> str:
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "–"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1.0:
        return f"{s * 1e3:.3g} ms" if s < 0.1 else f"{s * 1e3:.0f} ms"
    return f"{s:.2f} s"


def fmt_ratio(r: float) -> str:
    """``2.3×``; two decimals near 1 so that 0.97× does not read as a tie."""
    return f"{r:.2f}×" if r < 1.1 else f"{r:.1f}×"


def case_title(c: Case) -> str:
    return f"{fmt_bytes(c.nbytes)} ×{c.count:,}".replace(",", " ") if c.count > 1 else fmt_bytes(c.nbytes)


# --------------------------------------------------------------------------- payload
def _torch():
    import torch

    return torch


def make_payload(case: Case) -> list:
    """``case.count`` separate private tensors (one storage each) of words that
    depend on their position."""
    torch = _torch()
    words = case.nbytes // 8
    big = torch.arange(words * case.count, dtype=torch.int64)
    big.mul_(0x5851F42D4C957F2D).add_(12345)
    if case.count == 1:
        return [big.view(torch.float16).view(case.shape)]
    rows = big.view(case.count, words)
    return [rows[i].clone().view(torch.float16).view(case.shape) for i in range(case.count)]


class Payload:
    """The producer's tensors: allocated and filled once per size (like a model's
    KV cache, resident and warm), then changed in place before every repetition
    so that every word differs from the previous repetition's (stale or partial
    data fails the check)."""

    DELTA = 0x9E3779B97F4A7C1

    def __init__(self, case: Case) -> None:
        self.case = case
        self.ts = make_payload(case)

    def next(self, private_copies: bool = False) -> list:
        torch = _torch()
        for t in self.ts:
            t.view(-1).view(torch.int64).add_(self.DELTA)
        if private_copies:  # new private memory (torch.multiprocessing moves it to shm)
            return [t.clone() for t in self.ts]
        return list(self.ts)


def digest(tensors: Sequence[Any]) -> int:
    """A checksum that reads every 4 KiB page of every tensor: per tensor, the sum
    of a strided sample of int64 words (the first word included) and the last
    word, combined with position weights so that order matters too."""
    torch = _torch()
    if not tensors:
        return 0
    us = [t.reshape(-1).view(torch.int64) for t in tensors]
    samples = torch.stack([u[::SAMPLE_STRIDE] for u in us])  # copies the samples: reads every page
    lasts = torch.stack([u[-1] for u in us])
    w = torch.arange(1, len(us) + 1, dtype=torch.int64)
    a = int((samples.sum(dim=1) * w).sum())
    b = int((samples[:, 0] * (3 * w + 1)).sum())
    c = int((lasts * (7 * w + 5)).sum())
    mask = (1 << 64) - 1
    return ((a & mask) * 0x100000001B3 ^ (b & mask) << 1 ^ (c & mask)) & mask


def usable(tensors: Sequence[Any], case: Case) -> None:
    torch = _torch()
    if len(tensors) != case.count:
        raise AssertionError(f"consumer got {len(tensors)} tensors, expected {case.count}")
    for t in tensors:
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != case.shape or t.dtype != torch.float16:
            raise AssertionError(f"consumer got {type(t).__name__} {getattr(t, 'shape', None)} {getattr(t, 'dtype', None)}")


def _single_threaded_torch() -> None:
    """One intra-op thread per process: producer and consumer already share the
    cores, and torch's default (an OpenMP thread per core, spinning) made small
    copies 10-100x slower on a busy 2-core machine."""
    with contextlib.suppress(Exception):
        _torch().set_num_threads(1)


def _quiet_warnings() -> None:
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
    return t.reshape(-1).view(_torch().uint8)


# --------------------------------------------------------------------------- sides
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
        return tc0, self.kc.get_many(self.keys)

    def end_case(self) -> None:
        if self.role == "producer":
            for k in self.keys:
                self.kc.delete(k)
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
            torch = _torch()
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

        torch = _torch()
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
        torch = _torch()
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
            torch = _torch()
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
        torch = _torch()
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
    _quiet_warnings()
    _single_threaded_torch()
    with contextlib.suppress(Exception):
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when to stop
    _set_pdeathsig()
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


def _set_pdeathsig() -> None:
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


# --------------------------------------------------------------------------- services
class Services:
    """Servers the transports need, started on demand and stopped after use."""

    def __init__(self, tmp: str, log: Callable[[str], None]) -> None:
        self.tmp, self.log = tmp, log
        self.kdb: Any = None
        self.redis: Optional[subprocess.Popen] = None
        self.redis_port: Optional[int] = None
        self.ray_up = False

    def start_kachedb(self, max_total: int) -> dict:
        import kachedb

        size = _round_up(2 * max_total + 256 * MIB, 2 * MIB)
        sock = os.path.join(self.tmp, "kdb", "kachedb.sock")
        os.makedirs(os.path.dirname(sock), mode=0o700, exist_ok=True)
        self.kdb = kachedb.connect(socket=sock, start=True, size=size, timeout=120)
        if not self.kdb.started_daemon:
            raise TransportError(f"a daemon already listened on {sock}")
        self.log(f"  kachedb daemon: private socket {sock}, region {fmt_bytes(size)}")
        return {"socket": sock, "region_bytes": size}

    def stop_kachedb(self) -> None:
        kc, self.kdb = self.kdb, None
        if kc is not None:
            with contextlib.suppress(Exception):
                kc.close()
            kc.stop_daemon(timeout=30)

    def start_redis(self, max_total: int) -> dict:
        exe = shutil.which("redis-server")
        if exe is None:
            raise TransportError("redis-server is not installed (apt-get install -y redis-server)")
        import redis

        maxmem = _round_up(2 * max_total + 512 * MIB, MIB)
        rdir = os.path.join(self.tmp, "redis")
        os.makedirs(rdir, exist_ok=True)
        last = ""
        for _ in range(5):
            port = _free_port()
            argv = [exe, "--bind", "127.0.0.1", "--port", str(port), "--protected-mode", "yes",
                    "--save", "", "--appendonly", "no", "--maxmemory", str(maxmem),
                    "--maxmemory-policy", "noeviction", "--dir", rdir,
                    "--logfile", os.path.join(rdir, "redis.log"), "--daemonize", "no"]
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, preexec_fn=_set_pdeathsig)
            r = redis.Redis(host="127.0.0.1", port=port)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    r.ping()
                    r.close()
                    self.redis, self.redis_port = proc, port
                    self.log(f"  redis-server {_redis_version(exe)} on 127.0.0.1:{port}, maxmemory {fmt_bytes(maxmem)}")
                    return {"redis_port": port, "redis_maxmemory": maxmem}
                except Exception as e:  # not up yet
                    last = str(e)
                    time.sleep(0.05)
            r.close()
            _stop_popen(proc)
        raise TransportError(f"redis-server did not start: {last}")

    def stop_redis(self) -> None:
        p, self.redis = self.redis, None
        if p is not None:
            _stop_popen(p)

    def start_ray(self, max_total: int) -> dict:
        import logging

        import ray

        store = max(_round_up(2 * max_total + 256 * MIB, MIB), 128 * MIB)
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        tdir = os.path.join(self.tmp, "ray")
        os.makedirs(tdir, exist_ok=True)
        ray.init(num_cpus=max(2, os.cpu_count() or 2), num_gpus=0, object_store_memory=store,
                 include_dashboard=False, _temp_dir=tdir, log_to_driver=False, _node_ip_address="127.0.0.1",
                 logging_level=logging.WARNING, configure_logging=True,
                 _system_config={"automatic_object_spilling_enabled": False})
        self.ray_up = True
        self.log(f"  ray {ray.__version__}: local cluster on 127.0.0.1, object store {fmt_bytes(store)}, no dashboard, spilling off")
        return {"ray_store": store}

    def stop_ray(self) -> None:
        if self.ray_up:
            import ray

            self.ray_up = False
            ray.shutdown()

    def stop_all(self) -> None:
        for f in (self.stop_ray, self.stop_redis, self.stop_kachedb):
            try:
                f()
            except Exception as e:
                self.log(f"  cleanup: {f.__name__} failed: {e}")


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def _redis_version(exe: str) -> str:
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
        for tok in out.split():
            if tok.startswith("v="):
                return tok[2:]
    except Exception:
        pass
    return "?"


def _stop_popen(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.terminate()
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)


# --------------------------------------------------------------------------- Ray
def _ray_actor_classes() -> Tuple[Any, Any]:
    import ray

    @ray.remote(num_cpus=0)
    class RayConsumer:
        """ray.get of the refs (zero-copy numpy views of the object store) ->
        torch.from_numpy."""

        def __init__(self) -> None:
            _quiet_warnings()
            _single_threaded_torch()

        def recv(self, refs: list, case_d: dict) -> dict:
            tc0 = time.perf_counter()
            torch = _torch()
            arrs = ray.get(refs)
            outs = [torch.from_numpy(a) for a in arrs]
            t1 = time.perf_counter()
            case = Case.from_dict(case_d)
            usable(outs, case)
            d0 = time.perf_counter()
            got = digest(outs)
            touch = time.perf_counter() - d0
            del outs, arrs
            return {"tc0": tc0, "t1": t1, "digest": got, "touch_s": touch}

    @ray.remote(num_cpus=0)
    class RayProducer:
        """ray.put of each tensor's numpy view (one copy into the object store);
        the refs go to the consumer actor in a list (not resolved by Ray)."""

        def __init__(self) -> None:
            _quiet_warnings()
            _single_threaded_torch()
            self.payload: Optional[Payload] = None

        def end_case(self) -> None:
            self.payload = None

        def rep(self, case_d: dict, rep: int, consumer: Any) -> dict:
            if self.payload is None or self.payload.case.to_dict() != case_d:
                self.payload = None
                self.payload = Payload(Case.from_dict(case_d))
            ts = self.payload.next()
            expect = digest(ts)
            arrs = [t.numpy() for t in ts]
            t0 = time.perf_counter()
            refs = [ray.put(a) for a in arrs]
            tp = time.perf_counter()
            res = ray.get(consumer.recv.remote(refs, case_d))
            del refs, arrs, ts
            res.update({"t0": t0, "tp": tp, "expect": expect})
            return res

    return RayProducer, RayConsumer


# --------------------------------------------------------------------------- runner
def _median(xs: List[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


def max_reps(case: Case, quick: bool) -> int:
    """The most timed repetitions of a size; fewer when one is slow (see --case-budget)."""
    if quick:
        return 3
    if case.count > 1:
        return 5
    if case.total <= 64 * MIB:
        return 11
    return 7 if case.total <= 512 * MIB else 5


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * KIB
    return 0


COPIES = 3  # fresh private tensor + transport copy + (store slack / receive buffer / server)
HEADROOM = 1 * GIB


class Runner:
    def __init__(self, args: argparse.Namespace, log: Callable[[str], None], emit: Callable[[dict], None]) -> None:
        self.args, self.log, self.emit = args, log, emit
        self.t_start = time.monotonic()
        self.results: List[dict] = []
        self.notes: List[str] = []
        self.cases_left = 0
        self.last_wall: Dict[str, Tuple[float, int]] = {}  # transport -> (wall of one rep, bytes)

    def elapsed(self) -> float:
        return time.monotonic() - self.t_start

    def over_budget(self) -> bool:
        return self.elapsed() > self.args.time_limit

    def record(self, row: dict) -> None:
        self.results.append(row)

    def skip(self, tname: str, case: Case, why: str) -> None:
        self.cases_left -= 1
        self.record({"transport": tname, "bytes": case.nbytes, "count": case.count, "size": case.label,
                     "skipped": why})
        self.log(f"  {TITLES[tname]:<22} {case_title(case):>16}: skipped: {why}")

    def too_slow(self, tname: str, case: Case) -> Optional[str]:
        """Why ``case`` would end past --time-limit (a warm-up and 3 repetitions,
        each predicted from this transport's previous single-tensor size, scaled by
        bytes)."""
        if self.over_budget():
            return f"time limit ({self.args.time_limit:.0f} s) reached"
        prev = self.last_wall.get(tname)
        if prev is None or case.count > 1:
            return None
        wall, total = prev
        est = 4 * wall * max(1.0, case.total / total)
        if self.elapsed() + est > self.args.time_limit:
            return (f"time limit: would need ~{est:.0f} s more, {max(0.0, self.args.time_limit - self.elapsed()):.0f} s "
                    f"of --time-limit {self.args.time_limit:.0f} s left")
        return None

    def fits(self, case: Case) -> Tuple[bool, str]:
        need = COPIES * case.total + HEADROOM
        avail = mem_available()
        if avail < need:
            return False, (f"needs ~{fmt_bytes(need)} ({COPIES} copies + {fmt_bytes(HEADROOM)}), "
                           f"MemAvailable is {fmt_bytes(avail)}")
        return True, ""

    def measure(self, tname: str, case: Case, run_rep: Callable[[int], dict]) -> None:
        """Warm-up, then ``reps`` repetitions (fewer when one rep is slow); records medians."""
        # a fair share of the time left, so that a slow transport early on does not
        # push the last ones past --time-limit
        left = max(0.0, self.args.time_limit - self.elapsed())
        budget = min(self.args.case_budget, left / max(1, self.cases_left))
        self.cases_left -= 1
        w0 = time.monotonic()
        warm = run_rep(0)
        wall = time.monotonic() - w0
        if case.count == 1:  # many small blocks cost per block, not per byte: no basis for scaling
            self.last_wall[tname] = (wall, case.total)
        if self.args.reps is not None:
            reps = self.args.reps
        else:
            reps = max(3, min(max_reps(case, self.args.quick), int(budget / max(wall, 1e-3))))
        prod, cons, hand, touch = [], [], [], []
        verified = warm["digest"] == warm["expect"]
        for r in range(1, reps + 1):
            res = run_rep(r)
            prod.append(res["tp"] - res["t0"])
            cons.append(res["t1"] - res["tc0"])
            hand.append(res["t1"] - res["t0"])
            touch.append(res["touch_s"])
            if os.environ.get("KACHEDB_COMPARE_DEBUG"):
                self.log(f"    rep {r}: producer {fmt_time(res['tp'] - res['t0'])}, notify gap "
                         f"{fmt_time(res['tc0'] - res['tp'])}, consumer {fmt_time(res['t1'] - res['tc0'])}, "
                         f"handoff {fmt_time(res['t1'] - res['t0'])}")
            if res["digest"] != res["expect"]:
                verified = False
        row = {"transport": tname, "bytes": case.nbytes, "count": case.count, "size": case.label,
               "total_bytes": case.total,
               "handoff_s": _median(hand), "producer_s": _median(prod), "consumer_s": _median(cons),
               "touch_s": _median(touch), "handoff_min_s": min(hand), "handoff_max_s": max(hand),
               "reps": reps, "warmup": 1, "verified": verified}
        self.record(row)
        flag = "" if verified else "  DATA MISMATCH"
        self.log(f"  {TITLES[tname]:<22} {case_title(case):>16}: handoff {fmt_time(row['handoff_s']):>9}  "
                 f"producer {fmt_time(row['producer_s']):>9}  consumer {fmt_time(row['consumer_s']):>9}  "
                 f"touch {fmt_time(row['touch_s']):>9}  ({reps} reps){flag}")

    # -- the transports run through child processes
    def run_mp_transport(self, tname: str, cases: List[Case], services: Services) -> None:
        import torch.multiprocessing as tmp

        ctx = tmp.get_context("spawn")
        max_total = max(c.total for c in cases)
        cfg: Dict[str, Any] = {}
        if tname == "kachedb":
            cfg.update(services.start_kachedb(max_total))
        elif tname == "redis":
            cfg.update(services.start_redis(max_total))
        elif tname == "uds":
            cfg["uds_path"] = os.path.join(services.tmp, "uds.sock")
        link_p, link_c = ctx.Pipe(duplex=True)
        queue = ctx.Queue() if tname == "torch_mp" else None
        peers: List[Peer] = []
        try:
            cons = Peer(ctx, "consumer", tname, cfg, link_c, queue)
            peers.append(cons)
            info = cons.result(120)
            prod = Peer(ctx, "producer", tname, cfg, link_p, queue)
            peers.append(prod)
            pinfo = prod.result(120)
            if tname == "redis" and pinfo.get("hiredis") is not None:
                self.notes.append(f"redis-py {'with' if pinfo['hiredis'] else 'without'} the hiredis parser")
            if "addr" in info:
                prod.call("connect", info["addr"])
            for case in cases:
                if self.over_budget():
                    self.skip(tname, case, f"time limit ({self.args.time_limit:.0f} s) reached")
                    continue
                ok, why = self.fits(case)
                if not ok:
                    self.skip(tname, case, why)
                    continue
                why = self.too_slow(tname, case)
                if why:
                    self.skip(tname, case, why)
                    continue
                cons.call("case", case.to_dict())
                prod.call("case", case.to_dict())

                def run_rep(r: int) -> dict:
                    cons.send("rep", r)
                    prod.send("rep", r)
                    p = prod.result()
                    c = cons.result()
                    prod.call("end_rep")
                    cons.call("end_rep")
                    return {"t0": p["t0"], "tp": p["tp"], "expect": p["digest"], "tc0": c["tc0"], "t1": c["t1"],
                            "digest": c["digest"], "touch_s": c["touch_s"]}

                try:
                    self.measure(tname, case, run_rep)
                finally:
                    with contextlib.suppress(Exception):
                        prod.call("end_case", timeout=60)
                    with contextlib.suppress(Exception):
                        cons.call("end_case", timeout=60)
        finally:
            for p in reversed(peers):
                p.stop()
            link_p.close()
            link_c.close()
            if queue is not None:
                queue.close()
                queue.join_thread()
            if tname == "kachedb":
                services.stop_kachedb()
            elif tname == "redis":
                services.stop_redis()

    def run_ray(self, cases: List[Case], services: Services) -> None:
        import ray

        services.start_ray(max(c.total for c in cases))
        try:
            P, C = _ray_actor_classes()
            cons, prod = C.remote(), P.remote()
            for case in cases:
                if self.over_budget():
                    self.skip("ray", case, f"time limit ({self.args.time_limit:.0f} s) reached")
                    continue
                ok, why = self.fits(case)
                if not ok:
                    self.skip("ray", case, why)
                    continue
                why = self.too_slow("ray", case)
                if why:
                    self.skip("ray", case, why)
                    continue
                d = case.to_dict()
                try:
                    self.measure("ray", case, lambda r: ray.get(prod.rep.remote(d, r, cons), timeout=RPC_TIMEOUT))
                finally:
                    ray.get(prod.end_case.remote(), timeout=RPC_TIMEOUT)
            for a in (prod, cons):
                with contextlib.suppress(Exception):
                    ray.kill(a)
        finally:
            services.stop_ray()

    def run(self, transports: List[str], cases: List[Case], tmp: str) -> None:
        services = Services(tmp, self.log)
        self.cases_left = len(transports) * len(cases)
        try:
            for tname in transports:
                if self.over_budget():
                    for case in cases:
                        self.skip(tname, case, f"time limit ({self.args.time_limit:.0f} s) reached")
                    continue
                runnable = []
                for case in cases:
                    ok, why = self.fits(case)
                    if ok:
                        runnable.append(case)
                    else:
                        self.skip(tname, case, why)
                if not runnable:
                    continue
                missing = _missing_dependency(tname)
                if missing:
                    for case in runnable:
                        self.skip(tname, case, f"unavailable: {missing}")
                    continue
                self.log(f"[{self.elapsed():5.0f} s] {TITLES[tname]}")
                try:
                    if tname == "ray":
                        self.run_ray(runnable, services)
                    else:
                        self.run_mp_transport(tname, runnable, services)
                except Exception as e:
                    msg = str(e).strip().splitlines()
                    short = msg[-1] if msg else type(e).__name__
                    self.log(f"  {TITLES[tname]} failed: {''.join(traceback.format_exception_only(type(e), e)).strip()}")
                    done = {(r["transport"], r["size"]) for r in self.results}
                    for case in runnable:
                        if (tname, case.label) not in done:
                            self.cases_left -= 1
                            self.record({"transport": tname, "bytes": case.nbytes, "count": case.count,
                                         "size": case.label, "error": short[:500]})
        finally:
            services.stop_all()


def _missing_dependency(tname: str) -> Optional[str]:
    import importlib.util

    if tname == "ray" and importlib.util.find_spec("ray") is None:
        return "ray is not installed (pip install ray)"
    if tname == "redis":
        if importlib.util.find_spec("redis") is None:
            return "redis-py is not installed (pip install redis hiredis)"
        if shutil.which("redis-server") is None:
            return "redis-server not found (apt-get install -y redis-server)"
    return None


# --------------------------------------------------------------------------- cleanup check
def _set_subreaper() -> bool:
    """Orphaned descendants (a daemon whose parent died, Ray's workers) are
    re-parented to this process, so the final check sees every process the run
    started."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(36, 1, 0, 0, 0) == 0  # PR_SET_CHILD_SUBREAPER
    except Exception:
        return False


def _proc_table() -> Dict[int, Tuple[int, str, str]]:
    """pid -> (ppid, state, cmdline)."""
    out = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read().decode(errors="replace")
            rest = stat[stat.rindex(")") + 2:].split()
            with open(f"/proc/{d}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            out[int(d)] = (int(rest[1]), rest[0], cmd or stat[stat.index("(") + 1:stat.rindex(")")])
        except (OSError, ValueError, IndexError):
            continue
    return out


def _descendants(root: int, table: Dict[int, Tuple[int, str, str]]) -> List[int]:
    kids: Dict[int, List[int]] = {}
    for pid, (ppid, _, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.append(k)
            todo.append(k)
    return out


def _reap_zombies() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _shm_names() -> set:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def _stop_resource_tracker() -> None:
    with contextlib.suppress(Exception):
        from multiprocessing import resource_tracker

        stop = getattr(resource_tracker._resource_tracker, "_stop", None)
        if stop is not None:
            stop()


def check_cleanup(shm_before: set, tmp: str, markers: List[str], wait_s: float = 15.0) -> dict:
    """Waits up to ``wait_s`` for stragglers, then reports leftover processes
    (descendants of this one, or any process naming the run's temp dir or Redis
    port) and shared-memory segments this run made."""
    me = os.getpid()
    deadline = time.monotonic() + wait_s
    while True:
        _reap_zombies()
        table = _proc_table()
        left = [p for p in _descendants(me, table) if table[p][1] != "Z"]
        left += [p for p, (_, st, cmd) in table.items()
                 if p != me and p not in left and st != "Z" and any(m and m in cmd for m in markers)]
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.25)
    procs = [{"pid": p, "cmd": table[p][2][:200]} for p in left if p in table]
    new_shm = sorted(_shm_names() - shm_before)
    ours = [n for n in new_shm if n.startswith((SHM_PREFIX, "torch_", "plasma", "ray"))]
    tmp_left = os.path.exists(tmp)
    return {"ok": not procs and not ours and not tmp_left, "leftover_processes": procs,
            "leftover_shm": ours, "other_new_shm": [n for n in new_shm if n not in ours],
            "temp_dir_left": tmp_left}


# --------------------------------------------------------------------------- output
def add_ratios(results: List[dict]) -> None:
    base = {r["size"]: r["handoff_s"] for r in results if r["transport"] == "kachedb" and "handoff_s" in r}
    for r in results:
        if "handoff_s" in r:
            b = base.get(r["size"])
            r["ratio_vs_kachedb"] = (r["handoff_s"] / b) if b else None


def machine_description() -> dict:
    info: Dict[str, str] = {}
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break  # the first CPU is enough
                k, _, v = line.partition(":")
                info[k.strip()] = v.strip()
    cpu = info.get("model name", "?")
    if "cpu family" in info and "model" in info:
        cpu += f" (family {info['cpu family']} model {info['model']})"
    if "hypervisor" in info.get("flags", "").split():
        cpu += ", virtual machine"
    mem = 0
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem = int(line.split()[1]) * KIB
    versions = {"python": platform.python_version()}
    for mod in ("torch", "numpy", "kachedb", "ray", "redis"):
        with contextlib.suppress(Exception):
            versions[mod] = __import__(mod).__version__
    exe = shutil.which("redis-server")
    if exe:
        versions["redis-server"] = _redis_version(exe)
    rev = _git_revision()
    if rev:
        versions["kachedb"] = f"{versions.get('kachedb', '?')} (git {rev})"
    return {"cpu": cpu, "cpus": os.cpu_count(), "mem_total": mem, "kernel": platform.release(),
            "versions": versions}


def _git_revision() -> Optional[str]:
    """The commit of the source tree the package was imported from (editable
    installs), with ``+dirty`` for uncommitted changes; None outside git."""
    try:
        import kachedb

        where = os.path.dirname(os.path.abspath(kachedb.__file__))
        rev = subprocess.run(["git", "-C", where, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=10)
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(["git", "-C", where, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return rev.stdout.strip() + ("+dirty" if dirty else "")
    except Exception:
        return None


def render_markdown(results: List[dict], cases: List[Case], transports: List[str], meta: dict) -> str:
    by = {(r["transport"], r["size"]): r for r in results}
    lines = []
    m = meta["machine"]
    v = ", ".join(f"{k} {val}" for k, val in m["versions"].items())
    lines.append(f"Machine: {m['cpu']}, {m['cpus']} CPUs, {fmt_bytes(m['mem_total'])} RAM, Linux {m['kernel']}; {v}.")
    lines.append(f"Run: `{meta['command']}` ({meta['started']}, {meta['wall_s']:.0f} s).")
    lines.append("")
    lines.append("End-to-end handoff (producer starts -> consumer holds a verified `torch.Tensor`), median; "
                 "in brackets: × KacheDB's time (above 1 = slower than KacheDB).")
    lines.append("")
    hdr = "| transport | " + " | ".join(case_title(c) for c in cases) + " |"
    lines += [hdr, "|---|" + "---:|" * len(cases)]
    for t in transports:
        cells = []
        for c in cases:
            r = by.get((t, c.label))
            if r is None:
                cells.append("–")
            elif "handoff_s" in r:
                ratio = r.get("ratio_vs_kachedb")
                mark = "" if r["verified"] else " ✗ DATA MISMATCH"
                cells.append(fmt_time(r["handoff_s"]) + ("" if t == "kachedb" or ratio is None else f" ({fmt_ratio(ratio)})") + mark)
            else:
                cells.append("skipped" if "skipped" in r else "failed")
        lines.append(f"| {TITLES[t]} | " + " | ".join(cells) + " |")
    lines.append("")
    lines.append("Detail (medians; `touch` = the consumer's first read of every page afterwards, not in handoff):")
    lines.append("")
    lines.append("| size | transport | producer | consumer | handoff | × KacheDB | handoff min–max | touch | reps | data |")
    lines.append("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for c in cases:
        for t in transports:
            r = by.get((t, c.label))
            if r is None:
                continue
            if "handoff_s" in r:
                ratio = r.get("ratio_vs_kachedb")
                lines.append(f"| {case_title(c)} | {TITLES[t]} | {fmt_time(r['producer_s'])} | {fmt_time(r['consumer_s'])} | "
                             f"{fmt_time(r['handoff_s'])} | {'' if ratio is None else f'{ratio:.2f}'} | "
                             f"{fmt_time(r['handoff_min_s'])} – {fmt_time(r['handoff_max_s'])} | "
                             f"{fmt_time(r['touch_s'])} | {r['reps']} | {'verified' if r['verified'] else 'MISMATCH'} |")
            else:
                why = r.get("skipped") or ("failed: " + r.get("error", "?"))
                lines.append(f"| {case_title(c)} | {TITLES[t]} | | | | | | | | {why} |")
    skipped = [case_title(c) for c in cases
               if any(r["size"] == c.label and "MemAvailable" in r.get("skipped", "") for r in results)]
    if skipped:
        lines.append("")
        lines.append(f"Skipped for lack of memory: {', '.join(skipped)}.")
    if meta.get("notes"):
        lines.append("")
        lines.append("Notes: " + "; ".join(meta["notes"]) + ".")
    cl = meta.get("cleanup")
    if cl is not None:
        lines.append("")
        lines.append("Cleanup check: " + ("every process and shared-memory segment the run made is gone."
                                          if cl["ok"] else f"FAILED: {json.dumps(cl)}"))
    return "\n".join(lines) + "\n"


def render_chart(results: List[dict], cases: List[Case], transports: List[str], path: str, meta: dict) -> Optional[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib): no chart"
    from matplotlib.ticker import FuncFormatter

    by = {(r["transport"], r["size"]): r for r in results}
    fig, ax = plt.subplots(figsize=(12, 5.5), dpi=110)
    width = 0.8 / max(1, len(transports))
    colors = {"kachedb": "#d62728", "tcp": "#1f77b4", "uds": "#17becf", "shm": "#2ca02c",
              "torch_mp": "#ff7f0e", "ray": "#9467bd", "redis": "#8c564b"}
    for i, t in enumerate(transports):
        xs, ys, labels = [], [], []
        for j, c in enumerate(cases):
            r = by.get((t, c.label))
            if r and "handoff_s" in r:
                xs.append(j + (i - (len(transports) - 1) / 2) * width)
                ys.append(r["handoff_s"])
                ratio = r.get("ratio_vs_kachedb")
                labels.append("" if t == "kachedb" or ratio is None else fmt_ratio(ratio))
        ax.bar(xs, ys, width, label=TITLES[t], color=colors.get(t), edgecolor="black" if t == "kachedb" else None,
               linewidth=0.8)
        for x, y, lab in zip(xs, ys, labels):
            ax.text(x, y * 1.08, lab, ha="center", va="bottom", fontsize=6.5, rotation=90)
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g} s" if v >= 1 else fmt_time(v)))
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([case_title(c) for c in cases])
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi * 2.5)
    ax.set_ylabel("end-to-end handoff, median (log scale)")
    ax.set_title("Producer process -> consumer process holding a usable torch.Tensor (lower is better; × = vs KacheDB)")
    ax.grid(axis="y", which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    m = meta["machine"]
    fig.text(0.01, 0.01, f"{m['cpu']}, {m['cpus']} CPUs, {fmt_bytes(m['mem_total'])}; {meta['started']}", fontsize=7)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path)
    plt.close(fig)
    return None


BEGIN, END = "<!-- compare:begin (generated by the benchmark; edits here are overwritten) -->", "<!-- compare:end -->"


def update_doc(path: str, md: str, chart_rel: Optional[str]) -> None:
    body = md + (f"\n![handoff time per transport and size]({chart_rel})\n" if chart_rel else "")
    block = f"{BEGIN}\n{body}{END}"
    text = open(path).read() if os.path.exists(path) else ""
    if BEGIN in text and END in text:
        a, rest = text.split(BEGIN, 1)
        _, b = rest.split(END, 1)
        text = a + block + b
    else:
        text = text + ("\n" if text and not text.endswith("\n") else "") + block + "\n"
    with open(path, "w") as f:
        f.write(text)


# --------------------------------------------------------------------------- main
def build_parser(prog: str = "kachedb bench compare") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=(
        "Hand a KV tensor from one process to another: KacheDB vs TCP loopback, Unix socket, "
        "multiprocessing.shared_memory, torch.multiprocessing, Ray's object store and Redis."))
    p.add_argument("--sizes", default=None,
                   help=f"comma-separated sizes, NxCOUNT for COUNT separate tensors (default {FULL_SIZES}; "
                        f"--quick: {QUICK_SIZES})")
    p.add_argument("--transports", default=",".join(TRANSPORTS),
                   help=f"comma-separated subset of {','.join(TRANSPORTS)}")
    p.add_argument("--quick", action="store_true", help=f"CI mode: {QUICK_SIZES}, 3 reps")
    p.add_argument("--reps", type=int, default=None, help="repetitions after the warm-up (default: by size, "
                                                          "fewer when one is slow)")
    p.add_argument("--json", action="store_true", help="JSON lines on stdout (progress and table on stderr)")
    p.add_argument("--out", default=None, help="directory for compare_table.md, compare_chart.png and compare_results.jsonl")
    p.add_argument("--doc", default=None, help="Markdown file whose generated block is replaced with the table")
    p.add_argument("--render", metavar="JSONL", default=None,
                   help="do not measure: re-render the table/chart/doc block (--out, --doc) from a "
                        "compare_results.jsonl of an earlier run")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds after which remaining cases are skipped (default 510, quick 150); "
                        "each size of each transport gets a fair share of what is left")
    p.add_argument("--case-budget", type=float, default=None,
                   help="seconds per transport and size for the timed repetitions (default 6)")
    return p


def write_outputs(results: List[dict], cases: List[Case], transports: List[str], meta: dict, rows: List[dict],
                  out_dir: Optional[str], doc: Optional[str], log: Callable[[str], None]) -> str:
    """The Markdown table (returned), and with ``out_dir`` compare_table.md,
    compare_results.jsonl and compare_chart.png; with ``doc`` its generated block."""
    md = render_markdown(results, cases, transports, meta)
    chart_err = None
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "compare_table.md"), "w") as f:
            f.write(md)
        with open(os.path.join(out_dir, "compare_results.jsonl"), "w") as f:
            for d in rows:
                f.write(json.dumps(d) + "\n")
        chart_err = render_chart(results, cases, transports, os.path.join(out_dir, "compare_chart.png"), meta)
        if chart_err:
            log(chart_err)
    if doc:
        rel = None
        if out_dir and not chart_err:
            rel = os.path.relpath(os.path.join(out_dir, "compare_chart.png"), os.path.dirname(os.path.abspath(doc)))
        update_doc(doc, md, rel)
    return md


def render_saved(path: str, out_dir: Optional[str], doc: Optional[str]) -> str:
    """Re-renders the table, chart and doc block from a compare_results.jsonl
    written by an earlier run (no measuring)."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    meta = next(r["meta"] for r in rows if "meta" in r)
    meta["cleanup"] = next((r["cleanup"] for r in rows if "cleanup" in r), meta.get("cleanup"))
    results = [r for r in rows if "transport" in r]
    cases = [parse_size(s) for s in meta["sizes"]]
    return write_outputs(results, cases, meta["transports"], meta, rows, out_dir, doc, lambda s: print(s, file=sys.stderr))


def _command_of(prog: str) -> str:
    return "python -m kachedb bench compare" if prog.startswith("kachedb") else f"python {prog}"


def _raise_interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv: Optional[Sequence[str]] = None, prog: str = "kachedb bench compare") -> int:
    args = build_parser(prog).parse_args(argv)
    if args.render:
        sys.stdout.write(render_saved(args.render, args.out, args.doc))
        return 0
    if args.time_limit is None:
        args.time_limit = 150.0 if args.quick else 510.0
    if args.case_budget is None:
        args.case_budget = 6.0
    try:
        cases = [parse_size(s) for s in (args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)).split(",") if s.strip()]
    except ValueError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    transports = [t.strip() for t in args.transports.split(",") if t.strip()]
    bad = [t for t in transports if t not in TRANSPORTS]
    if bad:
        print(f"{prog}: unknown transport(s) {', '.join(bad)}; choose from {', '.join(TRANSPORTS)}", file=sys.stderr)
        return 2
    if "kachedb" in transports:
        transports = ["kachedb"] + [t for t in transports if t != "kachedb"]

    # stdout carries only our output; anything else (Ray, redis, children) writes to stderr
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def log(s: str) -> None:
        print(s, file=sys.stderr, flush=True)

    rows_out: List[dict] = []

    def emit(d: dict) -> None:
        rows_out.append(d)
        if args.json:
            out.write(json.dumps(d) + "\n")
            out.flush()

    _quiet_warnings()
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # children and Ray workers: see _single_threaded_torch
    _single_threaded_torch()
    subreaper = _set_subreaper()
    shm_before = _shm_names()
    tmp = tempfile.mkdtemp(prefix="kcmp-", dir="/tmp")  # short: Ray's socket paths live under it
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    old_term = signal.signal(signal.SIGTERM, _raise_interrupt)
    runner = Runner(args, log, emit)
    meta: Dict[str, Any] = {"machine": machine_description(), "started": started,
                            "command": " ".join([_command_of(prog), *(argv if argv is not None else sys.argv[1:])])}
    avail = mem_available()
    log(f"kachedb bench compare: {', '.join(case_title(c) for c in cases)}; "
        f"{', '.join(TITLES[t] for t in transports)}; MemAvailable {fmt_bytes(avail)}")
    for c in cases:
        ok, why = runner.fits(c)
        if not ok:
            log(f"  size {case_title(c)} will be skipped: {why}")
    interrupted = False
    try:
        runner.run(transports, cases, tmp)
    except KeyboardInterrupt:
        interrupted = True
        log("interrupted: cleaning up")
    finally:
        signal.signal(signal.SIGTERM, old_term)
        shutil.rmtree(tmp, ignore_errors=True)
        _stop_resource_tracker()
    markers = [tmp]
    cleanup = check_cleanup(shm_before, tmp, markers)
    if not subreaper:
        cleanup["note"] = "PR_SET_CHILD_SUBREAPER unavailable: only direct descendants were checked"
    meta["wall_s"] = runner.elapsed()
    meta["cleanup"] = cleanup
    meta["notes"] = ["every producer and consumer process runs torch with 1 intra-op thread"] + runner.notes
    if "redis" in transports:
        meta["notes"].append("Redis values above 1 MiB are split into 1 MiB keys (proto-max-bulk-len left at "
                             "its default of 512 MB)")
    if "torch_mp" in transports and any(c.count > TORCH_MP_BATCH for c in cases):
        meta["notes"].append(f"torch.multiprocessing sends more than {TORCH_MP_BATCH} tensors in acknowledged "
                             "batches (file_descriptor strategy: 2 fds per tensor in flight, RLIMIT_NOFILE)")
    add_ratios(runner.results)
    for r in runner.results:
        emit(r)
    emit({"meta": {**meta, "sizes": [c.label for c in cases], "transports": transports}})
    emit({"cleanup": cleanup})
    md = write_outputs(runner.results, cases, transports, meta, rows_out, args.out, args.doc, log)
    if args.json:
        log("")
        log(md)
    else:
        out.write(md)
    log(f"cleanup: {'ok' if cleanup['ok'] else 'FAILED'} ({len(cleanup['leftover_processes'])} leftover processes, "
        f"{len(cleanup['leftover_shm'])} leftover /dev/shm segments, "
        f"temp dir {'left' if cleanup['temp_dir_left'] else 'removed'}); total {runner.elapsed():.0f} s")
    out.flush()
    bad_rows = [r for r in runner.results if "error" in r or ("handoff_s" in r and not r["verified"])
                or ("skipped" in r and "MemAvailable" not in r["skipped"])]
    if interrupted:
        return 130
    return 0 if cleanup["ok"] and not bad_rows else 1


if __name__ == "__main__":
    sys.exit(main())
