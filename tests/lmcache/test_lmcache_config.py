"""kachedb.lmcache's configuration, plugin loading and key namespace (no engine: seconds)."""

import json
import subprocess
import sys

import pytest

import kachedb
import kachedb.lmcache
from kachedb.lmcache import keys


def test_config_is_accepted_by_lmcache_and_names_the_adapter(tmp_path):
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.storage_backend.connector import ConnectorAdapter
    from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

    sock = str(tmp_path / "d.sock")
    cfg = kachedb.lmcache.config(sock, namespace="tenant-a", retry_seconds=2)
    lmc = LMCacheEngineConfig.from_defaults(chunk_size=16, local_cpu=True, max_local_cpu_size=0.1, **cfg)
    assert lmc.remote_storage_plugins == ["kachedb"]
    extra = lmc.extra_config
    assert extra["remote_storage_plugin.kachedb.socket"] == sock
    assert extra["remote_storage_plugin.kachedb.namespace"] == "tenant-a"
    assert extra["remote_storage_plugin.kachedb.retry_seconds"] == 2.0
    # the class it names is what LMCache's plugin loader accepts
    import importlib

    mod = importlib.import_module(extra["remote_storage_plugin.kachedb.module_path"])
    adapter_cls = getattr(mod, extra["remote_storage_plugin.kachedb.class_name"])
    assert issubclass(adapter_cls, ConnectorAdapter)
    assert issubclass(mod.KacheDBConnector, RemoteConnector)


def test_tenant_option_and_bad_tenant(tmp_path):
    cfg = kachedb.lmcache.config(str(tmp_path / "d.sock"), tenant="team-a")
    assert cfg["extra_config"]["remote_storage_plugin.kachedb.tenant"] == "team-a"
    assert "remote_storage_plugin.kachedb.tenant" not in kachedb.lmcache.config(str(tmp_path / "d.sock"))["extra_config"]
    with pytest.raises(ValueError, match="not a tenant name"):
        kachedb.lmcache.config(tenant="no spaces")
    out = subprocess.run([sys.executable, "-m", "kachedb", "lmcache-config", "--tenant", "_x"], capture_output=True, text=True)
    assert out.returncode == 2 and "not a tenant name" in out.stderr


def test_max_pinned_bytes_option(tmp_path):
    sock = str(tmp_path / "d.sock")
    cfg = kachedb.lmcache.config(sock, max_pinned_bytes=1 << 20)
    assert cfg["extra_config"]["remote_storage_plugin.kachedb.max_pinned_bytes"] == 1 << 20
    assert "remote_storage_plugin.kachedb.max_pinned_bytes" not in kachedb.lmcache.config(sock)["extra_config"]
    with pytest.raises(ValueError):
        kachedb.lmcache.config(sock, max_pinned_bytes=-1)
    out = subprocess.run([sys.executable, "-m", "kachedb", "lmcache-config", "--socket", sock, "--max-pinned-bytes", "0"],
                         check=True, capture_output=True, text=True).stdout
    assert json.loads(out) == kachedb.lmcache.config(sock, max_pinned_bytes=0)


def test_adapter_claims_kachedb_plugin_urls_only():
    from kachedb.lmcache.connector import KacheDBConnectorAdapter

    a = KacheDBConnectorAdapter()
    assert a.can_parse("plugin://kachedb")
    assert a.can_parse("plugin://kachedb.node-b")
    for url in ("plugin://fs", "plugin://kachedbx", "plugin://fs.kachedb", "redis://kachedb:1", "kachedb"):
        assert not a.can_parse(url), url


def test_instance_names_and_bad_names(tmp_path):
    cfg = kachedb.lmcache.config(str(tmp_path / "b.sock"), name="kachedb.b")
    assert cfg["remote_storage_plugins"] == ["kachedb.b"]
    assert cfg["extra_config"]["remote_storage_plugin.kachedb.b.socket"] == str(tmp_path / "b.sock")
    for bad in ("redis", "kachedbx", ""):
        with pytest.raises(ValueError):
            kachedb.lmcache.config(name=bad)


