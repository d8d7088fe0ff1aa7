"""`mappa coach distill`: its data from real episode records (rollout with real coaches), the held-out split, the
report's metrics. The real SFT through the CLI runs in test_trained_coach's e2e, which then trains from its result."""

import asyncio
import json
import os
import statistics
import subprocess

import pytest
import yaml

from coach_server import COACH_TEMPLATE, CoachServer
from conftest import MAPPA, REPO
from openrlhf_mappa.coach.base import parse_score
from openrlhf_mappa.coach.cache import VerdictCache
from openrlhf_mappa.tools.distill import build_rows, report
from openrlhf_mappa.coach.heuristic import HeuristicCoach
from openrlhf_mappa.episode import Action, Episode, Verdict
from openrlhf_mappa.rollout import rollout
from openrlhf_mappa.team import load_topology
from test_coach import ScriptedPolicy

KEY = "PROCESS_SCORE"
REPLIES = ["It is 4.", "Maybe 5?", "\\boxed{4}", "\\boxed{5}", "I think 4, since 2+2 = 4.", "4!"]


def play(tmp_path, coach, mode="per_action", name="episodes.jsonl"):
    """A run's episodes.jsonl: 6 episodes of solver + verifier, each a different reply, judged by `coach`."""
    topology_path = tmp_path / "t.yaml"
    topology_path.write_text(yaml.safe_dump({
        "name": "t", "env": "mathchat", "coach_template": COACH_TEMPLATE, "score_key": KEY,
        "agents": [{"name": n, "model": "unused", "role": f"the {n}", "prompt": "{task}"}
                   for n in ("solver", "verifier")],
    }))  # fmt: skip
    topology = load_topology(str(topology_path))

    async def go():
        episodes = []
        for i, reply in enumerate(REPLIES):
            policies = {"solver": ScriptedPolicy(reply), "verifier": ScriptedPolicy(REPLIES[-1 - i])}
            task = [{"id": str(i), "prompt": f"2 + {i}?", "answer": str(2 + i)}]
            episodes += await rollout(topology, task, policies, coach, str(tmp_path / "ws"), 1, coach_mode=mode)
        await coach.aclose()
        return episodes

    path = tmp_path / name
    path.write_text("".join(ep.to_json() + "\n" for ep in asyncio.run(go())))
    return str(path)


def openai_coach(server, cache):
    from openrlhf_mappa.coach.openai_compat import OpenAICoach

    return OpenAICoach("judge", server.base_url, COACH_TEMPLATE, structured="off", score_key=KEY, backoff_s=0.01,
                       cache=VerdictCache(cache))


def records(path):
    return [json.loads(line) for line in open(path)]


def rewrite(path, records_):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records_)


def test_each_prompt_is_the_one_the_coach_was_sent_and_each_target_its_reply(tmp_path):
    # The coach server records each prompt it received; it answers the verifier with prose (no score).
    with CoachServer(mute={"verifier"}) as server:
        path = play(tmp_path, openai_coach(server, str(tmp_path / "cache.sqlite")))
    sent = {r["prompt"] for r in server.requests}
    train, held, skipped = build_rows([path], COACH_TEMPLATE, KEY, held_out_fraction=0.5, seed=1)
    rows = train + held
    assert sorted(r["prompt"] for r in rows) == sorted(p for p in sent if "AGENT=solver" in p)  # byte for byte
    assert {r["agent"] for r in rows} == {"solver"} and {r["coach"] for r in rows} == {"openai:judge"}
    for row in rows:  # the rule server's own reply, which reads back as the recorded score
        output = row["prompt"].split("OUTPUT<<", 1)[1].split(">>OUTPUT", 1)[0]
        assert row["response"] == f"Looks fine.\nPROCESS_SCORE: {len(set(output)) % 11}"
        assert parse_score(row["response"], KEY) == row["score"]
    assert skipped == {"reference verdict parse_error": 6}  # the verifier's prose never becomes a target
    assert train and held

    # Mode both: the per-action part is the reference; hindsight alone gives no per-action reply.
    with CoachServer(mute={"verifier"}) as server:
        both = play(tmp_path, openai_coach(server, str(tmp_path / "both.sqlite")), "both", "both.jsonl")
    train, held, skipped = build_rows([both], COACH_TEMPLATE, KEY, held_out_fraction=0.5, seed=1)
    assert sorted(r["prompt"] for r in train + held) == sorted(r["prompt"] for r in rows)
    assert sorted(r["response"] for r in train + held) == sorted(r["response"] for r in rows)
    assert skipped == {"reference verdict parse_error": 6}
    hindsight = play(tmp_path, HeuristicCoach(), "hindsight", "hindsight.jsonl")
    assert build_rows([hindsight], COACH_TEMPLATE, KEY) == ([], [], {"hindsight verdict only": 12})


