"""Run an agent's Python code in its episode workspace, confined, and report what happened.

Threat model: the code is untrusted but not a kernel exploit. A policy under RL stumbles into infinite loops,
huge outputs and memory blow-ups, and may learn to game its environment (read answer files, touch other
episodes, kill its supervisor). Run as root, every run gets (sandbox_launcher.py; docs/reference.md, "Code
sandbox"): a private mount namespace chrooted into a tmpfs with read-only system directories and Python
installation and only its own workspace writable; a uid of its own (2**30 + launcher pid) owning the
workspace, so it cannot signal or ptrace other processes; fresh network (no loopback), pid and IPC namespaces,
so all its processes die with the run; an allow-listed environment (no secrets, no GPU: CUDA_VISIBLE_DEVICES
empty unless MAPPA_SANDBOX_GPUS names some); and limits on wall-clock time (the whole process tree is killed),
CPU time, memory, file size and process count. Memory is capped with RLIMIT_DATA, not RLIMIT_AS: AS counts
address space that threads and allocators only reserve, so an AS cap rejects ordinary code.

Not contained: the limits are per process (memory adds up over `max_processes` processes); many files, each
under the file cap, can fill the disk; world-readable system files can be read; CPU is not shared fairly.
Without root only the network and pid namespaces apply (via a user namespace): the code keeps the caller's uid
and file access, and no process cap is set. Whatever could not be applied is named in `ToolFeedback.isolation`
and in a RuntimeWarning, never skipped silently. With `sandbox_url` the code runs on a SandboxFusion service
instead (its own isolation; the files it writes stay there).
"""

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from typing import Optional

from openrlhf_mappa.episode import ToolFeedback

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launcher.py")
SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD")
PASSED_ENV = ("LANG", "LC_ALL", "TZ")  # plus MAPPA_* variables that do not look like secrets
# The rest of the code's environment. One thread per math library: parallelism is the code's own choice
# (n_jobs), and idle thread pools only cost memory.
SANDBOX_ENV = {
    "PATH": f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin",
    # writable and private; libraries' dotfiles do not clutter the workspace
    "HOME": "/tmp", "TMPDIR": "/tmp",
    # the sandbox uid has no passwd entry; getpass.getuser() reads these
    "USER": "sandbox", "LOGNAME": "sandbox",
    "PYTHONUNBUFFERED": "1",  # what the code printed before a kill still reaches the coach
    "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "Agg",
    "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "NUMEXPR_NUM_THREADS": "1",
}
CODE_BLOCK_RE = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)
# What Python prints when a limit refused it something (the code usually dies of the exception).
LIMIT_ERRORS = (
    ("memory", re.compile(r"MemoryError|Cannot allocate memory|std::bad_alloc")),
    ("file_size", re.compile(r"\[Errno 27\] File too large")),
    ("processes", re.compile(r"BlockingIOError: \[Errno 11\]|can't start new thread")),
)


def extract_code(text: str) -> Optional[str]:
    """The contents of the ```python blocks of a reply, joined by newlines; None when there is none."""
    blocks = CODE_BLOCK_RE.findall(text or "")
    code = "\n".join(blocks)
    return code if code.strip() else None


