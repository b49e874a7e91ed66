"""The remote tier (`kachedb serve --remote`, docs/remote.md) against a real
3-master Redis Cluster that these tests start and stop, with two daemons
standing for two nodes (separate sockets and regions) and real clients.

Needs redis-server and redis-cli on PATH (Makefile `system-deps` installs
them); without them these tests fail rather than skip."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import urllib.request
import uuid

import numpy as np
import pytest
import torch

import kachedb
from kdb_support import Daemon, pattern, poll_until
from redis_cluster import RedisCluster

#: Small chunks, so that modest blocks span several chunks (several keys).
CHUNK = "64KiB"


@pytest.fixture(scope="module")
def cluster():
    c = RedisCluster(3)
    yield c
    c.stop()


def node(url: str, ns: str, *extra: str, size: str = "128MiB") -> Daemon:
    return Daemon(size, "--remote", url, "--remote-namespace", ns, "--remote-chunk-bytes", CHUNK, *extra)


def remote(d: Daemon) -> dict:
    return {k: v for k, v in d.stats().items() if k.startswith("remote_")}


def wait_written(d: Daemon, n: int) -> None:
    """Waits until `d` has written `n` blocks and its queue is empty."""
    poll_until(
        lambda: (lambda s: s["remote_writes"] >= n and s["remote_queue_blocks"] == 0)(d.stats()),
        timeout=60,
        what=f"{n} remote writes",
    )


def assert_clean(*daemons: Daemon) -> None:
    """No pins, reservations or queued writes left, invariants hold."""
    for d in daemons:
        poll_until(
            lambda d=d: (lambda s: s["pins"] == 0 and s["reserved"] == 0 and s["remote_queue_blocks"] == 0)(d.stats()),
            timeout=30,
            what="no pins, reservations or queued writes",
        )
        s = d.stats()
        assert s["invariants_ok"], s


def chain(seed: int):
    """A chain of blocks of mixed sizes and dtypes (one spans many chunks)."""
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(64, 33, generator=g, dtype=torch.float32),
        torch.randn(1000, generator=g).to(torch.float16),
        torch.randn(7, 5, 3, generator=g).to(torch.bfloat16),
        torch.randint(-100, 100, (300_001,), generator=g, dtype=torch.int8),  # ~4.6 chunks
        torch.randint(0, 1 << 40, (17, 3), generator=g, dtype=torch.int64),
        torch.tensor([], dtype=torch.float32),
        torch.from_numpy(np.frombuffer(pattern(1 << 20, seed), dtype=np.uint8).copy()),  # exactly 16 chunks
    ]


def same(t: torch.Tensor, want: torch.Tensor) -> bool:
    return (
        t.dtype == want.dtype
        and tuple(t.shape) == tuple(want.shape)
        and t.contiguous().view(torch.uint8).numpy().tobytes() == want.contiguous().view(torch.uint8).numpy().tobytes()
    )


def test_a_chain_put_on_one_node_is_found_whole_on_another(cluster):
    ns = f"t-{uuid.uuid4().hex[:8]}"
    from redis_cluster import _free_ports

    port = _free_ports(1)[0]
    a, b = node(cluster.url, ns), node(cluster.url, ns, "--metrics-addr", f"127.0.0.1:{port}")
    try:
        keys = [f"chain/{i}" for i in range(7)]
        blocks = chain(1)
        with a.connect() as ka:
            for k, t in zip(keys, blocks):
                ka.put(k, t)
        wait_written(a, len(keys))
        st = remote(a)
        assert st["remote_enabled"] and st["remote_dropped_writes"] == 0 and st["remote_errors"] == 0

        with b.connect() as kb:
            assert b.stats()["blocks"] == 0
            # One LOOKUP of the chain: its whole local-miss tail is fetched in one go.
            assert kb.lookup(keys) == len(keys)
            st = remote(b)
            assert st["remote_fetches"] == 1, st
            assert st["remote_fills"] == len(keys), st
            assert st["remote_fill_bytes"] == sum(t.numel() * t.element_size() for t in blocks)
            assert st["remote_corrupt"] == 0 and st["remote_errors"] == 0
            assert b.stats()["blocks"] == len(keys)
            # The filled blocks are ordinary local blocks now: no more fetches.
            for k, want in zip(keys, blocks):
                got = kb.get(k)
                assert same(got, want), k
                del got
            assert remote(b)["remote_fetches"] == 1
            # A key that is nowhere: a miss, counted, and nothing filled.
            assert kb.lookup(["chain/absent"]) == 0
            with pytest.raises(kachedb.NotFound):
                kb.get("chain/absent")
            assert remote(b)["remote_misses"] >= 2
        # B's fills are not written back.
        assert remote(b)["remote_writes"] == 0
        # The same counters as Prometheus metrics and in `kachedb stats`.
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20) as r:
            text = r.read().decode()
        assert f"kachedb_remote_fills_total {len(keys)}" in text.splitlines(), text
        assert "kachedb_remote_fill_duration_seconds_count 1" in text.splitlines()
        out = subprocess.run([sys.executable, "-m", "kachedb", "stats", "--socket", b.socket],
                             capture_output=True, text=True, check=True).stdout
        assert f"remote fills      {len(keys)} " in out, out
        assert_clean(a, b)
    finally:
        a.stop()
        b.stop()


def test_a_get_miss_fills_and_a_restarted_daemon_is_warm_again(cluster):
    ns = f"t-{uuid.uuid4().hex[:8]}"
    a = node(cluster.url, ns)
    keys = [f"warm/{i}" for i in range(5)]
    blocks = [torch.full((1000 * (i + 1),), float(i), dtype=torch.float32) for i in range(5)]
    try:
        with a.connect() as ka:
            for k, t in zip(keys, blocks):
                ka.put(k, t)
        wait_written(a, len(keys))
    finally:
        a.stop()
    # The same node, restarted empty.
    a2 = node(cluster.url, ns)
    try:
        assert a2.stats()["blocks"] == 0
        with a2.connect() as kc:
            got = kc.get_many(keys)
            assert all(g is not None and same(g, w) for g, w in zip(got, blocks))
            del got
            # A single GET of a block not local any more.
            kc.delete(keys[2])
            t = kc.get(keys[2])
            assert same(t, blocks[2])
            del t
        st = remote(a2)
        assert st["remote_fills"] == len(keys) + 1, st
        assert st["remote_fill_ms_max"] > 0
        assert_clean(a2)
    finally:
        a2.stop()


def test_a_batch_of_large_blocks_filled_at_once_lands_as_a_chain(cluster):
    """A chain of blocks too large for the first round of reads (over 256 KiB),
    asked for in one GET batch of a node that has none of them: each block's
    fill reads its next-block hint beside its chunks, so the blocks land linked
    to each other (the first one's parent was never read: it lands as a root).
    Read-ahead is off, so nothing but the batch's own reads links them."""
    ns = f"t-{uuid.uuid4().hex[:8]}"
    keys = [f"batch/{i}" for i in range(6)]
    blocks = [torch.from_numpy(np.frombuffer(pattern(600_000, 90 + i), dtype=np.uint8).copy()) for i in range(6)]
    a = node(cluster.url, ns)
    try:
        with a.connect() as ka:
            ka.put_many(keys, blocks, chain=True)
        wait_written(a, len(keys))
    finally:
        a.stop()
    b = node(cluster.url, ns, "--remote-read-ahead", "0")
    try:
        with b.connect() as kb:
            got = kb.get_many(keys)
            for k, g, want in zip(keys, got, blocks):
                assert g is not None and same(g, want), k
            del got, g
        st = remote(b)
        assert st["remote_fills"] == len(keys) and st["remote_corrupt"] == 0, st
        assert b.stats()["chained_blocks"] == len(keys) - 1, b.stats()
        assert_clean(b)
    finally:
        b.stop()


def test_a_walk_along_a_chain_reads_ahead_from_the_remote_store(cluster):
    """Issue 44, read-ahead from the remote tier: node A stores a chain of 20
    blocks; node B, empty, GETs them one at a time. Each block A wrote named
    its parent, so A left a next-block hint under the parent's key; B's fill
    of a block reads its hint, and B reads the next blocks ahead, into free
    space: most of B's GETs find their block local or being read. Every byte
    is right, and the filled blocks link into their chain on B. With
    ``--remote-read-ahead 0`` the same walk reads nothing ahead (one fetch per
    GET)."""
    ns = f"t-{uuid.uuid4().hex[:8]}"
    keys = [f"walk/{i}" for i in range(20)]
    blocks = [torch.from_numpy(np.frombuffer(pattern(100_000, 70 + i), dtype=np.uint8).copy()) for i in range(20)]
    a = node(cluster.url, ns)
    try:
        with a.connect() as ka:
            ka.put_many(keys, blocks, chain=True)
        wait_written(a, len(keys))
    finally:
        a.stop()
    for read_ahead in ("8", "0"):
        b = node(cluster.url, ns, "--remote-read-ahead", read_ahead)
        try:
            with b.connect() as kb:
                for k, want in zip(keys, blocks):
                    got = kb.get(k)
                    assert same(got, want), k
                    del got
            st = remote(b)
            assert st["remote_corrupt"] == 0 and st["remote_errors"] == 0, st
            assert_clean(b)
            if read_ahead == "0":
                assert st["remote_read_ahead"] == 0, st
                assert st["remote_fetches"] == len(keys), st
                continue
            # Blocks 0 and 1 are the client's own fetches (the hints along the
            # chain are read after block 0's); the rest can be read ahead.
            assert st["remote_read_ahead"] >= 12, st
            assert st["remote_fills"] == len(keys), st
            assert b.stats()["chained_blocks"] >= len(keys) - 2, b.stats()
        finally:
            b.stop()
    for bad in ("65", "-1"):
        out = subprocess.run([sys.executable, "-m", "kachedb", "serve", "--size", "16MiB", "--socket", "/nonexistent/k.sock",
                              "--remote", cluster.url, f"--remote-read-ahead={bad}"], capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "--remote-read-ahead" in out.stderr, (bad, out.stderr)


def test_the_tiers_own_session_is_not_bound_by_the_client_limit(cluster):
    """With `--max-client-bytes` smaller than what the tier holds at once (its
    write-behind pins, a chain's fill reservations), every block is still
    written and filled: the limit is the clients', the tier's session is the
    daemon's own. Each client stays within the limit (one 1 MiB block at a time)."""
    ns = f"t-{uuid.uuid4().hex[:8]}"
    limit = ("--max-client-bytes", "1536KiB")
    a, b = node(cluster.url, ns, *limit), node(cluster.url, ns, *limit)
    keys = [f"limit/{i}" for i in range(6)]
    blocks = [torch.from_numpy(np.frombuffer(pattern(1 << 20, 40 + i), dtype=np.uint8).copy()) for i in range(6)]
    try:
        with a.connect() as ka:
            for i, (k, t) in enumerate(zip(keys, blocks)):
                ka.put(k, t, parent=keys[i - 1] if i else None)
        wait_written(a, len(keys))  # 6 MiB pinned by the tier at once, over the client limit
        assert remote(a)["remote_dropped_writes"] == 0 and remote(a)["remote_errors"] == 0
        with b.connect() as kb:
            assert kb.lookup(keys) == len(keys)  # one fetch: 6 MiB of fill reservations at once
            st = remote(b)
            assert st["remote_fills"] == len(keys), st
            for k, want in zip(keys, blocks):
                got = kb.get(k)
                assert same(got, want), k
                del got
        assert b.stats()["client_limit_hits"] == 0
        assert_clean(a, b)
    finally:
        a.stop()
        b.stop()


def test_namespaces_do_not_share_and_values_expire_with_a_ttl(cluster):
    ns = f"t-{uuid.uuid4().hex[:8]}"
    a = node(cluster.url, ns, "--remote-ttl-s", "3600")
    b = node(cluster.url, f"t-{uuid.uuid4().hex[:8]}")
    rc = cluster.client()
    try:
        with a.connect() as ka:
            ka.put("ns/x", torch.ones(10))
            ka.put("ns/big", torch.zeros(100_000))  # 7 chunks
        wait_written(a, 2)
        with b.connect() as kb:
            assert kb.lookup(["ns/x"]) == 0
        assert remote(b)["remote_fills"] == 0
        for key, chunks in (("ns/x", 1), ("ns/big", 7)):
            for i in range(chunks):
                ttl_ms = rc.pttl(redis_key(ns, key, i))
                assert 0 < ttl_ms <= 3600 * 1000, (key, i, ttl_ms)
            assert rc.exists(redis_key(ns, key, chunks)) == 0
    finally:
        rc.close()
        a.stop()
        b.stop()


def redis_key(ns: str, key: str, chunk: int) -> str:
    """The Redis key of chunk `chunk` of block `key` (docs/remote.md, key layout)."""
    return f"{ns}:{{{kachedb.key_of(key):032x}}}:{chunk}"


def test_a_value_corrupted_inside_redis_is_never_served(cluster):
    ns = f"t-{uuid.uuid4().hex[:8]}"
    a, b = node(cluster.url, ns), node(cluster.url, ns)
    rc = cluster.client()
    try:
        data = np.frombuffer(pattern(300_000, 7), dtype=np.uint8).copy()  # 5 chunks
        names = ["bad/payload", "bad/header", "bad/missing", "bad/short", "good"]
        with a.connect() as ka:
            for k in names:
                ka.put(k, data)
        wait_written(a, len(names))
        # Flip bytes in the middle of chunk 2, same length.
        rc.setrange(redis_key(ns, "bad/payload", 2), 1000, b"\xff\x00\xff\x00")
        # Damage the header (the dims) in chunk 0.
        rc.setrange(redis_key(ns, "bad/header", 0), 20, b"\x09")
        # Lose a chunk.
        rc.delete(redis_key(ns, "bad/missing", 3))
        # Truncate the last chunk.
        last = rc.get(redis_key(ns, "bad/short", 4))
        rc.set(redis_key(ns, "bad/short", 4), last[:-1])
        with b.connect() as kb:
            for k in names[:4]:
                with pytest.raises(kachedb.NotFound):
                    kb.get(k)
                assert kb.lookup([k]) == 0
            got = kb.get_numpy("good")
            assert got.tobytes() == data.tobytes()
            del got
        st = remote(b)
        assert st["remote_corrupt"] >= 4, st
        assert st["remote_fills"] == 1, st
        assert_clean(a, b)
    finally:
        rc.close()
        a.stop()
        b.stop()


def test_a_slow_or_dead_master_turns_into_misses_and_the_daemon_recovers(cluster):
    ns = f"t-{uuid.uuid4().hex[:8]}"
    a = node(cluster.url, ns, "--remote-timeout-ms", "500")
    b = node(cluster.url, ns, "--remote-timeout-ms", "500")
    keys = [f"dead/{i}" for i in range(30)]
    blocks = [torch.full((2000,), float(i), dtype=torch.float32) for i in range(len(keys))]
    victim = None
    paused = False
    try:
        with a.connect() as ka:
            for k, t in zip(keys, blocks):
                ka.put(k, t)
            wait_written(a, len(keys))
            ports = {k: cluster.port_of_key(redis_key(ns, k, 0)) for k in keys}
            victim = ports[keys[0]]
            dead = [k for k in keys if ports[k] == victim]
            alive = [k for k in keys if ports[k] != victim]
            assert dead and alive

            with b.connect() as kb, b.connect() as local:
                local.put("local/x", torch.arange(100))
                stop = threading.Event()
                served = []

                def local_traffic():
                    while not stop.is_set():
                        t = local.get("local/x")
                        assert int(t[99]) == 99
                        del t
                        served.append(1)

                def check_all(first_waits: bool) -> None:
                    for n, k in enumerate(dead):
                        before = len(served)
                        with pytest.raises(kachedb.NotFound):
                            kb.get(k)
                        if first_waits and n == 0:
                            # That GET waited for a node that never answers (the
                            # whole timeout); the other client was served meanwhile.
                            assert len(served) > before
                    for k, t in zip(keys, blocks):
                        if k in alive:
                            g = kb.get(k)
                            assert same(g, t), k
                            del g
                            kb.delete(k)  # so the next round fills it again

                th = threading.Thread(target=local_traffic)
                th.start()
                try:
                    # A slow node: it accepts requests and never answers.
                    cluster.pause_node(victim, True)
                    paused = True
                    check_all(first_waits=True)
                    cluster.pause_node(victim, False)
                    paused = False
                    # A dead node.
                    cluster.kill_node(victim)
                    check_all(first_waits=False)
                finally:
                    stop.set()
                    th.join()
                st = remote(b)
                assert st["remote_errors"] >= 2 * len(dead), st
                assert st["remote_fills"] == 2 * len(alive), st

                # The master comes back (empty: no persistence). Writes reach it
                # again and B finds the blocks.
                cluster.restart_node(victim)
                deadline = time.monotonic() + 60
                while True:
                    # A's first writes after the restart may still fail while its
                    # connection notices the node is back: put again until they land.
                    for k, t in zip(keys, blocks):
                        if k in dead:
                            ka.delete(k)
                            ka.put(k, t)
                    poll_until(lambda: remote(a)["remote_queue_blocks"] == 0, timeout=60, what="the rewrites")
                    if all(in_redis(ns, cluster, k) for k in dead):
                        break
                    assert time.monotonic() < deadline, "the writes never reached the restarted master"
                    time.sleep(0.5)
                for k, t in zip(keys, blocks):
                    if k in dead:
                        g = kb.get(k)
                        assert same(g, t), k
                        del g
        assert_clean(a, b)
    finally:
        if paused:
            cluster.pause_node(victim, False)
        if victim is not None and victim not in cluster.procs:
            cluster.restart_node(victim)
        a.stop()
        b.stop()


def in_redis(ns: str, cluster: RedisCluster, key: str) -> bool:
    rc = cluster.client()
    try:
        return rc.exists(redis_key(ns, key, 0)) == 1
    finally:
        rc.close()


def test_concurrent_fills_and_local_traffic(cluster):
    ns = f"t-{uuid.uuid4().hex[:8]}"
    a, b = node(cluster.url, ns), node(cluster.url, ns, size="256MiB")
    chains = {c: [f"cc/{c}/{i}" for i in range(8)] for c in range(6)}
    data = {k: np.frombuffer(pattern(100_000 + 997 * i, c * 100 + i), dtype=np.uint8).copy()
            for c, ks in chains.items() for i, k in enumerate(ks)}
    try:
        with a.connect() as ka:
            for k, v in data.items():
                ka.put(k, v)
        wait_written(a, len(data))
        errors = []

        def filler(c):
            try:
                with b.connect() as kb:
                    ks = chains[c]
                    assert kb.lookup(ks) == len(ks)
                    for k in ks:
                        g = kb.get_numpy(k)
                        assert g.tobytes() == data[k].tobytes(), k
                        del g
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))

        with b.connect() as local:
            local.put("local/y", np.arange(1000, dtype=np.int32))
            stop = threading.Event()
            local_gets = []

            def local_traffic():
                while not stop.is_set():
                    v = local.get_numpy("local/y")
                    if int(v[999]) != 999:
                        errors.append("local value changed")
                    del v
                    local_gets.append(1)

            lt = threading.Thread(target=local_traffic)
            lt.start()
            threads = [threading.Thread(target=filler, args=(c,)) for c in chains]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            stop.set()
            lt.join()
        assert not errors, errors
        assert local_gets
        st = remote(b)
        assert st["remote_fills"] == len(data), st
        assert st["remote_corrupt"] == 0 and st["remote_errors"] == 0
        assert_clean(a, b)
    finally:
        a.stop()
        b.stop()


