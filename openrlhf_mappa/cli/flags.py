"""The launcher's command line: MAPPA's flags, and OpenRLHF's CLI contract, applied by parse_args before
torch, DeepSpeed, vLLM or Ray load. The contract: which of train_ppo_ray's flags MAPPA honours or refuses
(HONOURED, REFUSED_WHY), the range of each honoured number (UPSTREAM_RANGES), and where MAPPA's parse and
validate deviate from upstream's (DEVIATIONS).

Upstream's parser and checks are read from train_ppo_ray's `__main__` block with `ast` (upstream_cli):
openrlhf 0.11.2 has them nowhere else, and importing the module loads torch, DeepSpeed and vLLM (10-40 s)
before a typo could be refused. That reading stays until patches/openrlhf_train_ppo_ray_get_parser.patch
(get_parser(), validate(args)) is released upstream; then upstream_cli imports those two, and DEVIATIONS
applies unchanged.
"""

import argparse
import ast
import builtins
import contextlib
import difflib
import importlib.metadata
import importlib.util
import math
import operator
import os
import re
import sys
import types

OPENRLHF_FITS = ("0.11.2",)


def ranged(kind=int, low=None, high=None, *, above: bool = False, hint: str = ""):
    """An argparse type: a finite `kind` number in [low, high] (above: > low; None: open). Refused as parsed:
    a 0 or negative count otherwise fails an hour into a run, or quietly means something else (aiohttp: no
    timeout)."""
    noun = "an integer" if kind is int else "a number"
    if low is not None and high is not None:
        span = f"in {'(' if above else '['}{low:g}, {high:g}]"
    else:
        span = f"{'>' if above else '>='} {low:g}" if low is not None else f"<= {high:g}"

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        low_ok = low is None or (value > low if above else value >= low)
        if not (math.isfinite(value) and low_ok and (high is None or value <= high)):
            raise argparse.ArgumentTypeError(f"{text} is out of range: expected {noun} {span}{hint}")
        return value

    parse.__name__ = f"{noun} {span}"
    return parse


COUNT, NONNEGATIVE_INT = ranged(int, 1), ranged(int, 0)
POSITIVE, NONNEGATIVE = ranged(float, 0, above=True), ranged(float, 0)
FRACTION, SCORE = ranged(float, 0, 1), ranged(float, 0, 10)
# The largest GPUs hold 288 GB; a value in the thousands is MiB given as GiB (nvidia-smi prints MiB).
GPU_GIB = ranged(float, 0, 1024, above=True, hint=" (GiB; nvidia-smi shows MiB: divide by 1024)")


# MAPPA's flags that are gone, each with what replaces it: the trained coach's search switches merged (issue
# 54); `mappa coach score`'s own coach flags, now the training run's.
RENAMED = {
    "--kind": "--mappa.coach.kind (mappa coach score takes the training run's --mappa.coach.* flags)",
    "--mappa.coach.digits_only": "--mappa.coach.reply digit (digits_only and all_digits together)",
    "--mappa.coach.all_digits": "--mappa.coach.reply digit (digits_only and all_digits together)",
    "--mappa.coach.agreement_warmup": "--mappa.coach.warmup_steps (one warm-up: the agents' and "
                                      "min_agreement's)",
}


class Parser(argparse.ArgumentParser):
    """An argparse error alone, not under the whole usage (which buries it): an unknown flag with what
    replaced it (RENAMED) or the nearest known one, then where the flags are listed."""

    help_command = None  # how to list the flags (default: `<prog> --help`)

    def error(self, message):
        if message.startswith("unrecognized arguments:"):
            known = [o for a in self._actions for o in a.option_strings]
            for word in message.split(":", 1)[1].split():
                flag = word.split("=")[0]
                if flag in RENAMED:
                    message += f"\n  {word}: replaced by {RENAMED[flag]}"
                elif word.startswith("-") and (near := difflib.get_close_matches(flag, known, 1)):
                    message += f"\n  {word}: did you mean {near[0]}?"
        self.exit(2, f"{self.prog}: error: {message}\n(the flags: "
                     f"{self.help_command or self.prog + ' --help'})\n")


def add_mappa_args(parser):
    """MAPPA's flags, in one --help group: the team and its training, the coach, then the GPUs and the
    start-up."""
    g = parser.add_argument_group("MAPPA")
    add_training_args(g)
    add_coach_args(g)
    add_trained_coach_args(g)
    add_launch_args(g)


