"""Relay: the demo's task, built so that tiny untrained agents can visibly learn it in minutes on a CPU.

Each agent of the chain has a goal (`env_kwargs.goals`, examples/configs/relay.yaml): a regular expression its
whole reply must match, ending on its own; the episode succeeds only if every agent met its goal. Each action
is graded against its own agent's goal (`judge`, which the offline coach takes; an LLM coach is told the goal
as "Required reply: <regex>"), so every action earns credit of its own while the joint success is still near
zero. The outcome sees only reply texts, not whether a reply was cut off, so the goals must bound a reply's
length well below the token limit, lest a cut-off reply match.
"""

import re

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
                raise ValueError(
                    f"relay env: env_kwargs.goals[{name!r}] is not a regular expression: {goal!r} "
                    f"({e})"
                ) from None
        self.goals = goals

    def coach_ground_truth(self, agent) -> str:
        return "Required reply: " + self.goals[agent.name]

    def judge(self, agent, response: str, feedback, truncated_at) -> tuple:
        """The reply rule: 10 for a whole-reply match of the goal that ended on its own, 0 if cut off, else 5
        (+2 if it contains a match). An untrained agent first learns to stop (paying content first would crowd
        out the rare end token), then to say the right thing."""
        pattern = self.goals[agent.name]
        if truncated_at is not None:
            return 0.0, f"reply rule: cut off at the token limit ({truncated_at} tokens)", True
        if re.fullmatch(pattern, response):
            return 10.0, f"reply rule: the reply is {pattern!r} and ended on its own", False
        found = bool(re.search(pattern, response))
        why = f"reply rule: ended on its own but is not {pattern!r}; contains it: {found}"
        return 5.0 + 2.0 * found, why, True

    def outcome(self) -> dict:
        replies = {entry.agent: entry.response for entry in self.history}
        met = {
            f"{name}_met": re.fullmatch(goal, replies.get(name, "")) is not None
            for name, goal in self.goals.items()
        }
        return {"success": all(met.values()), **met}
