"""Crash-safe resume, for real: a tiny two-agent MAPPA run on CPU (Ray, vLLM, DeepSpeed ZeRO-3) is killed with
SIGKILL (its whole process group: driver, Ray, engines) right after its first team checkpoint, a cut-off line
is left at the end of metrics.jsonl, and the same command resumes it.

Asserted: every agent's resumed actor equals its checkpoint (log-probs of a fixed sequence against the
checkpoint's HF export), its engine got those weights before the first resumed rollout, and metrics.jsonl /
episodes.jsonl end with every step exactly once.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml


AGENTS = ("solver", "verifier")
PROBE_TEXT = "Probe: 7 + 5 = 12, the answer is 12."
TESTS = os.path.dirname(os.path.abspath(__file__))


def resume_and_probe(argv: list, out_path: str):
    """In a child process: resume training with `argv`; before the first resumed step, read each agent's
    actor and engine log-probs of a fixed sequence."""
    import ray
    from vllm import SamplingParams

    from openrlhf_mappa.cli.train_mappa_ray import parse_args, train
    from openrlhf_mappa.trainer import MappaTrainer

    fit = MappaTrainer.fit

    def probe_then_fit(self, start_step=0):
        ids = self.agents[0].tokenizer(PROBE_TEXT)["input_ids"]
        out = {"probe": ids, "start": start_step, "engine": {}, "actor": {}}
        for ag in self.agents:
            gen = ray.get(ag.engines[0].generate.remote(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)))
            out["engine"][ag.spec.name] = [d[t].logprob for t, d in zip(ids[1:], gen.prompt_logprobs[1:])]
            seq = torch.tensor([ids])
            refs = ag.actor.async_run_method_batch(
                method_name="forward", sequences=[seq], action_mask=[torch.ones(1, len(ids) - 1, dtype=torch.bool)],
                attention_mask=[torch.ones_like(seq)],
            )
            out["actor"][ag.spec.name] = ray.get(refs)[0][0].float().tolist()
        with open(out_path, "w") as f:
            json.dump(out, f)
        return fit(self, start_step)

    MappaTrainer.fit = probe_then_fit
    train(parse_args(argv))
    ray.shutdown()


@pytest.mark.e2e
def test_sigkilled_run_resumes_with_weights_and_logs_intact(tmp_path, tiny_model):
    from test_openrlhf_cpu_e2e import hf_probe_logprobs

    topology = yaml.safe_load(open(os.path.join(os.path.dirname(TESTS), "examples", "configs", "mathchat.yaml")))
    topology["agents"] = [dict(a, max_actions=1) for a in topology["agents"] if a["name"] in ("problem_solver", "verifier")]
    for a, name in zip(topology["agents"], AGENTS):
        a["name"] = name
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(topology))
    with open(tmp_path / "tasks.jsonl", "w") as f:
        for i in range(6):  # 3 steps of 2 tasks
            f.write(json.dumps({"id": i, "prompt": f"What is {i} + 2?", "answer": str(i + 2)}) + "\n")
    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    argv = [
        "--mappa.topology", str(tmp_path / "topology.yaml"),
        "--mappa.model", tiny_model,
        "--mappa.run_dir", str(run_dir),
        "--data.prompt_dataset", str(tmp_path / "tasks.jsonl"),
        "--actor.num_gpus_per_node", "1",
        "--vllm.num_engines", "1",
        "--vllm.enforce_eager",
        "--vllm.gpu_memory_utilization", "0.2",
        "--ds.zero_stage", "3",
        "--ds.attn_implementation", "sdpa",
        "--algo.kl.init_coef", "0",
        "--actor.adam.lr", "1e-2",
        "--actor.lr_warmup_ratio", "0",
        "--rollout.batch_size", "2",
        "--rollout.n_samples_per_prompt", "2",
        "--rollout.micro_batch_size", "2",
        "--rollout.max_new_tokens", "12",
        "--data.max_len", "512",
        "--train.batch_size", "4",
        "--train.micro_batch_size", "2",
        "--train.num_episodes", "1",
        "--ckpt.save_steps", "1",
        "--ckpt.save_hf",
        "--ckpt.load_enable",  # the same command starts and resumes
        "--ckpt.path", str(ckpt),
        "--ckpt.output_dir", str(tmp_path / "final"),
    ]  # fmt: skip
    env = dict(os.environ, MAPPA_CPU_NUM_GPUS="4")
    env.pop("RAY_ADDRESS", None)

    # Run 1: SIGKILL the whole process group as soon as the first team checkpoint exists.
    marker = ckpt / "mappa_checkpoint.json"
    log = open(tmp_path / "run1.log", "w")
    run1 = subprocess.Popen([sys.executable, "-m", "openrlhf_mappa.cli.train_mappa_ray", *argv], cwd=tmp_path,
                            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 600
    while not marker.exists():
        assert run1.poll() is None, (tmp_path / "run1.log").read_text()[-4000:]
        assert time.time() < deadline, "no checkpoint within 10 minutes"
        time.sleep(0.2)
    os.killpg(run1.pid, signal.SIGKILL)
    run1.wait()
    log.close()
    saved = json.loads(marker.read_text())["step"]
    assert saved in (1, 2)  # the kill may land after step 2's save, never before step 1's
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "agent/solver/kl": 0.1')  # a line cut off by the kill

    # Run 2: the same command resumes; probe every agent right before its first resumed step.
    child = f"import sys; sys.path.insert(0, {TESTS!r}); from test_resume_e2e import resume_and_probe; resume_and_probe({argv!r}, {str(tmp_path / 'probe.json')!r})"
    proc = subprocess.run([sys.executable, "-c", child], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert f"resuming after step {saved}" in proc.stdout

    result = json.load(open(tmp_path / "probe.json"))
    assert result["start"] == saved
    initial = hf_probe_logprobs(tiny_model, result["probe"])
    for name in AGENTS:
        checkpointed = hf_probe_logprobs(str(ckpt / name / f"global_step{saved}_hf"), result["probe"])
        actor, engine = torch.tensor(result["actor"][name]), torch.tensor(result["engine"][name])
        assert (actor - checkpointed).abs().max() < 0.02, name  # the resumed actor is the checkpoint ...
        assert (engine - actor).abs().max() < 0.02, name  # ... and so is its engine, before any rollout
        assert (checkpointed - initial).abs().mean() > 0.1, name  # (training had moved it: a real check)

    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2, 3]
    steps = [json.loads(line)["step"] for line in open(run_dir / "episodes.jsonl")]
    assert sorted(steps) == [1] * 4 + [2] * 4 + [3] * 4
    assert json.loads(marker.read_text())["step"] == 3
