"""The docs cite only what exists: every file path, every ``test_*`` name and
every ``file.rs::function`` that README.md, RELIABILITY.md and docs/*.md name
is in the tree. A renamed test or a moved file fails here, naming the doc."""

from __future__ import annotations

import os
import re
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Top-level folders a cited path starts with.
_ROOTS = ("crates", "bindings", "tests", "benchmarks", "docs", "examples", "deploy", "harness", "fuzz")
_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./-]*\w)" % "|".join(_ROOTS))
_TEST = re.compile(r"(?<![\w.])(test_\w+)")
_RS_FN = re.compile(r"(?<![\w/])(\w+\.rs)::(\w+)")


def _docs():
    names = ["README.md", "RELIABILITY.md"] + sorted(
        os.path.join("docs", f) for f in os.listdir(os.path.join(REPO, "docs")) if f.endswith(".md")
    )
    return {n: open(os.path.join(REPO, n), encoding="utf-8").read() for n in names}


def _tracked():
    out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                         capture_output=True, text=True, check=True)
    return [p for p in out.stdout.splitlines() if os.path.exists(os.path.join(REPO, p))]


def _sources(files, suffixes):
    text = {}
    for p in files:
        if p.endswith(suffixes):
            with open(os.path.join(REPO, p), encoding="utf-8", errors="replace") as f:
                text[p] = f.read()
    return text


def _exists(path, files):
    full = os.path.join(REPO, path)
    if os.path.exists(full):
        return True
    # A path the build or a run makes (git-ignored): a folder some tracked file is under.
    return any(f.startswith(path.rstrip("/") + "/") for f in files)


# Paths the docs name that a build or a run creates (not in the tree).
_GENERATED = ("bindings/python/python/kachedb/bin/kachedb",)


def test_every_cited_path_exists():
    files = _tracked()
    missing = []
    for doc, text in _docs().items():
        for m in _PATH.finditer(text):
            path = m.group(1).rstrip(".")
            if "*" in path or path in _GENERATED or path.startswith(_GENERATED):
                continue
            if not _exists(path, files):
                missing.append(f"{doc}: {path}")
    assert not missing, "cited paths that do not exist:\n" + "\n".join(sorted(set(missing)))


def test_every_cited_test_name_exists():
    files = _tracked()
    sources = "\n".join(_sources(files, (".py", ".rs")).values())
    defined = set(re.findall(r"\b(?:def|fn)\s+(test_\w+)", sources))
    defined |= {os.path.splitext(os.path.basename(p))[0] for p in files if p.endswith((".py", ".rs"))}  # modules
    missing = []
    for doc, text in _docs().items():
        for name in set(_TEST.findall(text)):
            if name not in defined and not name.endswith("_"):
                missing.append(f"{doc}: {name}")
    assert not missing, "cited tests that do not exist:\n" + "\n".join(sorted(missing))


def test_every_cited_rust_function_exists_in_a_file_of_that_name():
    files = _tracked()
    by_name = {}
    for p, src in _sources(files, (".rs",)).items():
        by_name.setdefault(os.path.basename(p), []).append(src)
    missing = []
    for doc, text in _docs().items():
        for file, fn in set(_RS_FN.findall(text)):
            srcs = by_name.get(file)
            if not srcs:
                missing.append(f"{doc}: {file} (no such file)")
            elif not any(re.search(r"\bfn\s+%s\b|\bmod\s+%s\b" % (fn, fn), s) for s in srcs):
                missing.append(f"{doc}: {file}::{fn}")
    assert not missing, "cited Rust functions that do not exist:\n" + "\n".join(sorted(missing))


def _broken_tables(text):
    """Line numbers where a blank line splits a table: a row, a blank line, then
    a row that does not start a table of its own (no `| --- |` line after it)."""
    lines = text.splitlines()
    bad = []
    for i in range(2, len(lines)):
        if lines[i - 2].startswith("|") and not lines[i - 1].strip() and lines[i].startswith("|"):
            nxt = lines[i + 1] if i + 1 < len(lines) else ""
            if not re.match(r"^\|\s*:?-{3,}", nxt):
                bad.append(i + 1)
    return bad


def test_no_table_is_split_by_a_blank_line():
    broken = [f"{doc}: line {n}" for doc, text in _docs().items() for n in _broken_tables(text)]
    assert not broken, "tables split by a blank line (the rows after it render as text):\n" + "\n".join(broken)


def test_the_checker_catches_a_missing_citation(tmp_path):
    """The patterns do find citations (so a passing run means something)."""
    text = "see `crates/kachedb-shm/src/nope.rs`, `test_no_such_test` and `ring.rs::no_such_fn`."
    assert [m.group(1) for m in _PATH.finditer(text)] == ["crates/kachedb-shm/src/nope.rs"]
    assert _TEST.findall(text) == ["test_no_such_test"]
    assert _RS_FN.findall(text) == [("ring.rs", "no_such_fn")]
    assert not _exists("crates/kachedb-shm/src/nope.rs", _tracked())
    assert _broken_tables("| a | b |\n| --- | --- |\n| 1 | 2 |\n\n| 3 | 4 |\n") == [5]
    assert _broken_tables("| a |\n| --- |\n\n| b |\n| --- |\n") == []
