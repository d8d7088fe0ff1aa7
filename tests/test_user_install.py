"""The user's way, on CPU: the README's GPU install (`pip install --no-deps .`, not editable) and the GPU scripts'
own `ray job submit --runtime-env-json '{"working_dir": "."}'`, which puts the uploaded copy of the checkout first on
every process's PYTHONPATH. Every other test runs the developers' way (an editable install, `python -m` from the
checkout), whose finder hides what the copy lacks: on that path `import ray` once failed in every process of a job.

What cannot be done here, and how it is stood in for: the install is of the package alone, into a virtual environment
of its own whose one path line reaches .venv's pinned stack (a second full install of torch, vLLM, DeepSpeed and
Ray would cost minutes of CI; the point is that no editable finder is there), and the GPUs are logical ones
(`ray start --num-gpus`).
"""

import json
import os
import re
import shlex
import socket
import subprocess
import sys
import sysconfig
import urllib.request

import pytest

from conftest import REPO, run_training, training, wait_for

GPU_SCRIPT = os.path.join(REPO, "examples", "scripts", "train_mappa_mathchat.sh")
AGENTS = ("quantity", "item", "code")


@pytest.fixture(scope="module")
def user_env(tmp_path_factory):
    """A virtual environment as the README's GPU install leaves it, as far as this machine allows: the package
    installed from the checkout (not editable, with its CPU-patch hook), `ray` on PATH, the pinned stack of .venv
    reached through a plain path line (so .venv's editable finder and hook never run in it)."""
    root = tmp_path_factory.mktemp("user")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "00_cpu_stack.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                    "--no-build-isolation", REPO], check=True, capture_output=True, timeout=600)
    (venv / "bin" / "ray").write_text(f"#!{python}\nimport sys\nfrom ray.scripts.scripts import main\nsys.exit(main())\n")
    (venv / "bin" / "ray").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PYTHONPATH", "MAPPA_CPU_MODE", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env['PATH']}"
    return {"root": root, "python": str(python), "site": site, "env": env}


LOADED = """
import hashlib, json, sys
import ray, openrlhf.trainer.ray.launcher  # the driver's first imports: Ray's, and OpenRLHF's launcher
import openrlhf_mappa.patches.cpu_device as _  # the CPU patches, as a CPU-mode process loads them
files = {n: m.__file__ for n, m in sorted(sys.modules.items()) if n.split(".")[0] == "openrlhf_mappa" and getattr(m, "__file__", None)}
print("LOADED " + json.dumps(dict(
    files=files, sha={n: hashlib.sha256(open(f, "rb").read()).hexdigest() for n, f in files.items()},
    finders=[type(f).__name__ for f in sys.meta_path],
    patched={n: getattr(sys.modules.get(n), "__mappa_cpu_patches__", None) for n in ("ray", "openrlhf.models.ring_attn_utils")})))
"""


