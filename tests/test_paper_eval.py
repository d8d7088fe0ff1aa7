"""The paper's evaluation (issue 49): the coach's ANSWER_CORRECT read strictly, the authors' coach-graded accuracy
beside math-verify through a real coach on 127.0.0.1, eval sets that overlap the training subset refused, the
paper table, and the GPU scripts' eval flags and data check (run for real, `ray` recording the submission)."""

import asyncio
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import REPO, submit_script
from test_coach import ScriptedPolicy
from test_trainer_units import MATHCHAT_YAML, model_dir

from openrlhf_mappa.tools import paper_table
from openrlhf_mappa.cli import train_mappa_ray
from openrlhf_mappa.coach import parse_answer_correct
from openrlhf_mappa.coach.openai_compat import OpenAICoach
from openrlhf_mappa.envs.base import load_tasks
from openrlhf_mappa.envs.dsbench import METRICS
from openrlhf_mappa.evaluation import coach_cost, evaluate, summarize, train_overlap
from openrlhf_mappa.team import load_topology

BENCH = os.environ.get("MAPPA_BENCH_DIR", os.path.join(os.path.dirname(REPO), "shared", "data", "mappa-bench"))
SCRIPTS = os.path.join(REPO, "examples", "scripts")
needs_bench = pytest.mark.skipif(not os.path.exists(os.path.join(BENCH, "AIME_1983_2024.json")),
                                 reason=f"the shared benchmark files are not in {BENCH} (set MAPPA_BENCH_DIR)")


@pytest.mark.parametrize("reply, expected", [
    ("Sound.\nPROCESS_SCORE: 7\nANSWER_CORRECT: 1", 1),
    ("PROCESS_SCORE: 3\n**ANSWER_CORRECT:** 0", 0),
    ("ANSWER_CORRECT: 1 (the Verifier's 204 is the reference)\nPROCESS_SCORE: 9", 1),
    ("PROCESS_SCORE: 8", None),  # no key line: evaluation asks once more, then falls back to the score
    ("The answer is correct, so ANSWER_CORRECT would be 1.\nPROCESS_SCORE: 8", None),  # prose, not a key line
    ("PROCESS_SCORE: 8\nANSWER_CORRECT: <1 or 0, only when a reference answer is given>", None),  # the template echoed
    ("PROCESS_SCORE: 8\nANSWER_CORRECT: 2", None),  # neither 1 nor 0
    ("ANSWER_CORRECT: 1\nPROCESS_SCORE: 8\nANSWER_CORRECT: 0", None),  # two different values
    ("<think>Maybe ANSWER_CORRECT: 0 ...\nANSWER_CORRECT: 0\n</think>\nPROCESS_SCORE: 8\nANSWER_CORRECT: 1", 1),
    ("<think>\nANSWER_CORRECT: 1\n</think>\nPROCESS_SCORE: 8", None),  # only inside the reasoning: no verdict
])  # fmt: skip
def test_answer_correct_is_read_from_its_key_line_only(reply, expected):
    assert parse_answer_correct(reply) == expected


class RuleCoach(BaseHTTPRequestHandler):
    """A real OpenAI-compatible coach: every action scores 5, except the Verifier's, by the task's first word:
    "Alpha" 9 and ANSWER_CORRECT 1; "Beta" 4 and no ANSWER_CORRECT, which it gives (0) when asked again;
    "Delta" 6 and no ANSWER_CORRECT, asked again still none (score 7); "Gamma" a reply with no score at all.
    The re-prompts it gets are kept in `reasked`."""

    reasked = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][0]["content"]
        content = "Fine.\nPROCESS_SCORE: 5"
        if "\nagent: verifier\n" in prompt:
            content = ("Right.\nPROCESS_SCORE: 9\nANSWER_CORRECT: 1" if "Alpha" in prompt else
                       "Plausible.\nPROCESS_SCORE: 4" if "Beta" in prompt else
                       "Unsure.\nPROCESS_SCORE: 6" if "Delta" in prompt else "I cannot say.")
        elif prompt.startswith("You previously provided this evaluation:"):
            RuleCoach.reasked.append(body)
            content = "PROCESS_SCORE: 4\nANSWER_CORRECT: 0" if "Plausible." in prompt else "PROCESS_SCORE: 7"
        data = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
                           "usage": {"prompt_tokens": 10, "completion_tokens": 5}}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def rule_coach():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), RuleCoach)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_port}/v1"
    httpd.shutdown()
    httpd.server_close()


