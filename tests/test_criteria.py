"""Coach criteria that change over training (topology `coach_templates`), and a coach that sees its running
bias (--mappa.coach.show_bias): validation at load time, the switch rule, the switch surviving a resume from
the files a run writes, the report's marker, and the bias figures in the prompt an OpenAI-compatible coach
server receives. MappaTrainer.fit itself drives the steps: real rollouts (MathChat environment, code run in the
sandbox), a real HTTP coach server on 127.0.0.1, scripted replies standing in for the vLLM engines and
conftest.StandIn for the agents' Ray actors; no Ray (the e2e part is in test_resume_e2e.py)."""

import dataclasses
import json
import os
import sys
import time
from types import SimpleNamespace

import pytest
import torch

from coach_server import COACH_TEMPLATE, CoachServer
from conftest import StandIn, render_report_dom, stand_in_team, train_step

from openrlhf_mappa.tools import report
from openrlhf_mappa.coach import CoachRequest, render_prompt
from openrlhf_mappa.coach.audit import BiasAudit
from openrlhf_mappa.coach.heuristic import HeuristicCoach
from openrlhf_mappa.coach.openai_compat import OpenAICoach
from openrlhf_mappa.episode import COACH_NAME, Action, Episode, ToolFeedback, Verdict
from openrlhf_mappa.team import load_topology
from openrlhf_mappa.topology import AGENT_METRICS
from openrlhf_mappa import trainer as trainer_module
from openrlhf_mappa.cli.train_mappa_ray import parse_args
from openrlhf_mappa.console import console as run_console
from openrlhf_mappa.resume import CHECKPOINT_MARKER, check_resume, write_marker
from openrlhf_mappa.rollout import AgentPolicy, SyncGate
from openrlhf_mappa.run_log import step_metrics
from openrlhf_mappa.trainer import MappaTrainer

AGENTS = [
    {"name": "solver", "model": "m", "role": "solves", "prompt": "Solve: {task}\n{history}"},
    {"name": "coder", "model": "m", "role": "computes", "prompt": "Compute: {task}\n{history}", "runs_code": True},
]
STAGES = [
    {"name": "reliability", "template": "RELIABILITY\n" + COACH_TEMPLATE},
    {"name": "quality", "template": "QUALITY\n" + COACH_TEMPLATE, "when": "agent/coder/code_error_rate < 0.2"},
    {"name": "polish", "template": "POLISH\n" + COACH_TEMPLATE, "when": "step >= 4"},
]


def write_topology(tmp_path, **overrides):
    raw = {"name": "t", "env": "mathchat", "agents": AGENTS, "coach_templates": STAGES}
    raw.update(overrides)
    raw = {k: v for k, v in raw.items() if v is not None}
    path = tmp_path / "topo.yaml"
    path.write_text(json.dumps(raw))  # JSON is valid YAML
    return str(path)


# ---------------------------------------------------------------- the schedule in the topology


def test_coach_templates_load_as_stages_in_order(tmp_path):
    topology = load_topology(write_topology(tmp_path))
    assert [s.name for s in topology.coach_stages] == ["reliability", "quality", "polish"]
    assert topology.coach_template == STAGES[0]["template"]  # the one a run starts with
    first, quality, polish = topology.coach_stages
    assert first.metric is None and quality.when == "agent/coder/code_error_rate < 0.2" and polish.when == "step >= 4"
    assert quality.holds(0.1) and not quality.holds(0.2) and not quality.holds(None) and not quality.holds(float("nan"))
    assert polish.holds(4) and not polish.holds(3)
    assert load_topology(write_topology(tmp_path, coach_templates=None, coach_template="{agent_output}")).coach_stages == []


