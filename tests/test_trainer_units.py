"""The trainer's pure pieces: the batch rule for agents whose action count varies, and the Experience
layout of one action (only the agent's own generated tokens train)."""

from types import SimpleNamespace

import torch

from openrlhf_mappa.episode import Action
from openrlhf_mappa.trainer import MappaTrainer, experience_of


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
