"""Start-up without compiling or waiting on a build lock: DeepSpeed's CPU ops come built with the environment
(`make install`), and every process of the environment uses the environment's own extension cache."""

import os
import subprocess
import sys
import textwrap

import pytest

OPS = ("deepspeed_shm_comm", "fused_adam")  # the ops a CPU run loads


def test_each_environment_has_its_own_extension_cache():
    code = "import os, sys; print(os.environ['TORCH_EXTENSIONS_DIR']); print(sys.prefix)"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    cache, prefix = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                   check=True, timeout=60).stdout.split()  # fmt: skip
    assert cache == os.path.join(prefix, "torch_extensions")
    out = subprocess.run([sys.executable, "-c", code], env=dict(env, TORCH_EXTENSIONS_DIR="/elsewhere"),
                         capture_output=True, text=True, check=True, timeout=60).stdout  # fmt: skip
    assert out.split()[0] == "/elsewhere"  # a cache the user names is kept


def test_deepspeed_cpu_ops_load_prebuilt_past_stale_locks(tmp_path):
    """Loads each op as DeepSpeed does at run time, with a stale build lock planted for it in an empty cache:
    a prebuilt op is imported, so the lock is never consulted and nothing is built. A JIT-built one would
    wait for the lock forever (here: until the timeout, which fails the test)."""
    for op in OPS:
        (tmp_path / op).mkdir()
        (tmp_path / op / "lock").touch()
    code = textwrap.dedent(f"""
        from deepspeed.accelerator import get_accelerator
        from deepspeed.git_version_info import installed_ops
        print("not built at install:", [op for op in {OPS!r} if not installed_ops[op]], flush=True)
        for name in ("ShareMemCommBuilder", "FusedAdamBuilder"):
            get_accelerator().create_op_builder(name).load()
    """)
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    try:
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"loading the ops waited on the planted locks (run `make install`): {e.stdout.decode()}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not built at install: []" in proc.stdout.splitlines(), proc.stdout
    assert sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*")) == sorted(OPS + tuple(f"{op}/lock" for op in OPS))
