"""One SGLang process with real host pools and the KacheDB backend, for the
two-process tests: ``python pool_proc.py SPEC.json``.

role "write": per layout, fills pages of a fresh host pool with random KV,
stores them with ``batch_set_v1`` (and, through a second backend on the generic
interface, with ``batch_set``), and saves their bytes for the reader.
role "read": per layout, fresh pools; counts the stored pages with
``batch_exists`` and loads them with ``batch_get_v1`` into other slots, then
compares bytes; also misses, partial prefixes, other namespaces, the generic
interface, and the daemon's pins after the loads. Writes a JSON result."""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import kachedb  # noqa: E402
import pools  # noqa: E402

spec = json.loads(Path(sys.argv[1]).read_text())
sock = spec["socket"]
n_pages = int(spec["pages"])
ps = pools.PAGE_SIZE
expected_path = Path(spec["expected"])
out = {"layouts": {}}


def prompt(layout: str):
    """A prompt's tokens and SGLang's page keys for them (different per layout)."""
    base = 1000 if layout == "page_first" else 5000
    toks = list(range(base, base + n_pages * ps))
    return toks, pools.page_hashes(toks)


kv = pools.device_pool()

if spec["role"] == "write":
    expected = {}
    for layout in spec["layouts"]:
        _, keys = prompt(layout)
        host = pools.host_pool(kv, layout)
        idx = host.alloc(n_pages * ps)
        pools.fill_random(host, idx, seed=7 if layout == "page_first" else 8)
        b = pools.backend(sock, host)
        set_v1 = b.batch_set_v1(keys, idx)
        again = b.batch_set_v1(keys, idx)  # already stored: skipped, still True
        # the generic interface, as SGLang's controller drives it without interface_v1
        g = pools.backend(sock, host, interface_v1=False)
        set_generic = g.batch_set(keys, [host.get_data_page(int(idx[i * ps]), flat=True) for i in range(n_pages)])
        expected[layout] = pools.pages_bytes(host, idx)
        out["layouts"][layout] = {
            "keys": keys,
            "host_indices": idx.tolist(),
            "set_v1": set_v1,
            "set_v1_again": again,
            "set_generic": set_generic,
            "stats": b.kachedb_stats(),
            "generic_stats": g.kachedb_stats(),
        }
        b.close()
        g.close()
    torch.save(expected, expected_path)
else:
    expected = torch.load(expected_path)
    with kachedb.connect(sock) as kc:
        for layout in spec["layouts"]:
            toks, keys = prompt(layout)
            host = pools.host_pool(kv, layout)
            host.alloc((n_pages + 3) * ps)  # slots past the writer's
            idx = host.alloc(n_pages * ps)
            b = pools.backend(sock, host)
            unknown = pools.page_hashes(toks + [7] * ps)[-1:]  # a page nobody stored, chained after the prompt
            r = {"host_indices": idx.tolist()}
            r["exists_all"] = b.batch_exists(keys)
            r["exists_with_tail"] = b.batch_exists(keys + unknown)
            r["exists_gap"] = b.batch_exists(keys[:3] + unknown + keys[3:])
            r["exists_one"] = b.exists(keys[0])
            r["exists_unknown"] = b.exists(unknown[0])
            r["zero_before"] = all(int(p.count_nonzero()) == 0 for p in pools.pages_bytes(host, idx))
            r["get_v1"] = b.batch_get_v1(keys, idx)
            r["pins_after_get"] = kc.stats()["pins"]
            got = pools.pages_bytes(host, idx)
            r["equal"] = [bool(torch.equal(a, e)) for a, e in zip(got, expected[layout])]
            # a load whose third page is missing: the leading two, nothing past the gap
            idx2 = host.alloc(n_pages * ps)
            gap = keys[:2] + unknown + keys[3:]
            r["get_v1_gap"] = b.batch_get_v1(gap, idx2)
            got2 = pools.pages_bytes(host, idx2)
            r["gap_equal_leading"] = [bool(torch.equal(got2[i], expected[layout][i])) for i in range(2)]
            r["gap_rest_untouched"] = all(int(p.count_nonzero()) == 0 for p in got2[2:])
            # other namespaces: another model, another TP rank, another salt
            r["exists_other_model"] = pools.backend(sock, host, model="test-org/other-model").batch_exists(keys)
            r["exists_other_tp_rank"] = pools.backend(sock, host, tp_rank=1, tp_size=2).batch_exists(keys)
            r["exists_other_salt"] = pools.backend(sock, host, namespace="tenant-b").batch_exists(keys)
            # the generic interface: the flat pages the writer's batch_set stored
            g = pools.backend(sock, host, interface_v1=False)
            r["generic_exists"] = g.batch_exists(keys)
            dummies = [host.get_dummy_flat_data_page() for _ in keys]
            pages = g.batch_get(keys, dummies)
            r["generic_equal"] = [
                p is not None and bool(torch.equal(p.contiguous().view(torch.uint8), e))
                for p, e in zip(pages, expected[layout])
            ]
            one = g.get(keys[0])  # no target: a private copy
            r["generic_get_private"] = one is not None and bool(torch.equal(one.view(torch.uint8), expected[layout][0]))
            del pages, one
            r["pins_after_generic"] = kc.stats()["pins"]
            r["stats"] = b.kachedb_stats()
            out["layouts"][layout] = r
            b.close()
            g.close()

Path(spec["out"]).write_text(json.dumps(out))
