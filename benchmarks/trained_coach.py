"""A trained coach against the judge it learns from, side by side in one run on this machine: the demo's relay team
(three tiny agents from scratch, examples/scripts/train_mappa_tiny_cpu.sh's settings) coached first by the heuristic
coach alone ("reference"), then by a random-init tiny coach model trained with the team (--mappa.coach.kind trained),
the heuristic coach its reference judge on --reference-fraction of the actions ("trained"), and, to tell what the coach
adds, paid by the reference on those draws alone ("reference-share"). All runs start from the same agents' weights
and seed. Prints, per run: the success rate, the steps to 0.8 success (mean over 3 steps), the
reference's requests, and for the trained coach its parse-error rate, held-out agreement with the reference and the
correlation of the two scores there, over the first and the last 5 steps.

    .venv/bin/python benchmarks/trained_coach.py [--steps 60] [--reference-fraction 0.25] [train_mappa_ray flags]

Extra flags go to every run (the later of a repeated flag wins). The coach is sent a short prompt (the agent's goal
and reply: COACH_TEMPLATE) instead of relay.yaml's, which would make its training 5x the team's here, and replies with
one digit (--mappa.coach.digits_only), trained on its format and agreement terms (the relay's outcome is the whole
team's, at odds with an action's own score), on every digit where the reference judged (--mappa.coach.all_digits), at
a fifth of the agents' learning rate (--mappa.coach.lr 1e-3); the reference draws are stratified by cut-off and ended
actions, the agents train on its verdicts from its 9th update (--mappa.coach.warmup_steps 8) and are paid the
reference's score where it judged (--mappa.coach.pay_reference). COACH_FLAGS, to try others.
"""

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from async_training import summary  # noqa: E402  (success rate, episodes to 0.8, relapses)

COACH_TEMPLATE = "Goal: {ground_truth}\nReply: {agent_output}"
COACH_FLAGS = ["--mappa.coach.digits_only", "--mappa.coach.all_digits", "--mappa.coach.lr", "1e-3",
               "--mappa.coach.terms", "format,agreement", "--mappa.coach.warmup_steps", "8",
               "--mappa.coach.reference_draw", "stratified", "--mappa.coach.on_failure", "neutral",
               "--mappa.coach.pay_reference"]


def run(out: str, model: str, coach_model: str, steps: int, fraction: float, mode: str, extra: list) -> list:
    import ray
    import yaml

    from openrlhf_mappa.cli.train_mappa_ray import parse_args, train

    topology = yaml.safe_load(open(os.path.join(REPO, "examples/configs/relay.yaml")))
    topology["coach_template"] = COACH_TEMPLATE
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "relay.yaml"), "w") as f:
        yaml.safe_dump(topology, f)
    coach = ["--mappa.coach.kind", "heuristic"]
    if mode != "reference":
        coach = ["--mappa.coach.kind", "trained", "--mappa.coach.model", coach_model,
                 "--mappa.coach.reference_fraction", str(fraction), *COACH_FLAGS]
    if mode == "reference-share":
        # The reference on the trained run's draws alone: the agents are paid its score, the coach's never (its
        # warm-up outlasts the run), and they train in batches of 8, about what that leaves of each one's 32.
        coach += ["--mappa.coach.warmup_steps", str(steps + 1),
                  "--train.batch_size", "8", "--train.micro_batch_size", "8", "--rollout.micro_batch_size", "8"]
    args = parse_args([
        "--mappa.topology", os.path.join(out, "relay.yaml"), "--mappa.model", model,
        "--mappa.train_truncated", "--mappa.run_dir", os.path.join(out, "run"),
        "--data.prompt_dataset", os.path.join(REPO, "examples/data/relay_train.jsonl"),
        "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1", "--vllm.sync_backend", "gloo",
        "--vllm.enforce_eager", "--vllm.gpu_memory_utilization", "0.2", "--ds.zero_stage", "3",
        "--ds.attn_implementation", "sdpa", "--algo.kl.init_coef", "0", "--actor.adam.lr", "5e-3",
        "--actor.lr_warmup_ratio", "0", "--actor.lr_scheduler", "constant", "--rollout.batch_size", "8",
        "--rollout.n_samples_per_prompt", "4", "--rollout.micro_batch_size", "32", "--rollout.max_new_tokens", "16",
        "--data.max_len", "256",
        "--train.batch_size", "32", "--train.micro_batch_size", "32", "--train.num_episodes", str(steps),
        "--train.seed", "0", "--ckpt.path", os.path.join(out, "ckpt"), "--ckpt.output_dir", os.path.join(out, "final"),
    ] + coach + extra)  # fmt: skip
    try:
        train(args)
    finally:
        ray.shutdown()
    return [json.loads(line) for line in open(os.path.join(out, "run", "metrics.jsonl"))]