def test_a_full_write_queue_drops_and_counts(cluster):
    ns = f"t-{uuid.uuid4().hex[:8]}"
    # A queue smaller than one block: every write is dropped, nothing is pinned.
    a = Daemon("64MiB", "--remote", cluster.url, "--remote-namespace", ns, "--remote-queue-bytes", "1000")
    try:
        with a.connect() as ka:
            for i in range(3):
                ka.put(f"q/{i}", np.zeros(10_000, dtype=np.uint8))
        st = remote(a)
        assert st["remote_dropped_writes"] == 3 and st["remote_writes"] == 0, st
        assert_clean(a)
    finally:
        a.stop()


def tier_thread_nices(pid: int) -> list[int]:
    """Nice values of the threads of process `pid` named kachedb-remote."""
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                if f.read().strip() != "kachedb-remote":
                    continue
            out.append(os.getpriority(os.PRIO_PROCESS, int(tid)))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def test_the_tier_threads_run_at_the_worker_nice_and_bad_values_are_refused(cluster):
    ns = f"t-{uuid.uuid4().hex[:8]}"
    own = os.getpriority(os.PRIO_PROCESS, 0)  # the daemon inherits it
    out = subprocess.run([sys.executable, "-m", "kachedb", "serve", "--help"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "--remote-worker-nice" in out.stdout, out.stdout
    cases = [
        ((), min(own + 19, 19)),  # the default
        (("--remote-worker-nice", "5"), min(own + 5, 19)),
        (("--remote-worker-nice", "0"), own),
    ]
    for extra, want in cases:
        d = node(cluster.url, ns, *extra)
        try:
            poll_until(lambda: (lambda n: len(n) >= 2 and all(v == want for v in n))(tier_thread_nices(d.proc.pid)),
                       timeout=30, what=f"tier threads at nice {want} ({extra})")
            # The serve loop (the main thread) keeps the daemon's own.
            assert os.getpriority(os.PRIO_PROCESS, d.proc.pid) == own
            # The tier still works at that priority: a put is written.
            with d.connect() as k:
                k.put(f"nice/{want}", np.arange(100, dtype=np.int32))
            wait_written(d, 1)
        finally:
            d.stop()
    for bad in ("20", "-1", "x"):
        out = subprocess.run([sys.executable, "-m", "kachedb", "serve", "--size", "16MiB", "--socket", "/nonexistent/k.sock",
                              "--remote", cluster.url, f"--remote-worker-nice={bad}"], capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "--remote-worker-nice" in out.stderr, (bad, out.stderr)


@pytest.fixture
def standalone_redis(tmp_path):
    """One redis-server, not in cluster mode, with a password."""
    from redis_cluster import _free_ports
    from kdb_support import _die_with_parent

    port = _free_ports(1)[0]
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
         "--requirepass", "s3cret pass", "--dir", str(tmp_path)],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=_die_with_parent,
    )
    try:
        deadline = time.monotonic() + 15
        while b"PONG" not in subprocess.run(["redis-cli", "-p", str(port), "-a", "s3cret pass", "--no-auth-warning", "ping"],
                                            capture_output=True).stdout:
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def test_standalone_redis_with_a_password_from_a_file_or_the_environment(standalone_redis, tmp_path):
    url = f"redis://127.0.0.1:{standalone_redis}"
    pw = tmp_path / "pw"
    pw.write_text("s3cret pass\n")
    pw.chmod(0o600)
    a = Daemon("64MiB", "--remote", url, "--remote-password-file", str(pw))
    os.environ["KACHEDB_REMOTE_PASSWORD"] = "s3cret pass"
    try:
        b = Daemon("64MiB", "--remote", url)
    finally:
        del os.environ["KACHEDB_REMOTE_PASSWORD"]
    c = Daemon("64MiB", "--remote", url)  # no password: refused by Redis, so misses
    try:
        t = torch.randn(3, 4)
        with a.connect() as ka:
            ka.put("sa/x", t)
        wait_written(a, 1)
        with b.connect() as kb:
            g = kb.get("sa/x")
            assert same(g, t)
            del g
        with c.connect() as kc:
            with pytest.raises(kachedb.NotFound):
                kc.get("sa/x")
        assert remote(c)["remote_errors"] >= 1
        assert_clean(a, b, c)
    finally:
        a.stop()
        b.stop()
        c.stop()


def test_a_takeover_keeps_the_cache_and_the_new_daemon_runs_the_tier(cluster):
    """`serve --takeover` on a node with a remote tier: the local blocks stay,
    the new daemon writes behind and fills like the old one did."""
    from test_takeover import take_over

    ns = f"t-{uuid.uuid4().hex[:8]}"
    args = ("--remote", cluster.url, "--remote-namespace", ns, "--remote-chunk-bytes", CHUNK)
    a = node(cluster.url, ns)
    try:
        blocks = chain(7)
        keys = [f"tk/{i}" for i in range(len(blocks))]
        with a.connect() as kc:
            for k, t in zip(keys, blocks):
                kc.put(k, t)
        wait_written(a, len(keys))
        take_over(a, 0, *args)
        with a.connect() as kc:
            s = kc.stats()
            assert s["blocks"] == len(keys) and s["remote_enabled"], s
            got = kc.get_many(keys)
            assert all(same(g, w) for g, w in zip(got, blocks))
            del got
            kc.put("tk/after", torch.arange(1000))
            wait_written(a, 1)
            kc.delete(keys[3])
            assert same(kc.get(keys[3]), blocks[3])
            assert remote(a)["remote_fills"] == 1
        assert_clean(a)
    finally:
        a.stop()


def test_a_takeover_hands_the_remote_write_queue_to_the_new_daemon(cluster):
    """Blocks committed while every master is paused are queued for the
    remote tier when a new daemon takes over: the old daemon hands the queue
    over (none dropped), and the new daemon writes them once the cluster
    answers again. (Before: the old daemon dropped its queue, counted.)"""
    from test_takeover import take_over

    ns = f"t-{uuid.uuid4().hex[:8]}"
    args = ("--remote", cluster.url, "--remote-namespace", ns, "--remote-chunk-bytes", CHUNK)
    slow = ("--remote-timeout-ms", "20000")
    a = node(cluster.url, ns, *slow)
    ports = list(cluster.procs)
    paused = False
    try:
        with a.connect() as kc:
            kc.put("warm", torch.arange(10))
            wait_written(a, 1)
            for p in ports:
                cluster.pause_node(p, True)
            paused = True
            keys = [f"queued/{i}" for i in range(6)]
            for i, k in enumerate(keys):
                kc.put(k, torch.full((5000,), float(i)))
            poll_until(lambda: remote(a)["remote_queue_blocks"] == len(keys), 30, "the writes to queue")
        take_over(a, 0, *args, *slow)
        for p in ports:
            cluster.pause_node(p, False)
        paused = False
        wait_written(a, len(keys))
        st = remote(a)
        assert st["remote_dropped_writes"] == 0, st
        assert all(in_redis(ns, cluster, k) for k in keys), st
        assert_clean(a)
    finally:
        if paused:
            for p in ports:
                cluster.pause_node(p, False)
        a.stop()


def test_a_delete_is_the_nodes_own_and_the_fleets_copy_goes_in_redis(cluster):
    """What a DELETE does with a remote tier (docs/remote.md, "DELETE and
    replacement across the fleet"): it is durable on the node (RAM and disk)
    but leaves the fleet's copy in the cluster, so a later miss on the node
    fills the key again, with the bytes the fleet holds; a re-put writes the
    newer bytes over the fleet's copy once its write-behind lands. The
    fleet's copy goes only in Redis (by its key names) or by TTL, after which
    every node's miss is a miss."""
    ns = f"t-{uuid.uuid4().hex[:8]}"
    a = node(cluster.url, ns)
    b = node(cluster.url, ns)
    try:
        with a.connect() as ka, b.connect() as kb:
            v1 = torch.full((3000,), 1.0)
            ka.put("fleet/k", v1)
            wait_written(a, 1)
            assert ka.delete("fleet/k")
            # Node-local: the cluster still has it, and A's next miss fills it.
            assert in_redis(ns, cluster, "fleet/k")
            assert same(ka.get("fleet/k"), v1)
            # A replacement: once its write lands, the fleet serves the newer bytes.
            v2 = torch.full((3000,), 2.0)
            ka.put("fleet/k", v2)
            wait_written(a, 2)
            assert same(kb.get("fleet/k"), v2)
            # The fleet's copy goes in Redis: then no node fills it.
            assert kb.delete("fleet/k") and ka.delete("fleet/k")
            rc = cluster.client()
            try:
                # A 12 KB block is one chunk: chunk 0 (its header and bytes).
                assert rc.delete(redis_key(ns, "fleet/k", 0)) == 1
            finally:
                rc.close()
            assert not in_redis(ns, cluster, "fleet/k")
            for kc in (ka, kb):
                with pytest.raises(kachedb.NotFound):
                    kc.get("fleet/k")
        assert_clean(a, b)
    finally:
        a.stop()
        b.stop()


# --- issue 25: a keyed tier, hostile headers, deadlines -----------------------------


def key_file(tmp_path, name: str, secret: bytes, mode: int = 0o600) -> str:
    """A fleet key file: 64 hex digits, mode `mode`."""
    p = tmp_path / name
    p.write_text(secret.hex() + "\n")
    p.chmod(mode)
    return str(p)


def copy_value(rc, src: str, dst: str) -> None:
    """Writes the value at `src` under `dst`, straight into Redis."""
    v = rc.get(src)
    assert v is not None, src
    rc.set(dst, v)


def test_a_fleet_key_authenticates_values_and_forged_ones_are_never_served(cluster, tmp_path):
    """Nodes with key A write; a node with key B and a node without a key
    refuse those values (counted as auth failures); a node with key A serves
    them. A value with a valid plain checksum and no tag (written by a keyless
    node, copied straight into the keyed namespace), and a keyed value whose
    payload was changed in Redis, are never served."""
    from redis_cluster import _free_ports

    ns, ns_plain = f"t-{uuid.uuid4().hex[:8]}", f"t-{uuid.uuid4().hex[:8]}"
    ka_path = key_file(tmp_path, "a.key", os.urandom(32))
    kb_path = key_file(tmp_path, "b.key", os.urandom(32))
    port = _free_ports(1)[0]
    a = node(cluster.url, ns, "--remote-key-file", ka_path)
    c = node(cluster.url, ns, "--remote-key-file", ka_path)
    b = node(cluster.url, ns, "--remote-key-file", kb_path, "--metrics-addr", f"127.0.0.1:{port}")
    n = node(cluster.url, ns)
    p = node(cluster.url, ns_plain)
    rc = cluster.client()
    try:
        data = np.frombuffer(pattern(300_000, 11), dtype=np.uint8).copy()  # 5 chunks
        with a.connect() as k:
            k.put("key/x", data)
            k.put("key/tampered", data)
        wait_written(a, 2)
        with p.connect() as k:
            k.put("key/forged", data)  # valid plain checksums, no tag
        wait_written(p, 1)
        for i in range(5):
            copy_value(rc, redis_key(ns_plain, "key/forged", i), redis_key(ns, "key/forged", i))
        # Same length, other bytes, in the middle of chunk 2 of a keyed value.
        rc.setrange(redis_key(ns, "key/tampered", 2), 1000, b"\xff\x00\xff\x00")

        # Key B: nothing of it is served.
        with b.connect() as k:
            for name in ("key/x", "key/forged", "key/tampered"):
                with pytest.raises(kachedb.NotFound):
                    k.get(name)
        st = remote(b)
        assert st["remote_fills"] == 0 and st["remote_auth_failures"] == 3 and st["remote_corrupt"] == 0, st
        # No key: keyed values are refused (this node cannot check them); the
        # unkeyed one is served, as a keyless node trusts every writer.
        with n.connect() as k:
            for name in ("key/x", "key/tampered"):
                with pytest.raises(kachedb.NotFound):
                    k.get(name)
            got = k.get_numpy("key/forged")
            assert got.tobytes() == data.tobytes()
            del got
        st = remote(n)
        assert st["remote_fills"] == 1 and st["remote_auth_failures"] == 2, st
        with c.connect() as k:
            got = k.get_numpy("key/x")
            assert got.tobytes() == data.tobytes()
            del got
            for name in ("key/forged", "key/tampered"):
                with pytest.raises(kachedb.NotFound):
                    k.get(name)
        st = remote(c)
        assert st["remote_fills"] == 1 and st["remote_auth_failures"] == 2 and st["remote_corrupt"] == 0, st
        # The keyless node said at start that it trusts every writer; the keyed ones did not.
        assert n.log().count("trusts every writer") == 1, n.log()
        assert "trusts every writer" not in c.log(), c.log()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20) as r:
            text = r.read().decode()
        assert "kachedb_remote_auth_failures_total 3" in text.splitlines(), text
        out = subprocess.run([sys.executable, "-m", "kachedb", "stats", "--socket", b.socket],
                             capture_output=True, text=True, check=True).stdout
        assert "3 failed authentication" in out, out
        assert_clean(a, b, c, n, p)
    finally:
        rc.close()
        for d in (a, b, c, n, p):
            d.stop()


