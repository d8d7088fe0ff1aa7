"""Crash-safe resume of a team colocated with OpenRLHF's hybrid engine, for real on CPU: two tiny agents of different
weights (MathChat's Problem Solver and Verifier) on ONE set of 2 logical GPUs (--mappa.colocate team, vLLM and
DeepSpeed sleep, Ray, vLLM, DeepSpeed ZeRO-3), each with 2 actor ranks and 2 engines, one on each GPU, so each GPU
holds both agents' actor ranks and engines. Right after its first team checkpoint, the Verifier's first vLLM engine
process is SIGKILLed (a GPU failing mid-run): the run must stop on that death, promptly (its watchdog, not a
collective's 10-minute timeout), non-zero, naming that agent and engine alone and keeping the steps it logged. A
cut-off line is left at the end of metrics.jsonl (a kill mid-write), and the same command resumes the run.
(SIGKILL of a whole run, driver and Ray included, then its resume: test_lora_e2e.)

Asserted: every agent's resumed actor equals its checkpoint (log-probs of a fixed sequence against the checkpoint's
HF export), and both its engines, put to sleep at start-up, got those weights before the first resumed rollout; at
the end both engines of each agent hold its actor's weights and not the other agent's; metrics.jsonl / episodes.jsonl
end with every step exactly once. The topology's coach criteria switch after step 1 and the coach is shown its
running bias: the resumed run goes on with the switched template, and the figures its first resumed step shows
cover the steps before the checkpoint.

On CPU sleep frees nothing, so the order of the calls is what is tested: patches/hybrid_engine.py logs every engine's
start-up / sleep / wake_up / generate and every actor's reload / offload / training from the process that ran it
(MAPPA_CALL_LOG), a line as each begins and one as it ends. Asserted from the resumed run's log, in its order of
events: no engine was awake (weights or KV cache) while any actor trained; no actor's states were loaded while any
engine generated; the agents trained one after another; each agent's engines started and slept before the next
agent's started (vLLM sizes its KV cache from the GPU's free memory while it starts).
"""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
import yaml

from conftest import (MAPPA, TINY_RUN_FLAGS, hybrid_engine_timeline, local_cluster_env, overlaps, record_experiences,
                      run_training, training, two_agent_mathchat, wait_for)

AGENTS = ("problem_solver", "verifier")
TESTS = os.path.dirname(os.path.abspath(__file__))


def resume_and_probe(argv: list, out_path: str, end_path: str = None, tensors_path: str = None):
    """In a child process: resume training with `argv`; before the first resumed step, probe every agent's
    actor and engines (test_mappa_e2e.probe_agents); with `end_path`, after the last step too, with the kind of
    each agent's reference and the layers its LoRA adapters wrap; with `tensors_path`, every resumed step's
    experience tensors (record_experiences)."""
    import ray

    from openrlhf_mappa.cli.train_mappa_ray import parse_args, train
    from openrlhf_mappa.trainer import MappaTrainer
    from test_mappa_e2e import probe_agents

    if tensors_path:
        record_experiences(tensors_path)
    fit = MappaTrainer.fit

    def probe_then_fit(self, start_step=0):
        with open(out_path, "w") as f:
            json.dump(dict(probe_agents(self.agents), start=start_step), f)
        return fit(self, start_step)

    MappaTrainer.fit = probe_then_fit
    agents = train(parse_args(argv))
    if end_path:
        # and, from actor rank 0, the classes of the layers its LoRA adapters wrap (bitsandbytes' for QLoRA)
        wrapped = lambda self: sorted({type(m.base_layer).__name__ for m in self.actor.model.modules()
                                       if hasattr(m, "base_layer")})
        base_layers = {ag.spec.name: ray.get(ag.actor._actor_handlers[0].__ray_call__.remote(wrapped)) for ag in agents}
        with open(end_path, "w") as f:
            json.dump(dict(probe_agents(agents), references=[type(ag.ref).__name__ for ag in agents],
                           base_layers=base_layers), f)
    ray.shutdown()


