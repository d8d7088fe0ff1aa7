"""Bad input, round three (issue 27), through the real command lines, the way a new user meets them.

A battery of bad inputs to `train_mappa_ray` and to every `mappa` tool: each is refused before anything starts
(no Ray, and not even torch, vLLM or transformers imported), with a message that names what to fix, no
traceback, exit 1 (argparse's errors: 2, printed first, without the usage). Then: a refused relaunch into an
existing run changes none of its files, and an environment that raises inside one episode ends that episode
only, through the real rollout and training step (scripted policies stand in for vLLM: no model generates).
Refusal times are recorded for the record (printed by the last test; never asserted)."""

import asyncio
import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import assert_documented_episodes, train_step
from test_coach import ScriptedPolicy
from test_launch import GOOD, HEAVY, workdir  # noqa: F401 (a fixture)

from openrlhf_mappa.envs.mathchat import MathChatEnv
from openrlhf_mappa.episode import Verdict, read_jsonl
from openrlhf_mappa.rewards import assign_rewards
from openrlhf_mappa.rollout import SyncGate, rollout


TOPOLOGY = ("name: t\nenv: {env}\ncoach_template: 'Judge {{agent_output}}. End with PROCESS_SCORE: <0-10>'\n{top}"
            "agents:\n  - name: solver\n    model: model\n    role: solves it\n    prompt: '{{task}}'\n{agent}")


def topology(env="mathchat", top="", agent=""):
    return TOPOLOGY.format(env=env, top=top, agent=agent)


def jsonl(*rows):
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


LEVEL_ENV = '''from openrlhf_mappa.envs.mathchat import MathChatEnv


class LevelEnv(MathChatEnv):
    def __init__(self, topology, task, workspace, level=1, **kwargs):
        super().__init__(topology, task, workspace, **kwargs)
        if level not in (1, 2, 3):
            raise ValueError(f"level must be 1, 2 or 3, got {level!r}")
'''
# The second new-user trial's judge: a bare number where a reply was cut off (read as "no grade", or a
# TypeError in the heuristic coach once the run was up).
BARE_JUDGE = '''from openrlhf_mappa.envs.mathchat import MathChatEnv


class BareEnv(MathChatEnv):
    def judge(self, agent, response, feedback, truncated_at):
        return {cut} if truncated_at is not None else super().judge(agent, response, feedback, truncated_at)
'''
OPENAI = ["--mappa.coach.kind", "openai", "--mappa.coach.model", "m", "--mappa.coach.base_url", "http://127.0.0.1:9/v1"]
MARKER = "ckpt/mappa_checkpoint.json"
STEP2 = {MARKER: '{"step": 2}', "ckpt/solver/_actor/latest": "global_step2"}


# Each launcher case adds its flags to a good launch (test_launch.GOOD); LIMITLESS lacks --rollout.max_new_tokens.
_LIMIT = GOOD.index("--rollout.max_new_tokens")
LIMITLESS = GOOD[:_LIMIT] + GOOD[_LIMIT + 2 :]


def case(name, argv, expect, files=None, code=1, tool="train", base=GOOD):
    argv = [*base, *argv] if tool == "train" else argv
    return pytest.param(SimpleNamespace(argv=argv, expect=expect, files=files or {}, code=code, tool=tool), id=name)


