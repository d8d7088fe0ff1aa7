"""Real MAPPA training on CPU: two tiny agents with their own weights, each with its own ZeRO-3 actor,
reference model and vLLM engine (Ray, vLLM, DeepSpeed for real), coached by an OpenAI-compatible server
on 127.0.0.1 (a stand-in for a paid API: it scores by rule, and answers one agent in prose full of
numbers that are not a score). β > 0, 2 steps, trained asynchronously (--train.async_enable: step 2's episodes
are generated one step ahead, while step 1 trains; partial rollouts: a weight sync pauses the engine, vLLM's
pause_generation for real) with OpenRLHF's off-policy correction; "solver" acts twice per episode, and its actor and
reference each run on 2 ranks of one ring-attention group (its topology's ring_attn_size 2, packed sequences split over
the ranks, the same micro-batches routed to both): only flash-attn's kernel is a stand-in (tests/stand_ins), since it
needs CUDA.

Asserted: the coached agent's actor changed, and each actor rank, on its own, gives a plain forward's log-probs of its
agent's export and holds its own ZeRO-3 partition of it; after the sync each
agent's engine holds its own actor's weights and not another agent's (compared through log-probs of a
fixed sequence); the agent the coach never scored got no score, no experience and no update; on the real
experience tensors, every row the solver trained on is one of its own actions of that step (token for token),
trained on that action's reward, and the advantage recorded for the action is the row's mean advantage, both
actions of every episode trained; the per-token reward recovered from the returns is −β·KL_t plus R on the last
action token, KL is the actor's log-probs minus the frozen initial model's; each step's metrics are the values
recomputed from its episodes and tensors, and `mappa report` renders them (in Chromium). The ring's log-probs are
checked against a plain forward of the frozen initial model (through the KL) and against vLLM's. Sampled at temperature
0.7 and top-p 0.9: every trained row's rollout log-probs are its action's, those of an action made by the initial
weights alone are that model's as vLLM samples (temperature, then top-p), recomputed; OpenRLHF's vllm_kl and
is_filter_ratio and the mismatch metrics are recomputed from the tensors.
"""

import dataclasses
import json
import math
import os
import subprocess
import sys

import datasets
import pytest
import torch
import yaml
from openrlhf.datasets.utils import blending_datasets

from coach_server import COACH_TEMPLATE, CoachServer
from conftest import (MAPPA, TINY_RUN_FLAGS, assert_documented_episodes, assert_report_renders,
                      assert_rows_are_their_actions, local_cluster_env, record_experiences, run_training,
                      two_agent_mathchat)
from test_datasets import STRATEGY

from openrlhf_mappa.envs.mathchat import MathChatEnv

AGENTS = ("solver", "mute")  # the coach never gives "mute" a score
PROBE_TEXT = "Probe: 7 + 5 = 12, the answer is 12."
TESTS = os.path.dirname(os.path.abspath(__file__))
BETA = 0.05
# Sampling settings at which vLLM's processed log-probs (logits over the temperature, renormalized over the top-p set)
# are 0.13 nats from the raw ones on the tiny model (measured), 40 times the bf16 engine's noise.
TEMPERATURE, TOP_P = 0.7, 0.9


class EveryTurnMathEnv(MathChatEnv):
    """MathChat in which each agent takes all its max_actions: a random tiny model never writes the code
    block that gives a Code Executor its second action, and this test needs an agent that acts twice."""

    def step(self, agent, turn, response):
        return dataclasses.replace(super().step(agent, turn, response), done=False)


@pytest.fixture
def coach_server():
    with CoachServer(mute={"mute"}) as server:
        yield server


def probe_agents(agents) -> dict:
    """Every agent's engines' and actor's log-probs of PROBE_TEXT (openrlhf_mappa.tools.doctor.probe, which
    `mappa doctor` checks the weight syncs with)."""
    from openrlhf_mappa.tools.doctor import probe

    return probe(agents, PROBE_TEXT)