def test_failed_or_mismatched_verdicts_never_become_targets(tmp_path):
    with CoachServer() as server:
        path = play(tmp_path, openai_coach(server, str(tmp_path / "cache.sqlite")))
    episodes = records(path)
    actions = [a for ep in episodes for a in ep["actions"]]
    assert len(actions) == 12 and all(a["verdict"]["status"] == "ok" for a in actions)
    actions[0]["verdict"].update(status="timeout", score=None)
    actions[1]["verdict"].update(status="parse_error", score=None)
    wrong = actions[2]["verdict"]  # a reply that reads as another score than the one recorded
    wrong["rationale"] = f"{KEY}: {(wrong['score'] + 1) % 11}"
    actions[3]["verdict"] = None
    rewrite(path, episodes)
    train, held, skipped = build_rows([path], COACH_TEMPLATE, KEY)
    assert skipped == {"reference verdict timeout": 1, "reference verdict parse_error": 1,
                       "reply does not parse to its score": 1, "no per-action verdict": 1}
    assert len(train + held) == 8
    # The cache holds the wrong one's true reply: the cached reply is the target.
    cache = VerdictCache(str(tmp_path / "cache.sqlite"))
    train, held, skipped = build_rows([path], COACH_TEMPLATE, KEY, caches=[cache])
    assert "reply does not parse to its score" not in skipped and len(train + held) == 9


def test_a_trained_coach_run_distills_its_reference_with_the_reply_from_the_cache(tmp_path):
    cache = str(tmp_path / "cache.sqlite")
    with CoachServer() as server:
        path = play(tmp_path, openai_coach(server, cache))
    reference = build_rows([path], COACH_TEMPLATE, KEY, held_out_fraction=0)[0]
    episodes = records(path)
    for i, a in enumerate(a for ep in episodes for a in ep["actions"]):  # as a trained coach records its verdicts
        ref = a["verdict"]
        v = Verdict(None, "parse_error", "7 7 banana", "trained", version=3)
        if i % 3:  # the reference asked about two actions in three
            v.reference = {"score": ref["score"], "status": "ok", "held_out": False, "p": 0.5, "coach": ref["coach"],
                           "tokens_in": 1, "tokens_out": 1, "cached": False}
        a["verdict"] = vars(v)
    rewrite(path, episodes)
    train, _, skipped = build_rows([path], COACH_TEMPLATE, KEY, held_out_fraction=0, caches=[VerdictCache(cache)])
    assert skipped == {"trained coach, reference not asked": 4}
    assert train == [r for i, r in enumerate(reference) if i % 3]  # the reference's replies, from its cache
    _, _, skipped = build_rows([path], COACH_TEMPLATE, KEY)
    assert skipped == {"trained coach, reference not asked": 4, "no reply text (give the run's --cache)": 8}
    digits, _, skipped = build_rows([path], COACH_TEMPLATE, KEY, "digit", held_out_fraction=0)  # no text needed
    assert [r["response"] for r in digits] == [str(min(9, int(r["score"] + 0.5))) for r in train]


