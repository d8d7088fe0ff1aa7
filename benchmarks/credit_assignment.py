"""Does per-action credit make a team learn faster? Trains two tiny agents from scratch through the real MAPPA
trainer (Ray + vLLM + DeepSpeed ZeRO-3 on CPU, heuristic coach), once with per-action process rewards
(`--mappa.reward process`) and once with the episode's outcome for every action (`--mappa.reward outcome`),
on the same seeds, tasks, batches and step budget, and prints how many steps each needs to reach a success
threshold, and the ratio outcome/process. Goal: outcome-only needs at least 2x the steps.

The task is a chain in which credit assignment matters: the upstream agent must write a digit, then the
downstream agent (which sees the upstream reply) must write a lowercase letter; the episode succeeds only if
both did, so the downstream agent cannot repair an upstream mistake. The coach judges each agent's own reply
against its own goal (the heuristic coach's pattern rule); the outcome baseline pays every action the joint
result, so each agent's good replies go unrewarded whenever the other agent failed. A random-init byte-level
tiny model writes a digit in ~13% and a lowercase letter in ~31% of its 4-token replies.

Success is smoothed by a trailing mean over --window steps; a run's "steps to threshold" is the first step
whose trailing mean reaches --threshold. A run stops as soon as that happens (the rest of the run cannot
change the first crossing); otherwise it runs the whole budget of --steps and counts as "not reached".

Per run: 2 agents x (1 ZeRO-3 actor + 1 vLLM engine), no reference model (KL 0), 8 tasks x 2 samples = 16
episodes per step, one optimizer step per agent per step, 4-token replies, constant lr 3e-3. Outputs:
<out>/<mode>-seed<S>/ (the run's train.log and metrics.jsonl) and <out>/summary.json.

    PYTHONPATH=. .venv/bin/python benchmarks/credit_assignment.py --quick     # 1 seed, 40-step budget
    PYTHONPATH=. .venv/bin/python benchmarks/credit_assignment.py             # 3 seeds, 60-step budget
"""

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from typing import Optional

import yaml

from openrlhf_mappa.coach.heuristic import PATTERN_PREFIX
from openrlhf_mappa.envs.base import MultiAgentEnv

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
GOALS = {"upstream": r"\d", "downstream": r"[a-z]"}  # agent -> regex its own reply must contain
MODES = ("process", "outcome")


class ChainEnv(MultiAgentEnv):
    """Each agent acts once; success = every agent's reply matches its own pattern (env_kwargs `goals`).
    The coach gets the agent's own pattern as ground truth, so it can judge each action on its own."""

    task_type = "chain"

    def __init__(self, topology, task, workspace, goals: dict, **kwargs):
        super().__init__(topology, task, workspace, **kwargs)
        self.goals = goals

    def coach_ground_truth(self, agent) -> str:
        return PATTERN_PREFIX + self.goals[agent.name]

    def outcome(self) -> dict:
        replies = {entry.agent: entry.response for entry in self.history}
        hits = {agent: bool(re.search(goal, replies.get(agent, ""))) for agent, goal in self.goals.items()}
        return {"success": all(hits.values()), **{f"{agent}_hit": hit for agent, hit in hits.items()}}


def steps_to_threshold(success_rates: list, threshold: float, window: int) -> Optional[int]:
    """The first step (1-based) whose trailing mean over the last `window` steps reaches `threshold`, or None.
    Steps before the window is full never count, so one lucky early batch cannot end a run."""
    for step in range(window, len(success_rates) + 1):
        if statistics.fmean(success_rates[step - window : step]) >= threshold:
            return step
    return None


