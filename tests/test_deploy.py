"""The deployment files in deploy/ (docs/deploy.md, "What is tested").

This machine has no systemd as PID 1, no container runtime and no Kubernetes.
The unit (alone and with the disk tier's drop-in, kachedb-disk.conf) is checked
with `systemd-analyze verify` (which must print nothing about it), its user with
`systemd-sysusers --root`, every command line in deploy/ against the built
`kachedb serve` (flags and values parse), and the unit's own command line is
run with a fake $NOTIFY_SOCKET: READY=1, MAINPID, the health probe and the
SIGHUP takeover that `systemctl reload` relies on. The drop-in's command line
is run as the unit would run it (as root: under a scratch uid, no capabilities,
no new privileges) on a directory standing in for the unit's StateDirectory=:
a block lands on disk, survives a takeover and a restart, and every system call
made meanwhile (traced) is one the unit's SystemCallFilter= allows. The
Containerfile and the DaemonSet are checked for structure (never built or
applied): they parse, and their paths, ports, ids and security settings agree
with each other and with the unit; the DaemonSet's init container script is run
on scratch directories with its capabilities only, and the daemon started as
the pod's uid on what it prepared.
"""
import json
import os
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from harness import privileged

# Every skip here is for a missing tool or privilege (systemd's tools, strace,
# root and setpriv): with KACHEDB_REQUIRE_PRIVILEGED_TESTS=1 (CI) it fails instead
# (harness/privileged.py).
pytestmark = [pytest.mark.timeout(180), pytest.mark.privileged]

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "kachedb.service"
DROPIN = DEPLOY / "kachedb-disk.conf"  # the disk tier's drop-in for the unit
SYSUSERS = DEPLOY / "kachedb.sysusers"
CONTAINERFILE = DEPLOY / "Containerfile"
DOCKERIGNORE = DEPLOY / "Containerfile.dockerignore"
DAEMONSET = DEPLOY / "kachedb-daemonset.yaml"
BIN = REPO / "target" / "release" / "kachedb"
INSTALLED = "/usr/local/bin/kachedb"  # where the unit expects the binary
SOCKET_DIR = "/run/kachedb"  # the socket directory on every host, container and node
DEFAULT_HEADROOM = 512 << 20  # `kachedb serve --headroom` default
STATE_DIR = "/var/lib/kachedb"  # the disk tier's home: the unit's StateDirectory=, the DaemonSet's hostPath
# The disk tier's index costs memory beside the region: measured 153 bytes per
# block on disk (100 000 blocks, RssAnon of a daemon that rebuilt its index after
# kill -9 against one with an empty DIR: 15.2 vs 0.7 MiB; docs/deploy.md); counted
# here as 256 per block of the smallest usual size, 64 KiB + the 4 KiB header.
INDEX_BYTES_PER_BLOCK = 256
SMALL_BLOCK_ON_DISK = (64 << 10) + 4096


# ---------------------------------------------------------------- helpers


def built_binary() -> Path:
    if not (BIN.is_file() and os.access(BIN, os.X_OK)):
        pytest.fail(f"{BIN} is not built: run `make build` first", pytrace=False)
    return BIN


def systemd_tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None)
    if path is None:
        pytest.skip(f"{name} not found: these checks need systemd's tools (apt-get install systemd, or make system-deps)")
    return path


def load_yaml_docs(path: Path) -> list:
    try:
        import yaml
    except ImportError:  # pyyaml comes with transformers, a CI dependency: fail, do not skip
        pytest.fail("checking the DaemonSet needs PyYAML: pip install pyyaml (or make setup)", pytrace=False)
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def unit_entries(text: str, path: Path = UNIT) -> list:
    """(section, key, value) of each assignment of a unit file (or drop-in),
    in order (comments skipped, backslash continuation lines joined)."""
    entries, section, buf = [], None, ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith(("#", ";"))):
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        line, buf = buf + line, ""
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep, f"{path}: not an assignment: {line!r}"
        entries.append((section, key.strip(), value.strip()))
    return entries


def unit_values(key: str, section: str = "Service") -> list:
    return [v for s, k, v in unit_entries(UNIT.read_text()) if s == section and k == key]


def unit_value(key: str, section: str = "Service") -> str:
    values = unit_values(key, section)
    assert len(values) == 1, f"{UNIT}: expected one {key}= in [{section}], found {values}"
    return values[0]


GID_EXPANSION = "$(id -g)"  # the one shell expansion the unit's ExecStart may use


def dropin_values(key: str, section: str = "Service") -> list:
    return [v for s, k, v in unit_entries(DROPIN.read_text(), DROPIN) if s == section and k == key]


def dropin_exec_start() -> str:
    """The drop-in's ExecStart=: an empty one (which drops the unit's), then its own."""
    values = dropin_values("ExecStart")
    assert len(values) == 2 and values[0] == "", (
        f"{DROPIN}: expected `ExecStart=` (empty: drops the unit's) then one ExecStart=, found {values}")
    return values[1]


def shell_script(exec_start: str) -> str:
    """The script of ExecStart=/bin/sh -c '…' ($$ undone: systemd's literal $)."""
    words = shlex.split(exec_start.lstrip("@-:+!").replace("$$", "$"))
    assert words[:2] == ["/bin/sh", "-c"] and len(words) == 3, f"ExecStart is not `/bin/sh -c '…'`: {words}"
    return words[2]


def unit_shell_script() -> str:
    return shell_script(unit_value("ExecStart"))


def dropin_shell_script() -> str:
    return shell_script(dropin_exec_start())


def script_daemon_argv(script: str) -> list:
    """The daemon's argv as a unit's `sh -c 'exec …'` starts it."""
    words = shlex.split(script)
    assert words[0] == "exec", f"the unit's shell must `exec` the daemon, so that it keeps the pid systemd started: {words}"
    assert "$" not in " ".join(w for w in words if w != GID_EXPANSION), f"unexpected shell expansion in {words}"
    return words[1:]


def unit_daemon_argv() -> list:
    """The daemon's argv as the unit starts it (through its `sh -c 'exec …'`)."""
    return script_daemon_argv(unit_shell_script())


def dropin_daemon_argv() -> list:
    """The daemon's argv as the unit with the disk drop-in starts it."""
    return script_daemon_argv(dropin_shell_script())


def serve_args(argv: list) -> list:
    """The arguments after `kachedb serve` in argv."""
    assert Path(argv[0]).name == "kachedb" and argv[1] == "serve", f"not `kachedb serve …`: {argv}"
    return argv[2:]


def flag_value(args: list, flag: str):
    """The value of `--flag V` or `--flag=V` in args (the last one), else None."""
    value = None
    for i, a in enumerate(args):
        if a == flag:
            assert i + 1 < len(args), f"{flag} without a value in {args}"
            value = args[i + 1]
        elif a.startswith(flag + "="):
            value = a.split("=", 1)[1]
    return value


def parse_size(s: str) -> int:
    """`kachedb serve --size` notation (binary units, crates/kachedb-shm/src/units.rs)."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", s)
    assert m, f"not a size: {s!r}"
    mult = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
            "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tb": 1 << 40,
            "tib": 1 << 40}[m.group(2).lower()]
    return int(float(m.group(1)) * mult)


def parse_systemd_bytes(s: str) -> int:
    """MemoryMax= notation: K, M, G, T are powers of 1024."""
    m = re.fullmatch(r"([0-9]+)([KMGT]?)", s)
    assert m, f"not a byte count systemd reads: {s!r}"
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}[m.group(2)]


def parse_k8s_quantity(s) -> int:
    m = re.fullmatch(r"([0-9]+)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(s))
    assert m, f"not a memory quantity this test reads: {s!r}"
    unit = m.group(2) or ""
    mult = {"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40,
            "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[unit]
    return int(m.group(1)) * mult


def disk_index_estimate(disk_size: int) -> int:
    """Memory the disk tier's index takes with `disk_size` bytes of small blocks."""
    return disk_size // SMALL_BLOCK_ON_DISK * INDEX_BYTES_PER_BLOCK