# ---------------------------------------------------------------- the launcher
LAUNCHER = [
    # MAPPA's numbers, refused as they are parsed
    case("coach.max_concurrency 0", ["--mappa.coach.max_concurrency", "0"],
         "argument --mappa.coach.max_concurrency: 0 is out of range: expected an integer >= 1", code=2),
    case("coach.max_concurrency -3", ["--mappa.coach.max_concurrency", "-3"],
         "argument --mappa.coach.max_concurrency: -3 is out of range: expected an integer >= 1", code=2),
    case("coach.max_concurrency many", ["--mappa.coach.max_concurrency", "many"],
         "argument --mappa.coach.max_concurrency: 'many' is not an integer", code=2),
    case("coach.format_retries -2", ["--mappa.coach.format_retries", "-2"],
         "argument --mappa.coach.format_retries: -2 is out of range: expected an integer >= 0", code=2),
    case("coach.timeout 0", ["--mappa.coach.timeout", "0"],
         "argument --mappa.coach.timeout: 0 is out of range: expected a number > 0", code=2),
    case("coach.timeout -5", ["--mappa.coach.timeout", "-5"],
         "argument --mappa.coach.timeout: -5 is out of range: expected a number > 0", code=2),
    case("coach.timeout nan", ["--mappa.coach.timeout", "nan"],
         "argument --mappa.coach.timeout: nan is out of range: expected a number > 0", code=2),
    case("coach.neutral_score 50", ["--mappa.coach.neutral_score", "50"],
         "argument --mappa.coach.neutral_score: 50 is out of range: expected a number in [0, 10]", code=2),
    case("coach.max_retries -1", ["--mappa.coach.max_retries", "-1"],
         "argument --mappa.coach.max_retries: -1 is out of range: expected an integer >= 0", code=2),
    case("coach.rpm -10", ["--mappa.coach.rpm", "-10"], "argument --mappa.coach.rpm: -10 is out of range", code=2),
    case("coach.max_tokens -1", ["--mappa.coach.max_tokens", "-1"],
         "argument --mappa.coach.max_tokens: -1 is out of range: expected an integer >= 0", code=2),
    case("coach.bias_window 0", ["--mappa.coach.bias_window", "0"],
         "argument --mappa.coach.bias_window: 0 is out of range: expected an integer >= 1", code=2),
    case("coach.bias_threshold -1", ["--mappa.coach.bias_threshold", "-1"],
         "argument --mappa.coach.bias_threshold: -1 is out of range: expected a number >= 0", code=2),
    case("coach.price_in -0.5", ["--mappa.coach.price_in", "-0.5"],
         "argument --mappa.coach.price_in: -0.5 is out of range: expected a number >= 0", code=2),
    case("gpus -2", ["--mappa.gpus", "-2"],
         "argument --mappa.gpus: -2 is out of range: expected an integer >= 1", code=2),
    case("gpu_memory_gib in MiB", ["--mappa.gpus", "8", "--mappa.gpu_memory_gib", "81559"],
         "argument --mappa.gpu_memory_gib: 81559 is out of range: expected a number in (0, 1024] (GiB; nvidia-smi "
         "shows MiB: divide by 1024)", code=2),
    case("gpu_memory_gib -80", ["--mappa.gpu_memory_gib", "-80"],
         "argument --mappa.gpu_memory_gib: -80 is out of range", code=2),
    # OpenRLHF's numbers that MAPPA honours
    case("train.num_episodes 0", ["--train.num_episodes", "0"],
         "argument --train.num_episodes: 0 is out of range: expected an integer >= 1", code=2),
    case("rollout.micro_batch_size 0", ["--rollout.micro_batch_size", "0"],
         "argument --rollout.micro_batch_size: 0 is out of range: expected an integer >= 1", code=2),
    case("train.micro_batch_size 0", ["--train.micro_batch_size", "0"],
         "argument --train.micro_batch_size: 0 is out of range", code=2),
    case("train.batch_size -4", ["--train.batch_size", "-4"],
         "argument --train.batch_size: -4 is out of range", code=2),
    case("rollout.batch_size 0", ["--rollout.batch_size", "0"],
         "argument --rollout.batch_size: 0 is out of range", code=2),
    case("n_samples_per_prompt 0", ["--rollout.n_samples_per_prompt", "0"],
         "argument --rollout.n_samples_per_prompt: 0 is out of range", code=2),
    case("rollout.max_new_tokens 0", ["--rollout.max_new_tokens", "0"],
         "argument --rollout.max_new_tokens: 0 is out of range", code=2),
    case("data.max_len 0", ["--data.max_len", "0"], "argument --data.max_len: 0 is out of range", code=2),
    case("data.max_samples 0", ["--data.max_samples", "0"], "argument --data.max_samples: 0 is out of range", code=2),
    case("vllm.num_engines -1", ["--vllm.num_engines", "-1"],
         "argument --vllm.num_engines: -1 is out of range", code=2),
    case("vllm.gpu_memory_utilization 1.5", ["--vllm.gpu_memory_utilization", "1.5"],
         "argument --vllm.gpu_memory_utilization: 1.5 is out of range: expected a number in (0, 1]", code=2),
    case("vllm.tensor_parallel_size 0", ["--vllm.tensor_parallel_size", "0"],
         "argument --vllm.tensor_parallel_size: 0 is out of range", code=2),
    case("actor.num_gpus_per_node 0", ["--actor.num_gpus_per_node", "0"],
         "argument --actor.num_gpus_per_node: 0 is out of range", code=2),
    case("rollout.temperature -1", ["--rollout.temperature", "-1"],
         "argument --rollout.temperature: -1 is out of range: expected a number >= 0", code=2),
    case("rollout.top_p 0", ["--rollout.top_p", "0"],
         "argument --rollout.top_p: 0 is out of range: expected a number in (0, 1]", code=2),
    case("algo.kl.init_coef -0.1", ["--algo.kl.init_coef", "-0.1"],
         "argument --algo.kl.init_coef: -0.1 is out of range", code=2),
    case("actor.adam.lr -0.1", ["--actor.adam.lr", "-0.1"], "argument --actor.adam.lr: -0.1 is out of range", code=2),
    # OpenRLHF's assertion named no flag: "The number of sample batches must be greater than or equal to ..."
    case("rollout micro batch above a step's samples", ["--rollout.micro_batch_size", "16"],
         "agent 'solver': a step's 2 samples (--rollout.batch_size 2 x --rollout.n_samples_per_prompt 1) "
         "make 0 micro-batches of --rollout.micro_batch_size 16, fewer than its 1 data-parallel actor ranks "
         "(--actor.num_nodes x --actor.num_gpus_per_node): lower --rollout.micro_batch_size to 2 or raise "
         "--rollout.batch_size"),
    # argparse took an exponent form for a flag: "argument --actor.adam.lr: expected one argument"
    case("actor.adam.lr -1e-3", ["--actor.adam.lr", "-1e-3"],
         "argument --actor.adam.lr: -1e-3 is out of range: expected a number >= 0", code=2),
    case("ds.zero_stage 4", ["--ds.zero_stage", "4"],
         "argument --ds.zero_stage: 4 is out of range: expected an integer in [0, 3]",
         code=2),
    case("train.max_epochs 0", ["--train.max_epochs", "0"], "argument --train.max_epochs: 0 is out of range", code=2),
    case("eval.n_samples_per_prompt 0", ["--eval.n_samples_per_prompt", "0"],
         "argument --eval.n_samples_per_prompt: 0 is out of range", code=2),
    # argparse's own errors: the error first, no usage, a pointer to --help
    case("unknown flag", ["--train.batch_sise", "4"],
         "unrecognized arguments: --train.batch_sise 4\n  --train.batch_sise: "
         "did you mean --train.batch_size?\n(the flags: python -m openrlhf_mappa.cli.train_mappa_ray --help)", code=2),
    case("bad choice", ["--mappa.reward", "proces"], "argument --mappa.reward: invalid choice: 'proces'", code=2),
    # the trained coach's flags merged in issue 54: the old spelling names its replacement
    case("digits_only merged into reply", ["--mappa.coach.digits_only"], "unrecognized arguments: "
         "--mappa.coach.digits_only\n  --mappa.coach.digits_only: replaced by --mappa.coach.reply digit (digits_only "
         "and all_digits together)\n(the flags: python -m openrlhf_mappa.cli.train_mappa_ray --help)", code=2),
    case("all_digits merged into reply", ["--mappa.coach.all_digits"],
         "--mappa.coach.all_digits: replaced by --mappa.coach.reply digit (digits_only and all_digits together)",
         code=2),
    case("agreement_warmup merged into warmup_steps", ["--mappa.coach.agreement_warmup", "3"],
         "unrecognized arguments: --mappa.coach.agreement_warmup 3\n  --mappa.coach.agreement_warmup: replaced by "
         "--mappa.coach.warmup_steps (one warm-up: the agents' and min_agreement's)\n(the flags:", code=2),
    # settings with which a run cannot train
    case("max_len below max_new_tokens", ["--data.max_len", "256", "--rollout.max_new_tokens", "1024"],
         "--rollout.max_new_tokens (1024) must be below --data.max_len (256), which holds the prompt and the reply "
         "together"),
    case("agent max_new_tokens above max_len", ["--data.max_len", "2048"],
         "agent 'solver': its max_new_tokens in the topology (4096) must be below --data.max_len (2048)",
         files={"t.yaml": topology(agent="    max_new_tokens: 4096\n")}),
    case("no max_new_tokens", [], "--rollout.max_new_tokens is required (agent 'solver' sets no max_new_tokens in the "
         "topology)", base=LIMITLESS),
    case("an agent never trains", ["--train.batch_size", "4"],
         "agent 'solver' takes at most 2 actions a step (--rollout.batch_size x --rollout.n_samples_per_prompt x its "
         "actions per episode), fewer than --train.batch_size (4): it would never train"),
    case("lora pool, async, prefix caching", ["--train.async_enable", "--vllm.enable_prefix_caching"],
         "agents solver declare lora: with --train.async_enable their pool's engines keep generating while an adapter "
         "reloads, so --vllm.enable_prefix_caching could serve an agent KV cache computed with its old adapter (vLLM "
         "keys it by adapter name): drop --vllm.enable_prefix_caching, or train synchronously",
         files={"t.yaml": topology(agent="    lora: {rank: 8}\n")}),
    # topology and task files
    case("duplicate agent key", [], "t.yaml: line 10: duplicate key 'max_actions' (first on line 9)",
         files={"t.yaml": topology(agent="    max_actions: 1\n    max_actions: 2\n")}),
    case("duplicate top-level key", [], "t.yaml: line 4: duplicate key 'coach_template' (first on line 3)",
         files={"t.yaml": topology(top="coach_template: 'again {agent_output} PROCESS_SCORE:'\n")}),
    case("duplicate task ids (JSONL)", ["--data.prompt_dataset", "dup.jsonl"],
         "dup.jsonl: line 1 and line 3 have the same id 'a'; give every task its own id",
         files={"dup.jsonl": jsonl({"id": "a", "prompt": "1+1?", "answer": 2}, {"id": "b", "prompt": "2+2?",
                                   "answer": 4}, {"id": "a", "prompt": "3+3?", "answer": 6})}),
    case("duplicate task ids (JSON list)", ["--data.prompt_dataset", "dup.json"],
         "dup.json: row 0 (counting from 0) and row 2 (counting from 0) have the same id '7'",
         files={"dup.json": json.dumps([{"id": 7, "prompt": "a?", "answer": 1}, {"prompt": "b?", "answer": 2},
                                        {"id": "7", "prompt": "c?", "answer": 3}])}),
    case("answer NaN", ["--data.prompt_dataset", "nan.jsonl"],
         "nan.jsonl: line 2: 'answer' is nan, not a finite number",
         files={"nan.jsonl": jsonl({"prompt": "1+1?", "answer": 2}, '{"prompt": "0/0?", "answer": NaN}')}),
    case("answer Infinity", ["--data.prompt_dataset", "inf.jsonl"],
         "inf.jsonl: line 1: 'answer' is inf, not a finite number",
         files={"inf.jsonl": jsonl('{"prompt": "1/0?", "answer": Infinity}', {"prompt": "1+1?", "answer": 2})}),
    case("task id a list", ["--data.prompt_dataset", "ids.jsonl"],
         "ids.jsonl: line 2: 'id' must be a string or a number, got list",
         files={"ids.jsonl": jsonl({"prompt": "1+1?", "answer": 2}, {"id": [1], "prompt": "2+2?", "answer": 4})}),
    case("a column the tasks lack", ["--data.input_key", "question"],
         "tasks.jsonl: line 1: missing 'question' (its columns: prompt, answer; name the task text's with "
         "--data.input_key COLUMN)"),
    case("a missing parquet file (not sent to the Hub)", ["--data.prompt_dataset", "gone.parquet"],
         "--data.prompt_dataset gone.parquet: [Errno 2] No such file or directory: 'gone.parquet' (relative "
         "to {cwd}): give the path of a task file (.json, .jsonl, .csv, .parquet, .arrow) or folder, or a "
         "Hugging Face dataset name"),
    case("a missing eval file", ["--eval.dataset", "gone.json"],
         "--eval.dataset gone.json: [Errno 2] No such file or directory: 'gone.json' (relative to {cwd})"),
    case("probabilities for another count of datasets", ["--data.prompt_probs", "0.5,0.5"],
         "--data.prompt_probs 0.5,0.5: give one probability per dataset of --data.prompt_dataset (1: tasks.jsonl), "
         "each at least 0, summing to 1"),
    case("probabilities not summing to 1", ["--data.prompt_dataset", "tasks.jsonl,tasks.jsonl", "--data.prompt_probs",
                                            "0.5,0.6"], "--data.prompt_probs 0.5,0.6: give one probability per dataset"),
    case("duplicate ids in an eval file", ["--eval.dataset", "evaldup.jsonl"],
         "evaldup.jsonl: line 1 and line 2 have the same id 'q'",
         files={"evaldup.jsonl": jsonl({"id": "q", "prompt": "1+1?", "answer": 2},
                                       {"id": "q", "prompt": "2+2?", "answer": 4})}),
    case("env_kwargs timeout of the wrong type", [],
         "env 'mathchat' (env_kwargs: code_timeout_s) cannot start task '1', the first task: ValueError: "
         "env_kwargs code_timeout_s must be a positive number of seconds, got 'ten'",
         files={"t.yaml": topology(top="env_kwargs: {code_timeout_s: ten}\n")}),
    case("env_kwargs memory negative", [], "env_kwargs code_memory_mb must be a positive integer, got -1",
         files={"t.yaml": topology(top="env_kwargs: {code_memory_mb: -1}\n")}),
    case("env_kwargs sandbox_url not a URL", [],
         "env_kwargs sandbox_url must be the http(s) URL of a SandboxFusion service, "
         "got 'localhost:8080'", files={"t.yaml": topology(top="env_kwargs: {sandbox_url: 'localhost:8080'}\n")}),
    case("dsbench workspace_files unknown", [],  # a contract for its one agent: the value is all that is wrong
         "env 'dsbench' (env_kwargs: workspace_files, contract) cannot start task '1', the first task: "
         "ValueError: env_kwargs workspace_files must be one of stateless, persistent, got 'stateful'",
         files={"t.yaml": topology(env="dsbench", top="env_kwargs: {workspace_files: stateful, contract: {solver: "
                                                      "[a.pkl]}}\n")}),
    case("dsbench coach_evidence unknown", [],
         "env 'dsbench' (env_kwargs: coach_evidence, contract) cannot start task '1', the first task: "
         "ValueError: env_kwargs coach_evidence must be one of authors, ours, got 'theirs'",
         files={"t.yaml": topology(env="dsbench", top="env_kwargs: {coach_evidence: theirs, contract: {solver: "
                                                      "[a.pkl]}}\n")}),
    case("relay goal missing", [], "ValueError: relay env: env_kwargs.goals has no goal for agent(s) ['solver']",
         files={"t.yaml": topology(env="relay", top="env_kwargs: {goals: {other: x}}\n")}),
    case("relay goal not a regex", [], "relay env: env_kwargs.goals['solver'] is not a regular expression: '[a-z'",
         files={"t.yaml": topology(env="relay", top="env_kwargs: {goals: {solver: '[a-z'}}\n")}),
    case("env rejects its own kwarg", [],
         "env 'levelenv:LevelEnv' (env_kwargs: level) cannot start task '1', the first task: "
         "ValueError: level must be 1, 2 or 3, got 7",
         files={"levelenv.py": LEVEL_ENV, "t.yaml": topology(env="levelenv:LevelEnv", top="env_kwargs: {level: 7}\n")}),
    case("env module with a syntax error", [], "env 'brokenenv:Env': module 'brokenenv' has a syntax error: ",
         files={"brokenenv.py": "class Env(:\n    pass\n", "t.yaml": topology(env="brokenenv:Env")}),
    case("env module raising at import", [], "env 'raisingenv:Env': importing module 'raisingenv' raised RuntimeError: "
         "set MY_ENV_HOME first", files={"raisingenv.py": "raise RuntimeError('set MY_ENV_HOME first')\n",
                                         "t.yaml": topology(env="raisingenv:Env")}),
    # coach flags that the coach kind asked for does not read: the run would silently train on another coach
    case("coach URL and model without a coach kind", ["--mappa.coach.base_url", "http://127.0.0.1:9/v1",
                                                      "--mappa.coach.model", "m"],
         "--mappa.coach.model, --mappa.coach.base_url: read by the openai and trained coaches only, and "
         "--mappa.coach.kind is heuristic (the default: the offline rule-based demo coach), which would score every "
         "action while ignoring them: use --mappa.coach.kind openai (an OpenAI-compatible server) or "
         "--mappa.coach.kind trained"),
    case("coach timeout without an LLM coach", ["--mappa.coach.timeout", "300"],
         "--mappa.coach.timeout: read by the openai and trained coaches only"),
    case("trained-coach flags without kind trained", ["--mappa.coach.reply", "digit", "--mappa.coach.lr", "1e-5"],
         "--mappa.coach.reply, --mappa.coach.lr: read by the trained coach only, and --mappa.coach.kind is "
         "heuristic (the default: the offline rule-based demo coach), which would score every action while ignoring "
         "them: use --mappa.coach.kind trained (a coach model trained with the team), or drop them"),
    case("trained-coach flag with kind openai", [*OPENAI, "--mappa.coach.pay_reference"],
         "--mappa.coach.pay_reference: read by the trained coach only, and --mappa.coach.kind is openai"),
    # the coach's cache
    case("coach cache not SQLite", [*OPENAI, "--mappa.coach.cache", "notes.txt"],
         "coach cache notes.txt: not an SQLite database", files={"notes.txt": "my notes\n"}),
    case("coach cache a directory", ["--mappa.coach.cache", "cachedir"], "coach cache cachedir: is a directory",
         files={"cachedir/x": ""}),
    # damaged resume state
    case("cut-off marker", ["--ckpt.load_enable"], f"{MARKER}: the team checkpoint marker is cut off or not JSON",
         files={MARKER: '{"step": 2, "coa'}),
    case("marker step not a number", ["--ckpt.load_enable"],
         f"{MARKER}: 'step' must be the integer step every agent saved (>= 1), got 'two'",
         files={MARKER: '{"step": "two"}'}),
    case("cut-off task list", ["--ckpt.load_enable"],
         "run/train_tasks.json: the record of the run's training tasks is cut off or not JSON",
         files={MARKER: '{"step": 1}', "run/train_tasks.json": '{"source": "tasks.jsonl", "ids": ["1", "2'}),
    case("empty step directory", ["--ckpt.load_enable"], "resume: the checkpoint of agent 'solver' at step 2 "
         "(ckpt/solver/_actor/global_step2) is incomplete: no *model_states.pt (it holds nothing)",
         files={**STEP2, "ckpt/solver/_actor/global_step2/": None}),
    case("step directory missing", ["--ckpt.load_enable"],
         "resume: agent 'solver' has no global_step2 in ckpt/solver/_actor",
         files=STEP2),
    case("empty states file", ["--ckpt.load_enable"],
         "is incomplete: empty files ['zero_pp_rank_0_mp_rank_00_model_states.pt']",
         files={**STEP2, "ckpt/solver/_actor/global_step2/zero_pp_rank_0_mp_rank_00_model_states.pt": ""}),
    case("run_dir is a file", ["--mappa.run_dir", "notes.txt"],
         "--mappa.run_dir notes.txt: exists and is not a directory",
         files={"notes.txt": "x"}),
    # Under a regular file even root cannot create a directory (the tests run as root, whom no permission stops).
    case("run_dir under a file", ["--mappa.run_dir", "notes.txt/run"],
         "--mappa.run_dir notes.txt/run: cannot be created: {cwd}/notes.txt is a file, not a directory",
         files={"notes.txt": "x"}),
    # Not access: a file system that holds no new directories refuses even root (the traceback of a
    # PermissionError).
    case("run_dir on /sys", ["--mappa.run_dir", "/sys/mappa-run"], "--mappa.run_dir /sys/mappa-run: cannot "
                                                                   "be "),
    case("ckpt.path under a file", ["--ckpt.path", "notes.txt/ckpt"],
         "--ckpt.path notes.txt/ckpt: cannot be created: {cwd}/notes.txt is a file, not a directory",
         files={"notes.txt": "x"}),
    case("ckpt.output_dir under a file", ["--ckpt.output_dir", "notes.txt/deep/hf"],
         "--ckpt.output_dir notes.txt/deep/hf: cannot be created: {cwd}/notes.txt is a file, not a directory",
         files={"notes.txt": "x"}),
    case("tensorboard_dir under a file", ["--logger.tensorboard_dir", "notes.txt/tb"],
         "--logger.tensorboard_dir notes.txt/tb: cannot be created: {cwd}/notes.txt is a file",
         files={"notes.txt": "x"}),
    case("CSV row with an unquoted comma", ["--data.prompt_dataset", "gifts.csv"],
         "gifts.csv: line 3: 4 fields, but the header has 3 (id,prompt,answer): put a field that holds a "
         "comma in double quotes", files={"gifts.csv": 'id,prompt,answer\ng1,"1 + 1, please?",2\ng2,2 + 2, '
                                              'please?,4\n'}),
    case("judge returns a bare 0.0", [], "t.yaml: env 'bareenv:BareEnv' on task '1', every agent replying 'A "
         "scripted reply of `mappa check`: 42.', cut off at 64 tokens: ValueError: BareEnv.judge returned "
         "0.0: expected None or a tuple (score: a number in [0, 10], why: str, failed: bool)",
         files={"bareenv.py": BARE_JUDGE.format(cut="0.0"), "t.yaml": topology(env="bareenv:BareEnv")}),
    case("judge returns a bare 0.5", [], "BareEnv.judge returned 0.5: expected None or a tuple",
         files={"bareenv.py": BARE_JUDGE.format(cut="0.5"), "t.yaml": topology(env="bareenv:BareEnv")}),
    case("env not an environment", [], "env 'plainenv:Env': plainenv.Env is not a MultiAgentEnv subclass; write it as "
         "class Env(openrlhf_mappa.envs.base.MultiAgentEnv)",
         files={"plainenv.py": "class Env:\n    def __init__(self, topology, task, workspace):\n        pass\n",
                "t.yaml": topology(env="plainenv:Env")}),
]  # fmt: skip

