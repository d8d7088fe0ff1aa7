"""Math debate: debaters argue over rounds, then a judge gives the team's final `\\boxed{}` answer.

The topology (examples/configs/debate.yaml) lists the debaters, then the judge, last. Every debater acts in
every round, concurrently with the other debaters (each sees the others' arguments of earlier rounds, as its
`view` selects); a debater's max_actions is its number of rounds. After the last round the judge acts once.
Success is MathChat's: the judge's (the last agent's) final `\\boxed{}` answer equals the task's answer, and
only the judge's coach is given that answer.
"""

from openrlhf_mappa.envs.mathchat import MathChatEnv


class MathDebateEnv(MathChatEnv):
    def next_agents(self, turns: dict, last: dict) -> list:
        *debaters, judge = self.topology.agents
        if turns[judge.name]:
            return []
        arguing = [d for d in debaters if turns[d.name] < d.max_actions]
        return arguing or [judge]