def test_evaluation_grades_by_math_verify_and_by_the_coachs_answer_correct(rule_coach, tmp_path):
    # Catches the old evaluation, which asked no coach (NoCoach): the paper's coach-graded figures could not be had.
    topology = load_topology(MATHCHAT_YAML, model_override="m")
    verifier = next(s for s in topology.agents if s.name == "verifier")
    template = topology.coach_template.replace("{role}", "{role}\nagent: {agent}")  # the rule server keys on it
    coach = OpenAICoach(template=template, model="judge", base_url=rule_coach, format_retries=0,
                        max_retries=0, structured="off", score_key=topology.score_key)
    policies = {"problem_solver": ScriptedPolicy("2 + 2 is 4."), "code_executor": ScriptedPolicy("No code: 4."),
                "verifier": ScriptedPolicy("So the answer is \\boxed{4}.")}  # fmt: skip
    tasks = [{"id": "a", "prompt": "Alpha: what is 2 + 2?", "answer": "4"},
             {"id": "b", "prompt": "Beta: what is 3 + 2?", "answer": "5"},
             {"id": "c", "prompt": "Gamma: what is 1 + 3?", "answer": "4"},
             {"id": "d", "prompt": "Delta: what is 3 + 3?", "answer": "6"}]  # fmt: skip
    RuleCoach.reasked.clear()

    async def run():
        try:
            return await evaluate(topology, tasks, policies, 2, str(tmp_path), coach=coach)
        finally:
            await coach.aclose()

    episodes = asyncio.run(run())
    summary, problems = summarize(episodes, [s.name for s in topology.agents], tasks)
    # math-verify: \boxed{4} is right for a and c, wrong for b and d
    assert [p["pass1"] for p in problems] == [1.0, 0.0, 1.0, 0.0] and summary["accuracy"] == 0.5
    # the authors' grader: a's ANSWER_CORRECT 1; b has none, asked once more (external_coach.py L415-450) it
    # says 0; d has none even then, so the retry's raw score 7 (their fallback, on 0-10); c's coach gave no
    # verdict: left out, counted, never a grade
    assert [p["pass1_coach"] for p in problems] == [1.0, 0.0, None, 7.0]
    assert summary["accuracy_coach"] == pytest.approx(8 / 3)
    assert {k: v for k, v in summary.items() if k.startswith("accuracy_coach/")} == {
        "accuracy_coach/answer_correct": 4, "accuracy_coach/score_fallback": 2, "accuracy_coach/score": 0,
        "accuracy_coach/no_final_action": 0, "accuracy_coach/ungraded": 2}  # fmt: skip
    # the re-prompt, the authors' word for word: their earlier reply alone, as one user message, no schema
    assert len(RuleCoach.reasked) == 4 and {json.dumps(r, sort_keys=True) for r in RuleCoach.reasked} == {
        json.dumps({"model": "judge", "temperature": 0, "messages": [{"role": "user", "content":
            f"You previously provided this evaluation:\n\n{reply}\n\nHowever, the response format was "
            "incorrect. Error: OUTCOME_SCORE/ANSWER_CORRECT missing for Verifier with ground truth\n\nPlease "
            "provide your evaluation again using EXACTLY this format:\n\nPROCESS_SCORE: [0.0 to "
            "10.0]\nANSWER_CORRECT: [0 or 1]\n\nDo not include any other text or explanation. Only output "
            "the score(s) in the exact format shown above.\n"}]}, sort_keys=True)
        for reply in ("Plausible.\nPROCESS_SCORE: 4", "Unsure.\nPROCESS_SCORE: 6")}  # fmt: skip
    last = [ep.actions[-1] for ep in episodes]
    assert {a.agent for a in last} == {verifier.name}
    assert [(a.verdict.answer_correct, a.verdict.score, a.verdict.retries) for a in last[:4]] == [
        (1, 9.0, 0), (1, 9.0, 0), (0, 4.0, 1), (0, 4.0, 1)]  # fmt: skip
    assert [(a.verdict.answer_correct, a.verdict.score, a.verdict.rationale) for a in last[6:]] == [
        (None, 7.0, "PROCESS_SCORE: 7")] * 2
    # its cost: 8 episodes x 3 actions, one request each, and 4 re-prompts, 10 + 5 tokens each
    assert coach_cost(episodes, price_in=1.0, price_out=2.0) == {
        "coach/requests": 24, "coach/failure_fraction": pytest.approx(2 / 24), "coach/tokens_in": 280,
        "coach/tokens_out": 140, "coach/cost_usd": pytest.approx((280 * 1.0 + 140 * 2.0) / 1e6)}  # fmt: skip