@pytest.mark.parametrize("cpu_mode", ["1", "0"])  # 0: what a CUDA build of torch decides (forced on this machine)
def test_installed_package_and_working_dir_copy_load_the_same_code(user_env, tmp_path, cpu_mode):
    # Installed: run from anywhere. A job's working directory: the checkout first on PYTHONPATH, as Ray's working_dir
    # puts it for the driver and every worker. In GPU mode the CPU-device patches refuse to load, so that one is
    # imported in CPU mode only.
    probe = LOADED if cpu_mode == "1" else LOADED.replace("import openrlhf_mappa.patches.cpu_device as _", "")
    runs = {}
    for where, cwd, env in (("installed", tmp_path, {}), ("working dir", REPO, {"PYTHONPATH": REPO})):
        proc = subprocess.run([user_env["python"], "-c", probe], cwd=cwd, capture_output=True, text=True, timeout=300,
                              env=dict(user_env["env"], MAPPA_CPU_MODE=cpu_mode, **env))
        assert proc.returncode == 0, (where, proc.stderr[-3000:])
        runs[where] = json.loads(next(l for l in proc.stdout.splitlines() if l.startswith("LOADED "))[len("LOADED "):])
    installed, copy = runs["installed"], runs["working dir"]
    roots = {"installed": user_env["site"], "working dir": REPO}
    for where, run in runs.items():
        assert "_EditableFinder" not in " ".join(run["finders"]), where  # no editable install anywhere
        assert run["files"] and all(f.startswith(roots[where] + os.sep) for f in run["files"].values()), (where, run["files"])
    assert copy["files"]["openrlhf_mappa.patches"] == os.path.join(REPO, "patches", "__init__.py")
    # The same modules, the same bytes, the same patches applied, from either copy.
    assert set(installed["files"]) == set(copy["files"]) and installed["sha"] == copy["sha"]
    assert installed["patched"] == copy["patched"] == {
        "ray": ["ray_logical_gpus"],
        "openrlhf.models.ring_attn_utils": ["flash_attn_stub", "cpu_device"] if cpu_mode == "1" else ["flash_attn_stub"]}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def submit_form(address: str) -> list:
    """The GPU script's own `ray job submit ... -- python3 -m`, read from the script, at this cluster's address."""
    text = open(GPU_SCRIPT).read()
    block = text[text.index("\nray job submit") + 1 :]
    argv = shlex.split(block[: block.index(" -m ") + 3].replace("\\\n", " "))
    assert argv[:3] == ["ray", "job", "submit"] and argv[-3:] == ["--", "python3", "-m"], argv
    assert any(a.startswith("--runtime-env-json=") and json.loads(a.split("=", 1)[1]) == {"working_dir": "."} for a in argv)
    return [f"--address={address}" if a.startswith("--address=") else a for a in argv]


