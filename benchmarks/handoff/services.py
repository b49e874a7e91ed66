"""The servers some transports need (the KacheDB daemon, redis-server, a Ray
cluster), started on demand and stopped after use, and Ray's actors."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from typing import Any, Callable, Optional, Tuple

from .cases import Case, MIB, Payload, digest, fmt_bytes, import_torch, usable
from .transports import TransportError, quiet_warnings, set_pdeathsig, single_threaded_torch


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
                                    stderr=subprocess.DEVNULL, preexec_fn=set_pdeathsig)
            r = redis.Redis(host="127.0.0.1", port=port)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and proc.poll() is None:
                try:
                    r.ping()
                    r.close()
                    self.redis, self.redis_port = proc, port
                    self.log(f"  redis-server {redis_version(exe)} on 127.0.0.1:{port}, maxmemory {fmt_bytes(maxmem)}")
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


def redis_version(exe: str) -> str:
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


def ray_actor_classes() -> Tuple[Any, Any]:
    import ray

    @ray.remote(num_cpus=0)
    class RayConsumer:
        """ray.get of the refs (zero-copy numpy views of the object store) ->
        torch.from_numpy."""

        def __init__(self) -> None:
            quiet_warnings()
            single_threaded_torch()

        def recv(self, refs: list, case_d: dict) -> dict:
            tc0 = time.perf_counter()
            torch = import_torch()
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
            quiet_warnings()
            single_threaded_torch()
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