def test_no_coach_no_coach_graded_accuracy(tmp_path):
    topology = load_topology(MATHCHAT_YAML, model_override="m")
    policies = {s.name: ScriptedPolicy("\\boxed{4}") for s in topology.agents}
    tasks = [{"id": "a", "prompt": "2 + 2?", "answer": "4"}]
    episodes = asyncio.run(evaluate(topology, tasks, policies, 2, str(tmp_path)))
    summary, _ = summarize(episodes, [s.name for s in topology.agents], tasks)
    assert summary["accuracy"] == 1.0 and "accuracy_coach" not in summary and coach_cost(episodes) == {}


@needs_bench
def test_aime_eval_32_shares_10_problems_with_the_seed_42_subset_and_the_launch_refuses_it(tmp_path, monkeypatch):
    # Catches the old launcher, which evaluated on training problems without a word (the reference doc's example
    # scored the trained team on aime_eval_32). The subset comes from the real path: the flags, then train().
    files = {n: os.path.join(BENCH, n + ".json") for n in ("aime_eval_32", "aime_2025", "amc_eval_32")}
    flags = ["--vllm.num_engines", "1", "--mappa.topology", MATHCHAT_YAML, "--mappa.model", model_dir(tmp_path),
             "--data.prompt_dataset", os.path.join(BENCH, "AIME_1983_2024.json"), "--data.max_samples", "512",
             "--train.seed", "42", "--rollout.max_new_tokens", "64", "--actor.num_gpus_per_node", "1",
             "--train.batch_size", "2", "--rollout.batch_size", "32", "--ds.attn_implementation", "sdpa", "--train.micro_batch_size", "1",
             "--mappa.run_dir", str(tmp_path / "run"), "--ckpt.path", str(tmp_path / "ckpt"),
             "--eval.dataset", ",".join(files.values())]  # fmt: skip
    with pytest.raises(SystemExit) as refused:
        train_mappa_ray.train(train_mappa_ray.parse_args(flags))
    said = str(refused.value)
    assert "aime_eval_32: 10 of its 32 problems" in said and "aime_2025:" not in said and "amc_eval_32:" not in said
    assert "--mappa.allow_eval_overlap" in said and not (tmp_path / "run").exists()

    # Allowed, it warns with the count and goes on to the launch (which starts Ray: stopped here)
    monkeypatch.setattr(train_mappa_ray, "launch", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt("no Ray here")))
    with pytest.raises(KeyboardInterrupt):
        train_mappa_ray.train(train_mappa_ray.parse_args([*flags, "--mappa.allow_eval_overlap", "--mappa.verbose"]))
    subset = json.loads((tmp_path / "run" / "train_tasks.json").read_text())["ids"]
    train = [t for t in load_tasks(os.path.join(BENCH, "AIME_1983_2024.json")) if t["id"] in set(subset)]
    assert len(train) == 512
    assert [len(train_overlap(train, load_tasks(f))) for f in files.values()] == [10, 0, 0]


