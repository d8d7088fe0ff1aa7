"""Resuming a run: the team checkpoint marker and the state a resume reads, checked before torch or Ray load;
the checkpoints' rotation, and what a resumed run reloads (logs cut back, weights to the engines, driver
state).

`check_resume` reads and checks everything a resume depends on (the marker, the run's record of its training
tasks, each agent's DeepSpeed checkpoint) and writes nothing, so that the launcher refuses damaged state in a
second, naming the file, and a refused launch leaves the run as it was; `apply` then makes its few changes.
"""

import dataclasses
import functools
import glob
import json
import os
import shutil
import sys

from openrlhf_mappa.console import console
from openrlhf_mappa.episode import Episode, read_jsonl, read_record
from openrlhf_mappa.placement import trainee_specs

CHECKPOINT_MARKER = "mappa_checkpoint.json"  # in --ckpt.path: the last step that every agent saved
SETTINGS_RECORD = "run_settings.json"  # in --mappa.run_dir: the settings that shape the run (run_settings)

# The flags that shape what a run trains, recorded at the start and compared on resume (check_resume): a
# resume with another batch, learning rate or KL would continue the checkpoint's optimizer, schedule and data
# position on other terms. Not here: what changes memory or speed only (micro batches, offload, engines, the
# packing) and where things go, so that a run that ran out of memory resumes with a smaller micro batch.
RUN_SHAPING = (
    "--rollout.batch_size", "--rollout.n_samples_per_prompt", "--train.batch_size", "--train.num_episodes",
    "--train.max_epochs", "--train.seed", "--train.async_enable", "--data.max_len", "--rollout.max_new_tokens",
    "--rollout.temperature", "--rollout.top_p", "--actor.adam.lr", "--actor.adam.betas",
    "--actor.adam.weight_decay", "--actor.optim", "--actor.muon.lr", "--actor.lr_scheduler",
    "--actor.lr_warmup_ratio", "--actor.min_lr_ratio", "--actor.max_norm", "--actor.eps_clip",
    "--actor.policy_loss_type", "--actor.loss_agg_mode", "--actor.entropy_coef", "--algo.kl.init_coef",
    "--algo.kl.target", "--algo.kl.horizon", "--algo.kl.estimator", "--algo.kl.use_loss", "--algo.advantage.gamma",
    "--algo.advantage.no_std_norm", "--mappa.reward", "--mappa.outcome_score", "--mappa.norm_scope",
    "--mappa.shared_policy", "--mappa.train_truncated", "--mappa.batch_semantics", "--mappa.lr_horizon",
    "--mappa.ppo_ratio", "--mappa.coach.kind", "--mappa.coach.mode", "--mappa.coach.model", "--mappa.coach.lr",
)  # fmt: skip


def run_settings(args, topology) -> dict:
    """What a run's training depends on beyond its tasks, as written to SETTINGS_RECORD: each RUN_SHAPING
    flag's value, and the topology's content (each top-level key, and each agent's keys under its name)."""
    settings = {flag: functools.reduce(getattr, flag[2:].split("."), args) for flag in RUN_SHAPING}
    content = dataclasses.asdict(topology)
    for agent in content.pop("agents"):
        name = agent.pop("name")
        settings.update({f"topology: agent {name!r} {key}": value for key, value in agent.items()})
    settings.update({f"topology: {key}": value for key, value in content.items()})
    return json.loads(json.dumps(settings, default=str))  # as the record reads back: tuples as lists


def changed_settings(recorded: dict, now: dict) -> list:
    """One line per setting whose value differs between the record and now (a key only one side has:
    absent)."""
    lines = []
    for key in now | recorded:  # now's keys, then those only the record has
        before, after = recorded.get(key, "(absent)"), now.get(key, "(absent)")
        if before != after:
            lines.append(f"{key}: {before!r:.100} in the run, {after!r:.100} now")
    return lines


