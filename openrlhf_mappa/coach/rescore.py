"""Re-score saved episodes with another coach or template, and say how the two coaches agree.

`mappa coach score --episodes runs/x/episodes.jsonl --out rescored.jsonl --model M --base-url U` reads every
action of every episode, asks the new coach about it with the exact context the first coach saw (stored
with the action), and writes one line per action with both verdicts. The agreement summary (per agent:
Pearson correlation and mean difference of the scores both coaches gave) is printed and written next to
the output as <out>.summary.json.
"""

import asyncio
import json
import statistics

from openrlhf_mappa.coach import Coach, CoachRequest
from openrlhf_mappa.coach.audit import pearson
from openrlhf_mappa.episode import read_jsonl


def read_actions(path: str) -> list:
    """(episode, action) dicts from an episodes.jsonl. A cut-off last line (a run killed mid-write) is
    skipped with a warning; a broken line anywhere else is an error naming its line."""
    out = []
    for lineno, episode in read_jsonl(path):
        for action in episode.get("actions", []):
            if not action.get("coach_request"):
                raise ValueError(f"{path}: line {lineno}: action without 'coach_request' (written by an older version?)")
            out.append((episode, action))
    return out


async def rescore(actions: list, coach: Coach) -> list:
    from tqdm import tqdm

    async def one(episode, action):
        request = CoachRequest(
            episode["episode_id"], action["agent"], action["turn"],
            agent_input=action["prompt_text"], agent_output=action["response_text"], **action["coach_request"],
        )
        return await coach.score(request)

    tasks = [asyncio.ensure_future(one(ep, a)) for ep, a in actions]
    with tqdm(total=len(tasks), desc=f"re-scoring with {coach.name}") as bar:
        for done in asyncio.as_completed(tasks):
            await done
            bar.update()
    return [t.result() for t in tasks]


def agreement(rows: list) -> dict:
    """Per agent and overall: pairs where both coaches gave a score, their correlation and mean difference."""
    summary = {}
    for agent in sorted({r["agent"] for r in rows}) + ["all"]:
        mine = [r for r in rows if agent in ("all", r["agent"])]
        pairs = [(r["before"]["score"], r["after"]["score"]) for r in mine
                 if r["before"] and r["before"]["score"] is not None and r["after"]["score"] is not None]
        statuses = {}
        for r in mine:
            statuses[r["after"]["status"]] = statuses.get(r["after"]["status"], 0) + 1
        summary[agent] = {
            "actions": len(mine),
            "both_scored": len(pairs),
            "pearson": pearson(*zip(*pairs)) if len(pairs) > 1 else None,
            "mean_before": statistics.fmean(b for b, _ in pairs) if pairs else None,
            "mean_after": statistics.fmean(a for _, a in pairs) if pairs else None,
            "mean_diff_after_minus_before": statistics.fmean(a - b for b, a in pairs) if pairs else None,
            "after_statuses": statuses,
        }
    return summary


def run(actions: list, out_path: str, coach: Coach) -> tuple:
    """Re-score `actions` (from read_actions), write both verdicts per action and the summary; return both
    (the rows as written, the summary)."""
    import dataclasses

    async def go():
        try:
            return await rescore(actions, coach)
        finally:
            await coach.aclose()

    verdicts = asyncio.run(go())
    rows = [
        {
            "episode_id": ep["episode_id"], "agent": a["agent"], "turn": a["turn"], "task_type": ep.get("task_type", ""),
            "success": bool(ep.get("outcome", {}).get("success")), "before": a.get("verdict"),
            "after": dataclasses.asdict(v),
        }
        for (ep, a), v in zip(actions, verdicts)
    ]
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
    print(f"{'agent':<20} {'actions':>7} {'scored':>6} {'pearson':>8} {'before':>7} {'after':>7} {'diff':>7}  after statuses")
    for agent, s in summary.items():
        print(f"{agent:<20} {s['actions']:>7} {s['both_scored']:>6} {fmt(s['pearson']):>8} {fmt(s['mean_before']):>7} "
              f"{fmt(s['mean_after']):>7} {fmt(s['mean_diff_after_minus_before']):>7}  {s['after_statuses']}")
