"""Run an agent's Python code in its episode workspace and report what happened.

A basic local runner: a separate process with a timeout, in its own process group, without the secrets of
the parent environment. It is not a security boundary (no filesystem, network or memory confinement).
"""

import os
import re
import signal
import subprocess
import sys
import tempfile
from typing import Optional

from openrlhf_mappa.episode import ToolFeedback

SECRET_MARKERS = ("KEY", "TOKEN", "SECRET", "PASSWORD")
CODE_BLOCK_RE = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL | re.IGNORECASE)


def extract_code(text: str) -> Optional[str]:
    """The contents of the ```python blocks of a reply, joined by newlines; None when there is none."""
    blocks = CODE_BLOCK_RE.findall(text or "")
    code = "\n".join(blocks)
    return code if code.strip() else None


def run_python(code: str, workspace: str, timeout_s: float = 10.0, max_output_chars: int = 4000) -> ToolFeedback:
    os.makedirs(workspace, exist_ok=True)
    fd, script = tempfile.mkstemp(prefix="_mappa_code_", suffix=".py", dir=workspace)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(code)
    env = {k: v for k, v in os.environ.items() if not any(m in k.upper() for m in SECRET_MARKERS)}
    # Unbuffered, so what the code printed before a timeout kill still reaches the coach.
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(
        [sys.executable, os.path.basename(script)],
        cwd=workspace,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,  # its own process group: one killpg also ends the processes it spawned
    )
    timed_out = False
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(proc.pid)
        try:
            stdout, stderr = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:  # a process that left the group still holds the pipes
            proc.kill()
            proc.stdout.close(), proc.stderr.close()
            proc.wait()
            stdout, stderr = b"", b""
    _kill_group(proc.pid)  # background children of code that exited normally must not outlive the action
    if os.path.exists(script):  # the code may have deleted itself
        os.remove(script)
    files = sorted(
        os.path.relpath(os.path.join(root, name), workspace)
        for root, _, names in os.walk(workspace)
        for name in names
    )
    return ToolFeedback(
        stdout=_truncate(stdout.decode("utf-8", errors="replace"), max_output_chars),
        stderr=_truncate(stderr.decode("utf-8", errors="replace"), max_output_chars),
        exit_code=proc.returncode,  # after a timeout: the kill signal, negated
        timed_out=timed_out,
        files=files,
    )


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _truncate(text: str, limit: int) -> str:
    # Keep both ends: the start shows what the code was doing, the end holds the traceback.
    if len(text) <= limit:
        return text
    head = limit // 2
    return f"{text[:head]}\n[... {len(text) - limit} characters cut ...]\n{text[len(text) - (limit - head):]}"