def check_resume(args, topology, task_ids: list) -> tuple:
    """(step, fixes) before any actor starts: the last step ALL agents saved (0: start fresh), and the changes
    that point every agent's DeepSpeed `latest` at it, as (path, tag) to write, or (path, None) to set aside.

    Agents save one after another: a run killed mid-save can leave agent A at step N+1, agent B at N. The
    marker, written once all agents saved, names N; A's `latest` is set back to N. A save not completed by
    all (no marker) is set aside, not half-resumed from. Refused, naming the file: no marker while the run
    already logged steps (it would silently start over), a damaged marker, another task list than the run's
    `train_tasks.json` (it would continue on other data), an agent's step directory missing or without its
    DeepSpeed states (it would fail only inside the actors)."""
    if not args.ckpt.load_enable:
        return 0, []
    marker = os.path.join(args.ckpt.path, CHECKPOINT_MARKER)
    state = read_record(marker, "the team checkpoint marker") if os.path.exists(marker) else {}
    step = state.get("step", 0)
    if state and (isinstance(step, bool) or not isinstance(step, int) or step < 1):
        raise ValueError(f"{marker}: 'step' must be the integer step every agent saved (>= 1), got {step!r}")
    problems = []  # the independent ones below, named together
    logged = os.path.join(args.mappa.run_dir, "metrics.jsonl")
    finished = os.path.exists(logged) and any(line.endswith("\n") for line in open(logged, encoding="utf-8"))
    if not step and finished:
        # Each whole line of metrics.jsonl is a finished step: with no checkpoint where --ckpt.path says (a
        # relative path `ray job submit` resolved in its copy of working_dir), it would restart at step 0.
        problems.append(f"--ckpt.load_enable: {os.path.abspath(logged)} already has logged steps, but "
                        f"{os.path.abspath(args.ckpt.path)} holds no checkpoint ({CHECKPOINT_MARKER}), so "
                        f"the run would start over at step 0. Point --ckpt.path at the run's checkpoints "
                        f"(an absolute path), or start fresh: a new --mappa.run_dir, or drop "
                        f"--ckpt.load_enable to overwrite this one's logs.")
    saved = state.get("coach_template")
    stages = [s.name for s in topology.coach_stages] if saved is not None else []
    if saved is not None and (not isinstance(saved, dict) or saved.get("name") not in stages):
        name = saved.get("name") if isinstance(saved, dict) else saved
        problems.append(f"resume: {marker} says step {step} was scored with coach template {name!r}, "
                        f"which is not in the coach_templates of {args.mappa.topology} "
                        f"({', '.join(stages) or 'none'}); resume with the topology of the first run")
    chosen = os.path.join(args.mappa.run_dir, "train_tasks.json")
    ids = task_ids  # no record (a fresh start): nothing to compare
    if step and os.path.exists(chosen):
        ids = read_record(chosen, "the record of the run's training tasks").get("ids")
    if not isinstance(ids, list):
        problems.append(f"{chosen}: the record of the run's training tasks has no 'ids' list")
    elif ids != task_ids:
        problems.append(f"resume: {chosen} lists other training tasks than --data.prompt_dataset, "
                        f"--train.seed and --data.max_samples pick now; resume with the settings of the "
                        f"first run")
    settings = settings_problem(args, topology, step) if step else ""
    if settings:
        problems.append(settings)
    tag, fixes = f"global_step{step}", []
    for spec in trainee_specs(args, topology):
        actor_dir = os.path.join(args.ckpt.path, spec.name, "_actor")
        latest = os.path.join(actor_dir, "latest")
        if not os.path.exists(latest):
            if step:
                problems.append(f"resume: {marker} says step {step}, but agent {spec.name!r} has no "
                                f"checkpoint in {actor_dir}")
            continue
        if not step:
            fixes.append((latest, None))
            continue
        step_dir = os.path.join(actor_dir, tag)
        if not os.path.isdir(step_dir):
            problems.append(f"resume: agent {spec.name!r} has no {tag} in {actor_dir} (removed by "
                            f"--ckpt.max_num?)")
            continue
        # DeepSpeed writes its model states (*model_states.pt) and, under ZeRO, each rank's optimizer states.
        files = os.listdir(step_dir)
        empty = sorted(f for f in files if f.endswith(".pt") and not os.path.getsize(f"{step_dir}/{f}"))
        if empty or not any(f.endswith("model_states.pt") for f in files):
            found = (f"empty files {empty}" if empty
                     else f"no *model_states.pt (it holds {sorted(files) or 'nothing'})")
            problems.append(f"resume: the checkpoint of agent {spec.name!r} at step {step} ({step_dir}) is "
                            f"incomplete: {found}. Restore it, or resume from an earlier team checkpoint")
            continue
        with open(latest, encoding="utf-8", errors="replace") as f:
            if f.read().strip() != tag:
                fixes.append((latest, tag))
    if problems:
        raise ValueError("\n".join(problems))
    return step, fixes


