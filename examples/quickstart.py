"""KacheDB quickstart: one process stores a KV-cache tensor, another reads it
back as a zero-copy torch.Tensor view of shared memory.

    python examples/quickstart.py          # starts a private daemon if none runs

Runs as written on a CPU-only machine.
"""
import multiprocessing as mp
import os
import time

import torch

import kachedb

KEY = b"quickstart/prefix-0"
SHAPE = (2, 32, 8, 1024, 128)  # (k/v, layers, kv heads, tokens, head dim): 128 MiB of f16


def writer(socket: str) -> None:
    kv = torch.randn(SHAPE, dtype=torch.float16, generator=torch.Generator().manual_seed(0))
    with kachedb.connect(socket=socket) as kc:
        t = time.perf_counter()
        kc.put(KEY, kv)
        dt = time.perf_counter() - t
        print(f"[writer pid {os.getpid()}] put {tuple(kv.shape)} {kv.dtype} "
              f"({kv.numel() * kv.element_size() / 2**20:.0f} MiB) in {dt * 1e3:.1f} ms")


def reader(socket: str) -> None:
    expected = torch.randn(SHAPE, dtype=torch.float16, generator=torch.Generator().manual_seed(0))
    with kachedb.connect(socket=socket) as kc:
        t = time.perf_counter()
        with kc.get(KEY) as kv:  # a torch.Tensor that *is* the shared memory, pinned while in use
            dt = time.perf_counter() - t
            same = torch.equal(kv, expected)
            print(f"[reader pid {os.getpid()}] got a zero-copy {tuple(kv.shape)} {kv.dtype} view "
                  f"in {dt * 1e6:.0f} µs; equal to what the writer put: {same}")
            assert same
        print(f"[reader] prefix lookup of [{KEY!r}, b'missing'] -> {kc.lookup([KEY, b'missing'])} leading hit(s)")


def main() -> None:
    # start=True spawns a local daemon (private socket, small region) unless one runs there.
    with kachedb.connect(start=True, size="1GiB") as kc:
        socket = kc.socket
        print(f"daemon at {socket}")
        ctx = mp.get_context("spawn")
        for target in (writer, reader):
            p = ctx.Process(target=target, args=(socket,))
            p.start()
            p.join()
            if p.exitcode != 0:
                raise SystemExit(f"{target.__name__} failed with exit code {p.exitcode}")
        s = kc.stats()
        print(f"daemon stats: {s['blocks']} block(s), {s['bytes_used'] / 2**20:.0f} MiB used, "
              f"{s['pins']} pin(s), {s['clients_connected']} client(s) connected")
        if kc.started_daemon:
            kc.stop_daemon()
            print("stopped the daemon this demo started")


if __name__ == "__main__":
    main()
