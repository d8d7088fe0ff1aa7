"""The trainer's pure pieces: the batch rule for agents whose action count varies, the Experience layout of
one action (only the agent's own generated tokens train), resume bookkeeping (team checkpoint marker, log
truncation), bad input rejected by the CLI before Ray starts, the training subset, truncated actions in the
rollout and the metrics, and the outcome baseline's coach. (The over-long prompt rule is tested with the
rollout, in test_topology_env.py.)"""

import asyncio
import json
import os
import random
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import REPO, stand_in_team, train_step
from test_coach import ScriptedPolicy

from openrlhf_mappa.cli.train_mappa_ray import choose_train_tasks, parse_args
from openrlhf_mappa.coach import Coach, render_prompt
from openrlhf_mappa.coach.audit import check_failures, coach_step_metrics
from openrlhf_mappa.envs.base import load_tasks
from openrlhf_mappa.episode import Action, Episode, Verdict
from openrlhf_mappa.rollout import rollout
from openrlhf_mappa.team import load_topology
from openrlhf_mappa.resume import apply, check_resume
from openrlhf_mappa.resume import truncate_logs
from openrlhf_mappa.rewards import batch_rule, experience_of
from openrlhf_mappa.run_log import step_metrics
from openrlhf_mappa.trainer import MappaTrainer

MATHCHAT_YAML = os.path.join(REPO, "examples", "configs", "mathchat.yaml")
AIME = os.path.join(os.environ.get("MAPPA_BENCH_DIR", os.path.join(os.path.dirname(REPO), "shared", "data", "mappa-bench")),
                    "AIME_1983_2024.json")


def model_dir(tmp_path) -> str:
    """A directory the launcher's model check accepts (it reads file names only), for a run refused later on."""
    (tmp_path / "model").mkdir(exist_ok=True)
    for name in ("config.json", "tokenizer.json"):
        (tmp_path / "model" / name).write_text("{}")
    return str(tmp_path / "model")


def train_with(batch_size, seed=0):
    return SimpleNamespace(batch_size=batch_size, seed=seed)


def executor_actions(turns_per_episode):
    return [Action(f"ep{e}", "code_executor", t, [1], [2], reward=1.0) for e, n in enumerate(turns_per_episode)
            for t in range(n)]


def test_batch_rule_keeps_whole_train_batches_of_a_varying_agent():
    # A Code Executor acting 1-2 times per episode: 1+2+2+1+2 = 8 actions, B = 3 -> 6 kept, 2 dropped.
    actions = executor_actions([1, 2, 2, 1, 2])
    kept, dropped = batch_rule(actions, train_with(3), step=1)
    assert (len(kept), dropped) == (6, 2)
    assert len({id(a) for a in kept}) == 6 and all(a in actions for a in kept)
    # seeded: the same step picks the same actions; another step may pick others
    again, _ = batch_rule(actions, train_with(3), step=1)
    assert [id(a) for a in again] == [id(a) for a in kept]


def test_batch_rule_skips_an_agent_with_fewer_actions_than_a_batch():
    kept, dropped = batch_rule(executor_actions([1, 2]), train_with(4), step=1)
    assert (kept, dropped) == ([], 3)
    kept, dropped = batch_rule([], train_with(4), step=1)
    assert (kept, dropped) == ([], 0)


def test_experience_trains_only_the_response_tokens():
    # prompt (with earlier agents' output and tool feedback rendered into it) = 5 tokens, response = 3
    action = Action("ep", "verifier", 0, prompt_ids=[10, 11, 12, 13, 14], response_ids=[20, 21, 22],
                    prompt_text="p", truncated=True)
    action.reward = 7.5
    e = experience_of(action)
    assert e.sequences.tolist() == [[10, 11, 12, 13, 14, 20, 21, 22]]
    # OpenRLHF's action mask is shifted by one: position i scores token i+1
    assert e.action_mask.tolist() == [[False, False, False, False, True, True, True]]
    assert e.rewards.tolist() == [7.5] and e.truncated.tolist() == [True]
    assert e.response_length.tolist() == [3.0] and e.total_length.tolist() == [8.0]


