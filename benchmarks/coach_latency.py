"""Is coach latency hidden behind generation? Runs the tiny MathChat training twice on this machine, once
with a coach that answers after --delay seconds and once with an instant one (the same OpenAI-compatible
server on 127.0.0.1, the same code path), and prints the ratio of their mean step wall times, and the actions
trained. Step 1 of each run is warm-up and is left out. Goal: ratio <= 1.2 (synchronous), <= 1.05 with --async
(--train.async_enable: the next step's rollout and its verdicts run while the team trains).

    .venv/bin/python benchmarks/coach_latency.py [--steps 3] [--delay 1.0] [--async]
"""

import argparse
import json
import os
import subprocess
import sys

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
from coach_server import COACH_TEMPLATE, CoachServer  # noqa: E402


def run(out: str, model: str, delay: float, steps: int, async_: bool) -> list:
    import ray

    from openrlhf_mappa.cli.train_mappa_ray import parse_args, train

    topology = yaml.safe_load(open(os.path.join(REPO, "examples/configs/mathchat.yaml")))
    topology["coach_template"] = COACH_TEMPLATE  # the rule-scoring server reads this layout
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "topology.yaml"), "w") as f:
        yaml.safe_dump(topology, f)
    with CoachServer(delay_s=delay) as coach:
        args = parse_args([
            "--mappa.topology", os.path.join(out, "topology.yaml"), "--mappa.model", model,
            "--mappa.coach.kind", "openai", "--mappa.coach.base_url", coach.base_url, "--mappa.coach.model", "bench",
            "--mappa.run_dir", os.path.join(out, "run"),
            "--data.prompt_dataset", os.path.join(REPO, "examples/data/tiny_math.jsonl"), "--data.max_samples", str(4 * steps),
            "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1", "--vllm.enforce_eager",
            "--vllm.gpu_memory_utilization", "0.2", "--ds.zero_stage", "3", "--ds.attn_implementation", "sdpa",
            "--algo.kl.init_coef", "0", "--actor.adam.lr", "1e-4", "--actor.lr_warmup_ratio", "0",
            "--rollout.batch_size", "4", "--rollout.n_samples_per_prompt", "2", "--rollout.micro_batch_size", "2",
            "--rollout.max_new_tokens", "32", "--data.max_len", "2048",
            "--train.batch_size", "4", "--train.micro_batch_size", "2", "--train.num_episodes", "1",
            # A random tiny model seldom ends within 32 tokens: left out, its cut-off actions would train nothing
            # (the run stops after --mappa.max_untrained_steps), and the step time would not include training.
            "--mappa.train_truncated",
            "--ckpt.path", os.path.join(out, "ckpt"), "--ckpt.output_dir", os.path.join(out, "final"),
        ] + ["--train.async_enable"] * async_)
        try:
            train(args)
        finally:
            ray.shutdown()
    metrics = [json.loads(line) for line in open(os.path.join(out, "run", "metrics.jsonl"))]
    trained = [sum(v for k, v in m.items() if k.endswith("/trained_actions")) for m in metrics]
    if not all(trained):
        raise SystemExit(f"{out}: a step trained nothing ({trained} actions a step): its time would not be a step's")
    return [(m["timing/step"], n, m) for m, n in zip(metrics, trained)]


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--delay", type=float, default=1.0)
    p.add_argument("--out", default=os.path.join(REPO, "runs", "bench-coach-latency"))
    p.add_argument("--async", dest="async_", action="store_true", help="train with --train.async_enable")
    a = p.parse_args()
    os.environ.setdefault("MAPPA_CPU_NUM_GPUS", "6")
    model = os.path.join(a.out, "tiny-model")
    if not os.path.exists(os.path.join(model, "config.json")):
        subprocess.run([os.path.join(os.path.dirname(sys.executable), "mappa"), "tiny-model", model], check=True)
    times = {}
    for delay in (0.0, a.delay):
        out = os.path.join(a.out, f"delay{delay:g}" + "-async" * a.async_)
        subprocess.run(["rm", "-rf", out], check=True)
        times[delay] = run(out, model, delay, a.steps, a.async_)[1:]
    instant, slow = (sum(t for t, _, _ in times[d]) / len(times[d]) for d in (0.0, a.delay))
    for delay, mean in ((0.0, instant), (a.delay, slow)):
        shown = ", ".join(f"{t:.2f} ({n} trained)" for t, n, _ in times[delay])
        print(f"step wall time, {'instant' if not delay else f'{delay:g} s'} coach{' (async)' * a.async_}: {mean:.2f} s  "
              f"(steps {shown})")
        # Where the step went: the agents' phases overlap (each agent's update starts when its verdicts are in).
        phase = lambda k: sum(m.get(f"timing/{k}", 0.0) for _, _, m in times[delay]) / len(times[delay])
        print("  per step: " + ", ".join(f"{k} {phase(k):.2f} s" for k in
                                          ("rollout", "coach_wait", "experience", "train", "sync")))
    print(f"ratio (goal <= {1.05 if a.async_ else 1.2}): {slow / instant:.3f}")


if __name__ == "__main__":
    main()
