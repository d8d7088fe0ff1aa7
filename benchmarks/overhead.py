"""What does MAPPA's team loop cost over OpenRLHF's own trainer? Real training runs of both, taking turns,
each the driver of its own local Ray cluster, on the same tiny model (`mappa tiny-model`), prompts, sampling,
tokens per step and batch sizes; per-phase step times side by side, with the ratio of the second to the first.

Default: OpenRLHF's `python -m openrlhf.cli.train_ppo_ray` (REINFORCE++, rewarded by a Python function,
`--reward.remote_url reward.py`) against one-agent MAPPA (`train_mappa_ray`, the `relay` env whose outcome is
the same rule, `--mappa.reward outcome`: no coach is asked). Single-turn. Goal (issue 66): MAPPA's steady-state
step and generation phase <= 1.05 x OpenRLHF's.
`--agents K`: one-agent MAPPA against K agents, each on its own logical GPUs (actor + engine) and each with
the same work as the one (K agents act once per episode and see only the task). Goal: the training phase
(train + sync) with 3 agents <= 1.3 x one agent's.

Both sides: ZeRO-3, one actor GPU and one vLLM engine per policy, no reference model (KL coefficient 0),
the same --train/--rollout batch sizes, --rollout.max_new_tokens and --data.max_len. Both log every step to
tensorboard through OpenRLHF's own TensorboardLogger, and the phase times are read back from there: the
phases each trainer times itself (OpenRLHF: timing/generation, make_experience, ppo_train, broadcast,
step_total; MAPPA: timing/rollout, experience, train, sync, step), and the wall clock between two steps' log
records, which also covers whatever a step does outside those timers. Steps up to --warmup are left out
(start-up too); each figure is the median of the remaining steps.

    flock /work/ray.lock env PYTHONPATH=. .venv/bin/python benchmarks/overhead.py              # ~7 min
    flock /work/ray.lock env PYTHONPATH=. .venv/bin/python benchmarks/overhead.py --agents 3   # ~12 min
    ... benchmarks/overhead.py --repeats 1 --profile   # where each side's processes spend a step (py-spy)

Each side runs --repeats times (3), the sides taking turns (A B A B A B): each figure is the median of its runs,
each ratio the ratio of those medians, with its spread (the lowest and highest ratio of run i to run i).

Each run's log, tensorboard events and inputs are under --out (runs/bench-overhead/<side>/<run>/).
"""

import argparse
import glob
import json
import os
import signal
import statistics
import subprocess
import sys
import time

import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROFILE_RATE = 50  # py-spy samples per second and process
RULE = r"(?s).*\d.*"  # success: the reply contains a digit (the relay env's goal; OpenRLHF's reward function)

REWARD_PY = f'''import re

import torch


def reward_func(queries, prompts, labels):
    # the relay env's outcome rule, as MAPPA's --mappa.reward outcome pays it: 10 x success
    rewards = torch.tensor([10.0 * bool(re.fullmatch({RULE!r}, q[len(p):])) for q, p in zip(queries, prompts)])
    return {{"rewards": rewards, "scores": rewards, "extra_logs": {{}}}}
'''

# Each side's own step timers, by phase. MAPPA's timing/train + timing/sync is its training phase's wall clock.
PHASES = ("generation", "experience", "train", "sync", "step")
KEYS = {
    "openrlhf": dict(zip(PHASES, ("timing/generation", "timing/make_experience", "timing/ppo_train",
                                  "timing/broadcast", "timing/step_total"))),
    "mappa": dict(zip(PHASES, ("timing/rollout", "timing/experience", "timing/train", "timing/sync", "timing/step"))),
}  # fmt: skip