@pytest.mark.parametrize(
    "stages, message",
    [
        ("x", "'coach_templates' must be a list of at least two stages"),
        (STAGES[:1], "'coach_templates' must be a list of at least two stages"),
        ([STAGES[0], dict(STAGES[1], after=3)], "coach_templates[1]: unknown key(s) ['after']; allowed: name, template, when"),
        ([STAGES[0], dict(STAGES[1], name="a b")], "coach_templates[1]: 'name' must be a word"),
        ([STAGES[0], dict(STAGES[1], name="reliability")], "the name 'reliability' is used twice"),
        ([dict(STAGES[0], when="step >= 1"), STAGES[1]], "(reliability): the first stage is in use from step 1"),
        ([STAGES[0], {"name": "q", "template": "x"}], "coach_templates[1] (q): 'when' must be a switch rule"),
        ([STAGES[0], dict(STAGES[1], when=50)], "'when' must be a switch rule '<metric> <op> <number>'"),
        ([STAGES[0], dict(STAGES[1], template="{agent_output} {score}")], "(quality): template: unknown field {score}"),
        ([STAGES[0], dict(STAGES[1], template="")], "(quality): 'template' is missing or empty"),
        ([STAGES[0], dict(STAGES[1], when="code_error_rate below 0.2")], "is not '<metric> <op> <number>'"),
        ([STAGES[0], dict(STAGES[1], when="agent/coder/code_error_rate == 0")], "is not '<metric> <op> <number>'"),
        ([STAGES[0], dict(STAGES[1], when="agent/code_executor/code_error_rate < 0.2")],
         "unknown agent 'code_executor'; the agents are solver, coder"),
        ([STAGES[0], dict(STAGES[1], when="agent/coder/code_errors < 0.2")], "agents log no metric 'code_errors'"),
        ([STAGES[0], dict(STAGES[1], when="code_error_rate < 0.2")], "unknown metric name 'code_error_rate'"),
        ([STAGES[0], dict(STAGES[1], when="eval/accuracy > 0.5")], "a rule reads one of: step, agent/<agent>/<metric>"),
        ([STAGES[0], dict(STAGES[1], when="coach/ < 1")], "unknown metric name 'coach/'"),
    ],
)  # fmt: skip
def test_bad_schedules_are_refused_at_load_time(tmp_path, stages, message):
    path = write_topology(tmp_path, coach_templates=stages)
    with pytest.raises(ValueError) as err:
        load_topology(path)
    assert str(err.value).startswith(path + ": ") and message in str(err.value)


def test_one_coach_template_or_a_schedule_not_both(tmp_path):
    with pytest.raises(ValueError, match="give either 'coach_template' .* or 'coach_templates'"):
        load_topology(write_topology(tmp_path, coach_template="{agent_output}"))


def test_the_rule_metrics_are_the_per_agent_keys_a_step_logs():
    # Catches a per-agent metric added to the trainer (or renamed) but not to the list a rule is checked against:
    # a rule on it would be refused, or a rule on a removed one would wait forever.
    args = parse_args(["--mappa.topology", "t.yaml", "--algo.dynamic_filtering_enable", "--train.async_enable"])
    lora = SimpleNamespace(synced={"sync_mib": 0.1, "full_sync_mib": 10.0})  # a LoRA agent logs its syncs too
    agents = [SimpleNamespace(spec=SimpleNamespace(name="coder"), trainer=lora)]
    ran = ToolFeedback(stdout="4", exit_code=0)
    action = Action("e", "coder", 0, [1], [2], formatted=True, feedback=ran, verdict=Verdict(6.0, "ok"), reward=6.0)
    episodes = [Episode("e", "t", outcome={"success": True}, actions=[action])]
    batch = SimpleNamespace(info={"kl": torch.tensor([0.1])}, sequences=torch.zeros(1, 3), action_mask=torch.ones(1, 2),
                            action_log_probs=torch.zeros(1, 2), rollout_log_probs=torch.zeros(1, 2))
    status = {"coder": {"policy_loss": 0.1, "actor_lr": 1e-6, "actor_grad_norm": 1.0, "ppo_clip_ratio": 0.0}}
    counts = {"left_out": 0, "fallback": 0, "truncated_left_out": {}, "filtered": {"coder": (0, 1, 1)},
              "staleness": {"coder": [1]}, "stale_left_out": {}, "optimizer_steps": {"coder": 1}}
    logged = step_metrics(args, SimpleNamespace(reward_scale=1.0), agents, {"coder": "coder"}, episodes, {"coder": [batch]},
                          status, {"coder": 0}, counts, {"coder": 0.01})
    assert {k.split("/")[2] for k in logged if k.startswith("agent/coder/")} == set(AGENT_METRICS)


# ---------------------------------------------------------------- switching, and switching after a resume


