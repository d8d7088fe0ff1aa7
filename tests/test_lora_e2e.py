"""Per-agent LoRA adapters on one shared base, for real on CPU: the relay's three agents (heuristic coach), each
with its own adapter (topology `lora`) on ONE tiny base model, served by ONE vLLM engine pool (vLLM's LoRA on
its CPU path), β > 0 with the base (the adapter off) as every agent's reference, 2 steps, ZeRO-3, one agent on 2
data-parallel ranks (rank 1 joins the gather of each adapter sync). The run is SIGKILLed once its first team
checkpoint exists, and the same command resumes it.

Asserted after the resume, before any step: every actor is its checkpoint's adapter (`mappa merge-lora` of the
checkpoint's HF export gives its log-probs) and the pool's engine, asked with that agent's adapter, agrees. At the
end: no reference model exists; each agent's adapter changed and differs from the others' (the HF exports, PEFT
format); the base did not change (each actor with its adapter off gives the base's log-probs); the pool's engine
with agent k's adapter gives agent k's actor's log-probs of a fixed sequence, not agent j's; each step logged the
bytes its adapter sync sent against a full model's; on the resumed steps' experience tensors, every row an agent
trained on is one of its own actions, on that action's reward, with the row's mean advantage recorded for it.
(`mappa eval` serving an export of this format: test_eval_e2e.)
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from conftest import (MAPPA, REPO, TINY_RUN_FLAGS, assert_rows_are_their_actions, local_cluster_env, run_training, training,
                      wait_for)

TESTS = os.path.dirname(os.path.abspath(__file__))
AGENTS = ("quantity", "item", "code")


def close(engine_logprobs, actor_logprobs) -> bool:
    """The bf16 engine's probe log-probs against the actor's: 2 bf16 steps at |logprob| 4-8 are 0.0625, and one
    token of 35 was 0.064 apart in a CI run (mean 0.007); another agent's policy is 0.28 apart on average."""
    d = (engine_logprobs - actor_logprobs).abs()
    return d.max().item() < 0.1 and d.mean().item() < 0.02