def assert_hybrid_engine_order(timeline: dict, steps: int):
    """The order of the hybrid engine's calls that a team on shared GPUs needs (see the module's docstring), for a
    run of `steps` steps, 2 actor ranks and 2 engines per agent."""
    assert set(timeline) == set(AGENTS)
    every = lambda kind: [s for t in timeline.values() for s in t[kind]]
    for name, t in timeline.items():
        assert len(t["train"]) == len(t["loaded"]) == steps * 2 and t["generate"], (name, t["train"])
        # Each fit ran between a reload and the next offload of its own rank's states.
        assert all(any(l0 <= t0 and t1 <= l1 for l0, l1 in t["loaded"]) for t0, t1 in t["train"]), name
    assert overlaps(every("awake"), every("train")) == []  # no engine awake while an actor trained
    assert overlaps(every("loaded"), every("generate")) == []  # no actor loaded while an engine generated
    assert overlaps(timeline[AGENTS[0]]["loaded"], timeline[AGENTS[1]]["loaded"]) == []  # one agent at a time
    # vLLM sizes its KV cache from the GPU's free memory while it starts: the first agent's two engines started, and
    # both slept, before the other's began (engines starting at once would count each other's memory as their own).
    first, second = sorted(AGENTS, key=lambda n: min(timeline[n]["init"]))
    assert len(timeline[first]["init"]) == len(timeline[second]["init"]) == 2
    asleep = max(t1 for _, t1 in sorted(timeline[first]["sleep"])[:2])  # its engines' first sleeps: at start-up
    assert asleep <= min(t0 for t0, _ in timeline[second]["init"]), (first, second)


