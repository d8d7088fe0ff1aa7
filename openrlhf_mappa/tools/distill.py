"""`mappa coach distill`: a reference coach's recorded verdicts fine-tuned into an open-weight coach model.

The data: each action of the runs' episodes.jsonl, its prompt rendered from its recorded coach_request exactly
as the coach was sent it (one user message), its target the reference's reply. The reference is the action's
per-action verdict (in mode both its per_action part; a hindsight-only verdict has no per-action reply), or,
for a trained coach's verdict, the reference judge's verdict recorded with it. With `--mappa.coach.reply text`
the target is the reference's own reply (an LLM coach's rationale, or the reply its verdict cache holds for
that prompt), kept only where parse_score reads back exactly the recorded score; a coach without reply text
(the heuristic coach) gets `{"rationale": ..., "score": ...}`. With `digit` the target is the score rounded to
one digit, 10 written 9. A failed verdict, one without a score, or a reply that reads as another score is
never a target: each skip is counted by reason. Episodes are held out whole, by a seeded draw per episode id.
The same action in two runs gives two identical rows: both are kept, as the reference judged it twice.

OpenRLHF's own train_sft fine-tunes the base model on the training rows; the result is then asked the held-out
prompts greedily and compared with the reference: agreement (mean 1 - |s - s_ref|/10, no score agreeing 0),
Pearson r, the parse-error rate and the confusion by score band (OUT/distill.json).

train_sft gets each prompt rendered here with the chat template's generation prompt and the target as its
continuation: a template may add more to a finished assistant turn than to the generation prompt (Qwen3's
empty <think> block), and a coach samples after the generation prompt, so that is where its first token must
be trained.
"""

import json
import os
import random
import subprocess
import sys
from collections import Counter

from openrlhf_mappa.coach.audit import pearson
from openrlhf_mappa.coach.base import CoachRequest, parse_score, render_prompt
from openrlhf_mappa.tools.rescore import read_actions

BANDS = ("0-2", "2-4", "4-6", "6-8", "8-10")  # [0,2), [2,4), ..., [8,10]
NO_SCORE = "no score"
# train_sft's flags that name the data distill wrote or how it is rendered: a user's value would train on
# something else than what the coach is sent.
OWN_SFT_FLAGS = ("--data.dataset", "--data.input_key", "--data.output_key", "--data.apply_chat_template",
                 "--data.input_template", "--data.tokenizer_chat_template")


def reference_verdict(action: dict) -> tuple:
    """(the reference's verdict as a dict with score, status, coach and its reply text or None, "") or (None,
    why there is none)."""
    verdict = action.get("verdict")
    if verdict and verdict.get("source") == "both":
        verdict = (action.get("verdict_parts") or {}).get("per_action")
    elif verdict and verdict.get("source") == "hindsight":
        return None, "hindsight verdict only"
    if not verdict:
        return None, "no per-action verdict"
    # A trained coach's verdict (or the reference's score it paid, pay_reference) is not the reference's
    # reply.
    if verdict.get("coach") == "trained" or verdict.get("reference"):
        if not verdict.get("reference"):
            return None, "trained coach, reference not asked"
        verdict = {**verdict["reference"], "rationale": None}
    if verdict["status"] != "ok" or verdict.get("score") is None:
        return None, f"reference verdict {verdict['status']}"
    return verdict, ""


def target(verdict: dict, prompt: str, reply: str, score_key: str, caches: list) -> tuple:
    """(the reply to train on, "") or (None, why the verdict gives none)."""
    score = verdict["score"]
    if reply == "digit":
        return str(min(9, int(score + 0.5))), ""
    # A heuristic coach's rationale is prose about the grade, no reply the score is read from.
    if verdict["coach"] == "heuristic":
        return json.dumps({"rationale": verdict["rationale"] or "", "score": score}, ensure_ascii=False), ""
    texts = [verdict["rationale"]] if verdict["rationale"] is not None else []
    for cache in caches:
        hit = cache.get(cache.key(verdict["coach"], prompt))
        texts += [hit.rationale] if hit else []
    if not texts:
        return None, "no reply text (give the run's --cache)"
    text = next((t for t in texts if parse_score(t, score_key) == score), None)
    return (text, "") if text is not None else (None, "reply does not parse to its score")


def build_rows(paths: list, template: str, score_key: str, reply: str = "text",
               held_out_fraction: float = 0.2, seed: int = 0, caches: tuple = ()) -> tuple:
    """(train rows, held-out rows, {skip reason: count}) from the episodes files; a row is {"prompt",
    "response", "score", "episode_id", "agent", "coach"}."""
    train, held, skipped = [], [], Counter()
    for path in paths:
        for episode, action in read_actions(path):
            verdict, why = reference_verdict(action)
            if verdict is None:
                skipped[why] += 1
                continue
            # As rescore rebuilds it: records older than coach_request's agent_input kept the agent's input
            # here.
            context = {"agent_input": action["prompt_text"], **action["coach_request"]}
            request = CoachRequest(episode["episode_id"], action["agent"], action["turn"],
                                   agent_output=action["response_text"], **context)
            prompt = render_prompt(template, request)
            response, why = target(verdict, prompt, reply, score_key, caches)
            if response is None:
                skipped[why] += 1
                continue
            row = {"prompt": prompt, "response": response, "score": verdict["score"],
                   "episode_id": episode["episode_id"], "agent": action["agent"], "coach": verdict["coach"]}
            side = random.Random(f"{seed}/{episode['episode_id']}").random() < held_out_fraction
            (held if side else train).append(row)
    return train, held, dict(skipped)


