"""Evaluation: the team plays held-out tasks with no coach and no training; pass@1 accuracy, DSBench scores and
behaviour metrics per agent. Used by MappaTrainer.evaluate (every --eval.steps) and `mappa eval`, both through
the training rollout, so an evaluated episode is exactly a training episode minus the coach.
"""

import os
import statistics

from openrlhf_mappa.coach import Coach, CoachRequest
from openrlhf_mappa.envs.base import load_tasks
from openrlhf_mappa.episode import Verdict
from openrlhf_mappa.rollout import rollout


class NoCoach(Coach):
    """Evaluation and the outcome baseline ask no coach: every verdict is `skipped` (no score, no cost), `reason`
    its rationale."""

    name = "none"

    def __init__(self, reason: str = "evaluation: not scored"):
        self.reason = reason

    async def score(self, request: CoachRequest) -> Verdict:
        return Verdict(score=None, status="skipped", rationale=self.reason, coach=self.name)


def load_eval_sets(paths: list, limit: int = 0) -> dict:
    """{file stem: its first `limit` tasks (0: all)}; the stem labels eval.jsonl, the loggers and the report, so
    training-time and standalone evaluations of one file line up."""
    return {os.path.splitext(os.path.basename(p))[0]: load_tasks(p)[: limit or None] for p in paths}


async def evaluate(topology, tasks: list, policies: dict, n_samples: int, workspace_root: str, step: int = 0,
                   progress=None) -> list:
    """n_samples episodes per task, all at once; returns the episodes, task-major. progress: see rollout."""
    episodes = [t for t in tasks for _ in range(n_samples)]
    return await rollout(topology, episodes, policies, NoCoach(), workspace_root, step, progress=progress)


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def behaviour_metrics(episodes: list, agent_names: list) -> dict:
    """`agent/<name>/<metric>`: how each agent acts, whatever it is rewarded for. action_length in response tokens;
    tool_error_rate over all actions, code_error_rate over those whose code ran; prompt_truncated counts prompts
    that left history out, prompt_too_long_skipped actions not taken (Episode.skipped_actions);
    answer_format_rate only for agents that owe a final answer (MultiAgentEnv.answer_formatted)."""
    m = {}
    for name in agent_names:
        acts = [a for ep in episodes for a in ep.actions if a.agent == name]
        ran = [a for a in acts if a.feedback.ran]
        owed = [a.formatted for a in acts if a.formatted is not None]
        p = f"agent/{name}/"
        m[p + "num_actions"] = len(acts)
        m[p + "action_length"] = _mean([len(a.response_ids) for a in acts])
        m[p + "tool_use_rate"] = len(ran) / len(acts) if acts else None
        m[p + "tool_error_rate"] = sum(a.feedback.error for a in acts) / len(acts) if acts else None
        m[p + "code_error_rate"] = sum(a.feedback.error for a in ran) / len(ran) if ran else None
        m[p + "truncated_rate"] = sum(a.truncated for a in acts) / len(acts) if acts else None
        m[p + "prompt_truncated"] = sum(a.prompt_truncated for a in acts)
        m[p + "prompt_too_long_skipped"] = sum(s["agent"] == name for ep in episodes for s in ep.skipped_actions)
        if owed:
            m[p + "answer_format_rate"] = sum(owed) / len(owed)
    return m


def summarize(episodes: list, agent_names: list, tasks: list) -> tuple:
    """(summary, problems). accuracy: the mean over problems of pass@1 (mean success over its samples). DSBench
    outcomes add relative_score (an invalid submission counts 0, as DSBench's paper), each task metric's mean
    over valid submissions, and success rate and relative score per task type."""
    by_task = {}
    for ep in episodes:
        by_task.setdefault(ep.task_id, []).append(ep)
    problems = []
    for task in tasks:
        samples = by_task.get(task["id"], [])
        problems.append({"id": task["id"], "type": task.get("type", ""), "reference": task["answer"],
                         "pass1": _mean([float(ep.success) for ep in samples]),
                         "samples": [ep.outcome for ep in samples]})
    outcomes = [ep.outcome for ep in episodes]
    summary = {"accuracy": _mean([p["pass1"] for p in problems]), "n_problems": len(problems),
               "n_samples": len(episodes) // max(1, len(problems))}
    if any("answered" in o for o in outcomes):
        summary["answered_rate"] = _mean([float(bool(o.get("answered"))) for o in outcomes])
    if any(ep.action_limit for ep in episodes):  # stopped by a limit (rollout.run_episode): failures, counted
        summary["action_limit_episodes"] = sum(bool(ep.action_limit) for ep in episodes)
    if any(ep.env_error for ep in episodes):  # ended by an exception in the environment: failures, counted
        summary["env_failed_episodes"] = sum(bool(ep.env_error) for ep in episodes)
    if any("relative_score" in o for o in outcomes):
        summary["relative_score"] = _mean([o.get("relative_score") or 0.0 for o in outcomes])
        for metric in sorted({o["metric_name"] for o in outcomes if o.get("metric_name")}):
            summary[f"metric/{metric}"] = _mean([o["metric"] for o in outcomes if o.get("metric_name") == metric])
        for task_type in sorted({ep.task_type for ep in episodes if ep.task_type}):
            typed = [ep for ep in episodes if ep.task_type == task_type]
            summary[f"{task_type}/success_rate"] = _mean([float(ep.success) for ep in typed])
            summary[f"{task_type}/relative_score"] = _mean([ep.outcome.get("relative_score") or 0.0 for ep in typed])
    summary.update(behaviour_metrics(episodes, agent_names))
    return summary, problems


def format_table(results: dict) -> str:
    """One row per dataset: its headline numbers, then every agent's behaviour (a terminal table)."""
    lines = []
    for dataset, summary in results.items():
        head = {k: v for k, v in summary.items() if not k.startswith("agent/")}
        lines.append(f"{dataset}: " + ", ".join(f"{k} {_fmt(v)}" for k, v in head.items()))
        agents = sorted({k.split("/")[1] for k in summary if k.startswith("agent/")})
        keys = sorted({k.split("/", 2)[2] for k in summary if k.startswith("agent/")})
        width = max(len(a) for a in agents) if agents else 5
        lines.append("  " + "agent".ljust(width) + "".join(f" {k:>18}" for k in keys))
        for a in agents:  # a column is as wide as its name (a name longer than 18 is printed whole)
            cells = [f" {_fmt(summary.get(f'agent/{a}/{k}')):>{max(18, len(k))}}" for k in keys]
            lines.append("  " + a.ljust(width) + "".join(cells))
    return "\n".join(lines)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)