def add_training_args(g):
    g.add_argument("--mappa.topology", required=True, help="topology YAML (agents, env, coach prompt)")
    g.add_argument("--mappa.model", default=None, help="use this model for every agent (overrides the YAML)")
    g.add_argument("--mappa.reward", choices=["process", "outcome"], default="process",
                   help="process: each action's coach score (MAPPA); outcome: the episode's outcome for "
                        "every action (baseline: --mappa.outcome_score if solved, else 0, times the "
                        "topology's reward_scale; no coach calls)")
    g.add_argument("--mappa.outcome_score", type=SCORE, default=10.0,
                   help="what a solved episode pays each action, on the coach's 0-10 scale (times "
                        "reward_scale), in the outcome baseline and for --mappa.coach.on_failure outcome "
                        "(default: the top of the scale, as the authors)")
    g.add_argument("--mappa.norm_scope", choices=["agent", "global", "group"], default="agent",
                   help="whiten advantages over each agent's batch (the authors' choice) or over all agents; "
                        "group: GRPO-style, normalize rewards over the samples of each prompt (baseline)")
    g.add_argument("--mappa.shared_policy", action="store_true",
                   help="baseline: one policy (the first agent's model) plays and trains every role")
    g.add_argument("--mappa.train_truncated", action="store_true",
                   help="also train actions cut off at the token limit (default: zero loss, as the authors' "
                        "mask_truncated_completions, see --mappa.batch_semantics; counted in "
                        "agent/<name>/truncated_left_out)")
    g.add_argument("--mappa.batch_semantics", choices=["authors", "usable"], default="authors",
                   help="authors: an agent's truncated and unscored actions stay in its batch at zero loss "
                        "(the authors' trainer), so it takes an optimizer step per train batch of all its "
                        "actions and its schedule ends where it should (agent/<name>/zero_loss_rows, "
                        "optimizer_steps); usable: they leave the batch first, so it takes fewer steps")
    g.add_argument("--mappa.lr_horizon", choices=["authors", "max_actions"], default="authors",
                   help="each agent's learning-rate schedule length. authors: episodes x tasks x samples per "
                        "prompt / train batch x epochs, the same for every agent (their base_controller.py); "
                        "max_actions: the most optimizer steps that agent can take (its max_actions per "
                        "episode, at most max_episode_actions), so its schedule ends at its last step")
    g.add_argument("--mappa.max_staleness", type=NONNEGATIVE_INT, default=None,
                   help="with --train.async_enable: leave out (and count, agent/<name>/stale_left_out) an "
                        "action one of whose weight versions, its own agent's or another agent's whose "
                        "output it saw, is more than this many updates behind when its step trains (default: "
                        "--train.async_queue_size, so that none is in steady state)")
    g.add_argument("--mappa.logprob_metrics", action="store_true",
                   help="ask the engines for each sampled token's log-prob even where nothing else reads "
                        "them, to log agent/<name>/logprob_mismatch_{abs,kl} (engine against trainer). Without "
                        "it they are asked for, and logged, only with --algo.advantage.is_correction_level, "
                        "--mappa.ppo_ratio rollout or --train.async_enable, as OpenRLHF asks only for its "
                        "correction")
    g.add_argument("--mappa.ppo_ratio", choices=["trainer", "rollout"], default="trainer",
                   help="the old policy of PPO's ratio and clip. trainer: the actor's log-probs just before "
                        "the update (OpenRLHF's); rollout: the engine's, of the weights that sampled each "
                        "action, so that the clip bounds each update around the policy that made the data "
                        "(async training)")
    g.add_argument("--mappa.max_untrained_steps", type=NONNEGATIVE_INT, default=3,
                   help="stop the run after this many steps in a row in which no agent trained on any action "
                        "(each such step names the reason on the console; 0: never stop)")
    g.add_argument("--mappa.env.max_failure_fraction", type=FRACTION, default=0.5,
                   help="stop the run when more than this fraction of a step's episodes raised an exception "
                        "in the environment (such an episode is a counted failure and trains nothing)")
    g.add_argument("--mappa.run_dir", default="./runs/mappa",
                   help="metrics.jsonl, episodes.jsonl and code workspaces")
    g.add_argument("--mappa.allow_resume_changes", action="store_true",
                   help="resume (--ckpt.load_enable) with other settings that shape the run (batch sizes, "
                        "samples, episodes, learning rate, KL, lengths, the topology) than "
                        "<run_dir>/run_settings.json records (refused by default, naming each); warned, and "
                        "recorded from then on")
    g.add_argument("--mappa.allow_eval_overlap", action="store_true",
                   help="evaluate on an --eval.dataset that shares problems with the training tasks (refused "
                        "by default: it inflates the trained team's score); warned, and counted as "
                        "train_overlap in eval.jsonl")


