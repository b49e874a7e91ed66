"""Sizes (``Case``), the producer's payload, the consumer's checksum and the
formatting of sizes and times."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30

FULL_SIZES = "64KiBx10000,64MiB,512MiB,2GiB"
QUICK_SIZES = "64KiBx200,64MiB"
SAMPLE_STRIDE = 509  # int64 words: 4072 bytes, so every 4 KiB page is read


class Case:
    """``count`` tensors of ``nbytes`` each, f16 KV-shaped (k/v, layers, kv heads,
    tokens, head dim) like a Llama-3-8B cache: 4 KiB per token per layer."""

    def __init__(self, label: str, nbytes: int, count: int) -> None:
        if nbytes <= 0 or nbytes % 4096:
            raise ValueError(f"size {label!r}: bytes per tensor must be a positive multiple of 4 KiB")
        if count <= 0:
            raise ValueError(f"size {label!r}: count must be positive")
        self.label, self.nbytes, self.count = label, nbytes, count
        pages = nbytes // 4096
        layers = 32 if pages % 32 == 0 and pages >= 32 * 16 else 1
        self.shape = (2, layers, 8, pages // layers, 128)

    @property
    def total(self) -> int:
        return self.nbytes * self.count

    def to_dict(self) -> dict:
        return {"label": self.label, "nbytes": self.nbytes, "count": self.count}

    @classmethod
    def from_dict(cls, d: dict) -> "Case":
        return cls(d["label"], d["nbytes"], d["count"])


_UNITS = {"": 1, "b": 1, "k": KIB, "kb": KIB, "kib": KIB, "m": MIB, "mb": MIB, "mib": MIB, "g": GIB, "gb": GIB, "gib": GIB}


def parse_size(spec: str) -> Case:
    """``64MiB``, ``2GiB``, ``64KiBx10000`` (10 000 tensors of 64 KiB)."""
    s = spec.strip()
    count = 1
    if "x" in s.lower():
        s, c = s.lower().split("x", 1)
        count = int(c.replace("_", ""))
    num = s.rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
    unit = s[len(num):].lower()
    if unit not in _UNITS or not num:
        raise ValueError(f"cannot parse size {spec!r} (e.g. 64MiB, 2GiB, 64KiBx10000)")
    nbytes = int(float(num) * _UNITS[unit])
    return Case(spec.strip(), nbytes, count)


def fmt_bytes(n: float) -> str:
    for unit, div in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= div:
            v = n / div
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n:.0f} B"


def fmt_time(s: Optional[float]) -> str:
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "–"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1.0:
        return f"{s * 1e3:.3g} ms" if s < 0.1 else f"{s * 1e3:.0f} ms"
    return f"{s:.2f} s"


def fmt_ratio(r: float) -> str:
    """``2.3×``; two decimals near 1 so that 0.97× does not read as a tie."""
    return f"{r:.2f}×" if r < 1.1 else f"{r:.1f}×"


def case_title(c: Case) -> str:
    return f"{fmt_bytes(c.nbytes)} ×{c.count:,}".replace(",", " ") if c.count > 1 else fmt_bytes(c.nbytes)


def import_torch():
    import torch

    return torch


def make_payload(case: Case) -> list:
    """``case.count`` separate private tensors (one storage each) of words that
    depend on their position."""
    torch = import_torch()
    words = case.nbytes // 8
    big = torch.arange(words * case.count, dtype=torch.int64)
    big.mul_(0x5851F42D4C957F2D).add_(12345)
    if case.count == 1:
        return [big.view(torch.float16).view(case.shape)]
    rows = big.view(case.count, words)
    return [rows[i].clone().view(torch.float16).view(case.shape) for i in range(case.count)]


class Payload:
    """The producer's tensors: allocated and filled once per size (like a model's
    KV cache, resident and warm), then changed in place before every repetition
    so that every word differs from the previous repetition's (stale or partial
    data fails the check)."""

    DELTA = 0x9E3779B97F4A7C1

    def __init__(self, case: Case) -> None:
        self.case = case
        self.ts = make_payload(case)

    def next(self, private_copies: bool = False) -> list:
        torch = import_torch()
        for t in self.ts:
            t.view(-1).view(torch.int64).add_(self.DELTA)
        if private_copies:  # new private memory (torch.multiprocessing moves it to shm)
            return [t.clone() for t in self.ts]
        return list(self.ts)


def digest(tensors: Sequence[Any]) -> int:
    """A checksum that reads every 4 KiB page of every tensor: per tensor, the sum
    of a strided sample of int64 words (the first word included) and the last
    word, combined with position weights so that order matters too."""
    torch = import_torch()
    if not tensors:
        return 0
    us = [t.reshape(-1).view(torch.int64) for t in tensors]
    samples = torch.stack([u[::SAMPLE_STRIDE] for u in us])  # copies the samples: reads every page
    lasts = torch.stack([u[-1] for u in us])
    w = torch.arange(1, len(us) + 1, dtype=torch.int64)
    a = int((samples.sum(dim=1) * w).sum())
    b = int((samples[:, 0] * (3 * w + 1)).sum())
    c = int((lasts * (7 * w + 5)).sum())
    mask = (1 << 64) - 1
    return ((a & mask) * 0x100000001B3 ^ (b & mask) << 1 ^ (c & mask)) & mask


def usable(tensors: Sequence[Any], case: Case) -> None:
    torch = import_torch()
    if len(tensors) != case.count:
        raise AssertionError(f"consumer got {len(tensors)} tensors, expected {case.count}")
    for t in tensors:
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != case.shape or t.dtype != torch.float16:
            raise AssertionError(f"consumer got {type(t).__name__} {getattr(t, 'shape', None)} {getattr(t, 'dtype', None)}")
