"""Does per-action credit make a team learn faster? Trains a chain of tiny agents from scratch through the real
MAPPA trainer (Ray + vLLM + DeepSpeed ZeRO-3 on CPU, heuristic coach) in three modes: per-action process
rewards (`process`: `--mappa.reward process`, one coach request per action), the episode's outcome for every
action (`outcome`: `--mappa.reward outcome`, no coach request), and hindsight process rewards (`hindsight`:
`--mappa.coach.mode hindsight`, one coach request per finished episode that scores all its actions), on the
same seeds, tasks, batches and step budget. It prints how many steps each needs to reach a success threshold,
the coach requests per step, and the ratios to `process`. Goals: outcome-only needs at least 2x the steps of
process on the 3-agent chain; hindsight at most 1.1x the steps of process with at most 1/3 of its requests.

The task is a chain in which credit assignment matters: with --chain 2, the upstream agent must write a digit,
then the downstream agent (which sees the upstream reply) must write a lowercase letter; --chain 3 puts a
middle agent between them that must write an uppercase letter. The episode succeeds only if every agent did,
so no agent can repair an earlier mistake. The coach judges each agent's own reply against its own goal (the
environment's pattern rule, `ChainEnv.judge`, which the heuristic coach takes; in hindsight mode the same rule
over the whole episode, which also names the first action that broke its goal); the outcome baseline pays every
action the joint result, so each agent's good replies go unrewarded whenever another agent failed. A random-init
byte-level tiny model writes a digit in ~13% and a lowercase letter in ~31% of its 4-token replies.

Success is smoothed by a trailing mean over --window steps; a run's "steps to threshold" is the first step
whose trailing mean reaches --threshold. A run stops as soon as that happens (the rest of the run cannot
change the first crossing); otherwise it runs the whole budget of --steps and counts as "not reached".

Per run: per agent 1 ZeRO-3 actor + 1 vLLM engine, no reference model (KL 0), 8 tasks x 2 samples = 16
episodes per step, one optimizer step per agent per step, 4-token replies (cut off at the limit, they train all
the same: --mappa.train_truncated), constant lr 3e-3. Outputs:
<out>/chain<N>/<mode>-seed<S>/ (the run's train.log, metrics.jsonl and result.json) and
<out>/chain<N>/summary.json. The table covers every result.json under <out>/chain<N>, so runs made by
separate invocations (one training run each, e.g. each under its own lock) add up to one table.

    PYTHONPATH=. .venv/bin/python benchmarks/credit_assignment.py --quick     # 1 seed, 40-step budget
    PYTHONPATH=. .venv/bin/python benchmarks/credit_assignment.py             # 3 seeds, 60-step budget
    PYTHONPATH=. .venv/bin/python benchmarks/credit_assignment.py --chain 3 --modes hindsight --seed 1   # one run
    PYTHONPATH=. .venv/bin/python benchmarks/credit_assignment.py --chain 3 --modes none    # the table only
"""

import argparse
import glob
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

from openrlhf_mappa.envs.base import MultiAgentEnv

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
# Per chain length: agent -> regex its own reply must contain, in the order they act.
CHAINS = {2: {"upstream": r"\d", "downstream": r"[a-z]"},
          3: {"upstream": r"\d", "middle": r"[A-Z]", "downstream": r"[a-z]"}}  # fmt: skip
GOALS = CHAINS[2]
MODES = ("process", "outcome", "hindsight")
FLAGS = {"process": ["--mappa.reward", "process"], "outcome": ["--mappa.reward", "outcome"],
         "hindsight": ["--mappa.reward", "process", "--mappa.coach.mode", "hindsight"]}  # fmt: skip


class ChainEnv(MultiAgentEnv):
    """Each agent acts once; success = every agent's reply matches its own pattern (env_kwargs `goals`).
    Each action is graded against its own agent's pattern, so the coach can judge each action on its own."""

    task_type = "chain"

    def __init__(self, topology, task, workspace, goals: dict, **kwargs):
        super().__init__(topology, task, workspace, **kwargs)
        self.goals = goals

    def coach_ground_truth(self, agent) -> str:
        return self.goals[agent.name]

    def judge(self, agent, response, feedback, truncated_at) -> tuple:
        """The pattern rule: 10 if the reply contains a match of the agent's pattern, else 0."""
        pattern = self.goals[agent.name]
        if re.search(pattern, response):
            return 10.0, f"pattern rule: the output matches {pattern!r}", False
        return 0.0, f"pattern rule: the output does not match {pattern!r}", True

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