def add_coach_args(g):
    g.add_argument("--mappa.coach.kind", choices=["heuristic", "openai", "trained"], default="heuristic",
                   help="heuristic: offline rule-based coach (demo/tests); openai: any OpenAI-compatible "
                        "server; trained: the model --mappa.coach.model in the team's cluster, trained with "
                        "the agents and anchored to a reference judge (--mappa.coach.reference_*)")
    g.add_argument("--mappa.coach.mode", choices=["per_action", "hindsight", "both"], default="per_action",
                   help="per_action: one coach request per action, as the episode runs (the paper); "
                        "hindsight: one request per finished episode, scoring every action and naming the "
                        "one responsible for the outcome; both: the mean of the two scores (the one that "
                        "exists when the other failed)")
    g.add_argument("--mappa.coach.model", default=None,
                   help="coach model name at the OpenAI-compatible server")
    g.add_argument("--mappa.coach.base_url", default=None,
                   help="e.g. https://api.openai.com/v1 or http://localhost:8000/v1")
    g.add_argument("--mappa.coach.api_key_env", default="OPENAI_API_KEY",
                   help="environment variable holding the key")
    g.add_argument("--mappa.coach.timeout", type=POSITIVE, default=60.0, help="seconds per coach request")
    g.add_argument("--mappa.coach.max_concurrency", type=COUNT, default=32,
                   help="coach verdicts in progress: requests in flight or waiting to retry")
    g.add_argument("--mappa.coach.max_retries", type=NONNEGATIVE_INT, default=4,
                   help="retries of a request after 429 (honouring Retry-After), 5xx, timeouts or dropped "
                        "connections")
    g.add_argument("--mappa.coach.rpm", type=NONNEGATIVE, default=0.0,
                   help="requests-per-minute limit (0: none)")
    g.add_argument("--mappa.coach.structured", choices=["auto", "json_schema", "off"], default="auto",
                   help="ask for a JSON-schema verdict {rationale, score}; auto: fall back to text if the "
                        "server refuses")
    g.add_argument("--mappa.coach.max_tokens", type=NONNEGATIVE_INT, default=0,
                   help="coach reply token limit (0: the server's default)")
    g.add_argument("--mappa.coach.format_retries", type=NONNEGATIVE_INT, default=2,
                   help="re-prompts after a reply with no valid score")
    g.add_argument("--mappa.coach.cache", default=None,
                   help="SQLite verdict cache (default: <run_dir>/coach_cache.sqlite; 'none': memory only)")
    g.add_argument("--mappa.coach.on_failure", choices=["skip", "outcome", "neutral"], default="skip",
                   help="actions without a valid score: skip (left out), outcome (episode outcome), neutral "
                        "(neutral_score)")
    g.add_argument("--mappa.coach.neutral_score", type=SCORE, default=5.0,
                   help="score (0-10, times the topology's reward_scale) paid for on_failure=neutral")
    g.add_argument("--mappa.coach.max_failure_fraction", type=FRACTION, default=0.5,
                   help="stop the run when more than this fraction of a step's verdicts failed")
    g.add_argument("--mappa.coach.bias_threshold", type=NONNEGATIVE, default=1.0,
                   help="warn when an agent's mean coach score differs between task types by more than this")
    g.add_argument("--mappa.coach.bias_window", type=COUNT, default=5,
                   help="steps pooled by the coach-bias audit")
    g.add_argument("--mappa.coach.standardize_task_type", action="store_true",
                   help="standardize coach scores per agent x task type (bias mitigation)")
    g.add_argument("--mappa.coach.show_bias", action="store_true",
                   help="show an LLM coach its own running bias in every prompt: its mean score per agent "
                        "and task type and how its scores agree with outcomes, over the last "
                        "--mappa.coach.bias_window steps (where the template names {coach_bias}, else above "
                        "the prompt)")
    g.add_argument("--mappa.coach.price_in", type=NONNEGATIVE, default=0.0,
                   help="USD per 1M prompt tokens (cost metrics)")
    g.add_argument("--mappa.coach.price_out", type=NONNEGATIVE, default=0.0,
                   help="USD per 1M completion tokens")
    g.add_argument("--mappa.coach.score_outcome_runs", action="store_true",
                   help="with --mappa.reward outcome: still ask the coach about every action, for comparison "
                        "(logged, never trained on; default: no coach calls)")