def common_flags(a, out: str) -> list:
    """The flags both CLIs take with the same meaning (OpenRLHF's own parser; MAPPA's extends it)."""
    return [
        "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1", "--vllm.sync_backend", "gloo",
        "--vllm.enforce_eager", "--vllm.gpu_memory_utilization", "0.2",
        "--ds.zero_stage", "3", "--ds.attn_implementation", "sdpa",
        "--algo.kl.init_coef", "0", "--actor.adam.lr", "1e-5", "--actor.lr_warmup_ratio", "0",
        "--data.prompt_dataset", os.path.join(a.out, "prompts.jsonl"),
        "--rollout.batch_size", str(a.prompts), "--rollout.n_samples_per_prompt", str(a.samples),
        "--rollout.micro_batch_size", str(a.micro_batch), "--rollout.max_new_tokens", str(a.max_new_tokens),
        "--data.max_len", str(a.max_len), "--train.batch_size", str(a.prompts * a.samples),
        "--train.micro_batch_size", str(a.micro_batch), "--train.num_episodes", "1", "--train.seed", "0",
        "--logger.tensorboard_dir", os.path.join(out, "tensorboard"),
        "--ckpt.path", os.path.join(out, "ckpt"), "--ckpt.output_dir", os.path.join(out, "final"),
    ]  # fmt: skip


def openrlhf_cmd(a, out: str) -> list:
    return [sys.executable, "-m", "openrlhf.cli.train_ppo_ray", *common_flags(a, out),
            "--actor.model_name_or_path", a.model, "--algo.advantage.estimator", "reinforce",
            "--reward.remote_url", os.path.join(a.out, "reward.py"),
            # MAPPA renders each agent's prompt with the model's chat template; so does OpenRLHF with this flag.
            "--data.input_key", "prompt", "--data.label_key", "answer", "--data.apply_chat_template"]  # fmt: skip


def mappa_cmd(a, out: str, agents: int) -> list:
    names = [f"agent{i}" for i in range(1, agents + 1)]
    topology = {
        "name": f"overhead-{agents}",
        "env": "relay",
        "env_kwargs": {"goals": {name: RULE for name in names}},
        # No {history} in the prompt: every agent sees only the task, so each has the one agent's work.
        "agents": [{"name": n, "model": a.model, "max_actions": 1, "role": "Answers the task.", "prompt": "{task}"}
                   for n in names],  # fmt: skip
        # Never rendered: outcome rewards ask no coach. A template without the score key is warned about.
        "coach_template": "{agent_output}\nEnd with a line PROCESS_SCORE: <0-10>.",
    }
    with open(os.path.join(out, "topology.yaml"), "w") as f:
        yaml.safe_dump(topology, f)
    return [sys.executable, "-m", "openrlhf_mappa.cli.train_mappa_ray", *common_flags(a, out),
            "--mappa.topology", os.path.join(out, "topology.yaml"), "--mappa.reward", "outcome",
            "--mappa.run_dir", os.path.join(out, "run"),
            # A random tiny model seldom stops before the token limit; OpenRLHF trains on cut-off replies too.
            "--mappa.train_truncated"]  # fmt: skip