def settings_problem(args, topology, step: int) -> str:
    """check_resume's refusal of settings that differ from the run's record ("" where none differ, or the run
    has no record: one from before they were recorded); with --mappa.allow_resume_changes, a warning
    instead."""
    recorded = os.path.join(args.mappa.run_dir, SETTINGS_RECORD)
    if not os.path.exists(recorded):
        return ""
    changed = changed_settings(read_record(recorded, "the record of the run's settings"),
                               run_settings(args, topology))
    if changed and args.mappa.allow_resume_changes:
        print(f"[mappa] WARNING: resume with --mappa.allow_resume_changes: from step {step} on, "
              + "; ".join(changed), file=sys.stderr, flush=True)
    elif changed:
        shown = "\n  " + "\n  ".join(changed)
        return (f"resume: this launch changes settings that shape the run ({recorded} records those it "
                f"trained with until step {step}):{shown}\nresume with the run's settings, or pass "
                f"--mappa.allow_resume_changes to continue with these from step {step} on (recorded as the "
                "run's from then on)")
    return ""


def apply(fixes: list) -> None:
    """The changes check_resume found: each `latest` file set to its tag, or set aside (None)."""
    for latest, tag in fixes:
        if tag is None:
            os.replace(latest, latest + ".incomplete")
        else:
            with open(latest, "w") as f:
                f.write(tag)


def rotate_checkpoints(agent_ckpt_dir: str, keep: int) -> list:
    """Delete all but the `keep` newest DeepSpeed checkpoints (_actor/global_step<N>) and HF exports
    (global_step<N>_hf) of one agent, once a team checkpoint is written; returns the paths deleted.
    DeepSpeed's own rotation runs before each save and is given one more (agent_args): with --ckpt.max_num 1
    it would delete the team's checkpoint while the next is half saved, and a kill then leaves nothing to
    resume. It never rotates HF exports (a full model per save: 8 GB for a 4B agent in bf16)."""
    deleted = []
    for pattern, suffix in ((os.path.join(agent_ckpt_dir, "_actor", "global_step*"), ""),
                            (os.path.join(agent_ckpt_dir, "global_step*_hf"), "_hf")):
        saved = {}  # step -> path
        for path in glob.glob(pattern):
            step = os.path.basename(path)[len("global_step") : len(os.path.basename(path)) - len(suffix)]
            if step.isdigit() and os.path.isdir(path):
                saved[int(step)] = path
        deleted += [saved[step] for step in sorted(saved)[: max(0, len(saved) - keep)]]
    for path in deleted:
        shutil.rmtree(path)
    return deleted