def test_overlap_matches_text_and_aime_year_part_number():
    train = [{"id": "2009-II-8", "prompt": "Dave rolls a die.", "year": 2009, "part": "II", "problem_number": 8},
             {"id": "1983-1", "prompt": "Let $x$ be 1.", "year": 1983, "part": None, "problem_number": 1}]
    evals = [{"id": "1", "prompt": "Dave rolls  a DIE.", "answer": "1"},  # the same text, spacing and case aside
             {"id": "2", "prompt": "Reworded.", "url": "https://artofproblemsolving.com/wiki/index.php/"
              "2009_AIME_II_Problems/Problem_8"},
             {"id": "3", "prompt": "x", "url": "https://artofproblemsolving.com/wiki/index.php/1983_AIME_Problems/Problem_1"},
             {"id": "4", "prompt": "Other.", "url": "https://artofproblemsolving.com/wiki/index.php/2009_AIME_I_Problems/Problem_8"},
             {"id": "2009-II-8", "prompt": "An AMC problem whose id happens to be the same."}]  # fmt: skip
    assert train_overlap(train, evals) == ["1", "2", "3"]


def write_eval(run_dir, rows):
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "eval.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)


def test_paper_table_sets_before_beside_last_and_best_for_both_graders_and_both_dsbench_definitions(tmp_path):
    # Catches the project before this table (no command wrote the paper's figures), and the table of audit 4
    # (C14, N6) and the second user trial: DSBench only by our definitions, "after" only the last evaluation,
    # every run named `run`, math-verify headings on a relay, a raw 0-10 coach score shown in % (117 % -> 1000
    # %).
    math = tmp_path / "mathchat" / "run"  # the scripts' layout: runs/<name>/run
    write_eval(math, [
        {"step": 0, "dataset": "aime_2025", "grader": "math-verify", "accuracy": 29 / 120, "accuracy_coach": 0.25,
         "n_problems": 30, "n_samples": 4, "accuracy_coach/score_fallback": 0, "accuracy_coach/ungraded": 1},
        {"step": 0, "dataset": "amc_eval_32", "grader": "math-verify", "accuracy": 0.5, "n_problems": 32,
         "n_samples": 4},
        {"step": 4, "dataset": "aime_2025", "grader": "math-verify", "accuracy": 0.4, "accuracy_coach": 0.3,
         "n_problems": 30, "n_samples": 4, "accuracy_coach/score_fallback": 1},
        {"step": 128, "dataset": "aime_2025", "grader": "math-verify", "accuracy": 35 / 120, "accuracy_coach": 0.4,
         "n_problems": 30, "n_samples": 4, "accuracy_coach/score_fallback": 2},
        {"step": 128, "dataset": "amc_eval_32", "grader": "math-verify", "accuracy": 0.625, "n_problems": 32,
         "n_samples": 4, "train_overlap": 3},
    ])  # fmt: skip
    # a relay: the coach asked no ANSWER_CORRECT, its raw score is the figure
    relay = tmp_path / "demo" / "run"
    write_eval(relay, [
        {"step": 0, "dataset": "relay_eval", "grader": "success (the environment's outcome)", "accuracy": 0.0,
         "accuracy_coach": 1.17, "accuracy_coach/score": 16, "n_problems": 8, "n_samples": 2},
        {"step": 50, "dataset": "relay_eval", "grader": "success (the environment's outcome)", "accuracy": 1.0,
         "accuracy_coach": 10.0, "accuracy_coach/score": 16, "n_problems": 8, "n_samples": 2},
    ])  # fmt: skip
    ds = tmp_path / "dsbench"
    write_eval(ds, [
        {"step": 0, "dataset": "tasks", "grader": "valid submission.csv", "accuracy": 0.5, "relative_score": 0.2,
         "metric/rmse": 3.0, "regression/success_rate": 0.25, "authors/scored_rate": 0.75, "authors/accuracy": 0.6,
         "authors/count_accuracy": 12, "authors/rmse": 4.0, "authors/count_rmse": 12, "n_problems": 8,
         "n_samples": 4},
        {"step": 2, "dataset": "tasks", "grader": "valid submission.csv", "accuracy": 0.625, "relative_score": 0.4,
         "metric/rmse": 2.0, "authors/scored_rate": 0.875, "authors/accuracy": 0.7, "authors/rmse": 2.5,
         "n_problems": 8, "n_samples": 4},
        {"step": 120, "dataset": "tasks", "grader": "valid submission.csv", "accuracy": 0.75, "relative_score": 0.35,
         "metric/rmse": 2.5, "metric/accuracy": 0.8, "regression/success_rate": 0.5, "accuracy_coach": 6.5,
         "accuracy_coach/score": 32, "authors/scored_rate": 1.0, "authors/accuracy": 0.65, "authors/rmse": 3.0,
         "n_problems": 8, "n_samples": 4},
    ])  # fmt: skip
    proc = subprocess.run([sys.executable, "-m", "openrlhf_mappa.tools.mappa", "paper-table", str(math),
                           str(relay), str(ds), "--out", str(tmp_path / "table")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads((tmp_path / "table.json").read_text())
    cells = {(r["name"], r["dataset"], r["metric"]): (r["before"], r["after"], r["after_step"], r["delta"], r["best"],
                                                      r["best_step"], r["best_delta"], r["unit"])
             for r in result["accuracy"]}  # fmt: skip
    assert cells == {
        ("mathchat", "aime_2025", "math-verify"): pytest.approx(
            (29 / 1.2, 35 / 1.2, 128, 6 / 1.2, 40.0, 4, 19 / 1.2, "%")),
        ("mathchat", "aime_2025", "coach ANSWER_CORRECT"): pytest.approx(
            (25.0, 40.0, 128, 15.0, 40.0, 128, 15.0, "%")),
        ("mathchat", "amc_eval_32", "math-verify"): pytest.approx((50.0, 62.5, 128, 12.5, 62.5, 128, 12.5, "%")),
        ("demo", "relay_eval", "success (the environment's outcome)"): pytest.approx(
            (0.0, 100.0, 50, 100.0, 100.0, 50, 100.0, "%")),
        ("demo", "relay_eval", "coach score of the final agent (0-10)"): pytest.approx(
            (1.17, 10.0, 50, 8.83, 10.0, 50, 8.83, ""))}  # fmt: skip
    notes = {(r["dataset"], r["metric"]): r["note"] for r in result["accuracy"]}
    assert notes[("aime_2025", "coach ANSWER_CORRECT")] == (
        "before: 1 episodes ungraded (coach failed), left out; "
        "last: 2 episodes graded by the raw 0-10 score (no ANSWER_CORRECT, asked twice)")
    assert notes[("aime_2025", "math-verify")] == ""  # the best evaluation's fallbacks are the coach row's
    assert notes[("amc_eval_32", "math-verify")] == "3 problems are training problems: not held out"
    ds_cells = {r["metric"]: (r["before"], r["after"], r["delta"], r["best"], r["best_step"], r["unit"])
                for r in result["dsbench"]}  # fmt: skip
    assert ds_cells == {
        "ours: success rate (valid submission.csv)": pytest.approx((50.0, 75.0, 25.0, 75.0, 120, "%")),
        "ours: relative score": pytest.approx((0.2, 0.35, 0.15, 0.4, 2, "")),
        "ours: accuracy (competition metric, valid submissions)": (None, 0.8, None, 0.8, 120, ""),
        "ours: rmse (competition metric, valid submissions)": (3.0, 2.5, -0.5, 2.0, 2, ""),  # lower is better
        "ours: regression success rate": pytest.approx((25.0, 50.0, 25.0, 50.0, 120, "%")),
        "authors': scored rate (predictions read)": pytest.approx((75.0, 100.0, 25.0, 100.0, 120, "%")),
        "authors': accuracy (pooled over tasks)": pytest.approx((0.6, 0.65, 0.05, 0.7, 2, "")),
        "authors': rmse (pooled over tasks)": pytest.approx((4.0, 3.0, -1.0, 2.5, 2, "")),
        "authors': coach score of the last action (in-loop eval, 0-10)": (None, 6.5, None, 6.5, 120, "")}  # fmt: skip
    assert ({n for n, m in METRICS.items() if not m.higher_is_better} | {"mse"}
            == set(paper_table.LOWER_IS_BETTER))
    md = (tmp_path / "table.md").read_text()
    assert md in proc.stdout and "## Accuracy" in md and "MathChat" not in md
    assert ("| mathchat | aime_2025 | math-verify | 24.2 | 29.2 (step 128) | +5.0 pp | 40.0 (step 4) | +15.8 "
            "pp | 30 x 4 |  |") in md
    assert ("| demo | relay_eval | coach score of the final agent (0-10) | 1.2 | 10.0 (step 50) | "
            "+8.8300 |") in md
    assert ("| dsbench | tasks | ours: success rate (valid submission.csv) | 50.0 | 75.0 (step 120) | +25.0 "
            "pp | 75.0 (step 120) | +25.0 pp | 8 x 4 |  |") in md


def test_paper_table_refuses_a_run_without_evaluations(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "openrlhf_mappa.tools.mappa", "paper-table", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "no eval.jsonl records (pass --eval.dataset to the run)" in proc.stderr


@pytest.mark.parametrize("script, flags", [
    ("train_mappa_mathchat.sh", {"--eval.steps": "4", "--eval.n_samples_per_prompt": "4", "--eval.temperature": "0.6"}),
    ("train_mappa_dsbench.sh", {"--eval.steps": "2", "--eval.n_samples_per_prompt": "4", "--eval.temperature": "0.6"}),
])  # fmt: skip
def test_gpu_scripts_evaluate_as_the_authors(tmp_path, script, flags):
    # Catches the old scripts, which passed no --eval.*: only before and after, on no eval set at all.
    argv, _ = submit_script(os.path.join(SCRIPTS, script), tmp_path, MAPPA_DATA="/data")
    argv = argv[argv.index("openrlhf_mappa.cli.train_mappa_ray") + 1:]
    assert {k: argv[argv.index(k) + 1] for k in flags} == flags
    evals = argv[argv.index("--eval.dataset") + 1].split(",")
    if script == "train_mappa_mathchat.sh":
        assert evals == ["/data/aime_2025.json", "/data/amc_eval_32.json"]
        assert argv[argv.index("--data.prompt_dataset") + 1] == "/data/AIME_1983_2024.json"
    else:
        assert evals == [os.path.join(REPO, "data", "dsbench-eval", "tasks.jsonl")]


def run_script(script, tmp_path, **env):
    """The script under bash, `ray` on PATH recording a submission (conftest.submit_script), the data check on."""
    stub = tmp_path / "bin" / "ray"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text(f"#!/bin/sh\necho submitted > {tmp_path / 'submitted'}\n")
    stub.chmod(0o755)
    env = dict(os.environ, PATH=f"{stub.parent}{os.pathsep}{os.environ['PATH']}", MAPPA_COACH_BASE_URL="http://c/v1",
               MAPPA_COACH_MODEL="c", MAPPA_SKIP_DATA_CHECK="0", MAPPA_SKIP_CHECK="1",
               **env)
    proc = subprocess.run(["bash", os.path.join(SCRIPTS, script)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=60)
    return proc, (tmp_path / "submitted").exists()


@needs_bench
def test_mathchat_script_refuses_missing_or_different_data_before_submitting(tmp_path):
    # Catches the old script, which sent a missing data/AIME_1983_2024.json to the cluster, found missing there.
    data = tmp_path / "data"
    data.mkdir()
    proc, submitted = run_script("train_mappa_mathchat.sh", tmp_path, MAPPA_DATA=str(data))
    assert proc.returncode == 1 and not submitted
    assert (f"{data}/AIME_1983_2024.json is missing. It is the authors' data/Bench/AIME_1983_2024.json "
            "(github.com/ltjed/multiagent-coaching, SHA-256 bf08c2a301e4f5dc338453c1e19d0993448452a0d5fdb739826cf6092"
            "55671d3)") in proc.stderr

    for name in ("AIME_1983_2024.json", "aime_2025.json", "amc_eval_32.json"):
        (data / name).write_bytes(open(os.path.join(BENCH, name), "rb").read())
    (data / "amc_eval_32.json").write_bytes((data / "amc_eval_32.json").read_bytes() + b"\n")  # one byte more
    proc, submitted = run_script("train_mappa_mathchat.sh", tmp_path, MAPPA_DATA=str(data))
    changed = hashlib.sha256((data / "amc_eval_32.json").read_bytes()).hexdigest()
    assert proc.returncode == 1 and not submitted
    assert f"amc_eval_32.json has SHA-256 {changed}, not the authors' ba208c17af3586190f6fb" in proc.stderr

    (data / "amc_eval_32.json").write_bytes(open(os.path.join(BENCH, "amc_eval_32.json"), "rb").read())
    proc, submitted = run_script("train_mappa_mathchat.sh", tmp_path, MAPPA_DATA=str(data))
    assert proc.returncode == 0 and submitted, proc.stderr


@needs_bench
def test_dsbench_script_refuses_unimported_tasks_and_other_metadata(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    for name in ("dsbench_modeling_train.json", "dsbench_modeling_eval.json"):
        (data / name).write_bytes(open(os.path.join(BENCH, name), "rb").read())
    proc, submitted = run_script("train_mappa_dsbench.sh", tmp_path, MAPPA_DATA=str(data))
    assert proc.returncode == 1 and not submitted  # the checkout has no imported tasks
    assert (f"{REPO}/data/dsbench/tasks.jsonl is missing: import the tasks of the authors' dsbench_modeling_train.json"
            f" from DSBench's data, mappa dsbench import --data-root DIR --metadata {data}/dsbench_modeling_train.json "
            f"--out {REPO}/data/dsbench (README, DSBench), with the authors' data/Bench/dsbench_modeling_cleaned_prompts"
            f".json (the agents' task text, SHA-256 fa5de59bab19296a1e4eed3305a594daa60bc3f199a8462653a3c4b6fbc44fdc) "
            f"beside the metadata") in proc.stderr
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("{}\n")
    # the authors' eval metadata passes its check (a 65-character hash once refused it: audit 4, N3); the eval
    # tasks are not imported in the checkout either
    proc, submitted = run_script("train_mappa_dsbench.sh", tmp_path, MAPPA_DATA=str(data),
                                 MAPPA_TRAIN_DATA=str(tasks))
    assert proc.returncode == 1 and not submitted
    assert "SHA-256 6ea24184" not in proc.stderr
    assert (f"{REPO}/data/dsbench-eval/tasks.jsonl is missing: import the tasks of the authors' "
            "dsbench_modeling_eval.json") in proc.stderr
    (data / "dsbench_modeling_eval.json").write_text("{}\n")
    proc, submitted = run_script("train_mappa_dsbench.sh", tmp_path, MAPPA_DATA=str(data), MAPPA_TRAIN_DATA=str(tasks))
    assert proc.returncode == 1 and not submitted
    assert "dsbench_modeling_eval.json has SHA-256" in proc.stderr and "not their data/Bench/" in proc.stderr
    # your own tasks for both: nothing of the authors' is checked
    proc, submitted = run_script("train_mappa_dsbench.sh", tmp_path, MAPPA_DATA=str(data), MAPPA_TRAIN_DATA=str(tasks),
                                 MAPPA_EVAL_DATA=str(tasks))
    assert proc.returncode == 0 and submitted, proc.stderr


def paper_hashes() -> dict:
    """{file: SHA-256} as examples/scripts/paper_data.sh holds them (its paper_sha256 case lines)."""
    text = open(os.path.join(SCRIPTS, "paper_data.sh"), encoding="utf-8").read()
    return dict(re.findall(r"^ +(\S+)\) echo (\S+) ;;$", text, re.MULTILINE))


def data_check(directory, *files) -> subprocess.CompletedProcess:
    """The scripts' own data check: paper_data.sh sourced from the checkout as the scripts source it, then
    `paper_data DIR FILE...`."""
    script = 'source examples/scripts/paper_data.sh && paper_data "$@"'
    return subprocess.run(["bash", "-c", script, "check", str(directory), *files], cwd=REPO,
                          capture_output=True, env=dict(os.environ, MAPPA_SKIP_DATA_CHECK="0"), text=True,
                          timeout=60)


@needs_bench
def test_every_hash_of_the_scripts_data_check_is_the_authors_files(tmp_path):
    # Catches the 65-character hash of dsbench_modeling_eval.json (audit 4, N3): the check refused the
    # authors' own file, and the DSBench recipe could not start.
    hashes = paper_hashes()
    assert len(hashes) == 6 and all(re.fullmatch("[0-9a-f]{64}", h) for h in hashes.values()), hashes
    reference = open(os.path.join(REPO, "docs", "reference.md"), encoding="utf-8").read()
    assert dict(re.findall(r"^\| `data/Bench/(\S+)` \|.*\| `(\w+)` \|$", reference, re.MULTILINE)) == hashes
    # The cleaned task texts are not in the shared bench (only `mappa dsbench import` reads them): their hash
    # was checked against the authors' commit ed66921 by hand.
    shared = [name for name in hashes if name != "dsbench_modeling_cleaned_prompts.json"]
    for name in shared:
        genuine = open(os.path.join(BENCH, name), "rb").read()
        assert hashlib.sha256(genuine).hexdigest() == hashes[name], name
        changed = bytearray(genuine)
        changed[len(changed) // 2] ^= 1  # one byte
        (tmp_path / name).write_bytes(changed)
        proc = data_check(tmp_path, name)
        assert proc.returncode == 1, name
        assert (f"{tmp_path}/{name} has SHA-256 {hashlib.sha256(changed).hexdigest()}, not the authors' "
                f"{hashes[name]}: it is not their data/Bench/{name}") in proc.stderr
    proc = data_check(BENCH, *shared)
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr


def test_each_environment_heads_its_accuracy_and_the_run_log_records_it(tmp_path):
    # Catches the table of the second user trial (issue 64): "math-verify" headed a relay's and a custom
    # environment's accuracy, and every run was named `run`.
    from types import SimpleNamespace

    from openrlhf_mappa.run_log import RunLog

    configs = os.path.join(REPO, "examples", "configs")
    graders = {name: load_topology(os.path.join(configs, f"{name}.yaml"), model_override="m").env_cls.grader
               for name in ("mathchat", "debate", "relay", "dsbench")}
    assert graders == {"mathchat": "math-verify", "debate": "math-verify",
                       "relay": "success (the environment's outcome)", "dsbench": "valid submission.csv"}
    args = SimpleNamespace(logger=SimpleNamespace(wandb=SimpleNamespace(key=None), tensorboard_dir=None))
    run = tmp_path / "gift" / "run"
    RunLog(args, str(run)).evaluation(3, "gifts_eval", {"accuracy": 0.5, "n_problems": 2, "n_samples": 1}, [],
                                      graders["relay"])
    assert json.loads((run / "eval.jsonl").read_text()) == {
        "step": 3, "dataset": "gifts_eval", "grader": "success (the environment's outcome)", "accuracy": 0.5,
        "n_problems": 2, "n_samples": 1}  # fmt: skip
    rows = paper_table.table([str(run)])["accuracy"]
    assert [(r["name"], r["metric"], r["after"]) for r in rows] == [
        ("gift", "success (the environment's outcome)", 50.0)]


def test_the_documented_mappa_eval_commands_run_at_the_recipes_lengths():
    # Catches audit 4's N5: the docs' `mappa eval` examples ran at its defaults (1,024 new tokens or max_len
    # 8,192), too short for the paper's figures.
    reference = open(os.path.join(REPO, "docs", "reference.md"), encoding="utf-8").read()
    block = reference.split("**Standalone**", 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [c for c in block.replace("\\\n", " ").splitlines() if c.startswith("mappa eval")]
    script = open(os.path.join(SCRIPTS, "train_mappa_mathchat.sh"), encoding="utf-8").read()
    recipe = {flag: re.search(rf"{flag} (\d+)", script).group(1) for flag in ("--rollout.max_new_tokens",
                                                                              "--data.max_len")}
    assert len(commands) == 2 and recipe == {"--rollout.max_new_tokens": "4096", "--data.max_len": "28672"}
    for command in commands:
        words = command.split()
        assert {flag: words[words.index(flag) + 1] for flag in recipe if flag in words} == recipe, command
