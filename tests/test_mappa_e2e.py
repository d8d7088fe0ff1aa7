"""A real MAPPA training step on CPU: two tiny agents with their own weights, each with its own ZeRO-3
actor and vLLM engine (Ray, vLLM, DeepSpeed for real), coached by an OpenAI-compatible server on
127.0.0.1 (a stand-in for a paid API: it scores by rule, and answers garbage for one agent).

Asserted: the coached agent's actor changed; after the sync each agent's engine holds its own
actor's weights and not another agent's (compared through log-probs of a fixed sequence); the agent
whose every verdict was unparsable got no experience and was not updated; metrics and episodes are
written per agent, and `mappa report` renders them (in Chromium where installed).
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from coach_server import COACH_TEMPLATE, CoachServer
from conftest import MAPPA, TINY_RUN_FLAGS, assert_report_renders, local_cluster_env, run_training

AGENTS = ("solver", "mute")
PROBE_TEXT = "Probe: 7 + 5 = 12, the answer is 12."
TESTS = os.path.dirname(os.path.abspath(__file__))  # "mute" gets only garbage from the coach


@pytest.fixture
def coach_server():
    with CoachServer(mute={"mute"}) as server:
        yield server


def probe_agents(agents) -> dict:
    """For every agent, its engine's and its actor's log-probs of one fixed sequence (PROBE_TEXT)."""
    import ray
    from vllm import SamplingParams

    ids = agents[0].tokenizer(PROBE_TEXT)["input_ids"]
    out = {"probe": ids, "engine": {}, "actor": {}}
    for ag in agents:
        gen = ray.get(ag.engines[0].generate.remote(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)))
        out["engine"][ag.spec.name] = [d[t].logprob for t, d in zip(ids[1:], gen.prompt_logprobs[1:])]
        seq = torch.tensor([ids])
        refs = ag.actor.async_run_method_batch(
            method_name="forward", sequences=[seq], action_mask=[torch.ones(1, len(ids) - 1, dtype=torch.bool)],
            attention_mask=[torch.ones_like(seq)],
        )
        out["actor"][ag.spec.name] = ray.get(refs)[0][0].float().tolist()
    return out


def run_and_probe(argv: list, out_path: str):
    """In a child process (see the test): train with `argv`, then probe every agent (probe_agents). Ray and
    vLLM never live in the pytest process itself."""
    import ray

    from openrlhf_mappa.cli.train_mappa_ray import parse_args, train

    agents = train(parse_args(argv))
    with open(out_path, "w") as f:
        json.dump(probe_agents(agents), f)
    ray.shutdown()


@pytest.mark.e2e
def test_mappa_step_trains_each_agent_on_its_own(tmp_path, coach_server):
    models = {}
    for seed, name in enumerate(AGENTS):
        models[name] = str(tmp_path / f"model-{name}")
        subprocess.run([MAPPA, "tiny-model", models[name], "--seed", str(seed)], check=True, capture_output=True)
    topology = {
        "name": "e2e",
        "env": "mathchat",
        "coach_template": COACH_TEMPLATE,
        "agents": [
            {"name": n, "model": models[n], "role": f"{n} role", "prompt": "{task}\n{history}", "max_actions": 1}
            for n in AGENTS
        ],
    }
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(topology))
    with open(tmp_path / "tasks.jsonl", "w") as f:
        for i in range(2):
            f.write(json.dumps({"id": i, "prompt": f"What is {i} + 2?", "answer": str(i + 2)}) + "\n")

    run_dir = tmp_path / "run"
    argv = [
        "--mappa.topology", str(tmp_path / "topology.yaml"),
        "--mappa.coach.kind", "openai",
        "--mappa.coach.base_url", coach_server.base_url,
        "--mappa.coach.model", "rule-coach",
        "--mappa.coach.api_key_env", "MAPPA_TEST_COACH_KEY",
        "--mappa.run_dir", str(run_dir),
        "--data.prompt_dataset", str(tmp_path / "tasks.jsonl"),
        *TINY_RUN_FLAGS,
        "--actor.adam.lr", "1e-2",
        "--actor.lr_warmup_ratio", "0",
        "--ckpt.path", str(tmp_path / "ckpt"),
        "--ckpt.output_dir", str(tmp_path / "final"),
    ]
    env = local_cluster_env(4, MAPPA_TEST_COACH_KEY="secret-123")
    child = f"import sys; sys.path.insert(0, {TESTS!r}); from test_mappa_e2e import run_and_probe; run_and_probe({argv!r}, {str(tmp_path / 'probe.json')!r})"
    proc = run_training([sys.executable, "-c", child], tmp_path / "train", timeout=900, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    result = json.load(open(tmp_path / "probe.json"))
    probe = result["probe"]
    engine = {n: torch.tensor(v) for n, v in result["engine"].items()}
    actor = {n: torch.tensor(v) for n, v in result["actor"].items()}

    from test_openrlhf_cpu_e2e import hf_probe_logprobs

    init = {n: hf_probe_logprobs(models[n], probe) for n in AGENTS}
    for n in AGENTS:
        others = [o for o in AGENTS if o != n]
        report = {k: round((engine[n] - v[k]).abs().max().item(), 4) for k, v in (("actor", actor), ("init", init)) for k in [n]}
        # its engine holds its own actor's weights (bf16 engine vs actor: ~0.003 nats measured) ...
        assert (engine[n] - actor[n]).abs().max() < 0.02, (n, report)
        # ... and not another agent's
        for o in others:
            assert (engine[n] - actor[o]).abs().mean() > 0.1, (n, o)
    # coached: trained, its weights moved away from the initial model
    assert (actor["solver"] - init["solver"]).abs().mean() > 0.1
    # "mute" had only unparsable verdicts: no experience, not updated
    assert (actor["mute"] - init["mute"]).abs().max() < 0.02

    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1]
    m = metrics[0]
    assert m["agent/solver/updated"] == 1 and m["agent/mute/updated"] == 0
    assert m["agent/mute/trained_actions"] == 0
    assert (m["coach/verdicts_parse_error"], m["coach/verdicts_ok"], m["coach/failure_fraction"]) == (4, 4, 0.5)
    assert m["coach/retries"] == 8  # each unparsable reply re-prompted twice (--mappa.coach.format_retries 2)
    assert m["coach_bias/solver/math/n"] == 4 and "coach_bias/mute/math/n" not in m and m["coach_bias/warning"] == 0
    assert os.path.exists(run_dir / "coach_cache.sqlite")
    for n in AGENTS:
        for key in ("coach_score", "outcome_success", "action_length", "tool_use_rate", "num_actions"):
            assert f"agent/{n}/{key}" in m
    assert m["agent/solver/trained_actions"] == 4 and "agent/solver/policy_loss" in m

    episodes = [json.loads(line) for line in open(run_dir / "episodes.jsonl")]
    assert len(episodes) == 4
    for ep in episodes:
        assert [a["agent"] for a in ep["actions"]] == list(AGENTS)
        for a in ep["actions"]:
            v = a["verdict"]
            if a["agent"] == "mute":
                assert v["status"] == "parse_error" and v["score"] is None and a["reward"] is None
            else:
                assert v["status"] == "ok" and v["coach"] == "openai:rule-coach"
                assert a["reward"] == v["score"] and a["advantage"] is not None
    assert len(coach_server.requests) == 4 + 4 * 3
    assert {r["authorization"] for r in coach_server.requests} == {"Bearer secret-123"}  # key from the named env var

    # The run's HTML report; rendered where Chromium is installed (CI installs it), the mute agent's cards grey.
    proc = subprocess.run([MAPPA, "report", str(run_dir)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    if shutil.which("chromium"):
        dom = assert_report_renders(str(run_dir / "report.html"), AGENTS, steps=1, episodes=4)
        mute = [c for c in dom.find_all("div", "action") if c.attrs["data-agent"] == "mute"]
        assert mute and all(c.find_all("div", "score")[0].text() == "no score: parse_error" for c in mute)


def test_launch_fails_fast_when_the_cluster_has_too_few_gpus(tmp_path, tiny_model):
    """The real CLI on a local Ray cluster with 1 logical GPU, asked for 2 agents x (actor + engine):
    it must stop before creating any actor, naming both numbers (Ray alone would wait forever)."""
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"prompt": "1 + 1?", "answer": "2"}) + "\n")
    topology = {
        "name": "two", "env": "mathchat", "coach_template": COACH_TEMPLATE,
        "agents": [{"name": n, "model": tiny_model, "role": n, "prompt": "{task}"} for n in ("a", "b")],
    }
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(topology))
    env = local_cluster_env(1)
    proc = run_training(
        [sys.executable, "-m", "openrlhf_mappa.cli.train_mappa_ray", "--mappa.topology", str(tmp_path / "t.yaml"),
         "--data.prompt_dataset", str(tasks), "--rollout.batch_size", "1", "--train.batch_size", "1",
         "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1", "--algo.kl.init_coef", "0",
         "--mappa.run_dir", str(tmp_path / "run")],
        tmp_path / "train", timeout=180, cwd=tmp_path, env=env,
    )
    assert proc.returncode != 0
    assert "not enough GPUs" in proc.stderr and "need 4 GPUs" in proc.stderr and "has 1" in proc.stderr, proc.stderr[-2000:]
    assert "a/actor: 1" in proc.stderr and "b/vllm: 1" in proc.stderr
    assert "RolloutRayActor" not in proc.stdout + proc.stderr  # no engine was ever started