# ---------------------------------------------------------------- the `mappa` tools
def tool(name, argv, expect, **kwargs):
    return case(name, argv, expect, tool="mappa", **kwargs)


EVAL = ["eval", "--mappa.topology", "t.yaml", "--eval.dataset", "tasks.jsonl", "--mappa.model", "model"]
SCORE = ["coach", "score", "--episodes", "episodes.jsonl", "--out", "rescored.jsonl", "--mappa.coach.kind",
         "heuristic"]
EPISODES = {"episodes.jsonl": jsonl({"episode_id": "e", "actions": []})}
DISTILL = ["coach", "distill", "--episodes", "judged.jsonl", "--mappa.topology", "t.yaml", "--model.model_name_or_path",
           "base", "--ckpt.output_dir", "out"]
_ACTION = {"agent": "solver", "turn": 0, "prompt_text": "2+2?", "response_text": "4",
           "coach_request": {"role": "r", "task": "2+2?", "task_type": "math", "agent_input": "2+2?", "feedback": ""}}
_HEURISTIC = {"score": 5.0, "status": "ok", "rationale": "heuristic coach: fine", "coach": "heuristic"}
JUDGED = {"base/config.json": "{}", "base/tokenizer.json": "{}",  # a model directory check_model accepts
          "judged.jsonl": jsonl(*({"episode_id": f"e{i}", "actions": [{**_ACTION, "verdict": _HEURISTIC}]}
                                  for i in range(4)))}