def add_trained_coach_args(g):
    g.add_argument("--mappa.coach.reference_kind", choices=["heuristic", "openai"], default="heuristic",
                   help="trained coach: the judge it is compared with (openai: --mappa.coach.reference_model "
                        "at --mappa.coach.base_url)")
    g.add_argument("--mappa.coach.reference_model", default=None,
                   help="trained coach: the reference judge's model")
    g.add_argument("--mappa.coach.reference_fraction", type=FRACTION, default=0.25,
                   help="trained coach: the share of actions the reference judge also scores (a cost)")
    g.add_argument("--mappa.coach.reference_draw", choices=["uniform", "stratified"], default="uniform",
                   help="trained coach: uniform: each action drawn at --mappa.coach.reference_fraction; "
                        "stratified: cut-off and ended actions share it equally (by the last step's counts), "
                        "so the rare kind is judged as often as the usual one")
    g.add_argument("--mappa.coach.held_out_fraction", type=FRACTION, default=0.2,
                   help="trained coach: the share of the reference's verdicts kept out of its reward, to "
                        "measure its agreement with the reference (coach/heldout_agreement)")
    g.add_argument("--mappa.coach.terms", default="format,outcome,agreement,bias",
                   help="trained coach: the terms of its reward, comma-separated (coach/trained.py "
                        "coach_rewards)")
    g.add_argument("--mappa.coach.agreement_bands", type=COUNT, default=5,
                   help="trained coach: the reference's score bands (of 0-10) that share its agreement term "
                        "equally, so a rare score weighs as much as the usual one (1: unweighted)")
    g.add_argument("--mappa.coach.reply", choices=["text", "digit"], default="text",
                   help="trained coach: text: as the coach prompt asks; digit: one token of 0-9 (vLLM's "
                        "allowed_token_ids), always a score, and it trains on all ten digits, each against "
                        "their mean, where the agreement term judges (not on the sampled one)")
    g.add_argument("--mappa.coach.pay_reference", action="store_true",
                   help="trained coach: where its reference judge scored an action, the agents are paid that "
                        "score (the coach still trains on its own verdict there); elsewhere the coach's")
    g.add_argument("--mappa.coach.lr", type=NONNEGATIVE, default=0.0,
                   help="trained coach: its actor's learning rate (0: --actor.adam.lr, the agents')")
    g.add_argument("--mappa.coach.warmup_steps", type=NONNEGATIVE_INT, default=0,
                   help="trained coach: the steps before its reference has shaped it: the agents train only "
                        "on verdicts of a coach with at least this many updates (until then it trains alone, "
                        "on the agents' untrained actions), and --mappa.coach.min_agreement applies only "
                        "after them")
    g.add_argument("--mappa.coach.min_agreement", type=FRACTION, default=0.0,
                   help="trained coach: stop the run when its held-out agreement with the reference falls "
                        "below this after --mappa.coach.warmup_steps steps (0: never)")


def add_launch_args(g):
    g.add_argument("--mappa.colocate", choices=["none", "agent", "team"], default="none",
                   help="OpenRLHF's hybrid engine for a team. none: each agent's actor, reference and "
                        "engines on GPUs of their own; agent: they share that agent's GPUs "
                        "(--train.colocate_all, per agent: the authors' setup); team: every agent shares one "
                        "GPU set. Add --vllm.enable_sleep --ds.enable_sleep so that engines sleep while "
                        "actors train and actors offload while engines generate")
    g.add_argument("--mappa.gpus", type=COUNT, default=None,
                   help="GPUs in the cluster, for `mappa plan` and the check before Ray starts (at launch: "
                        "Ray's count)")
    g.add_argument("--mappa.gpu_memory_gib", type=GPU_GIB, default=None,
                   help="memory of one GPU in GiB, for the plan's memory check (default: detected where the "
                        "driver sees a GPU)")
    g.add_argument("--mappa.host_memory_gib", type=POSITIVE, default=None,
                   help="host memory of one node in GiB, for the plan's check of offloaded states and "
                        "sleeping engines (default: at launch each node's own, or its container's limit, "
                        "read on that node)")
    g.add_argument("--mappa.gpus_per_node", type=COUNT, default=None,
                   help="GPUs per node: --mappa.gpus in nodes of this many, for the plan's nodes and their "
                        "host memory (default: in `mappa plan`, this machine's GPUs, else 8; at launch the "
                        "Ray cluster's nodes are planned, and this divides a node's cores among its actor "
                        "processes)")
    g.add_argument("--mappa.actor_threads", type=NONNEGATIVE_INT, default=0,
                   help="OpenMP threads of each actor and reference process (DeepSpeed's CPU Adam with "
                        "--ds.adam_offload); 0: the launcher node's cores / its GPUs (Ray would give a "
                        "fractional-CPU actor one thread)")
    g.add_argument("--mappa.startup_warn_s", type=POSITIVE, default=300.0,
                   help="while engines and actors start: name those not up yet, and what they wait for, "
                        "every this many seconds")
    g.add_argument("--mappa.startup_timeout_s", type=POSITIVE, default=1800.0,
                   help="stop a start-up not done after this many seconds, with that message")
    g.add_argument("--mappa.verbose", action="store_true",
                   help="show Ray's, vLLM's and DeepSpeed's output on the console (default: in "
                        "<run_dir>/train.log; the console shows the step lines, progress bars, errors and "
                        "the watchdogs' messages)")