def trainer_for(topology, coach, tmp_path, tasks=(), show_bias=False, on_save=None, flags=()) -> MappaTrainer:
    """The driver of a run (MappaTrainer, OpenRLHF's flags as parsed, and `flags`), its agents' Ray side stood in for
    (conftest.StandIn): 2 tasks a step, one sample each, a checkpoint every 2 steps."""
    args = parse_args(["--mappa.topology", "topo.yaml", "--mappa.run_dir", str(tmp_path / "run"), "--ckpt.path",
                       str(tmp_path / "ckpt"), "--ckpt.load_enable", "--ckpt.save_steps", "2", "--rollout.batch_size", "2",
                       "--rollout.n_samples_per_prompt", "1", "--train.batch_size", "2", "--data.max_len", "64",
                       "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1", "--train.micro_batch_size", "1"]
                      + ["--mappa.coach.show_bias"] * show_bias + list(flags))  # fmt: skip
    os.makedirs(args.ckpt.path, exist_ok=True)
    if getattr(coach, "agent", False) is None:  # a trained coach: one more trainee (placement.trainee_specs), stood in
        spec = dataclasses.replace(topology.agents[0], name=COACH_NAME)
        (coach.agent,) = stand_in_team(args, SimpleNamespace(agents=[spec]))
    return MappaTrainer(args, topology, stand_in_team(args, topology, on_save), coach, list(tasks), args.mappa.run_dir)


def agents_saved(ckpt, step: int):
    """Each agent's DeepSpeed checkpoint directory as its actor leaves it (the part of a save that needs Ray)."""
    for agent in ("solver", "coder"):
        (ckpt / agent / "_actor" / f"global_step{step}").mkdir(parents=True)
        (ckpt / agent / "_actor" / f"global_step{step}" / "zero_pp_rank_0_mp_rank_00_model_states.pt").write_bytes(b"x")
        (ckpt / agent / "_actor" / "latest").write_text(f"global_step{step}")


class Replies:
    """Stands in for an agent's vLLM engine (no model): its replies in order, one per call."""

    def __init__(self, *replies, gate=None):
        self.replies, self.calls, self.tokenizer, self.gate = replies, 0, self, gate or SyncGate()

    sample = AgentPolicy.sample  # generate() behind the gate, as the real one

    def prompt_ids(self, messages, keep_reasoning=False):
        return messages[-1]["content"], [1, 2, 3], False

    async def generate(self, prompt_ids):
        self.calls += 1
        return [self.calls - 1], False, []  # the reply's index, read back by decode

    def decode(self, ids, skip_special_tokens=True):
        return self.replies[ids[0]]


def script(trainer, **replies):
    """The trainer's agents' engines stood in for by Replies, each behind its agent's gate (its weight versions), as
    the trainer's own policies are."""
    trainer.policies = {ag.spec.name: Replies(*replies[ag.spec.name], gate=ag.trainer.gate) for ag in trainer.agents}