def sampled_log_probs(logits_BAV, tokens_BA, temperature: float, top_p: float):
    """The log-probs vLLM samples `tokens_BA` with (logprobs_mode processed_logprobs): the logits over the temperature,
    renormalized over the top-p set, which vLLM (apply_top_k_top_p) takes as every logit but the lowest ones whose
    probabilities sum to at most 1 - top_p. The sampled token is always kept: a bf16 engine kept it, where float32 may
    put it just past the edge of the set."""
    t_BAV = logits_BAV / temperature
    sorted_BAV, order_BAV = t_BAV.sort(-1)
    cut_BAV = sorted_BAV.softmax(-1).cumsum(-1) <= 1 - top_p
    cut_BAV[..., -1] = False
    cut_BAV = torch.zeros_like(cut_BAV).scatter(-1, order_BAV, cut_BAV).scatter(-1, tokens_BA[..., None], False)
    return t_BAV.masked_fill(cut_BAV, float("-inf")).log_softmax(-1).gather(-1, tokens_BA[..., None])[..., 0]


def assert_ranks_hold_their_parts(q_proj_ranks: list, export: str):
    """Each actor rank's part of its first q_proj (as run_and_probe records it) is its own slice of that weight in the
    agent's HF export: rank r's ZeRO-3 partition, or its AutoTP rows, is the r-th of the flattened weight (padded to
    the ranks' total); a rank that holds as much as the whole holds all of it. Compared rank by rank: ranks of one
    group return the same gathered output whatever each holds, so comparing them with each other shows nothing."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export, torch_dtype=torch.float32)
    flat = next(m.weight for n, m in model.named_modules() if n.endswith("q_proj")).detach().flatten()
    size = len(q_proj_ranks[0][2])
    whole, flat = size >= len(flat), torch.nn.functional.pad(flat, (0, size * len(q_proj_ranks) - len(flat)))
    for r, (_, _, part) in enumerate(q_proj_ranks):
        part, expected = torch.tensor(part), flat[:size] if whole else flat[r * size:(r + 1) * size]
        # within bf16's rounding: the export may be written from float32 master weights
        assert torch.allclose(part, expected, rtol=2**-8, atol=1e-6), (export, r, (part - expected).abs().max())


def run_and_probe(argv: list, out_path: str, tensors_path: str = None):
    """In a child process (see the test): train with `argv`, then probe every agent (probe_agents; with each actor
    rank's first q_proj, its class and shape). Ray and
    vLLM never live in the pytest process itself. With `tensors_path`, every step's experience tensors are
    saved as the advantage step leaves them (rewards.compute_advantages is observed, not replaced)."""
    import ray

    from openrlhf_mappa.cli.train_mappa_ray import parse_args, train

    if tensors_path:
        record_experiences(tensors_path)
    agents = train(parse_args(argv))
    # and, per actor rank, the class and shape of its first q_proj (DeepSpeed's AutoTP replaces and splits it) and the
    # part of it the rank holds: its ZeRO-3 partition (ds_tensor), else its weight (AutoTP's rows, or all of it)
    q_proj = lambda self: next([type(m).__name__, list(m.weight.shape),
                                getattr(m.weight, "ds_tensor", m.weight).float().flatten().tolist()]
                               for n, m in self.actor.model.module.named_modules() if n.endswith("q_proj"))
    layers = {ag.spec.name: ray.get([h.__ray_call__.remote(q_proj) for h in ag.actor._actor_handlers]) for ag in agents}
    with open(out_path, "w") as f:
        json.dump(dict(probe_agents(agents), q_proj=layers), f)
    ray.shutdown()


@pytest.mark.e2e
def test_mappa_trains_each_agent_on_its_own_with_kl(tmp_path, coach_server):
    models = {}
    for seed, name in enumerate(AGENTS):
        models[name] = str(tmp_path / f"model-{name}")
        subprocess.run([MAPPA, "tiny-model", models[name], "--seed", str(seed)], check=True, capture_output=True)
    agent_rows = {
        "solver": dict(max_actions=2, num_gpus_per_node=2, ring_attn_size=2),  # acts twice; a ring of 2 ranks each
        "mute": dict(max_actions=1),
    }
    topology = {
        "name": "e2e",
        "env": "test_mappa_e2e:EveryTurnMathEnv",
        "coach_template": COACH_TEMPLATE,
        "agents": [dict(name=n, model=models[n], role=f"{n} role", prompt="{task}\n{history}", **agent_rows[n])
                   for n in AGENTS],
    }  # fmt: skip
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(topology))
    # The tasks as OpenRLHF users bring them: a JSONL file and a parquet file, columns of their own (the flags name
    # them), blended by probabilities; seed 42 interleaves them into 4 rows, 2 steps of 2 tasks x 2 samples.
    with open(tmp_path / "a.jsonl", "w") as f:
        for i in range(2):
            f.write(json.dumps({"question": f"What is {i} + 2?", "solution": str(i + 2)}) + "\n")
    datasets.Dataset.from_dict({"question": [f"What is {i} + 2?" for i in (2, 3)], "solution": ["4", "5"]}).to_parquet(
        str(tmp_path / "b.parquet"))
    tasks = f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.parquet'}"

    run_dir = tmp_path / "run"
    argv = [
        "--mappa.topology", str(tmp_path / "topology.yaml"),
        "--mappa.coach.kind", "openai",
        "--mappa.coach.base_url", coach_server.base_url,
        "--mappa.coach.model", "rule-coach",
        "--mappa.coach.api_key_env", "MAPPA_TEST_COACH_KEY",
        "--mappa.run_dir", str(run_dir),
        "--data.prompt_dataset", tasks, "--data.prompt_probs", "0.7,0.3",
        "--data.input_key", "question", "--data.label_key", "solution",
        *TINY_RUN_FLAGS,
        "--algo.kl.init_coef", str(BETA),  # after TINY_RUN_FLAGS' 0: the later flag wins
        "--algo.kl.estimator", "k1",
        # "mute"'s unscored actions leave the batch, so it never trains (by default they are zero-loss rows:
        # tests/test_batch_semantics.py, test_trainer_units.py)
        "--mappa.batch_semantics", "usable",
        "--algo.advantage.is_correction_level", "token",  # OpenRLHF's correction, on vLLM's own log-probs
        "--rollout.temperature", str(TEMPERATURE), "--rollout.top_p", str(TOP_P),  # vLLM's processed log-probs
        "--train.async_enable", "--train.partial_rollout_enable",  # step 2 generated beside step 1; syncs pause
        "--ref.num_gpus_per_node", "1",
        "--actor.adam.lr", "1e-2",
        "--actor.lr_warmup_ratio", "0",
        "--ckpt.path", str(tmp_path / "ckpt"),
        "--ckpt.output_dir", str(tmp_path / "final"),
    ]  # fmt: skip
    # solver: 2 actor + 2 reference + 1 engine; mute: 1 + 1 + 1
    env = local_cluster_env(8, MAPPA_TEST_COACH_KEY="secret-123",
                            PYTHONPATH=os.pathsep.join([os.path.join(TESTS, "stand_ins"), os.environ.get("PYTHONPATH", "")]))
    probe_path, tensors_path = str(tmp_path / "probe.json"), str(tmp_path / "tensors.pt")
    child = (f"import sys; sys.path.insert(0, {TESTS!r}); from test_mappa_e2e import run_and_probe; "
             f"run_and_probe({argv!r}, {probe_path!r}, {tensors_path!r})")  # fmt: skip
    proc = run_training([sys.executable, "-c", child], tmp_path / "train", timeout=1500, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    result = json.load(open(probe_path))
    probe = result["probe"]
    engine = {n: torch.tensor(v) for n, v in result["engine"].items()}
    actor = {n: torch.tensor(v) for n, v in result["actor"].items()}

    from test_openrlhf_cpu_e2e import hf_probe_logprobs

    init = {n: hf_probe_logprobs(models[n], probe) for n in AGENTS}
    # Each actor rank, on its own (the probe's actor runs at temperature 1, as vLLM's prompt log-probs): its log-probs
    # are a plain forward's of the agent's export, and it holds its own ZeRO-3 partition of it.
    for n in AGENTS:
        final = hf_probe_logprobs(str(tmp_path / "final" / n), probe)
        for r, lp in enumerate(result["actor_ranks"][n]):
            gap = (torch.tensor(lp) - final).abs()
            assert gap.max() < 0.05 and gap.mean() < 0.01, (n, r, gap.max(), gap.mean())
        assert_ranks_hold_their_parts(result["q_proj"][n], str(tmp_path / "final" / n))
    assert len(result["q_proj"]["solver"]) == 2
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
    # "mute" never had a score: no experience, not updated
    assert (actor["mute"] - init["mute"]).abs().max() < 0.02
    processes = json.load(open(run_dir / "processes.json"))
    assert {"solver/actor rank 1", "solver/reference rank 1", "mute/reference rank 0"} <= set(processes)

    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    episodes = [json.loads(line) for line in open(run_dir / "episodes.jsonl")]
    syncs = [s for s in map(json.loads, open(run_dir / "syncs.jsonl")) if s["agent"] == "solver"]
    assert [(s["step"], s["version"]) for s in syncs] == [(1, 1), (2, 2)]  # one sync per update, one version each
    checked = assert_documented_episodes(str(run_dir / "episodes.jsonl"))  # the documented record
    assert checked["episode"] == 8 and checked["verdict"] == checked["action"]
    # The tasks trained on are OpenRLHF's blend of both files, row for row (no id column: each row's position).
    blend = blending_datasets(tasks, "0.7,0.3", STRATEGY, 42)
    assert json.load(open(run_dir / "train_tasks.json"))["ids"] == ["0", "1", "2", "3"] and len(blend) == 4
    assert sorted(ep["task_id"] for ep in episodes) == sorted(["0", "1", "2", "3"] * 2)
    for ep in episodes:
        row = blend[int(ep["task_id"])]
        assert row["question"] in ep["actions"][0]["prompt_text"]
        assert ep["actions"][-1]["coach_request"]["ground_truth"] == row["solution"]  # the last agent's coach's
    steps = torch.load(tensors_path)  # the real experience tensors of every step: only the solver's
    assert [m["step"] for m in metrics] == [1, 2] and len(episodes) == 8
    assert len(steps) == 2 and all(set(s) == {"solver"} for s in steps)
    for ep in episodes:
        assert [(a["agent"], a["turn"]) for a in ep["actions"]] == [("solver", 0), ("solver", 1), ("mute", 0)]
        for a in ep["actions"]:
            v = a["verdict"]
            if a["agent"] == "mute":  # prose full of numbers, none of them a score: no score recorded
                assert v["status"] == "parse_error" and v["score"] is None and a["reward"] is None
            else:  # both of the solver's actions train on their own verdicts
                assert v["status"] == "ok" and v["coach"] == "openai:rule-coach" and a["reward"] == v["score"]
    assert len([r for r in coach_server.requests if r["prompt"]]) == 2 * (8 + 4 * 3)
    assert {r["authorization"] for r in coach_server.requests} == {"Bearer secret-123"}  # key from the named env var

    from transformers import AutoModelForCausalLM, AutoTokenizer

    # Every row the solver trained on is one of its own actions of that step, on that action's reward, and the
    # advantage recorded for that action is the row's: each step, both turns of all 4 episodes.
    rows = assert_rows_are_their_actions(steps, episodes, AutoTokenizer.from_pretrained(models["solver"]))
    for step, m in enumerate(metrics, 1):
        mine = [ep for ep in episodes if ep["step"] == step]
        trained = [(episodes[i]["episode_id"], episodes[i]["actions"][j]["turn"]) for i, j in rows[step, "solver"]]
        assert sorted(trained) == sorted((ep["episode_id"], t) for ep in mine for t in (0, 1))
        assert m["agent/solver/updated"] == 1 and m["agent/mute/updated"] == 0
        assert m["agent/solver/trained_actions"] == 8 and m["agent/mute/trained_actions"] == 0
        assert (m["coach/verdicts_parse_error"], m["coach/verdicts_ok"]) == (4, 8)
        assert m["coach/failure_fraction"] == pytest.approx(4 / 12)
        assert m["coach/retries"] == 8  # each unscorable reply re-prompted twice (--mappa.coach.format_retries 2)
        assert m["coach_bias/solver/math/n"] == 8 and "coach_bias/mute/math/n" not in m and m["coach_bias/warning"] == 0
        # The step's values, recomputed from its episodes and tensors.
        success = sum(ep["outcome"]["success"] for ep in mine) / 4
        scores = [a["verdict"]["score"] for ep in mine for a in ep["actions"] if a["agent"] == "solver"]
        assert (m["outcome/success_rate"], m["agent/solver/outcome_success"]) == (success, success)
        assert m["agent/solver/coach_score"] == pytest.approx(sum(scores) / 8) and m["agent/mute/coach_score"] is None
        assert (m["agent/solver/num_actions"], m["agent/mute/num_actions"]) == (8, 4)
        for n in AGENTS:
            ran = [a["feedback"]["exit_code"] is not None or a["feedback"]["timed_out"] for ep in mine for a in ep["actions"]
                   if a["agent"] == n]  # fmt: skip
            assert m[f"agent/{n}/tool_use_rate"] == sum(ran) / len(ran), n
        tokens = [b["action_mask"].sum(1) for b in steps[step - 1]["solver"]]
        assert m["agent/solver/action_length"] == pytest.approx(torch.cat(tokens).float().mean().item())
        kl_B = torch.cat([(b["kl"].float() * b["action_mask"]).sum(1) / b["action_mask"].sum(1) for b in steps[step - 1]["solver"]])
        assert m["agent/solver/kl"] == pytest.approx(kl_B.mean().item(), abs=1e-6)
        # vLLM's sampling log-probs against the actor's (both over the temperature) on the same tokens, row by row
        # with the version its action was made by (the solver's weights have had step - 1 updates when step `step`
        # trains). Made by the actor's current weights (all of step 1's): vLLM's are renormalized over the top-p set,
        # so above the actor's by minus the log of that set's mass, between 0 and -log(top_p) (0.105), up to the bf16
        # engine's noise. Step 2's, generated one step ahead beside step 1's update, are one update back. Those made
        # wholly by the initial weights are checked against their recomputed log-probs below.
        lag = [step - 1 - episodes[i]["actions"][j]["versions"]["solver"] for i, j in rows[step, "solver"]]
        d_BA = [(lp - rlp)[mask] for b in steps[step - 1]["solver"] for lp, rlp, mask in
                zip(b["action_log_probs"].float(), b["rollout_log_probs"].float(), b["action_mask"].bool())]
        fresh, stale = (torch.cat([d for d, k in zip(d_BA, lag) if k == n] or [torch.zeros(0)]) for n in (0, 1))
        assert len(fresh) + len(stale) == sum(map(len, d_BA)), lag  # nothing older than one update
        assert not len(fresh) or -0.01 < -fresh.mean() < -math.log(TOP_P) + 0.01, (step, -fresh.mean())
        assert (step == 1) == (not len(stale)), (step, lag)
        assert m["agent/solver/staleness_max"] == max(lag) and m["agent/solver/stale_left_out"] == 0
        # partial rollouts: a sync pauses the engine (vLLM's pause_generation, for real) rather than waiting, so an
        # action in flight across one would end on a later version than it began (test_workflows makes that case;
        # here both steps' episodes ended before the first sync, measured). The solver's versions, its two actions'
        # starts and ends in order, lie within its syncs (syncs.jsonl) from those ended before the episode began to
        # those begun before its agents were done; "mute", acting after both, records the solver's older start.
        for ep in mine:
            first, second, after = ep["actions"]
            seen = [v for a in (first, second) for v in (a["versions"]["solver"], a["version_end"])]
            began, done = ep["timings"]["start"], ep["timings"]["start"] + ep["timings"]["rollout_s"]
            ended_before, begun_before = (sum(s[k] < t for s in syncs) for k, t in (("end", began), ("start", done)))
            assert ended_before <= seen[0] and seen == sorted(seen) and seen[-1] <= begun_before, (step, seen)
            assert after["versions"]["solver"] == seen[0] and set(after["versions"]) == set(AGENTS), after["versions"]
        d_N = torch.cat(d_BA)
        assert m["agent/solver/logprob_mismatch_abs"] == pytest.approx(d_N.abs().mean().item(), abs=1e-6)
        assert m["agent/solver/logprob_mismatch_kl"] == pytest.approx((d_N.exp() - 1 - d_N).mean().item(), abs=1e-6)
        # OpenRLHF's correction, recomputed over the step's action tokens (--algo.advantage.is_correction_level
        # token, its default band [0.5, 5] in mask mode): vllm_kl is vLLM's log-probs minus the actor's, and a token
        # is filtered where their ratio (the actor's over vLLM's) leaves the band (measured: 0.104 and none at step 1,
        # 0.279 and 1 token in 6 at step 2, one update behind).
        assert m["agent/solver/vllm_kl"] == pytest.approx(-d_N.mean().item(), abs=1e-5), (step, -d_N.mean())
        filtered_N = (d_N.exp() < 0.5) | (d_N.exp() > 5)
        assert m["agent/solver/is_filter_ratio"] == pytest.approx(filtered_N.float().mean().item(), abs=1e-6)
        assert m["agent/solver/kl_coef"] == BETA and "agent/mute/logprob_mismatch_abs" not in m
        assert "agent/solver/policy_loss" in m and "agent/mute/kl" not in m
    assert os.path.exists(run_dir / "coach_cache.sqlite")

    ref_model = AutoModelForCausalLM.from_pretrained(models["solver"], torch_dtype=torch.float32)
    for step, s in enumerate(steps, 1):
        made, initial = iter(rows[step, "solver"]), []  # each row's action, in row order
        for b in s["solver"]:
            mask_BA, kl_BA, G_BA = b["action_mask"].bool(), b["kl"].float(), b["returns"].float()
            # r_t = G_t − G_{t+1}, read off the returns the actor trains on ...
            r_BA = torch.where(mask_BA, G_BA - torch.nn.functional.pad(G_BA[:, 1:], (0, 1)), 0.0)
            pos_A = torch.arange(mask_BA.size(1))
            is_last_BA = pos_A == torch.where(mask_BA, pos_A, -1).max(1).values[:, None]
            # ... is −β·KL_t on every action token, plus the action's reward R on its last one
            expected_BA = torch.where(mask_BA, -BETA * kl_BA + is_last_BA * b["rewards"][:, None].float(), 0.0)
            assert torch.allclose(r_BA, expected_BA, atol=1e-5), (step, (r_BA - expected_BA).abs().max())
            # KL (k1) is the actor's log-probs minus the reference's, and the reference is the frozen initial
            # model: logp − KL matches the initial model's log-probs at both steps (both over the temperature, as
            # OpenRLHF's Actor divides its logits).
            with torch.no_grad():
                logits_BAV = ref_model(b["sequences"]).logits[:, :-1].float()[:, -mask_BA.size(1):]
            tokens_BA = b["sequences"][:, 1:][:, -mask_BA.size(1):]
            ref_BA = torch.log_softmax(logits_BAV / TEMPERATURE, -1).gather(-1, tokens_BA[..., None])[..., 0]
            gap = ((b["action_log_probs"].float() - kl_BA) - ref_BA)[mask_BA].abs()
            assert gap.max() < 0.02 and gap.mean() < 0.005, (step, gap.max(), gap.mean())  # measured 0.004, 0.001
            # An action made wholly by the initial weights (its version and version_end 0: all of step 1's, step 2's
            # that no sync crossed): its rollout log-probs are the initial model's as vLLM samples (temperature, top-p),
            # and not its raw log-probs (temperature 1, the whole vocabulary), which an engine in logprobs_mode
            # raw_logprobs would return.
            sampled_BA = sampled_log_probs(logits_BAV, tokens_BA, TEMPERATURE, TOP_P)
            raw_BA = torch.log_softmax(logits_BAV, -1).gather(-1, tokens_BA[..., None])[..., 0]
            for rlp, sampled, raw, mask in zip(b["rollout_log_probs"].float(), sampled_BA, raw_BA, mask_BA):
                i, j = next(made)
                if episodes[i]["actions"][j]["versions"]["solver"] == episodes[i]["actions"][j]["version_end"] == 0:
                    initial.append(((rlp - sampled)[mask], (rlp - raw)[mask]))
        assert step == 2 or len(initial) == 8, (step, len(initial))
        if initial:
            sampled_N, raw_N = (torch.cat(d).abs() for d in zip(*initial))
            # measured: 0.0015 and 0.0055 nats from the recomputed ones, 0.11-0.13 from the raw ones
            assert sampled_N.mean() < 0.01 and sampled_N.max() < 0.05, (step, sampled_N.mean(), sampled_N.max())
            assert raw_N.mean() > 0.05, (step, raw_N.mean())
        kl_abs = torch.cat([b["kl"][b["action_mask"].bool()].abs().flatten() for b in s["solver"]])
        # step 1: the actor is still the initial model (KL 0 measured); step 2: it moved (0.28 measured)
        assert kl_abs.max() < 1e-4 if step == 1 else kl_abs.mean() > 1e-2

    # The run's HTML report, written by the launcher at the run's end, and by `mappa report` again; rendered
    # (the test skips without Chromium, and fails so under CI), the mute agent's cards grey.
    assert (run_dir / "report.html").exists()
    proc = subprocess.run([MAPPA, "report", str(run_dir)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    dom = assert_report_renders(str(run_dir / "report.html"), AGENTS, steps=2, episodes=8)
    mute = [c for c in dom.find_all("div", "action") if c.attrs["data-agent"] == "mute"]
    assert mute and all(c.find_all("div", "score")[0].text() == "no score: parse_error" for c in mute)


@pytest.mark.e2e
def test_tensor_parallel_agent_trains_on_split_layers_fed_alike(tmp_path, tiny_model):
    """DeepSpeed's AutoTP for one agent, for real on CPU (ZeRO-2, gloo): MathChat's Problem Solver on 2 ranks in one
    tensor-parallel group (topology `tensor_parallel_size: 2`), beside a Verifier on 1; heuristic coach, 2 steps.
    Sampled at top-p 0.9 with `--mappa.ppo_ratio rollout`: PPO's old log-probs are vLLM's."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    topology_path, tasks = two_agent_mathchat(tmp_path, num_tasks=4)
    raw = yaml.safe_load(open(topology_path))
    raw["agents"][0].update(num_gpus_per_node=2, tensor_parallel_size=2)
    assert raw["agents"][0]["name"] == "problem_solver"
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(raw))
    argv = ["--mappa.topology", topology_path, "--mappa.model", tiny_model, "--data.prompt_dataset", tasks,
            "--mappa.run_dir", str(tmp_path / "run"), *TINY_RUN_FLAGS, "--ds.zero_stage", "2",
            "--actor.adam.lr", "1e-2", "--actor.lr_warmup_ratio", "0", "--ckpt.output_dir", str(tmp_path / "final"),
            "--rollout.top_p", str(TOP_P), "--mappa.ppo_ratio", "rollout"]  # fmt: skip
    probe_path, tensors_path = str(tmp_path / "probe.json"), str(tmp_path / "tensors.pt")
    child = (f"import sys; sys.path.insert(0, {TESTS!r}); from test_mappa_e2e import run_and_probe; "
             f"run_and_probe({argv!r}, {probe_path!r}, {tensors_path!r})")  # fmt: skip
    proc = run_training([sys.executable, "-c", child], tmp_path / "train", timeout=1200, cwd=tmp_path,
                        env=local_cluster_env(5))  # the solver's 2 actor ranks and engine, the verifier's 1 and 1
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    result = json.load(open(probe_path))
    # Each solver rank holds half of every q_proj (AutoTP's LinearLayer); the verifier's is whole.
    assert [q[:2] for q in result["q_proj"]["problem_solver"]] == [["LinearLayer", [64, 128]]] * 2, result["q_proj"]
    assert [q[:2] for q in result["q_proj"]["verifier"]] == [["Linear", [128, 128]]]
    # Both ranks compute one forward (each its half, all-reduced), and the sync sent the gathered weights: the
    # engine gives the trained actor's log-probs, and the actor moved away from the initial model. Each rank on
    # its own: its half of q_proj is its rows of the export's, and its log-probs are a plain forward's of the export.
    from test_openrlhf_cpu_e2e import hf_probe_logprobs

    for n in ("problem_solver", "verifier"):
        final = hf_probe_logprobs(str(tmp_path / "final" / n), result["probe"])
        for r, lp in enumerate(result["actor_ranks"][n]):
            gap = (torch.tensor(lp) - final).abs()
            assert gap.max() < 0.05 and gap.mean() < 0.01, (n, r, gap.max(), gap.mean())
        assert_ranks_hold_their_parts(result["q_proj"][n], str(tmp_path / "final" / n))
    engine, actor = (torch.tensor(result[k]["problem_solver"]) for k in ("engine", "actor"))
    assert (engine - actor).abs().max() < 0.02
    assert (actor - torch.as_tensor(hf_probe_logprobs(tiny_model, result["probe"]))).abs().mean() > 0.05
    # Step 1's experience (the initial weights): the split forward's log-probs of every row are a plain HF
    # forward's, so both ranks of the group were given the same rows; each row is one of the solver's actions; its
    # rollout log-probs are that forward's renormalized over the top-p set, as vLLM samples.
    steps = torch.load(tensors_path)
    episodes = [json.loads(line) for line in open(tmp_path / "run" / "episodes.jsonl")]
    rows = assert_rows_are_their_actions(steps, episodes, AutoTokenizer.from_pretrained(tiny_model))
    assert len(steps) == 2 and all(len(rows[step, "problem_solver"]) == 4 for step in (1, 2))
    model = AutoModelForCausalLM.from_pretrained(tiny_model, torch_dtype=torch.float32)
    for b in steps[0]["problem_solver"]:
        mask_BA = b["action_mask"].bool()
        with torch.no_grad():
            logits = model(b["sequences"], attention_mask=b["attention_mask"]).logits[:, :-1].float()
        hf_BA = torch.log_softmax(logits, -1).gather(-1, b["sequences"][:, 1:, None])[..., 0][:, -mask_BA.size(1):]
        gap = (b["action_log_probs"].float() - hf_BA)[mask_BA].abs()
        assert gap.max() < 0.05 and gap.mean() < 0.01, (gap.max(), gap.mean())
        tokens_BA = b["sequences"][:, 1:][:, -mask_BA.size(1):]
        sampled_BA = sampled_log_probs(logits[:, -mask_BA.size(1):], tokens_BA, 1.0, TOP_P)
        gap = (b["rollout_log_probs"].float() - sampled_BA)[mask_BA].abs()
        assert gap.max() < 0.05 and gap.mean() < 0.01, (gap.max(), gap.mean())
    # --mappa.ppo_ratio rollout: PPO's old log-probs are vLLM's, so upstream's ppo_kl (old minus new over the action
    # tokens; new is the experience's own, as the step's one optimizer step comes after both micro-batches) is vLLM's
    # minus the actor's: top-p's renormalization, 0.104 nats measured. With the actor's as old (trainer, the
    # default) it is 0.
    metrics = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    for step, m in enumerate(metrics, 1):
        d_N = torch.cat([(b["rollout_log_probs"].float() - b["action_log_probs"].float())[b["action_mask"].bool()]
                         for b in steps[step - 1]["problem_solver"]])
        assert d_N.mean() > 0.05 and m["agent/problem_solver/ppo_kl"] == pytest.approx(d_N.mean().item(), abs=1e-4)


@pytest.mark.e2e  # it starts a Ray cluster
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
         "--ds.attn_implementation", "sdpa",  # no flash-attn here: refused before the GPU count otherwise
         "--rollout.max_new_tokens", "8", "--mappa.run_dir", str(tmp_path / "run")],
        tmp_path / "train", timeout=180, cwd=tmp_path, env=env,
    )
    assert proc.returncode != 0
    assert "not enough GPUs" in proc.stderr and "need 4 GPUs" in proc.stderr and "has 1" in proc.stderr, proc.stderr[-2000:]
    assert "a/actor: 1" in proc.stderr and "b/vllm: 1" in proc.stderr
    log = (tmp_path / "run" / "train.log").read_text()  # Ray's output, without --mappa.verbose
    assert "RolloutRayActor" not in proc.stdout + proc.stderr + log  # no engine was ever started