def write_setup(out: str, seed: int, goals: dict, num_tasks: int) -> tuple:
    """Per seed: one tiny model per agent (its own weights), the topology and the tasks; returns their paths."""
    agents = []
    for i, name in enumerate(goals):
        model = os.path.join(out, "models", f"seed{seed}", name)
        if not os.path.exists(os.path.join(model, "config.json")):
            mappa = os.path.join(os.path.dirname(sys.executable), "mappa")
            tiny_seed = str(len(goals) * seed + i)
            subprocess.run([mappa, "tiny-model", model, "--seed", tiny_seed], check=True, capture_output=True)
        agents.append({"name": name, "model": model, "max_actions": 1})
    agents[0].update(role="Upstream agent: writes a number for the next agent.", prompt="{task}\nWrite a number.")
    if len(goals) == 3:
        agents[1].update(role="Middle agent: writes a name after the upstream agent's number.",
                         prompt="{task}\nUpstream wrote:\n{history}\nWrite a name.")  # fmt: skip
    agents[-1].update(role="Downstream agent: writes a word after the earlier agents' replies.",
                      prompt="{task}\nUpstream wrote:\n{history}\nWrite a word.")  # fmt: skip
    topology = {
        "name": "credit-chain",
        "env": "credit_assignment:ChainEnv",
        "env_kwargs": {"goals": goals},
        "agents": agents,
        # Read only by an LLM coach; the heuristic coach takes the environment's grade (ChainEnv.judge).
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
    """One real training run in a subprocess (train_mappa_ray); stops it once the threshold is reached. Its
    result goes to <run>/result.json as well."""
    goals = CHAINS[a.chain]
    topology, tasks = write_setup(out, seed, goals, a.tasks_per_step)
    run = os.path.join(out, f"{mode}-seed{seed}")
    subprocess.run(["rm", "-rf", run], check=True)
    os.makedirs(run)
    cmd = [
        sys.executable, "-m", "openrlhf_mappa.cli.train_mappa_ray",
        "--mappa.topology", topology, *FLAGS[mode], "--mappa.coach.kind", "heuristic",
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
        # A 4-token reply nearly always hits the token limit, and cut-off actions are left out of training by
        # default: without this flag nothing would train (every run at 0% success, 0 trained actions).
        "--mappa.train_truncated",
    ]  # fmt: skip
    # Per agent an actor and an engine on a fresh local Ray cluster; the env module is importable from BENCH.
    env = dict(os.environ, MAPPA_CPU_NUM_GPUS=str(2 * len(goals)), VLLM_CPU_KVCACHE_SPACE="1",
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
    if not any(m.get(f"agent/{agent}/trained_actions") for m in metrics for agent in goals):
        raise SystemExit(f"{mode} seed {seed}: the run trained no action at all; see {run}/run/metrics.jsonl")
    success = [m["outcome/success_rate"] for m in metrics]
    result = {
        "mode": mode, "seed": seed, "chain": a.chain, "steps_run": len(success), "wall_s": round(wall, 1),
        "steps_to_threshold": steps_to_threshold(success, a.threshold, a.window),
        "median_step_s": round(statistics.median(m["timing/step"] for m in metrics), 2),
        "coach_requests_per_step": statistics.fmean(m["coach/requests"] for m in metrics),
        "config": {k: getattr(a, k) for k in ("steps", "threshold", "window", "lr", "tasks_per_step")},
        "success_rate": success,
        "coach_score": {agent: [m[f"agent/{agent}/coach_score"] for m in metrics] for agent in goals},
    }  # fmt: skip
    with open(os.path.join(run, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


def mean_steps(runs: list, steps: int) -> tuple:
    """Mean steps to threshold, a run that never got there counted as the budget; True if that made it a bound."""
    values = [r["steps_to_threshold"] or steps for r in runs]
    return statistics.fmean(values), any(r["steps_to_threshold"] is None for r in runs)


def mean_of(runs: list, key: str) -> Optional[float]:
    return statistics.fmean(r[key] for r in runs) if runs else None


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="1 seed and a 40-step budget")
    p.add_argument("--chain", type=int, choices=sorted(CHAINS), default=2, help="agents in the chain")
    p.add_argument("--modes", default=",".join(MODES),
                   help=f"comma-separated modes to train, of {', '.join(MODES)}; 'none' prints the table only")
    p.add_argument("--seeds", type=int, default=3, help="train seeds 0 .. N-1")
    p.add_argument("--seed", type=int, action="append", help="train only this seed (repeatable); overrides --seeds")
    p.add_argument("--steps", type=int, default=60, help="step budget of every run")
    p.add_argument("--threshold", type=float, default=0.8, help="success rate to reach (trailing mean)")
    p.add_argument("--window", type=int, default=3, help="steps in the trailing mean")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--tasks-per-step", type=int, default=8, help="tasks per step; each is played twice")
    p.add_argument("--out", default=os.path.join(REPO, "runs", "bench-credit"))
    a = p.parse_args()
    if a.quick:
        a.seeds, a.steps = 1, 40
    modes = [] if a.modes == "none" else a.modes.split(",")
    if set(modes) - set(MODES):
        p.error(f"--modes: unknown {sorted(set(modes) - set(MODES))}; choose from {', '.join(MODES)}")
    out = os.path.join(os.path.abspath(a.out), f"chain{a.chain}")  # each training run works in its own directory
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    for seed in a.seed if a.seed is not None else range(a.seeds):
        for mode in modes:
            r = train(out, mode, seed, a)
            print(f"[credit] chain {a.chain}, {mode} seed {seed}: steps to threshold {r['steps_to_threshold']}, "
                  f"{r['steps_run']} steps in {r['wall_s']:.0f} s, {r['coach_requests_per_step']:.1f} coach requests "
                  "per step", flush=True)  # fmt: skip

    # Every run of this chain so far, from this invocation or earlier ones with the same settings.
    runs = []
    for path in sorted(glob.glob(os.path.join(out, "*-seed*", "result.json"))):
        r = json.load(open(path))
        if r["config"] == {k: getattr(a, k) for k in r["config"]}:
            runs.append(r)
    runs.sort(key=lambda r: (MODES.index(r["mode"]), r["seed"]))
    print(f"\n{a.chain}-agent chain: steps to a success rate >= {a.threshold:g} (trailing mean of {a.window} steps), "
          f"budget {a.steps} steps, {2 * a.tasks_per_step} episodes per step")  # fmt: skip
    print(f"{'mode':<9} {'seed':>4}  {'steps to threshold':<22} {'last success':>12} {'requests/step':>13} {'step s':>7} {'run s':>6}")
    for r in runs:
        reached = r["steps_to_threshold"] or f"not reached in {a.steps}"
        print(f"{r['mode']:<9} {r['seed']:>4}  {reached!s:<22} {r['success_rate'][-1]:>12.2f} "
              f"{r['coach_requests_per_step']:>13.1f} {r['median_step_s']:>7.2f} {r['wall_s']:>6.0f}")  # fmt: skip
    by_mode = {mode: [r for r in runs if r["mode"] == mode] for mode in MODES}
    means = {mode: mean_steps(rs, a.steps) for mode, rs in by_mode.items() if rs}
    requests = {mode: mean_of(rs, "coach_requests_per_step") for mode, rs in by_mode.items() if rs}
    for mode, (mean, bound) in means.items():
        seeds = ",".join(str(r["seed"]) for r in by_mode[mode])
        print(f"mean steps, {mode} (seeds {seeds}): {'>= ' if bound else ''}{mean:.1f}; "
              f"coach requests per step: {requests[mode]:.1f}")
    ratios = {}
    if "process" in means:
        process, process_bound = means["process"]
        for mode, goal in (("outcome", ">= 2"), ("hindsight", "<= 1.1")):
            if mode not in means:
                continue
            steps, bound = means[mode]
            if process_bound:
                ratios[mode] = "n/a (process did not reach the threshold in every seed)"
            else:
                ratios[mode] = f"{'>= ' if bound else ''}{steps / process:.2f}"
            print(f"ratio {mode}/process steps (goal {goal}): {ratios[mode]}")
        if "hindsight" in requests and requests["process"]:
            ratios["hindsight_requests"] = f"{requests['hindsight'] / requests['process']:.2f}"
            print(f"ratio hindsight/process coach requests per step (goal <= 0.33): {ratios['hindsight_requests']}")
    print(f"wall time of this invocation: {(time.time() - t0) / 60:.1f} min")

    summary = {
        "config": {k: v for k, v in vars(a).items() if k not in ("out", "seed", "modes")} | {"goals": CHAINS[a.chain],
                                                                                      "episodes_per_step": 2 * a.tasks_per_step},
        "mean_steps": {mode: {"mean": m, "lower_bound": b} for mode, (m, b) in means.items()},
        "coach_requests_per_step": requests,
        "ratios_to_process": ratios,
        "runs": runs,
    }  # fmt: skip
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"summary: {os.path.join(out, 'summary.json')}")


if __name__ == "__main__":
    main()