@pytest.mark.e2e
def test_three_lora_agents_share_one_base_and_one_engine_pool(tmp_path, tiny_model):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from test_openrlhf_cpu_e2e import hf_probe_logprobs

    topology = yaml.safe_load(open(os.path.join(REPO, "examples", "configs", "relay.yaml")))
    for agent in topology["agents"]:
        agent["model"] = tiny_model
        agent["lora"] = {"rank": 8, "alpha": 16}
    topology["agents"][0]["num_gpus_per_node"] = 2  # quantity: 2 ZeRO-3 ranks, whose rank 1 joins each adapter gather
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(topology))
    run_dir, ckpt, final = tmp_path / "run", tmp_path / "ckpt", tmp_path / "final"
    argv = [
        "--mappa.topology", str(tmp_path / "topology.yaml"),
        "--data.prompt_dataset", os.path.join(REPO, "examples", "data", "relay_train.jsonl"),
        "--data.max_samples", "4",  # 2 steps of 2 tasks x 2 samples
        "--mappa.run_dir", str(run_dir),
        *TINY_RUN_FLAGS,
        "--algo.kl.init_coef", "0.01", "--algo.kl.estimator", "k1",  # after TINY_RUN_FLAGS' 0
        "--actor.adam.lr", "5e-2", "--actor.lr_warmup_ratio", "0",
        "--ckpt.save_steps", "1", "--ckpt.save_hf", "--ckpt.load_enable",  # the same command starts and resumes
        "--ckpt.path", str(ckpt), "--ckpt.output_dir", str(final),
    ]  # fmt: skip
    # 4 actor ranks and 1 engine pool, each on a GPU of its own: 5 logical GPUs (a full-weights team would need 7).
    env = local_cluster_env(5)
    marker = ckpt / "mappa_checkpoint.json"
    with training([sys.executable, "-m", "openrlhf_mappa.cli.train_mappa_ray", *argv], tmp_path / "train1", cwd=tmp_path,
                  env=env) as run1:  # its whole process group SIGKILLed at the end of the block
        wait_for(run1, marker.exists, 900, "first team checkpoint")
    saved = json.loads(marker.read_text())["step"]
    assert saved in (1, 2)
    assert "GPUs: pool tiny/vllm" in open(tmp_path / "train1.out").read()

    start_path, end_path, tensors_path = (str(tmp_path / f) for f in ("start.json", "end.json", "tensors.pt"))
    child = (f"import sys; sys.path.insert(0, {TESTS!r}); from test_resume_e2e import resume_and_probe; "
             f"resume_and_probe({argv!r}, {start_path!r}, {end_path!r}, {tensors_path!r})")  # fmt: skip
    proc = run_training([sys.executable, "-c", child], tmp_path / "train2", timeout=1500, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert f"resuming after step {saved}" in proc.stdout

    # Resumed: each adapter back in its actor (DeepSpeed's checkpoint) and in the pool's engine.
    start = json.load(open(start_path))
    assert start["start"] == saved
    merge = lambda n: [MAPPA, "merge-lora", str(ckpt / n / f"global_step{saved}_hf"), str(tmp_path / f"merged-{n}")]
    merges = {n: subprocess.Popen(merge(n), stderr=subprocess.PIPE) for n in AGENTS}  # at once: each imports torch
    for n in AGENTS:
        assert merges[n].wait(timeout=300) == 0, merges[n].stderr.read()[-2000:]
        checkpointed = torch.as_tensor(hf_probe_logprobs(str(tmp_path / f"merged-{n}"), start["probe"]))
        assert (torch.tensor(start["actor"][n]) - checkpointed).abs().max() < 0.05, n
        assert close(torch.tensor(start["engine"][n]), torch.tensor(start["actor"][n])), n

    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:
        for n in AGENTS:
            assert m[f"agent/{n}/updated"] == 1 and m[f"agent/{n}/trained_actions"] == 4
            assert 0 < m[f"agent/{n}/sync_mib"] < m[f"agent/{n}/full_sync_mib"] / 2, m  # the adapter alone travels
    # The resumed steps: each row an agent trained on is one of its own actions, on that action's reward, with the
    # row's mean advantage recorded for it; all 4 of each agent's actions trained; KL, the base's (the adapter off).
    episodes = [json.loads(line) for line in open(run_dir / "episodes.jsonl")]
    steps = torch.load(tensors_path) if os.path.exists(tensors_path) else []  # none when the kill came after step 2
    assert len(steps) == 2 - saved and all(set(s) == set(AGENTS) for s in steps)
    rows = assert_rows_are_their_actions(steps, episodes, AutoTokenizer.from_pretrained(tiny_model), first_step=saved + 1)
    for (step, n), trained in rows.items():
        assert len(trained) == 4, (step, n)
        kl_B = torch.cat([(b["kl"].float() * b["action_mask"]).sum(1) / b["action_mask"].sum(1) for b in steps[step - saved - 1][n]])
        assert metrics[step - 1][f"agent/{n}/kl"] == pytest.approx(kl_B.mean().item(), abs=1e-6), (step, n)

    end = json.load(open(end_path))
    assert end["references"] == ["AdapterOff"] * 3  # no reference model: the base with the adapter off
    base = torch.as_tensor(hf_probe_logprobs(tiny_model, end["probe"]))
    actor = {n: torch.tensor(v) for n, v in end["actor"].items()}
    adapters = {}  # the HF exports, in PEFT format (peft writes .safetensors or .bin)
    for n in AGENTS:
        exported = final / n / "adapter_model.safetensors"
        adapters[n] = load_file(str(exported)) if exported.exists() else torch.load(final / n / "adapter_model.bin")
    for n in AGENTS:
        assert (torch.tensor(end["base"][n]) - base).abs().max() < 0.02, n  # the base did not change
        assert (actor[n] - base).abs().mean() > 0.05, n  # the adapter moved the policy
        lora_b = [v for k, v in adapters[n].items() if "lora_B" in k]
        assert lora_b and all(v.abs().sum() > 0 for v in lora_b), n  # trained from peft's zero init
        engine = torch.tensor(end["engine"][n])
        assert close(engine, actor[n]), n  # the pool with agent n's adapter is agent n's policy
        for o in AGENTS:
            if o != n:
                assert (engine - actor[o]).abs().mean() > 0.05, (n, o)
                assert any(not torch.equal(adapters[n][k], adapters[o][k]) for k in adapters[n]), (n, o)


@pytest.mark.e2e
def test_qlora_agents_train_adapters_on_a_4bit_base_and_resume(tmp_path, tiny_model):
    """--ds.load_in_4bit (QLoRA) for real on CPU: bitsandbytes' nf4 base under OpenRLHF's actor, ZeRO-3 (quantity on 2
    ranks), the pool's engine serving the bf16 base. A 3-step run, then the same command with 3 more steps resumes
    it from DeepSpeed's checkpoint (whose quantization constants upstream's strict load refuses). Both train
    asynchronously with partial rollouts and a queue of 2: the rollout runs up to 2 steps ahead on the one pool while
    its three agents train and sync their adapters (each sync pausing the pool), so each adapter's version must be
    that agent's own, and an action 2 updates old still trains."""
    topology = yaml.safe_load(open(os.path.join(REPO, "examples", "configs", "relay.yaml")))
    for agent in topology["agents"]:
        agent["model"] = tiny_model
        agent["lora"] = {"rank": 8, "alpha": 16}
    topology["agents"][0]["num_gpus_per_node"] = 2
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(topology))
    run_dir, ckpt, final = tmp_path / "run", tmp_path / "ckpt", tmp_path / "final"
    argv = [
        "--mappa.topology", str(tmp_path / "topology.yaml"),
        "--data.prompt_dataset", os.path.join(REPO, "examples", "data", "relay_train.jsonl"),
        "--data.max_samples", "6", "--mappa.run_dir", str(run_dir), *TINY_RUN_FLAGS, "--ds.load_in_4bit",
        "--actor.adam.lr", "5e-2", "--actor.lr_warmup_ratio", "0",
        "--train.async_enable", "--train.partial_rollout_enable", "--train.async_queue_size", "2",
        "--ckpt.save_steps", "1", "--ckpt.load_enable", "--ckpt.path", str(ckpt), "--ckpt.output_dir", str(final),
    ]  # fmt: skip
    env = local_cluster_env(5)
    paths = {k: str(tmp_path / f"{k}.json") for k in ("start1", "end1", "start2", "end2")}
    # Run 2 extends the run by an episode: a change to the run's settings, taken deliberately.
    for run, more in ((1, []), (2, ["--train.num_episodes", "2", "--mappa.allow_resume_changes"])):
        child = (f"import sys; sys.path.insert(0, {TESTS!r}); from test_resume_e2e import resume_and_probe; "
                 f"resume_and_probe({argv + more!r}, {paths[f'start{run}']!r}, {paths[f'end{run}']!r})")
        proc = run_training([sys.executable, "-c", child], tmp_path / f"train{run}", timeout=1200, cwd=tmp_path,
                            env=env)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    start1, end1, start2, end2 = (json.load(open(paths[k])) for k in ("start1", "end1", "start2", "end2"))
    assert "resuming after step 3" in open(tmp_path / "train2.out").read() and start2["start"] == 3

    from openrlhf_mappa.tools.doctor import SAME, sync_verdicts
    from test_dsbench_e2e import assert_async
    from test_openrlhf_cpu_e2e import hf_probe_logprobs

    t = torch.tensor
    for n in AGENTS:
        assert end1["base_layers"][n] == ["Linear4bit"], end1["base_layers"]  # every adapted layer's base is 4-bit
        # The 4-bit base is not the engines' bf16 one, and the adapter off is that 4-bit base.
        quantization = (t(start1["base"][n]) - t(start1["engine_base"][n])).abs()
        print(f"{n}: 4-bit base vs the engine's bf16 base {quantization.mean():.4f} nats mean, "
              f"{quantization.max():.4f} max")
        assert quantization.max() > SAME, n
        assert (t(start1["actor"][n]) - t(start1["base"][n])).abs().max() < 1e-6, n  # peft's B = 0: the base
        # Resumed: each actor is its checkpoint's adapter on the rebuilt 4-bit base, as the first run left it.
        assert (t(start2["actor"][n]) - t(end1["actor"][n])).abs().max() < 1e-3, n
    # Against the untrained adapters: the pool holds each agent's adapter after run 1, after the resume (loaded before
    # the first rollout) and after run 2. (Run 2 alone may move an agent less than the doctor's 0.05: 0.045 seen.)
    for after in (end1, start2, end2):
        verdicts = sync_verdicts(start1, after, quantized=AGENTS)
        assert all(ok for ok, _ in verdicts.values()), verdicts
    # The final HF export is each adapter in PEFT format: merged into the bf16 base, it is what the pool serves.
    merge = lambda n: [MAPPA, "merge-lora", str(final / n), str(tmp_path / f"merged-{n}")]
    merges = {n: subprocess.Popen(merge(n), stderr=subprocess.PIPE) for n in AGENTS}
    for n in AGENTS:
        assert merges[n].wait(timeout=300) == 0, merges[n].stderr.read()[-2000:]
        merged = torch.as_tensor(hf_probe_logprobs(str(tmp_path / f"merged-{n}"), end2["probe"]))
        assert (merged - t(end2["engine"][n])).abs().max() < 0.05, n
    from transformers import AutoModelForCausalLM

    bf16_mib = 2 * sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(tiny_model).parameters()) / 2**20
    metrics = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    # From the records: step t + 2's rollout began before step t's syncs ended, in each run; every action's adapter
    # version is one the pool had loaded for its own agent while it ran; at most 2 behind, the logged staleness.
    episodes = [json.loads(line) for line in open(run_dir / "episodes.jsonl")]
    syncs = [json.loads(line) for line in open(run_dir / "syncs.jsonl")]
    # one sync per agent and step, and its adapter's first load into the pool (step 0), whose version 1 the actions
    # of step 1 carry: "synced before step t trains" is then the syncs of the steps before t
    assert sorted((s["step"], s["agent"]) for s in syncs) == sorted((k, n) for k in range(7) for n in AGENTS)
    assert_async(episodes, syncs, metrics, AGENTS, queue=2, partial=True, runs=((1, 3), (4, 6)))
    for m in metrics:
        for n in AGENTS:
            assert m[f"agent/{n}/updated"] == 1 and m[f"agent/{n}/trained_actions"] == 4
            assert m[f"agent/{n}/logprob_mismatch_abs"] > 0  # sampled on the bf16 base, trained on the 4-bit one
            # What a full sync would send: the bf16 model, its 4-bit layers counted by their unpacked shapes.
            assert m[f"agent/{n}/full_sync_mib"] == pytest.approx(bf16_mib, rel=1e-6)
            assert 0 < m[f"agent/{n}/sync_mib"] < bf16_mib / 2
