#!/usr/bin/env bash
# Builds the `kachedb` binary of the commit tests/upgrade/PREVIOUS names, once
# per commit, and prints its path: target/upgrade-prev/kachedb-<commit>.
# The tree comes from this repository's history (`git archive`) into
# target/upgrade-prev/src-<commit>; it builds in its own target directory,
# target/upgrade-prev-target (seeded, the first time, with this tree's
# release dependencies, so that only the workspace's crates compile).
set -euo pipefail
root=$(git rev-parse --show-toplevel)
cd "$root"
commit=$(awk '$1 == "commit" { print $2 }' tests/upgrade/PREVIOUS)
[ -n "$commit" ] || { echo "tests/upgrade/PREVIOUS names no commit" >&2; exit 1; }
out=target/upgrade-prev/kachedb-$commit
if [ -x "$out" ]; then echo "$root/$out"; exit 0; fi
git cat-file -e "$commit^{commit}" 2>/dev/null || {
  echo "commit $commit (tests/upgrade/PREVIOUS) is not in this clone: git fetch --unshallow" >&2; exit 1; }
src=target/upgrade-prev/src-$commit
rm -rf "$src" && mkdir -p "$src"
git archive "$commit" | tar -x -C "$src"
# Fresh mtimes: cargo must not take a crate of the seed (this tree's) for the
# commit's, whose files git archive dates back to the commit.
find "$src" -type f -exec touch {} +
tgt=$root/target/upgrade-prev-target
if [ ! -d "$tgt/release" ] && [ -d target/release/deps ]; then
  mkdir -p "$tgt/release"
  cp -a target/release/deps target/release/build target/release/.fingerprint "$tgt/release/"
fi
start=$(date +%s)
(cd "$src" && CARGO_TARGET_DIR="$tgt" ${CARGO:-cargo} build --release --locked -p kachedb-cli --no-default-features >&2)
echo "== built kachedb of $commit in $(( $(date +%s) - start )) s" >&2
cp "$tgt/release/kachedb" "$out.tmp" && mv "$out.tmp" "$out"
rm -rf "$src"
echo "$root/$out"