def test_truncate_logs_keeps_steps_up_to_the_checkpoint(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "x": ')
    (tmp_path / "episodes.jsonl").write_text('{"step": 1, "a": 1}\n{"step": 1, "a": 2}\n{"step": 3}')
    truncate_logs(str(tmp_path), 2)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert (tmp_path / "episodes.jsonl").read_text() == '{"step": 1, "a": 1}\n{"step": 1, "a": 2}\n'
    truncate_logs(str(tmp_path), 0)  # a fresh start in the same run directory
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def prepare_resume(args, topology) -> int:
    """What the launcher does: check the resume state, then make the changes it found."""
    step, fixes = check_resume(args, topology, [])
    apply(fixes)
    return step


def fake_checkpoints(root, latest_by_agent, marker_step=None):
    for agent, tags in latest_by_agent.items():
        actor = root / agent / "_actor"
        for tag in tags:
            (actor / tag).mkdir(parents=True)
            (actor / tag / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"states")
        if tags:
            (actor / "latest").write_text(tags[-1])
    if marker_step is not None:
        (root / "mappa_checkpoint.json").write_text(json.dumps({"step": marker_step}))
    args = SimpleNamespace(ckpt=SimpleNamespace(load_enable=True, path=str(root)),
                           mappa=SimpleNamespace(shared_policy=False, run_dir=str(root / "run")))
    topology = SimpleNamespace(agents=[SimpleNamespace(name=a) for a in latest_by_agent])
    return args, topology


def test_prepare_resume_rolls_every_agent_back_to_the_team_checkpoint(tmp_path):
    # Killed while saving step 2: the solver had saved it, the verifier had not.
    args, topology = fake_checkpoints(tmp_path, {"solver": ["global_step1", "global_step2"], "verifier": ["global_step1"]}, 1)
    assert prepare_resume(args, topology) == 1
    assert (tmp_path / "solver" / "_actor" / "latest").read_text() == "global_step1"
    args.ckpt.load_enable = False
    assert prepare_resume(args, topology) == 0  # no --ckpt.load_enable: a fresh start


def test_prepare_resume_sets_aside_a_first_save_that_never_completed(tmp_path):
    args, topology = fake_checkpoints(tmp_path / "a", {"solver": ["global_step1"], "verifier": []})
    assert prepare_resume(args, topology) == 0
    assert not (tmp_path / "a" / "solver" / "_actor" / "latest").exists()
    assert (tmp_path / "a" / "solver" / "_actor" / "latest.incomplete").exists()
    args, topology = fake_checkpoints(tmp_path / "b", {"solver": ["global_step3"], "verifier": ["global_step1"]}, 3)
    with pytest.raises(ValueError, match="agent 'verifier' has no global_step3"):
        prepare_resume(args, topology)
    # Every agent's fault in one refusal, a line each.
    root = tmp_path / "c"
    args, topology = fake_checkpoints(root, {"solver": ["global_step1"], "verifier": []}, 3)
    with pytest.raises(ValueError) as err:
        prepare_resume(args, topology)
    assert str(err.value).split("\n") == [
        f"resume: agent 'solver' has no global_step3 in {root}/solver/_actor (removed by --ckpt.max_num?)",
        f"resume: {root}/mappa_checkpoint.json says step 3, but agent 'verifier' has no checkpoint in "
        f"{root}/verifier/_actor"]


def test_cli_rejects_bad_input_before_ray_starts(tmp_path):
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "1 + 1?", "answer": "2"}\n{"prompt": "", "answer": "3"}\n')
    (tmp_path / "t.yaml").write_text(
        "name: t\nenv: mathchat\ncoach_template: 'x {agent_output}'\nagents:\n"
        "  - {name: a, model: /no/such/model, role: r, prompt: '{task}'}\n"
    )
    base = [sys.executable, "-m", "openrlhf_mappa.cli.train_mappa_ray", "--vllm.num_engines", "1",
            "--rollout.max_new_tokens", "64"]
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    cases = [
        (["--mappa.topology", str(tmp_path / "t.yaml"), "--data.prompt_dataset", str(tmp_path / "tasks.jsonl")],
         "model '/no/such/model' is not a directory"),
        (["--mappa.topology", MATHCHAT_YAML, "--mappa.model", model_dir(tmp_path),
          "--data.prompt_dataset", str(tmp_path / "tasks.jsonl")], "tasks.jsonl: line 2: empty 'prompt'"),
    ]
    for flags, message in cases:
        proc = subprocess.run(base + flags, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
        assert "Ray" not in proc.stdout + proc.stderr  # rejected before any cluster, actor or engine


# ── the training subset ──


def test_choose_train_tasks_is_a_seeded_random_subset_in_file_order():
    # Catches the old first-N rows: 4 of 10 tasks with seed 42 are t0, t1, t5, t8 (numpy's legacy RandomState,
    # sorted: the authors' random_sample_train), not t0-t3; the same seed picks the same tasks again.
    tasks = [{"id": f"t{i}"} for i in range(10)]
    assert [t["id"] for t in choose_train_tasks(tasks, 4, seed=42)] == ["t0", "t1", "t5", "t8"]
    assert [t["id"] for t in choose_train_tasks(tasks, 4, seed=0)] == ["t2", "t4", "t8", "t9"]
    assert choose_train_tasks(tasks, 4, seed=42) == choose_train_tasks(tasks, 4, seed=42)
    assert choose_train_tasks(tasks, 10, seed=42) == tasks == choose_train_tasks(tasks, 10**8, seed=42)  # all, in order


@pytest.mark.skipif(not os.path.exists(AIME), reason="the shared benchmark files are not here")
def test_aime_subset_spans_every_year():
    # The brief's case: the first 512 of AIME_1983_2024 stop at 2010; a random 512 reach 2024.
    tasks = load_tasks(AIME)
    assert tasks[511]["year"] == 2010
    years = [t["year"] for t in choose_train_tasks(tasks, 512, seed=42)]
    assert (len(years), min(years), max(years)) == (512, 1983, 2024) and years == sorted(years)


def test_cli_records_the_training_subset_and_refuses_another_on_resume(tmp_path, monkeypatch):
    # Catches the old CLI, which took the first --data.max_samples rows and wrote no record of them, so a
    # resumed run with another seed would silently continue on other tasks. Refused launches write nothing.
    from openrlhf_mappa.cli import train_mappa_ray

    with open(tmp_path / "tasks.jsonl", "w") as f:
        f.writelines(json.dumps({"id": f"t{i}", "prompt": f"{i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(10))
    flags = ["--vllm.num_engines", "1", "--mappa.topology", MATHCHAT_YAML, "--mappa.model", model_dir(tmp_path),
             "--data.prompt_dataset", str(tmp_path / "tasks.jsonl"), "--data.max_samples", "4",
             "--rollout.max_new_tokens", "64", "--actor.num_gpus_per_node", "1", "--train.batch_size", "2",
             "--ds.attn_implementation", "sdpa",  # no flash-attn here (check_this_machine refuses flash attention)
             "--train.micro_batch_size", "1", "--mappa.run_dir", str(tmp_path / "run"),
             "--ckpt.path", str(tmp_path / "ckpt")]
    base = [sys.executable, "-m", "openrlhf_mappa.cli.train_mappa_ray", *flags]  # fmt: skip
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)

    proc = subprocess.run(base, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "fewer than --rollout.batch_size" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists()  # refused before anything was written

    # A launch that passes every check writes the record before Ray starts (launch, which starts Ray, stands in here).
    monkeypatch.setattr(train_mappa_ray, "launch", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt("no Ray here")))
    with pytest.raises(KeyboardInterrupt, match="no Ray here"):
        train_mappa_ray.train(train_mappa_ray.parse_args([*flags, "--rollout.batch_size", "2", "--mappa.verbose"]))
    record = json.loads((tmp_path / "run" / "train_tasks.json").read_text())
    source = {"datasets": str(tmp_path / "tasks.jsonl"), "probs": None, "split": "train", "input_key": "prompt",
              "label_key": "answer"}
    assert record == {"source": source, "seed": 42, "total": 10, "max_samples": 4,
                      "ids": ["t0", "t1", "t5", "t8"]}  # fmt: skip

    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "mappa_checkpoint.json").write_text(json.dumps({"step": 1}))
    proc = subprocess.run(base + ["--rollout.batch_size", "2", "--ckpt.load_enable", "--train.seed", "0"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert proc.returncode != 0 and "lists other training tasks" in proc.stderr, proc.stderr[-2000:]
    assert "Ray" not in proc.stdout + proc.stderr
    assert json.loads((tmp_path / "run" / "train_tasks.json").read_text()) == record  # the refused resume kept it


# ── rollout: truncated actions, the outcome baseline's coach ──


class CutOffPolicy(ScriptedPolicy):
    """A reply whose generation hit the token limit."""

    max_new_tokens = 8

    async def generate(self, prompt_ids):
        return [4] * self.max_new_tokens, True, []


class RecordingCoach(Coach):
    name = "recording"

    def __init__(self):
        self.requests = []

    async def score(self, request):
        self.requests.append(request)
        return Verdict(score=6.0, status="ok", coach=self.name)


def scripted_mathchat(truncated_solver: bool, coach_input: str = "authors", executor: str = "") -> tuple:
    topology = load_topology(MATHCHAT_YAML, model_override="m")
    topology.coach_input = coach_input
    solver = CutOffPolicy if truncated_solver else ScriptedPolicy
    policies = {"problem_solver": solver("Let me think about 2 + 2 and then"),
                "code_executor": ScriptedPolicy(executor or "No code needed: 2 + 2 = 4."),
                "verifier": ScriptedPolicy("So the answer is \\boxed{4}.")}  # fmt: skip
    return topology, policies, [{"id": "1", "prompt": "What is 2 + 2?", "answer": "4"}]


class VerifierCoach(RecordingCoach):
    """The verifier's verdicts never come (`hang`), or fail after a moment; the other agents' come at once."""

    def __init__(self, hang: bool):
        super().__init__()
        self.hang = hang

    async def score(self, request):
        if request.agent == "verifier":
            await asyncio.sleep(3600 if self.hang else 0.2)
            raise RuntimeError("the coach is down")
        return await super().score(request)


def test_the_rollout_handle_gives_each_member_its_verdicts_or_the_failure_and_leaves_none_waiting(tmp_path):
    # The handle the trainer reads: each member's verdicts as a future, set by the rollout. A member whose
    # verdicts are in gets its actions; one whose verdict failed gets the coach's error (never an invented
    # score); and when the run's loop stops with a verdict still coming, a thread waiting on it is told so.
    import concurrent.futures
    import threading

    from openrlhf_mappa.rollout import RolloutRunner

    topology, policies, tasks = scripted_mathchat(truncated_solver=False)
    members, runner = {a.name: a.name for a in topology.agents}, RolloutRunner()
    with runner.running():
        run = runner.start(topology, tasks * 2, policies, VerifierCoach(hang=False), str(tmp_path), 1,
                           members=members)
        assert len(run.episodes.result(timeout=60)) == 2 and run.seconds is not None
        solver = run.verdicts["problem_solver"].result(timeout=60)
        assert [(a.agent, a.verdict.score) for a in solver] == [("problem_solver", 6.0)] * 2
        with pytest.raises(RuntimeError, match="the coach is down"):
            run.verdicts["verifier"].result(timeout=60)
        with pytest.raises(RuntimeError, match="the coach is down"):
            run.complete.result(timeout=60)
        run = runner.start(topology, tasks, policies, VerifierCoach(hang=True), str(tmp_path), 2,
                           members=members)
        run.verdicts["code_executor"].result(timeout=60)
        waiting = concurrent.futures.Future()
        verifier = run.verdicts["verifier"]
        threading.Thread(target=lambda: waiting.set_result(verifier.exception())).start()
    assert isinstance(waiting.result(timeout=10), concurrent.futures.CancelledError)
    assert run.complete.cancelled()
    runner.loop.run_until_complete(asyncio.sleep(0.1))  # the stopped rollout's cancellation: nothing left
    runner.loop.close()


@pytest.mark.parametrize("coach_input, marked", [("authors", False), ("ours", True)])
def test_truncated_action_is_shown_to_the_coach_as_the_topology_says(coach_input, marked, tmp_path):
    # The authors' coach gets the raw text of a cut-off action (coach_utils.py); `coach_input: ours` marks
    # where it was cut off (before issue 62 every topology did, mathchat.yaml too). `mappa coach score` must
    # rebuild the same prompt from the log.
    topology, policies, tasks = scripted_mathchat(truncated_solver=True, coach_input=coach_input)
    coach = RecordingCoach()
    (episode,) = asyncio.run(rollout(topology, tasks, policies, coach, str(tmp_path), step=1))
    assert [a.coach_request["truncated_at"] for a in episode.actions] == [8, None, None]
    prompts = [render_prompt(topology.coach_template, r) for r in coach.requests]
    solver, executor = prompts[:2]
    assert ("Let me think about 2 + 2 and then\n[cut off at the limit of 8 tokens]" in solver) is marked
    assert "Let me think about 2 + 2 and then" in solver
    assert "[cut off at the limit" not in executor

    from openrlhf_mappa.tools import rescore

    (tmp_path / "episodes.jsonl").write_text(episode.to_json() + "\n")
    again = RecordingCoach()
    asyncio.run(rescore.rescore(rescore.read_actions(str(tmp_path / "episodes.jsonl")), again))
    assert sorted((r.agent, r.truncated_at) for r in again.requests) == [
        ("code_executor", None), ("problem_solver", 8), ("verifier", None)]  # fmt: skip
    rebuilt = {r.agent: render_prompt(topology.coach_template, r) for r in again.requests}
    assert [rebuilt[r.agent] for r in coach.requests] == prompts


def test_the_coach_sees_the_first_2000_characters_of_a_code_run_as_the_authors(tmp_path):
    """The authors' coach reads tool_observation[:2000] (coach_utils.py); the agent sees up to 4,000 chars
    a stream and the workspace's files. `coach_input: ours` shows the coach what the agent saw."""
    code = "```python\nopen('notes.txt', 'w').write('x')\nprint('7' * 3000)\n```"
    seen = {}
    for coach_input in ("authors", "ours"):
        topology, policies, tasks = scripted_mathchat(False, coach_input, executor=code)
        coach = RecordingCoach()
        workspace = str(tmp_path / coach_input)
        (episode,) = asyncio.run(rollout(topology, tasks, policies, coach, workspace, step=1))
        run = episode.actions[1].feedback
        seen[coach_input] = (coach.requests[1].feedback, run)
    authors, run = seen["authors"]
    assert authors == run.as_text()[:2000] == "stdout:\n" + "7" * 1992
    ours, run = seen["ours"]
    assert ours == run.as_text() and len(ours) > 3000
    assert "\nfiles: notes.txt\nthis run created: notes.txt" in ours


@pytest.mark.parametrize("classification, counts", [(40, (10, 6)), (45, (11, 5))])
def test_dsbench_batches_keep_the_share_of_each_task_type(classification, counts):
    """`batch_strata: type` (dsbench.yaml), as the authors' StratifiedBatchSampler: every step's 16 tasks hold
    round(16 x share) of each type, the rounding's rest going to the larger group; a pass of 64 tasks still
    takes 4 steps, each task once where the shares divide evenly (40 + 24: 10 + 6 a batch), a group used up
    drawn again (45 + 19: 11 + 5 a batch, so 44 classification tasks and 20 regression ones, one of them
    twice). Without it (MathChat): one shuffle per pass, as before."""
    kinds = ["classification"] * classification + ["regression"] * (64 - classification)
    tasks = [{"id": str(i), "type": kind} for i, kind in enumerate(kinds)]
    args = SimpleNamespace(rollout=SimpleNamespace(batch_size=16, n_samples_per_prompt=1),
                           train=SimpleNamespace(num_episodes=2, seed=42))
    trainer = SimpleNamespace(args=args, tasks=tasks, topology=SimpleNamespace(batch_strata="type"))
    steps = list(MappaTrainer.batches(trainer, 0))
    assert [step for step, _ in steps] == list(range(1, 9))
    for _, batch in steps:
        kinds = [t["type"] for t in batch]
        assert (kinds.count("classification"), kinds.count("regression")) == counts
    first_pass = [t["id"] for _, batch in steps[:4] for t in batch]
    assert len(set(first_pass)) == (64 if counts == (10, 6) else 63)
    assert [t["id"] for t in steps[4][1]] != [t["id"] for t in steps[0][1]]  # each pass in its own order
    trainer.topology.batch_strata = None
    order = list(range(64))
    random.Random(42).shuffle(order)
    assert [t["id"] for t in next(MappaTrainer.batches(trainer, 0))[1]] == [str(i) for i in order[:16]]


def trainer_for(reward: str, coach, tmp_path, score_outcome_runs: bool = False) -> MappaTrainer:
    """A MappaTrainer with no agents (nothing on Ray): enough to see which coach its rollouts ask."""
    args = SimpleNamespace(
        mappa=SimpleNamespace(reward=reward, max_staleness=0, ppo_ratio="trainer", logprob_metrics=False,
                              coach=SimpleNamespace(score_outcome_runs=score_outcome_runs, bias_threshold=1.0,
                                                    bias_window=5)),
        algo=SimpleNamespace(advantage=SimpleNamespace(is_correction_level="off")),
        train=SimpleNamespace(async_enable=False),
        rollout=SimpleNamespace(temperature=1.0, top_p=1.0), eval=SimpleNamespace(temperature=0.6),
        data=SimpleNamespace(max_len=64), logger=SimpleNamespace(wandb=SimpleNamespace(key=None), tensorboard_dir=None),
    )  # fmt: skip
    trainer = MappaTrainer(args, None, [], coach, [], str(tmp_path / "run"))
    trainer.runner.loop.close()
    return trainer


def test_outcome_baseline_asks_no_coach_unless_told(tmp_path):
    # Catches the old rollout of the outcome baseline, which sent every action to the (possibly paid) coach.
    topology, policies, tasks = scripted_mathchat(truncated_solver=False)
    coach = RecordingCoach()
    trainer = trainer_for("outcome", coach, tmp_path)
    (episode,) = asyncio.run(rollout(topology, tasks, policies, trainer.rollout_coach, str(tmp_path / "ws"), step=1))
    assert coach.requests == [] and not trainer.scored
    assert {a.verdict.status for a in episode.actions} == {"skipped"}
    assert episode.actions[0].verdict.rationale == "outcome baseline: not scored"
    m = coach_step_metrics([episode])
    assert (m["coach/verdicts_skipped"], m["coach/failure_fraction"]) == (3, 0.0)
    check_failures([episode], m, max_fraction=0.0)  # skipped verdicts are not failures

    # --mappa.coach.score_outcome_runs: the coach is asked (and its failures checked), for comparison only.
    trainer = trainer_for("outcome", coach, tmp_path, score_outcome_runs=True)
    assert trainer.rollout_coach is coach and trainer.scored
    assert trainer_for("process", coach, tmp_path).rollout_coach is coach


def test_step_metrics_count_truncated_actions_per_agent_and_log_the_scale():
    # Catches the old metrics, which neither counted the truncated actions left out nor logged reward_scale.
    agents = [SimpleNamespace(spec=SimpleNamespace(name=n)) for n in ("solver", "verifier")]
    episodes = [Episode("e", "t", outcome={"success": True}, actions=[
        Action("e", "solver", 0, [1], [2, 3], truncated=True, verdict=Verdict(9.0, "ok")),
        Action("e", "verifier", 0, [1], [2], verdict=Verdict(8.0, "ok"))])]  # fmt: skip
    from openrlhf_mappa.rewards import assign_rewards

    counts = assign_rewards(episodes, "process", scale=0.1)
    m = step_metrics(parse_args(["--mappa.topology", "t.yaml"]), SimpleNamespace(reward_scale=0.1), agents,
                     {"solver": "solver", "verifier": "verifier"}, episodes, {}, {}, {"solver": 0, "verifier": 0}, counts,
                     {"solver": 0.0, "verifier": 0.0})
    assert (m["agent/solver/truncated_left_out"], m["agent/verifier/truncated_left_out"]) == (1, 0)
    assert m["reward_scale"] == 0.1 and m["coach/left_out"] == 0
    assert episodes[0].actions[1].reward == pytest.approx(0.8)  # Action.reward: the scaled reward it trains on


class ByTaskCoach(Coach):
    """Scores an action by its task's length: a score that differs between the episodes, and so do the advantages."""

    name = "by-task"

    async def score(self, request):
        return Verdict(score=float(len(request.task) % 11), status="ok", coach=self.name)


def truncated_solver_step(tmp_path, *flags) -> tuple:
    """One step of a MathChat team whose problem solver's every reply is cut off at the token limit, all of the
    driver for real but the agents' Ray side (conftest.StandIn) and their engines (scripted replies): (the step's
    metrics, its episodes' actions as episodes.jsonl records them, the agents' stand-ins)."""
    topology, policies, _ = scripted_mathchat(truncated_solver=True)
    tasks = [{"id": "1", "prompt": "What is 2 + 2?", "answer": "4"}, {"id": "2", "prompt": "What is 12 + 30?", "answer": "42"}]
    args = parse_args(["--mappa.topology", MATHCHAT_YAML, "--mappa.run_dir", str(tmp_path / "run"), "--ckpt.path",
                       str(tmp_path / "ckpt"), "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "1",
                       "--train.batch_size", "2", "--data.max_len", "256", "--actor.num_gpus_per_node", "1",
                       "--vllm.num_engines", "1", "--train.micro_batch_size", "1", *flags])  # fmt: skip
    agents = stand_in_team(args, topology)
    trainer = MappaTrainer(args, topology, agents, ByTaskCoach(), tasks, args.mappa.run_dir)
    trainer.policies = policies
    m = train_step(trainer, 1, tasks)
    episodes = [json.loads(line) for line in open(tmp_path / "run" / "episodes.jsonl")]
    return m, [a for ep in episodes for a in ep["actions"]], [ag.trainer for ag in agents]


def test_truncated_actions_train_at_zero_loss_in_their_agents_batch(tmp_path, monkeypatch, capsys):
    # Catches the old batch (now --mappa.batch_semantics usable): the solver's cut-off actions left its batch, so it
    # took no optimizer step. By default they are its batch, at zero loss: each row's advantage is 0 on every action
    # token, with its action mask kept (OpenRLHF counts it in the loss denominator), and its action records its reward.
    from openrlhf_mappa.console import console as run_console

    monkeypatch.setattr(run_console, "err", sys.stdout)  # captured
    m, actions, (solver, executor, verifier) = truncated_solver_step(tmp_path)
    # A batch of zero-loss rows alone learns nothing: the console says so (and --mappa.max_untrained_steps counts it).
    assert "[mappa] step 1: agent 'problem_solver' trained on nothing: 2 of its 2 actions cut off" in capsys.readouterr().out
    ((step, rows),) = solver.trained
    own = [a for a in actions if a["agent"] == "problem_solver"]
    assert step == 1 and len(rows) == 2 == len(own) and all(a["zero_loss"] and a["advantage"] == 0.0 for a in own)
    for e in rows:
        (a,) = [a for a in own if a["prompt_text"] == e.prompts[0]]
        assert e.rewards.item() == pytest.approx(a["reward"]) == 0.1 * (len(a["coach_request"]["task"]) % 11)
        assert e.action_mask.sum() == 8 and torch.equal(e.advantages, torch.zeros_like(e.advantages))
    assert (m["agent/problem_solver/updated"], m["agent/problem_solver/trained_actions"]) == (1, 2)
    assert (m["agent/problem_solver/zero_loss_rows"], m["agent/problem_solver/truncated_left_out"]) == (2, 2)
    # One optimizer step each (2 rows, batches of 2); the others' rows train as before.
    assert [m[f"agent/{n}/optimizer_steps"] for n in ("problem_solver", "code_executor", "verifier")] == [1, 1, 1]
    assert (m["agent/verifier/zero_loss_rows"], len(verifier.trained), len(executor.trained)) == (0, 1, 1)


def test_a_step_in_which_one_agent_has_no_batch_trains_the_others_alone(tmp_path):
    # --mappa.batch_semantics usable (the behaviour before; no --mappa.train_truncated): every reply of the problem
    # solver is cut off at the token limit, so it has nothing to train: no batch, no train_step, metrics that say so.
    # The others train on their own actions, each row on its action's reward, each action recording its row's mean
    # advantage.
    m, actions, (solver, executor, verifier) = truncated_solver_step(tmp_path, "--mappa.batch_semantics", "usable")
    assert solver.trained == []
    assert (m["agent/problem_solver/updated"], m["agent/problem_solver/trained_actions"]) == (0, 0)
    assert (m["agent/problem_solver/truncated_left_out"], m["agent/problem_solver/dropped_for_batching"]) == (2, 0)
    assert not {"agent/problem_solver/kl", "agent/problem_solver/policy_loss"} & set(m)
    assert (m["agent/problem_solver/optimizer_steps"], m["agent/problem_solver/zero_loss_rows"]) == (0, 0)
    assert all(a["reward"] is None and a["advantage"] is None for a in actions if a["agent"] == "problem_solver")
    for name, stand_in in (("code_executor", executor), ("verifier", verifier)):
        assert (m[f"agent/{name}/updated"], m[f"agent/{name}/trained_actions"], m[f"agent/{name}/kl"]) == (1, 2, 0.0)
        ((step, rows),) = stand_in.trained
        own = [a for a in actions if a["agent"] == name]
        assert step == 1 and len(rows) == 2 == len(own)
        for e in rows:
            (a,) = [a for a in own if a["prompt_text"] == e.prompts[0]]  # the row's own action
            assert a["reward"] == pytest.approx(0.1 * (len(a["coach_request"]["task"]) % 11))  # MathChat's scale 0.1
            assert e.rewards.item() == pytest.approx(a["reward"])
            assert a["advantage"] == pytest.approx(((e.advantages * e.action_mask).sum() / e.action_mask.sum()).item())
        # two rewards over rows of equal length, whitened: -1 and +1
        assert sorted(a["advantage"] for a in own) == pytest.approx([-1.0, 1.0], abs=1e-3)


# Steps 1, 2, 3 and 25 of a real `make demo` run (its metrics.jsonl; only the keys the console reads, and one
# agent's KL and loss missing at step 2, as when an agent skips its update), and its eval.jsonl.
DEMO_METRICS = [
    {"step": 1, "outcome/success_rate": 0.0, "agent/quantity/coach_score": 1.3, "agent/item/coach_score": 3.1,
     "agent/code/coach_score": 2.5, "agent/quantity/kl": 0.0, "agent/item/kl": 0.0, "agent/code/kl": 0.0,
     "agent/quantity/policy_loss": 2e-07, "agent/item/policy_loss": 1e-07, "agent/code/policy_loss": 0.0,
     "timing/rollout": 0.61, "timing/experience": 0.8, "timing/train": 2.0, "timing/sync": 1.4, "timing/step": 4.9},
    {"step": 2, "outcome/success_rate": 0.0, "agent/quantity/coach_score": 1.2, "agent/item/coach_score": 2.0,
     "agent/code/coach_score": 1.5, "agent/quantity/kl": 0.0, "agent/item/kl": 0.0,
     "agent/quantity/policy_loss": 3e-07, "agent/item/policy_loss": 3e-07,
     "timing/rollout": 0.5, "timing/experience": 0.4, "timing/train": 0.9, "timing/sync": 0.3, "timing/step": 2.2},
    {"step": 3, "outcome/success_rate": 0.0625, "agent/quantity/coach_score": 1.9, "agent/item/coach_score": 2.0,
     "agent/code/coach_score": 2.4, "timing/step": 2.3},
    {"step": 25, "outcome/success_rate": 0.0625, "agent/quantity/coach_score": 7.024249999999999,
     "agent/item/coach_score": 3.771562499999999, "agent/code/coach_score": 6.289062499999999,
     "agent/quantity/kl": 0.0, "agent/item/kl": 0.0, "agent/code/kl": 0.0,
     "agent/quantity/policy_loss": -3.0139707169442805e-07, "agent/item/policy_loss": 2.789311110973358e-07,
     "agent/code/policy_loss": 6.235562838040866e-08, "timing/rollout": 0.7059924602508545,
     "timing/experience": 0.8145232200622559, "timing/train": 2.0146102905273438, "timing/sync": 1.3925509452819824,
     "timing/step": 4.941298246383667},
]
DEMO_EVAL = [{"step": 0, "dataset": "relay_eval", "accuracy": 0.0, "n_problems": 8, "n_samples": 2},
             {"step": 30, "dataset": "relay_eval", "accuracy": 0.375, "n_problems": 8, "n_samples": 2}]


def test_step_line_reads_like_openrlhfs_step_log():
    from openrlhf_mappa.console import step_line

    agents = ["quantity", "item", "code"]
    assert step_line(25, 30, DEMO_METRICS[3], agents) == (
        "[mappa] step 25/30 | success 0.062 | coach quantity 7.02, item 3.77, code 6.29 | kl 0 | loss 1.33e-08 | "
        "rollout 0.7s, experience 0.8s, train 2.0s, sync 1.4s, step 4.9s")
    # KL and loss are the means over the agents that updated; a value nobody logged is a dash, not a zero.
    assert " | kl 0 | loss 3e-07 | " in step_line(2, 30, DEMO_METRICS[1], agents)
    line = step_line(3, 30, DEMO_METRICS[2], agents)
    assert " | kl - | loss - | rollout -s, experience -s, train -s, sync -s, step 2.3s" in line


def test_run_summary_compares_the_first_and_last_steps_and_evaluations(tmp_path):
    from openrlhf_mappa.console import run_summary

    assert run_summary(str(tmp_path)) == ["[mappa] no step finished"]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in DEMO_METRICS))
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(m) + "\n" for m in DEMO_EVAL))
    assert run_summary(str(tmp_path)) == [
        "[mappa] 4 steps (0.2 min of training steps); success rate 0.021 (first 3 steps) -> 0.042 (last 3)",
        "[mappa] coach score (first 3 -> last 3 steps): quantity 1.467 -> 3.375, item 2.367 -> 2.591, code 2.133 -> 3.396",
        "[mappa] evaluation relay_eval: accuracy 0.000 (step 0) -> 0.375 (step 30)",
    ]