@contextlib.contextmanager
def refusals(prefix: str = "[mappa]"):
    """Bad input found before Ray starts (or a `mappa` tool's heavy imports) ends the run with its message
    alone: the loaders' errors and upstream's assertions say what to fix, a traceback only hides it
    (MAPPA_TRACEBACK=1)."""
    try:
        yield
    except (ValueError, OSError, AssertionError) as e:
        if os.environ.get("MAPPA_TRACEBACK", "0") not in ("", "0"):
            raise
        raise SystemExit(f"{prefix} {e or type(e).__name__}") from None


# Every flag of train_ppo_ray's parser is honoured (it does in MAPPA what it does in OpenRLHF) or refused: a
# refused flag off its default stops the launch instead of being silently ignored. A new upstream flag is
# refused until it is added here; tests/test_launch.py checks that docs/reference.md's table names every
# refused one.
HONOURED = """
    actor.num_nodes actor.num_gpus_per_node ref.num_nodes ref.num_gpus_per_node ref.offload
    vllm.num_engines vllm.tensor_parallel_size vllm.sync_backend vllm.enable_prefix_caching vllm.enforce_eager
    vllm.gpu_memory_utilization vllm.enable_sleep ds.enable_sleep train.colocate_all
    ds.zero_stage ds.param_dtype ds.zpg ds.adam_offload ds.attn_implementation ds.experts_implementation
    ds.use_liger_kernel ds.grad_accum_dtype ds.overlap_comm ds.deepcompile ds.packing_samples
    ds.use_universal_ckpt
    ds.ring_attn_size ds.ring_attn_head_stride ds.tensor_parallel_size ds.load_in_4bit
    actor.gradient_checkpointing_enable actor.gradient_checkpointing_reentrant
    actor.eps_clip actor.eps_clip_low_high actor.dual_clip actor.policy_loss_type actor.loss_agg_mode
    actor.aux_loss_coef actor.entropy_coef actor.optim actor.muon.lr actor.muon.momentum actor.muon.ns_steps
    actor.muon.nesterov actor.muon.no_nesterov actor.adam.lr actor.adam.betas actor.adam.eps
    actor.adam.weight_decay
    actor.lr_scheduler actor.lr_warmup_ratio actor.min_lr_ratio actor.max_norm
    train.enable_ema train.ema_beta train.max_epochs train.micro_batch_size train.batch_size
    train.num_episodes
    train.seed train.full_determinism_enable
    rollout.batch_size rollout.micro_batch_size rollout.max_new_tokens rollout.n_samples_per_prompt
    rollout.temperature rollout.top_p
    algo.kl.init_coef algo.kl.estimator algo.kl.target algo.kl.horizon algo.kl.use_loss
    algo.kl.unbiased_gradient
    algo.advantage.gamma algo.advantage.no_std_norm algo.advantage.is_correction_level
    algo.advantage.is_correction_mode algo.advantage.is_correction_gating
    algo.advantage.is_correction_threshold
    algo.dynamic_filtering_enable algo.dynamic_filtering_range
    train.async_enable train.async_queue_size train.partial_rollout_enable
    train.dynamic_batch_enable rollout.max_tokens_per_gpu train.max_tokens_per_gpu
    data.prompt_dataset data.prompt_probs data.prompt_split data.input_key data.label_key data.max_len
    data.max_samples data.apply_chat_template eval.dataset eval.split eval.steps eval.temperature
    eval.n_samples_per_prompt
    ckpt.path ckpt.output_dir ckpt.save_steps ckpt.save_hf ckpt.disable_ds ckpt.max_num ckpt.max_mem
    ckpt.load_enable
    logger.wandb.key logger.wandb.org logger.wandb.group logger.wandb.project logger.wandb.run_name
    logger.tensorboard_dir
""".split()  # data.apply_chat_template: MAPPA always renders prompts with each model's chat template
REFUSED = "not used by MAPPA; see docs/reference.md#openrlhfs-flags-honoured-or-refused"
# The refused flags whose reason a user of OpenRLHF would not guess, by name or by family ("ds.lora":
# ds.lora.*).
REFUSED_WHY = {
    "actor.model_name_or_path": "each agent's model comes from the topology (or --mappa.model)",
    "ds.lora": "LoRA is set per agent, in the topology (agents[].lora), and its adapters are synced by "
               "MAPPA: OpenRLHF 0.11.2's run-wide LoRA syncs every weight under peft's names, which vLLM's "
               "loader rejects (OpenRLHF #1349)",
    "algo.advantage.estimator": "MAPPA's advantages are REINFORCE++ (rewards.py): only reinforce",
    "train.colocate_actor_ref": "MAPPA colocates an agent's actor, reference and engines together "
                                "(--mappa.colocate agent) or not at all; the actor and reference alone are "
                                "not placed together",
    "vllm.sync_with_ray": "every agent's Ray collective sync group would be named 'openrlhf', so agents' "
                          "weight syncs would collide; use --vllm.sync_backend",
    "train.agent_func_path": "the topology's environment drives each episode (--mappa.topology)",
}
# The range of each honoured OpenRLHF number, given to its parser (parse_args), which takes any int or float:
# a 0 there divides by zero in upstream's own checks (--rollout.micro_batch_size), or the run trains nothing.
UPSTREAM_RANGES = {
    **dict.fromkeys(("actor.num_nodes", "actor.num_gpus_per_node", "ref.num_nodes", "ref.num_gpus_per_node",
                     "vllm.num_engines", "vllm.tensor_parallel_size", "ds.zpg", "train.num_episodes",
                     "train.max_epochs", "train.batch_size", "train.micro_batch_size", "rollout.batch_size",
                     "rollout.micro_batch_size", "rollout.n_samples_per_prompt", "rollout.max_new_tokens",
                     "data.max_len", "data.max_samples", "eval.n_samples_per_prompt", "ckpt.max_num"), COUNT),
    "ds.zero_stage": ranged(int, 0, 3), "vllm.gpu_memory_utilization": ranged(float, 0, 1, above=True),
    "rollout.temperature": NONNEGATIVE, "eval.temperature": NONNEGATIVE, "train.async_queue_size": COUNT,
    "rollout.top_p": ranged(float, 0, 1, above=True),
    "algo.kl.init_coef": NONNEGATIVE, "algo.kl.target": POSITIVE, "algo.kl.horizon": POSITIVE,
    "algo.advantage.gamma": ranged(float, 0, 1, above=True), "actor.adam.lr": NONNEGATIVE,
    "actor.adam.eps": POSITIVE,
    "actor.adam.weight_decay": NONNEGATIVE, "actor.eps_clip": POSITIVE, "actor.max_norm": NONNEGATIVE,
    "actor.lr_warmup_ratio": FRACTION, "actor.min_lr_ratio": FRACTION, "train.ema_beta": FRACTION,
}