_FAILED = {**_HEURISTIC, "score": None, "status": "parse_error"}
UNUSABLE = jsonl(*({"episode_id": f"e{i}", "actions": [{**_ACTION, "verdict": v}]}
                   for i, v in enumerate([None, None, _FAILED, _FAILED])))
ADAPTER = {"adapter/adapter_config.json": json.dumps({"base_model_name_or_path": "/no/such/base", "r": 8})}
TOOLS = [
    tool("eval --eval.n_samples_per_prompt 0", [*EVAL, "--eval.n_samples_per_prompt", "0"],
         "mappa eval: error: argument --eval.n_samples_per_prompt: 0 is out of range: expected an integer >= 1",
         code=2),
    tool("eval --eval.temperature -1", [*EVAL, "--eval.temperature", "-1"],
         "argument --eval.temperature: -1 is out of range", code=2),
    tool("eval without task files", EVAL[:3] + EVAL[5:], "mappa eval: give the tasks: --eval.dataset DATASET"),
    tool("eval a coach model without an LLM coach", [*EVAL, "--mappa.coach.model", "judge"],
         "--mappa.coach.model: read by the openai and trained coaches only, and --mappa.coach.kind is heuristic"),
    tool("eval bad topology", EVAL, "mappa eval: t.yaml: unknown key(s) ['coach_templat']",
         files={"t.yaml": topology().replace("coach_template:", "coach_templat:")}),
    tool("eval missing data", [*EVAL[:4], "missing.jsonl", *EVAL[5:]],
         "mappa eval: [Errno 2] No such file or directory: 'missing.jsonl'"),
    tool("eval max-len below max-new-tokens", [*EVAL, "--data.max_len", "100"],
         "--rollout.max_new_tokens (1024) must be below --data.max_len (100)"),
    tool("eval duplicate ids", [*EVAL[:4], "dup.jsonl", *EVAL[5:]], "dup.jsonl: line 1 and line 2 have the same id 'a'",
         files={"dup.jsonl": jsonl({"id": "a", "prompt": "1?", "answer": 1},
                                   {"id": "a", "prompt": "2?", "answer": 2})}),
    tool("eval --out in no directory", [*EVAL, "--out", "nodir/results.json"],
         "mappa eval: --out nodir/results.json: there is no directory"),
    tool("eval --checkpoint without the agent", [*EVAL[:5], "--checkpoint", "exports"],
         "mappa eval: --checkpoint: no model for agent 'solver' at exports/solver", files={"exports/": None}),
    tool("eval --checkpoint with --mappa.model", [*EVAL, "--checkpoint", "exports"],
         "mappa eval: --mappa.model (one model for every agent) or --checkpoint (a run's exports), not both"),
    tool("coach distill missing episodes", [*DISTILL[:3], "missing.jsonl", *DISTILL[4:]],
         "mappa coach distill: [Errno 2] No such file or directory: 'missing.jsonl'", files=JUDGED),
    tool("coach distill no usable verdict", DISTILL, "mappa coach distill: judged.jsonl: no usable reference verdict "
         "(2 no per-action verdict, 2 reference verdict parse_error)", files={**JUDGED, "judged.jsonl": UNUSABLE}),
    tool("coach distill nothing held out", [*DISTILL, "--mappa.coach.held_out_fraction", "0"],
         "judged.jsonl: no held-out verdicts (4 verdicts usable, --mappa.coach.held_out_fraction 0.0); give more "
         "episodes or another fraction", files=JUDGED),
    tool("coach distill a non-empty output", DISTILL, "mappa coach distill: --ckpt.output_dir out: exists and is not "
         "an empty directory; remove it or give another path", files={**JUDGED, "out/old.txt": "x"}),
    tool("coach distill an output under a file", [*DISTILL[:-1], "notes.txt/coach"], "mappa coach distill: "
         "--ckpt.output_dir notes.txt/coach: cannot be created: {cwd}/notes.txt is a file, not a directory",
         files={**JUDGED, "notes.txt": "x"}),
    tool("coach distill no coach template", DISTILL, "mappa coach distill: t.yaml: 'coach_template' is missing",
         files={**JUDGED, "t.yaml": "\n".join(ln for ln in topology().splitlines() if "coach_template" not in ln)}),
    tool("coach distill a missing base model", DISTILL, "--model.model_name_or_path: base is not a Hugging Face model "
         "directory: it has no config.json", files={**JUDGED, "base/config.json": None}),
    tool("coach distill --data.dataset", [*DISTILL, "--data.dataset", "x.jsonl"], "mappa coach distill: "
         "--data.dataset: mappa coach distill sets these to the data it writes", files=JUDGED),
    tool("coach distill a misspelt flag of its own", [*DISTILL, "--mappa.coach.held_out_fractoin", "0.1"],
         "--mappa.coach.held_out_fractoin: did you mean --mappa.coach.held_out_fraction?", code=2, files=JUDGED),
    tool("coach distill a missing cache", [*DISTILL, "--cache", "runs/coach_cache.sqlite"],
         "mappa coach distill: --cache runs/coach_cache.sqlite: no such file", files=JUDGED),
    tool("coach score missing episodes", [*SCORE[:3], "missing.jsonl", *SCORE[4:]],
         "mappa coach score: [Errno 2] No such file or directory: 'missing.jsonl'"),
    tool("coach score JSON list", [*SCORE[:3], "list.jsonl", *SCORE[4:]],
         "mappa coach score: list.jsonl: line 1: a JSON list, not one record (a JSON object) per line",
         files={"list.jsonl": json.dumps([{"episode_id": "e", "actions": []}]) + "\n"}),
    tool("coach score a binary episodes file", [*SCORE[:3], "run.sqlite", *SCORE[4:]],
         "mappa coach score: run.sqlite: line 1: byte 0x89 is not UTF-8: not a JSONL file of a run (one JSON "
         "record per line)", files={"run.sqlite": b"\x89PNG\r\n\x1a\n\x00\x00"}),
    tool("coach score --mappa.coach.max_concurrency 0", [*SCORE, "--mappa.coach.max_concurrency", "0"],
         "argument --mappa.coach.max_concurrency: 0 is out of range", code=2),
    tool("coach score --mappa.coach.timeout 0", [*SCORE, "--mappa.coach.timeout", "0"],
         "argument --mappa.coach.timeout: 0 is out of range", code=2),
    tool("coach score a URL without an LLM coach", [*SCORE, "--mappa.coach.base_url", "http://127.0.0.1:9/v1"],
         "--mappa.coach.base_url: read by the openai and trained coaches only", files=EPISODES),
    # The old spelling, before the coach flags were the training run's (issue 62).
    tool("coach score --kind", [*SCORE[:-2], "--kind", "heuristic"],
         "mappa: error: unrecognized arguments: --kind heuristic\n  --kind: replaced by --mappa.coach.kind "
         "(mappa coach score takes the training run's --mappa.coach.* flags)", code=2),
    tool("coach score --mappa.coach.kind trained", [*SCORE[:-1], "trained"],
         "mappa coach score: error: --mappa.coach.kind trained: a trained coach judges inside its run only", code=2),
    tool("coach score missing template", [*SCORE, "--template", "missing.txt"],
         "mappa coach score: [Errno 2] No such file or directory: 'missing.txt'", files=EPISODES),
    # A template file's fields are checked where it is read, as the topology's are (topology.check_template).
    tool("coach score template with an unknown field", [*SCORE, "--template", "tpl.txt"],
         "mappa coach score: tpl.txt: unknown field {nope}; allowed fields: task, role, agent,",
         files={**EPISODES, "tpl.txt": "Judge {nope}. PROCESS_SCORE:"}),
    tool("coach score review template with a coach field", [*SCORE, "--review-template", "r.txt"],
         "mappa coach score: r.txt: unknown field {agent_output}; allowed fields: task, task_type, trajectory, outcome, "
         "num_actions", files={**EPISODES, "r.txt": "Review {trajectory} {agent_output}"}),
    tool("coach score cache not SQLite", [*SCORE[:-1], "openai", "--mappa.coach.model", "m",
                                         "--mappa.coach.base_url", "http://127.0.0.1:9/v1", "--template", "tpl.txt",
                                         "--mappa.coach.cache", "notes.txt"],
         "mappa coach score: coach cache notes.txt: not an SQLite database",
         files={**EPISODES, "tpl.txt": "{agent_output} PROCESS_SCORE:", "notes.txt": "notes"}),
    tool("report metrics without step", ["report", "r"],
         "mappa report: r/metrics.jsonl: line 1: no integer 'step' (every line of a run's metrics.jsonl has one)",
         files={"r/metrics.jsonl": jsonl({"outcome/success_rate": 0.5})}),
    tool("report --out in no directory", ["report", "r", "--out", "nodir/r.html"],
         "mappa report: --out nodir/r.html: there is no directory", files={"r/metrics.jsonl": jsonl({"step": 1})}),
    tool("merge-lora base model missing", ["merge-lora", "adapter", "merged"],
         "mappa merge-lora: adapter/adapter_config.json: its base model: model '/no/such/base' is not a directory",
         files=ADAPTER),
    tool("merge-lora not an adapter", ["merge-lora", "model", "merged"],
         "mappa merge-lora: model holds no adapter_config.json (not a LoRA agent's export)"),
    tool("merge-lora cut-off config", ["merge-lora", "adapter", "merged"],
         "mappa merge-lora: adapter/adapter_config.json: the adapter's config is cut off or not JSON",
         files={"adapter/adapter_config.json": '{"base_model_name_or_path": "mo'}),
    tool("sandbox run missing file", ["sandbox", "run", "missing.py"],
         "mappa sandbox run: [Errno 2] No such file or directory: 'missing.py'"),
    tool("sandbox run --timeout 0", ["sandbox", "run", "x.py", "--timeout", "0"],
         "argument --timeout: 0 is out of range",
         code=2),
    tool("sandbox run --memory-mb 0", ["sandbox", "run", "x.py", "--memory-mb", "0"],
         "argument --memory-mb: 0 is out of range",
         code=2),
    tool("sandbox run not UTF-8", ["sandbox", "run", "latin1.py"], "mappa sandbox run: latin1.py: not UTF-8 text",
         files={"latin1.py": b"print('caf\xe9')\n"}),
    tool("tiny-model --hidden-size 100", ["tiny-model", "tiny", "--hidden-size", "100"],
         "mappa tiny-model: --hidden-size 100: must be a multiple of 32 (head_dim 32)"),
    tool("tiny-model --layers 0", ["tiny-model", "tiny", "--layers", "0"],
         "argument --layers: 0 is out of range", code=2),
    tool("tiny-model --vocab-size 10", ["tiny-model", "tiny", "--vocab-size", "10"],
         "mappa tiny-model: --vocab-size 10: must be at least 259"),
    tool("tiny-model --init-std 0", ["tiny-model", "tiny", "--init-std", "0"], "argument --init-std: 0 is out of range",
         code=2),
    tool("tiny-model out_dir is a file", ["tiny-model", "notes.txt"],
         "mappa tiny-model: notes.txt: exists and is not a "
         "directory", files={"notes.txt": "x"}),
    # --task-text raw: no cleaned prompts beside these metadata files, whose own faults are what is checked
    tool("dsbench import metadata not records", ["dsbench", "import", "--data-root", ".", "--metadata", "meta.json",
                                                 "--out", "pack", "--task-text", "raw"],
         "mappa dsbench import: meta.json: entry 1 is not a task's record", files={"meta.json": "[1, 2]"}, code=2),
    tool("dsbench score a directory", ["dsbench", "score", "--task-dir", ".", "--submission", "ws"],
         "mappa dsbench score: --submission ws: a directory; give the submission's CSV file "
         "(ws/submission.csv is there)", files={"ws/submission.csv": "id,y\n1,2\n"}, code=2),
    tool("dsbench import data root missing", ["dsbench", "import", "--data-root", "nowhere", "--metadata", "meta.json",
                                              "--out", "pack", "--task-text", "raw"],
         "mappa dsbench import: --data-root nowhere: not a directory", files={"meta.json": jsonl({"metadata": {}})},
         code=2),
    tool("dsbench import cleaned prompts missing", ["dsbench", "import", "--data-root", ".", "--metadata",
                                                    "data/meta.json", "--out", "pack"],
         "mappa dsbench import: no data/dsbench_modeling_cleaned_prompts.json (looked for beside --metadata): the "
         "agents' task text is the authors' cleaned one by default; get dsbench_modeling_cleaned_prompts.json from "
         "https://github.com/ltjed/multiagent-coaching (data/Bench/) and put it there or pass --cleaned-prompts "
         "PATH, or pass --task-text raw to give the agents DSBench's raw Kaggle text",
         files={"data/meta.json": jsonl({"metadata": {}})}, code=2),
    tool("dsbench import cleaned prompt not text", ["dsbench", "import", "--data-root", ".", "--metadata", "meta.json",
                                                    "--out", "pack", "--cleaned-prompts", "c.json"],
         "mappa dsbench import: c.json: entry 'toy' has no \"cleaned_prompt\" text",
         files={"meta.json": jsonl({"metadata": {}}), "c.json": json.dumps({"toy": {"prompt": "x"}})}, code=2),
    tool("dsbench import cleaned prompts with raw text", ["dsbench", "import", "--data-root", ".", "--metadata",
                                                          "meta.json", "--out", "pack", "--task-text", "raw",
                                                          "--cleaned-prompts", "c.json"],
         "mappa dsbench import: --cleaned-prompts goes with --task-text cleaned (the default), not raw",
         files={"meta.json": jsonl({"metadata": {}})}, code=2),
    tool("plan gpu memory in MiB", ["plan", *GOOD, "--mappa.gpus", "8", "--mappa.gpu_memory_gib", "81559"],
         "mappa plan: error: argument --mappa.gpu_memory_gib: 81559 is out of range", code=2),
    tool("plan negative GPUs", ["plan", *GOOD, "--mappa.gpus", "-1", "--mappa.gpu_memory_gib", "80"],
         "mappa plan: error: argument --mappa.gpus: -1 is out of range: expected an integer >= 1", code=2),
    tool("plan with a coach URL and no coach kind", ["plan", *GOOD, "--mappa.coach.base_url", "http://x:8001/v1",
                                                     "--mappa.gpus", "8", "--mappa.gpu_memory_gib", "80"],
         "--mappa.coach.base_url: read by the openai and trained coaches only"),
    tool("plan env_kwargs typo", ["plan", *GOOD, "--mappa.gpus", "8", "--mappa.gpu_memory_gib", "80"],
         "mappa plan: t.yaml: env_kwargs do not fit mathchat: unknown key(s) 'code_timout_s' (did you mean "
         "'code_timeout_s'?); MathChatEnv takes code_timeout_s,", files={"t.yaml": topology(top="env_kwargs: {code_timout_s: 5}\n")}),
    tool("plan zero GPUs", ["plan", *GOOD, "--mappa.gpus", "0", "--mappa.gpu_memory_gib", "80"],
         "argument --mappa.gpus: 0 is out of range", code=2),
]  # fmt: skip


