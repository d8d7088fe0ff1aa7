"""How fast `train_mappa_ray` refuses bad input: the real CLI, in a fresh interpreter each time, on inputs it refuses
before Ray starts, each run --repeat times; prints the median and the slowest seconds per case. Tests check what is
refused and that torch, Ray and vLLM never load for it (tests/test_launch.py); how long it takes is measured here.

    .venv/bin/python benchmarks/refusal_times.py --repeat 3
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=3)
    repeat = parser.parse_args().repeat
    work = tempfile.mkdtemp(prefix="mappa-refusals-")
    os.makedirs(os.path.join(work, "run"))
    with open(os.path.join(work, "tasks.jsonl"), "w") as f:
        f.write('{"id": 0, "prompt": "1 + 1?", "answer": "2"}\n')
    with open(os.path.join(work, "run", "metrics.jsonl"), "w") as f:
        f.write('{"step": 1}\n')  # a run that logged a step, with no checkpoint where --ckpt.path says
    model = os.path.join(work, "model")
    os.makedirs(model)
    for name in ("config.json", "tokenizer.json"):  # the launcher's model check reads file names only
        open(os.path.join(model, name), "w").write("{}")
    good = ["--mappa.topology", os.path.join(ROOT, "examples", "configs", "mathchat.yaml"), "--mappa.model", model,
            "--data.prompt_dataset", "tasks.jsonl", "--mappa.run_dir", "run", "--ckpt.path", "ckpt",
            "--rollout.batch_size", "1", "--rollout.micro_batch_size", "1", "--train.batch_size", "1",
            "--train.micro_batch_size", "1", "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1",
            "--rollout.max_new_tokens", "64", "--ds.attn_implementation", "sdpa"]
    cases = {
        "missing dataset": good + ["--data.prompt_dataset", "missing.jsonl"],
        "model that is no directory": good + ["--mappa.model", "models/none"],
        "unknown coach kind": good + ["--mappa.coach.kind", "oracle"],
        "resume that would start over (after the heavy imports)": good + ["--ckpt.load_enable"],
    }
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MAPPA_TRACEBACK")}
    print(f"{'case':58} {'median s':>9} {'max s':>7}  exit  refusal")
    for case, argv in cases.items():
        times, codes = [], set()
        for _ in range(repeat):
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "openrlhf_mappa.cli.train_mappa_ray", *argv], cwd=work, env=env,
                                  capture_output=True, text=True, timeout=300)
            times.append(time.perf_counter() - t0)
            codes.add(proc.returncode)
        said = (proc.stderr.strip().splitlines() or [""])[-1][:70]
        print(f"{case:58} {statistics.median(times):9.2f} {max(times):7.2f}  {sorted(codes)}  {said}")


if __name__ == "__main__":
    main()
