"""The code sandbox: a battery of hostile programs, concurrent workspaces, the CLI and the SandboxFusion backend.

Everything runs real subprocesses through `run_python`. The battery needs root (the project's machines and CI
run as root): without it the sandbox only has network and pid namespaces, and these tests are skipped.
"""

import json
import os
import resource
import socket
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from openrlhf_mappa.sandbox import run_python

ROOT = Path(__file__).resolve().parents[1]
FULL = {"user": True, "filesystem": True, "network": True, "pid_namespace": True}
root_only = pytest.mark.skipif(os.geteuid() != 0, reason="the full sandbox needs root")


def run(code: str, workspace, **kwargs):
    return run_python(textwrap.dedent(code), str(workspace), **{"timeout_s": 3.0, **kwargs})


@pytest.fixture
def ws(tmp_path):
    return tmp_path / "ws"


# ---------------------------------------------------------------- the hostile battery


@root_only
def test_a_plain_run_has_every_protection(ws):
    fb = run("print('hi')", ws)
    assert fb.stdout == "hi\n" and fb.stderr == "" and fb.exit_code == 0 and fb.limit is None
    assert fb.isolation == FULL


@root_only
def test_infinite_loop_hits_the_cpu_limit(ws):
    fb = run("while True:\n    pass", ws, timeout_s=10.0, cpu_time_s=1)
    assert fb.limit == "cpu" and not fb.timed_out and fb.exit_code < 0
    assert "[killed: CPU time limit]" in fb.as_text()


@root_only
def test_sleeping_past_the_timeout(ws):
    fb = run("import time\nprint('sleeping')\ntime.sleep(60)", ws, timeout_s=3.0)
    assert fb.timed_out and fb.limit == "timeout" and fb.stdout == "sleeping\n"
    assert fb.as_text().startswith("[timed out]")


@root_only
def test_fork_bomb_hits_the_process_limit(ws):
    fb = run("import os\nwhile True:\n    os.fork()", ws, max_processes=16, timeout_s=10.0)
    assert fb.limit == "processes" and not fb.timed_out and fb.exit_code == 1


@root_only
def test_memory_bomb_hits_the_memory_limit(ws):
    fb = run("blocks = []\nwhile True:\n    blocks.append(bytearray(10 << 20))", ws, memory_mb=200)
    assert fb.limit == "memory" and fb.exit_code == 1 and "MemoryError" in fb.stderr
    assert "[hit the memory limit]" in fb.as_text()


@root_only
def test_disk_filling_write_hits_the_file_size_limit(ws):
    code = "with open('big.bin', 'wb') as f:\n    while True:\n        f.write(b'0' * (1 << 20))"
    fb = run(code, ws, max_file_mb=5)
    assert fb.limit == "file_size" and fb.exit_code == 1
    assert (ws / "big.bin").stat().st_size <= 5 << 20 and fb.files_created == ["big.bin"]


@root_only
def test_no_network(ws):
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    code = f"""
        import socket
        for host in ("127.0.0.1", "1.1.1.1"):
            try:
                socket.create_connection((host, {port}), timeout=2)
                print(host, "connected")
            except OSError as e:
                print(host, "blocked", e.errno)
    """
    fb = run(code, ws)
    assert fb.exit_code == 0 and fb.stdout.count("blocked") == 2, fb.stdout
    with pytest.raises(socket.timeout):
        listener.accept()  # nothing reached the host's loopback either
    listener.close()


@root_only
def test_environment_secrets_are_not_visible(ws, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "sk-hidden-1")
    monkeypatch.setenv("MAPPA_HF_TOKEN", "hf-hidden-2")
    monkeypatch.setenv("WANDB_API_KEY", "hidden-3")
    code = """
        import glob, os
        seen = " ".join(os.environ.values())
        for path in glob.glob("/proc/*/environ"):  # the environments of every process it can see
            try:
                seen += open(path, "rb").read().decode(errors="replace")
            except OSError:
                pass
        print("hidden" in seen, sorted(glob.glob("/proc/[0-9]*")))
    """
    fb = run(code, ws)
    assert fb.stdout.startswith("False ") and fb.exit_code == 0
    assert "OMP_NUM_THREADS" in run("import os; print(sorted(os.environ))", ws).stdout