def run_cli(cwd, tool: str, argv: list):
    """The real command in a fresh interpreter, `-X importtime` listing every module it imported."""
    module = "openrlhf_mappa.cli.train_mappa_ray" if tool == "train" else "openrlhf_mappa.tools.mappa"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RAY_ADDRESS", "MAPPA_TRACEBACK", "HF_HUB_OFFLINE", "MAPPA_CPU_NUM_GPUS")}  # fmt: skip
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", module, *argv], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)
    proc.imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines()
                     if line.startswith("import time:")}
    proc.message = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("import time:"))
    return proc


def write_files(root, files: dict):
    for name, content in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if content is None:  # a directory
            path.mkdir(exist_ok=True)
        elif isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content)


@pytest.mark.parametrize("bad", LAUNCHER + TOOLS)
def test_bad_input_is_refused_before_anything_starts(workdir, bad):  # noqa: F811 (the workdir fixture)
    write_files(workdir, {"t.yaml": topology(), "tasks.jsonl": jsonl(*({"prompt": f"{i} + 1?", "answer": i + 1}
                                                                       for i in range(4)))})  # fmt: skip
    write_files(workdir, bad.files)
    proc = run_cli(workdir, bad.tool, bad.argv)
    assert proc.returncode == bad.code, proc.message[-3000:]
    expect = bad.expect.replace("{cwd}", str(workdir))
    assert expect in proc.message, proc.message[-3000:]  # names the flag, value and range, or the file and line
    assert "Traceback" not in proc.message and "usage:" not in proc.message
    if bad.code == 2:  # argparse's: the error is the first line
        assert proc.message.splitlines()[0].startswith(("train_mappa_ray: error: ", "mappa")), proc.message[:500]
    assert "Started a local Ray instance" not in proc.stdout + proc.message
    assert not {m.split(".")[0] for m in proc.imported} & HEAVY  # before torch, Ray, vLLM or transformers load