def write_setup(out: str, seed: int, num_tasks: int) -> tuple:
    """Per seed: one tiny model per agent (its own weights), the topology and the tasks; returns their paths."""
    agents = []
    for i, name in enumerate(GOALS):
        model = os.path.join(out, "models", f"seed{seed}", name)
        if not os.path.exists(os.path.join(model, "config.json")):
            mappa = os.path.join(os.path.dirname(sys.executable), "mappa")
            subprocess.run([mappa, "tiny-model", model, "--seed", str(2 * seed + i)], check=True, capture_output=True)
        agents.append({"name": name, "model": model, "max_actions": 1})
    agents[0].update(role="Upstream agent: writes a number for the next agent.", prompt="{task}\nWrite a number.")
    agents[1].update(role="Downstream agent: writes a word after the upstream agent's number.",
                     prompt="{task}\nUpstream wrote:\n{history}\nWrite a word.")  # fmt: skip
    topology = {
        "name": "credit-chain",
        "env": "credit_assignment:ChainEnv",
        "env_kwargs": {"goals": GOALS},
        "agents": agents,
        # Read only by an LLM coach; the heuristic coach checks the pattern it is given as ground truth.
        "coach_template": "Agent {agent} ({role}) was given:\n{agent_input}\nIt replied:\n{agent_output}\n"
        "Its reply must contain a match of this pattern: {ground_truth}\n"
        "Reply PROCESS_SCORE: 10 if it does, else PROCESS_SCORE: 0.",
    }
    topology_path = os.path.join(out, f"topology-seed{seed}.yaml")
    with open(topology_path, "w") as f:
        yaml.safe_dump(topology, f)
    tasks_path = os.path.join(out, "tasks.jsonl")
    with open(tasks_path, "w") as f:
        for i in range(num_tasks):
            f.write(json.dumps({"id": i, "prompt": f"Request {i}.", "answer": "-"}) + "\n")
    return topology_path, tasks_path


def read_metrics(metrics_path: str) -> list:
    """The complete lines of a run's metrics.jsonl so far (one dict per step)."""
    if not os.path.exists(metrics_path):
        return []
    rows = []
    with open(metrics_path) as f:
        for line in f:
            if line.endswith("\n"):  # a line being written is read on the next poll
                rows.append(json.loads(line))
    return rows


