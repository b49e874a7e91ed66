"""One SGLang scheduler-like process for the server-identity test: for each
server configuration it publishes SGLang's ``ServerArgs`` the way a scheduler
process does (``runtime_context.publish(..., role="scheduler")``, last publish
wins), then builds a fresh host pool and the KacheDB backend as SGLang's cache
controller does, and stores or reads pages: ``python identity_proc.py SPEC.json``.

role "write": per configuration, fills the pages of prompts with random KV (a
seed per configuration: other settings, other KV) and stores them with
``batch_set_v1``; saves the bytes. role "read": per configuration, counts each
prompt's pages with ``batch_exists`` and loads them with ``batch_get_v1``,
comparing the bytes with each writer configuration's. Writes a JSON result."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import pools  # noqa: E402

spec = json.loads(Path(sys.argv[1]).read_text())
n_pages = int(spec["pages"])
ps = pools.PAGE_SIZE
kv = pools.device_pool()
out = {}


def publish(args: dict) -> None:
    from sglang.srt.runtime_context import publish as _publish
    from sglang.srt.server_args import ServerArgs

    _publish(ServerArgs(model_path=spec["model"], device="cpu", **args), role="scheduler")


def keys_of(prompt: str):
    base = {"P": 1000, "Q": 3000}[prompt]
    return pools.page_hashes(list(range(base, base + n_pages * ps)))


if spec["role"] == "write":
    expected = {}
    for i, c in enumerate(spec["configs"]):
        publish(c["args"])
        host = pools.host_pool(kv, "page_first")
        b = pools.backend(spec["socket"], host)
        rec = {"fields": b.kachedb_stats()["fields"].get("server")}
        for prompt in c["prompts"]:
            idx = host.alloc(n_pages * ps)
            pools.fill_random(host, idx, seed=100 + i)
            rec[prompt] = b.batch_set_v1(keys_of(prompt), idx)
            expected[f"{c['name']}/{prompt}"] = pools.pages_bytes(host, idx)
        rec["stats"] = b.kachedb_stats()
        out[c["name"]] = rec
        b.close()
    torch.save(expected, spec["expected"])
else:
    expected = torch.load(spec["expected"])
    for c in spec["configs"]:
        publish(c["args"])
        host = pools.host_pool(kv, "page_first")
        b = pools.backend(spec["socket"], host)
        rec = {}
        for prompt in ("P", "Q"):
            keys = keys_of(prompt)
            idx = host.alloc(n_pages * ps)
            r = {"exists": b.batch_exists(keys), "get": b.batch_get_v1(keys, idx)}
            got = pools.pages_bytes(host, idx)
            # whose bytes were loaded: the writer configuration whose pages they equal
            r["equal_to"] = sorted(
                name for name, pages in expected.items()
                if name.endswith("/" + prompt) and all(torch.equal(a, e) for a, e in zip(got, pages))
            )
            rec[prompt] = r
        out[c["name"]] = rec
        b.close()

Path(spec["out"]).write_text(json.dumps(out))
