"""What makes two engines' KV bytes equal, as far as the model files say: the
model's identity, its config file's digest and its weight files. The engine
integrations (``kachedb.vllm``, ``kachedb.sglang``) build their key namespaces
from these and from the engine's own settings. Imports no engine and no torch."""

from __future__ import annotations

import hashlib
import os
from typing import Any, List, Mapping, Optional


def canonical(obj: Any) -> Any:
    """``obj`` with mappings sorted and unknown objects turned into strings, so
    its JSON is stable across processes."""
    if isinstance(obj, Mapping):
        return {str(k): canonical(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [canonical(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return str(obj)


def weights_fingerprint(model: str) -> List[Any]:
    """Names and sizes of the weight files of a local model directory (cheap:
    no file is read). Empty for a hub id or a directory without weights."""
    if not os.path.isdir(model):
        return []
    out = []
    for name in sorted(os.listdir(model)):
        if name.endswith((".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")):
            try:
                out.append([name, os.path.getsize(os.path.join(model, name))])
            except OSError:
                pass
    return out


def config_file_digest(model: str) -> Optional[str]:
    """sha256 of a local model directory's config.json, else ``None``."""
    path = os.path.join(model, "config.json")
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def model_identity(model: str, revision: Optional[str] = None) -> str:
    """A local directory's real path, else the hub id with its revision."""
    if os.path.isdir(model):
        return "dir:" + os.path.realpath(model)
    return f"hub:{model}@{revision or 'main'}"
