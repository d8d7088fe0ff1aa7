"""Relay: the demo's task, built so that tiny untrained agents can visibly learn it in minutes on a CPU.

Each agent of the chain has a goal (`env_kwargs.goals`, examples/configs/relay.yaml): a regular expression its
whole reply must match, ending on its own; the episode succeeds only if every agent met its goal. The coach is
told each goal ("Required reply: <regex>", coach/heuristic.py rule 2), so every action earns credit of its own
while the joint success is still near zero. An environment sees only reply texts, not whether a reply was cut
off, so the goals must bound a reply's length well below the token limit, lest a cut-off reply match.
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