def test_criteria_switch_on_a_logged_metric_and_survive_a_resume(tmp_path, capsys, monkeypatch):
    # fit() itself drives the steps (rollout, coach, the rule, the checkpoints in its order), all of the driver real but
    # the agents' Ray side (StandIn, whose calls trainer.ray.get passes through) and engines (Replies): the coder's
    # code fails in step 1 and runs from step 2 on; a checkpoint every 2 steps; an actor dies in step 4's training.
    monkeypatch.setattr(run_console, "out", sys.stdout)  # the captured terminal
    monkeypatch.setattr(run_console, "err", sys.stderr)
    monkeypatch.setattr(trainer_module.ray, "get", lambda refs, **kwargs: refs)
    topology = load_topology(write_topology(tmp_path))
    tasks = [{"id": str(i), "prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(10)]  # 5 steps of 2
    figures = {}  # the coach's running figures as each checkpoint saw them
    with CoachServer() as server:
        coach = OpenAICoach(model="m", base_url=server.base_url, template=topology.coach_template)
        first = trainer_for(topology, coach, tmp_path, tasks, on_save=lambda step: figures.setdefault(step, first.bias_audit.prompt_text()))
        script(first, solver=["2 + 2 is 4."] * 8,
               coder=[f"```python\n{code}\n```" for code in ["print(1 / 0)"] * 2 + ["print(2 + 2)"] * 6])
        solver = first.agents[0].trainer

        def dies_in_step_4(experiences, step):
            if step == 4:
                raise RuntimeError("solver's actor died")
            solver.kl_ctl.value = 0.01 * step  # as upstream's train_step updates an adaptive KL controller
            return StandIn.train_step(solver, experiences, step)

        solver.train_step = dies_in_step_4
        with pytest.raises(RuntimeError, match="solver's actor died"):
            first.fit()
        out = capsys.readouterr().out
        assert ("[mappa] coach criteria: after step 2, agent/coder/code_error_rate = 0 (agent/coder/code_error_rate < 0.2): "
                "coach template 'reliability' -> 'quality', in use from step 3") in out  # fmt: skip
        assert out.count("coach criteria: after step") == 1  # step 1's code failed: error rate 1, no switch
        assert (first.stage, first.stage_since, coach.template) == (1, 3, STAGES[1]["template"])
        # Step 2's checkpoint came after step 2's switch, and records the template in use from step 3.
        assert json.load(open(tmp_path / "ckpt" / CHECKPOINT_MARKER)) == {
            "step": 2, "coach_cost_usd": 0.0, "coach_template": {"name": "quality", "since_step": 3},
            "kl_coef": {"solver": 0.02, "coder": 0.0}, "versions": {"solver": 2, "coder": 2},
            "optimizer_steps": {"solver": 2, "coder": 2}}  # fmt: skip
        assert list(figures) == [2] and "(the last 2 training steps, 8 scored actions)" in figures[2]
        prompts = [r["prompt"].split("\n", 1)[0] for r in server.requests]
        assert prompts == ["RELIABILITY"] * 8 + ["QUALITY"] * 8  # 2 episodes x 2 actions per step, steps 1-4
        first.runner.loop.run_until_complete(coach.aclose())

        # The same command again: the CLI builds the coach with the first template; the trainer restores.
        assert check_resume(first.args, topology, []) == (2, [])
        assert json.load(open(tmp_path / "ckpt" / CHECKPOINT_MARKER))["coach_template"] == {"name": "quality", "since_step": 3}
        coach = OpenAICoach(model="m", base_url=server.base_url, template=topology.coach_template)
        second = trainer_for(topology, coach, tmp_path, tasks)
        script(second, solver=["2 + 2 is 4."] * 6, coder=["```python\nprint(2 + 2)\n```"] * 6)
        second.resume(2)
        assert "resuming with coach template 'quality' (in use since step 3)" in capsys.readouterr().out
        assert second.agents[0].trainer.kl_ctl.value == 0.02  # the KL coefficient as step 2 left it
        assert [ag.trainer.gate.version for ag in second.agents] == [2, 2]  # and the weights' versions
        assert (second.stage, second.stage_since, coach.template) == (1, 3, STAGES[1]["template"])
        assert second.bias_audit.prompt_text() == figures[2]  # the audit's window, rebuilt from episodes.jsonl
        del server.requests[:]
        second.fit(2)  # steps 3-5; step >= 4 switches to polish from step 5
        assert "'quality' -> 'polish', in use from step 5" in capsys.readouterr().out
        assert [r["prompt"].split("\n", 1)[0] for r in server.requests] == ["QUALITY"] * 8 + ["POLISH"] * 4
    assert [step for step, _ in solver.trained] == [1, 2, 3] and [s for s, _ in second.agents[0].trainer.trained] == [3, 4, 5]
    assert json.load(open(tmp_path / "ckpt" / CHECKPOINT_MARKER))["coach_template"] == {"name": "polish", "since_step": 5}

    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [(r["step"], r["coach/template_stage"]) for r in rows] == [(1, 0), (2, 0), (3, 1), (4, 1), (5, 2)]
    # each step's rewards used the coefficient before its update: 0 at step 1, then the one saved and resumed
    assert [r["agent/solver/kl_coef"] for r in rows] == [0.0, 0.01, 0.02, 0.02, 0.02]
    # one optimizer step a step (2 rows, batches of 2), counted on from the checkpoint's after the resume
    assert [r["agent/solver/optimizer_steps"] for r in rows] == [1, 2, 3, 4, 5]
    # The report marks the first step of each new template on its charts and in its header.
    data = report.load_run(str(tmp_path / "run"))
    assert data["template_switches"] == [{"step": 3, "stage": 1}, {"step": 5, "stage": 2}]
    out = tmp_path / "page.html"
    report.write_report(str(tmp_path / "run"), out=str(out))
    dom = render_report_dom(str(out))
    assert "coach criteria switches: stage 1 from step 3, stage 2 from step 5" in dom.text()
    chart = next(f for f in dom.find_all("figure", "chart") if f.attrs["data-title"] == "agent/*/code_error_rate")
    assert [line.find_all("title")[0].text() for line in chart.find_all("g", "switch")] == [
        "coach template stage 1 from step 3", "coach template stage 2 from step 5"]  # fmt: skip


def test_a_metric_without_a_value_switches_nothing_and_says_so(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(run_console, "out", sys.stdout)  # the captured terminal
    monkeypatch.setattr(run_console, "err", sys.stderr)
    topology = load_topology(write_topology(tmp_path))
    trainer = trainer_for(topology, HeuristicCoach(), tmp_path)
    for step in (1, 2):  # no code ran: the coder's code_error_rate is None
        trainer.advance_criteria(step, {"agent/coder/code_error_rate": None})
    assert trainer.stage == 0
    out = capsys.readouterr().out
    assert out.count("step 1 logged no value of agent/coder/code_error_rate; coach template 'quality' waits") == 1
    assert "step 2 logged" not in out  # said once, not every step


def test_a_resume_with_a_template_the_topology_no_longer_has_is_refused(tmp_path):
    topology = load_topology(write_topology(tmp_path))
    trainer = trainer_for(topology, HeuristicCoach(), tmp_path)
    agents_saved(tmp_path / "ckpt", 9)
    write_marker(str(tmp_path / "ckpt"), {"step": 9, "coach_template": {"name": "polish", "since_step": 7}})
    renamed = load_topology(write_topology(tmp_path, coach_templates=STAGES[:2]))
    with pytest.raises(ValueError, match="scored with coach template 'polish', which is not in the coach_templates of "
                                         r"topo.yaml \(reliability, quality\)"):
        check_resume(trainer.args, renamed, [])
    assert check_resume(trainer.args, topology, []) == (9, [])


# ---------------------------------------------------------------- the coach's running bias in its prompt


def scored_episode(agent_scores: dict, task_type: str, success: bool) -> Episode:
    actions = [Action("e", agent, 0, [1], [2], verdict=Verdict(score, "ok"), coach_request={"is_final_agent": agent == "coder"})
               for agent, score in agent_scores.items()]  # fmt: skip
    return Episode("e", "t", task_type=task_type, outcome={"success": success}, actions=actions)


def test_bias_figures_are_measured_or_absent_never_invented():
    audit = BiasAudit(window=2)
    assert audit.prompt_text() == ("Your recent scoring in this run: no figures yet (none of your scores in this run "
                                   "has been tallied so far).")  # fmt: skip
    audit.update([scored_episode({"solver": 8.0}, "regression", True)])  # no final agent scored
    assert "Agreement of your scores with outcomes: not measurable yet (no final agent's action was scored)." in audit.prompt_text()
    audit.update([scored_episode({"solver": 6.0, "coder": 9.0}, "regression", True),
                  scored_episode({"solver": 4.0, "coder": 3.0}, "classification", False),
                  scored_episode({"solver": 5.0, "coder": 5.0}, "classification", False)])  # fmt: skip
    text = audit.prompt_text()
    assert "(the last 2 training steps, 7 scored actions)" in text
    assert ("- coder, classification: 4.00 (n=2)\n- coder, regression: 9.00 (n=1)\n"
            "- solver, classification: 4.50 (n=2)\n- solver, regression: 7.00 (n=2)") in text  # fmt: skip
    # final scores 9 (solved), 3 and 5 (failed): r = 0.945
    assert "(the final agent's score vs. the episode's success, 3 episodes): Pearson correlation 0.94;" in text
    assert "mean 9.00 on solved episodes (n=1); mean 4.00 on failed episodes (n=2)." in text
    audit.update([scored_episode({"coder": 5.0}, "regression", False)] * 2)  # step 1 leaves the window
    assert "- solver, regression: 6.00 (n=1)" in audit.prompt_text()
    assert "correlation undefined" not in audit.prompt_text()
    one_outcome = BiasAudit()
    one_outcome.update([scored_episode({"coder": s}, "math", False) for s in (2.0, 4.0)])
    assert "correlation undefined (one outcome only, or constant scores); no solved episode; mean 3.00 on failed" in one_outcome.prompt_text()


def test_the_coach_prompt_shows_the_bias_figures_only_when_enabled(tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_module.ray, "get", lambda refs, **kwargs: refs)  # conftest.StandIn's calls return values
    topology = load_topology(write_topology(tmp_path, coach_templates=None, coach_template=COACH_TEMPLATE))
    tasks = [{"id": str(i), "prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(4)]  # 2 steps of 2
    with CoachServer() as server:
        for show_bias in (True, False):
            coach = OpenAICoach(model="m", base_url=server.base_url, template=topology.coach_template)
            trainer = trainer_for(topology, coach, tmp_path / str(show_bias), tasks, show_bias=show_bias)
            script(trainer, solver=["2 + 2 is 4."] * 4, coder=["```python\nprint(2 + 2)\n```"] * 4)
            trainer.fit()
        step1, step2, off = server.requests[:4], server.requests[4:8], server.requests[8:]
    assert all(r["prompt"].startswith("Your recent scoring in this run: no figures yet") for r in step1)
    solver_score = len(set("2 + 2 is 4.")) % 11  # what the server's rule gives the solver's reply
    for r in step2:
        assert r["prompt"].startswith("Your recent scoring in this run (the last 1 training step, 4 scored actions).")
        assert f"- solver, math: {solver_score:.2f} (n=2)" in r["prompt"]
        assert "Agreement of your scores with outcomes (the final agent's score vs. the episode's success, 2 episodes)" in r["prompt"]
        assert "\n\nAGENT=" in r["prompt"]  # the figures, then the template as without them
    assert len(off) == 8 and not any("recent scoring" in r["prompt"] or "mean score" in r["prompt"] for r in off)
    assert all(r["prompt"].startswith("AGENT=") for r in off)

    # Re-scoring sends the prompt the coach saw: the figures are kept with each action when shown, and only then.
    from openrlhf_mappa.tools import rescore

    shown = rescore.read_actions(str(tmp_path / "True" / "run" / "episodes.jsonl"))
    assert all(a["coach_request"]["coach_bias"].startswith("Your recent scoring") for _, a in shown)
    hidden = rescore.read_actions(str(tmp_path / "False" / "run" / "episodes.jsonl"))
    assert not any("coach_bias" in a["coach_request"] for _, a in hidden)


def test_a_template_places_the_figures_where_it_names_them():
    request = CoachRequest("e", "solver", 0, "solves", "2 + 2?", "math", "in", "4", "", coach_bias="FIGURES")
    assert render_prompt("Judge {agent_output}.\n{coach_bias}\nPROCESS_SCORE:", request) == "Judge 4.\nFIGURES\nPROCESS_SCORE:"
    assert render_prompt("Judge {agent_output}.", request) == "FIGURES\n\nJudge 4."
    request.coach_bias = None
    assert render_prompt("Judge {agent_output}.\n{coach_bias}\nPROCESS_SCORE:", request) == "Judge 4.\n\nPROCESS_SCORE:"
    assert render_prompt("Judge {agent_output}. {{coach_bias}}", request) == "Judge 4. {coach_bias}"


# ---------------------------------------------------------------- async training: the loop's order and the versions


@pytest.mark.parametrize("max_staleness", [None, 0])
def test_async_training_generates_the_next_step_while_the_team_trains(tmp_path, monkeypatch, max_staleness):
    # --train.async_enable with the agents' Ray side and engines stood in for. The solver's step-1 update waits until
    # step 2's rollout has asked the solver's engine for its first reply: in a synchronous loop that never comes (the
    # test fails on the wait). So the solver's step-2 actions were made by its weights before step 1's update, one
    # version behind when step 2 trains: within the default bound (the queue size, 1) they train; with
    # --mappa.max_staleness 0 they are left out, counted, and the console says why.
    monkeypatch.setattr(trainer_module.ray, "get", lambda refs, **kwargs: refs)
    monkeypatch.setattr(run_console, "err", sys.stderr)
    topology = load_topology(write_topology(tmp_path, coach_templates=None, coach_template=COACH_TEMPLATE))
    tasks = [{"id": str(i), "prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(6)]  # 3 steps of 2
    flags = ["--train.async_enable"] + (["--mappa.max_staleness", str(max_staleness)] if max_staleness is not None else [])
    with CoachServer() as server:
        coach = OpenAICoach(model="m", base_url=server.base_url, template=topology.coach_template)
        trainer = trainer_for(topology, coach, tmp_path, tasks, flags=flags)
        script(trainer, solver=["2 + 2 is 4."] * 6, coder=["```python\nprint(2 + 2)\n```"] * 6)
        solver, engine = trainer.agents[0].trainer, trainer.policies["solver"]
        waited = []

        def train_step(experiences, step):
            if step == 1:
                deadline = time.time() + 30
                while engine.calls < 3 and time.time() < deadline:  # 2 replies a step: a third is step 2's
                    time.sleep(0.01)
                waited.append(engine.calls)
            return StandIn.train_step(solver, experiences, step)

        solver.train_step = train_step
        trainer.fit()
    assert waited and waited[0] >= 3, "step 2's rollout did not run during step 1's update"
    episodes = [json.loads(line) for line in open(tmp_path / "run" / "episodes.jsonl")]
    first, second = ([a for ep in episodes if ep["step"] == s for a in ep["actions"] if a["agent"] == "solver"]
                     for s in (1, 2))
    assert [a["versions"]["solver"] for a in first + second] == [0, 0, 0, 0]  # step 2's too: before step 1's sync
    assert all(a["version_end"] == a["versions"]["solver"] for a in first + second)  # no partial rollout
    assert all(set(a["versions"]) == {"solver"} for a in first)  # the first to act saw nobody's output
    rows = {r["step"]: r for r in (json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl"))}
    assert rows[2]["agent/solver/staleness_max"] == 1 and rows[1]["agent/solver/staleness_max"] == 0
    if max_staleness is None:
        assert rows[2]["agent/solver/trained_actions"] == 2 and rows[2]["agent/solver/stale_left_out"] == 0
        assert not any(a["stale"] for a in second)
    else:
        assert rows[2]["agent/solver/trained_actions"] == 0 and rows[2]["agent/solver/stale_left_out"] == 2
        assert all(a["stale"] and a["reward"] is None for a in second)
    assert solver.gate.version == len([s for s, _ in solver.trained])  # one version per update and its sync


class OldJudge(Replies):
    """Stands in for a trained coach's engine: every verdict "PROCESS_SCORE: 7", sampled by its weights of
    `version` (as AgentPolicy.sample records it), whatever its version is now."""

    def __init__(self, version: int):
        super().__init__()
        self.version = version

    async def sample(self, prompt_ids):
        return ([0], False, []), self.version, self.version

    def decode(self, ids, skip_special_tokens=True):
        return "PROCESS_SCORE: 7"


@pytest.mark.parametrize("behind", [1, 2])
def test_a_trained_coachs_verdicts_train_the_team_within_the_staleness_bound_only(tmp_path, monkeypatch, behind):
    # A step of the trainer with a trained coach on the team (its Ray side stood in for, as the agents'), every
    # verdict from the coach's weights `behind` updates before its version now. Within the bound (the default, the
    # queue size: 1) the agents train on them and the coach on its own actions; past it neither does, each left out
    # and counted. Catches a trainer that gives the coach (stale_verdicts, rewarded) any other bound, or reads the
    # coach's version after the step's own update of it.
    from openrlhf_mappa.coach.heuristic import HeuristicCoach
    from openrlhf_mappa.coach.trained import TrainedCoach

    monkeypatch.setattr(trainer_module.ray, "get", lambda refs, **kwargs: refs)
    topology = load_topology(write_topology(tmp_path, coach_templates=None, coach_template=COACH_TEMPLATE))
    coach = TrainedCoach("{agent_output}", "PROCESS_SCORE", HeuristicCoach(), reference_fraction=0.0,
                         held_out_fraction=0.0, terms=("format",))
    tasks = [{"id": str(i), "prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(2)]
    trainer = trainer_for(topology, coach, tmp_path, tasks)
    script(trainer, solver=["2 + 2 is 4."] * 2, coder=["```python\nprint(2 + 2)\n```"] * 2)
    coach.agent.trainer.gate.version, coach.policy = 3, OldJudge(3 - behind)
    m = train_step(trainer, 1, tasks)
    assert trainer.bound == 1
    fresh = behind <= trainer.bound
    actions = [a for line in open(tmp_path / "run" / "episodes.jsonl") for a in json.loads(line)["actions"]]
    assert [(a["verdict"]["score"], a["verdict"]["version"], a["stale"]) for a in actions] == [
        (7.0, 3 - behind, not fresh)] * 4
    trained = [m[f"agent/{name}/trained_actions"] for name in ("solver", "coder", "coach")]
    assert trained == ([2, 2, 4] if fresh else [0, 0, 0]) and m["coach/stale_left_out"] == (0 if fresh else 4)
    assert (m["agent/solver/updated"], m["agent/coach/updated"]) == (fresh, fresh)
