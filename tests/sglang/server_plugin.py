"""An SGLang general plugin for ``test_sglang_server.py``: the test copies this
file into a temporary folder as ``kachedb_sglang_test_plugin.py``, next to a
``kachedb_sglang_test_plugin-0.dist-info/entry_points.txt`` naming
``register`` in SGLang's general-plugin group (``sglang.srt.plugins``), and
puts that folder on the servers' ``PYTHONPATH`` with ``SGLANG_PLUGINS`` naming
only this plugin; nothing is installed. SGLang calls ``register`` in every
process it starts (``sglang.srt.plugins.load_plugins``: in its scheduler
process first thing in ``run_scheduler_process``, before it publishes the
server arguments and builds the ``Scheduler``); the hooks are registered with
SGLang's own ``HookRegistry``.

Two hooks let the real server run on a machine without CUDA, and only there
(``torch.cuda.is_available()`` false):

* SGLang's HiCache host pool registers its buffer with CUDA
  (``cudaHostRegister``: ``pin_memory`` is always on): here it is plain host
  memory (``pin_memory=False``);
* SGLang's HiCache copies between the device KV pool and the host pool with
  sgl_kernel's ``transfer_kv_direct`` (``--hicache-io-backend direct``,
  ``--hicache-mem-layout layer_first``), which SGLang's CPU build does not
  have: here it is the same copy in torch (per layer, the rows of the given
  token indices: ``dst[dst_indices] = src[src_indices]``).

And a probe, after the real ``Scheduler`` is built in the real scheduler
process (SGLang's cache controller has then created the KacheDB backend
through its storage factory and registered its host pool): it writes, to
``$KACHEDB_TEST_PROBE_OUT``, the process's role and ids, the server arguments
SGLang published there, the backend's ``kachedb_stats()`` (its namespace and
fields), and what a page round trip through that backend and the server's own
host pool gave: first a lookup and load of prompt P's pages (SGLang's page
hashes of fixed tokens), then a store of P's pages filled with random bytes
(seed ``$KACHEDB_TEST_PROBE_SEED``), with the SHA-256 of the pages loaded and
stored. The server then goes on starting."""

import hashlib
import json
import os
import traceback

#: Prompt P of the probe: its tokens (within the test model's vocabulary) and pages.
PROBE_PAGES = 4


def _probe_tokens(page_size):
    return [(i * 13) % 400 + 5 for i in range(PROBE_PAGES * page_size)]


def _page_digests(host, indices, page_size):
    """The SHA-256 of each page's bytes in the host pool (its flat data page)."""
    import torch

    out = []
    for s in range(0, len(indices), page_size):
        page = host.get_data_page(int(indices[s]), flat=True).contiguous().view(-1).view(torch.uint8)
        out.append(hashlib.sha256(page.numpy().tobytes()).hexdigest())
    return out


def _probe(backends):
    import torch
    from sglang.srt import runtime_context as rc
    from sglang.srt.mem_cache.utils import get_hash_str

    from kachedb.sglang.keys import SERVER_FIELDS

    ctx = rc.get_context()
    published = ctx.resolved_server_args_dict()
    out = {
        "pid": os.getpid(),
        "ppid": os.getppid(),
        "role": rc.publish_role(),
        "published": {k: published.get(k) for k in SERVER_FIELDS},
        "backends": [type(b).__name__ for b in backends],
    }
    kb = [b for b in backends if hasattr(b, "kachedb_stats")]
    if len(kb) != 1:
        return out
    b = kb[0]
    host = b.mem_pool_host
    ps = int(host.page_size)
    out["host_pool"] = {"class": type(host).__name__, "layout": host.layout, "page_size": ps,
                        "dtype": str(host.dtype), "pin_memory": bool(host.pin_memory)}
    out["stats_at_start"] = b.kachedb_stats()
    keys = get_hash_str(_probe_tokens(ps), None, page_size=ps)
    keys = list(keys) if isinstance(keys, (list, tuple)) else [keys]
    n = len(keys)
    idx = host.alloc(n * ps)
    try:
        g = torch.Generator().manual_seed(int(os.environ.get("KACHEDB_TEST_PROBE_SEED", "0")))
        for s in range(0, n * ps, ps):  # known bytes, to tell a load from untouched slots
            page = host.get_data_page(int(idx[s]), flat=True)
            host.set_from_flat_data_page(int(idx[s]), torch.zeros(page.numel(), dtype=page.dtype))
        read = {"exists": b.batch_exists(keys), "get": b.batch_get_v1(keys, idx)}
        read["digests"] = _page_digests(host, idx, ps)
        for s in range(0, n * ps, ps):
            page = host.get_data_page(int(idx[s]), flat=True)
            data = torch.randint(0, 256, (page.numel() * page.element_size(),), generator=g, dtype=torch.uint8)
            host.set_from_flat_data_page(int(idx[s]), data.view(page.dtype))
        write = {"set": b.batch_set_v1(keys, idx), "digests": _page_digests(host, idx, ps)}
    finally:
        host.free(idx)
    out.update(read=read, write=write, stats=b.kachedb_stats())
    return out


def register():
    import torch
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    backends = []

    if not torch.cuda.is_available():
        import sglang.srt.mem_cache.pool_host.mha as mha

        def host_memory(*args, **kwargs):
            kwargs["pin_memory"] = False
            return args, kwargs

        def transfer_kv_direct(src_layers, dst_layers, src_indices, dst_indices, page_size):
            src_indices, dst_indices = src_indices.to(torch.long), dst_indices.to(torch.long)
            for src, dst in zip(src_layers, dst_layers):
                dst[dst_indices.to(dst.device)] = src[src_indices.to(src.device)].to(dst.device)

        HookRegistry.register("sglang.srt.mem_cache.pool_host.base.HostKVCache.__init__", host_memory,
                              HookType.BEFORE)
        if not hasattr(mha, "transfer_kv_direct"):
            mha.transfer_kv_direct = transfer_kv_direct

    def created(result, *args, **kwargs):
        backends.append(result)
        return result

    def scheduler_built(result, *args, **kwargs):
        path = os.environ.get("KACHEDB_TEST_PROBE_OUT")
        if path:
            try:
                out = _probe(backends)
            except Exception:
                out = {"error": traceback.format_exc(), "pid": os.getpid()}
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(out, f, default=str)
            os.replace(tmp, path)
        return result

    HookRegistry.register("sglang.srt.mem_cache.storage.StorageBackendFactory.create_backend", created,
                          HookType.AFTER)
    HookRegistry.register("sglang.srt.managers.scheduler.Scheduler.__init__", scheduler_built, HookType.AFTER)
