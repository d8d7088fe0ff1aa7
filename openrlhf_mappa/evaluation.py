"""Evaluation: the team plays held-out tasks with no training; pass@1 accuracy, DSBench scores and behaviour
metrics per agent. Used by MappaTrainer.evaluate (every --eval.steps) and `mappa eval`, both through the
training rollout, so an evaluated episode is exactly a training episode. Its accuracy has two graders: the
environment's (`accuracy`; MathChat: math-verify) and, where a coach was asked, the authors'
(`accuracy_coach`, coach_graded).
"""

import asyncio
import os
import re
import statistics
import unicodedata

from openrlhf_mappa.coach import Coach, CoachRequest
from openrlhf_mappa.coach.base import ANSWER_KEY
from openrlhf_mappa.coach.audit import coach_step_metrics
from openrlhf_mappa.envs.base import load_tasks
from openrlhf_mappa.episode import Verdict
from openrlhf_mappa.rollout import rollout


class NoCoach(Coach):
    """Evaluation and the outcome baseline ask no coach: every verdict is `skipped` (no score, no cost),
    `reason` its rationale."""

    name = "none"

    def __init__(self, reason: str = "evaluation: not scored"):
        self.reason = reason

    async def score(self, request: CoachRequest) -> Verdict:
        return Verdict(score=None, status="skipped", rationale=self.reason, coach=self.name)


def load_eval_sets(args, needs_answer: bool = True, limit: int = 0) -> dict:
    """{name: its first `limit` tasks (0: all)} of each comma-separated --eval.dataset entry, its own set
    (where OpenRLHF blends them into one), loaded by load_tasks with --eval.split and the --data keys. The
    name (a file's stem, a Hub dataset's last part) labels eval.jsonl, the loggers and the report, so
    training-time and standalone evaluations of one dataset line up."""
    sets = {}
    for entry in filter(None, (e.strip() for e in (args.eval.dataset or "").split(","))):
        name = os.path.splitext(os.path.basename(entry.split("@")[0].rstrip("/")))[0]
        sets[name] = load_tasks(entry, None, args.eval.split, input_key=args.data.input_key,
                                label_key=args.data.label_key, needs_answer=needs_answer,
                                seed=args.train.seed)[: limit or None]
    return sets


def train_overlap(train_tasks: list, eval_tasks: list) -> list:
    """The ids of the eval tasks that are training problems too: the same text (case, spaces and `$` aside),
    or the same AIME problem, known by its AoPS URL or its year, part and number (rows of one problem differ
    in wording between files, and their ids are numbered per file, so ids alone say nothing)."""
    seen = set().union(*map(problem_keys, train_tasks))
    return [task["id"] for task in eval_tasks if problem_keys(task) & seen]


_AOPS = re.compile(r"(\d{4})_AIME_(?:(I{1,2})_)?Problems/Problem_(\d+)")


def problem_keys(task: dict) -> set:
    text = re.sub(r"[\s$]+", "", unicodedata.normalize("NFKC", str(task.get("prompt", ""))).lower())
    keys = {("text", text)}
    url = _AOPS.search(str(task.get("url") or ""))
    if url:
        keys.add(("aime", int(url[1]), url[2], int(url[3])))
    elif isinstance(task.get("year"), int) and isinstance(task.get("problem_number"), int):
        keys.add(("aime", task["year"], task.get("part"), task["problem_number"]))
    return keys


async def evaluate(topology, tasks: list, policies: dict, n_samples: int, workspace_root: str, step: int = 0,
                   progress=None, coach: Coach = None) -> list:
    """n_samples episodes per task, all at once; returns the episodes, task-major. progress: see rollout.
    coach: asked about every action, per action, for the authors' grader (coach_graded); None: no coach."""
    coach = coach or NoCoach()
    episodes = [t for t in tasks for _ in range(n_samples)]
    played = await rollout(topology, episodes, policies, coach, workspace_root, step, progress=progress)
    if not asks_answer(coach):
        return played
    # The authors ask once more where the final agent's verdict, shown the reference, states no ANSWER_CORRECT
    # (external_coach.py L415-450); only then does their grader fall back to the raw score (coach_graded). A
    # verdict from a hindsight review has no reply of its own to ask about.
    unanswered = []
    for ep in played:
        final = final_action(ep)
        if final is None or final.verdict is None or final.coach_request.get("ground_truth") is None:
            continue
        verdict = final.verdict
        if verdict.status == "ok" and verdict.source == "per_action" and verdict.answer_correct is None:
            unanswered.append(final)
    verdicts = await asyncio.gather(*(coach.reask_answer(a.verdict) for a in unanswered))
    for action, verdict in zip(unanswered, verdicts):
        action.verdict = verdict
    return played