def refusal_of(action):
    """Why MAPPA refuses an action of upstream's parser; None for a flag it honours, and --help."""
    name = action.option_strings[0].lstrip("-")
    if action.dest == "help" or name in HONOURED:
        return None
    return next((why for key, why in REFUSED_WHY.items() if name == key or name.startswith(key + ".")),
                REFUSED)


def refuse_ignored_flags(upstream: list, raw) -> None:
    """Stop when a refused flag (of `upstream`, the actions of upstream's parser) has a value other than its
    default. `raw`: the namespace before upstream's checks, which change some values (e.g. --vllm.enable_sleep
    back to False)."""
    plain = lambda v: list(v) if isinstance(v, tuple) else v  # nargs flags: a list given, a tuple as default
    refused = {}  # dest -> message (--x.nesterov and --x.no_nesterov share one)
    for action in upstream:
        why = refusal_of(action)
        value = getattr(raw, action.dest, None)
        if why is not None and plain(value) != plain(action.default):
            refused.setdefault(action.dest, f"{action.option_strings[0]} {value!r}: {why}")
    if refused:
        raise SystemExit("[mappa] OpenRLHF flags that MAPPA does not honour (refused rather than silently "
                         "ignored):\n  "
                         + "\n  ".join(refused.values()))


def hf_exports(args) -> str:
    """--ckpt.output_dir, <mappa.run_dir>/hf where none is given."""
    if args.ckpt.output_dir is None:
        return os.path.join(args.mappa.run_dir, "hf")
    return args.ckpt.output_dir


def colocation(args) -> bool:
    """--train.colocate_all: given, it sets --mappa.colocate agent (where that is none); then on under any
    --mappa.colocate."""
    if args.train.colocate_all and args.mappa.colocate == "none":
        args.mappa.colocate = "agent"
    return args.mappa.colocate != "none"