@pytest.mark.e2e
def test_ray_job_submit_from_a_user_install_checks_the_cluster_trains_and_resumes(user_env, tmp_path):
    # A cluster of two nodes as a user starts one (`ray start --head`, then `ray start --address` on the other
    # node; here both on this machine, with logical GPUs and --block, so that each node is one process group,
    # killed at the end), with the user's environment. The head has 2 GPUs, the other node 1: the plan puts one
    # agent there, and its actor and engine are placed on that node as planned.
    out = tmp_path / "out"  # MAPPA_OUT: absolute, outside the job's copy of the checkout
    tiny = out / "tiny-model"
    subprocess.run([os.path.join(os.path.dirname(user_env["python"]), "mappa"), "tiny-model", str(tiny)], check=True,
                   capture_output=True, env=user_env["env"], timeout=300)
    dashboard = free_port()
    env = dict(user_env["env"], VLLM_CPU_KVCACHE_SPACE="1")
    gcs = free_port()
    head = ["ray", "start", "--head", "--block", "--num-gpus", "2", "--num-cpus", str((os.cpu_count() or 1) + 2),
            f"--port={gcs}", f"--dashboard-port={dashboard}", f"--dashboard-agent-listen-port={free_port()}",
            f"--ray-client-server-port={free_port()}", "--temp-dir", str(user_env["root"] / "ray"), "--disable-usage-stats"]
    node1 = ["ray", "start", f"--address=127.0.0.1:{gcs}", "--block", "--num-gpus", "1", "--num-cpus", "2",
             f"--dashboard-agent-listen-port={free_port()}", "--temp-dir", str(user_env["root"] / "ray1"),
             "--disable-usage-stats"]  # a node's own temp dir, as on a machine of its own: their runtime envs apart
    address = f"http://127.0.0.1:{dashboard}"
    flags = [
        "--mappa.topology", "examples/configs/relay.yaml",  # relative: the job's copy of the checkout has it
        "--mappa.model", str(tiny),
        "--mappa.coach.kind", "heuristic",
        "--mappa.run_dir", str(out / "run"),
        "--data.prompt_dataset", os.path.join(REPO, "examples", "data", "relay_train.jsonl"),
        "--data.max_samples", "4", "--train.num_episodes", "4",  # 8 steps of 2 tasks x 2 samples
        "--mappa.colocate", "agent", "--vllm.enable_sleep", "--ds.enable_sleep",  # the GPU script's placement
        "--mappa.actor_threads", "2",
        "--actor.num_gpus_per_node", "1", "--vllm.num_engines", "1", "--vllm.sync_backend", "gloo",
        "--vllm.enforce_eager", "--vllm.gpu_memory_utilization", "0.2", "--ds.zero_stage", "3",
        "--ds.attn_implementation", "sdpa", "--algo.kl.init_coef", "0", "--actor.adam.lr", "1e-2",
        "--rollout.batch_size", "2", "--rollout.n_samples_per_prompt", "2", "--rollout.micro_batch_size", "2",
        "--rollout.max_new_tokens", "12", "--data.max_len", "512", "--train.batch_size", "4",
        "--train.micro_batch_size", "2", "--mappa.train_truncated",
        "--ckpt.save_steps", "1", "--ckpt.load_enable", "--ckpt.save_hf", "--ckpt.max_num", "1",
        "--ckpt.path", str(out / "ckpt"), "--ckpt.output_dir", str(out / "hf"),
    ]  # fmt: skip
    with training(head, tmp_path / "ray-head", env=env) as cluster, training(node1, tmp_path / "ray-node1", env=env):
        wait_for(cluster, lambda: dashboard_up(address), 180, "the Ray dashboard")
        wait_for(cluster, lambda: len(state(address, "nodes")) == 2, 180, "the second node")
        wait_for(cluster, lambda: jobs_accepted(address), 180, "the head node's job agent")
        form = submit_form(address)

        # The self-check first, as the README asks before a long job: the same flags, the small model.
        doctor = run_training(form + ["openrlhf_mappa.tools.mappa", "doctor", *flags], tmp_path / "doctor",
                              timeout=900, cwd=REPO, env=env)
        rows = doctor_rows(doctor.stdout)
        assert doctor.returncode == 0 and "0 failed" in doctor.stdout, doctor.stdout[-4000:]
        assert {rows["weights synced", a][0] for a in AGENTS} == {"ok"} and {rows["train step", a][0] for a in AGENTS} == {"ok"}
        threads = [rows["threads", a] for a in AGENTS]  # each agent's one actor rank (no reference: KL 0)
        assert all(r[0] == "ok" and "OMP_NUM_THREADS=2, torch 2 threads" in r[1] for r in threads), threads

        # Training, stopped as a preempted job would be (`ray job stop`) once the first team checkpoint exists ...
        marker = out / "ckpt" / "mappa_checkpoint.json"
        with training(form + ["openrlhf_mappa.cli.train_mappa_ray", *flags], tmp_path / "job1", cwd=REPO, env=env) as job1:
            submitted = lambda: re.search(r"Job '(raysubmit_\w+)' submitted", open(f"{job1.log}.out").read())
            wait_for(job1, submitted, 300, "the job's submission")
            wait_for(job1, marker.exists, 900, "the first team checkpoint")
            # Ray's REST call, as `ray job stop` makes it (the CLI alone takes seconds to start, and steps are short).
            request = urllib.request.Request(f"{address}/api/jobs/{submitted()[1]}/stop", method="POST")
            assert json.load(urllib.request.urlopen(request, timeout=60))["stopped"]
            job1.wait(timeout=120)
        saved = json.loads(marker.read_text())["step"]
        # ... and the same submission again: it resumes after the checkpoint and finishes.
        job2 = run_training(form + ["openrlhf_mappa.cli.train_mappa_ray", *flags], tmp_path / "job2", timeout=900, cwd=REPO,
                            env=env)
        actors = state(address, "actors")
        worker_node = next(n["node_id"] for n in state(address, "nodes") if not n["is_head_node"])
    log = job2.stdout + job2.stderr
    assert job2.returncode == 0 and "succeeded" in log, log[-4000:]
    assert 1 <= saved < 8 and f"resuming after step {saved}" in log  # stopped mid-run: the resume has steps to do
    # The plan: the first agent on node 1 (the node of 1 GPU, the fullest with room), the others on node 0. Each run
    # (the doctor's, both jobs') put exactly that agent's actor and engine on the second node, in one placement
    # group: its GPU set.
    assert f"1  GPUs: {AGENTS[0]}/actor, on node 1" in log and f"1  GPUs: {AGENTS[1]}/actor, on node 0" in log, log[-4000:]
    assert f"node 1: Ray node {worker_node}, 1 GPUs" in log
    there = {}
    for actor in actors:
        if actor["class_name"] in ("PolicyModelActor", "RolloutRayActor"):
            there.setdefault(actor["job_id"], []).append((actor["node_id"] == worker_node, actor))
    assert len(there) == 3  # the doctor and two jobs
    for job, placed in there.items():
        on_node1 = [a for worker, a in placed if worker]
        assert sorted(a["class_name"] for a in on_node1) == ["PolicyModelActor", "RolloutRayActor"], (job, placed)
        assert len({a["placement_group_id"] for a in on_node1}) == 1 and len(placed) == 6, (job, placed)

    metrics = [json.loads(line) for line in open(out / "run" / "metrics.jsonl")]
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert all(m[f"agent/{a}/updated"] == 1 for m in metrics for a in AGENTS)
    assert json.loads(marker.read_text())["step"] == 8
    for agent in AGENTS:  # --ckpt.max_num 1: one DeepSpeed checkpoint and one HF export left per agent
        kept = sorted(os.listdir(out / "ckpt" / agent))
        assert kept == ["_actor", "global_step8_hf"], (agent, kept)
        assert sorted(os.listdir(out / "ckpt" / agent / "_actor")) == ["global_step8", "latest", "zero_to_fp32.py"]
        assert os.path.isfile(out / "hf" / agent / "config.json")
    assert not os.path.exists(os.path.join(REPO, "runs"))  # nothing written into the checkout