def test_output_to_sends_the_noise_to_the_log_and_keeps_errors_on_the_terminal(tmp_path):
    # What --mappa.verbose turns off, in a real child process: a library's write to file descriptor 2 (as
    # vLLM's and DeepSpeed's log handlers do) and print() (as Ray's forwarding of its workers' output) go to
    # the log; the run's own lines stay on the terminal, and so does the error that ends the run.
    code = f"""
import os, sys
from openrlhf_mappa.console import console
from openrlhf_mappa.cli.train_mappa_ray import output_to
with output_to({str(tmp_path / 'train.log')!r}):
    os.write(2, b"INFO vllm engine noise\\n")
    print("(RolloutRayActor pid=1) forwarded worker line")
    print("[mappa] step 1/1 | success 1.000", file=console.err)
    print("[mappa] resuming after step 3", file=console.out)
    raise RuntimeError("agent 'solver': actor rank 0 died")
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    log = (tmp_path / "train.log").read_text()
    assert "INFO vllm engine noise" in log and "forwarded worker line" in log
    assert "vllm engine" not in proc.stdout + proc.stderr and "worker line" not in proc.stdout + proc.stderr
    assert proc.stdout == "[mappa] resuming after step 3\n"
    assert ("[mappa] step 1/1 | success 1.000\n[mappa] the run stopped; Ray's, vLLM's and DeepSpeed's output is in "
            f"{tmp_path / 'train.log'}\nTraceback") in proc.stderr  # (importing torch warns before the redirect)
    assert proc.returncode == 1 and proc.stderr.endswith("RuntimeError: agent 'solver': actor rank 0 died\n")