def test_the_code_sees_no_gpu_unless_the_user_gives_it_some(ws, monkeypatch):
    # Without CUDA_VISIBLE_DEVICES in its environment, CUDA shows a process every GPU of the node: the driver's,
    # where the run's engines and actors are. The code's own environment says so, printed by the code itself.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # the driver's own, which the code must not inherit either
    monkeypatch.delenv("MAPPA_SANDBOX_GPUS", raising=False)
    show = "import os; print(repr(os.environ.get('CUDA_VISIBLE_DEVICES')))"
    assert run(show, ws).stdout == "''\n"
    monkeypatch.setenv("MAPPA_SANDBOX_GPUS", "1")  # opted in: this GPU
    assert run(show, ws).stdout == "'1'\n"


@root_only
def test_reading_and_writing_outside_the_workspace(ws, tmp_path):
    (tmp_path / "answers.txt").write_text("42")  # e.g. a task's reference answers, next to the workspace
    code = f"""
        import os, sys
        for path in ({str(tmp_path / "answers.txt")!r}, "/root/.bashrc", "../answers.txt"):
            try:
                print("read", open(path).read())
            except OSError as e:
                print("no read", e.errno)
        for path in ({str(tmp_path / "planted.txt")!r}, sys.prefix + "/planted.txt", "/etc/planted", "/usr/x"):
            try:
                open(path, "w").write("x")
                print("wrote", path)
            except OSError as e:
                print("no write", e.errno)
    """
    fb = run(code, ws)
    assert fb.exit_code == 0 and "read" not in fb.stdout.replace("no read", "")
    assert fb.stdout.count("no write") == 4, fb.stdout
    assert not (tmp_path / "planted.txt").exists() and not Path(sys.prefix, "planted.txt").exists()


@root_only
def test_another_episodes_workspace_is_out_of_reach(tmp_path):
    other = tmp_path / "ep1"
    run("open('X_train.pkl', 'w').write('mine')", other)
    code = f"""
        import os
        for action in (lambda: os.listdir({str(other)!r}), lambda: open({str(other / "X_train.pkl")!r}, "a"),
                       lambda: os.listdir("../ep1")):
            try:
                action()
                print("reached")
            except OSError as e:
                print("out of reach", e.errno)
    """
    fb = run(code, tmp_path / "ep2")
    assert fb.stdout.count("out of reach") == 3, fb.stdout
    assert (other / "X_train.pkl").read_text() == "mine"


@root_only
def test_killing_the_parent_hurts_nobody(ws):
    code = """
        import os, signal
        for target in (os.getppid(), -1):  # the supervisor, then every process it may signal
            try:
                os.kill(target, signal.SIGKILL)
            except OSError as e:
                print("refused", e.errno)
        print("still here")
        os.killpg(0, signal.SIGKILL)  # its own process group: only the code itself may die of it
    """
    fb = run(code, ws)
    assert "still here" in fb.stdout and fb.exit_code == -9 and fb.limit is None and not fb.timed_out
    assert run("print('next')", ws).stdout == "next\n"  # the sandbox (and this test process) carry on


@root_only
def test_100_mb_of_stdout_is_capped(ws):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code = "import sys\nline = 'x' * 999 + '\\n'\nfor _ in range(100_000):\n    sys.stdout.write(line)\nprint('END')"
    fb = run(code, ws, timeout_s=20.0, max_output_chars=1000)
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert fb.exit_code == 0 and fb.output_truncated and len(fb.stdout) < 1100
    assert fb.stdout.startswith("xxx") and fb.stdout.endswith("END\n")
    assert "characters cut" in fb.stdout and grown_mb < 50


@root_only
def test_data_science_code_fits_the_default_limits(ws):
    code = """
        import pickle
        import numpy as np, pandas as pd
        from sklearn.ensemble import RandomForestClassifier
        X = pd.DataFrame(np.random.rand(500, 8))
        model = RandomForestClassifier(n_estimators=20, n_jobs=2).fit(X, X[0] > 0.5)
        pickle.dump(model, open("model.pkl", "wb"))
        print("ok")
    """
    fb = run(code, ws, timeout_s=60.0)
    assert fb.stdout == "ok\n" and fb.exit_code == 0, fb.stderr
    assert fb.files == ["model.pkl"] and fb.files_created == ["model.pkl"]


# ---------------------------------------------------------------- workspaces, files, concurrency