def render(rows: list, tokenizer) -> None:
    """Each row's sft_prompt, its prompt sent as one user message as a coach sends it (AgentPolicy.prompt_ids,
    vLLM's chat endpoint), and sft_response, its target then the EOS token, the continuation train_sft
    trains."""
    for row in rows:
        row["sft_prompt"] = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                                          tokenize=False, add_generation_prompt=True)
        row["sft_response"] = row["response"] + tokenizer.eos_token


def needed_len(row: dict, tokenizer) -> int:
    """The --data.max_len under which train_sft keeps the row whole: it drops a row whose prompt has max_len -
    2 tokens or more, and cuts prompt and response together to max_len (OpenRLHF's SFTDataset)."""
    prompt = len(tokenizer(row["sft_prompt"], add_special_tokens=False)["input_ids"])
    whole = len(tokenizer(row["sft_prompt"] + row["sft_response"], add_special_tokens=False)["input_ids"])
    return max(whole, prompt + 3)


def band(score) -> str:
    return NO_SCORE if score is None else BANDS[min(4, int(score // 2))]


def report(rows: list, replies: list, score_key: str) -> dict:
    """The distilled coach's replies to the held-out rows against the reference's scores."""
    scores = [parse_score(r, score_key) for r in replies]
    agree = [0.0 if s is None else 1 - abs(s - row["score"]) / 10 for s, row in zip(scores, rows)]
    confusion = {b: {c: 0 for c in (*BANDS, NO_SCORE)} for b in BANDS}
    for s, row in zip(scores, rows):
        confusion[band(row["score"])][band(s)] += 1
    return {"n": len(rows), "agreement": sum(agree) / len(agree),
            "pearson": pearson([(s, row["score"]) for s, row in zip(scores, rows) if s is not None]),
            "parse_error_rate": scores.count(None) / len(rows), "confusion": confusion}


def print_report(metrics: dict, label: str):
    r = metrics["pearson"]
    print(f"\n{label}: {metrics['n']} held-out verdicts, agreement {metrics['agreement']:.3f}, Pearson r "
          f"{'-' if r is None else f'{r:.3f}'}, parse errors {metrics['parse_error_rate']:.1%}")
    print("reference band \\ distilled  " + " ".join(f"{c:>8}" for c in (*BANDS, NO_SCORE)))
    for b, row in metrics["confusion"].items():
        print(f"{b:>26}  " + " ".join(f"{n:>8}" for n in row.values()))


def generate(model_dir: str, texts: list, max_new_tokens: int, batch_size: int = 8) -> list:
    """Greedy replies of the model to each chat-templated prompt (render), on the GPU train_sft just used
    where there is one."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else "cpu"
    tokenizer = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto").to(device).eval()
    replies = []
    for i in range(0, len(texts), batch_size):
        batch = tokenizer(texts[i : i + batch_size], return_tensors="pt", padding=True,
                          add_special_tokens=False)
        batch = batch.to(device)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        replies += tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return replies


def sft_command(model: str, out: str, nproc: int, seed: int, max_len: int, extra: list) -> list:
    """torchrun of OpenRLHF's train_sft on OUT/distill/train.jsonl, its rows rendered already (render: the
    prompt taken as written, "{}"); the user's extra flags come last and win."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
            "-m", "openrlhf.cli.train_sft",
            "--model.model_name_or_path", model,
            "--data.dataset", os.path.join(out, "distill", "train.jsonl"),
            "--data.input_key", "sft_prompt", "--data.output_key", "sft_response",
            "--data.input_template", "{}",
            "--data.max_len", str(max_len),
            "--ckpt.output_dir", out, "--ckpt.path", os.path.join(out, "distill", "checkpoints"),
            "--train.seed", str(seed), *extra]


def fine_tune(command: list, log_path: str) -> None:
    """Run train_sft, its output streamed and kept in `log_path`; its last lines in the error where it
    fails."""
    tail = []
    with open(log_path, "w", encoding="utf-8") as log:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
            tail = (tail + [line])[-30:]
        if proc.wait() != 0:
            raise SystemExit(f"mappa coach distill: train_sft failed (exit {proc.returncode}; its log: "
                             f"{log_path}, remove its directory to rerun); its last lines:\n{''.join(tail)}")


def write_jsonl(path: str, rows: list) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")