def test_a_heuristic_coach_gets_a_json_reply_and_digit_targets_round_with_ten_as_nine(tmp_path):
    path = play(tmp_path, HeuristicCoach())
    text, _, skipped = build_rows([path], COACH_TEMPLATE, KEY, held_out_fraction=0)
    assert len(text) == 12 and not skipped
    for row in text:
        assert parse_score(row["response"], KEY) == row["score"]
        assert json.loads(row["response"])["rationale"].startswith("heuristic coach: ")
    episodes = records(path)
    scores = [2.5, 3.49, 9.5, 10.0, 0.0, 6.0]
    for a, score in zip((a for ep in episodes for a in ep["actions"]), scores):
        a["verdict"]["score"] = score
    rewrite(path, episodes)
    digits, _, _ = build_rows([path], COACH_TEMPLATE, KEY, "digit", held_out_fraction=0)
    assert [r["response"] for r in digits[:6]] == ["3", "3", "9", "9", "0", "6"]
    assert [r["score"] for r in digits[:6]] == scores  # the reference's score stays the report's


def test_episodes_are_held_out_whole_by_a_seeded_draw(tmp_path):
    request = {"role": "r", "task": "t", "task_type": "math", "agent_input": "in", "feedback": "", "round": 0}
    path = tmp_path / "many.jsonl"
    with open(path, "w") as f:
        for i in range(1000):
            actions = [Action(f"e{i}", agent, 0, [], [], prompt_text="in", response_text=f"{agent} {i}",
                              coach_request={**request, "position": k},
                              verdict=Verdict(5.0, "ok", "heuristic coach: fine", "heuristic"))
                       for k, agent in enumerate(("a", "b"))]
            f.write(Episode(f"e{i}", str(i), "math", actions).to_json() + "\n")
    train, held, _ = build_rows([str(path)], COACH_TEMPLATE, KEY, held_out_fraction=0.2, seed=3)
    held_ids = {r["episode_id"] for r in held}
    assert not held_ids & {r["episode_id"] for r in train} and len(train) + len(held) == 2000
    assert len(held) == 2 * len(held_ids) and abs(len(held_ids) / 1000 - 0.2) < 0.05
    again = build_rows([str(path)], COACH_TEMPLATE, KEY, held_out_fraction=0.2, seed=3)[1]
    other = build_rows([str(path)], COACH_TEMPLATE, KEY, held_out_fraction=0.2, seed=4)[1]
    assert again == held and other != held
    # The same run given twice: every row twice (the reference judged each action twice), each on its one side.
    train2, held2, _ = build_rows([str(path)] * 2, COACH_TEMPLATE, KEY, held_out_fraction=0.2, seed=3)
    assert sorted(map(json.dumps, held2)) == sorted(map(json.dumps, held * 2)) and len(train2) == 2 * len(train)


def test_the_report_is_agreement_pearson_parse_errors_and_the_confusion_by_band():
    rows = [{"score": 10.0}, {"score": 4.0}, {"score": 0.0}, {"score": 7.0}]
    replies = [f"{KEY}: 9", "I cannot say.", f"{KEY}: 1", "6"]
    metrics = report(rows, replies, KEY)
    assert metrics["agreement"] == pytest.approx((0.9 + 0 + 0.9 + 0.9) / 4)
    assert metrics["pearson"] == pytest.approx(statistics.correlation((9, 1, 6), (10, 0, 7)))  # scored pairs
    assert metrics["parse_error_rate"] == 0.25 and metrics["n"] == 4
    assert metrics["confusion"]["8-10"]["8-10"] == 1 and metrics["confusion"]["4-6"]["no score"] == 1
    assert metrics["confusion"]["0-2"]["0-2"] == 1 and metrics["confusion"]["6-8"]["6-8"] == 1
    assert sum(n for row in metrics["confusion"].values() for n in row.values()) == 4
    assert report(rows[:1], replies[:1], KEY)["pearson"] is None  # one pair: undefined


FIXTURE = os.path.join(REPO, "tests", "fixtures", "relay_episodes.jsonl")
RELAY = os.path.join(REPO, "examples", "configs", "relay.yaml")
CPU_SFT = ["--train.max_epochs", "1", "--train.batch_size", "4", "--train.micro_batch_size", "2", "--adam.lr", "1e-3",
           "--ds.zero_stage", "3", "--ds.attn_implementation", "sdpa", "--data.max_len", "1024"]