def test_created_and_changed_files(ws):
    run("open('a.txt', 'w').write('1'); open('b.txt', 'w').write('1')", ws)
    fb = run("import os\nopen('a.txt', 'w').write('22'); open('c.txt', 'w').write('3'); os.remove('b.txt')", ws)
    assert fb.files == ["a.txt", "c.txt"] and fb.files_created == ["c.txt"] and fb.files_changed == ["a.txt"]
    assert "this run created: c.txt; changed: a.txt" in fb.as_text()


@root_only
def test_concurrent_runs_do_not_see_each_other(tmp_path):
    # Each run says it is in flight (mine.txt, seen from outside) and then waits for "go", which the test writes once
    # both are: run one after the other, the first would wait until its timeout. Then each lists the shared parent.
    code = """
        import os, time
        open("mine.txt", "w").write(str(os.getuid()))
        while not os.path.exists("go"):
            time.sleep(0.05)
        print(os.getuid(), sorted(os.listdir("..")))
    """
    names, results = ("ep0", "ep1"), {}

    def go(name):
        results[name] = run(code, tmp_path / name, timeout_s=30.0)

    threads = [threading.Thread(target=go, args=(name,)) for name in names]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads) and not all((tmp_path / n / "mine.txt").exists() for n in names):
        time.sleep(0.05)
    for name in names:
        (tmp_path / name / "go").write_text("")
    for t in threads:
        t.join()
    assert not any(results[name].timed_out for name in names), results  # both were in flight at once
    for name in ("ep0", "ep1"):
        uid, seen = results[name].stdout.split(" ", 1)
        assert seen.strip() == f"['{name}']", seen  # only its own workspace under the shared parent
        assert (tmp_path / name / "mine.txt").read_text() == uid
    assert results["ep0"].stdout.split()[0] != results["ep1"].stdout.split()[0]


# ---------------------------------------------------------------- the CLI


def test_cli_prints_the_result_as_json(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import sys\nprint('from file')\nopen('out.csv', 'w').write('a')\nsys.exit(2)")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "openrlhf_mappa.tools.mappa", "sandbox", "run", str(script),
           "--workspace", str(tmp_path / "w"), "--timeout", "5", "--memory-mb", "512"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["stdout"] == "from file\n" and result["exit_code"] == 2 and result["files"] == ["out.csv"]
    assert result["timed_out"] is False and result["limit"] is None and "isolation" in result


# ---------------------------------------------------------------- SandboxFusion


class _StandIn(BaseHTTPRequestHandler):
    """Answers POST /run_code the way SandboxFusion does; records each request body."""

    answers, requests = [], []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, body))
        payload = json.dumps(type(self).answers.pop(0)).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture
def stand_in():
    """SandboxFusion cannot be installed here (a Docker service); this small server speaks its /run_code API."""
    server = HTTPServer(("127.0.0.1", 0), _StandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _StandIn.answers, _StandIn.requests = [], []
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_sandboxfusion_backend(stand_in, tmp_path):
    _StandIn.answers = [
        {"status": "Failed", "message": "", "run_result": {"status": "Finished", "return_code": 1,
         "stdout": "hi\n", "stderr": "ValueError: x\n", "execution_time": 0.1}},
        {"status": "Failed", "message": "", "run_result": {"status": "TimeLimitExceeded", "return_code": None,
         "stdout": "", "stderr": ""}},
        {"status": "SandboxError", "message": "runner crashed", "run_result": None},
    ]  # fmt: skip
    fb = run_python("print('hi')", str(tmp_path), timeout_s=4, memory_mb=300, sandbox_url=stand_in + "/")
    path, body = _StandIn.requests[0]
    assert path == "/run_code"
    assert body == {"code": "print('hi')", "language": "python", "run_timeout": 4, "memory_limit_MB": 300}
    assert fb.stdout == "hi\n" and fb.stderr == "ValueError: x\n" and fb.exit_code == 1 and not fb.timed_out
    assert fb.isolation == {"remote": stand_in + "/"}
    fb = run_python("while True: pass", str(tmp_path), sandbox_url=stand_in)
    assert fb.timed_out and fb.limit == "timeout" and fb.as_text().startswith("[timed out]")
    with pytest.raises(RuntimeError, match="runner crashed"):
        run_python("print(1)", str(tmp_path), sandbox_url=stand_in)


def test_sandboxfusion_unreachable_raises(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # a port nobody listens on
    with pytest.raises(RuntimeError, match="SandboxFusion at"):
        run_python("print(1)", str(tmp_path), sandbox_url=f"http://127.0.0.1:{port}")