def dashboard_up(address: str) -> bool:
    try:
        with urllib.request.urlopen(address + "/api/version", timeout=5) as r:
            return r.status == 200
    except OSError:
        return False


def state(address: str, what: str) -> list:
    """Ray's state API (`ray list nodes` / `ray list actors --detail`, dead actors included) over the dashboard."""
    url = f"{address}/api/v0/{what}?detail=1&limit=10000" + ("&filter_keys=state&filter_predicates=%3D&filter_values=ALIVE"
                                                              if what == "nodes" else "")
    try:
        with urllib.request.urlopen(url, timeout=60) as r:
            return json.load(r)["data"]["result"]["result"]
    except OSError:
        return []


def jobs_accepted(address: str) -> bool:
    """The head node's job agent has registered: a job that does nothing is accepted. Until then the dashboard, up
    already, answers a submission 500 "No available agent to submit job, please try again later" (after waiting 10 s
    for the agent; on 2 busy cores it registered later than that once, and the doctor's submission failed)."""
    job = json.dumps({"entrypoint": "true"}).encode()
    request = urllib.request.Request(address + "/api/jobs/", data=job, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status == 200
    except OSError:  # urllib's HTTPError (the 500) included
        return False


def doctor_rows(stdout: str) -> dict:
    """(check, agent) -> (result, detail) from `mappa doctor`'s table (columns of 22, 18 and 9 characters)."""
    rows = {}
    for line in stdout.splitlines():
        if line[40:49].strip() in ("ok", "FAIL", "skipped"):
            rows.setdefault((line[:22].strip(), line[22:40].strip()), []).append((line[40:49].strip(), line[49:]))
    return {key: found[0] if len(found) == 1 else found for key, found in rows.items()}