def test_an_unknown_dataset_name_says_what_was_tried(workdir):  # noqa: F811
    # Offline (no network here): without HF_HUB_OFFLINE, the same message comes after the Hub client's retries.
    from test_launch import assert_refused, cli

    write_files(workdir, {"t.yaml": topology()})
    proc = cli(workdir, GOOD + ["--data.prompt_dataset", "nosuch/tasks"], "unknown dataset", HF_HUB_OFFLINE="1")
    assert_refused(proc, "unknown dataset", "nosuch/tasks: OpenRLHF's blending_datasets cannot load it (a name that is "
                   "no local file or folder is looked up on the Hugging Face Hub): ConnectionError: Couldn't reach "
                   "'nosuch/tasks' on the Hub (OfflineModeIsEnabled)")


def test_several_mistakes_are_named_in_one_refusal(workdir):  # noqa: F811
    # Three independent mistakes (a token limit, an async-only flag, a flag the coach kind does not read): one
    # launch names them all, each on its own line with its fix, not one per launch.
    write_files(workdir, {"t.yaml": topology(), "tasks.jsonl": jsonl({"prompt": "1 + 1?", "answer": 2})})
    proc = run_cli(workdir, "train", [*GOOD, "--data.max_len", "32", "--mappa.max_staleness", "1",
                                      "--mappa.coach.timeout", "300"])
    assert proc.returncode == 1, proc.message[-3000:]
    assert proc.message == (
        "3 problems:\n"
        "- --rollout.max_new_tokens (64) must be below --data.max_len (32), which holds the prompt and the reply "
        "together: no prompt would fit, and every action would be skipped\n"
        "- --mappa.max_staleness applies to --train.async_enable: synchronous training is on-policy\n"
        "- --mappa.coach.timeout: read by the openai and trained coaches only, and --mappa.coach.kind is heuristic (the "
        "default: the offline rule-based demo coach), which would score every action while ignoring it: use "
        "--mappa.coach.kind openai (an OpenAI-compatible server) or --mappa.coach.kind trained (a coach model trained "
        "with the team), or drop it"), proc.message[-3000:]
    assert not {m.split(".")[0] for m in proc.imported} & HEAVY