# What MAPPA does instead of upstream with an honoured flag. DEFAULT: the parser's default is the value.
# SET: the function's value, of the parsed args, for upstream's checks and the run. CHECKED_AS: upstream's
# checks see the value, the run the one given. KEPT: the run gets the value given, whatever the checks set.
DEFAULT, SET, CHECKED_AS, KEPT = "default", "set", "checked as", "kept as given"
# MAPPA's deviations from train_ppo_ray's parse and validate: (flag, what MAPPA does instead, its value, why),
# applied by parse_args alone, in this order (tests/test_launch.py shows each on a parsed command line).
DEVIATIONS = (
    ("algo.advantage.estimator", DEFAULT, "reinforce",
     "MAPPA's estimator is REINFORCE++ (return-to-go + global whitening), computed in rewards.py"),
    ("data.input_key", DEFAULT, "prompt",
     "tasks keep MAPPA's column names (every shipped file's), where OpenRLHF's is 'input'"),
    ("data.label_key", DEFAULT, "answer",
     "tasks keep MAPPA's column names (every shipped file's), where OpenRLHF has none"),
    ("ckpt.output_dir", DEFAULT, None, "none given: the final HF exports go with the run (the next row)"),
    ("ckpt.output_dir", SET, hf_exports,
     "<mappa.run_dir>/hf, not OpenRLHF's ./ckpt of whatever directory the launch ran from"),
    ("train.colocate_all", SET, colocation,
     "OpenRLHF's colocation, applied to each agent, is --mappa.colocate agent; any colocation keeps it on "
     "for upstream's checks, which would otherwise turn --vllm.enable_sleep off"),
    ("algo.dynamic_filtering_enable", CHECKED_AS, False,
     "upstream's check demands a reward model or an agent function: MAPPA's coach scores, and validate() "
     "checks the rest of it"),
    ("eval.dataset", CHECKED_AS, None,
     "upstream's check demands a reward model for it: MAPPA's environment grades it"),
    ("rollout.micro_batch_size", CHECKED_AS, 1,
     "upstream asserts that a step's rollout micro-batches are at least the actor ranks, naming no flag or "
     "value: validate() says it per agent, with both and the fix (in `mappa check`'s table too)"),
    ("ds.packing_samples", KEPT, None,
     "upstream turns it on with token budgets and ring attention: a CPU trains padded budgets under sdpa, an "
     "agent with ring attention is packed (placement.agent_args), on GPUs packing_problems refuses budgets "
     "without it"),
    ("ds.attn_implementation", KEPT, None,
     "upstream makes it flash attention with packing: on GPUs packing_problems refuses packing without flash "
     "attention, and check_this_machine ring attention without it"),
)


# Statements of upstream's main block that MAPPA changes; upstream_cli fails loudly when one is missing.
UPSTREAM_PARSE = "args = parser.parse_args()"  # the block splits here: the parser before, the checks after
UPSTREAM_HIERARCHIZE = "from openrlhf.utils.config import hierarchize"  # its package imports DeepSpeed
UPSTREAM_HIERARCHIZED = "args = hierarchize(args)"  # parse_args hierarchizes itself
UPSTREAM_TRAIN = "train(args)"  # where the checks end


