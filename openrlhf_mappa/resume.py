"""Resuming a run: the team checkpoint marker and the state a resume reads, checked before torch or Ray load.

`check_resume` reads and checks everything a resume depends on (the marker, the run's record of its training
tasks, each agent's DeepSpeed checkpoint) and writes nothing, so that the launcher refuses damaged state in a
second, naming the file, and a refused launch leaves the run as it was; `apply` then makes its few changes.
"""

import os

from openrlhf_mappa.episode import read_record
from openrlhf_mappa.placement import trainee_specs

CHECKPOINT_MARKER = "mappa_checkpoint.json"  # in --ckpt.path: the last step that every agent saved


def check_resume(args, topology, task_ids: list) -> tuple:
    """(step, fixes) before any actor starts: the last step ALL agents saved (0: start fresh), and the changes that
    point every agent's DeepSpeed `latest` at it, as (path, tag) to write, or (path, None) to set aside.

    Agents save one after another, so a run killed mid-save can leave agent A at step N+1 and agent B at step N.
    The run-level marker, written once all agents saved, names N; A's `latest` is set back to N. A save that never
    completed for all agents (no marker) is set aside, not half-resumed from. Refused, naming the file: no marker
    while the run directory already logged steps (the run would silently start over), a damaged marker, another
    task list than the run's `train_tasks.json` (the steps after the checkpoint would continue on other data), an
    agent's step directory missing or without its DeepSpeed states (it would fail only inside the actors)."""
    if not args.ckpt.load_enable:
        return 0, []
    marker = os.path.join(args.ckpt.path, CHECKPOINT_MARKER)
    state = read_record(marker, "the team checkpoint marker") if os.path.exists(marker) else {}
    step = state.get("step", 0)
    if state and (isinstance(step, bool) or not isinstance(step, int) or step < 1):
        raise ValueError(f"{marker}: 'step' must be the integer step every agent saved (>= 1), got {step!r}")
    logged = os.path.join(args.mappa.run_dir, "metrics.jsonl")
    if not step and os.path.exists(logged) and any(line.endswith("\n") for line in open(logged, encoding="utf-8")):
        # Each whole line of metrics.jsonl is a finished step (from 1). Without a team checkpoint where
        # --ckpt.path says, the run would restart at step 0 and overwrite its logs: typically a relative
        # --ckpt.path that `ray job submit` resolved inside its temporary copy of working_dir.
        raise ValueError(f"--ckpt.load_enable: {os.path.abspath(logged)} already has logged steps, but "
                         f"{os.path.abspath(args.ckpt.path)} holds no checkpoint ({CHECKPOINT_MARKER}), so the run "
                         f"would start over at step 0. Point --ckpt.path at the run's checkpoints (an absolute path), "
                         f"or start fresh: a new --mappa.run_dir, or drop --ckpt.load_enable to overwrite this one's "
                         f"logs.")
    saved = state.get("coach_template")
    stages = [s.name for s in topology.coach_stages] if saved is not None else []
    if saved is not None and (not isinstance(saved, dict) or saved.get("name") not in stages):
        name = saved.get("name") if isinstance(saved, dict) else saved
        raise ValueError(f"resume: {marker} says step {step} was scored with coach template {name!r}, which is not "
                         f"in the coach_templates of {args.mappa.topology} ({', '.join(stages) or 'none'}); resume "
                         f"with the topology of the first run")
    chosen = os.path.join(args.mappa.run_dir, "train_tasks.json")
    if step and os.path.exists(chosen):
        ids = read_record(chosen, "the record of the run's training tasks").get("ids")
        if not isinstance(ids, list):
            raise ValueError(f"{chosen}: the record of the run's training tasks has no 'ids' list")
        if ids != task_ids:
            raise ValueError(f"resume: {chosen} lists other training tasks than --data.prompt_dataset, --train.seed "
                             f"and --data.max_samples pick now; resume with the settings of the first run")
    tag, fixes = f"global_step{step}", []
    for spec in trainee_specs(args, topology):
        actor_dir = os.path.join(args.ckpt.path, spec.name, "_actor")
        latest = os.path.join(actor_dir, "latest")
        if not os.path.exists(latest):
            if step:
                raise ValueError(f"resume: {marker} says step {step}, but agent {spec.name!r} has no checkpoint in "
                                 f"{actor_dir}")
            continue
        if not step:
            fixes.append((latest, None))
            continue
        step_dir = os.path.join(actor_dir, tag)
        if not os.path.isdir(step_dir):
            raise ValueError(f"resume: agent {spec.name!r} has no {tag} in {actor_dir} (removed by --ckpt.max_num?)")
        # DeepSpeed writes its model states (*model_states.pt) and, under ZeRO, each rank's optimizer states.
        files = os.listdir(step_dir)
        empty = sorted(f for f in files if f.endswith(".pt") and not os.path.getsize(os.path.join(step_dir, f)))
        if empty or not any(f.endswith("model_states.pt") for f in files):
            found = f"empty files {empty}" if empty else f"no *model_states.pt (it holds {sorted(files) or 'nothing'})"
            raise ValueError(f"resume: the checkpoint of agent {spec.name!r} at step {step} ({step_dir}) is "
                             f"incomplete: {found}. Restore it, or resume from an earlier team checkpoint")
        with open(latest, encoding="utf-8", errors="replace") as f:
            if f.read().strip() != tag:
                fixes.append((latest, tag))
    return step, fixes


def apply(fixes: list) -> None:
    """The changes check_resume found: each `latest` file set to its tag, or set aside (None)."""
    for latest, tag in fixes:
        if tag is None:
            os.replace(latest, latest + ".incomplete")
        else:
            with open(latest, "w") as f:
                f.write(tag)