def distill(model, out, *flags):
    """`mappa coach distill` on the recorded relay run, as a user runs it."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    cmd = [MAPPA, "coach", "distill", "--episodes", FIXTURE, "--mappa.topology", RELAY,
           "--model.model_name_or_path", model, "--ckpt.output_dir", str(out), *flags, *CPU_SFT]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


# ---------------------------------------------------------------- what train_sft gets (issue 63)
# Qwen3's chat template in the part that matters here: a finished assistant turn after the last user message
# gets an empty reasoning block that the generation prompt does not.
QWEN3_STYLE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'assistant' and loop.last %}"
    "{{ '<|im_start|>assistant\n<think>\n\n</think>\n\n' + m['content'] + '<|im_end|>\n' }}"
    "{% else %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def coach_base(tmp_path, chat_template=None):
    """A base model directory as distill reads it before train_sft (config and the tiny byte-level tokenizer,
    one token per byte, `chat_template` if given)."""
    from openrlhf_mappa.tools.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = chat_template or tokenizer.chat_template
    base = tmp_path / "base"
    tokenizer.save_pretrained(base)
    (base / "config.json").write_text("{}")
    return str(base)


def judged_run(tmp_path, lengths):
    """An episodes file, one action per episode, the agent's output `lengths[i]` bytes long, judged 0-10 by
    the heuristic coach's verdict format; and the topology."""
    topology = tmp_path / "t.yaml"
    topology.write_text(yaml.safe_dump({
        "name": "t", "env": "mathchat", "coach_template": COACH_TEMPLATE, "score_key": KEY,
        "agents": [{"name": "solver", "model": "unused", "role": "the solver", "prompt": "{task}"}],
    }))  # fmt: skip
    request = {"role": "r", "task": "t", "task_type": "math", "agent_input": "in", "feedback": "", "round": 0,
               "position": 0}
    path = tmp_path / "judged.jsonl"
    with open(path, "w") as f:
        for i, n in enumerate(lengths):
            action = Action(f"e{i}", "solver", 0, [], [], prompt_text="in", response_text="x" * n,
                            coach_request=request, verdict=Verdict(float(i % 11), "ok", "fine", "heuristic"))
            f.write(Episode(f"e{i}", str(i), "math", [action]).to_json() + "\n")
    return str(path), str(topology)


def distill_data(*argv):
    """`mappa coach distill`'s own steps up to train_sft, as its main runs them on these flags."""
    from openrlhf_mappa.tools.mappa import distill_data as data, distill_parser

    args, extra = distill_parser().parse_known_args(list(argv))
    return data(args, extra)


def trained(command):
    """{prompt text: the text of its tokens under the loss mask} for the rows that OpenRLHF's SFTDataset
    (real) keeps of the command's data, its data flags read with train_sft's own defaults."""
    import argparse
    from types import SimpleNamespace

    from datasets import load_dataset
    from openrlhf.datasets import SFTDataset
    from transformers import AutoTokenizer

    p = argparse.ArgumentParser()
    for flag in ("--model.model_name_or_path", "--data.dataset", "--data.input_key", "--data.output_key"):
        p.add_argument(flag)
    p.add_argument("--data.input_template", default="User: {}\nAssistant: ")
    p.add_argument("--data.max_len", type=int, default=2048)
    p.add_argument("--data.apply_chat_template", action="store_true")
    flags = vars(p.parse_known_args(command)[0])
    tokenizer = AutoTokenizer.from_pretrained(flags["model.model_name_or_path"])
    data = SimpleNamespace(input_key=flags["data.input_key"], output_key=flags["data.output_key"],
                           apply_chat_template=flags["data.apply_chat_template"],
                           tokenizer_chat_template=None)
    rows = load_dataset("json", data_files=flags["data.dataset"], split="train")
    dataset = SFTDataset(rows, tokenizer, flags["data.max_len"],
                         SimpleNamespace(args=SimpleNamespace(data=data)),
                         input_template=flags["data.input_template"], num_processors=1)
    out = {}
    for i in range(len(dataset)):
        ids, _, mask = dataset[i]  # the loss mask is shifted: position k trains token k + 1
        out[dataset.prompts[i]] = tokenizer.decode(ids[0, 1:][mask[0, :-1].bool()])
    return out


