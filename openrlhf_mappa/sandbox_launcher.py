"""The program `sandbox.run_python` starts (python sandbox_launcher.py CONFIG_JSON): it confines itself, then
runs the agent's script. Standard library only, in a fresh single-threaded process, so the namespace and uid
changes are safe (they are not after fork in a multi-threaded trainer). It reports JSON lines on
CONFIG["report_fd"]: {"isolation": {...}}, then {"exit_code", "cpu_s"} or {"error"}. Threat model: sandbox.py.
"""

import ctypes
import json
import os
import resource
import sys
import traceback

# sys.modules before this script imported anything: what the interpreter loaded at start-up (.pth hooks).
# The agent's interpreter loads the same, so those files must be visible inside the sandbox.
STARTUP_FILES = [getattr(m, "__file__", None) for name, m in list(sys.modules.items()) if name != "__main__"]

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
PR_SET_NO_NEW_PRIVS = 38
UID_BASE = 1 << 30  # sandbox uid = UID_BASE + launcher pid: unique among running sandboxes, owned by nobody
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc")

libc = ctypes.CDLL(None, use_errno=True)


def check(ret: int, what: str) -> None:
    if ret != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def mount(src, dst, fstype, flags, data=None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    check(libc.mount(enc(src), enc(dst), enc(fstype), flags, enc(data)), f"mount {dst}")


def bind(src: str, new_root: str, read_only: bool) -> None:
    dst = new_root + src
    if os.path.isdir(src):
        os.makedirs(dst, exist_ok=True)
    else:  # a single file (a device node, a module file): the mount point is an empty file
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        open(dst, "a").close()
    mount(src, dst, None, MS_BIND | MS_REC)
    if read_only:
        mount(None, dst, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


def build_root(cfg: dict) -> None:
    """Chroot into a tmpfs holding read-only binds of the system and the interpreter, and the workspace; all
    else is absent. The tmpfs also serves /tmp and /dev/shm: its size caps what is written outside the
    workspace."""
    new_root, workspace = cfg["new_root"], cfg["workspace"]
    mount(None, "/", None, MS_REC | MS_PRIVATE)  # nothing mounted here propagates back to the host
    mount("tmpfs", new_root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={cfg['max_file_mb']}m,mode=755")
    # A start-up module counts by its package directory (or its own file): the project's .pth hook, say.
    modules = {os.path.dirname(f) if os.path.basename(f) == "__init__.py" else f for f in STARTUP_FILES if f}
    bound = []
    for path in list(SYSTEM_DIRS) + [sys.prefix, sys.base_prefix] + sorted(modules, key=len):
        if not os.path.lexists(path) or any(path == b or path.startswith(b + "/") for b in bound):
            continue
        if os.path.islink(path) and path in SYSTEM_DIRS:  # merged /usr: /bin -> usr/bin
            os.symlink(os.readlink(path), new_root + path)
            continue
        bind(path, new_root, read_only=True)
        bound.append(path)
    for dev in ("null", "zero", "random", "urandom"):
        bind(f"/dev/{dev}", new_root, read_only=False)
    os.symlink("/proc/self/fd", new_root + "/dev/fd")
    for scratch in ("/tmp", "/dev/shm"):
        os.makedirs(new_root + scratch, exist_ok=True)
        os.chmod(new_root + scratch, 0o1777)
    os.makedirs(new_root + "/proc")
    mount("proc", new_root + "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    bind(workspace, new_root, read_only=False)
    os.chroot(new_root)
    os.chdir("/")


def run_agent(cfg: dict, uid, report_fd: int) -> None:
    """In the forked child: limits, then the unprivileged uid, then exec. Never returns."""
    try:
        os.close(report_fd)
        cpu = int(cfg["cpu_time_s"] + 0.999)
        limits = [
            (resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU at the soft limit, SIGKILL a second later
            (resource.RLIMIT_DATA, cfg["memory_mb"] << 20, cfg["memory_mb"] << 20),
            (resource.RLIMIT_FSIZE, cfg["max_file_mb"] << 20, cfg["max_file_mb"] << 20),
            (resource.RLIMIT_CORE, 0, 0),
        ]
        if uid is not None:  # RLIMIT_NPROC counts per real uid: only meaningful for a uid of our own
            limits.append((resource.RLIMIT_NPROC, cfg["max_processes"], cfg["max_processes"]))
        for which, soft, hard in limits:
            resource.setrlimit(which, (soft, hard))
        # setuid binaries stay inert
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        if uid is not None:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
        os.chdir(cfg["workspace"])
        os.execv(cfg["python"], [cfg["python"], cfg["script"]])
    except BaseException:
        traceback.print_exc()
        os._exit(127)


def main() -> None:
    cfg = json.loads(sys.argv[1])
    report_fd = cfg["report_fd"]
    root = os.geteuid() == 0
    iso = {"user": False, "filesystem": False, "network": False, "pid_namespace": False}
    reasons = []

    def unshare(flags: int, what: str) -> bool:
        ok = libc.unshare(flags) == 0
        if not ok:
            reasons.append(f"unshare({what}) failed: {os.strerror(ctypes.get_errno())}")
        return ok

    if root:
        private_mounts = unshare(CLONE_NEWNS, "mount")
        can_unshare = True
    else:  # a user namespace grants the right to make the others, though not a uid change or our own mounts
        private_mounts, can_unshare = False, unshare(CLONE_NEWUSER, "user")
        reasons.append("not root: the code runs as the calling user, with that user's file access")
    if can_unshare:
        iso["network"] = unshare(CLONE_NEWNET, "network")
        iso["pid_namespace"] = unshare(CLONE_NEWPID | CLONE_NEWIPC, "pid+ipc")

    uid = UID_BASE + os.getpid()
    init = os.fork()  # in the new pid namespace this child is pid 1: when it exits, every process there dies
    if init:
        os.waitpid(init, 0)
        os._exit(0)
    try:
        if private_mounts:
            build_root(cfg)
            iso["filesystem"] = True
    except OSError as e:
        reasons.append(f"private filesystem view failed ({e}), so the code also keeps root's uid")
    if iso["filesystem"]:  # a uid of its own only inside the private view: outside it, /root may hide Python
        for where, dirs, files in os.walk(cfg["workspace"]):
            for name in [where] + [os.path.join(where, n) for n in dirs + files]:
                os.lchown(name, uid, uid)  # lchown: a symlink the code left must not redirect this
        os.chmod(cfg["workspace"], 0o700)
        iso["user"] = True
    else:
        uid = None
    if reasons:
        iso["reason"] = "; ".join(reasons)
    report = os.fdopen(report_fd, "w")
    report.write(json.dumps({"isolation": iso, "uid": uid}) + "\n")
    report.flush()

    agent = os.fork()
    if agent == 0:
        run_agent(cfg, uid, report_fd)
    # As pid 1, orphans of the code are re-parented here: reap them until the agent itself ends.
    while True:
        pid, status, usage = os.wait4(-1, 0)
        if pid == agent:
            break
    cpu_s = usage.ru_utime + usage.ru_stime
    report.write(json.dumps({"exit_code": os.waitstatus_to_exitcode(status), "cpu_s": cpu_s}) + "\n")
    report.close()
    os._exit(0)


if __name__ == "__main__":
    try:
        main()
    except BaseException:
        os.write(json.loads(sys.argv[1])["report_fd"], json.dumps({"error": traceback.format_exc()}).encode())
        os._exit(1)
