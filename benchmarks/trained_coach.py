"""A trained and a distilled coach against the judge they learn from, side by side in one run on this machine: the
demo's relay team (three tiny agents from scratch, examples/scripts/train_mappa_tiny_cpu.sh's settings) coached by

- "reference": the heuristic coach alone;
- "trained": a random-init tiny coach model trained with the team (--mappa.coach.kind trained), the heuristic coach
  its reference judge on --reference-fraction of the actions;
- "reference-share": to tell what that coach adds, the agents paid by the reference on those draws alone;
- "distilled": the reference run's verdicts distilled into the same tiny coach (`mappa coach distill`, OpenRLHF's
  SFT trainer, a fifth of the episodes held out), then that coach frozen, served by vLLM's OpenAI-compatible server
  as a user serves one (`vllm serve`), coaching the team as `--mappa.coach.kind openai`;
- "distilled-trained": the trained coach started from the distilled one (no warm-up: it already judges).

All runs start from the same agents' weights and seed. Prints, per run: the success rate, the steps to 0.8 success
(mean over 3 steps), the reference's requests, the wall time, and for a trained coach its parse-error rate, held-out
agreement with the reference and the correlation of the two scores there, over the first and the last 5 steps; for
the distillation, its held-out agreement, r and parse errors (distill.json) and its wall time.

    .venv/bin/python benchmarks/trained_coach.py [--steps 60] [--reference-fraction 0.25] [--modes …] [flags]

Extra flags go to every run (the later of a repeated flag wins). The coach is sent a short prompt (the agent's goal
and reply: COACH_TEMPLATE) instead of relay.yaml's, which would make its training 5x the team's here, and replies with
one digit, trained on all ten where the reference judged (--mappa.coach.reply digit), on its format and agreement
terms (the relay's outcome is the whole team's, at odds with an action's own score), at a fifth of the agents'
learning rate (--mappa.coach.lr 1e-3); the reference draws are stratified by cut-off and ended actions, the agents
train on its verdicts from its 9th update (--mappa.coach.warmup_steps 8) and are paid the reference's score where it
judged (--mappa.coach.pay_reference). COACH_FLAGS, to try others; DISTILL_FLAGS, the distillation's.
"""

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from async_training import summary  # noqa: E402  (success rate, episodes to 0.8, relapses)

COACH_TEMPLATE = "Goal: {ground_truth}\nReply: {agent_output}"
COACH_FLAGS = ["--mappa.coach.reply", "digit", "--mappa.coach.lr", "1e-3",
               "--mappa.coach.terms", "format,agreement", "--mappa.coach.warmup_steps", "8",
               "--mappa.coach.reference_draw", "stratified", "--mappa.coach.on_failure", "neutral",
               "--mappa.coach.pay_reference"]
# The distillation (OpenRLHF's train_sft flags): the reference run's ~4,600 training verdicts, 3 epochs.
DISTILL_FLAGS = ["--mappa.coach.reply", "digit", "--train.max_epochs", "3", "--train.batch_size", "32",
                 "--train.micro_batch_size", "32", "--adam.lr", "1e-3", "--data.max_len", "256",
                 "--ds.zero_stage", "3", "--ds.attn_implementation", "sdpa"]


def coach_flags(mode: str, coach_model: str, distilled: str, fraction: float, steps: int) -> list:
    """The coach of each mode (the module docstring); "distilled" adds the served coach's URL in main."""
    if mode == "reference":
        return ["--mappa.coach.kind", "heuristic"]
    if mode == "distilled":  # frozen: at temperature 0 it gives one digit, as it was distilled to
        return ["--mappa.coach.kind", "openai", "--mappa.coach.model", "distilled", "--mappa.coach.structured", "off",
                "--mappa.coach.max_tokens", "2", "--mappa.coach.on_failure", "neutral"]
    trained = ["--mappa.coach.kind", "trained", "--mappa.coach.reference_fraction", str(fraction), *COACH_FLAGS]
    if mode == "distilled-trained":
        return trained + ["--mappa.coach.model", distilled, "--mappa.coach.warmup_steps", "0"]
    trained += ["--mappa.coach.model", coach_model]
    if mode == "reference-share":
        # The reference on the trained run's draws alone: the agents are paid its score, the coach's never (its
        # warm-up outlasts the run), and they train in batches of 8, about what that leaves of each one's 32.
        trained += ["--mappa.coach.warmup_steps", str(steps + 1),
                    "--train.batch_size", "8", "--train.micro_batch_size", "8", "--rollout.micro_batch_size", "8"]
    return trained


def distill(reference_run: str, topology: str, coach_model: str, out: str) -> dict:
    """`mappa coach distill` on the reference run's verdicts, as a user runs it; its held-out report."""
    subprocess.run(["rm", "-rf", out], check=True)
    subprocess.run([os.path.join(os.path.dirname(sys.executable), "mappa"), "coach", "distill",
                    "--episodes", os.path.join(reference_run, "episodes.jsonl"), "--mappa.topology", topology,
                    "--model.model_name_or_path", coach_model, "--ckpt.output_dir", out, *DISTILL_FLAGS], check=True)
    return json.load(open(os.path.join(out, "distill.json")))