def truncate_logs(run_dir: str, step: int) -> None:
    """Keep only the lines of steps <= `step` in the run's JSONL logs. A resumed run redoes the
    steps after its checkpoint, which would otherwise appear twice; a line cut off by a kill is dropped."""
    for name in ("metrics.jsonl", "episodes.jsonl", "eval.jsonl", "syncs.jsonl"):
        path = os.path.join(run_dir, name)
        if not os.path.exists(path):
            continue
        kept, dropped = [], 0
        with open(path, encoding="utf-8") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    record = None
                if isinstance(record, dict) and record.get("step", 0) <= step:
                    kept.append(line.rstrip("\n") + "\n")
                else:
                    dropped += 1
        with open(path + ".tmp", "w", encoding="utf-8") as f:
            f.writelines(kept)
        os.replace(path + ".tmp", path)
        if dropped:
            print(
                f"[mappa] {path}: kept {len(kept)} lines up to step {step}, dropped {dropped} (later steps "
                f"or cut off)",
                file=console.out,
                flush=True,
            )


def write_marker(ckpt_path: str, state: dict) -> None:
    """Only once every agent saved is a step a checkpoint of the whole team (see check_resume): the marker
    says so, with the driver's `state` that driver_state() reads back. Written atomically."""
    marker = os.path.join(ckpt_path, CHECKPOINT_MARKER)
    with open(marker + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(marker + ".tmp", marker)


def save_team(trainees: list, ckpt, state: dict) -> None:
    """OpenRLHF-style resumable checkpoints (and HF exports with --ckpt.save_hf), one directory per agent;
    then the team's marker; then the rotation, only now that the marker names a step all agents saved."""
    import ray

    step = state["step"]
    ray.get([ref for ag in trainees for ref in ag.actor.async_run_method(
        method_name="save_checkpoint", tag=f"global_step{step}", client_states={"global_step": step})])
    write_marker(ckpt.path, state)
    for ag in trainees:
        rotate_checkpoints(ag.args.ckpt.path, ckpt.max_num)


def load_team(trainees: list, step: int, saved: dict) -> None:
    """Every agent checked to have loaded the checkpoint of `step`, then each agent's engines given its
    actor's loaded weights (they start from the base model), and its KL coefficient and weight version as the
    marker's `saved` state has them (the sync counted one more version, and made none)."""
    for ag in trainees:
        loaded = ag.trainer.init_checkpoint_states()["global_step"]
        if loaded != step:
            raise RuntimeError(
                f"resume: agent {ag.spec.name!r} loaded the checkpoint of step {loaded}, expected "
                f"{step}"
            )
    for ag in trainees:
        ag.trainer.broadcast_to_vllm()
        ag.trainer.kl_ctl.value = saved.get("kl_coef", {}).get(ag.spec.name, ag.trainer.kl_ctl.value)
        ag.trainer.gate.version = saved.get("versions", {}).get(ag.spec.name, ag.trainer.gate.version)
        ag.trainer.gate.log.clear()


def driver_state(ckpt_path: str, run_dir: str, step: int, window: int) -> tuple:
    """(coach cost so far, the coach template in use as {name, since_step} or None, {step: episodes}, the
    marker's per-agent state: `kl_coef`, `versions`, `optimizer_steps`) as the team checkpoint of `step` left
    them: the episodes of the bias audit's last `window` steps refill its window, whose warnings and the
    figures a coach is shown (--mappa.coach.show_bias) would otherwise restart from nothing."""
    marker = json.load(open(os.path.join(ckpt_path, CHECKPOINT_MARKER)))
    path, by_step = os.path.join(run_dir, "episodes.jsonl"), {}
    for _, ep in read_jsonl(path) if os.path.exists(path) else []:
        if step - window < ep["step"] <= step:
            by_step.setdefault(ep["step"], []).append(Episode.from_record(ep))
    agents = {key: marker[key] for key in ("kl_coef", "versions", "optimizer_steps") if key in marker}
    return marker.get("coach_cost_usd", 0.0), marker.get("coach_template"), by_step, agents