def disk_queue_bytes(args: list) -> int:
    """--disk-queue-bytes, or its default: a quarter of --size, at most 1 GiB."""
    given = flag_value(args, "--disk-queue-bytes")
    return parse_size(given) if given else min(parse_size(flag_value(args, "--size")) // 4, 1 << 30)


def port_of(addr: str) -> int:
    host, sep, port = addr.rpartition(":")
    assert sep and host and port.isdigit(), f"not HOST:PORT: {addr!r}"
    return int(port)


def serve_help_flags() -> set:
    out = subprocess.run([str(built_binary()), "serve", "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"^\s+(?:-\w, )?(--[a-z0-9][a-z0-9-]*)", out.stdout, re.M))


def assert_serve_accepts(args: list, what: str):
    """Every flag of `kachedb serve ARGS` exists, and every value parses: clap
    checks each value as it reads it, so ARGS + --help exits 0 only if all do."""
    flags = serve_help_flags()
    unknown = sorted({a.split("=", 1)[0] for a in args if a.startswith("--")} - flags)
    assert not unknown, f"{what}: `kachedb serve` has no {unknown} (its flags: {sorted(flags)})"
    out = subprocess.run([str(built_binary()), "serve", *args, "--help"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "Usage: kachedb serve" in out.stdout, (
        f"{what}: `kachedb serve {shlex.join(args)}` is refused:\n{out.stderr}")


def containerfile_instructions() -> list:
    """(INSTRUCTION, arguments) of the Containerfile, continuation lines joined."""
    out, buf = [], ""
    for raw in CONTAINERFILE.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        line, buf = buf + line, ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def containerfile_one(instruction: str):
    found = [rest for word, rest in containerfile_instructions() if word == instruction]
    assert len(found) == 1, f"{CONTAINERFILE}: expected one {instruction}, found {found}"
    return found[0]


def daemonset() -> dict:
    docs = load_yaml_docs(DAEMONSET)
    sets = [d for d in docs if d.get("kind") == "DaemonSet"]
    assert len(sets) == 1, f"{DAEMONSET}: expected one DaemonSet, found kinds {[d.get('kind') for d in docs]}"
    return sets[0]


def daemon_container(ds: dict) -> dict:
    containers = ds["spec"]["template"]["spec"]["containers"]
    assert len(containers) == 1, f"expected one container, found {[c.get('name') for c in containers]}"
    return containers[0]


# ---------------------------------------------------------------- the unit


def verify_unit(text: str, tmp: Path, dropin: str = None) -> list:
    """Lines `systemd-analyze verify` prints about a copy of the unit with
    `text` (the binary path pointing at the built one), and with `dropin` as
    its drop-in kachedb.service.d/disk.conf if given; [] if it is clean."""
    d = tmp / f"verify-{time.monotonic_ns()}"
    d.mkdir()
    unit = d / "kachedb.service"
    unit.write_text(text.replace(INSTALLED, str(built_binary())))
    env = None
    if dropin is not None:
        (d / "kachedb.service.d").mkdir()
        (d / "kachedb.service.d" / "disk.conf").write_text(dropin.replace(INSTALLED, str(built_binary())))
        # Drop-ins are looked up next to a unit found on the unit path (the
        # trailing ':' keeps the default directories after this one).
        env = {**os.environ, "SYSTEMD_UNIT_PATH": f"{d}:"}
    out = subprocess.run([systemd_tool("systemd-analyze"), "verify", str(unit)],
                         capture_output=True, text=True, timeout=120, env=env)
    lines = (out.stdout + out.stderr).splitlines()
    about_it = [ln for ln in lines if str(d) in ln or "kachedb" in ln]
    if out.returncode != 0:
        about_it.append(f"(exit status {out.returncode}) " + " | ".join(lines))
    return about_it


def test_unit_passes_systemd_analyze_verify(tmp_path):
    text = UNIT.read_text()
    assert INSTALLED in text
    problems = verify_unit(text, tmp_path)
    assert problems == [], "systemd-analyze verify:\n" + "\n".join(problems)


@pytest.mark.parametrize("good,bad", [
    ("ProtectHome=yes", "ProtecHome=yes"),  # an unknown directive
    ("MemoryMax=9G", "MemoryMax=9Q"),  # a value systemd cannot read
    ("Type=notify", "Type=notfy"),
])
def test_verify_check_catches_a_typo(tmp_path, good, bad):
    # systemd-analyze exits 0 on these (it ignores the line): the check above
    # must still fail, through what it prints.
    text = UNIT.read_text()
    assert good in text, f"{UNIT} no longer has {good!r}: update this test"
    assert verify_unit(text.replace(good, bad), tmp_path), f"a unit with {bad!r} passed the check"


def test_unit_with_the_disk_dropin_passes_systemd_analyze_verify(tmp_path):
    text = DROPIN.read_text()
    assert INSTALLED in text
    problems = verify_unit(UNIT.read_text(), tmp_path, dropin=text)
    assert problems == [], "systemd-analyze verify (unit + kachedb-disk.conf):\n" + "\n".join(problems)


@pytest.mark.parametrize("good,bad", [
    ("MemoryMax=10G", "MemoryMax=10Q"),  # a value systemd cannot read
    ("ExecStart=\n", ""),  # without the reset: two ExecStart= in a Type=notify unit, refused
    ("[Service]", "[Servic]"),  # an unknown section: everything in it ignored
])
def test_verify_check_reads_the_dropin(tmp_path, good, bad):
    # Proves the drop-in is read where the check above puts it, and checked.
    text = DROPIN.read_text()
    assert good in text, f"{DROPIN} no longer has {good!r}: update this test"
    assert verify_unit(UNIT.read_text(), tmp_path, dropin=text.replace(good, bad, 1)), (
        f"a drop-in with {good!r} -> {bad!r} passed the check")


def test_sysusers_creates_the_units_user_and_group(tmp_path):
    root = tmp_path / "root"
    (root / "etc").mkdir(parents=True)
    out = subprocess.run([systemd_tool("systemd-sysusers"), f"--root={root}", str(SYSUSERS)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "garbage" not in out.stderr.lower(), out.stdout + out.stderr
    user, group = unit_value("User"), unit_value("Group")
    passwd = {ln.split(":")[0]: ln.split(":") for ln in (root / "etc/passwd").read_text().splitlines()}
    groups = {ln.split(":")[0]: ln.split(":") for ln in (root / "etc/group").read_text().splitlines()}
    assert user in passwd, f"{SYSUSERS} does not create User={user}: {passwd}"
    assert group in groups, f"{SYSUSERS} does not create Group={group}: {groups}"
    # --allow-gid "$(id -g)" admits the daemon's primary group: it must be Group=.
    assert passwd[user][3] == groups[group][2], "the user's primary group is not the unit's Group="
    assert passwd[user][6].endswith("nologin")


def test_unit_settings_fit_the_daemon():
    assert unit_value("Type") == "notify"
    assert unit_value("NotifyAccess") == "all"  # a reload's successor reports READY=1/MAINPID
    assert re.fullmatch(r"/bin/kill -HUP \$MAINPID", unit_value("ExecReload"))
    args = serve_args(unit_daemon_argv())
    # SIGHUP must mean "take over", not the default "stop", or a reload stops the service.
    assert flag_value(args, "--on-sighup") == "takeover", args
    assert "--takeover" not in args  # the successor adds it; the first start has no daemon to take over

    sock = flag_value(args, "--socket")
    assert sock and Path(sock).parent == Path(SOCKET_DIR) == Path("/run") / unit_value("RuntimeDirectory"), (
        f"--socket {sock} is not in RuntimeDirectory= ({SOCKET_DIR})")
    # The daemon refuses a socket directory group or others can write (not sticky).
    assert int(unit_value("RuntimeDirectoryMode"), 8) & 0o022 == 0
    assert unit_value("RuntimeDirectoryPreserve") == "yes"
    assert unit_value("PrivateTmp") == "yes" and not sock.startswith("/tmp/")
    assert flag_value(args, "--allow-gid") == GID_EXPANSION, "the unit admits no group: engines of other uids are refused"

    size = parse_size(flag_value(args, "--size"))
    headroom = parse_size(flag_value(args, "--headroom") or str(DEFAULT_HEADROOM))
    mem_max = parse_systemd_bytes(unit_value("MemoryMax"))
    assert mem_max >= size + headroom + (256 << 20), (
        f"MemoryMax={unit_value('MemoryMax')} leaves no room beside --size + --headroom: the daemon would refuse to start")
    assert port_of(flag_value(args, "--metrics-addr")) == 9464

    # Settings that would break the daemon: PrivateUsers hides clients' uids
    # (SO_PEERCRED gives 65534), ProcSubset=pid hides /proc/meminfo.
    assert unit_values("PrivateUsers") in ([], ["no"])
    assert unit_values("ProcSubset") in ([], ["all"])
    families = unit_value("RestrictAddressFamilies").split()
    assert "AF_UNIX" in families and "AF_INET" in families
    assert int(unit_value("LimitNOFILE")) >= 4096  # one fd per client connection


def test_unit_has_a_state_directory_for_the_disk_tier():
    # ProtectSystem=strict leaves nothing writable but what the unit names:
    # StateDirectory= makes /var/lib/kachedb, owned by User=/Group= (chowned back
    # if not), writable inside the sandbox, kept across stops.
    assert unit_value("ProtectSystem") == "strict"
    assert Path("/var/lib") / unit_value("StateDirectory") == Path(STATE_DIR)
    # 0700: the daemon's own (the block files are engines' KV cache); and the
    # daemon refuses a DIR its group or others may write.
    assert int(unit_value("StateDirectoryMode"), 8) & 0o077 == 0
    # DynamicUser= would move it to /var/lib/private and change the uid clients trust.
    assert unit_values("DynamicUser") in ([], ["no"])
    # The sandbox settings the disk tier needs are those of the unit: the drop-in
    # changes only the command line and the memory limit.
    keys = {k for s, k, _ in unit_entries(DROPIN.read_text(), DROPIN)}
    assert keys <= {"ExecStart", "MemoryMax"}, f"{DROPIN} sets more than ExecStart= and MemoryMax=: {keys}"


def test_disk_dropin_is_the_units_command_line_with_the_disk():
    unit_argv, argv = unit_daemon_argv(), dropin_daemon_argv()
    # The drop-in repeats the unit's line and adds the disk flags after it, so
    # the two cannot drift apart unnoticed.
    assert argv[:len(unit_argv)] == unit_argv, (
        f"{DROPIN}'s ExecStart= is not the unit's with flags added at the end:\n{unit_argv}\n{argv}")
    added = argv[len(unit_argv):]
    assert added and all(not a.startswith("--") or a.startswith(("--disk", "--tenant-disk")) for a in added), added
    args = serve_args(argv)
    disk = flag_value(args, "--disk")
    assert disk and Path(STATE_DIR) in Path(disk).parents, f"--disk {disk} is not under StateDirectory= ({STATE_DIR})"
    assert not Path(disk).is_relative_to(Path(flag_value(args, "--socket")).parent)
    disk_size = parse_size(flag_value(args, "--disk-size"))
    size = parse_size(flag_value(args, "--size"))
    headroom = parse_size(flag_value(args, "--headroom") or str(DEFAULT_HEADROOM))
    mem = dropin_values("MemoryMax") or unit_values("MemoryMax")
    mem_max = parse_systemd_bytes(mem[-1])
    need = size + headroom + (256 << 20) + disk_index_estimate(disk_size)
    assert mem_max >= need, (
        f"MemoryMax={mem[-1]} < --size + --headroom + process + the disk index of --disk-size "
        f"({need >> 20} MiB): raise it in {DROPIN.name}")
    assert disk_queue_bytes(args) <= size // 2  # pinned megaslab memory while the disk is behind
    assert_serve_accepts([a if a != GID_EXPANSION else str(os.getegid()) for a in args], "the drop-in's ExecStart")
    script = dropin_shell_script().replace(INSTALLED, str(built_binary())) + " --help"
    out = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "Usage: kachedb serve" in out.stdout, f"{script}:\n{out.stderr}"


def test_unit_exec_start_is_accepted_by_the_binary():
    argv = unit_daemon_argv()
    assert argv[0] == INSTALLED
    args = serve_args(argv)
    assert_serve_accepts([a if a != GID_EXPANSION else str(os.getegid()) for a in args], "the unit's ExecStart")
    # The same through the unit's real shell text, `$(id -g)` and quoting included.
    script = unit_shell_script().replace(INSTALLED, str(built_binary())) + " --help"
    out = subprocess.run(["/bin/sh", "-c", script], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and "Usage: kachedb serve" in out.stdout, f"{script}:\n{out.stderr}"


class Notifications:
    """A fake $NOTIFY_SOCKET: each datagram's sender pid (SO_PASSCRED) and its KEY=VALUE lines."""

    def __init__(self, path: Path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(str(path))
        self.got = []  # (sender pid, {key: value})

    def wait_for(self, pred, timeout: float, what: str, alive=None):
        deadline = time.monotonic() + timeout
        while True:
            for sender, msg in self.got:
                if pred(sender, msg):
                    return sender, msg
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {what} within {timeout} s; received: {self.got}")
            if alive is not None and not alive():
                raise AssertionError(f"the daemon exited before {what}; received: {self.got}")
            self.receive(min(left, 0.2))

    def receive(self, timeout: float) -> bool:
        """Reads one datagram into `got`; False if none came within timeout."""
        self.sock.settimeout(timeout)
        try:
            data, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(struct.calcsize("iII")))
        except (socket.timeout, BlockingIOError):
            return False
        sender = None
        for level, kind, payload in anc:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                sender = struct.unpack("iII", payload[:struct.calcsize("iII")])[0]
        msg = dict(ln.split("=", 1) for ln in data.decode().splitlines() if "=" in ln)
        self.got.append((sender, msg))
        return True

    def drain(self):
        """Reads every datagram already queued."""
        while self.receive(0.05):
            pass

    def close(self):
        self.sock.close()


def gone(pid: int) -> bool:
    """Whether pid has exited (a zombie that nobody reaped counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def healthz(addr: str, within: float = 5.0):
    """GET /healthz's status and body: the first 200, or the last answer after
    `within` seconds (READY=1 may come a moment before the serve loop runs,
    when /healthz still answers 503)."""
    deadline = time.monotonic() + within
    while True:
        try:
            with urllib.request.urlopen(f"http://{addr}/healthz", timeout=5) as r:
                answer = r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            answer = e.code, e.read().decode()
        if answer[0] == 200 or time.monotonic() > deadline:
            return answer
        time.sleep(0.05)


def daemon_pid_serving(sock: Path) -> int:
    out = subprocess.run([str(built_binary()), "stats", "--json", "--socket", str(sock)],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    return int(json.loads(out.stdout)["daemon_pid"])


def test_units_command_line_notifies_systemd_and_reloads_by_takeover():
    """What Type=notify, NotifyAccess=all and ExecReload= rely on, with the
    unit's own flags (socket, size and metrics port moved to scratch values):
    READY=1 and MAINPID once it serves; on SIGHUP a successor takes over, the
    old daemon tells systemd the successor's pid before it exits (so systemd
    never sees its main pid gone), and the successor reports READY=1 itself."""
    args = serve_args(unit_daemon_argv())
    tmp = Path(tempfile.mkdtemp(prefix="kdeploy-"))  # short: AF_UNIX paths are limited to 107 bytes
    sock = tmp / "run" / "kachedb_0.sock"
    replace = {"--socket": str(sock), "--size": "64MiB", "--metrics-addr": "127.0.0.1:0"}
    run_args, i = [], 0
    while i < len(args):
        a = args[i]
        if a in replace:
            run_args += [a, replace[a]]
            i += 2
            continue
        run_args.append(str(os.getegid()) if a == GID_EXPANSION else a)
        i += 1
    assert all(flag_value(run_args, f) == v for f, v in replace.items()), run_args
    notify = Notifications(tmp / "notify")
    env = {k: v for k, v in os.environ.items() if not k.startswith("KACHEDB_")}
    env["NOTIFY_SOCKET"] = str(tmp / "notify")
    log = open(tmp / "daemon.log", "w+")
    first = subprocess.Popen([str(built_binary()), "serve", *run_args], stdin=subprocess.DEVNULL,
                             stdout=log, stderr=subprocess.STDOUT, env=env)
    successor = None
    try:
        try:
            notify.wait_for(lambda s, m: m.get("READY") == "1", 60, "READY=1", alive=lambda: first.poll() is None)
            assert any(m.get("MAINPID") == str(first.pid) for _, m in notify.got), notify.got
            assert sock.exists()
            assert daemon_pid_serving(sock) == first.pid  # ready means serving
            addr = re.search(r"metrics at http://([0-9.]+:[0-9]+)/metrics", (tmp / "daemon.log").read_text())
            assert addr, "no `metrics at http://…` line in the log"
            addr = addr.group(1)
            assert healthz(addr) == (200, "ok\n")  # the probe path of the DaemonSet

            seen = len(notify.got)
            first.send_signal(signal.SIGHUP)  # ExecReload=/bin/kill -HUP $MAINPID
            _, msg = notify.wait_for(lambda s, m: m.get("MAINPID", str(first.pid)) != str(first.pid), 60,
                                     "MAINPID of a successor")
            successor = int(msg["MAINPID"])
            cmdline = Path(f"/proc/{successor}/cmdline").read_bytes().split(b"\0")
            assert b"--takeover" in cmdline, cmdline
            notify.wait_for(lambda s, m: s == successor and m.get("READY") == "1", 60, "READY=1 from the successor")
            assert first.wait(timeout=30) == 0, "the old daemon did not exit cleanly after handing over"
            notify.drain()  # what the old daemon sent is queued by now
            # Sent by the old daemon itself, hence before it exited: systemd reads
            # notifications before it handles the exit, so it follows the pid.
            assert any(s == first.pid and m.get("MAINPID") == str(successor) for s, m in notify.got[seen:]), (
                f"the old daemon did not report the successor's pid before exiting: {notify.got[seen:]}")
            assert daemon_pid_serving(sock) == successor
            assert healthz(addr) == (200, "ok\n")  # the metrics listener went along
        except AssertionError:
            log.seek(0)
            print("daemon log:\n" + log.read())
            raise
    finally:
        for pid in (first.pid, successor):
            if pid and not gone(pid):
                os.kill(pid, signal.SIGTERM)
        first.wait(timeout=30)
        deadline = time.monotonic() + 30
        while successor and not gone(successor) and time.monotonic() < deadline:
            time.sleep(0.05)
        notify.close()
        log.close()
        shutil.rmtree(tmp, ignore_errors=True)
    assert not successor or gone(successor), f"the successor (pid {successor}) did not stop on SIGTERM"


# ---------------------------------------------------------------- the disk tier, as the unit runs it


def replace_flags(args: list, replace: dict) -> list:
    """args with the value of each flag in `replace` swapped (each must be there)."""
    out, i = [], 0
    while i < len(args):
        if args[i] in replace:
            out += [args[i], replace[args[i]]]
            i += 2
        else:
            out.append(args[i])
            i += 1
    assert all(flag_value(out, f) == v for f, v in replace.items()), (replace, args)
    return out


def free_id() -> int:
    """A number that is no user's and no group's here: the unit's `kachedb` stand-in."""
    used = set()
    for table in ("/etc/passwd", "/etc/group"):
        for line in Path(table).read_text().splitlines():
            fields = line.split(":")
            if len(fields) > 2 and fields[2].isdigit():
                used.add(int(fields[2]))
    return next(n for n in range(61000, 65000) if n not in used)


class DaemonUser:
    """Whom the daemon runs as here. As root: a scratch uid and gid, with no
    capabilities and no new privileges (the unit's User=, Group=,
    CapabilityBoundingSet=, AmbientCapabilities=, NoNewPrivileges=), and the
    clients with that gid as their primary group (the unit's --allow-gid) and
    KACHEDB_TRUST_UID, as an engine would. Otherwise: this test's own user."""

    def __init__(self, uid: int = None, gid: int = None):
        self.scratch = os.geteuid() == 0 and shutil.which("setpriv") is not None
        if not self.scratch and privileged.required():
            pytest.fail("the daemon would run as this test's own user: running it as the unit does needs root and setpriv "
                        f"({privileged.REQUIRE_VAR}=1 requires it)", pytrace=False)
        if self.scratch:
            self.uid = uid if uid is not None else free_id()
            self.gid = gid if gid is not None else self.uid
        else:
            self.uid, self.gid = os.geteuid(), os.getegid()

    def daemon(self, cmd: list) -> list:
        if not self.scratch:
            return cmd
        return ["setpriv", f"--reuid={self.uid}", f"--regid={self.gid}", "--clear-groups", "--nnp",
                "--bounding-set=-all", "--inh-caps=-all", *cmd]

    def client(self, cmd: list) -> list:
        return ["setpriv", f"--regid={self.gid}", "--clear-groups", *cmd] if self.scratch else cmd

    def client_env(self) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith("KACHEDB_")}
        env["KACHEDB_TRUST_UID"] = str(self.uid)
        return env

    def give(self, path: Path, mode: int):
        if self.scratch:
            os.chown(path, self.uid, self.gid)
        os.chmod(path, mode)


class StandIn:
    """Scratch directories for the unit's /run/kachedb (RuntimeDirectory=) and
    /var/lib/kachedb (StateDirectory=), owned and moded as systemd makes them."""

    def __init__(self, user: DaemonUser):
        self.tmp = Path(tempfile.mkdtemp(prefix="kdisk-"))  # short: AF_UNIX paths are limited to 107 bytes
        os.chmod(self.tmp, 0o755)  # the daemon's user reaches what is inside
        self.run = self.tmp / "run"
        self.state = self.tmp / "state"
        self.run.mkdir()
        self.state.mkdir()
        user.give(self.run, int(unit_value("RuntimeDirectoryMode"), 8))
        user.give(self.state, int(unit_value("StateDirectoryMode"), 8))

    def here(self, path: str) -> Path:
        """Where a path under the unit's StateDirectory= is in the stand-in."""
        return self.state / Path(path).relative_to(STATE_DIR)

    def remove(self):
        shutil.rmtree(self.tmp, ignore_errors=True)


def dropin_run_script(where: StandIn) -> tuple:
    """The drop-in's `sh -c` script with the socket, size and metrics port moved
    to scratch values and DIR into the stand-in state directory (`$(id -g)`,
    --disk-size and every other flag as they are), and DIR there."""
    argv = dropin_daemon_argv()
    disk = where.here(flag_value(serve_args(argv), "--disk"))
    args = replace_flags(serve_args(argv), {
        "--socket": str(where.run / "kachedb_0.sock"), "--size": "64MiB",
        "--metrics-addr": "127.0.0.1:0", "--disk": str(disk)})
    words = [str(built_binary()), "serve", *args]
    return "exec " + " ".join('"$(id -g)"' if w == GID_EXPANSION else shlex.quote(w) for w in words), disk


def stats_as(user: DaemonUser, sock: Path) -> dict:
    out = subprocess.run(user.client([str(built_binary()), "stats", "--json", "--socket", str(sock)]),
                         capture_output=True, text=True, timeout=30, env=user.client_env())
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def wait_stats(user: DaemonUser, sock: Path, pred, what: str, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = stats_as(user, sock)
        if pred(st):
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} within {timeout} s: " + json.dumps({k: v for k, v in st.items() if k.startswith("disk_")}))
        time.sleep(0.1)


BLOCK_CLIENT = r"""
import hashlib, json, sys, kachedb
sock, op, key = sys.argv[1:4]
c = kachedb.connect(sock)  # trusts the daemon's uid through $KACHEDB_TRUST_UID
if op == "put":
    data = b"".join(hashlib.sha256(f"{key}/{i}".encode()).digest() for i in range(8192))  # 256 KiB
    c.put(key, data)
elif op == "get":
    data = c.get_numpy(key).tobytes()
else:  # delete: answered once the disk copy's removal is durable
    data = b"deleted" if c.delete(key) else b"absent"
c.close()
print(json.dumps({"sha256": hashlib.sha256(data).hexdigest(), "len": len(data)}))
"""


def block_op(user: DaemonUser, sock: Path, op: str, key: str) -> dict:
    out = subprocess.run(user.client([sys.executable, "-c", BLOCK_CLIENT, str(sock), op, key]),
                         capture_output=True, text=True, timeout=60, env=user.client_env())
    assert out.returncode == 0, f"{op} {key}: {out.stderr}"
    return json.loads(out.stdout)


class UnitRun:
    """The drop-in's command line started as the unit starts it: `/bin/sh -c
    'exec …'` as the daemon's user, with a fake $NOTIFY_SOCKET; optionally under
    `strace -f` (which then is the process started, the daemon its child)."""

    def __init__(self, user: DaemonUser, where: StandIn, name: str, trace: bool = False):
        self.user, self.where = user, where
        script, self.disk = dropin_run_script(where)
        self.sock = where.run / "kachedb_0.sock"
        self.notify = Notifications(where.tmp / f"notify-{name}")
        user.give(where.tmp / f"notify-{name}", 0o600)  # the daemon's user sends to it
        self.log_path = where.tmp / f"{name}.log"
        self.log = open(self.log_path, "w+")
        self.trace = where.tmp / f"{name}.strace" if trace else None
        cmd = ["/bin/sh", "-c", script]
        if self.trace:
            # strace runs as the daemon's user, inside the same restrictions, so
            # the shell, `id` and every daemon (the successor too) are traced.
            self.trace.touch()
            user.give(self.trace, 0o600)
            cmd = ["strace", "-f", "-qq", "-o", str(self.trace), *cmd]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KACHEDB_")}
        env["NOTIFY_SOCKET"] = str(where.tmp / f"notify-{name}")
        self.proc = subprocess.Popen(user.daemon(cmd), stdin=subprocess.DEVNULL, stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env)
        self.pids = []  # every daemon pid seen (the first, successors)

    def ready(self) -> int:
        """Waits for READY=1; the main pid it reports."""
        sender, msg = self.notify.wait_for(lambda s, m: m.get("READY") == "1", 60, "READY=1",
                                           alive=lambda: self.proc.poll() is None)
        pid = int(next((m["MAINPID"] for s, m in self.notify.got if s == sender and "MAINPID" in m), sender))
        assert pid == sender, f"READY=1 from pid {sender}, MAINPID={pid}"
        self.pids.append(pid)
        return pid

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def stop(self, pid: int):
        """SIGTERM to the daemon (`systemctl stop`); waits for it and for the process started."""
        if not gone(pid):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 30
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(pid), f"the daemon (pid {pid}) did not stop on SIGTERM"
        self.proc.wait(timeout=30)

    def close(self):
        for pid in self.pids:
            if not gone(pid):
                os.kill(pid, signal.SIGTERM)
        if self.proc.poll() is None:
            self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.notify.close()
        self.log.close()


def run_disk_lifecycle(trace: bool = False) -> list:
    """The unit with the disk drop-in, as systemd would run it, through what an
    operator does to it: start, a block put and written behind to DIR, `systemctl
    reload` (a takeover: the successor adopts DIR), `systemctl restart` (an empty
    megaslab: the block comes back from DIR, same bytes). The strace files, if traced."""
    user = DaemonUser()
    where = StandIn(user)
    runs = []
    try:
        first = UnitRun(user, where, "first", trace)
        runs.append(first)
        try:
            pid = first.ready()
            disk = first.disk
            # The daemon made DIR in the state directory, its own, 0700, with its parts.
            for d in (disk, disk / "blocks", disk / "tmp"):
                st = d.stat()
                assert (st.st_uid, st.st_mode & 0o777) == (user.uid, 0o700), f"{d}: uid {st.st_uid} mode {st.st_mode:o}"
            assert (disk / "lock").read_text().strip() == str(pid)
            assert stats_as(user, first.sock)["disk_enabled"] is True

            put = block_op(user, first.sock, "put", "deploy-disk-block")
            block_op(user, first.sock, "put", "deploy-disk-deleted")
            st = wait_stats(user, first.sock, lambda s: s["disk_writes"] >= 2, "disk writes of the blocks")
            assert (st["disk_writes"], st["disk_blocks"], st["disk_errors"]) == (2, 2, 0), st
            # Without capabilities the tier's threads still got their class and nice value.
            assert "disk tier: running its threads SCHED_IDLE:" not in first.text()
            assert "disk tier: setting its threads' nice value" not in first.text()
            assert len(list((disk / "blocks").iterdir())) == 2
            # A DELETE removes the disk copy (durably) before it is answered.
            assert block_op(user, first.sock, "delete", "deploy-disk-deleted")["len"] == len(b"deleted")
            files = list((disk / "blocks").iterdir())
            assert len(files) == 1 and files[0].suffix == ".kdb", files
            fst = files[0].stat()
            assert fst.st_uid == user.uid and fst.st_mode & 0o077 == 0, (fst.st_uid, oct(fst.st_mode))
            assert fst.st_size >= 4096 + put["len"]

            # `systemctl reload`: the successor takes DIR over (descriptor and lock).
            os.kill(pid, signal.SIGHUP)
            _, msg = first.notify.wait_for(lambda s, m: m.get("MAINPID", str(pid)) != str(pid), 60,
                                           "MAINPID of a successor")
            successor = int(msg["MAINPID"])
            first.pids.append(successor)
            first.notify.wait_for(lambda s, m: s == successor and m.get("READY") == "1", 60,
                                  "READY=1 from the successor")
            deadline = time.monotonic() + 30
            while not gone(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert gone(pid), "the old daemon did not exit after handing over"
            assert "adopting the directory and lock" in first.text()
            st = wait_stats(user, first.sock, lambda s: s["disk_indexed"], "index rebuilt after the takeover")
            assert st["daemon_pid"] == successor and st["disk_blocks"] == 1, st
            assert (disk / "lock").read_text().strip() == str(successor)

            # `systemctl restart`: stop, start afresh on the same directory.
            first.stop(successor)
        finally:
            first.close()
        assert len(list((disk / "blocks").iterdir())) == 1

        again = UnitRun(user, where, "restart", trace)
        runs.append(again)
        try:
            pid = again.ready()
            assert stats_as(user, again.sock)["blocks"] == 0  # nothing in RAM
            got = block_op(user, again.sock, "get", "deploy-disk-block")
            assert got == put, "the block filled from disk differs from the one put"
            st = wait_stats(user, again.sock, lambda s: s["disk_indexed"], "index rebuilt after the restart")
            assert (st["disk_fills"], st["disk_recovered"], st["disk_torn"]) == (1, 1, 0), st
            again.stop(pid)
        finally:
            again.close()
        return [r.trace.read_text() for r in runs if r.trace]
    except AssertionError:
        for r in runs:
            print(f"---- {r.log_path.name}:\n{r.text() if not r.log.closed else r.log_path.read_text()}")
        raise
    finally:
        where.remove()


def test_disk_dropin_command_line_keeps_blocks_in_the_state_directory():
    """The drop-in's own command line (socket, size, metrics port moved; DIR in a
    stand-in for /var/lib/kachedb owned and moded as StateDirectory= makes it),
    run as the daemon's user: a block put lands on disk, stays through a reload
    (takeover) and comes back, same bytes, after a restart."""
    run_disk_lifecycle()


def syscalls_of(group: str, cache: dict = {}) -> set:
    """The system calls of a SystemCallFilter= item (a group expanded, as
    `systemd-analyze syscall-filter` lists it)."""
    if not group.startswith("@"):
        return {group}
    if group not in cache:
        out = subprocess.run([systemd_tool("systemd-analyze"), "syscall-filter", group],
                             capture_output=True, text=True, timeout=60)
        lines = out.stdout.splitlines()
        assert out.returncode == 0 and lines and lines[0].strip() == group, out.stdout + out.stderr
        names = set()
        for ln in lines[1:]:
            word = ln.strip()
            if word and not word.startswith("#"):
                names |= syscalls_of(word)
        cache[group] = names
    return cache[group]


def unit_allowed_syscalls() -> set:
    """What the unit's SystemCallFilter= lines allow: the allow-list, minus the `~` items."""
    allowed, denied = set(), set()
    for line in unit_values("SystemCallFilter"):
        deny = line.startswith("~")
        for item in line.lstrip("~").split():
            (denied if deny else allowed).update(syscalls_of(item))
    assert allowed, "the unit has no allow-list SystemCallFilter="
    return allowed - denied


STRACE_CALL = re.compile(r"^(\d+)\s+(?:<\.\.\. )?([a-z_][a-z0-9_]*)(\(| resumed>)")


def test_disk_tier_makes_only_system_calls_the_unit_allows():
    """The lifecycle above under `strace -f` (shell, `id -g`, the daemon, its
    successor and the restarted daemon): every system call made is in the
    unit's SystemCallFilter=, and none breaks RestrictRealtime=,
    RestrictAddressFamilies=, RestrictNamespaces= or MemoryDenyWriteExecute=.
    (systemd is not PID 1 here: this is the filter's list, not the kernel's
    seccomp, that is checked.)"""
    if shutil.which("strace") is None:
        pytest.skip("strace not found: tracing the daemon's system calls needs it (apt-get install strace)")
    traces = run_disk_lifecycle(trace=True)
    assert len(traces) == 2
    allowed = unit_allowed_syscalls()
    made, lines = set(), []
    for text in traces:
        for ln in text.splitlines():
            m = STRACE_CALL.match(ln)
            if m:
                made.add(m.group(2))
                lines.append(ln)
    # The trace saw the disk tier at work, and the scheduling class it asks for.
    for call in ("flock", "fdatasync", "sync_file_range", "unlinkat", "sched_setscheduler", "execve", "memfd_create"):
        assert call in made, f"no {call} in the trace: {sorted(made)}"
    assert made & {"renameat", "renameat2"}, sorted(made)
    refused = sorted(made - allowed)
    assert not refused, f"system calls the unit's SystemCallFilter= refuses (EPERM): {refused}"

    bad = []
    families = set(unit_value("RestrictAddressFamilies").split())
    for ln in lines:
        call = STRACE_CALL.match(ln).group(2)
        if call == "sched_setscheduler":
            policy = re.search(r"sched_setscheduler\(\d+, (\w+)", ln)
            if policy and policy.group(1) not in ("SCHED_OTHER", "SCHED_BATCH", "SCHED_IDLE"):
                bad.append(("RestrictRealtime=", ln))
        elif call in ("socket", "socketpair"):
            fam = re.search(r"socket(?:pair)?\((\w+)", ln)
            if fam and fam.group(1) not in families:
                bad.append(("RestrictAddressFamilies=", ln))
        elif call in ("clone", "clone3", "unshare", "setns"):
            if "CLONE_NEW" in ln or call == "setns":
                bad.append(("RestrictNamespaces=", ln))
        elif call in ("mmap", "mprotect", "pkey_mprotect"):
            if "PROT_EXEC" in ln and ("PROT_WRITE" in ln or call != "mmap"):
                bad.append(("MemoryDenyWriteExecute=", ln))
    assert not bad, "calls the unit's sandbox refuses:\n" + "\n".join(f"{what} {ln}" for what, ln in bad)


def refused_start(user: DaemonUser, where: StandIn) -> str:
    """Starts the drop-in's command line and returns its output, expecting it to exit non-zero."""
    script, _ = dropin_run_script(where)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KACHEDB_")}
    out = subprocess.run(user.daemon(["/bin/sh", "-c", script]), capture_output=True, text=True,
                         timeout=60, env=env, stdin=subprocess.DEVNULL)
    assert out.returncode != 0, f"the daemon started:\n{out.stdout}{out.stderr}"
    return out.stdout + out.stderr


@pytest.mark.parametrize("case", ["state directory not writable", "DIR group-writable", "DIR another user's"])
def test_daemon_refuses_a_disk_directory_the_unit_would_not_give_it(case):
    """Why StateDirectory= and its owner and mode: without them the daemon
    cannot make DIR, and it refuses a DIR others could write or another user owns."""
    user = DaemonUser()
    if case == "DIR another user's" and not user.scratch:
        pytest.skip("making a directory of another user needs root (and setpriv)")
    where = StandIn(user)
    try:
        disk = where.here(flag_value(serve_args(dropin_daemon_argv()), "--disk"))
        if case == "state directory not writable":
            # What ProtectSystem=strict without StateDirectory= leaves: a
            # directory the daemon's user cannot write (here: root's, or read-only).
            if user.scratch:
                os.chown(where.state, 0, 0)
                os.chmod(where.state, 0o755)
            else:
                os.chmod(where.state, 0o555)
            out = refused_start(user, where)
            assert str(disk) in out and "denied" in out.lower(), out
        elif case == "DIR group-writable":
            disk.mkdir(mode=0o700)
            user.give(disk, 0o770)
            out = refused_start(user, where)
            assert f"chmod go-w {disk}" in out, out
        else:
            # root's, writable through the daemon's group: what an fsGroup-managed
            # volume looks like (root:fsGroup, g+rwxs).
            disk.mkdir()
            os.chown(disk, 0, user.gid)
            os.chmod(disk, 0o2770)
            out = refused_start(user, where)
            assert f"chown {user.uid} {disk}" in out, out
    finally:
        os.chmod(where.state, 0o700)
        where.remove()



# ---------------------------------------------------------------- the image


def exec_form(rest: str, instruction: str) -> list:
    try:
        value = json.loads(rest)
    except json.JSONDecodeError:
        value = None
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), (
        f"{instruction} must be in exec form (a JSON array), so that the daemon is PID 1 and gets SIGTERM: {rest}")
    return value


def image_serve_args() -> list:
    entry = exec_form(containerfile_one("ENTRYPOINT"), "ENTRYPOINT")
    assert entry == ["kachedb", "serve"], entry
    return exec_form(containerfile_one("CMD"), "CMD")


def test_containerfile_structure():
    ins = containerfile_instructions()
    froms = [rest.split() for word, rest in ins if word == "FROM"]
    assert [f[0] for f in froms] == ["rust:1-bookworm", "debian:bookworm-slim"], froms
    build_stage = froms[0][2] if len(froms[0]) == 3 and froms[0][1].upper() == "AS" else None
    assert build_stage, f"the builder stage has no name: {froms[0]}"
    runs = " ".join(rest for word, rest in ins if word == "RUN")
    assert "cargo build --release --locked -p kachedb-cli" in runs and "kachedb-bench" not in runs
    copies_from = [rest.split() for word, rest in ins if word == "COPY" and rest.startswith("--from=")]
    assert [c[-1] for c in copies_from] == [INSTALLED], copies_from
    assert copies_from[0][0] == f"--from={build_stage}"

    # Every workspace member reaches the builder (Cargo loads all their manifests),
    # and the dockerignore file lets each COPY source through.
    members = re.search(r"members\s*=\s*\[(.*?)\]", (REPO / "Cargo.toml").read_text(), re.S)
    members = re.findall(r'"([^"]+)"', members.group(1))
    sources = [s for word, rest in ins if word == "COPY" and not rest.startswith("--")
               for s in rest.split()[:-1]]
    for m in members:
        assert any(f"{m}/Cargo.toml" == s or f"{m}/".startswith(s.rstrip("/") + "/") for s in sources), (
            f"workspace member {m} is not copied into the builder: {sources}")
    assert "Cargo.lock" in sources  # --locked
    allowed = [ln[1:].strip() for ln in DOCKERIGNORE.read_text().splitlines() if ln.startswith("!")]
    for s in sources:
        s = s.rstrip("/")
        assert s in allowed or f"{s}/**" in allowed, f"{DOCKERIGNORE.name} keeps {s} out of the build context"

    # Non-root, numeric; the socket directory exists, owned by it, not writable by others.
    user = containerfile_one("USER")
    m = re.fullmatch(r"(\d+):(\d+)", user)
    assert m and int(m.group(1)) != 0, f"USER {user}: give a numeric non-root uid:gid"
    args = image_serve_args()
    sock_dir = str(Path(flag_value(args, "--socket")).parent)
    assert sock_dir == SOCKET_DIR
    mk = re.search(r"install -d -o (\d+) -g (\d+) -m (0?[0-7]{3}) " + re.escape(sock_dir) + r"\b", runs)
    assert mk, f"the image does not create {sock_dir} for its user"
    assert (mk.group(1), mk.group(2)) == (m.group(1), m.group(2))
    assert int(mk.group(3), 8) & 0o022 == 0
    # The disk tier's home: a new named volume mounted there starts as the image's
    # directory, its user's, 0700 (the daemon makes DIR inside it).
    mk = re.search(r"install -d -o (\d+) -g (\d+) -m (0?[0-7]{3}) " + re.escape(STATE_DIR) + r"\b", runs)
    assert mk, f"the image does not create {STATE_DIR} for its user"
    assert (mk.group(1), mk.group(2)) == (m.group(1), m.group(2))
    assert int(mk.group(3), 8) & 0o077 == 0
    expose = containerfile_one("EXPOSE").split()
    assert expose == [str(port_of(flag_value(args, "--metrics-addr")))], expose
    assert flag_value(args, "--metrics-addr").startswith("0.0.0.0:")  # reachable from outside the container


def test_containerfile_command_line_is_accepted_by_the_binary():
    assert_serve_accepts(image_serve_args(), "the Containerfile's ENTRYPOINT + CMD")


# ---------------------------------------------------------------- the DaemonSet


def test_daemonset_structure():
    docs = load_yaml_docs(DAEMONSET)
    ds = daemonset()
    assert ds["apiVersion"] == "apps/v1"
    ns = ds["metadata"]["namespace"]
    assert ns == "kachedb"
    assert any(d.get("kind") == "Namespace" and d["metadata"]["name"] == ns for d in docs)
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    pod = ds["spec"]["template"]["spec"]
    # The region travels over the socket (SCM_RIGHTS): no host IPC namespace, no
    # host PIDs or network, no /dev/shm volume.
    for key in ("hostIPC", "hostPID", "hostNetwork"):
        assert not pod.get(key), f"{key} is set"
    assert isinstance(pod.get("terminationGracePeriodSeconds"), int)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert not any(v.get("emptyDir", {}).get("medium") == "Memory" for v in volumes.values())

    c = daemon_container(ds)
    assert "command" not in c, "the image's ENTRYPOINT (`kachedb serve`) must stay"
    args = c["args"]
    assert all(isinstance(a, str) for a in args), f"every arg must be a string (quote numbers): {args}"
    sock = flag_value(args, "--socket")
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    assert "/dev/shm" not in mounts
    mount = mounts.get(str(Path(sock).parent))
    assert mount, f"the socket's directory {Path(sock).parent} is not a mounted volume: {list(mounts)}"
    vol = volumes[mount["name"]]
    assert vol.get("hostPath", {}).get("path") == SOCKET_DIR, vol
    assert vol["hostPath"].get("type") == "DirectoryOrCreate"
    # Engines find the daemon at the same host path whether systemd or Kubernetes runs it.
    assert sock == flag_value(serve_args(unit_daemon_argv()), "--socket") == flag_value(image_serve_args(), "--socket")

    port = port_of(flag_value(args, "--metrics-addr"))
    assert port == port_of(flag_value(serve_args(unit_daemon_argv()), "--metrics-addr"))
    assert [p["containerPort"] for p in c["ports"]] == [port]
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": port}, (probe, c[probe])

    # Memory: the region is allocated up front and charged to this container.
    res = c["resources"]
    limit = parse_k8s_quantity(res["limits"]["memory"])
    assert parse_k8s_quantity(res["requests"]["memory"]) == limit
    size = parse_size(flag_value(args, "--size"))
    headroom = parse_size(flag_value(args, "--headroom") or str(DEFAULT_HEADROOM))
    disk_size = flag_value(args, "--disk-size")
    index = disk_index_estimate(parse_size(disk_size)) if disk_size else 0
    assert limit >= size + headroom + (256 << 20) + index, (
        f"memory limit {limit} < --size + --headroom + process + the disk index ({index >> 20} MiB)")

    # Who: the image's uid; admitted group = runAsGroup; locked down.
    uid, gid = map(int, containerfile_one("USER").split(":"))
    psc = pod["securityContext"]
    assert (psc["runAsUser"], psc["runAsGroup"], psc["runAsNonRoot"]) == (uid, gid, True)
    assert flag_value(args, "--allow-gid") == str(gid)
    sc = c["securityContext"]
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    for key in ("runAsUser", "runAsGroup", "privileged"):
        assert key not in sc, f"the daemon container overrides {key}"

    # The init container hands the hostPath directories to the daemon's uid, modes
    # without group/other write (test_daemonset_init_container_* runs it).
    ic = init_container(ds)
    script = init_script(ic)
    assert f"chown {uid}:{gid} {SOCKET_DIR}" in script, script
    mode = re.search(r"chmod (0?[0-7]{3}) " + re.escape(SOCKET_DIR), script)
    assert mode and int(mode.group(1), 8) & 0o022 == 0, script
    assert ic["image"] == c["image"]
    assert {m["mountPath"]: m["name"] for m in ic["volumeMounts"]} == {
        m["mountPath"]: m["name"] for m in c["volumeMounts"]}, "the init container prepares other volumes than the daemon's"
    isc = ic["securityContext"]
    assert isc["allowPrivilegeEscalation"] is False and isc["capabilities"]["drop"] == ["ALL"]
    assert isc["readOnlyRootFilesystem"] is True
    assert set(isc["capabilities"].get("add", [])) <= {"CHOWN", "FOWNER", "DAC_READ_SEARCH"}


def init_container(ds: dict) -> dict:
    ics = ds["spec"]["template"]["spec"].get("initContainers", [])
    assert len(ics) == 1, f"expected one init container, found {[i.get('name') for i in ics]}"
    return ics[0]


def init_script(ic: dict) -> str:
    """The init container's `/bin/sh -c` script as its shell gets it (Kubernetes
    turns `$$` into `$`; a `$(NAME)` left would be read as a variable)."""
    cmd = ic.get("command", []) + ic.get("args", [])
    assert cmd[:2] == ["/bin/sh", "-c"] and len(cmd) == 3, cmd
    assert not re.search(r"(?<!\$)\$\([A-Za-z_]", cmd[2].replace("$$", "")), (
        f"`$(…)` in the init script is a Kubernetes variable reference: write `$$(…)`: {cmd[2]}")
    return cmd[2].replace("$$", "$")


def state_mount(ds: dict) -> tuple:
    """The daemon's --disk, and the mount (and its volume) it lies in."""
    pod = ds["spec"]["template"]["spec"]
    c = daemon_container(ds)
    disk = flag_value(c["args"], "--disk")
    assert disk, "the DaemonSet does not turn the disk tier on (--disk)"
    mounts = [m for m in c["volumeMounts"] if Path(m["mountPath"]) in Path(disk).parents]
    assert len(mounts) == 1, f"--disk {disk} is not inside exactly one mounted volume: {c['volumeMounts']}"
    volumes = {v["name"]: v for v in pod["volumes"]}
    return disk, mounts[0], volumes[mounts[0]["name"]]


def test_daemonset_disk_volume():
    ds = daemonset()
    pod = ds["spec"]["template"]["spec"]
    c = daemon_container(ds)
    disk, mount, vol = state_mount(ds)
    # The node's /var/lib/kachedb (the systemd unit's StateDirectory= too), which
    # outlives the pod: a new pod (an update) indexes what the old one wrote. An
    # emptyDir goes with the pod; a DaemonSet cannot claim a PersistentVolume per node.
    assert mount["mountPath"] == STATE_DIR and not mount.get("readOnly"), mount
    assert vol.get("hostPath") == {"path": STATE_DIR, "type": "DirectoryOrCreate"}, vol
    assert Path(disk).parent == Path(STATE_DIR), f"--disk {disk}: the daemon makes DIR (0700) right inside the volume"
    # No fsGroup: the kubelet ignores it for a hostPath, and where it applies it adds
    # g+rw (directories g+rwxs) to everything, which the daemon refuses in DIR.
    psc = pod["securityContext"]
    assert "fsGroup" not in psc and "fsGroupChangePolicy" not in psc, psc
    # The init container gives the state directory to the daemon's uid, 0700.
    uid, gid = psc["runAsUser"], psc["runAsGroup"]
    script = init_script(init_container(ds))
    assert f"chown -R {uid}:{gid} {STATE_DIR}" in script, script
    mode = re.search(r"chmod (0?[0-7]{3}) " + re.escape(STATE_DIR), script)
    assert mode and int(mode.group(1), 8) & 0o077 == 0, script
    assert parse_size(flag_value(c["args"], "--disk-size")) > 0
    assert disk_queue_bytes(c["args"]) <= parse_size(flag_value(c["args"], "--size")) // 2


def test_daemonset_init_container_prepares_what_the_daemon_checks():
    """The init container's script, run on scratch directories standing in for
    the node's (a socket directory as the kubelet makes it, root's 0755, and a
    state directory left 0700 by a daemon of another uid) as root with only the
    capabilities it adds; then the DaemonSet's args, run as the pod's uid on
    them: the daemon takes DIR and serves."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("runs the init script as root with its capabilities only, and the daemon as the pod's uid: needs root and setpriv")
    ds = daemonset()
    psc = ds["spec"]["template"]["spec"]["securityContext"]
    ic = init_container(ds)
    disk_arg, _, _ = state_mount(ds)
    user = DaemonUser(psc["runAsUser"], psc["runAsGroup"])
    where = StandIn(user)
    proc = None
    try:
        os.chown(where.run, 0, 0)
        os.chmod(where.run, 0o755)
        old = where.here(disk_arg)
        (old / "blocks").mkdir(parents=True)
        (old / "blocks" / "not-a-block").write_text("left by a daemon of uid 998")
        for path in (where.state, old, old / "blocks", old / "blocks" / "not-a-block"):
            os.chown(path, 998, 998)
            os.chmod(path, 0o600 if path.is_file() else 0o700)
        script = init_script(ic).replace(SOCKET_DIR, str(where.run)).replace(STATE_DIR, str(where.state))
        caps = ",".join(f"+{c.lower()}" for c in ic["securityContext"]["capabilities"].get("add", []))
        out = subprocess.run(["setpriv", f"--bounding-set=-all{',' + caps if caps else ''}", "--inh-caps=-all",
                              "--nnp", "/bin/sh", "-c", script], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, f"the init script failed with its capabilities ({caps}):\n{out.stderr}"
        st = where.run.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (user.uid, user.gid, 0o750)
        st = where.state.stat()
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (user.uid, user.gid, 0o700)
        for path in where.state.rglob("*"):
            assert (path.stat().st_uid, path.stat().st_gid) == (user.uid, user.gid), path

        args = replace_flags(daemon_container(ds)["args"], {
            "--socket": str(where.run / "kachedb_0.sock"), "--size": "64MiB",
            "--metrics-addr": "127.0.0.1:0", "--disk": str(old)})
        env = {k: v for k, v in os.environ.items() if not k.startswith("KACHEDB_")}
        log = open(where.tmp / "pod.log", "w+")
        proc = subprocess.Popen(user.daemon([str(built_binary()), "serve", *args]), stdin=subprocess.DEVNULL,
                                stdout=log, stderr=subprocess.STDOUT, env=env)
        sock = where.run / "kachedb_0.sock"
        deadline = time.monotonic() + 60
        while not sock.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (where.tmp / "pod.log").read_text()
            time.sleep(0.05)
        st = wait_stats(user, sock, lambda s: s["disk_indexed"], "the disk index")
        assert st["disk_enabled"] and st["disk_dir_lost"] == 0, st
        assert (old / "lock").read_text().strip() == str(proc.pid)
        put = block_op(user, sock, "put", "deploy-pod-block")
        wait_stats(user, sock, lambda s: s["disk_writes"] >= 1, "disk write of the block")
        assert block_op(user, sock, "get", "deploy-pod-block") == put
    finally:
        if proc is not None:
            if proc.poll() is None:
                proc.terminate()
            proc.wait(timeout=30)
        where.remove()


def test_daemonset_command_line_is_accepted_by_the_binary():
    assert_serve_accepts(daemon_container(daemonset())["args"], "the DaemonSet's args")