@pytest.mark.e2e
def test_team_on_shared_gpus_stopped_by_a_dead_engine_resumes_with_weights_logs_and_order_intact(tmp_path):
    from test_openrlhf_cpu_e2e import hf_probe_logprobs

    topology, tasks = two_agent_mathchat(tmp_path, num_tasks=6)  # 3 steps of 2 tasks
    raw = yaml.safe_load(open(topology))
    models = {}
    builds = []  # at once: each is seconds of importing torch
    for seed, agent in enumerate(raw["agents"]):  # different initial weights: whose weights an engine holds is visible
        agent["model"] = models[agent["name"]] = str(tmp_path / f"model-{agent['name']}")
        build = [MAPPA, "tiny-model", agent["model"], "--seed", str(seed)]
        builds.append(subprocess.Popen(build, stdout=subprocess.DEVNULL))
    assert [b.wait(timeout=300) for b in builds] == [0] * len(builds)
    raw["coach_templates"] = [{"name": "first", "template": raw.pop("coach_template")},
                              {"name": "later", "template": "Later criteria.\n{agent_output}", "when": "step >= 1"}]  # fmt: skip
    open(topology, "w").write(yaml.safe_dump(raw))
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    argv = [
        "--mappa.topology", topology,
        "--mappa.run_dir", str(run_dir),
        "--data.prompt_dataset", tasks,
        *TINY_RUN_FLAGS,
        "--actor.num_gpus_per_node", "2", "--vllm.num_engines", "2",  # after TINY_RUN_FLAGS' 1: the later flag wins
        "--mappa.colocate", "team", "--vllm.enable_sleep", "--ds.enable_sleep",
        "--actor.adam.lr", "1e-2",
        "--actor.lr_warmup_ratio", "0",
        "--ckpt.save_steps", "1",
        "--ckpt.save_hf",
        "--ckpt.load_enable",  # the same command starts and resumes
        "--ckpt.path", str(ckpt),
        "--ckpt.output_dir", str(tmp_path / "final"),
        "--mappa.coach.show_bias",
    ]  # fmt: skip
    logs = [tmp_path / "calls1.jsonl", tmp_path / "calls2.jsonl"]  # each run's hybrid engine calls

    # Run 1: once the first team checkpoint exists, one engine process of the Verifier is SIGKILLed.
    marker = ckpt / "mappa_checkpoint.json"
    with training([sys.executable, "-m", "openrlhf_mappa.cli.train_mappa_ray", *argv], tmp_path / "train1", cwd=tmp_path,
                  env=local_cluster_env(2, MAPPA_CALL_LOG=str(logs[0]))) as run1:
        wait_for(run1, marker.exists, 900, "first team checkpoint")
        os.kill(json.loads((run_dir / "processes.json").read_text())["verifier/vLLM engine 0"], signal.SIGKILL)
        # A bound on the wait, below the weight broadcast's 10-minute collective timeout that a hung run waits out.
        wait_for(run1, lambda: run1.poll() is not None, 300, "stop after the engine's death")
    stopped = (tmp_path / "train1.err").read_text()
    assert run1.returncode != 0
    assert "[mappa] run stopped: agent 'verifier': vLLM engine 0 died" in stopped, stopped[-4000:]
    assert "agent 'problem_solver'" not in stopped.split("[mappa] run stopped:")[-1].split("\n")[0]  # only the dead one
    saved = json.loads(marker.read_text())["step"]
    assert saved in (1, 2)  # the kill may land after step 2's save, never before step 1's
    logged = [json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")]
    assert logged in ([1], [1, 2]) and saved <= logged[-1]  # what it had is kept
    assert "placement plan for 2 GPUs" in open(tmp_path / "train1.out").read()
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "agent/solver/kl": 0.1')  # a line cut off by a kill mid-write

    # The same command with another rollout batch is refused before Ray starts, naming the flag and both
    # values, and leaves the run as it was; the same command with the run's settings resumes below (run 2).
    relaunch = [sys.executable, "-m", "openrlhf_mappa.cli.train_mappa_ray", *argv,
                "--rollout.batch_size", "4"]
    before = (run_dir / "run_settings.json").read_text()
    refused = subprocess.run(relaunch, cwd=tmp_path, env=local_cluster_env(2), capture_output=True, text=True,
                             timeout=300)
    assert (refused.returncode == 1
            and "--rollout.batch_size: 2 in the run, 4 now" in refused.stderr), refused.stderr
    assert "--mappa.allow_resume_changes" in refused.stderr and "Traceback" not in refused.stderr
    assert ((run_dir / "run_settings.json").read_text() == before
            and json.loads(marker.read_text())["step"] == saved)

    # Run 2: the same command resumes; probe every agent right before its first resumed step, and after its last.
    probe_path, end_path = str(tmp_path / "probe.json"), str(tmp_path / "end.json")
    child = (f"import sys; sys.path.insert(0, {TESTS!r}); from test_resume_e2e import resume_and_probe; "
             f"resume_and_probe({argv!r}, {probe_path!r}, {end_path!r})")  # fmt: skip
    proc = run_training([sys.executable, "-c", child], tmp_path / "train2", timeout=1500, cwd=tmp_path,
                        env=local_cluster_env(2, MAPPA_CALL_LOG=str(logs[1])))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert f"resuming after step {saved}" in proc.stdout
    assert "'first' -> 'later', in use from step 2" in open(tmp_path / "train1.out").read()
    assert "resuming with coach template 'later' (in use since step 2)" in proc.stdout
    assert "coach criteria: after step" not in proc.stdout  # no second switch

    result = json.load(open(probe_path))
    assert result["start"] == saved
    for name in AGENTS:
        initial = hf_probe_logprobs(models[name], result["probe"])
        checkpointed = hf_probe_logprobs(str(ckpt / name / f"global_step{saved}_hf"), result["probe"])
        actor = torch.tensor(result["actor"][name])
        assert (actor - checkpointed).abs().max() < 0.02, name  # the resumed actor is the checkpoint ...
        for engine in result["engines"][name]:  # ... and so are both its engines, asleep since start-up, before any rollout
            assert (torch.tensor(engine) - actor).abs().max() < 0.02, name
        assert (checkpointed - initial).abs().mean() > 0.1, name  # (training had moved it: a real check)
    end = json.load(open(end_path))
    actor = {n: torch.tensor(v) for n, v in end["actor"].items()}
    for name in AGENTS:  # after the last sync: both engines of each agent hold its actor's weights, the other's not
        for engine in map(torch.tensor, end["engines"][name]):
            assert (engine - actor[name]).abs().max() < 0.02, name
            assert all((engine - actor[o]).abs().mean() > 0.1 for o in AGENTS if o != name), name

    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    assert [m["coach/template_stage"] for m in metrics] == [0, 1, 1]
    assert all(m[f"agent/{n}/updated"] == 1 and m[f"agent/{n}/trained_actions"] == 4 for m in metrics for n in AGENTS)
    episodes = [json.loads(line) for line in open(run_dir / "episodes.jsonl")]
    assert sorted(ep["step"] for ep in episodes) == [1] * 4 + [2] * 4 + [3] * 4
    assert json.loads(marker.read_text()) == {"step": 3, "coach_cost_usd": 0.0,
                                              "coach_template": {"name": "later", "since_step": 2},
                                              "kl_coef": {n: 0.0 for n in AGENTS}, "versions": {n: 3 for n in AGENTS},
                                              "optimizer_steps": {n: 3 for n in AGENTS}}  # one a step, resumed
    # The weight syncs, one per agent and step, cut back to the checkpoint at the resume: the versions run on.
    syncs = [json.loads(line) for line in open(run_dir / "syncs.jsonl")]
    assert sorted((s["agent"], s["step"], s["version"]) for s in syncs) == [(n, k, k) for n in sorted(AGENTS) for k in (1, 2, 3)]
    # The figures shown in the first resumed step: the steps up to the checkpoint, rebuilt from episodes.jsonl.
    shown = {a["coach_request"]["coach_bias"] for ep in episodes if ep["step"] == saved + 1 for a in ep["actions"]}
    (figures,) = shown
    assert figures.startswith(f"Your recent scoring in this run (the last {saved} training step"), figures
    assert f"{saved * 8} scored actions" in figures  # 4 episodes x 2 agents per step

    # The resumed run: its start-up, the resume's sync into the sleeping engines, and its steps after the checkpoint.
    assert_hybrid_engine_order(hybrid_engine_timeline(str(logs[1]), str(run_dir / "processes.json")), steps=3 - saved)
