"""Relay: the demo's task, built so that tiny untrained agents can visibly learn it in a few minutes on a CPU.

Each agent in the topology's chain has its own goal, a regular expression its whole reply must match, and
its reply must end on its own (the model stops, instead of being cut off at the token limit). The episode
succeeds only if every agent met its goal, so no agent can make up for another. The goals come from the
topology's `env_kwargs` (examples/configs/relay.yaml):

    env: relay
    env_kwargs:
      goals: {quantity: '\\d{1,3}', item: '[a-z]{1,8}', code: '[A-Z]{1,4}'}

The coach is told each agent's own goal as ground truth ("Required reply: <regex>"), so it judges every action
on its own: the heuristic coach pays 10 for a reply that is exactly a match and ended on its own, and partial
credit for either half (coach/heuristic.py, rule 2). That per-action credit is what lets the team learn while
the joint success is still near zero.

An environment sees reply texts only; it cannot see whether a reply was cut off. So the goals bound the
length of a reply well below the token limit (the demo: at most 8 characters, cut off at 16 tokens): a cut-off
reply that matched would need 8 or more special tokens, which decode to nothing. With an unbounded goal such
as `[A-Z]+`, 16 capitals cut off at the limit counted as a success (measured in an early demo run). The
coach, told about every cut-off, pays nothing for one; `agent/<name>/truncated_rate` in metrics.jsonl shows
how often replies hit the limit.

Also a small example of writing your own environment (see envs/base.py): override `outcome` and, to give
the coach a checkable goal per action, `coach_ground_truth`.
"""

import re

from openrlhf_mappa.coach.heuristic import REPLY_PREFIX
from openrlhf_mappa.envs.base import MultiAgentEnv


class RelayEnv(MultiAgentEnv):
    task_type = "relay"

    def __init__(self, topology, task, workspace, goals: dict, **kwargs):
        super().__init__(topology, task, workspace, **kwargs)
        missing = [agent.name for agent in topology.agents if agent.name not in goals]
        if missing:
            raise ValueError(f"relay env: env_kwargs.goals has no goal for agent(s) {missing}")
        for name, goal in goals.items():
            try:
                re.compile(goal)
            except (re.error, TypeError) as e:
                raise ValueError(f"relay env: env_kwargs.goals[{name!r}] is not a regular expression: {goal!r} "
                                 f"({e})") from None
        self.goals = goals

    def coach_ground_truth(self, agent) -> str:
        return REPLY_PREFIX + self.goals[agent.name]

    def outcome(self) -> dict:
        replies = {entry.agent: entry.response for entry in self.history}
        met = {name: re.fullmatch(goal, replies.get(name, "")) is not None for name, goal in self.goals.items()}
        return {"success": all(met.values()), **{f"{name}_met": ok for name, ok in met.items()}}
