"""The deployment files in deploy/ (docs/deploy.md, "What is tested").

This machine has no systemd as PID 1, no container runtime and no Kubernetes.
The unit is checked with `systemd-analyze verify` (which must print nothing
about it), its user with `systemd-sysusers --root`, every command line in
deploy/ against the built `kachedb serve` (flags and values parse), and the
unit's own command line is run with a fake $NOTIFY_SOCKET: READY=1, MAINPID,
the health probe and the SIGHUP takeover that `systemctl reload` relies on.
The Containerfile and the DaemonSet are checked for structure only (never
built or applied): they parse, and their paths, ports, ids and security
settings agree with each other and with the unit.
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
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

REPO = Path(__file__).resolve().parent.parent
DEPLOY = REPO / "deploy"
UNIT = DEPLOY / "kachedb.service"
SYSUSERS = DEPLOY / "kachedb.sysusers"
CONTAINERFILE = DEPLOY / "Containerfile"
DOCKERIGNORE = DEPLOY / "Containerfile.dockerignore"
DAEMONSET = DEPLOY / "kachedb-daemonset.yaml"
BIN = REPO / "target" / "release" / "kachedb"
INSTALLED = "/usr/local/bin/kachedb"  # where the unit expects the binary
SOCKET_DIR = "/run/kachedb"  # the socket directory on every host, container and node
DEFAULT_HEADROOM = 512 << 20  # `kachedb serve --headroom` default


# ---------------------------------------------------------------- helpers


def built_binary() -> Path:
    if not (BIN.is_file() and os.access(BIN, os.X_OK)):
        pytest.fail(f"{BIN} is not built: run `make build` first", pytrace=False)
    return BIN


def systemd_tool(name: str) -> str:
    path = shutil.which(name) or (f"/usr/bin/{name}" if os.access(f"/usr/bin/{name}", os.X_OK) else None)
    if path is None:
        pytest.fail(f"{name} not found: these checks need systemd's tools (apt-get install systemd)", pytrace=False)
    return path


def load_yaml_docs(path: Path) -> list:
    try:
        import yaml
    except ImportError:  # pyyaml comes with transformers, a CI dependency: fail, do not skip
        pytest.fail("checking the DaemonSet needs PyYAML: pip install pyyaml (or make setup)", pytrace=False)
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def unit_entries(text: str) -> list:
    """(section, key, value) of each assignment of a unit file, in order
    (comments skipped, backslash continuation lines joined)."""
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
        assert sep, f"{UNIT}: not an assignment: {line!r}"
        entries.append((section, key.strip(), value.strip()))
    return entries


def unit_values(key: str, section: str = "Service") -> list:
    return [v for s, k, v in unit_entries(UNIT.read_text()) if s == section and k == key]


def unit_value(key: str, section: str = "Service") -> str:
    values = unit_values(key, section)
    assert len(values) == 1, f"{UNIT}: expected one {key}= in [{section}], found {values}"
    return values[0]


GID_EXPANSION = "$(id -g)"  # the one shell expansion the unit's ExecStart may use


def unit_shell_script() -> str:
    """The script of ExecStart=/bin/sh -c '…' ($$ undone: systemd's literal $)."""
    words = shlex.split(unit_value("ExecStart").lstrip("@-:+!").replace("$$", "$"))
    assert words[:2] == ["/bin/sh", "-c"] and len(words) == 3, f"ExecStart is not `/bin/sh -c '…'`: {words}"
    return words[2]


def unit_daemon_argv() -> list:
    """The daemon's argv as the unit starts it (through its `sh -c 'exec …'`)."""
    words = shlex.split(unit_shell_script())
    assert words[0] == "exec", f"the unit's shell must `exec` the daemon, so that it keeps the pid systemd started: {words}"
    assert "$" not in " ".join(w for w in words if w != GID_EXPANSION), f"unexpected shell expansion in {words}"
    return words[1:]


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


def verify_unit(text: str, tmp: Path) -> list:
    """Lines `systemd-analyze verify` prints about a copy of the unit with
    `text` (the binary path pointing at the built one); [] if it is clean."""
    d = tmp / f"verify-{time.monotonic_ns()}"
    d.mkdir()
    unit = d / "kachedb.service"
    unit.write_text(text.replace(INSTALLED, str(built_binary())))
    out = subprocess.run([systemd_tool("systemd-analyze"), "verify", str(unit)],
                         capture_output=True, text=True, timeout=120)
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
    assert "cargo build --release --locked -p kachedb-cli --no-default-features" in runs
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
    assert limit >= size + headroom + (256 << 20), f"memory limit {limit} < --size + --headroom + process"

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

    # The init container hands the hostPath directory to the daemon's uid, mode without group/other write.
    for ic in pod.get("initContainers", []):
        script = " ".join(ic.get("command", []) + ic.get("args", []))
        assert f"chown {uid}:{gid} {SOCKET_DIR}" in script, script
        mode = re.search(r"chmod (0?[0-7]{3}) " + re.escape(SOCKET_DIR), script)
        assert mode and int(mode.group(1), 8) & 0o022 == 0, script
        assert ic["image"] == c["image"]
        assert {m["mountPath"]: m["name"] for m in ic["volumeMounts"]} == {SOCKET_DIR: mount["name"]}
        isc = ic["securityContext"]
        assert isc["allowPrivilegeEscalation"] is False and isc["capabilities"]["drop"] == ["ALL"]
        assert set(isc["capabilities"].get("add", [])) <= {"CHOWN", "FOWNER"}


def test_daemonset_command_line_is_accepted_by_the_binary():
    assert_serve_accepts(daemon_container(daemonset())["args"], "the DaemonSet's args")
