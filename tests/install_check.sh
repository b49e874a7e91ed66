#!/usr/bin/env bash
# make install-check: the distribution as users install it, each way into a new virtual
# environment (no system site-packages, nothing of the source tree), then
# tests/install_check.py in it (kachedb --version and serve, connect(start=True), a put,
# a zero-copy numpy get from another process):
#   wheel   the wheel file ($1, `make wheel`: manylinux_2_28)
#   sdist   the sdist file ($2, built from source by pip: Rust toolchain needed)
#   source  `pip install <checkout>` (the source tree)
#   git     `pip install git+file://<checkout>` (the committed HEAD)
#   debian11  the wheel in a Debian 11 root (glibc 2.31, Python 3.9), made with
#           debootstrap at $DEBIAN11_ROOT; needs root and debootstrap, else listed as skipped.
# The from-source paths share one cargo target directory ($INSTALL_CHECK_TARGET_DIR,
# default the checkout's target/): the environments are new, the compiled crates are reused.
# Usage: tests/install_check.sh WHEEL SDIST   (PYTHON: the interpreter that makes the venvs)
set -euo pipefail
WHEEL=$(realpath "$1"); SDIST=$(realpath "$2")
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python3}
DEBIAN11_ROOT=${DEBIAN11_ROOT:-$ROOT/target/debian11-root}
export CARGO_TARGET_DIR=${INSTALL_CHECK_TARGET_DIR:-$ROOT/target}
CHECK=$ROOT/tests/install_check.py
WORK=$(mktemp -d /tmp/kdb-install-check-XXXXXX)
MOUNTS=()
cleanup() {
  for ((i=${#MOUNTS[@]}-1; i>=0; i--)); do umount "${MOUNTS[$i]}" 2>/dev/null || umount -l "${MOUNTS[$i]}" || true; done
  rm -rf "$WORK"
}
trap cleanup EXIT
RESULTS=()

# path NAME PIP-ARGS...: a new venv, pip install PIP-ARGS, the checks; records the time.
path() {
  local name=$1; shift
  local t0=$SECONDS venv=$WORK/$name
  echo "== $name: pip install $*"
  "$PYTHON" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@"
  local t1=$SECONDS
  (cd "$WORK" && env -u PYTHONPATH -u KACHEDB_BIN "$venv/bin/python" "$CHECK" "$WORK/$name-run")
  RESULTS+=("$name: ok (install $((t1 - t0)) s, checks $((SECONDS - t1)) s)")
}

path wheel "$WHEEL"
path sdist "$SDIST"
path source "$ROOT"
path git "git+file://$ROOT"

echo "== debian11: the wheel in a Debian 11 (bullseye) root"
if [ "$(id -u)" != 0 ] || ! command -v debootstrap >/dev/null; then
  if [ "${KACHEDB_REQUIRE_PRIVILEGED_TESTS:-}" = 1 ]; then
    echo "install-check: the Debian 11 check needs root and debootstrap, and KACHEDB_REQUIRE_PRIVILEGED_TESTS=1 (CI) forbids skipping it" >&2
    exit 1
  fi
  RESULTS+=("debian11: SKIPPED: needs root and debootstrap (apt-get install debootstrap, or make system-deps as root)")
else
  t0=$SECONDS
  if [ ! -x "$DEBIAN11_ROOT/usr/bin/python3" ]; then
    echo "   debootstrap bullseye into $DEBIAN11_ROOT (first time only, a few minutes)"
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip bullseye "$DEBIAN11_ROOT" \
      http://deb.debian.org/debian >"$WORK/debootstrap.log" 2>&1 || { cat "$WORK/debootstrap.log"; exit 1; }
  fi
  # numpy for its Python 3.9, fetched here (the root needs no network).
  mkdir -p "$WORK/wheels"
  "$PYTHON" -m pip download -q --disable-pip-version-check "numpy>=1.22" --python-version 3.9 --only-binary=:all: \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WORK/wheels"
  cp "$WHEEL" "$CHECK" "$WORK/wheels/"
  in=/tmp/kdb-install-check
  rm -rf "$DEBIAN11_ROOT$in"; mkdir -p "$DEBIAN11_ROOT$in"; cp -a "$WORK/wheels" "$DEBIAN11_ROOT$in/"
  for m in proc dev dev/shm; do
    if [ "$m" = proc ]; then mount -t proc proc "$DEBIAN11_ROOT/proc"; else mount --bind "/$m" "$DEBIAN11_ROOT/$m"; fi
    MOUNTS+=("$DEBIAN11_ROOT/$m")
  done
  echo "   $(chroot "$DEBIAN11_ROOT" ldd --version | head -1); $(chroot "$DEBIAN11_ROOT" python3 --version)"
  chroot "$DEBIAN11_ROOT" /usr/bin/env -i PATH=/usr/bin:/bin HOME=/root /bin/sh -ec "
    python3 -m venv $in/venv
    $in/venv/bin/pip install -q --disable-pip-version-check --no-index --find-links $in/wheels kachedb-shm
    cd $in && $in/venv/bin/python $in/wheels/install_check.py $in/run"
  rm -rf "$DEBIAN11_ROOT$in"
  RESULTS+=("debian11: ok ($((SECONDS - t0)) s)")
fi

echo "== install check"
printf '   %s\n' "${RESULTS[@]}"
