"""The overhead benchmark's reading of both trainers' step times (benchmarks/overhead.py): tensorboard events
written by torch's SummaryWriter, as both runs write them (OpenRLHF's TensorboardLogger: `train/<key>`), read
back per step; the steady state drops the warm-up steps and times each step from the previous one's log
record. No training here; the benchmark itself runs both trainers."""

import os
import sys

import pytest
from torch.utils.tensorboard import SummaryWriter

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))
from overhead import read_steps, steady_state  # noqa: E402


def write_run(path, steps: list, walls: list):
    writer = SummaryWriter(log_dir=str(path / "run-name"))
    for step, (logs, wall) in enumerate(zip(steps, walls), 1):
        for key, value in logs.items():
            writer.add_scalar(f"train/{key}", value, step, walltime=wall)
    writer.close()


def openrlhf_step(i):
    return {"timing/generation": 1.0 + i, "timing/make_experience": 0.5, "timing/ppo_train": 2.0 * i,
            "timing/broadcast": 0.25, "timing/step_total": 3.75 + 3 * i, "rollout/response_length_mean": 10.0 + i,
            "rollout/num_samples": 4.0, "policy_loss": 0.1}  # fmt: skip


def test_openrlhf_steady_state_leaves_out_warmup_and_times_steps_log_to_log(tmp_path):
    # steps 1..5 logged at these wall times: intervals 10, 4, 6, 5 for steps 2..5
    write_run(tmp_path, [openrlhf_step(i) for i in range(1, 6)], [100.0, 110.0, 114.0, 120.0, 125.0])
    steps = read_steps(str(tmp_path))
    assert len(steps) == 5 and steps[0]["wall"] == pytest.approx(100.0)
    assert steps[2]["timing/ppo_train"] == pytest.approx(6.0) and steps[2]["policy_loss"] == pytest.approx(0.1)

    s = steady_state(steps, "openrlhf", warmup=2)  # steps 3, 4, 5 (i = 3, 4, 5)
    assert s["generation"] == pytest.approx(5.0)  # median of 4, 5, 6
    assert s["train"] == pytest.approx(8.0) and s["sync"] == pytest.approx(0.25)
    assert s["train+sync"] == pytest.approx(8.25)
    assert s["step"] == pytest.approx(15.75)
    assert s["wall"] == pytest.approx(5.0)  # median of 4, 6, 5: step 2's interval of 10 is warm-up
    assert s["tokens"] == pytest.approx(14.0 * 4)


def test_mappa_steady_state_sums_every_agents_tokens(tmp_path):
    step = {"timing/rollout": 2.0, "timing/experience": 0.5, "timing/train": 1.5, "timing/sync": 0.5, "timing/step": 4.6,
            "agent/a1/num_actions": 4.0, "agent/a1/action_length": 10.0,
            "agent/a2/num_actions": 4.0, "agent/a2/action_length": 20.0}  # fmt: skip
    write_run(tmp_path, [step] * 3, [50.0, 55.0, 59.0])
    s = steady_state(read_steps(str(tmp_path)), "mappa", warmup=2)
    assert (s["generation"], s["train+sync"], s["step"], s["wall"]) == pytest.approx((2.0, 2.0, 4.6, 4.0))
    assert s["tokens"] == pytest.approx(4 * 10 + 4 * 20)


def test_refusals_name_what_is_missing(tmp_path):
    write_run(tmp_path / "a", [{"timing/rollout": 1.0}] * 3, [1.0, 2.0, 3.0])
    with pytest.raises(SystemExit, match="logged no timing/experience"):
        steady_state(read_steps(str(tmp_path / "a")), "mappa", warmup=1)
    write_run(tmp_path / "b", [openrlhf_step(1)] * 2, [1.0, 2.0])
    with pytest.raises(SystemExit, match="none is left after 2 of warm-up"):
        steady_state(read_steps(str(tmp_path / "b")), "openrlhf", warmup=2)
    with pytest.raises(SystemExit, match="expected one run's tensorboard events .* found 2"):
        read_steps(str(tmp_path))