def test_the_battery_is_at_least_sixty_inputs():
    assert len(LAUNCHER) + len(TOOLS) >= 60


def test_traceback_on_request_from_a_tool(workdir):  # noqa: F811
    (workdir / "t.yaml").write_text(topology())
    env = dict(os.environ, MAPPA_TRACEBACK="1")
    proc = subprocess.run([sys.executable, "-m", "openrlhf_mappa.tools.mappa", *EVAL[:4], "missing.jsonl",
                           *EVAL[5:]], cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" in proc.stderr and "FileNotFoundError" in proc.stderr


def test_new_flags_are_range_checked(capsys):
    from openrlhf_mappa.cli.train_mappa_ray import parse_args

    for flag, value in (("--mappa.max_untrained_steps", "-1"), ("--mappa.env.max_failure_fraction", "1.5")):
        with pytest.raises(SystemExit) as e:
            parse_args(["--mappa.topology", "t.yaml", flag, value])
        assert e.value.code == 2 and f"argument {flag}: {value} is out of range" in capsys.readouterr().err
    args = parse_args(["--mappa.topology", "t.yaml"])
    assert (args.mappa.max_untrained_steps, args.mappa.env.max_failure_fraction) == (3, 0.5)


# ---------------------------------------------------------------- a refused relaunch changes nothing


def snapshot(*roots) -> dict:
    """Every file under the roots: its bytes and its modification time (a rewrite with the same bytes shows)."""
    out = {}
    for root in roots:
        for dirpath, dirnames, filenames in os.walk(root):
            out.update({os.path.join(dirpath, d): "dir" for d in dirnames})
            for name in filenames:
                path = os.path.join(dirpath, name)
                with open(path, "rb") as f:
                    out[path] = (f.read(), os.stat(path).st_mtime_ns)
    return out


def test_a_refused_relaunch_changes_no_file_of_an_existing_run(workdir):  # noqa: F811
    # Catches the old launcher, which wrote train_tasks.json (16 ids -> 8 here) and opened the coach's cache
    # before its later checks: relaunched with another --data.max_samples and a mistyped --eval.dataset, it was
    # refused, but the run's own resume was refused afterwards.
    from openrlhf_mappa.cli.train_mappa_ray import choose_train_tasks
    from openrlhf_mappa.coach.cache import VerdictCache
    from openrlhf_mappa.envs.base import load_tasks
    from openrlhf_mappa.episode import Verdict

    write_files(workdir, {"t.yaml": topology(), "tasks.jsonl": jsonl(*({"prompt": f"{i} + 1?", "answer": i + 1}
                                                                       for i in range(16)))})  # fmt: skip
    ids = [t["id"] for t in choose_train_tasks(load_tasks(str(workdir / "tasks.jsonl")), 10**8, 42)]
    step_dir = "ckpt/solver/_actor/global_step2/"
    write_files(workdir, {  # the run as its first launch left it, killed after step 2's team checkpoint
        "run/train_tasks.json": json.dumps({"source": str(workdir / "tasks.jsonl"), "seed": 42, "total": 16,
                                            "max_samples": 10**8, "ids": ids}, indent=1),
        "run/metrics.jsonl": jsonl({"step": 1, "outcome/success_rate": 0.0}, {"step": 2, "outcome/success_rate": 0.5}),
        "run/episodes.jsonl": jsonl({"episode_id": "s1-1-x", "step": 1, "actions": []}), "run/train.log": "log\n",
        MARKER: json.dumps({"step": 2, "coach_cost_usd": 0.0}), "ckpt/solver/_actor/latest": "global_step2",
        step_dir + "zero_pp_rank_0_mp_rank_00_model_states.pt": "states",
        step_dir + "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt": "optim",
    })  # fmt: skip
    cache = VerdictCache(str(workdir / "run" / "coach_cache.sqlite"))  # the default cache, with one verdict
    cache.put("k", Verdict(7.0, "ok"))
    cache.close()
    before = snapshot(workdir / "run", workdir / "ckpt")
    relaunches = {
        "another subset and a mistyped eval file": (["--data.max_samples", "8", "--eval.dataset", "typo.jsonl"],
                                                    "No such file or directory: 'typo.jsonl'"),
        "a resume with another seed": (["--ckpt.load_enable", "--train.seed", "7", "--data.max_samples", "8"],
                                       "lists other training tasks"),
        "an unreachable coach": (OPENAI, "coach server http://127.0.0.1:9/v1/models cannot be reached"),
        "a coach number out of range": (["--mappa.coach.max_concurrency", "0"], "out of range"),
        "env_kwargs the env rejects": (["--mappa.topology", "bad.yaml"], "must be a positive integer, got -1"),
    }
    (workdir / "bad.yaml").write_text(topology(top="env_kwargs: {code_max_processes: -1}\n"))
    for name, (flags, message) in relaunches.items():
        proc = run_cli(workdir, "train", [*GOOD, *flags])
        assert proc.returncode != 0 and message in proc.message, (name, proc.message[-2000:])
        assert snapshot(workdir / "run", workdir / "ckpt") == before, f"{name}: the refused launch changed the run"


# ---------------------------------------------------------------- an environment that raises in one episode


class FlakyEnv(MathChatEnv):
    """MathChat whose step raises on the second agent's action in the tasks whose id starts with 'bad', as a bug
    in a user's environment would."""

    def step(self, agent, turn, response):
        if self.task["id"].startswith("bad") and agent.name == "solver":
            return {}["the env's own bug"]
        return super().step(agent, turn, response)


class CutOffPolicy(ScriptedPolicy):
    """A reply whose generation hit the token limit."""

    max_new_tokens = 8

    async def generate(self, prompt_ids):
        return [4] * self.max_new_tokens, True, []


def scripted_trainer(tmp_path, tasks, monkeypatch, *flags, policy=None):
    """A real MappaTrainer (the real args, topology, rollout, coach, rewards, batch rule, metrics and logs) whose
    agents have no Ray components: scripted policies generate, and a --train.batch_size larger than a step's
    actions keeps every step before the part that needs Ray actors (no agent trains)."""
    from openrlhf_mappa import trainer as trainer_module
    from openrlhf_mappa.console import console as run_console
    from openrlhf_mappa.launch import Agent
    from openrlhf_mappa.cli.train_mappa_ray import parse_args
    from openrlhf_mappa.coach.heuristic import HeuristicCoach
    from openrlhf_mappa.placement import agent_args
    from openrlhf_mappa.team import load_topology

    (tmp_path / "t.yaml").write_text(topology(env="test_bad_input:FlakyEnv").replace(
        "agents:\n", "agents:\n  - {name: checker, model: model, role: checks it, prompt: '{task}'}\n"))
    args = parse_args(["--mappa.topology", str(tmp_path / "t.yaml"), "--mappa.run_dir", str(tmp_path / "run"),
                       "--rollout.batch_size", str(len(tasks)), "--rollout.max_new_tokens", "8",
                       "--train.batch_size", "64", "--train.num_episodes", "5", "--actor.num_gpus_per_node", "1",
                       *flags])  # fmt: skip
    topology_ = load_topology(args.mappa.topology)
    agents = [Agent(spec, agent_args(args, spec), tokenizer=None, engines=[], actor=object(), ref=None,
                                   trainer=SimpleNamespace(adapter=None, kl_ctl=SimpleNamespace(value=0.0), gate=SyncGate())) for spec in topology_.agents]
    trainer = trainer_module.MappaTrainer(args, topology_, agents, HeuristicCoach(), tasks, args.mappa.run_dir)
    policy = policy or ScriptedPolicy
    trainer.policies = {"checker": policy("It is 2."), "solver": policy("So \\boxed{2}.")}
    monkeypatch.setattr(run_console, "out", sys.stdout)  # captured
    monkeypatch.setattr(run_console, "err", sys.stdout)
    return trainer


def test_an_environment_raising_in_one_episode_neither_stops_nor_corrupts_the_run(tmp_path, monkeypatch, capsys):
    # Catches the old rollout, where the exception went up through asyncio.gather and ended the whole run.
    tasks = [{"id": i, "prompt": "What is 1 + 1?", "answer": "2", "type": ""} for i in ("t1", "bad", "t3", "t4")]
    trainer = scripted_trainer(tmp_path, tasks, monkeypatch)
    first = train_step(trainer, 1, tasks)
    assert first["outcome/env_failed_episodes"] == 1 and first["outcome/success_rate"] == 0.75
    out = capsys.readouterr().out
    assert ("[mappa] step 1: 1 of 4 episodes ended with an exception in the environment (they train nothing). First: "
            "FlakyEnv.step raised KeyError: \"the env's own bug\" (") in out and "test_bad_input.py, line" in out
    second = train_step(trainer, 2, tasks)  # the run goes on
    episodes = [ep for _, ep in read_jsonl(str(tmp_path / "run" / "episodes.jsonl"))]
    assert assert_documented_episodes(str(tmp_path / "run" / "episodes.jsonl"))["episode"] == 8  # the documented record
    assert [(ep["step"], ep["task_id"], bool(ep["env_error"])) for ep in episodes] == [
        (s, t["id"], t["id"] == "bad") for s in (1, 2) for t in tasks]  # every episode of both steps, whole, in order
    for ep in episodes:
        if ep["task_id"] == "bad":  # the checker acted, then the env raised on the solver's action
            assert ep["outcome"] == {"success": False} and "FlakyEnv.step raised KeyError" in ep["env_error"]
            (action,) = ep["actions"]  # the checker's: kept with its verdict, never trained on
            assert action["agent"] == "checker" and action["verdict"]["status"] == "ok" and action["reward"] is None
        else:  # the others as if nothing happened: both actions scored and rewarded, the task solved
            assert ep["outcome"]["success"] and [a["agent"] for a in ep["actions"]] == ["checker", "solver"]
            assert all(a["verdict"]["status"] == "ok" and a["reward"] is not None for a in ep["actions"])
    assert second["outcome/env_failed_episodes"] == 1 and second["coach/verdicts_ok"] == 7

    # Too many such episodes in a step stop the run, as coach failures do, with the step's records kept.
    bad = [dict(t, id=f"bad{i}") if i else t for i, t in enumerate(tasks)]
    with pytest.raises(RuntimeError, match=r"step 3: 3 of 4 episodes ended with an exception in the environment .* more "
                                         r"than --mappa.env.max_failure_fraction 0.5 of them"):
        train_step(trainer, 3, bad)
    assert [ep["step"] for _, ep in read_jsonl(str(tmp_path / "run" / "episodes.jsonl"))].count(3) == 4
    last = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])
    assert (last["step"], last["outcome/env_failed_episodes"]) == (3, 3)