def test_train_sft_gets_every_row_whole_or_a_row_is_left_out_counted_and_named(tmp_path):
    # Issue 63 (review 3, finding 1): train_sft's default --data.max_len 2048 dropped every prompt over it and
    # cut the replies of the rest, unseen. One byte per token: the output's length sets each row's.
    lengths = [100, 3000, 500, 2500, 50, 4000, 1200, 60, 700, 90]
    path, topology = judged_run(tmp_path, lengths)
    base = coach_base(tmp_path)
    flags = ["--episodes", path, "--mappa.topology", topology, "--model.model_name_or_path", base,
             "--mappa.coach.held_out_fraction", "0.2", "--train.batch_size", "2",
             "--train.micro_batch_size", "1"]
    _, train, held, skipped, left_out, command = distill_data(*flags, "--ckpt.output_dir",
                                                              str(tmp_path / "a"))
    assert not skipped and not left_out and len(train) + len(held) == 10
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    tokens = {r["episode_id"]: len(tokenizer(r["sft_prompt"] + r["sft_response"])["input_ids"])
              for r in train}
    # The longest training row's prompt and target, over train_sft's default 2048
    assert int(command[command.index("--data.max_len") + 1]) == max(tokens.values()) > 2048
    kept = trained(command)
    # each row whole: prompt and target+EOS
    assert {r["sft_prompt"]: r["sft_response"] for r in train} == kept
    assert all(r["sft_response"].endswith("<|im_end|>") for r in train)

    # A user's --data.max_len: the rows it cannot hold whole are left out here, each named with its tokens.
    out = tmp_path / "b"
    _, train2, held2, skipped, left_out, command = distill_data(*flags, "--ckpt.output_dir", str(out),
                                                                "--data.max_len", "2048")
    over = {r["episode_id"] for r in train if r["episode_id"] not in {t["episode_id"] for t in train2}}
    assert over and {r["episode_id"] for r in left_out} == over and held2 == held
    for r in left_out:  # the tokens of its prompt and target as train_sft tokenizes them
        assert r["tokens"] == tokens[r["episode_id"]] > 2048
    assert skipped == {"over --data.max_len 2048": len(over)}
    assert over == {f"e{i}" for i, n in enumerate(lengths) if n >= 2000} - {r["episode_id"] for r in held}
    assert trained(command) == {r["sft_prompt"]: r["sft_response"] for r in train2}
    assert [json.loads(line)["episode_id"] for line in open(out / "distill" / "train.jsonl")] == \
        [r["episode_id"] for r in train2]


@pytest.mark.parametrize("reply", ["digit", "text"])
def test_a_target_is_trained_where_the_coach_samples_it_whatever_the_template_adds(tmp_path, reply):
    # Issue 63 (finding 5): with a Qwen3-style template, train_sft's own chat templating trained
    # "<think>\n\n</think>\n\n7" where the coach samples its first token after the generation prompt alone.
    path, topology = judged_run(tmp_path, [10, 20, 30, 40, 50, 60])
    base = coach_base(tmp_path, QWEN3_STYLE)
    _, train, held, _, _, command = distill_data(
        "--episodes", path, "--mappa.topology", topology, "--model.model_name_or_path", base,
        "--ckpt.output_dir", str(tmp_path / "out"), "--mappa.coach.reply", reply,
        "--mappa.coach.held_out_fraction", "0.3",
        "--train.batch_size", "1", "--train.micro_batch_size", "1")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(base)
    kept = trained(command)
    assert len(kept) == len(train) and held
    # the prefix a coach samples after (AgentPolicy.prompt_ids, vLLM's chat endpoint)
    for row in train + held:
        assert row["sft_prompt"] == tokenizer.apply_chat_template(
            [{"role": "user", "content": row["prompt"]}], tokenize=False, add_generation_prompt=True)
    for row in train:
        expect = ((str(min(9, int(row["score"] + 0.5))) if reply == "digit" else row["response"])
                  + "<|im_end|>")
        assert kept[row["sft_prompt"]] == expect and "<think>" not in kept[row["sft_prompt"]]