def coach_summary(metrics: list, trained: bool) -> dict:
    mean = lambda xs: sum(xs) / len(xs) if xs else None
    window = lambda key, part: mean([m[key] for m in part if m.get(key) is not None])
    out = {"reference requests": sum(m["coach/reference_requests" if trained else "coach/requests"] for m in metrics),
           "verdicts": sum(m["coach/requests"] for m in metrics)}
    if trained:
        for key, name in (("coach/parse_error_rate", "parse errors"), ("coach/heldout_agreement", "held-out agree"),
                          ("coach/heldout_correlation", "held-out r")):
            out[f"{name}, first 5"], out[f"{name}, last 5"] = window(key, metrics[:5]), window(key, metrics[-5:])
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--reference-fraction", type=float, default=0.25)
    p.add_argument("--out", default=os.path.join(REPO, "runs", "bench-trained-coach"))
    p.add_argument("--modes", default="reference,trained,reference-share",
                   help="which runs, e.g. trained alone to repeat it")
    a, extra = p.parse_known_args()
    os.environ.setdefault("MAPPA_CPU_NUM_GPUS", "8")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    models = {}
    for name, seed in (("tiny-model", "0"), ("tiny-coach", "1")):  # the demo's agents; a coach of other weights
        models[name] = os.path.join(a.out, name)
        if not os.path.exists(os.path.join(models[name], "config.json")):
            subprocess.run([os.path.join(os.path.dirname(sys.executable), "mappa"), "tiny-model", models[name],
                            "--seed", seed, "--vocab-size", "259", "--init-std", "0.002"], check=True,
                           capture_output=True)
    results = {}
    for mode in a.modes.split(","):
        out = os.path.join(a.out, mode)
        subprocess.run(["rm", "-rf", out], check=True)
        metrics = run(out, models["tiny-model"], models["tiny-coach"], a.steps, a.reference_fraction, mode, extra)
        s = summary(metrics)
        reached = s["episodes to 0.8"] and s["episodes to 0.8"] // 32
        results[mode] = {"success first 3": s["success first 3"], "success last 3": s["success last 3"],
                         "steps to 0.8": reached, **coach_summary(metrics, mode != "reference")}
    print(f"relay, {a.steps} steps of 32 episodes, reference fraction {a.reference_fraction:g} {' '.join(extra)}")
    print(f"{'':26}" + "".join(f"{mode:>12}" for mode in results))
    for key in dict.fromkeys(k for r in results.values() for k in r):
        cells = [results[mode].get(key) for mode in results]
        print(f"{key:26}" + "".join(f"{c:>12.3f}" if isinstance(c, float) else f"{str(c):>12}" for c in cells))
    for mode in (m for m in results if m != "reference" and "reference" in results):
        r, t = results["reference"], results[mode]
        if r["steps to 0.8"] and t["steps to 0.8"]:
            print(f"steps to 0.8, {mode} / reference: {t['steps to 0.8'] / r['steps to 0.8']:.2f} (goal <= 1.5)")
        print(f"reference requests, {mode} / reference: {t['reference requests'] / r['reference requests']:.2f} "
              f"(goal <= 0.30)")


if __name__ == "__main__":
    main()
