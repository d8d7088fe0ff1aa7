"""Each per-agent fact computed once (issue 65, Build 2): placement.Member holds a trainee's spec and args and
computes its actor and reference GPUs, whether it has a reference group, its engine pool, its most actions per
episode and its schedule length; placement.scored whether the coach is asked. The package holds each old
formula at that one site only, and the facts read through Member agree with the plan's counts on a few
teams."""

import os
import re
from pathlib import Path

import pytest

from openrlhf_mappa import placement
from openrlhf_mappa.cli.train_mappa_ray import parse_args, schedule_steps
from openrlhf_mappa.episode import COACH_NAME
from openrlhf_mappa.launch import actor_args
from openrlhf_mappa.team import load_topology
from openrlhf_mappa.topology import Lora

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "openrlhf_mappa"
MATHCHAT = str(ROOT / "examples" / "configs" / "mathchat.yaml")  # max_actions: 1, 2 (code_executor), 1
QWEN3_4B = str(ROOT / "tests" / "fixtures" / "qwen3-4b")

# (the fact, the old formula as a pattern, the one file that may hold it). Where they were computed before:
# actor GPUs at 7 sites (placement x4, the CLI, the doctor), "has a reference group" at 5 (launch, placement
# x3, the CLI), the trainees at 2, scored at 3 (trainer, the CLI x2), most actions and the schedule at 2
# (topology, the CLI).
RULES = [
    ("actor and reference GPUs", r"num_nodes\s*\*\s*[\w.]*num_gpus_per_node", "placement.py"),
    ("has a reference group", r"init_coef\s*>\s*0\s+and\b[^\n]*lora", "placement.py"),
    ("the trainees", r"topology\.agents\[:1\]", "placement.py"),
    ("scored", r"reward\s*==\s*\"process\"\s+or", "placement.py"),
    ("schedule length", r"lr_horizon\s*==", "placement.py"),
    ("most actions", r"def most_actions", "placement.py"),
]
# agent_trainer.py overrides upstream's split_rollout_samples inside its actor, on upstream's own rank count.
UPSTREAM_OVERRIDE = ("agent_trainer.py", "num_nodes")


def package_sources() -> dict:
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                out[os.path.relpath(path, PACKAGE)] = open(path, encoding="utf-8").read()
    return out


@pytest.mark.parametrize("fact, pattern, home", RULES, ids=[rule[0] for rule in RULES])
def test_each_fact_has_one_site(fact, pattern, home):
    found = {path for path, text in package_sources().items() if re.search(pattern, text)}
    found -= {UPSTREAM_OVERRIDE[0]} if UPSTREAM_OVERRIDE[1] in pattern else set()
    assert found == {home}, f"{fact}: computed in {sorted(found)}, not in {home} alone"


def run_args(*extra):
    return parse_args(["--mappa.topology", MATHCHAT, "--data.prompt_dataset", "x.json", "--mappa.model",
                       QWEN3_4B, "--actor.num_gpus_per_node", "2", "--ref.num_gpus_per_node", "1",
                       "--vllm.num_engines", "2", "--algo.kl.init_coef", "0.01", "--rollout.batch_size", "8",
                       "--rollout.n_samples_per_prompt", "2", "--train.batch_size", "4",
                       "--train.num_episodes", "1", "--mappa.lr_horizon", "max_actions", *extra])


def team(*extra):
    args = run_args(*extra)
    topology = load_topology(MATHCHAT, model_override=args.mappa.model)
    return args, topology


def test_the_schedule_ends_at_the_last_step_under_max_episode_actions():
    # Issue 65 / review 3.4: schedule_steps summed the agents' max_actions itself and ignored the topology's
    # max_episode_actions, which the actors' batch plan (launch.actor_args) and the trainer's step count
    # respect: the schedule ran past the steps an agent can take. 64 tasks in rollout batches of 8: 8 steps.
    args, topology = team()
    assert schedule_steps(args, topology, 64) == {"problem_solver": 32, "code_executor": 64, "verifier": 32}
    topology.max_episode_actions = 1
    for spec in topology.agents:  # the schedule's optimizer steps a rollout step are what the actor plans for
        planned = actor_args(args, spec, topology).rollout.batch_size * 2 // 4
        assert schedule_steps(args, topology, 64)[spec.name] == 8 * planned == 32
    args.mappa.shared_policy = True  # one policy for every role: 4 actions an episode, capped at 1
    assert schedule_steps(args, topology, 64)["problem_solver"] == 32
    args, topology = team("--mappa.coach.kind", "trained", "--mappa.coach.model", QWEN3_4B)
    topology.max_episode_actions = 2  # the coach judges every action: 4, capped at 2
    assert schedule_steps(args, topology, 64)[COACH_NAME] == 8 * (8 * 2 * 2 // 4)


def test_the_facts_through_member():
    # GPUs of their own: each agent's actor GPUs from the flags or its topology's num_gpus_per_node (its
    # reference's too), a reference group each with KL on, engines of its own.
    args, topology = team()
    topology.agents[2].num_gpus_per_node = 4
    members = placement.members(args, topology)
    assert [(m.spec.name, m.actor_gpus, m.ref_gpus, m.has_reference, m.pool) for m in members] == [
        ("problem_solver", 2, 1, True, None), ("code_executor", 2, 1, True, None),
        ("verifier", 4, 4, True, None)]
    assert [m.most_actions(topology) for m in members] == [1, 2, 1]
    plan = placement.make_plan(args, topology)
    for m in members:
        name = m.spec.name
        assert (plan.counts[f"{name}/actor"], plan.counts[f"{name}/reference"]) == (m.actor_gpus, m.ref_gpus)
    # Two LoRA agents sharing a base: one pool, no reference group (the actor with its adapter off), no
    # engines of their own; the full-weight verifier keeps its own.
    for spec in topology.agents[:2]:
        spec.lora = Lora(16, 32.0)
    members = placement.members(args, topology)
    assert [(m.has_reference, m.pool) for m in members] == [(False, "pool qwen3-4b")] * 2 + [(True, None)]
    assert list(placement.lora_pools(args, topology)) == ["pool qwen3-4b"]
    assert set(placement.make_plan(args, topology).counts) == {"problem_solver/actor", "code_executor/actor",
                                                               "verifier/actor", "verifier/reference",
                                                               "verifier/vllm", "pool qwen3-4b/vllm"}
    # Without KL no member has a reference group; colocated as a team the shares count the models a GPU holds.
    args, topology = team("--algo.kl.init_coef", "0", "--mappa.colocate", "team")
    assert not any(m.has_reference for m in placement.members(args, topology))
    assert placement.gpu_share(args, topology) == int(1e4 / 6) / 1e4  # 3 actors, 3 engines
    # A trained coach is one more member, last, with its own args: its rate, its one-digit reply.
    args, topology = team("--mappa.coach.kind", "trained", "--mappa.coach.model", QWEN3_4B,
                          "--mappa.coach.lr", "1e-6", "--mappa.coach.reply", "digit")
    coach = placement.members(args, topology)[-1]
    assert (coach.spec.name, coach.args.actor.adam.lr) == (COACH_NAME, 1e-6)
    assert coach.args.rollout.max_new_tokens == 1  # one digit
    assert coach.most_actions(topology) == 4 and coach.has_reference and coach.actor_gpus == 2
    assert placement.scored(args) and not placement.scored(run_args("--mappa.reward", "outcome"))