def test_a_batch_the_processes_cannot_split_and_a_missing_flash_attn_are_refused_before_any_model_loads(
        tmp_path, monkeypatch):
    # Issue 63 (findings 2, 11). MOCKED: this machine's GPUs (8 reported by detect_gpus; the test machine has
    # none). The docs' --train.batch_size 32 at train_sft's micro-batch 8 over 8 processes was 32 // 8 // 8 =
    # 0 accumulation steps, a ZeroDivisionError after every rank loaded the model; train_sft's default
    # flash-attn failed in every rank's from_pretrained.
    import importlib.util

    from openrlhf_mappa import placement
    from openrlhf_mappa.tools.mappa import main

    assert importlib.util.find_spec("flash_attn") is None  # the CPU environment's
    monkeypatch.setattr(placement, "detect_gpus", lambda: (8, 80.0))
    path, topology = judged_run(tmp_path, [10, 20, 30, 40])
    argv = ["coach", "distill", "--episodes", path, "--mappa.topology", topology,
            "--model.model_name_or_path", coach_base(tmp_path), "--ckpt.output_dir", str(tmp_path / "out"),
            "--train.batch_size", "32"]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert str(e.value) == (  # after the data is read (torch is needed), before any model loads
        "mappa coach distill: 2 problems:\n"
        "- --train.batch_size 32 is not a multiple of --train.micro_batch_size 8 x 8 data-parallel "
        "process(es) (64): train_sft accumulates batch // (micro x processes) micro-batches; give "
        "--nproc_per_node 4, or a --train.batch_size that is a multiple of 64\n"
        "- --ds.attn_implementation flash_attention_2 needs flash-attn's kernels, and the module flash_attn "
        "is not installed here: install flash-attn (`pip install flash-attn==2.8.3 --no-build-isolation`, "
        "built for the torch and CUDA there) or pass --ds.attn_implementation sdpa (more memory at long "
        "contexts)")
    assert not (tmp_path / "out").exists()  # nothing written
    with pytest.raises(SystemExit, match="give --nproc_per_node 6, or a --train.batch_size that is a "
                                         "multiple of 48"):
        main([*argv, "--train.batch_size", "36", "--train.micro_batch_size", "6",
              "--ds.attn_implementation", "sdpa"])
    with pytest.raises(SystemExit, match="give a --train.micro_batch_size that divides 32, or a "
                                         "--train.batch_size"):
        main([*argv, "--train.micro_batch_size", "6", "--ds.attn_implementation", "sdpa"])
    with pytest.raises(SystemExit, match="--nproc_per_node 8: not a multiple of --ds.ring_attn_size x "):
        main([*argv, "--ds.ring_attn_size", "3", "--ds.attn_implementation", "sdpa"])
    # Its fix: the process count named, sdpa. Then the data step runs, and train_sft gets that count.
    *_, command = distill_data(*argv[2:], "--nproc_per_node", "4", "--ds.attn_implementation", "sdpa")
    assert command[command.index("--nproc_per_node") + 1] == "4"


def test_the_report_generates_on_the_gpu_train_sft_used(tiny_model, monkeypatch):
    # Issue 63 (finding 6): the report loaded the model with no device, so generate ran on the CPU beside idle
    # GPUs. MOCKED: a visible GPU (torch.accelerator says one is there; this machine's torch has no CUDA):
    # moving the model there must fail here, where before it generated on the CPU without trying.
    import torch

    from openrlhf_mappa.tools.distill import generate

    assert generate(tiny_model, ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"], 2) != []
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda: torch.device("cuda"))
    with pytest.raises((AssertionError, RuntimeError), match="CUDA|cuda"):
        generate(tiny_model, ["<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"], 2)
