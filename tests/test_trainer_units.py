"""The trainer's pure pieces: the batch rule for agents whose action count varies, the Experience layout of
one action (only the agent's own generated tokens train), the over-long prompt rule, resume bookkeeping
(team checkpoint marker, log truncation), and bad input rejected by the CLI before Ray starts."""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from openrlhf_mappa.episode import Action
from openrlhf_mappa.rollout import AgentPolicy
from openrlhf_mappa.trainer import MappaTrainer, experience_of, prepare_resume, truncate_logs


def trainer_with(batch_size, seed=0):
    t = MappaTrainer.__new__(MappaTrainer)  # the rule reads only args
    t.args = SimpleNamespace(train=SimpleNamespace(batch_size=batch_size, seed=seed))
    return t


def executor_actions(turns_per_episode):
    return [Action(f"ep{e}", "code_executor", t, [1], [2]) for e, n in enumerate(turns_per_episode) for t in range(n)]


def test_batch_rule_keeps_whole_train_batches_of_a_varying_agent():
    # A Code Executor acting 1-2 times per episode: 1+2+2+1+2 = 8 actions, B = 3 -> 6 kept, 2 dropped.
    actions = executor_actions([1, 2, 2, 1, 2])
    kept, dropped = trainer_with(3).batch_rule(actions, step=1)
    assert (len(kept), dropped) == (6, 2)
    assert len({id(a) for a in kept}) == 6 and all(a in actions for a in kept)
    # seeded: the same step picks the same actions; another step may pick others
    again, _ = trainer_with(3).batch_rule(actions, step=1)
    assert [id(a) for a in again] == [id(a) for a in kept]


def test_batch_rule_skips_an_agent_with_fewer_actions_than_a_batch():
    kept, dropped = trainer_with(4).batch_rule(executor_actions([1, 2]), step=1)
    assert (kept, dropped) == ([], 3)
    kept, dropped = trainer_with(4).batch_rule([], step=1)
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


def test_over_long_prompt_keeps_its_last_tokens_and_is_flagged(tiny_model):
    from transformers import AutoTokenizer

    policy = AgentPolicy(engines=[], tokenizer=AutoTokenizer.from_pretrained(tiny_model), max_new_tokens=16, max_len=64)
    text, ids, cut = policy.prompt_ids([{"role": "user", "content": "short"}])
    assert not cut and len(ids) < 48
    text, ids, cut = policy.prompt_ids([{"role": "user", "content": "x " * 300 + "THE END"}])
    full = policy.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert cut and len(ids) == 64 - 16 and ids == full[-48:]  # the freshest context survives


def test_truncate_logs_keeps_steps_up_to_the_checkpoint(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"step": 3}\n{"step": 4, "x": ')
    (tmp_path / "episodes.jsonl").write_text('{"step": 1, "a": 1}\n{"step": 1, "a": 2}\n{"step": 3}')
    truncate_logs(str(tmp_path), 2)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n{"step": 2}\n'
    assert (tmp_path / "episodes.jsonl").read_text() == '{"step": 1, "a": 1}\n{"step": 1, "a": 2}\n'
    truncate_logs(str(tmp_path), 0)  # a fresh start in the same run directory
    assert (tmp_path / "metrics.jsonl").read_text() == ""


def fake_checkpoints(root, latest_by_agent, marker_step=None):
    for agent, tags in latest_by_agent.items():
        actor = root / agent / "_actor"
        for tag in tags:
            (actor / tag).mkdir(parents=True)
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
    with pytest.raises(SystemExit, match="agent 'verifier' has no global_step3"):
        prepare_resume(args, topology)


def test_cli_rejects_bad_input_before_ray_starts(tmp_path):
    (tmp_path / "tasks.jsonl").write_text('{"prompt": "1 + 1?", "answer": "2"}\n{"prompt": "", "answer": "3"}\n')
    (tmp_path / "t.yaml").write_text(
        "name: t\nenv: mathchat\ncoach_template: 'x {agent_output}'\nagents:\n"
        "  - {name: a, model: /no/such/model, role: r, prompt: '{task}'}\n"
    )
    base = [sys.executable, "-m", "openrlhf_mappa.cli.train_mappa_ray", "--vllm.num_engines", "1"]
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    cases = [
        (["--mappa.topology", str(tmp_path / "t.yaml"), "--data.prompt_dataset", str(tmp_path / "tasks.jsonl")],
         "model '/no/such/model' is not a directory"),
        (["--mappa.topology", os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples", "configs", "mathchat.yaml"),
          "--data.prompt_dataset", str(tmp_path / "tasks.jsonl")], "tasks.jsonl: line 2: empty 'prompt'"),
    ]
    for flags, message in cases:
        proc = subprocess.run(base + flags, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
        assert "Ray" not in proc.stdout + proc.stderr  # rejected before any cluster, actor or engine