def train(out: str, mode: str, seed: int, a) -> dict:
    """One real training run in a subprocess (train_mappa_ray); stops it once the threshold is reached."""
    topology, tasks = write_setup(out, seed, a.tasks_per_step)
    run = os.path.join(out, f"{mode}-seed{seed}")
    subprocess.run(["rm", "-rf", run], check=True)
    os.makedirs(run)
    cmd = [
        sys.executable, "-m", "openrlhf_mappa.cli.train_mappa_ray",
        "--mappa.topology", topology, "--mappa.reward", mode, "--mappa.coach.kind", "heuristic",
        "--mappa.run_dir", os.path.join(run, "run"), "--data.prompt_dataset", tasks,
        "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1", "--vllm.sync_backend", "gloo",
        "--vllm.enforce_eager", "--vllm.gpu_memory_utilization", "0.2",
        "--ds.zero_stage", "3", "--ds.attn_implementation", "sdpa", "--algo.kl.init_coef", "0",
        "--actor.adam.lr", str(a.lr), "--actor.lr_warmup_ratio", "0", "--actor.lr_scheduler", "constant",
        "--rollout.batch_size", str(a.tasks_per_step), "--rollout.n_samples_per_prompt", "2",
        "--rollout.micro_batch_size", str(2 * a.tasks_per_step), "--rollout.max_new_tokens", "4",
        "--data.max_len", "256", "--train.batch_size", str(2 * a.tasks_per_step),
        "--train.micro_batch_size", str(2 * a.tasks_per_step), "--train.num_episodes", str(a.steps),
        "--train.seed", str(seed), "--ckpt.path", os.path.join(run, "ckpt"), "--ckpt.output_dir", os.path.join(run, "final"),
    ]  # fmt: skip
    # Two agents x (actor + engine) on a fresh local Ray cluster; the env module is importable from BENCH.
    env = dict(os.environ, MAPPA_CPU_NUM_GPUS="4", VLLM_CPU_KVCACHE_SPACE="1",
               PYTHONPATH=os.pathsep.join(p for p in (BENCH, REPO, os.environ.get("PYTHONPATH")) if p))  # fmt: skip
    env.pop("RAY_ADDRESS", None)
    metrics_path = os.path.join(run, "run", "metrics.jsonl")
    t0, stopped = time.time(), False
    with open(os.path.join(run, "train.log"), "w") as log:
        # A shell starts background jobs with SIGINT ignored, and the child would inherit that (nohup runs).
        proc = subprocess.Popen(cmd, cwd=run, env=env, stdout=log, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
        while proc.poll() is None:
            time.sleep(2)
            success = [m["outcome/success_rate"] for m in read_metrics(metrics_path)]
            if steps_to_threshold(success, a.threshold, a.window) is not None:
                # SIGINT is Ctrl-C: the driver unwinds and Ray tears its local cluster down.
                proc.send_signal(signal.SIGINT)
                stopped = True
                try:
                    proc.wait(timeout=120)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    wall = time.time() - t0
    metrics = read_metrics(metrics_path)
    if not stopped and (proc.returncode != 0 or len(metrics) < a.steps):
        raise SystemExit(f"{mode} seed {seed}: the training run failed (exit {proc.returncode}); see {run}/train.log")
    success = [m["outcome/success_rate"] for m in metrics]
    return {
        "mode": mode, "seed": seed, "steps_run": len(success), "wall_s": round(wall, 1),
        "steps_to_threshold": steps_to_threshold(success, a.threshold, a.window),
        "median_step_s": round(statistics.median(m["time/step"] for m in metrics), 2),
        "success_rate": success,
        "coach_score": {agent: [m[f"agent/{agent}/coach_score"] for m in metrics] for agent in GOALS},
    }  # fmt: skip


def mean_steps(runs: list, steps: int) -> tuple:
    """Mean steps to threshold, a run that never got there counted as the budget; True if that made it a bound."""
    values = [r["steps_to_threshold"] or steps for r in runs]
    return statistics.fmean(values), any(r["steps_to_threshold"] is None for r in runs)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1 seed and a 40-step budget")
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--steps", type=int, default=60, help="step budget of every run")
    p.add_argument("--threshold", type=float, default=0.8, help="success rate to reach (trailing mean)")
    p.add_argument("--window", type=int, default=3, help="steps in the trailing mean")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--tasks-per-step", type=int, default=8, help="tasks per step; each is played twice")
    p.add_argument("--out", default=os.path.join(REPO, "runs", "bench-credit"))
    a = p.parse_args()
    if a.quick:
        a.seeds, a.steps = 1, 40
    a.out = os.path.abspath(a.out)  # each training run works in its own directory
    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    runs = []
    for seed in range(a.seeds):
        for mode in MODES:
            runs.append(train(a.out, mode, seed, a))
            r = runs[-1]
            print(f"[credit] {mode} seed {seed}: steps to threshold {r['steps_to_threshold']}, "
                  f"{r['steps_run']} steps in {r['wall_s']:.0f} s", flush=True)  # fmt: skip

    print(f"\nsteps to a success rate >= {a.threshold:g} (trailing mean of {a.window} steps), budget {a.steps} steps, "
          f"{2 * a.tasks_per_step} episodes per step")  # fmt: skip
    print(f"{'mode':<8} {'seed':>4}  {'steps to threshold':<22} {'last success':>12} {'step s':>7} {'run s':>6}")
    for r in runs:
        reached = r["steps_to_threshold"] or f"not reached in {a.steps}"
        print(f"{r['mode']:<8} {r['seed']:>4}  {reached!s:<22} {r['success_rate'][-1]:>12.2f} "
              f"{r['median_step_s']:>7.2f} {r['wall_s']:>6.0f}")  # fmt: skip
    means = {mode: mean_steps([r for r in runs if r["mode"] == mode], a.steps) for mode in MODES}
    for mode, (mean, bound) in means.items():
        print(f"mean steps, {mode}: {'>= ' if bound else ''}{mean:.1f}")
    (process, process_bound), (outcome, outcome_bound) = means["process"], means["outcome"]
    if process_bound:
        ratio = "n/a (process rewards did not reach the threshold in every seed)"
    else:
        ratio = f"{'>= ' if outcome_bound else ''}{outcome / process:.2f}"
    print(f"ratio outcome/process (goal >= 2): {ratio}")
    print(f"total wall time: {(time.time() - t0) / 60:.1f} min")

    summary = {
        "config": {k: v for k, v in vars(a).items() if k != "out"} | {"goals": GOALS, "episodes_per_step": 2 * a.tasks_per_step},
        "mean_steps": {mode: {"mean": m, "lower_bound": b} for mode, (m, b) in means.items()},
        "ratio_outcome_over_process": ratio,
        "wall_min": round((time.time() - t0) / 60, 1),
        "runs": runs,
    }  # fmt: skip
    with open(os.path.join(a.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"summary: {os.path.join(a.out, 'summary.json')}")


if __name__ == "__main__":
    main()