def test_a_step_that_trains_nothing_says_why_and_a_run_that_never_trains_stops(tmp_path, monkeypatch, capsys):
    # Catches the old trainer, which logged 0 trained actions for every agent and went on without a word.
    tasks = [{"id": f"t{i}", "prompt": "What is 1 + 1?", "answer": "2", "type": ""} for i in range(4)]
    # usable: the cut-off actions leave the batch (by default they are zero-loss rows, which need Ray actors here;
    # tests/test_trainer_units.py checks that such a batch alone counts as trained on nothing)
    trainer = scripted_trainer(tmp_path, tasks, monkeypatch, "--train.batch_size", "4", "--mappa.batch_semantics",
                               "usable", policy=CutOffPolicy)
    with pytest.raises(RuntimeError, match="no agent trained") as stopped:  # trainer.RunStopped
        trainer.fit()
    out = capsys.readouterr().out
    said = ("agent 'checker' trained on nothing: 4 of its 4 actions cut off at --rollout.max_new_tokens (8 tokens) and "
            "left out: raise it, or train them with --mappa.train_truncated")
    assert [f"[mappa] step {s}: {said}" in out for s in (1, 2, 3, 4)] == [True, True, True, False]
    assert str(stopped.value).startswith("no agent trained in 3 steps in a row (--mappa.max_untrained_steps 3); at "
                                         "step 3, " + said.replace(" trained on nothing:", ":"))
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 3  # each step logged, then the stop

    # The other reasons, with the flags that change them: no coach score, left over for batching.
    (ep,) = asyncio.run(rollout(trainer.topology, tasks[:1], {n: ScriptedPolicy("x") for n in ("checker", "solver")},
                                trainer.rollout_coach, str(tmp_path / "ws"), 1))  # fmt: skip
    ep.actions[0].verdict = Verdict(None, "parse_error")
    assign_rewards([ep], "process")
    checker, solver = trainer.agents
    from openrlhf_mappa.health import untrained_reasons

    reasons = untrained_reasons([checker, solver], trainer.owner, [ep], {"checker": 0, "solver": 1}, False)
    assert reasons["checker"] == (
        "1 of its 1 actions without a coach score (parse_error 1): --mappa.coach.on_failure outcome or neutral trains "
        "them")
    assert reasons["solver"] == (
        "1 of its 1 actions left over by the batch rule, less than one --train.batch_size (4) batch: lower "
        "--train.batch_size, or raise --rollout.batch_size")



def test_help_shows_each_default_and_lists_the_refused_flags_apart():
    # --help once listed the 58 refused OpenRLHF flags among the usable ones, with no default shown anywhere, and
    # `mappa doctor --help` said `usage: train_mappa_ray`.
    from openrlhf_mappa.cli.flags import REFUSED, REFUSED_WHY

    env = dict(os.environ, COLUMNS="1000")  # argparse wraps at the terminal's width: one line per flag here
    help_of = lambda *argv: subprocess.run([sys.executable, "-m", *argv, "--help"], capture_output=True, text=True,
                                           env=env, timeout=120)
    train = help_of("openrlhf_mappa.cli.train_mappa_ray")
    assert train.returncode == 0 and train.stdout.startswith("usage: train_mappa_ray --mappa.topology YAML")
    usable, refused = train.stdout.split("OpenRLHF's flags that MAPPA refuses (given, each stops the launch), and why:")
    flags = lambda text: {line.split()[0] for line in text.splitlines() if line.startswith("  --")}
    assert {f"--{flag}" for flag in REFUSED_WHY if flag != "ds.lora"} | {"--ds.lora.rank"} <= flags(refused)
    assert not flags(refused) & flags(usable)
    assert f"--critic.num_nodes CRITIC.NUM_NODES\n                        {REFUSED} (default: 1)\n" in refused
    assert "seconds per coach request (default: 60.0)\n" in usable
    assert "--ckpt.max_num CKPT.MAX_NUM\n                        OpenRLHF's (train_ppo_ray) (default: 3)\n" in usable
    for tool in ("doctor", "plan", "eval"):
        own = help_of("openrlhf_mappa.tools.mappa", tool)
        assert own.returncode == 0 and own.stdout.startswith(f"usage: mappa {tool} --mappa.topology YAML"), own.stdout
        assert "train_mappa_ray" not in own.stdout.split("\n\n")[0]