def run_python(code: str, workspace: str, timeout_s: float = 10.0, max_output_chars: int = 4000, *,
               memory_mb: int = 4096, cpu_time_s: Optional[float] = None, max_file_mb: int = 1024,
               max_processes: int = 256, sandbox_url: Optional[str] = None) -> ToolFeedback:
    """Run `code` with the workspace as its current directory, confined (see the module docstring).
    `cpu_time_s` defaults to `timeout_s` (it matters for code that burns several cores at once)."""
    if sandbox_url:
        return _run_remote(code, sandbox_url, timeout_s, memory_mb, max_output_chars)
    os.makedirs(workspace, exist_ok=True)
    workspace = os.path.realpath(workspace)  # the private view binds the real path
    before = _snapshot(workspace)
    cpu_limit = cpu_time_s or timeout_s
    limits = dict(
        cpu_time_s=cpu_limit, memory_mb=memory_mb, max_file_mb=max_file_mb, max_processes=max_processes
    )
    stdout, stderr, timed_out, returncode, report = _launch(
        code, workspace, timeout_s, max_output_chars, limits
    )
    if "error" in report:
        raise RuntimeError(f"the sandbox could not start the code:\n{report['error']}")
    after = _snapshot(workspace)

    isolation = report.get("isolation", {})
    missing = [name for name, ok in isolation.items() if ok is False]
    if missing:
        warnings.warn(f"sandbox without {', '.join(missing)}: {isolation.get('reason', '')}", RuntimeWarning)
    # The launcher reports the code's own exit; its absence means the whole group was killed first.
    exit_code = report.get("exit_code", -signal.SIGKILL if timed_out else returncode)
    stderr_text = stderr.text()
    limit = None
    if timed_out:
        limit = "timeout"
    elif exit_code == -signal.SIGXCPU or exit_code == -signal.SIGKILL and report.get("cpu_s", 0) >= cpu_limit:
        limit = "cpu"  # SIGKILL: the hard limit, for code that caught or ignored SIGXCPU
    elif exit_code != 0:
        tail = stderr_text[-2000:]  # the final traceback; the start may be another process's output
        limit = next((name for name, pattern in LIMIT_ERRORS if pattern.search(tail)), None)
    return ToolFeedback(  # exit_code < 0: killed by that signal
        stdout=stdout.text(), stderr=stderr_text, exit_code=exit_code, timed_out=timed_out,
        files=sorted(after), limit=limit, output_truncated=stdout.cut > 0 or stderr.cut > 0,
        files_created=sorted(set(after) - set(before)),
        files_changed=sorted(p for p in after if p in before and after[p] != before[p]), isolation=isolation,
    )


def _launch(code: str, workspace: str, timeout_s: float, max_output_chars: int, limits: dict):
    """Run the code through sandbox_launcher.py, which confines it and applies `limits`: (stdout, stderr,
    timed_out, the launcher's exit status, its report: the isolation applied and the code's exit code and CPU
    time, or the error that kept the code from starting)."""
    fd, script = tempfile.mkstemp(prefix="_mappa_code_", suffix=".py", dir=workspace)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(code)
    env = {k: v for k, v in os.environ.items() if k in PASSED_ENV or k.startswith("MAPPA_")}
    env = {k: v for k, v in env.items() if not any(m in k.upper() for m in SECRET_MARKERS)} | SANDBOX_ENV
    # No GPU unless MAPPA_SANDBOX_GPUS names some (as CUDA_VISIBLE_DEVICES would): with no
    # CUDA_VISIBLE_DEVICES the code would see every GPU of the node, where the run's engines and actors hold
    # them.
    env["CUDA_VISIBLE_DEVICES"] = os.environ.get("MAPPA_SANDBOX_GPUS", "")
    report_r, report_w = os.pipe()
    with tempfile.TemporaryDirectory(prefix="mappa_sandbox_root_") as new_root:
        config = dict(
            python=sys.executable, script=script, workspace=workspace, new_root=new_root, report_fd=report_w,
            **limits,
        )
        # start_new_session: its own process group, apart from ours, so that one killpg ends it all.
        proc = subprocess.Popen([sys.executable, LAUNCHER, json.dumps(config)], cwd="/", env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True, pass_fds=(report_w,))
        os.close(report_w)
        stdout, stderr, timed_out = _collect(proc, timeout_s, max_output_chars)
        _kill_group(proc.pid)  # background children of code that exited normally must not outlive the action
        proc.wait()
    report = {}
    with os.fdopen(report_r, encoding="utf-8") as f:  # every writer is dead by now: this read cannot block
        for line in f:
            report.update(json.loads(line))
    if os.path.lexists(script):  # the code may have deleted itself
        os.remove(script)
    return stdout, stderr, timed_out, proc.returncode, report