def test_a_key_file_others_can_read_or_a_bad_key_is_refused_at_start(cluster, tmp_path):
    sock = str(tmp_path / "k.sock")
    cases = [
        (key_file(tmp_path, "open.key", os.urandom(32), 0o644), "chmod 600"),
        (key_file(tmp_path, "group.key", os.urandom(32), 0o640), "chmod 600"),
    ]
    short = tmp_path / "short.key"
    short.write_text("abcd\n")
    short.chmod(0o600)
    cases.append((str(short), "64 hex digits"))
    for path, want in cases:
        out = subprocess.run([sys.executable, "-m", "kachedb", "serve", "--size", "16MiB", "--socket", sock,
                              "--remote", cluster.url, "--remote-key-file", path],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode != 0 and "--remote-key-file" in out.stderr and want in out.stderr, (path, out.stderr)
        assert not os.path.exists(sock)


#: XXH3's default secret (first 128 bytes), to seal forged headers the way a
#: keyless writer would (docs/remote.md: the header checksum is xxh3-64).
_XXH3_SECRET = bytes.fromhex(
    "b8fe6c3923a44bbe7c01812cf721ad1cded46de9839097db7240a4a4b7b3671f"
    "cb79e64eccc0e578825ad07dccff7221b8084674f743248ee03590e6813a264c"
    "3c2852bb91c300cb88d0658b1b532ea371644897a20df94e3819ef46a9deacd8"
    "a8fa763fe39c343ff9dcbbc7c70b4f1d8a51e04bcdb45931c89f7ec9d9787364"
)
_M64 = (1 << 64) - 1


def _xxh3_64_65to96(data: bytes) -> int:
    """XXH3-64 (seed 0) of 65..96 bytes: the header checksum of bytes 0..80."""
    n = len(data)
    assert 64 < n <= 96

    def mix16(off: int, soff: int) -> int:
        lo = int.from_bytes(data[off:off + 8], "little") ^ int.from_bytes(_XXH3_SECRET[soff:soff + 8], "little")
        hi = int.from_bytes(data[off + 8:off + 16], "little") ^ int.from_bytes(_XXH3_SECRET[soff + 8:soff + 16], "little")
        p = lo * hi
        return (p & _M64) ^ (p >> 64)

    acc = n * 0x9E3779B185EBCA87
    acc += mix16(32, 64) + mix16(n - 48, 80) + mix16(16, 32) + mix16(n - 32, 48) + mix16(0, 0) + mix16(n - 16, 16)
    acc &= _M64
    acc ^= acc >> 37
    acc = (acc * 0x165667919E3779F9) & _M64
    return acc ^ (acc >> 32)


def plain_header(key: str, dims, chunk_bytes: int, chunk_count: int, length: int) -> bytes:
    """A format-1 header (u8 dtype) with a valid header checksum."""
    import struct

    h = bytearray(96)
    h[0:4] = b"KDBR"
    struct.pack_into("<HHBBHI", h, 4, 1, 96, 1, len(dims), 0, chunk_count)
    for i, d in enumerate(dims):
        struct.pack_into("<I", h, 16 + 4 * i, d)
    struct.pack_into("<QII", h, 40, length, chunk_bytes, 0)
    h[56:72] = kachedb.key_of(key).to_bytes(16, "little")
    struct.pack_into("<Q", h, 80, _xxh3_64_65to96(bytes(h[:80])))
    return bytes(h)


def reads_served(cluster: RedisCluster) -> int:
    """GET and GETRANGE commands the cluster's masters have answered."""
    from redis_cluster import _cli

    total = 0
    for port in cluster.ports:
        for line in _cli(port, "info", "commandstats").splitlines():
            if line.startswith(("cmdstat_get:", "cmdstat_getrange:")):
                total += int(line.split("calls=")[1].split(",")[0])
    return total


def test_a_hostile_header_costs_a_few_reads_and_is_counted(cluster):
    """Headers with valid checksums that claim 2^32-1 chunks of 64 MiB (~2^58
    bytes), a block larger than the megaslab, or a block whose chunks are not
    there: each GET misses after a handful of Redis reads (not billions, not
    one per claimed chunk), counted as corrupt, and later fills work."""
    ns = f"t-{uuid.uuid4().hex[:8]}"
    a, d = node(cluster.url, ns), node(cluster.url, ns, size="128MiB")
    rc = cluster.client()
    try:
        data = np.frombuffer(pattern(100_000, 5), dtype=np.uint8).copy()
        with a.connect() as k:
            k.put("hostile/good", data)
        wait_written(a, 1)
        # The test's own xxh3 agrees with the daemon's (else the headers below
        # would be refused for their checksum, not for what they claim).
        real = rc.get(redis_key(ns, "hostile/good", 0))
        assert int.from_bytes(real[80:88], "little") == _xxh3_64_65to96(real[:80])
        mib64, kib64 = 64 << 20, 64 << 10
        hostile = {
            # 2^32-1 chunks of 64 MiB.
            "hostile/huge": plain_header("hostile/huge", [mib64, (1 << 32) - 1], mib64, (1 << 32) - 1,
                                         mib64 * ((1 << 32) - 1)),
            # 256 MiB: more than the 128 MiB megaslab, 4096 chunks of 64 KiB.
            "hostile/too-big": plain_header("hostile/too-big", [256 << 20], kib64, 4096, 256 << 20),
            # 64 MiB in 1024 chunks of 64 KiB that are not there.
            "hostile/hollow": plain_header("hostile/hollow", [64 << 20], kib64, 1024, 64 << 20),
        }
        for name, header in hostile.items():
            rc.set(redis_key(ns, name, 0), header + b"\x00" * kib64)
        with d.connect() as k:
            for name in hostile:
                before = reads_served(cluster)
                with pytest.raises(kachedb.NotFound):
                    k.get(name)
                time.sleep(1.0)  # a reader left running would go on reading meanwhile
                reads = reads_served(cluster) - before
                # Chunk 0, then at most one window of 16 chunks (+ slack for
                # the cluster client's own reads).
                assert reads <= 24, (name, reads)
            st = remote(d)
            assert st["remote_corrupt"] == len(hostile) and st["remote_fills"] == 0, st
            got = k.get_numpy("hostile/good")
            assert got.tobytes() == data.tobytes()
            del got
        assert remote(d)["remote_fills"] == 1
        assert_clean(a, d)
    finally:
        rc.close()
        a.stop()
        d.stop()


def test_a_fill_slower_than_its_deadline_is_cancelled_and_later_fills_work(cluster):
    """The shard holding a 32 MiB block (512 chunks of 64 KiB) is paused
    (CLIENT PAUSE) most of the time, so the fill outlives its deadline (4 ×
    --remote-timeout-ms + 1 s) though no request times out: the fill is cancelled,
    the client gets a miss, the reads of that fill stop (at most the window
    already sent reaches Redis), and once the shard answers again the same GET
    fills."""
    import redis as redis_py

    ns = f"t-{uuid.uuid4().hex[:8]}"
    a = node(cluster.url, ns)
    b = node(cluster.url, ns, "--remote-timeout-ms", "800")  # slack over the 250 ms pauses
    data = np.frombuffer(pattern(32 << 20, 9), dtype=np.uint8).copy()
    stop = threading.Event()
    pauser = None
    direct = None
    try:
        with a.connect() as k:
            k.put("slow/x", data)
        wait_written(a, 1)
        shard = cluster.port_of_key(redis_key(ns, "slow/x", 0))
        direct = redis_py.Redis(host="127.0.0.1", port=shard)

        def pause_loop():
            while not stop.is_set():
                direct.execute_command("CLIENT", "PAUSE", "250", "ALL")
                time.sleep(0.27)

        pauser = threading.Thread(target=pause_loop)
        pauser.start()
        with b.connect() as k:
            with pytest.raises(kachedb.NotFound):
                k.get("slow/x")
            # The shard stays slow: a fill left running would go on reading
            # (about 16 chunks per pause); a cancelled one sent its last window.
            before = reads_served(cluster)
            time.sleep(2.5)
            after = reads_served(cluster)
            assert after - before <= 20, f"{after - before} reads after the miss: the fill kept running"
            assert remote(b)["remote_fetches_cancelled"] == 1, remote(b)
            stop.set()
            pauser.join()
            pauser = None
            direct.execute_command("CLIENT", "UNPAUSE")
            st = remote(b)
            assert st["remote_fills"] == 0, st
            got = k.get_numpy("slow/x")
            assert got.tobytes() == data.tobytes()
            del got
        assert remote(b)["remote_fills"] == 1
        assert_clean(a, b)
    finally:
        stop.set()
        if pauser is not None:
            pauser.join()
        if direct is not None:
            direct.execute_command("CLIENT", "UNPAUSE")
            direct.close()
        a.stop()


def _cli_stats(d: Daemon) -> dict:
    """`kachedb stats --json` of the daemon's own binary (it knows the disk_* fields)."""
    import json

    out = subprocess.run(
        [*d.command, "stats", "--json", "--socket", d.socket], capture_output=True, text=True, check=True, timeout=60
    )
    return json.loads(out.stdout)


def test_a_miss_asks_the_disk_tier_first_and_the_remote_for_what_the_disk_lacks(cluster, tmp_path):
    """Tier order disk, then remote, in one fetch: a LOOKUP of a chain whose
    blocks are on disk except one (its file deleted) fills those from disk and
    only the missing one from the cluster, bytes right."""
    ns = f"t-{uuid.uuid4().hex[:8]}"
    disk = str(tmp_path / "disk")
    tiers = ("--disk", disk, "--disk-size", "256MiB")
    keys = [f"order/{i}" for i in range(5)]
    blocks = [torch.from_numpy(np.frombuffer(pattern(200_000 + i, 40 + i), dtype=np.uint8).copy()) for i in range(5)]
    a = node(cluster.url, ns, *tiers)
    try:
        with a.connect() as ka:
            ka.put_many(keys, blocks, chain=True)
        wait_written(a, len(keys))
        poll_until(lambda: _cli_stats(a)["disk_writes"] == len(keys), timeout=60, what="disk writes")
    finally:
        a.stop()
    os.unlink(os.path.join(disk, "blocks", f"{kachedb.key_of(keys[2]):032x}.kdb"))
    b = node(cluster.url, ns, *tiers)
    try:
        with b.connect() as kb:
            assert kb.lookup(keys) == len(keys)
            s = _cli_stats(b)
            assert (s["disk_fills"], s["disk_misses"]) == (4, 1), s
            assert (s["remote_fills"], s["remote_fetches"]) == (1, 1), s
            for k, want in zip(keys, blocks):
                got = kb.get(k)
                assert same(got, want), k
                del got
    finally:
        b.stop()


def test_a_fill_from_disk_counts_in_the_disk_histogram_not_the_remote_one(cluster, tmp_path):
    """With both tiers, a miss filled wholly from disk is counted in
    ``kachedb_disk_fill_duration_seconds``; the remote tier's histogram counts
    only fetches that ended at the remote tier (none here)."""
    from redis_cluster import _free_ports

    ns = f"t-{uuid.uuid4().hex[:8]}"
    tiers = ("--disk", str(tmp_path / "disk"), "--disk-size", "256MiB")
    keys = [f"hist/{i}" for i in range(3)]
    blocks = [torch.from_numpy(np.frombuffer(pattern(50_000 + i, 70 + i), dtype=np.uint8).copy()) for i in range(3)]
    a = node(cluster.url, ns, *tiers)
    try:
        with a.connect() as ka:
            ka.put_many(keys, blocks, chain=True)
        wait_written(a, len(keys))
        poll_until(lambda: _cli_stats(a)["disk_writes"] == len(keys), timeout=60, what="disk writes")
    finally:
        a.stop()
    port = _free_ports(1)[0]
    b = node(cluster.url, ns, *tiers, "--metrics-addr", f"127.0.0.1:{port}")
    try:
        with b.connect() as kb:
            assert kb.lookup(keys) == len(keys)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20) as r:
            lines = r.read().decode().splitlines()
        assert f"kachedb_disk_fills_total {len(keys)}" in lines
        assert "kachedb_remote_fills_total 0" in lines
        assert "kachedb_remote_fill_duration_seconds_count 0" in lines, "a disk fill counted as a remote one"
        assert "kachedb_disk_fill_duration_seconds_count 1" in lines
    finally:
        b.stop()