def upstream_cli():
    """OpenRLHF's (get_parser, validate) of train_ppo_ray, and its hierarchize; none loads torch or Ray.

    openrlhf 0.11.2 keeps them inline under `__main__`, so that block is read from the source and split at its
    parse_args(): importing the module would load torch, DeepSpeed and vLLM. The block may use only
    standard-library names. Once patches/openrlhf_train_ppo_ray_get_parser.patch is released upstream, import
    its functions instead."""
    installed = importlib.metadata.version("openrlhf")
    if installed not in OPENRLHF_FITS:
        raise SystemExit(f"[mappa] openrlhf_mappa's CLI reads openrlhf {', '.join(OPENRLHF_FITS)}'s "
                         f"train_ppo_ray; found openrlhf {installed}. Install openrlhf=={OPENRLHF_FITS[-1]}.")
    path = importlib.util.find_spec("openrlhf.cli.train_ppo_ray").origin  # imports only the empty packages
    with open(path, encoding="utf-8") as f:
        module = ast.parse(f.read(), path)
    # openrlhf.utils.config run from its file: its package's __init__ loads DeepSpeed.
    config_path = os.path.join(os.path.dirname(path), "..", "utils", "config.py")
    spec = importlib.util.spec_from_file_location("_openrlhf_config", config_path)
    config = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(config)
    main = next(n for n in module.body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    build, checks, seen = [], [], set()
    for stmt in main.body:
        text = ast.unparse(stmt.test if isinstance(stmt, ast.If) else stmt)
        seen.add(text)
        if text == UPSTREAM_TRAIN:
            break
        if text not in (UPSTREAM_PARSE, UPSTREAM_HIERARCHIZE, UPSTREAM_HIERARCHIZED):
            (checks if UPSTREAM_PARSE in seen else build).append(stmt)
    namespace = {}
    for stmt in module.body:
        is_import = isinstance(stmt, (ast.Import, ast.ImportFrom))
        if is_import and ast.unparse(stmt).split()[1].split(".")[0] in sys.stdlib_module_names:
            exec(compile(ast.Module(body=[stmt], type_ignores=[]), path, "exec"), namespace)
    nodes = [n for stmt in build + checks for n in ast.walk(stmt)]
    bound = {n.id for n in nodes if isinstance(n, ast.Name) and not isinstance(n.ctx, ast.Load)} | {"args"}
    imports = [n for n in nodes if isinstance(n, (ast.Import, ast.ImportFrom))]
    bound |= {(a.asname or a.name).split(".")[0] for n in imports for a in n.names}
    unbound = {n.id for n in nodes if isinstance(n, ast.Name)} - bound - set(namespace) - set(dir(builtins))
    rewritten = (UPSTREAM_PARSE, UPSTREAM_HIERARCHIZE, UPSTREAM_HIERARCHIZED, UPSTREAM_TRAIN)
    missing = [s for s in rewritten if s not in seen]
    if missing or unbound:
        raise RuntimeError(f"openrlhf {installed} changed the main block of {path}: statements MAPPA "
                           f"rewrites not found: {missing}; names it reads that are not standard library: "
                           f"{sorted(unbound)}. Update openrlhf_mappa/cli/flags.py upstream_cli.")
    build, checks = (compile(ast.Module(body=b, type_ignores=[]), path, "exec") for b in (build, checks))

    def get_parser():
        scope = dict(namespace)
        exec(build, scope)
        return scope["parser"]

    def validate_upstream(args):
        exec(checks, dict(namespace, args=args))

    return get_parser, validate_upstream, config.hierarchize


def help_apart(parser, upstream: list) -> None:
    """--help: each flag's default, and OpenRLHF's flags that MAPPA refuses listed apart, each with its
    reason."""
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    refused = parser.add_argument_group("OpenRLHF's flags that MAPPA refuses (given, each stops the launch), "
                                        "and why")
    for group in parser._action_groups[:-1]:
        for action in list(group._group_actions):
            why = refusal_of(action) if action in upstream else None
            if why is not None:
                group._group_actions.remove(action)
                refused._group_actions.append(action)
                action.help = why
            elif action.option_strings and not action.help:  # argparse shows no default without a help text
                action.help = "OpenRLHF's (train_ppo_ray)"


def parse_args(argv=None, prog: str = "train_mappa_ray", description: str = None, add_tool_args=None):
    """OpenRLHF's flags and checks (upstream_cli) with MAPPA's, numbers range-checked as parsed
    (UPSTREAM_RANGES), refused flags before upstream's checks change any value, and MAPPA's deviations
    (DEVIATIONS). `prog`: the command an argparse error and --help name; `description`: what its --help says
    it does; `add_tool_args(parser)`: a `mappa` tool's own flags."""
    get_parser, validate_upstream, hierarchize = upstream_cli()
    parser = get_parser()
    upstream = list(parser._actions)
    add_mappa_args(parser)
    if add_tool_args:
        add_tool_args(parser)
    help_apart(parser, upstream)
    parser.description = description or "Train a MAPPA team: OpenRLHF's flags and --mappa.*"
    # not 230 lines of them
    parser.usage = "%(prog)s --mappa.topology YAML [OpenRLHF's flags] [--mappa.* flags]"
    parser.prog, parser.error = prog, types.MethodType(Parser.error, parser)
    parser.help_command = ("python -m openrlhf_mappa.cli.train_mappa_ray --help" if prog == "train_mappa_ray"
                           else None)
    ranged_flags = {a.option_strings[0].lstrip("-"): a for a in parser._actions if a.option_strings}
    missing = sorted(set(UPSTREAM_RANGES) - set(ranged_flags))
    if missing:
        raise RuntimeError(f"UPSTREAM_RANGES names flags upstream's parser does not have: {missing}")
    for name, check in UPSTREAM_RANGES.items():
        ranged_flags[name].type = check
    ranged_flags["ckpt.output_dir"].help = ("each agent's final HF export goes to DIR/<agent> (MAPPA's "
                                            "default: <mappa.run_dir>/hf; OpenRLHF's: ./ckpt)")
    # argparse reads a negative number in exponent form ("-1e-5") as a flag and says only "expected one
    # argument": read as a number, it gets the flag's own refusal ("out of range: expected a number >= 0").
    parser._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)(e[-+]?\d+)?$", re.IGNORECASE)
    for flag, what, value, _ in DEVIATIONS:  # DEVIATIONS, applied here alone: the defaults first
        if what == DEFAULT:
            parser.set_defaults(**{flag: value})
    raw = parser.parse_args(sys.argv[1:] if argv is None else argv)
    refuse_ignored_flags(upstream, raw)
    args, given = hierarchize(raw), []
    for flag, what, value, _ in DEVIATIONS:  # then the values upstream's checks see, and after them the run's
        path, _, name = flag.rpartition(".")
        group = operator.attrgetter(path)(args)
        if what == SET:
            setattr(group, name, value(args))
        elif what in (CHECKED_AS, KEPT):
            given.append((group, name, getattr(group, name)))
        if what == CHECKED_AS:
            setattr(group, name, value)
    with refusals():  # upstream validates with assert
        validate_upstream(args)
    for group, name, value in given:
        setattr(group, name, value)
    return args
