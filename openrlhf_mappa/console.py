"""The user's terminal and the run's summaries printed there: one line per step, a few at the end of a run."""

import os
import sys
import types

from openrlhf_mappa.episode import read_jsonl


# Where the run's own output goes (step lines, progress bars, tables; messages to `err` with tqdm.write, above
# the bars). Without --mappa.verbose, train_mappa_ray.output_to sends the process's stdout and stderr (Ray's,
# vLLM's and DeepSpeed's) to a log file and points these at copies of the terminal's.
console = types.SimpleNamespace(out=sys.stdout, err=sys.stderr)


def step_line(step: int, total: int, metrics: dict, agents: list) -> str:
    """One step on one line, as OpenRLHF logs its steps: success rate, each agent's mean coach score, the
    agents' mean KL and policy loss, and the phase timings. A value missing that step is printed as '-'."""

    def num(v, spec):
        return "-" if v is None else format(v, spec)

    def mean(key):
        values = [metrics[f"agent/{a}/{key}"] for a in agents if metrics.get(f"agent/{a}/{key}") is not None]
        return sum(values) / len(values) if values else None

    coach = ", ".join(f"{a} {num(metrics.get(f'agent/{a}/coach_score'), '.2f')}" for a in agents)
    phases = ", ".join(f"{k} {num(metrics.get('timing/' + k), '.1f')}s"
                       for k in ("rollout", "experience", "train", "sync", "step"))
    return (
        f"[mappa] step {step}/{total} | success {num(metrics.get('outcome/success_rate'), '.3f')} | "
        f"coach {coach} | kl {num(mean('kl'), '.3g')} | loss {num(mean('policy_loss'), '.3g')} | {phases}"
    )


def run_summary(run_dir: str) -> list:
    """The end of a run in a few lines, from its metrics.jsonl and eval.jsonl: steps and time, the success
    rate of the first and last 3 steps, each agent's coach score then and now, and every evaluation set's
    accuracy at its first and last evaluation."""
    metrics, evals = (
        [r for _, r in read_jsonl(path)] if os.path.exists(path) else []
        for path in (os.path.join(run_dir, "metrics.jsonl"), os.path.join(run_dir, "eval.jsonl"))
    )
    if not metrics:
        return ["[mappa] no step finished"]

    def mean(rows, key):
        values = [r[key] for r in rows if r.get(key) is not None]
        return f"{sum(values) / len(values):.3f}" if values else "-"

    first, last = metrics[:3], metrics[-3:]
    seconds = sum(r.get("timing/step") or 0.0 for r in metrics)
    lines = [f"[mappa] {len(metrics)} steps ({seconds / 60:.1f} min of training steps); "
             f"success rate {mean(first, 'outcome/success_rate')} (first 3 steps) -> "
             f"{mean(last, 'outcome/success_rate')} (last 3)"]
    agents = list(dict.fromkeys(k.split("/")[1] for r in metrics for k in r
                                if k.startswith("agent/") and k.endswith("/coach_score")))
    if agents:
        scores = ", ".join(
            f"{a} {mean(first, f'agent/{a}/coach_score')} -> {mean(last, f'agent/{a}/coach_score')}"
            for a in agents
        )
        lines.append(f"[mappa] coach score (first 3 -> last 3 steps): {scores}")
    by_dataset = {}
    for r in evals:
        by_dataset.setdefault(r.get("dataset"), []).append(r)
    for dataset, rows in by_dataset.items():
        a, b = rows[0], rows[-1]
        lines.append(f"[mappa] evaluation {dataset}: accuracy {mean([a], 'accuracy')} (step {a['step']}) -> "
                     f"{mean([b], 'accuracy')} (step {b['step']})")
    return lines