# --- issue 41: a value's namespace, the tenant a fill counts for ---------------------


def test_a_keyed_value_copied_into_another_namespace_is_never_served(cluster, tmp_path):
    """The keyed tags cover the namespace: a value a node of namespace X wrote,
    copied by anyone with Redis access to the same block key in namespace Y,
    is refused by a node of Y holding the same fleet key (a miss, counted in
    ``remote_auth_failures``), never served; values written in Y are served.
    Both a block of one chunk (verified in round one) and one of five."""
    ns_x, ns_y = f"t-{uuid.uuid4().hex[:8]}", f"t-{uuid.uuid4().hex[:8]}"
    fleet = key_file(tmp_path, "fleet.key", os.urandom(32))
    x = node(cluster.url, ns_x, "--remote-key-file", fleet)
    y_writer = node(cluster.url, ns_y, "--remote-key-file", fleet)
    y = node(cluster.url, ns_y, "--remote-key-file", fleet)
    rc = cluster.client()
    try:
        big = np.frombuffer(pattern(300_000, 13), dtype=np.uint8).copy()  # 5 chunks
        small = np.frombuffer(pattern(1000, 14), dtype=np.uint8).copy()  # 1 chunk
        own = np.frombuffer(pattern(200_000, 15), dtype=np.uint8).copy()
        with x.connect() as k:
            k.put("replay/big", big)
            k.put("replay/small", small)
        wait_written(x, 2)
        with y_writer.connect() as k:
            k.put("replay/own", own)
        wait_written(y_writer, 1)
        for name, chunks in (("replay/big", 5), ("replay/small", 1)):
            for i in range(chunks):
                copy_value(rc, redis_key(ns_x, name, i), redis_key(ns_y, name, i))
            assert rc.exists(redis_key(ns_x, name, chunks)) == 0
        with y.connect() as k:
            for name in ("replay/big", "replay/small"):
                with pytest.raises(kachedb.NotFound):
                    k.get(name)
                assert k.lookup([name]) == 0
            got = k.get_numpy("replay/own")
            assert got.tobytes() == own.tobytes()
            del got
        st = remote(y)
        assert st["remote_fills"] == 1, st
        assert st["remote_auth_failures"] >= 2 and st["remote_corrupt"] == 0, st
        assert y.stats()["blocks"] == 1
        # The values are good in their own namespace: a node of X serves them.
        x2 = node(cluster.url, ns_x, "--remote-key-file", fleet)
        try:
            with x2.connect() as k:
                got = k.get_numpy("replay/big")
                assert got.tobytes() == big.tobytes()
                del got
            assert remote(x2)["remote_fills"] == 1 and remote(x2)["remote_auth_failures"] == 0
        finally:
            x2.stop()
        assert_clean(x, y_writer, y)
    finally:
        rc.close()
        for d in (x, y_writer, y):
            d.stop()


