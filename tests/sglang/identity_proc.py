"""One SGLang scheduler-like process for the server-identity tests: for each
server configuration in turn it publishes SGLang's ``ServerArgs`` the way a
scheduler process does (``runtime_context.publish(..., role="scheduler")``,
last publish wins) — or, for a configuration without ``args``, leaves the
process without any (``runtime_context.reset_context()``) — then builds a
fresh host pool and the KacheDB backend as SGLang's cache controller does, and
reads, then writes pages: ``python identity_proc.py SPEC.json``.

SPEC: ``socket``, ``pages``, ``expected`` (a folder: the bytes each
configuration stores, ``NAME--PROMPT.pt``, for the processes after it) and
``configs``: ``[{"name", "args": {ServerArgs fields} or null, "extra": {extra
config entries}, "read": [prompts], "write": [prompts]}]``.

Read: counts a prompt's pages with ``batch_exists``, loads them with
``batch_get_v1`` into slots holding known bytes, and names the stored
configurations whose bytes were loaded (``equal_to``) or says the slots were
left untouched. Write: fills a prompt's pages with random KV (a seed per
configuration name: other settings, other KV) and stores them with
``batch_set_v1``. Writes a JSON result: per configuration, the namespace
fields, each prompt's results and the backend's ``kachedb_stats()``."""

import json
import sys
import zlib
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pools  # noqa: E402

spec = json.loads(Path(sys.argv[1]).read_text())
n_pages = int(spec["pages"])
ps = pools.PAGE_SIZE
expected_dir = Path(spec["expected"])
expected_dir.mkdir(parents=True, exist_ok=True)
kv = pools.device_pool()
out = {}


def keys_of(prompt: str):
    base = {"P": 1000, "Q": 3000, "R": 5000, "S": 7000}[prompt]
    return pools.page_hashes(list(range(base, base + n_pages * ps)))


def stored(prompt: str):
    """The bytes each configuration stored for ``prompt``, by configuration name."""
    return {f.name.split("--")[0]: torch.load(f) for f in sorted(expected_dir.glob(f"*--{prompt}.pt"))}


for c in spec["configs"]:
    if c.get("args") is None:
        pools.unpublish_server_args()
    else:
        pools.publish_server_args(**c["args"])
    host = pools.host_pool(kv, "page_first")
    b = pools.backend(spec["socket"], host, publish=False, extra=c.get("extra"))
    st = b.kachedb_stats()
    rec = {"server": st["fields"]["server"], "namespace": st["namespace_v1"], "refused": st["refused"]}
    for prompt in c.get("read", []):
        keys = keys_of(prompt)
        idx = host.alloc(n_pages * ps)
        pools.fill_random(host, idx, seed=7)
        before = pools.pages_bytes(host, idx)
        r = {"exists": b.batch_exists(keys), "get": b.batch_get_v1(keys, idx)}
        got = pools.pages_bytes(host, idx)
        r["equal_to"] = sorted(
            name for name, pages in stored(prompt).items() if all(torch.equal(a, e) for a, e in zip(got, pages))
        )
        r["untouched"] = all(torch.equal(a, e) for a, e in zip(got, before))
        rec[prompt] = r
    for prompt in c.get("write", []):
        idx = host.alloc(n_pages * ps)
        pools.fill_random(host, idx, seed=zlib.crc32(c["name"].encode()))
        rec[prompt] = {"set": b.batch_set_v1(keys_of(prompt), idx)}
        torch.save(pools.pages_bytes(host, idx), expected_dir / f"{c['name']}--{prompt}.pt")
    rec["stats"] = b.kachedb_stats()
    out[c["name"]] = rec
    b.close()

Path(spec["out"]).write_text(json.dumps(out))
