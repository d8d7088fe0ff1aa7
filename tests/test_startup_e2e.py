"""Start-up, for real (Ray, vLLM, DeepSpeed ZeRO-3 on CPU): a run killed while its actor initialises leaves no
process behind, and the same command then reaches step 1 even past stale build locks in the environment's
extension cache (its ops were built at install, so the locks are never consulted; the start-up watchdog names
them). That run is also the baselines' (one shared policy, group normalization, evaluation during training; see
test_eval_e2e). A start-up that cannot finish (another job holds every GPU) is named, then stopped, never silent."""

import contextlib
import json
import os
import re
import sys
import textwrap
import time

import pytest

from conftest import TINY_RUN_FLAGS, local_cluster_env, run_training, training, two_agent_mathchat, wait_for
from test_eval_e2e import assert_shared_policy_group_norm_run


def processes_of(run_id: str) -> dict:
    """{pid: command line} of the live processes whose environment carries MAPPA_TEST_RUN=run_id: a driver
    passes its environment on to everything it starts (Ray's daemons and workers, engines, actors)."""
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):
            if f"MAPPA_TEST_RUN={run_id}".encode() in open(f"/proc/{pid}/environ", "rb").read().split(b"\0"):
                found[int(pid)] = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
    return found


def shared_policy_argv(tmp_path, tiny_model, *flags) -> list:
    """One step of a two-role MathChat team on one policy: one actor and one engine, the cheapest real run."""
    topology, tasks = two_agent_mathchat(tmp_path, num_tasks=2)
    return [
        "--mappa.topology", topology,
        "--mappa.model", tiny_model,
        "--mappa.run_dir", str(tmp_path / "run"),
        "--mappa.shared_policy",
        "--data.prompt_dataset", tasks,
        *TINY_RUN_FLAGS,
        "--ckpt.path", str(tmp_path / "ckpt"),
        "--ckpt.output_dir", str(tmp_path / "final"),
        *flags,
    ]  # fmt: skip


@pytest.mark.e2e
def test_start_up_killed_then_restarted_past_stale_locks(tmp_path, tiny_model):
    # Run 2 is also the baselines' run: one shared policy for both roles, GRPO-style group normalization, evaluation
    # before and after training (checked in test_eval_e2e.assert_shared_policy_group_norm_run), on the training tasks
    # themselves: allowed by --mappa.allow_eval_overlap (the launcher refuses an eval set of training problems).
    argv = shared_policy_argv(tmp_path, tiny_model, "--mappa.startup_warn_s", "10", "--mappa.startup_timeout_s", "300",
                              "--mappa.norm_scope", "group", "--eval.dataset", str(tmp_path / "tasks.jsonl"),
                              "--mappa.allow_eval_overlap",
                              "--eval.n_samples_per_prompt", "2", "--actor.adam.lr", "1e-2", "--actor.lr_warmup_ratio", "0")
    cmd = [sys.executable, "-m", "openrlhf_mappa.cli.train_mappa_ray", *argv]
    run_id = str(tmp_path)
    env = local_cluster_env(2, MAPPA_TEST_RUN=run_id)

    # Run 1: the test fails on purpose while the actor initialises its model (where DeepSpeed would compile
    # its ops, taking the build lock); the `training` block must leave no process of the run behind.
    def initialising():
        return any("init_model_from_pretrained" in c for c in processes_of(run_id).values())

    with pytest.raises(AssertionError, match="on purpose"):
        with training(cmd, tmp_path / "train1", cwd=tmp_path, env=env) as run1:
            wait_for(run1, initialising, 600, "actor initialising its model")
            raise AssertionError("failing on purpose, mid start-up")
    deadline = time.time() + 10  # SIGKILLed processes go within moments
    while processes_of(run_id) and time.time() < deadline:
        time.sleep(0.2)
    assert processes_of(run_id) == {}, "processes of the killed run were left behind"

    # Run 2, the same command, with the locks a build killed midway leaves, in the environment's own cache.
    cache = os.environ["TORCH_EXTENSIONS_DIR"]  # set for every process of the environment (openrlhf_mappa.compat)
    locks = [os.path.join(cache, op, "lock") for op in ("deepspeed_shm_comm", "fused_adam")]
    planted = [lock for lock in locks if not os.path.exists(lock)]
    try:
        for lock in planted:
            os.makedirs(os.path.dirname(lock), exist_ok=True)
            open(lock, "x").close()
        proc = run_training(cmd, tmp_path / "train2", timeout=900, cwd=tmp_path, env=env)
    finally:
        for lock in planted:  # the cache as the test found it
            os.remove(lock)
            with contextlib.suppress(OSError):
                os.rmdir(os.path.dirname(lock))  # when the test made it, empty
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert [json.loads(line)["step"] for line in open(tmp_path / "run" / "metrics.jsonl")] == [1]
    # The console without --mappa.verbose: the step line and the summary with the paths; Ray's start-up noise
    # is in the run's train.log instead.
    assert "[mappa] step 1/1 | success " in proc.stderr and "| coach problem_solver " in proc.stderr
    assert f"[mappa] log:         {tmp_path / 'run' / 'train.log'}" in proc.stdout.splitlines()
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr
    assert "Started a local Ray instance" in (tmp_path / "run" / "train.log").read_text()
    warnings = [line for line in proc.stderr.splitlines() if "start-up not done after" in line]
    assert warnings, proc.stderr[-4000:]  # every 10 s of start-up, the watchdog says what is not up yet ...
    assert all(f"the build lock {lock}" in warnings[0] for lock in locks), warnings[0]  # ... and sees the locks
    assert_shared_policy_group_norm_run(tmp_path / "run")


@pytest.mark.e2e
def test_start_up_without_a_free_gpu_is_named_then_stopped(tmp_path, tiny_model):
    # 30 s: room on a loaded machine to reach the engines' stage before the stop (at 8 s it once had not).
    argv = shared_policy_argv(tmp_path, tiny_model, "--mappa.startup_warn_s", "2", "--mappa.startup_timeout_s", "30")
    child = textwrap.dedent(f"""
        import ray
        from ray.util.placement_group import placement_group
        from openrlhf_mappa.cli.train_mappa_ray import parse_args, train

        ray.init()
        ray.get(placement_group([{{"GPU": 2}}]).ready())  # another job holds both GPUs of the cluster
        train(parse_args({argv!r}))
    """)
    proc = run_training([sys.executable, "-c", child], tmp_path / "train", timeout=300, cwd=tmp_path, env=local_cluster_env(2))
    assert proc.returncode != 0, proc.stderr[-4000:]
    warning = next((line for line in proc.stderr.splitlines() if "start-up not done after" in line), "")
    assert "Stops after --mappa.startup_timeout_s 30" in warning, proc.stderr[-4000:]
    stop = proc.stderr.split("[mappa] stopping: ")[-1].splitlines()[0]
    assert stop.startswith("start-up not done after"), proc.stderr[-4000:]
    # Every placement group is asked for before any component starts: the components waiting on them are named.
    assert "not up yet: agent 'problem_solver': vLLM engine 0, agent 'problem_solver': actor rank 0;" in stop
    assert re.search(r"a placement group Ray cannot place: \[\{[^]]*'GPU': 1\.0[^]]*\}\], 0 GPUs free", stop), stop
    assert stop.endswith("Stopped by --mappa.startup_timeout_s 30.")