def tenant_rows(d: Daemon) -> dict:
    return {t["name"]: t for t in d.stats()["tenants"]}


def test_fills_count_for_the_tenant_whose_miss_started_them_within_its_limit(cluster):
    """Node A writes two chains of 1 MiB blocks through; on node B a client of
    tenant ``t1`` (``--tenant-limit t1=4MiB``) looks them up, one chain after
    the other. The filled blocks count for t1 (not for ``default``), t1 stays
    within its limit by evicting its own filled blocks, and a block of the
    default tenant on B is left alone. Bytes read back are right."""
    ns = f"t-{uuid.uuid4().hex[:8]}"
    mib = 1 << 20
    a = node(cluster.url, ns)
    b = node(cluster.url, ns, "--tenant-limit", "t1=4MiB")
    chains = [[f"tenant/{c}/{i}" for i in range(3)] for c in range(2)]
    data = {k: np.frombuffer(pattern(mib, 100 + 10 * c + i), dtype=np.uint8).copy()
            for c, ks in enumerate(chains) for i, k in enumerate(ks)}
    try:
        with a.connect() as ka:
            for ks in chains:
                ka.put_many(ks, [data[k] for k in ks], chain=True)
        wait_written(a, len(data))
        with b.connect() as kd:
            kd.put("tenant/default-own", np.full(2 * mib, 5, dtype=np.uint8))
        default_bytes = tenant_rows(b)["default"]["bytes"]
        assert default_bytes >= 2 * mib
        with kachedb.connect(b.socket, tenant="t1") as kt:
            assert kt.lookup(chains[0]) == 3
            rows = tenant_rows(b)
            assert rows["t1"]["blocks"] == 3 and rows["t1"]["bytes"] == 3 * mib, rows["t1"]
            assert rows["default"]["blocks"] == 1 and rows["default"]["bytes"] == default_bytes, rows["default"]
            # The second chain does not fit beside the first within 4 MiB:
            # t1's own filled blocks make room.
            assert kt.lookup(chains[1]) == 3
            rows = tenant_rows(b)
            assert rows["t1"]["bytes"] <= 4 * mib and rows["t1"]["limit_bytes"] == 4 * mib, rows["t1"]
            assert rows["t1"]["evictions"] >= 2, rows["t1"]
            assert rows["default"]["blocks"] == 1 and rows["default"]["bytes"] == default_bytes, rows["default"]
            assert rows["default"]["evictions"] == 0, rows["default"]
            for k in chains[1]:
                got = kt.get_numpy(k)
                assert got.tobytes() == data[k].tobytes(), k
                del got
        st = remote(b)
        assert st["remote_fills"] == 6 and st["remote_corrupt"] == 0 and st["remote_errors"] == 0, st
        with b.connect() as kd:
            got = kd.get_numpy("tenant/default-own")
            assert int(got.min()) == 5 == int(got.max())
            del got
        assert_clean(a, b)
    finally:
        a.stop()
        b.stop()
