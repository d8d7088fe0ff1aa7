"""`mappa check`, the dry run: every check the launcher runs before Ray starts (train_mappa_ray.Preflight), as a
table, exit 1 on a failure. Each case runs the real command in a subprocess on a tiny model and real files; the
coach is a real HTTP server on 127.0.0.1 (tests/coach_server.py) or a closed port. Each run also reports whether
Ray was started: it never is."""

import re
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from coach_server import CoachServer
from conftest import REPO

# Runs `mappa check` as the console script does, then says whether Ray was imported and initialised.
RUNNER = """
import sys
from openrlhf_mappa.tools.mappa import main
try:
    main(sys.argv[1:])
except SystemExit as e:
    code = e.code
ray = sys.modules.get("ray")
print("RAY STARTED:", bool(ray and ray.is_initialized()))
sys.exit(code)
"""


def check(tmp_path, tiny_model, *extra, topology=None) -> tuple:
    """(exit code, {check: (verdict, what it said)}, output) of `mappa check` on the tiny MathChat team."""
    argv = ["check", "--mappa.topology", topology or f"{REPO}/examples/configs/mathchat.yaml",
            "--mappa.model", tiny_model, "--mappa.run_dir", str(tmp_path / "run"), "--ckpt.path", str(tmp_path / "ckpt"),
            "--data.prompt_dataset", f"{REPO}/examples/data/tiny_math.jsonl", "--data.max_samples", "8",
            "--eval.dataset", f"{REPO}/examples/data/tiny_math_eval.jsonl", "--ds.attn_implementation", "sdpa",
            "--vllm.sync_backend", "gloo", "--rollout.batch_size", "4", "--rollout.micro_batch_size", "2",
            "--rollout.max_new_tokens", "32", "--data.max_len", "2048", "--train.batch_size", "4",
            "--train.micro_batch_size", "2", "--actor.num_gpus_per_node", "1", "--ref.num_gpus_per_node", "1",
            "--vllm.num_engines", "1", *extra]
    proc = subprocess.run([sys.executable, "-c", RUNNER, *argv], cwd=REPO, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert "RAY STARTED: False" in out, out
    rows = {}  # a row: verdict, what it checks, seconds taken (none when not run), what it found
    for line in proc.stdout.splitlines():
        row = re.match(r"(ok|FAILED|-) +(.+?) {2,}(?:[\d.]+ s  )?(.*)$", line)
        if row:
            rows[row.group(2)] = (row.group(1), row.group(3).strip())
    return proc.returncode, rows, out


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def coach_topology(tmp_path, **changes) -> str:
    """mathchat.yaml with a coach template the rule server reads (AGENT=, OUTPUT<<...>>OUTPUT), and `changes`."""
    raw = yaml.safe_load(open(f"{REPO}/examples/configs/mathchat.yaml"))
    raw["coach_template"] = "AGENT={agent}\nOUTPUT<<{agent_output}>>OUTPUT\nPROCESS_SCORE: <0-10>"
    raw.update(changes)
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path)


def test_a_launch_that_would_start_passes_every_check(tmp_path, tiny_model):
    with CoachServer() as server:
        code, rows, out = check(tmp_path, tiny_model, "--mappa.coach.kind", "openai", "--mappa.coach.base_url",
                                server.base_url, "--mappa.coach.model", "rule", "--mappa.gpus", "9",
                                "--mappa.gpu_memory_gib", "80", topology=coach_topology(tmp_path))
        scored = [r for r in server.requests if "OUTPUT<<" in r["prompt"]]
    assert code == 0, out
    assert {what: verdict for what, (verdict, _) in rows.items()} == {
        "topology, flags": "ok", "models": "ok", "training tasks": "ok", "eval sets": "ok",
        "environment on each task type": "ok", "run directory, resume": "ok", "this machine's packages": "ok",
        "GPU and memory plan": "ok", "coach": "ok"}
    assert rows["training tasks"][1].startswith("8 of the 16 in ")
    assert rows["GPU and memory plan"][1] == "fits: 9 GPUs of 9"
    # One real scoring request; the rule server's score of "2 + 2 = 4." is its distinct characters mod 11.
    assert len(scored) == 1 and rows["coach"][1].startswith(f"openai rule: scored a test action {len(set('2 + 2 = 4.')) % 11} ")
    assert not (tmp_path / "run").exists()  # a dry run writes nothing
    # the test action's HTTP session is closed (aiohttp warned of it above the table)
    assert "Unclosed" not in out


def test_a_config_only_model_fails_its_own_row_and_every_other_check_runs(tmp_path, tiny_model):
    # Catches the old table, whose first row checked the models too: with `mappa plan`'s config-only directory
    # (no tokenizer, or a hub id out of reach), every other check was "not run: it needs team".
    code, rows, out = check(tmp_path, tiny_model, "--mappa.model", f"{REPO}/tests/fixtures/qwen3-4b")
    assert (code == 1 and rows["models"][0] == "FAILED"
            and "it has no tokenizer files" in rows["models"][1]), out
    assert [what for what, (verdict, _) in rows.items() if verdict != "ok"] == ["models"], out


class NotFound(BaseHTTPRequestHandler):
    """A server whose API is under /v1, asked without it: every path answers 404, as vLLM's does."""

    def do_GET(self):
        self.send_error(404, "Not Found")

    do_POST = do_GET

    def log_message(self, *args):
        pass


