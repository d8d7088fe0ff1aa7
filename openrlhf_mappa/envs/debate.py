"""Math debate (examples/configs/debate.yaml): the debaters argue concurrently for their max_actions rounds,
each seeing the others' earlier arguments as its `view` selects; then the judge, listed last, acts once.
Success and the judge's coach's ground truth are MathChat's (the last agent's final `\\boxed{}` answer).
"""

from openrlhf_mappa.envs.mathchat import MathChatEnv


class MathDebateEnv(MathChatEnv):
    def next_agents(self, turns: dict, last: dict) -> list:
        *debaters, judge = self.topology.agents
        if turns[judge.name]:
            return []
        arguing = [d for d in debaters if turns[d.name] < d.max_actions]
        return arguing or [judge]