def asks_answer(coach) -> bool:
    """Whether the coach's template asks for ANSWER_CORRECT (MathChat's does; DSBench's, relay's do not)."""
    return coach is not None and ANSWER_KEY in (coach.template or "")


def final_action(episode):
    """The final agent's last action, or None when it never acted."""
    return next((a for a in reversed(episode.actions) if a.coach_request.get("is_final_agent")), None)


def coach_cost(episodes: list, price_in: float = 0.0, price_out: float = 0.0) -> dict:
    """The grading coach's requests, tokens, failed fraction and cost (with prices, USD per 1M tokens) over an
    evaluation's episodes: its summary's coach/ keys; {} when no coach was asked."""
    m = coach_step_metrics(episodes, price_in, price_out)
    if not m["coach/requests"]:
        return {}
    keys = (
        "coach/requests",
        "coach/failure_fraction",
        "coach/tokens_in",
        "coach/tokens_out",
        "coach/cost_usd",
    )
    return {k: m[k] for k in keys if k in m}


def coach_graded(episode, answer_asked: bool = True) -> tuple:
    """(accuracy, how) of one episode by the authors' grader (multi_agent_world_async.evaluate_samples, with
    mathchat_workflow_with_coach.py and coach_utils.py): the coach's ANSWER_CORRECT (1/0) on the final agent's
    last action; where its reply has none even when asked again (evaluate), that verdict's raw 0-10 score (so
    their mean can pass 1); 0.0 when the final agent never acted. None when the coach gave no verdict there
    (it failed, or none was asked): left out of the mean and counted, never an invented grade (their coach
    never fails: it falls back to 5.0). `answer_asked` False (a coach template without ANSWER_CORRECT, as
    DSBench's): the raw score is the grade by design ("score"), no fallback."""
    final = final_action(episode)
    if final is None:
        return 0.0, "no_final_action"
    verdict = final.verdict
    if verdict is None or verdict.status != "ok":
        return None, "ungraded"
    if verdict.answer_correct is not None:
        return float(verdict.answer_correct), "answer_correct"
    return verdict.score, "score_fallback" if answer_asked else "score"