class Served:
    """The distilled coach behind vLLM's OpenAI-compatible server (what `vllm serve` runs), on 127.0.0.1."""

    def __init__(self, model: str, log: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url, self.log = f"http://127.0.0.1:{port}/v1", open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name",
             "distilled", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "512", "--enforce-eager"],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    def __enter__(self) -> str:
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/models", timeout=2)
                return self.url
            except OSError:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise SystemExit(f"the vLLM server did not come up: see {self.log.name}") from None
                time.sleep(1)

    def __exit__(self, *exc):
        os.killpg(self.proc.pid, signal.SIGTERM)
        self.proc.wait(timeout=60)
        self.log.close()


def write_topology(out: str) -> str:
    import yaml

    topology = yaml.safe_load(open(os.path.join(REPO, "examples/configs/relay.yaml")))
    topology["coach_template"] = COACH_TEMPLATE
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "relay.yaml"), "w") as f:
        yaml.safe_dump(topology, f)
    return os.path.join(out, "relay.yaml")


def run(out: str, model: str, topology: str, coach: list, steps: int, extra: list) -> list:
    import ray

    from openrlhf_mappa.cli.train_mappa_ray import parse_args, train

    os.makedirs(out, exist_ok=True)
    args = parse_args([
        "--mappa.topology", topology, "--mappa.model", model,
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


def coach_summary(metrics: list, mode: str) -> dict:
    mean = lambda xs: sum(xs) / len(xs) if xs else None
    window = lambda key, part: mean([m[key] for m in part if m.get(key) is not None])
    trained = "trained" in mode or mode == "reference-share"
    asked = {"reference": "coach/requests", "distilled": None}.get(mode, "coach/reference_requests")
    out = {"reference requests": sum(m[asked] for m in metrics) if asked else 0,
           "verdicts": sum(m["coach/requests"] for m in metrics)}
    if trained:
        for key, name in (("coach/parse_error_rate", "parse errors"), ("coach/heldout_agreement", "held-out agree"),
                          ("coach/heldout_correlation", "held-out r")):
            out[f"{name}, first 5"], out[f"{name}, last 5"] = window(key, metrics[:5]), window(key, metrics[-5:])
    return out


def print_table(results: dict):
    print(f"{'':28}" + "".join(f"{mode:>18}" for mode in results))
    for key in dict.fromkeys(k for r in results.values() for k in r):
        cells = [results[mode].get(key) for mode in results]
        print(f"{key:28}" + "".join(f"{c:>18.3f}" if isinstance(c, float) else f"{str(c):>18}" for c in cells))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--reference-fraction", type=float, default=0.25)
    p.add_argument("--out", default=os.path.join(REPO, "runs", "bench-trained-coach"))
    p.add_argument("--modes", default="reference,trained,reference-share,distilled,distilled-trained",
                   help="which runs, e.g. trained alone to repeat it; the distilled ones distill the reference "
                        "run's verdicts (run first, or kept from an earlier run of the script)")
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
    topology, distilled = write_topology(a.out), os.path.join(a.out, "distilled-coach")
    results, report = {}, None
    for mode in a.modes.split(","):
        out = os.path.join(a.out, mode)
        subprocess.run(["rm", "-rf", out], check=True)
        if mode.startswith("distilled") and report is None:
            t0 = time.time()
            report = distill(os.path.join(a.out, "reference", "run"), topology, models["tiny-coach"], distilled)
            report["wall s"] = time.time() - t0
        coach = coach_flags(mode, models["tiny-coach"], distilled, a.reference_fraction, a.steps)
        t0 = time.time()
        if mode == "distilled":
            with Served(distilled, os.path.join(a.out, "vllm-serve.log")) as url:
                metrics = run(out, models["tiny-model"], topology, coach + ["--mappa.coach.base_url", url], a.steps,
                              extra)
        else:
            metrics = run(out, models["tiny-model"], topology, coach, a.steps, extra)
        s = summary(metrics)
        reached = s["episodes to 0.8"] and s["episodes to 0.8"] // 32
        results[mode] = {"success first 3": s["success first 3"], "success last 3": s["success last 3"],
                         "steps to 0.8": reached, "wall s": time.time() - t0, **coach_summary(metrics, mode)}
    print(f"relay, {a.steps} steps of 32 episodes, reference fraction {a.reference_fraction:g} {' '.join(extra)}")
    print_table(results)
    if report is not None:
        r = report["pearson"]
        print(f"distilled from the reference run's verdicts in {report['wall s']:.0f} s: {report['rows']['train']} "
              f"trained on, {report['n']} held out: agreement {report['agreement']:.3f}, Pearson r "
              f"{'-' if r is None else f'{r:.3f}'}, parse errors {report['parse_error_rate']:.1%} (goal r >= 0.8)")
    goals = {"trained": 1.5, "distilled": 1.3, "distilled-trained": 1.2}
    for mode in (m for m in results if m != "reference" and "reference" in results):
        r, t = results["reference"], results[mode]
        if r["steps to 0.8"] and t["steps to 0.8"]:
            print(f"steps to 0.8, {mode} / reference: {t['steps to 0.8'] / r['steps to 0.8']:.2f} "
                  f"(goal <= {goals.get(mode, '-')})")
        print(f"reference requests, {mode} / reference: {t['reference requests'] / r['reference requests']:.2f} "
              f"(goal <= 0.30)")


if __name__ == "__main__":
    main()
