"""A resume that changes the run (issue 64): the settings that shape it are recorded as a launch starts
(<run_dir>/run_settings.json) and compared on resume; a difference is refused naming each flag and both
values, unless --mappa.allow_resume_changes. Through the real launcher's checks, before Ray (launch stands in
for it)."""

import json

import pytest

from test_launch import GOOD, workdir, write_topology  # noqa: F401 (a fixture)

from openrlhf_mappa import resume
from openrlhf_mappa.cli import train_mappa_ray
from openrlhf_mappa.cli.train_mappa_ray import parse_args
from openrlhf_mappa.team import load_topology


def no_ray(*args):
    raise KeyboardInterrupt("no Ray here")


def launch(workdir, monkeypatch, *flags):
    """The real train() up to Ray: every check, then the run's records (launch, which starts Ray, stands
    in)."""
    monkeypatch.chdir(workdir)
    monkeypatch.setattr(train_mappa_ray, "launch", no_ray)
    with pytest.raises(KeyboardInterrupt, match="no Ray here"):
        train_mappa_ray.train(parse_args([*GOOD, "--mappa.verbose", *flags]))


def checkpoint_at_step_2(workdir):
    """What a run that saved step 2 leaves: the team's marker, the agent's DeepSpeed states and `latest`."""
    states = workdir / "ckpt" / "solver" / "_actor" / "global_step2"
    states.mkdir(parents=True)
    (states / "mp_rank_00_model_states.pt").write_text("states")
    (states.parent / "latest").write_text("global_step2")
    (workdir / "ckpt" / resume.CHECKPOINT_MARKER).write_text('{"step": 2}')


def test_changed_settings_name_each_flag_and_both_values():
    recorded = {"--rollout.batch_size": 4, "--actor.adam.lr": 1e-05, "topology: agent 'a' prompt": "{task}"}
    now = {"--rollout.batch_size": 2, "--actor.adam.lr": 1e-05, "topology: agent 'b' prompt": "{task}"}
    assert resume.changed_settings(recorded, now) == [
        "--rollout.batch_size: 4 in the run, 2 now",
        "topology: agent 'b' prompt: '(absent)' in the run, '{task}' now",
        "topology: agent 'a' prompt: '{task}' in the run, '(absent)' now",
    ]
    assert resume.changed_settings(recorded, dict(recorded)) == []


def test_run_settings_hold_the_flags_and_the_topology(workdir):  # noqa: F811
    path = write_topology(workdir)
    args = parse_args([*GOOD, "--actor.adam.lr", "1e-5"])
    settings = resume.run_settings(args, load_topology(path))
    flags = ("--rollout.batch_size", "--train.batch_size", "--actor.adam.lr")
    assert [settings[flag] for flag in flags] == [2, 2, 1e-5]
    assert settings["--actor.adam.betas"] == [0.9, 0.95] and settings["--algo.kl.init_coef"] == 0.01
    assert settings["topology: agent 'solver' model"] == "model" and settings["topology: env"] == "mathchat"
    assert "--rollout.micro_batch_size" not in settings  # memory only: a resume after an OOM may lower it
    assert json.loads(json.dumps(settings)) == settings  # as the record reads back


def test_a_resume_with_another_rollout_batch_is_refused_and_the_same_continues(  # noqa: F811
        workdir, monkeypatch):
    # Catches the old launcher, which resumed "at step 2" with any batch, learning rate or KL (the trial's
    # friction 3: 16 episodes a step, then 8, on the first run's optimizer and data position).
    write_topology(workdir)
    launch(workdir, monkeypatch, "--rollout.batch_size", "4")
    record = json.loads((workdir / "run" / resume.SETTINGS_RECORD).read_text())
    assert record["--rollout.batch_size"] == 4
    checkpoint_at_step_2(workdir)

    args = parse_args([*GOOD, "--ckpt.load_enable", "--rollout.batch_size", "2", "--actor.adam.lr", "1e-4"])
    with pytest.raises(ValueError) as refused:
        resume.check_resume(args, load_topology("t.yaml"), ["1", "2", "3", "4"])
    assert str(refused.value) == (
        f"resume: this launch changes settings that shape the run (run/{resume.SETTINGS_RECORD} records "
        f"those it trained with until step 2):\n"
        f"  --rollout.batch_size: 4 in the run, 2 now\n"
        f"  --actor.adam.lr: 1e-06 in the run, 0.0001 now\n"
        "resume with the run's settings, or pass --mappa.allow_resume_changes to continue with these from "
        f"step 2 on (recorded as the run's from then on)")
    # The refused launch wrote nothing; the same resume with the run's settings continues at step 2.
    with pytest.raises(SystemExit, match="--rollout.batch_size: 4 in the run, 2 now"):
        launch(workdir, monkeypatch, "--ckpt.load_enable", "--rollout.batch_size", "2")
    assert json.loads((workdir / "run" / resume.SETTINGS_RECORD).read_text()) == record
    args = parse_args([*GOOD, "--ckpt.load_enable", "--rollout.batch_size", "4"])
    assert resume.check_resume(args, load_topology("t.yaml"), ["1", "2", "3", "4"]) == (2, [])


def test_allow_resume_changes_continues_with_a_warning_and_records_the_new_settings(  # noqa: F811
        workdir, monkeypatch, capsys):
    write_topology(workdir)
    launch(workdir, monkeypatch, "--rollout.batch_size", "4")
    checkpoint_at_step_2(workdir)
    launch(workdir, monkeypatch, "--ckpt.load_enable", "--rollout.batch_size", "2",
           "--mappa.allow_resume_changes")
    assert ("[mappa] WARNING: resume with --mappa.allow_resume_changes: from step 2 on, "
            "--rollout.batch_size: 4 in the run, 2 now") in capsys.readouterr().err
    assert json.loads((workdir / "run" / resume.SETTINGS_RECORD).read_text())["--rollout.batch_size"] == 2