class _Capped:
    """The first and last bytes of a stream, at most `limit` in all; the middle is only counted."""

    def __init__(self, limit: int):
        self.tail_cap = limit // 2
        self.head_cap = limit - self.tail_cap
        self.head, self.tail, self.cut = b"", b"", 0

    def add(self, chunk: bytes) -> None:
        room = self.head_cap - len(self.head)
        self.head += chunk[:room]
        kept = self.tail + chunk[max(room, 0) :]
        self.cut += max(len(kept) - self.tail_cap, 0)
        self.tail = kept[len(kept) - self.tail_cap :] if self.tail_cap else b""

    def text(self) -> str:
        head, tail = self.head.decode("utf-8", errors="replace"), self.tail.decode("utf-8", errors="replace")
        return f"{head}\n[... about {self.cut} characters cut ...]\n{tail}" if self.cut else head + tail


def _collect(proc: subprocess.Popen, timeout_s: float, max_output_chars: int):
    """Read stdout and stderr as they come, keeping only capped copies, until the code ends or times out."""
    out, err = _Capped(max_output_chars), _Capped(max_output_chars)
    streams = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    selector = selectors.DefaultSelector()
    for fd in streams:
        selector.register(fd, selectors.EVENT_READ)
    deadline, timed_out, ending = time.monotonic() + timeout_s, False, False
    while selector.get_map():
        now = time.monotonic()
        if now >= deadline:
            if ending:  # the group is dead, yet something still holds the pipes open: stop listening
                break
            timed_out = proc.poll() is None
            _kill_group(proc.pid)
            deadline, ending = now + 1.0, True
        elif not ending and proc.poll() is not None:  # the launcher is done; take what is still in the pipes
            deadline, ending = now + 1.0, True
        for key, _ in selector.select(timeout=min(deadline - now, 0.1)):
            chunk = os.read(key.fd, 1 << 16)
            if chunk:
                streams[key.fd].add(chunk)
            else:
                selector.unregister(key.fd)
    selector.close()
    proc.stdout.close(), proc.stderr.close()
    return out, err, timed_out


def _snapshot(workspace: str) -> dict:
    """{relative path: (size, mtime)} of the workspace's files, not following symlinks."""
    files = {}
    for where, _, names in os.walk(workspace):
        for name in names:
            path = os.path.join(where, name)
            st = os.lstat(path)
            files[os.path.relpath(path, workspace)] = (st.st_size, st.st_mtime_ns)
    return files


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _run_remote(code: str, url: str, timeout_s: float, memory_mb: int, max_output_chars: int) -> ToolFeedback:
    """Run the code on a SandboxFusion service (POST {url}/run_code). An unusable service raises RuntimeError
    rather than returning an error result: a broken sandbox must not turn into a low reward for the agent."""
    body = {"code": code, "language": "python", "run_timeout": timeout_s, "memory_limit_MB": memory_mb}
    request = urllib.request.Request(url.rstrip("/") + "/run_code", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s + 30) as response:
            answer = json.loads(response.read())
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise RuntimeError(f"SandboxFusion at {url}: {e}") from e
    run = answer.get("run_result") or {}
    if answer.get("status") == "SandboxError" or run.get("status") == "Error" or not run:
        raise RuntimeError(f"SandboxFusion at {url} failed: {answer.get('message') or answer}")
    timed_out = run.get("status") == "TimeLimitExceeded"
    stdout, stderr = _Capped(max_output_chars), _Capped(max_output_chars)
    stdout.add((run.get("stdout") or "").encode())
    stderr.add((run.get("stderr") or "").encode())
    exit_code = run.get("return_code")
    return ToolFeedback(
        stdout=stdout.text(), stderr=stderr.text(),
        exit_code=-signal.SIGKILL if timed_out and exit_code is None else exit_code,
        timed_out=timed_out, limit="timeout" if timed_out else None,
        output_truncated=stdout.cut > 0 or stderr.cut > 0, isolation={"remote": url},
    )