def train(cmd: list, out: str, gpus: int, timeout: float, profile: tuple = None) -> tuple:
    """Runs `cmd` to its end in a session of its own (its output in <out>/train.log) on a fresh local Ray
    cluster with `gpus` logical GPUs; returns when it started and ended. Whatever it leaves running is killed.
    profile (warmup, steps): py-spy samples the run's whole process tree over its steady steps."""
    env = dict(os.environ, MAPPA_CPU_NUM_GPUS=str(gpus), VLLM_CPU_KVCACHE_SPACE="1")
    env.pop("RAY_ADDRESS", None)
    t0 = time.time()
    with open(os.path.join(out, "train.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=out, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    if profile:
        record_steady_steps(proc, out, *profile)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        rc = f"none: still running after {timeout:g} s"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the run's own process group: its Ray workers and engines
        except ProcessLookupError:
            pass
        proc.wait()
    if rc != 0:
        tail = "".join(open(os.path.join(out, "train.log"), errors="replace").readlines()[-40:])
        raise SystemExit(f"{tail}\n[overhead] {cmd[2]} failed (exit {rc}); its log: {out}/train.log")
    return t0, time.time()


def record_steady_steps(proc, out: str, warmup: int, steps: int):
    """From step `warmup` logged to step `steps` logged, py-spy samples every process of the run (the driver,
    Ray's workers, the vLLM engine) into <out>/profile.txt: py-spy's raw format, one stack and its sample count
    a line, each stack under the processes that started it."""
    def logged() -> int:
        found = glob.glob(os.path.join(out, "tensorboard", "**", "events.out.tfevents.*"), recursive=True)
        return len(read_steps(os.path.join(out, "tensorboard"))) if found else 0

    while logged() < warmup and proc.poll() is None:
        time.sleep(0.5)
    spy = subprocess.Popen([os.path.join(os.path.dirname(sys.executable), "py-spy"), "record", "--pid",
                            str(proc.pid), "--subprocesses", "--rate", str(PROFILE_RATE), "--format", "raw",
                            "--output", os.path.join(out, "profile.txt"), "--nonblocking"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    while logged() < steps and proc.poll() is None:
        time.sleep(0.5)
    spy.send_signal(signal.SIGINT)  # py-spy writes what it sampled and exits
    spy.wait()


def profile_summary(path: str, steps: int, top: int) -> list:
    """Lines: per kind of process (its title: the driver, ray::RolloutRayActor, the engine core, ...) its CPU
    seconds per step, and its `top` functions by self time (the innermost frame), in ms per step."""
    by_kind = {}
    for line in open(path, errors="replace"):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames = stack.split(";")
        last = max(i for i, frame in enumerate(frames) if frame.startswith("process "))
        title = frames[last].partition(":")[2].strip('"').split(" ")
        kind = next((t for t in title if "train_" in t or "::" in t), os.path.basename(title[0]))[:60]
        leaf = frames[-1].split(" (")[0] if last < len(frames) - 1 else "(no Python frame)"
        functions = by_kind.setdefault(kind, {})
        functions[leaf] = functions.get(leaf, 0) + int(count)
    lines = []
    per_step = 1000 / PROFILE_RATE / steps  # ms per sample, per step
    for kind, functions in sorted(by_kind.items(), key=lambda item: -sum(item[1].values())):
        lines.append(f"  {kind}: {sum(functions.values()) * per_step / 1000:.2f} CPU s per step")
        for name, samples in sorted(functions.items(), key=lambda item: -item[1])[:top]:
            lines.append(f"      {samples * per_step:8.1f} ms  {name}")
    return lines


def read_steps(tensorboard_dir: str) -> list:
    """One dict per logged training step, in step order, from a run's tensorboard events: every scalar
    `train/<key>` under <key>, and `wall`, the wall-clock time its step was logged."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    dirs = sorted({os.path.dirname(p) for p in glob.glob(os.path.join(tensorboard_dir, "**", "events.out.tfevents.*"), recursive=True)})
    if len(dirs) != 1:
        raise SystemExit(f"[overhead] expected one run's tensorboard events under {tensorboard_dir}, found {len(dirs)}")
    events = EventAccumulator(dirs[0], size_guidance={"scalars": 0})
    events.Reload()
    steps = {}
    for tag in events.Tags()["scalars"]:
        if tag.startswith("train/"):
            for e in events.Scalars(tag):
                row = steps.setdefault(e.step, {"wall": e.wall_time})
                row[tag[len("train/"):]] = e.value
                row["wall"] = min(row["wall"], e.wall_time)
    return [steps[k] for k in sorted(steps)]


def steady_state(steps: list, side: str, warmup: int) -> dict:
    """Per phase, the median over the steps after `warmup` of each side's own timer; `train+sync`, the training
    phase's wall clock; `wall`, the time from the previous step's log record to this one's; and `tokens`,
    the replies' tokens generated per step (all agents)."""
    keys = KEYS[side]
    missing = [k for k in keys.values() if k not in steps[-1]]
    if missing:
        raise SystemExit(f"[overhead] the {side} run logged no {', '.join(missing)} (its keys: {sorted(steps[-1])})")
    rows = []
    for prev, step in zip(steps, steps[1:]):
        row = {phase: step[key] for phase, key in keys.items()}
        row["train+sync"] = row["train"] + row["sync"]
        row["wall"] = step["wall"] - prev["wall"]
        if side == "openrlhf":
            row["tokens"] = step["rollout/response_length_mean"] * step["rollout/num_samples"]
        else:
            agents = [k[len("agent/"):-len("/num_actions")] for k in step if k.startswith("agent/") and k.endswith("/num_actions")]
            row["tokens"] = sum(step[f"agent/{n}/num_actions"] * step[f"agent/{n}/action_length"] for n in agents)
        rows.append(row)
    kept = rows[warmup - 1 :]  # rows[i] is step i + 2
    if not kept:
        raise SystemExit(f"[overhead] the {side} run logged {len(steps)} steps; none is left after {warmup} of warm-up")
    return {k: statistics.median(r[k] for r in kept) for k in kept[0]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--agents", type=int, default=0,
                   help="0: OpenRLHF vs one-agent MAPPA; K: one-agent vs K-agent MAPPA (training phase)")
    p.add_argument("--steps", type=int, default=8, help="training steps per run")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each run left out")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (--rollout.batch_size)")
    p.add_argument("--samples", type=int, default=2, help="samples per prompt; one optimizer step per step")
    p.add_argument("--micro-batch", type=int, default=8, help="--rollout/--train.micro_batch_size")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-len", type=int, default=384)
    p.add_argument("--timeout", type=float, default=600, help="seconds per training run")
    p.add_argument("--repeats", type=int, default=3, help="runs of each side, interleaved (A B A B ...)")
    p.add_argument("--out", default=os.path.join(REPO, "runs", "bench-overhead"))
    p.add_argument("--profile", action="store_true",
                   help="py-spy records each run's steady steps (every process) into <run>/profile.txt; prints "
                        "where each side's processes spend their CPU per step, by function (self time)")
    p.add_argument("--profile-top", type=int, default=8, help="functions shown per process with --profile")
    a = p.parse_args()
    if not 1 <= a.warmup < a.steps:  # step 1 always goes: it has no previous log record to time it from
        p.error(f"need 1 <= --warmup < --steps; got --warmup {a.warmup}, --steps {a.steps}")
    a.out = os.path.abspath(a.out)
    os.makedirs(a.out, exist_ok=True)
    a.model = os.path.join(a.out, "tiny-model")
    if not os.path.exists(os.path.join(a.model, "config.json")):
        subprocess.run([os.path.join(os.path.dirname(sys.executable), "mappa"), "tiny-model", a.model, "--seed", "0"],
                       check=True, capture_output=True)  # fmt: skip
    with open(os.path.join(a.out, "prompts.jsonl"), "w") as f:
        for i in range(a.prompts * a.steps):
            f.write(json.dumps({"prompt": f"Write the number that follows {i + 7}.", "answer": str(i + 8)}) + "\n")
    with open(os.path.join(a.out, "reward.py"), "w") as f:
        f.write(REWARD_PY)

    if a.agents:  # (label, trainer, agents)
        sides = [("MAPPA, 1 agent", "mappa", 1), (f"MAPPA, {a.agents} agents", "mappa", a.agents)]
    else:
        sides = [("OpenRLHF", "openrlhf", 1), ("MAPPA", "mappa", 1)]
    # The sides take turns (A B A B ...), so that a slow spell of the machine falls on both, not on one side's runs.
    runs = {label: [] for label, _, _ in sides}  # label -> one (steady state, whole run, launch to step 1) a run
    for repeat in range(1, a.repeats + 1):
        for label, side, agents in sides:
            out = os.path.join(a.out, f"{side}-{agents}", str(repeat))
            subprocess.run(["rm", "-rf", out], check=True)
            os.makedirs(out)
            cmd = openrlhf_cmd(a, out) if side == "openrlhf" else mappa_cmd(a, out, agents)
            print(f"[overhead] {label}, run {repeat} of {a.repeats}: {a.steps} steps ... ", end="", flush=True)
            started, ended = train(cmd, out, 2 * agents, a.timeout, (a.warmup, a.steps) if a.profile else None)
            steps = read_steps(os.path.join(out, "tensorboard"))
            if len(steps) != a.steps:
                raise SystemExit(f"[overhead] {label}: {len(steps)} steps logged, expected {a.steps}; "
                                 f"see {out}/train.log")
            runs[label].append((steady_state(steps, side, a.warmup), ended - started, steps[0]["wall"] - started))
            print(f"{ended - started:.0f} s (launch to step 1 logged: {steps[0]['wall'] - started:.0f} s)", flush=True)

    (l1, _, _), (l2, _, _) = sides
    print(f"\nSteady state: median of steps {a.warmup + 1}-{a.steps} in each run, then the median of its {a.repeats} "
          f"runs, seconds ({a.prompts} prompts x {a.samples} samples, <= {a.max_new_tokens} new tokens, one optimizer "
          "step per policy per step; start-up excluded). Ratio: of the medians; spread: the lowest and highest ratio "
          "of a run of the second side to its turn's run of the first")  # fmt: skip
    rows = [("generation (rollout)", "generation"), ("experience", "experience"), ("training", "train"),
            ("sync (weights to vLLM)", "sync"), ("training + sync", "train+sync"),
            ("step (its own timer)", "step"), ("step (wall, log to log)", "wall"),
            ("reply tokens per step", "tokens")]  # fmt: skip
    width = max(len(l1), len(l2), 9)
    print(f"{'phase':<26} {l1:>{width}} {l2:>{width}}  ratio  spread")
    ratios = {}
    for name, key in rows:
        first = [run[0][key] for run in runs[l1]]
        second = [run[0][key] for run in runs[l2]]
        pairs = [b / f for f, b in zip(first, second) if f]
        median_first, median_second = statistics.median(first), statistics.median(second)
        ratios[key] = median_second / median_first if median_first else float("nan")
        spread = f"{min(pairs):.2f}-{max(pairs):.2f}" if pairs else "-"
        print(f"{name:<26} {median_first:>{width}.2f} {median_second:>{width}.2f}  "
              f"{ratios[key]:.2f}   {spread}")
    if a.profile:
        for label, side, agents in sides:
            for repeat in range(1, a.repeats + 1):
                path = os.path.join(a.out, f"{side}-{agents}", str(repeat), "profile.txt")
                if os.path.exists(path):
                    print(f"\nprofile, {label}, run {repeat} (steps {a.warmup + 1}-{a.steps}, py-spy at "
                          f"{PROFILE_RATE} Hz, self time):")
                    print("\n".join(profile_summary(path, a.steps - a.warmup, a.profile_top)))
    startups = [statistics.median(run[2] for run in runs[label]) for label in (l1, l2)]
    walls = [statistics.median(run[1] for run in runs[label]) for label in (l1, l2)]
    print(f"{'launch to step 1 logged':<26} {startups[0]:>{width}.0f} {startups[1]:>{width}.0f}  (not in the ratios)")
    print(f"{'whole run':<26} {walls[0]:>{width}.0f} {walls[1]:>{width}.0f}")
    if a.agents:
        cores = os.cpu_count()
        print(f"\ntraining phase (train + sync), {a.agents} agents / 1 agent: {ratios['train+sync']:.2f} (goal <= 1.3). "
              f"On {cores} cores {a.agents} agents' training cannot take less than {a.agents / min(a.agents, cores):.2f}x "
              "one agent's, if one agent's training keeps one core busy.")  # fmt: skip
    else:
        print(f"\nsteady-state step (wall, log to log), MAPPA / OpenRLHF: {ratios['wall']:.2f} (goal <= 1.05); "
              f"generation {ratios['generation']:.2f} (goal <= 1.05); by their own timers {ratios['step']:.2f}")

if __name__ == "__main__":
    main()
