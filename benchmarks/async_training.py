"""Synchronous against async team training, side by side in one run on this machine: the demo's relay team (three
tiny agents learning from scratch, examples/scripts/train_mappa_tiny_cpu.sh's settings) where every action's tool
call takes --tool-s seconds and the coach answers after --coach-s seconds, so that a rollout waits as DSBench's do.
Both runs start from the same weights and seed. Prints, per mode: steps per hour (step 1, warm-up, left out), the
share of the wall time the team waited for its episodes (synchronous: every rollout; async: what training did not
hide), the mean staleness of the actions, the success rate over training, the episodes seen before the
success rate (mean over 3 steps) first reached 0.8, and the steps in which an agent relapsed into replies cut off
at the token limit after it had learned to end them.

    .venv/bin/python benchmarks/async_training.py [--steps 40] [--tool-s 0.25] [--coach-s 1.0] [train_mappa_ray flags]

Extra flags go to both runs (e.g. --train.max_epochs 4: a longer update, to weigh training against the rollout).

The stand-ins are the benchmark's own: the relay env's step sleeps (a tool call), and the heuristic coach's score
awaits an asyncio sleep first (an API coach's latency); everything else is the real code path.
"""

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the topology names SlowRelay by this module

from openrlhf_mappa.envs.relay import RelayEnv  # noqa: E402

TOOL_S = float(os.environ.get("MAPPA_BENCH_TOOL_S", "0.25"))


class SlowRelay(RelayEnv):
    """The relay, each action followed by a tool call that takes TOOL_S seconds (run in a thread by the rollout)."""

    def step(self, agent, turn, response):
        time.sleep(TOOL_S)
        return super().step(agent, turn, response)


def run(out: str, model: str, steps: int, coach_s: float, async_: bool, extra: list) -> list:
    import ray
    import yaml

    from openrlhf_mappa.cli.train_mappa_ray import parse_args, train
    from openrlhf_mappa.coach.heuristic import HeuristicCoach

    score = HeuristicCoach.score

    async def slow_score(self, request):
        await asyncio.sleep(coach_s)
        return await score(self, request)

    HeuristicCoach.score = slow_score
    topology = yaml.safe_load(open(os.path.join(REPO, "examples/configs/relay.yaml")))
    topology["env"] = "async_training:SlowRelay"
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "relay.yaml"), "w") as f:
        yaml.safe_dump(topology, f)
    tasks = os.path.join(REPO, "examples/data/relay_train.jsonl")  # 8 tasks: one step a pass
    args = parse_args([
        "--mappa.topology", os.path.join(out, "relay.yaml"), "--mappa.model", model, "--mappa.coach.kind", "heuristic",
        "--mappa.train_truncated", "--mappa.run_dir", os.path.join(out, "run"), "--data.prompt_dataset", tasks,
        "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1", "--vllm.sync_backend", "gloo",
        "--vllm.enforce_eager", "--vllm.gpu_memory_utilization", "0.2", "--ds.zero_stage", "3",
        "--ds.attn_implementation", "sdpa", "--algo.kl.init_coef", "0", "--actor.adam.lr", "5e-3",
        "--actor.lr_warmup_ratio", "0", "--actor.lr_scheduler", "constant", "--rollout.batch_size", "8",
        "--rollout.n_samples_per_prompt", "4", "--rollout.micro_batch_size", "32", "--rollout.max_new_tokens", "16",
        "--data.max_len", "256", "--train.batch_size", "32", "--train.micro_batch_size", "32",
        "--train.num_episodes", str(steps), "--train.seed", "0", "--ckpt.path", os.path.join(out, "ckpt"),
        "--ckpt.output_dir", os.path.join(out, "final"),
    ] + ["--train.async_enable", "--algo.advantage.is_correction_level", "token"] * async_ + extra)  # fmt: skip
    try:
        train(args)
    finally:
        ray.shutdown()
        HeuristicCoach.score = score
    return [json.loads(line) for line in open(os.path.join(out, "run", "metrics.jsonl"))]


def summary(metrics: list) -> dict:
    timed = metrics[1:]
    wall = sum(m["timing/step"] for m in timed)
    waited = sum(m["timing/rollout_wait"] for m in timed)  # the team idle, waiting for its episodes
    success = [m["outcome/success_rate"] for m in metrics]
    smooth = [sum(success[max(0, i - 2): i + 1]) / len(success[max(0, i - 2): i + 1]) for i in range(len(success))]
    reached = next((i + 1 for i, s in enumerate(smooth) if s >= 0.8), None)
    stale = [m[k] for m in metrics for k in m if k.endswith("/staleness_mean")]
    # Relapses: steps in which an agent that had learned to end its replies (under 10% cut off at the token limit)
    # had half or more of them cut off again; all cut off alike, they score alike and teach it little.
    relapsed = set()
    for key in {k for m in metrics for k in m if k.endswith("/truncated_rate")}:
        rates = [(m["step"], m[key]) for m in metrics if m.get(key) is not None]
        learned = next((i for i, (_, rate) in enumerate(rates) if rate < 0.1), len(rates))
        relapsed |= {step for step, rate in rates[learned:] if rate >= 0.5}
    return {"steps/hour": 3600 * len(timed) / wall, "waiting share": waited / wall,
            "staleness": sum(stale) / len(stale) if stale else 0.0, "success first 3": sum(success[:3]) / 3,
            "success last 3": sum(success[-3:]) / 3, "episodes to 0.8": reached and reached * 32,
            "relapsed steps": len(relapsed),
            "rollout s": sum(m["timing/rollout"] for m in timed) / len(timed),
            "train s": sum(m["timing/train"] + m["timing/experience"] + m["timing/sync"] for m in timed) / len(timed)}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--coach-s", type=float, default=1.0)
    p.add_argument("--tool-s", type=float, default=0.25)
    p.add_argument("--out", default=os.path.join(REPO, "runs", "bench-async"))
    p.add_argument("--modes", default="sync,async", help="which runs, e.g. async alone to repeat it")
    a, extra = p.parse_known_args()
    os.environ["MAPPA_BENCH_TOOL_S"] = str(a.tool_s)  # read where the topology imports this module by name
    os.environ.setdefault("MAPPA_CPU_NUM_GPUS", "6")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    model = os.path.join(a.out, "tiny-model")
    if not os.path.exists(os.path.join(model, "config.json")):
        subprocess.run([os.path.join(os.path.dirname(sys.executable), "mappa"), "tiny-model", model, "--seed", "0",
                        "--vocab-size", "259", "--init-std", "0.002"], check=True, capture_output=True)
    results = {}
    for mode in a.modes.split(","):
        out = os.path.join(a.out, mode)
        subprocess.run(["rm", "-rf", out], check=True)
        results[mode] = summary(run(out, model, a.steps, a.coach_s, mode == "async", extra))
    print(f"relay, {a.steps} steps of 32 episodes, tool call {a.tool_s:g} s, coach {a.coach_s:g} s {' '.join(extra)}")
    print(f"{'':18}" + "".join(f"{mode:>12}" for mode in results))
    for key in next(iter(results.values())):
        cells = [results[mode][key] for mode in results]
        print(f"{key:18}" + "".join(f"{c:>12.3f}" if isinstance(c, float) else f"{str(c):>12}" for c in cells))
    if {"sync", "async"} <= set(results):
        print(f"throughput async / sync: {results['async']['steps/hour'] / results['sync']['steps/hour']:.2f}")


if __name__ == "__main__":
    main()