GRADED_BY = ("answer_correct", "score_fallback", "score", "no_final_action", "ungraded")
AUTHORS_FIGURES = ("accuracy", "f1", "roc_auc", "rmse", "mae", "mse")  # DSBench's, pooled as the authors'


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def summarize(episodes: list, agent_names: list, tasks: list, answer_asked: bool = True) -> tuple:
    """(summary, problems). accuracy: the mean over problems of pass@1 (mean success over its samples).
    DSBench outcomes add relative_score (an invalid submission counts 0, as DSBench's paper), each task
    metric's mean over valid submissions, and success rate and relative score per task type. Where a coach
    graded the episodes, accuracy_coach is the same mean by the authors' grader (coach_graded; `answer_asked`:
    the coach's template asks for ANSWER_CORRECT), with accuracy_coach/<how> counts."""
    by_task = {}
    for ep in episodes:
        by_task.setdefault(ep.task_id, []).append(ep)
    # A coach graded this evaluation (not NoCoach): some verdict is not `skipped`.
    graded = any(a.verdict and a.verdict.status != "skipped" for ep in episodes for a in ep.actions)
    problems = []
    for task in tasks:
        samples = by_task.get(task["id"], [])
        problems.append({"id": task["id"], "type": task.get("type", ""), "reference": task["answer"],
                         "pass1": _mean([float(ep.success) for ep in samples]),
                         "samples": [ep.outcome for ep in samples]})
        if graded:
            problems[-1]["pass1_coach"] = _mean([coach_graded(ep, answer_asked)[0] for ep in samples])
    outcomes = [ep.outcome for ep in episodes]
    summary = {"accuracy": _mean([p["pass1"] for p in problems]), "n_problems": len(problems),
               "n_samples": len(episodes) // max(1, len(problems))}
    if graded:  # the authors' grader, beside the environment's; how each episode was graded, counted
        summary["accuracy_coach"] = _mean([p["pass1_coach"] for p in problems])
        hows = [coach_graded(ep, answer_asked)[1] for ep in episodes]
        summary.update({f"accuracy_coach/{how}": hows.count(how) for how in GRADED_BY})
    if any("answered" in o for o in outcomes):
        summary["answered_rate"] = _mean([float(bool(o.get("answered"))) for o in outcomes])
    # Failures, counted where there are any: episodes stopped by a limit (rollout.run_episode), and episodes
    # ended by an exception in the environment.
    if action_limited := sum(bool(ep.action_limit) for ep in episodes):
        summary["action_limit_episodes"] = action_limited
    if env_failed := sum(bool(ep.env_error) for ep in episodes):
        summary["env_failed_episodes"] = env_failed
    if any("relative_score" in o for o in outcomes):
        summary["relative_score"] = _mean([o.get("relative_score") or 0.0 for o in outcomes])
        for metric in sorted({o["metric_name"] for o in outcomes if o.get("metric_name")}):
            summary[f"metric/{metric}"] = _mean(
                [o["metric"] for o in outcomes if o.get("metric_name") == metric]
            )
        for task_type in sorted({ep.task_type for ep in episodes if ep.task_type}):
            typed = [ep for ep in episodes if ep.task_type == task_type]
            summary[f"{task_type}/success_rate"] = _mean([float(ep.success) for ep in typed])
            summary[f"{task_type}/relative_score"] = _mean(
                [ep.outcome.get("relative_score") or 0.0 for ep in typed]
            )
    if any("authors_figures" in o for o in outcomes):
        # DSBench as the authors' evaluate_samples reads it (multi_agent_world_async.py L385-388, L437-457):
        # an episode is scored when its predictions can be read (envs/dsbench.py authors_predictions),
        # whatever their rows or columns; each figure the mean over the scored episodes that have it, pooled
        # across tasks, with its count (their avg_*, count_*).
        scored = [o["authors_figures"] for o in outcomes if o.get("authors_figures") is not None]
        summary["authors/scored_rate"] = len(scored) / len(outcomes)
        for name in AUTHORS_FIGURES:
            values = [f[name] for f in scored if name in f]
            if values:
                summary[f"authors/{name}"] = statistics.fmean(values)
                summary[f"authors/count_{name}"] = len(values)
    # Here, not at the top: run_log loads torch, and the flag checks import this module before torch is due.
    from openrlhf_mappa.run_log import behaviour_metrics

    summary.update(behaviour_metrics(episodes, agent_names))
    return summary, problems


def format_table(results: dict) -> str:
    """One row per dataset: its headline numbers, then every agent's behaviour (a terminal table)."""
    lines = []
    for dataset, summary in results.items():
        head = (f"{k} {_fmt(v)}" for k, v in summary.items() if not k.startswith("agent/"))
        lines.append(f"{dataset}: " + ", ".join(head))
        agents = sorted({k.split("/")[1] for k in summary if k.startswith("agent/")})
        keys = sorted({k.split("/", 2)[2] for k in summary if k.startswith("agent/")})
        width = max(map(len, agents), default=5)
        lines.append("  " + "agent".ljust(width) + "".join(f" {k:>18}" for k in keys))
        for a in agents:  # a column is as wide as its name (a name longer than 18 is printed whole)
            cells = [f" {_fmt(summary.get(f'agent/{a}/{k}')):>{max(18, len(k))}}" for k in keys]
            lines.append("  " + a.ljust(width) + "".join(cells))
    return "\n".join(lines)


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)
