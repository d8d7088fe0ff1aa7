"""`mappa coach score`: re-score saved episodes with another coach or template, and say how the two agree.

Every action of an episodes.jsonl is asked of the new coach with the exact context the first coach saw (stored
with the action); one line per action holds both verdicts. The agreement summary (per agent: Pearson
correlation and mean difference) is printed and written as <out>.summary.json. `--mode hindsight` asks one
review per episode instead (coach.judge_episode), `--mode both` both, combined as in training.
"""

import asyncio
import json
import statistics
from collections import Counter

from openrlhf_mappa.coach.base import Coach, CoachRequest, judge_episode
from openrlhf_mappa.coach.audit import pearson
from openrlhf_mappa.episode import read_jsonl


def read_actions(path: str) -> list:
    """(episode, action) dicts from an episodes.jsonl. A cut-off last line (a run killed mid-write) is
    skipped with a warning; a broken line anywhere else is an error naming its line."""
    out = []
    for lineno, episode in read_jsonl(path):
        for action in episode.get("actions", []):
            if not isinstance(action, dict) or not action.get("coach_request"):
                raise ValueError(f"{path}: line {lineno}: action without 'coach_request' (written by an "
                                 "older version?)")
            missing = [k for k in ("agent", "turn", "prompt_text", "response_text") if k not in action]
            if "episode_id" not in episode or missing:
                raise ValueError(f"{path}: line {lineno}: not an episode of a run's episodes.jsonl (no "
                                 f"{', '.join(missing or ['episode_id'])})")
            out.append((episode, action))
    return out


async def rescore(actions: list, coach: Coach, mode: str = "per_action") -> tuple:
    """(verdicts, reviews): each action's new verdict under `mode`, and per action its episode's review (None
    in mode per_action). Actions of one episode are judged together, in order."""
    from tqdm import tqdm

    by_episode = {}
    for i, (episode, _) in enumerate(actions):
        by_episode.setdefault(episode["episode_id"], []).append(i)
    verdicts, reviews = [None] * len(actions), [None] * len(actions)

    async def one(indices):
        episode = actions[indices[0]][0]
        requests = []
        for a in (actions[i][1] for i in indices):
            # Records written before the coach_request kept the agent's input: the coach saw the templated
            # prompt.
            context = {"agent_input": a["prompt_text"], **a["coach_request"]}
            requests.append(CoachRequest(episode["episode_id"], a["agent"], a["turn"],
                                         agent_output=a["response_text"], **context))
        pending = [asyncio.ensure_future(coach.score(r)) for r in requests] if mode != "hindsight" else []
        judged, _, review = await judge_episode(coach, mode, requests, episode.get("outcome", {}), pending)
        for i, verdict in zip(indices, judged):
            verdicts[i], reviews[i] = verdict, review

    tasks = [asyncio.ensure_future(one(indices)) for indices in by_episode.values()]
    with tqdm(total=len(tasks), desc=f"re-scoring episodes with {coach.name} ({mode})") as bar:
        for done in asyncio.as_completed(tasks):
            await done
            bar.update()
    return verdicts, reviews


def agreement(rows: list) -> dict:
    """Per agent and overall: pairs where both coaches gave a score, their correlation and mean difference."""
    summary = {}
    for agent in sorted({r["agent"] for r in rows}) + ["all"]:
        mine = [r for r in rows if agent in ("all", r["agent"])]
        pairs = [(r["before"]["score"], r["after"]["score"]) for r in mine
                 if r["before"] and r["before"]["score"] is not None and r["after"]["score"] is not None]
        summary[agent] = {
            "actions": len(mine),
            "both_scored": len(pairs),
            "pearson": pearson(pairs),
            "mean_before": statistics.fmean(b for b, _ in pairs) if pairs else None,
            "mean_after": statistics.fmean(a for _, a in pairs) if pairs else None,
            "mean_diff_after_minus_before": statistics.fmean(a - b for b, a in pairs) if pairs else None,
            "after_statuses": dict(Counter(r["after"]["status"] for r in mine)),
        }
    return summary


def run(actions: list, out_path: str, coach: Coach, mode: str = "per_action") -> tuple:
    """Re-score `actions` (from read_actions), write the rows (both verdicts per action) and the summary;
    return both. In modes hindsight and both a row says whether the review held the action responsible (None:
    failed)."""
    import dataclasses

    async def go():
        try:
            return await rescore(actions, coach, mode)
        finally:
            await coach.aclose()

    verdicts, reviews = asyncio.run(go())
    rows = []
    position = {}  # episode id -> index of the next action in it
    for (ep, a), v, review in zip(actions, verdicts, reviews):
        k = position[ep["episode_id"]] = position.get(ep["episode_id"], -1) + 1
        row = {"episode_id": ep["episode_id"], "agent": a["agent"], "turn": a["turn"],
               "task_type": ep.get("task_type", ""), "success": bool(ep.get("outcome", {}).get("success")),
               "before": a.get("verdict"), "after": dataclasses.asdict(v)}
        if mode != "per_action":
            row["responsible"] = (None if review is None or review.responsible is None
                                  else review.responsible == k)
        rows.append(row)
    with open(out_path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    summary = agreement(rows)
    with open(out_path + ".summary.json", "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    return rows, summary


def print_summary(summary: dict, before: str, after: str):
    def fmt(x):
        return "-" if x is None else f"{x:.3f}"

    print(f"\nagreement of {after} (after) with {before} (before):")
    print(f"{'agent':<20} {'actions':>7} {'scored':>6} {'pearson':>8} {'before':>7} {'after':>7} "
          f"{'diff':>7}  after statuses")
    for agent, s in summary.items():
        print(f"{agent:<20} {s['actions']:>7} {s['both_scored']:>6} {fmt(s['pearson']):>8} "
              f"{fmt(s['mean_before']):>7} {fmt(s['mean_after']):>7} "
              f"{fmt(s['mean_diff_after_minus_before']):>7}  {s['after_statuses']}")