def test_socket_defaults_like_connect(monkeypatch):
    monkeypatch.setenv("KACHEDB_SOCKET", "/tmp/somewhere/k.sock")
    assert kachedb.lmcache.config()["extra_config"]["remote_storage_plugin.kachedb.socket"] == "/tmp/somewhere/k.sock"
    monkeypatch.delenv("KACHEDB_SOCKET")
    assert kachedb.lmcache.config()["extra_config"]["remote_storage_plugin.kachedb.socket"] == kachedb.default_socket_path()


def test_cli_prints_the_same_json(tmp_path):
    sock = str(tmp_path / "x.sock")
    out = subprocess.run([sys.executable, "-m", "kachedb", "lmcache-config", "--socket", sock, "--namespace", "t"],
                         check=True, capture_output=True, text=True).stdout
    assert json.loads(out) == kachedb.lmcache.config(sock, namespace="t")
    bad = subprocess.run([sys.executable, "-m", "kachedb", "lmcache-config", "--name", "redis"], capture_output=True, text=True)
    assert bad.returncode == 2 and "kachedb" in bad.stderr


def test_package_imports_without_lmcache_or_torch():
    code = (
        "import sys; sys.modules['lmcache'] = None; sys.modules['torch'] = None\n"
        "import kachedb.lmcache\n"
        "cfg = kachedb.lmcache.config('/tmp/k.sock')\n"
        "assert cfg['remote_storage_plugins'] == ['kachedb'], cfg\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


BASE = dict(fmt="KV_2LTD", shapes=[[2, 4, 16, 32]], dtypes=["torch.bfloat16"], chunk_size=16, use_mla=False)


@pytest.mark.parametrize("change", [
    {"fmt": "KV_MLA_FMT"}, {"shapes": [[2, 4, 16, 64]]}, {"shapes": [[2, 4, 16, 32], [2, 2, 16, 32]]},
    {"dtypes": ["torch.float16"]}, {"chunk_size": 256}, {"use_mla": True}, {"salt": "tenant-b"},
])
def test_namespace_separates_layouts(change):
    a = keys.namespace_digest(keys.namespace_fields(**BASE))
    b = keys.namespace_digest(keys.namespace_fields(**dict(BASE, **change)))
    assert len(a) == 16 and a != b


def test_namespace_is_stable_and_keys_are_namespaced():
    f = keys.namespace_fields(**BASE)
    assert f["layout_version"] == keys.LAYOUT_VERSION
    assert f["dtypes"] == ["bfloat16"]
    ns = keys.namespace_digest(f)
    assert ns == keys.namespace_digest(keys.namespace_fields(**BASE))
    k = keys.chunk_key(ns, "m@1@0@abc@bfloat16")
    assert k == ns + b"m@1@0@abc@bfloat16"
    assert kachedb.key_of(k) != kachedb.key_of(keys.chunk_key(keys.namespace_digest(dict(f, salt="x")), "m@1@0@abc@bfloat16"))


def test_cli_output_works_as_lmcache_config_file_and_env(tmp_path, monkeypatch):
    """What the docs show: the CLI's JSON in the file LMCACHE_CONFIG_FILE names
    (JSON is YAML), or the two environment variables."""
    from lmcache.v1.config import LMCacheEngineConfig

    sock = str(tmp_path / "x.sock")
    out = subprocess.run([sys.executable, "-m", "kachedb", "lmcache-config", "--socket", sock],
                         check=True, capture_output=True, text=True).stdout
    cfg = json.loads(out)
    path = tmp_path / "lmcache.yaml"
    path.write_text(json.dumps(dict(cfg, chunk_size=256, local_cpu=True, max_local_cpu_size=1.0)))
    from_file = LMCacheEngineConfig.from_file(str(path))
    assert from_file.remote_storage_plugins == ["kachedb"]
    assert from_file.extra_config == cfg["extra_config"]
    monkeypatch.setenv("LMCACHE_REMOTE_STORAGE_PLUGINS", "kachedb")
    monkeypatch.setenv("LMCACHE_EXTRA_CONFIG", json.dumps(cfg["extra_config"]))
    from_env = LMCacheEngineConfig.from_env()
    assert from_env.remote_storage_plugins == ["kachedb"]
    assert from_env.extra_config == cfg["extra_config"]