def test_a_coach_url_without_v1_is_named(tmp_path, tiny_model):
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), NotFound)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_port}"
    try:
        code, rows, out = check(tmp_path, tiny_model, "--mappa.coach.kind", "openai",
                                "--mappa.coach.base_url", url, "--mappa.coach.model", "m",
                                topology=coach_topology(tmp_path))
    finally:
        httpd.shutdown()
        httpd.server_close()
    assert code == 1 and rows["coach"][0] == "FAILED", out
    assert (f"an OpenAI-compatible API is served under a version path: did you mean --mappa.coach.base_url "
            f"{url}/v1?") in out


@pytest.mark.parametrize("case", ["env value", "eval file", "coach", "plan", "package", "micro batch"])
def test_the_dry_run_names_what_would_stop_the_launch(case, tmp_path, tiny_model):
    extra, topology = [], None
    if case == "env value":
        topology = coach_topology(tmp_path, env_kwargs={"code_timeout_s": -1})
    elif case == "eval file":
        extra = ["--eval.dataset", str(tmp_path / "missing.jsonl")]
    elif case == "coach":
        extra = ["--mappa.coach.kind", "openai", "--mappa.coach.base_url", f"http://127.0.0.1:{closed_port()}/v1",
                 "--mappa.coach.model", "m"]
    elif case == "plan":
        extra = ["--mappa.gpus", "2", "--mappa.gpu_memory_gib", "80"]
    elif case == "micro batch":  # OpenRLHF's assertion, before the table, named no flag
        extra = ["--rollout.micro_batch_size", "16"]
    else:  # flash-attn is not installed here (nor in CI): OpenRLHF's default attention needs its kernels
        extra = ["--ds.attn_implementation", "flash_attention_2"]
    code, rows, out = check(tmp_path, tiny_model, *extra, topology=topology)
    failed = {what: said for what, (verdict, said) in rows.items() if verdict == "FAILED"}
    expected = {"env value": "environment on each task type", "eval file": "eval sets", "coach": "coach",
                "plan": "GPU and memory plan", "package": "this machine's packages",
                "micro batch": "topology, flags"}[case]
    assert code == 1 and list(failed) == [expected], out
    message = {"env value": "env_kwargs code_timeout_s must be a positive number of seconds, got -1",
               "eval file": "missing.jsonl", "coach": "cannot be reached",
               "plan": "GPUs", "package": "pip install flash-attn",
               "micro batch": "make 0 micro-batches of --rollout.micro_batch_size 16"}[case]
    assert message in (out if case == "micro batch" else failed[expected]), failed  # its row's further lines
    if case == "eval file":  # what needs the eval set is not run; what does not still is
        assert rows["environment on each task type"][0] == "-" and rows["coach"][0] == "ok"


def test_the_gpu_scripts_run_the_dry_run_first(tmp_path):
    """Both GPU scripts run `mappa check` with their own flags (and the user's) before `ray job submit`; a failed
    check stops the script, nothing submitted. The check itself is stood in (a `python3` on PATH that records its
    arguments): the recipe's Qwen3-4B and Gemini cannot be reached here."""
    for script, fails in (("train_mappa_mathchat.sh", False), ("train_mappa_dsbench.sh", True)):
        stub = tmp_path / "bin"
        stub.mkdir(exist_ok=True)
        (stub / "python3").write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path / 'checked.txt'}\nexit {int(fails)}\n")
        (stub / "python3").chmod(0o755)
        (stub / "ray").write_text(f"#!/bin/sh\necho submitted > {tmp_path / 'submitted.txt'}\n")
        (stub / "ray").chmod(0o755)
        (tmp_path / "submitted.txt").unlink(missing_ok=True)
        env = {"PATH": f"{stub}:/usr/bin:/bin", "MAPPA_SKIP_DATA_CHECK": "1", "HOME": str(tmp_path)}
        proc = subprocess.run(["bash", f"{REPO}/examples/scripts/{script}", "--ds.attn_implementation", "sdpa"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        checked = (tmp_path / "checked.txt").read_text().split()
        assert checked[:3] == ["-m", "openrlhf_mappa.tools.mappa", "check"] and checked[-2:] == [
            "--ds.attn_implementation", "sdpa"], checked
        assert "--mappa.topology" in checked and (proc.returncode != 0) is fails
        assert (tmp_path / "submitted.txt").exists() is not fails, proc.stderr


def test_the_gpu_script_names_a_missing_ray_cluster_before_submitting(tmp_path):
    # Catches the old script, which went from a passing check to `ray job submit` and its 40-line traceback
    # (ConnectionError: Failed to connect to Ray at address: http://127.0.0.1:8265). Stood in: the check (a
    # `python3` that passes) and `ray`, whose `ray status` finds no cluster (exit 1, as the real one's).
    stub = tmp_path / "bin"
    stub.mkdir()
    (stub / "python3").write_text("#!/bin/sh\nexit 0\n")
    (stub / "ray").write_text("#!/bin/sh\n[ \"$1\" = status ] && exit 1\necho \"$@\" > "
                              f"{tmp_path / 'submitted.txt'}\n")
    for name in ("python3", "ray"):
        (stub / name).chmod(0o755)
    env = {"PATH": f"{stub}:/usr/bin:/bin", "MAPPA_SKIP_DATA_CHECK": "1", "HOME": str(tmp_path)}
    proc = subprocess.run(["bash", f"{REPO}/examples/scripts/train_mappa_mathchat.sh"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and not (tmp_path / "submitted.txt").exists(), proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "[mappa] no Ray cluster is running here (`ray status` found none): start one first (`ray start "
        "--head --num-gpus 6`, or join this node to yours), then run this script again")
