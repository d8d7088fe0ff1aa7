"""The overhead benchmark's reading of both trainers' step times (benchmarks/overhead.py): tensorboard events
written by torch's SummaryWriter, as both runs write them (OpenRLHF's TensorboardLogger: `train/<key>`), read
back per step; the steady state drops the warm-up steps and times each step from the previous one's log
record. No training here; the benchmark itself runs both trainers."""

import asyncio
import os
import sys
from types import SimpleNamespace

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


class Engine:
    """A stand-in for an agent's vLLM engine actor (no engine here: generating is the benchmark's part): it
    records the SamplingParams it was asked with and returns vLLM's output shape, a log-prob per token only
    when they were asked for, as vLLM does."""

    def __init__(self):
        self.asked = []
        self.generate = self

    def remote(self, prompt_ids, params):
        self.asked.append(params)
        logprobs = None
        if params.logprobs:
            logprobs = [{7: SimpleNamespace(logprob=-0.5)}, {8: SimpleNamespace(logprob=-1.5)}]
        done = asyncio.get_event_loop().create_future()
        done.set_result(SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7, 8], logprobs=logprobs,
                                                                 finish_reason="stop")]))
        return done


@pytest.mark.parametrize("asked", [True, False])
def test_rollout_logprobs_are_asked_for_only_where_read(asked):
    # Issue 66: the per-token log-prob objects were most of MAPPA's generation overhead on OpenRLHF's. The
    # policy asks vLLM for them only when a reader is on (rollout.logprobs_read), and then returns each one.
    from openrlhf_mappa.rollout import AgentPolicy

    engine = Engine()
    policy = AgentPolicy([engine], tokenizer=None, max_new_tokens=2, max_len=8, logprobs=asked)
    ids, truncated, logprobs = asyncio.run(policy.generate([1, 2, 3]))
    assert ids == [7, 8] and not truncated
    assert (engine.asked[0].logprobs, logprobs) == ((1, [-0.5, -1.5]) if asked else (None, []))


def test_logprobs_are_read_by_the_correction_the_ratio_async_and_the_metrics_switch():
    from openrlhf_mappa.rollout import logprobs_read

    def args(level="off", ratio="trainer", is_async=False, metrics=False):
        return SimpleNamespace(algo=SimpleNamespace(advantage=SimpleNamespace(is_correction_level=level)),
                               mappa=SimpleNamespace(ppo_ratio=ratio, logprob_metrics=metrics),
                               train=SimpleNamespace(async_enable=is_async))

    assert not logprobs_read(args())  # OpenRLHF's default: none asked for
    assert logprobs_read(args(level="token")) and logprobs_read(args(ratio="rollout"))
    assert logprobs_read(args(is_async=True)) and logprobs_read(args(metrics=True))
