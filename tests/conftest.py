import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from html.parser import HTMLParser
from types import SimpleNamespace

import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAPPA = os.path.join(os.path.dirname(sys.executable), "mappa")
CI = os.environ.get("CI", "").lower() not in ("", "0", "false")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI (`CI` set, as .ci/run sets it) a skip is a failure: CI provides every prerequisite a test may skip
    without (the shared benchmark data, Chromium, root), so a skip there means one went missing, silently."""
    report = (yield).get_result()
    if CI and report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.outcome, report.longrepr = "failed", f"skipped under CI, where nothing may be: {reason}"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny model built by the real `mappa tiny-model` console script."""
    out = str(tmp_path_factory.mktemp("models") / "tiny")
    subprocess.run([MAPPA, "tiny-model", out, "--seed", "0"], check=True, capture_output=True, timeout=300)
    return out


def local_cluster_env(num_gpus: int, **extra) -> dict:
    """The environment of a training subprocess: a new local Ray cluster with `num_gpus` logical GPUs, never
    a cluster that RAY_ADDRESS happens to name, and without Ray's dashboard, which no test of a local cluster
    reads (its start costs ~15 s of CPU per run; test_user_install's cluster, started as a user does, has it)."""
    env = dict(os.environ, MAPPA_CPU_NUM_GPUS=str(num_gpus), MAPPA_CPU_RAY_DASHBOARD="0", **extra)
    env.pop("RAY_ADDRESS", None)
    return env


@contextlib.contextmanager
def training(cmd: list, log, **popen):
    """A training process (the driver of its own Ray cluster, engines and actors) for the span of a `with`
    block, its output in `log`.out and `log`.err. It starts in a session of its own, and at the block's end,
    pass or fail, its whole process group is SIGKILLed: a failed test once left a cluster running, holding
    a build lock that hung every later run."""
    with open(f"{log}.out", "w") as out, open(f"{log}.err", "w") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, start_new_session=True, **popen)
    proc.log = str(log)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_for(proc, done, timeout: float, what: str):
    """Poll `done()` until it holds. If the run ends first or `timeout` seconds pass, fail with the run's
    last log lines, so that a slow or stuck run says where it was."""
    deadline = time.time() + timeout
    while not done():
        ended = proc.poll() is not None and not done()
        if ended or time.time() > deadline:
            tails = [f"--- {proc.log}.{stream}, last lines ---\n" + "\n".join(open(f"{proc.log}.{stream}").read().splitlines()[-60:])
                     for stream in ("out", "err")]  # fmt: skip
            why = f"the run exited with {proc.returncode} before {what}" if ended else f"no {what} within {timeout:g} s"
            pytest.fail(why + "\n" + "\n".join(tails))
        time.sleep(0.5)


def run_training(cmd: list, log, timeout: float, **popen) -> subprocess.CompletedProcess:
    """`cmd` run to its end, at most `timeout` seconds, as a `training` block: its exit code and output."""
    with training(cmd, log, **popen) as proc:
        wait_for(proc, lambda: proc.poll() is not None, timeout, "end of the run")
    return subprocess.CompletedProcess(cmd, proc.returncode, open(f"{log}.out").read(), open(f"{log}.err").read())


# The tiny MAPPA runs of the e2e tests: per agent one actor GPU and one eager vLLM engine, ZeRO-3 with SDPA
# (no flash-attn on CPU), no reference model; per step 2 tasks x 2 samples, trained as one batch of 4.
TINY_RUN_FLAGS = [
    "--actor.num_gpus_per_node", "1",
    "--vllm.num_engines", "1",
    "--vllm.enforce_eager",
    "--vllm.gpu_memory_utilization", "0.2",
    "--ds.zero_stage", "3",
    "--ds.attn_implementation", "sdpa",
    "--algo.kl.init_coef", "0",
    "--rollout.batch_size", "2",
    "--rollout.n_samples_per_prompt", "2",
    "--rollout.micro_batch_size", "2",
    "--rollout.max_new_tokens", "12",
    "--data.max_len", "512",
    "--train.batch_size", "4",
    "--train.micro_batch_size", "2",
    "--train.num_episodes", "1",
    # A random tiny model seldom ends within 12 tokens; its cut-off actions must still train here.
    "--mappa.train_truncated",
]  # fmt: skip


def openrlhf_copy(dest, *patches) -> str:
    """A copy of the installed openrlhf (the pinned release) in `dest`/openrlhf, with the upstream-candidate diffs
    `patches` (file names in patches/) applied in order by `patch -p1`, as their headers say. Each must apply
    cleanly: `git apply --check` and `patch --dry-run` pass, and neither run reports fuzz or an offset, which
    would mean the diff was made against other source. Returns `dest`: put it first on sys.path (or PYTHONPATH)
    and the copy shadows the installed package."""
    import importlib.util

    installed = os.path.dirname(importlib.util.find_spec("openrlhf").origin)  # locates it, imports nothing
    shutil.copytree(installed, os.path.join(dest, "openrlhf"), ignore=shutil.ignore_patterns("__pycache__"))
    for name in patches:
        diff = os.path.join(REPO, "patches", name)
        checks = (["git", "apply", "--check", "-p1", diff], ["patch", "-p1", "--dry-run", "-i", diff])
        for cmd in (*checks, ["patch", "-p1", "-i", diff]):
            proc = subprocess.run(cmd, cwd=dest, capture_output=True, text=True, timeout=60)
            said = proc.stdout + proc.stderr
            assert proc.returncode == 0 and not re.search(r"FAILED|fuzz|offset", said), f"{name}: {cmd[:3]}: {said}"
    return str(dest)


def submit_script(script, tmp_path, **env) -> tuple:
    """Run a GPU launch script for real under bash, with one stand-in: `ray` on PATH records the submission instead
    of sending it to a GPU cluster, which cannot exist here. Returns (the arguments `ray` got, the finished
    process); `env` adds environment variables (the coach's URL and model have defaults; the paper's data files are
    not checked unless MAPPA_SKIP_DATA_CHECK is given as "0": examples/scripts/paper_data.sh; the dry run, which
    needs the recipe's models and coach, is skipped: tests/test_check.py runs it)."""
    stub = tmp_path / "bin" / "ray"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text(f"#!/bin/sh\n{sys.executable} -c 'import json, sys; print(json.dumps(sys.argv[1:]))' \"$@\" "
                    f"> {tmp_path / 'submitted.json'}\n")
    stub.chmod(0o755)
    env = dict(os.environ, PATH=f"{stub.parent}{os.pathsep}{os.environ['PATH']}", **{
        "MAPPA_COACH_BASE_URL": "http://coach:8001/v1", "MAPPA_COACH_MODEL": "Qwen/Qwen3-32B",
        "MAPPA_SKIP_DATA_CHECK": "1", "MAPPA_SKIP_CHECK": "1", **env})
    proc = subprocess.run(["bash", str(script)], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((tmp_path / "submitted.json").read_text()), proc


def two_agent_mathchat(tmp_path, num_tasks: int):
    """MathChat's Problem Solver and Verifier (one action each) and `num_tasks` sums; returns their paths. The
    prompts of mathchat_own_rubric.yaml: the authors' (mathchat.yaml) alone take ~530 of the tiny runs' 512
    tokens for the Verifier (the tiny model's tokens are bytes)."""
    topology = yaml.safe_load(open(os.path.join(REPO, "examples", "configs", "mathchat_own_rubric.yaml")))
    # view all: the Verifier's own view names the Code Executor, who is left out here
    kept = [a for a in topology["agents"] if a["name"] in ("problem_solver", "verifier")]
    topology["agents"] = [dict(a, max_actions=1, view="all") for a in kept]
    (tmp_path / "topology.yaml").write_text(yaml.safe_dump(topology))
    with open(tmp_path / "tasks.jsonl", "w") as f:
        for i in range(num_tasks):
            f.write(json.dumps({"id": i, "prompt": f"What is {i} + 2?", "answer": str(i + 2)}) + "\n")
    return str(tmp_path / "topology.yaml"), str(tmp_path / "tasks.jsonl")


JSON_TYPES = {"str": str, "int": int, "float": (int, float), "bool": bool, "list": list, "object": dict}


def documented_records() -> dict:
    """{record: {key: (JSON types, optional)}}: the tables of docs/reference.md's "The episodes.jsonl record",
    each after its `<!-- record: NAME -->` marker; a type "T or null" allows null."""
    text = open(os.path.join(REPO, "docs", "reference.md"), encoding="utf-8").read()
    section = text.split("\n## The episodes.jsonl record\n", 1)[1].split("\n## ", 1)[0]
    tables, rows = {}, None
    for line in section.splitlines():
        marker = re.fullmatch(r"<!-- record: (\w+) -->", line)
        if marker:
            rows = tables.setdefault(marker.group(1), {})
        elif line.startswith("| `") and rows is not None:
            key, types = (cell.strip() for cell in line.split("|")[1:3])
            rows[key.split("`")[1]] = (types.split(" or "), "*(optional)*" in key)
    return tables


def assert_documented_episodes(path: str) -> dict:
    """Every record of an episodes.jsonl file has the keys docs/reference.md documents for it, no other, each of
    its documented type; so do its actions, their feedback, coach requests, verdicts, and its review. Returns how
    many of each record were checked."""
    from openrlhf_mappa.episode import read_jsonl

    docs, seen = documented_records(), {}

    def check(record: dict, name: str, where: str):
        keys = docs[name]
        required = {k for k, (_, optional) in keys.items() if not optional}
        missing, undocumented = sorted(required - set(record)), sorted(set(record) - set(keys))
        assert not missing and not undocumented, f"{where}: {name}: missing {missing}, undocumented {undocumented}"
        for key, value in record.items():
            types, _ = keys[key]
            allowed = tuple(JSON_TYPES[t] for t in types if t != "null")
            if value is None:
                ok = "null" in types
            else:  # a JSON true is no int here
                ok = isinstance(value, allowed) and (not isinstance(value, bool) or "bool" in types)
            assert ok, f"{where}: {name}.{key} = {value!r}, documented as {' or '.join(types)}"
        seen[name] = seen.get(name, 0) + 1

    for lineno, episode in read_jsonl(path):
        where = f"{path}: line {lineno}"
        check(episode, "episode", where)
        if episode["review"] is not None:
            check(episode["review"], "review", where)
        for action in episode["actions"]:
            check(action, "action", where)
            check(action["feedback"], "feedback", where)
            check(action["coach_request"], "coach_request", where)
            for verdict in [action["verdict"], *action["verdict_parts"].values()]:
                if verdict is not None:
                    check(verdict, "verdict", where)
    return seen


RECORDED = ("sequences", "attention_mask", "action_mask", "rewards", "kl", "action_log_probs", "rollout_log_probs",
            "returns", "advantages")


def record_experiences(path: str):
    """From here on in this process (a training child of a test), every step's experience tensors of every agent go
    to `path`, as the advantage step leaves them: a list, one {agent: [{RECORDED field: tensor}, ...]} per step.
    rewards.compute_advantages is observed, not replaced. A step calls it once per agent (each as its verdicts come
    in, from the agents' threads) or once for the team: a call naming an agent already recorded starts a step."""
    import threading

    import torch

    from openrlhf_mappa import rewards

    steps, compute, lock = [], rewards.compute_advantages, threading.Lock()

    def recording(batches_by_agent, *args, **kwargs):
        advantage_of = compute(batches_by_agent, *args, **kwargs)
        recorded = {name: [{k: getattr(b, k).clone() for k in RECORDED if getattr(b, k) is not None} for b in batches]
                    for name, batches in batches_by_agent.items()}  # fmt: skip
        with lock:
            if not steps or set(recorded) & set(steps[-1]):
                steps.append({})
            steps[-1].update(recorded)
            torch.save(steps, path)
        return advantage_of

    rewards.compute_advantages = recording


def assert_rows_are_their_actions(steps: list, episodes: list, tokenizer, first_step: int = 1) -> dict:
    """Every row an agent trained on (`steps` as record_experiences saved them, the first of step `first_step`) is one
    of that agent's own actions of that step in episodes.jsonl, token for token (its prompt's ids, its decoded reply),
    each action at most once, and trained on that action's own values: the row's reward is the action's reward (0 for
    an unscored zero-loss row, whose action has none), and the advantage recorded for the action is the row's mean
    advantage over its tokens (0 for a zero-loss row), and the row's rollout log-probs (on its action tokens) are the
    ones vLLM sampled that action with. An action that trained no row recorded no advantage.
    Returns {(step, agent): [(episode index, action index) of each row, in row order]}."""
    trained = {}
    for step, by_agent in enumerate(steps, first_step):
        for name, batches in by_agent.items():
            own, rows = {}, trained.setdefault((step, name), [])
            for i, ep in enumerate(episodes):
                for j, a in enumerate(ep["actions"]):
                    if ep["step"] == step and a["agent"] == name and (a["reward"] is not None or a["zero_loss"]):
                        key = (tuple(tokenizer(a["prompt_text"], add_special_tokens=False)["input_ids"]), a["response_text"])
                        own.setdefault(key, []).append((i, j))  # token-identical actions: interchangeable
            for b in batches:
                mask_BA = b["action_mask"].bool()
                mean_adv_B = (b["advantages"].float() * mask_BA).sum(1) / mask_BA.sum(1)
                # no rollout log-probs where nothing reads them (rollout.logprobs_read): none recorded either
                sampled_B = ([lp[m].tolist() for lp, m in zip(b["rollout_log_probs"].float(), mask_BA)]
                             if "rollout_log_probs" in b else [[]] * len(mask_BA))
                for seq, real, mask, reward, adv, sampled in zip(
                        b["sequences"].tolist(), b["attention_mask"].bool().tolist(), mask_BA.tolist(),
                        b["rewards"].tolist(), mean_adv_B.tolist(), sampled_B):
                    start = mask.index(True) + 1  # the action mask is shifted by one, as OpenRLHF's
                    prompt = tuple(t for t, r in zip(seq[:start], real) if r)
                    reply = tokenizer.decode([t for t, m in zip(seq[1:], mask) if m], skip_special_tokens=True)
                    assert own.get((prompt, reply)), f"step {step}: {name} trained on a row that is none of its actions left"
                    i, j = own[(prompt, reply)].pop(0)
                    a = episodes[i]["actions"][j]
                    expected = a["reward"] if a["reward"] is not None else 0.0  # an unscored zero-loss row: 0
                    assert reward == pytest.approx(expected, abs=1e-6), (step, name, i, j, reward, a["reward"])
                    assert not a["zero_loss"] or adv == 0.0, (step, name, i, j, adv)  # no loss, no gradient
                    assert a["advantage"] == pytest.approx(adv, abs=1e-5), (step, name, i, j, a["advantage"], adv)
                    assert sampled == pytest.approx(a["rollout_logprobs"], abs=1e-4), (step, name, i, j)  # 4 decimals
                    rows.append((i, j))
            for i, j in sum(own.values(), []):
                assert episodes[i]["actions"][j]["advantage"] is None, (step, name, i, j)  # never trained
    return trained


class StandIn:
    """One agent's Ray side as the driver (trainer.MappaTrainer) uses it, for unit tests of the driver's own logic
    (a step where an agent has no batch, the order inside fit), where a Ray launch would cost minutes per case; the
    e2e tests check the same rows against real actors. As the agent's actor group: a save writes the checkpoint
    directory DeepSpeed leaves, with a states file only (and calls `on_save(step)`); a resume reads its step back.
    As its trainer: the experience maker gives every row zero log-probs and KL (what the actor and reference
    forwards of an unchanged model give), and train_step keeps the experiences it was given. Its calls return
    plain values, not Ray refs: the test passes them through trainer.ray.get (monkeypatched)."""

    def __init__(self, name: str, ckpt: str, on_save=None):
        self.name, self.dir, self.on_save = name, os.path.join(ckpt, name, "_actor"), on_save
        self.experience_maker, self.adapter, self.synced, self.trained = self, None, {}, []
        self.kl_ctl = SimpleNamespace(value=0.0)  # OpenRLHF's FixedKLController at --algo.kl.init_coef 0
        from openrlhf_mappa.rollout import SyncGate

        self.gate = SyncGate()

    def async_run_method(self, method_name, tag=None, **kwargs):
        assert method_name == "save_checkpoint", method_name
        os.makedirs(os.path.join(self.dir, tag))
        with open(os.path.join(self.dir, tag, "mp_rank_00_model_states.pt"), "w") as f:  # what resume.check_resume reads
            f.write("states")
        with open(os.path.join(self.dir, "latest"), "w") as f:
            f.write(tag)
        if self.on_save:
            self.on_save(kwargs["client_states"]["global_step"])
        return [None]

    def async_save_model(self):
        return []

    def init_checkpoint_states(self):
        return {"global_step": int(open(os.path.join(self.dir, "latest")).read()[len("global_step"):])}

    def broadcast_to_vllm(self):
        with self.gate.sync():  # as AgentTrainer's: the next version
            pass

    def split_rollout_samples(self, experiences):
        for i, e in enumerate(experiences):  # as upstream's: each row's index into the rows given
            e.index = [i]
        return experiences

    def make_experience(self, experiences):
        import torch

        for e in experiences:
            e.action_log_probs, e.kl = torch.zeros(e.action_mask.shape), torch.zeros(e.action_mask.shape)
            e.info["kl"] = torch.zeros(len(e.sequences))
        return experiences

    def train_step(self, experiences, step):
        self.trained.append((step, experiences))
        self.broadcast_to_vllm()  # upstream's train_step ends with the sync
        return {"policy_loss": 0.0, "timing/broadcast": 0.0}, step


def stand_in_team(args, topology, on_save=None) -> list:
    """trainer.Agent-like records of `topology`'s agents, each with a StandIn for its actor and trainer, no engines."""
    from openrlhf_mappa.placement import agent_args

    agents = []
    for spec in topology.agents:
        stand_in = StandIn(spec.name, args.ckpt.path, on_save)
        agents.append(SimpleNamespace(spec=spec, args=agent_args(args, spec), tokenizer=None, engines=[], actor=stand_in,
                                      ref=None, trainer=stand_in))
    return agents


def train_step(trainer, step: int, tasks: list) -> dict:
    """One synchronous step of `trainer` (a MappaTrainer) on `tasks`, as its fit runs one: the rollout, then
    MappaTrainer.step; the step's metrics."""
    t_start = time.time()
    with trainer.runner.running():
        with trainer.engines_awake():
            run = trainer.collect(*trainer.start(step, tasks))
        return trainer.step(run, t_start)


class Node:
    """An element of a rendered page: tag, attributes, children (nodes and text)."""

    def __init__(self, tag, attrs):
        self.tag, self.attrs, self.children = tag, dict(attrs), []

    def text(self) -> str:
        return "".join(c if isinstance(c, str) else c.text() for c in self.children)

    def find_all(self, tag, cls=None) -> list:
        found = []
        for c in self.children:
            if isinstance(c, Node):
                if c.tag == tag and (cls is None or cls in c.attrs.get("class", "").split()):
                    found.append(c)
                found += c.find_all(tag, cls)
        return found


class DomParser(HTMLParser):
    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "wbr"}

    def __init__(self):
        super().__init__()
        self.stack = [Node("document", {})]

    def handle_starttag(self, tag, attrs):
        node = Node(tag, attrs)
        self.stack[-1].children.append(node)
        if tag not in self.VOID:
            self.stack.append(node)

    def handle_startendtag(self, tag, attrs):
        self.stack[-1].children.append(Node(tag, attrs))

    def handle_endtag(self, tag):
        if any(n.tag == tag for n in self.stack[1:]):
            while self.stack.pop().tag != tag:
                pass

    def handle_data(self, data):
        self.stack[-1].children.append(data)


def chromium(html_path: str, *args) -> subprocess.CompletedProcess:
    """Headless Chromium on a page, its console on stderr; asserts that no script error was reported. Skips the
    test when Chromium is not installed (under CI, which installs it, that skip fails)."""
    binary = shutil.which("chromium")
    if binary is None:
        pytest.skip("chromium is not installed (apt-get install chromium): the report's page cannot be rendered")
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
           "--enable-logging=stderr", "--v=0", "--virtual-time-budget=5000", *args, "file://" + os.path.abspath(html_path)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    errors = [line for line in proc.stderr.splitlines() if ":CONSOLE" in line and "Uncaught" in line]
    assert proc.returncode == 0 and not errors, (errors, proc.stderr[-3000:])
    return proc


def render_report_dom(html_path: str) -> Node:
    """The page as headless Chromium leaves it after its scripts ran (--dump-dom), parsed; its script ran to
    the end (the body's data-rendered mark)."""
    proc = chromium(html_path, "--dump-dom")
    assert "</html>" in proc.stdout and 'data-rendered="1"' in proc.stdout, proc.stderr[-3000:]
    parser = DomParser()
    parser.feed(proc.stdout)
    return parser.stack[0]


def assert_report_renders(html_path: str, agents, steps: int, episodes: int) -> Node:
    """`mappa report`'s page, rendered: every agent's action-length curve has a dot per logged step, the
    viewer lists the episodes and shows the newest one's actions with their coach verdicts. Returns the DOM."""
    dom = render_report_dom(html_path)
    charts = {f.attrs["data-title"]: f for f in dom.find_all("figure", "chart")}
    dots = {g.attrs["data-series"]: g.find_all("use") for g in charts["agent/*/action_length"].find_all("g", "series")}
    assert {a: len(dots.get(a, [])) for a in agents} == {a: steps for a in agents}
    assert len(dom.find_all("li", "episode")) == episodes
    cards = dom.find_all("div", "action")
    assert cards and all(c.find_all("div", "score") and c.find_all("pre", "rationale") for c in cards)
    assert {c.attrs["data-agent"] for c in cards} <= set(agents)
    return dom


def hybrid_engine_timeline(call_log: str, processes_json: str) -> dict:
    """The hybrid engine's calls as a run made them (patches/hybrid_engine.py logs them under MAPPA_CALL_LOG, each
    from the process that ran it: a line as a call begins, one as it ends), per agent: `awake` spans of each engine
    from a wake_up to the next sleep (weights only or all: either holds GPU memory), `loaded` spans of each actor
    rank from a reload of its DeepSpeed states to the next offload, `train`, `generate`, `sleep` and `init` (an
    engine's start-up) spans of the calls themselves. A span is (first, last) line number in the log: appended by
    every process to one file, the lines' order is the order of events, no clock needed. A span still open at the
    log's end runs to infinity. And `plans`, one per training that ended: the actor's micro-batches under token
    budgets, each the lengths of its rows (None without budgets)."""
    names = {pid: key.split("/")[0] for key, pid in json.load(open(processes_json)).items()}
    out, begun, opened = {}, {}, {}
    kinds = {"wake_up": "awake", "sleep": "awake", "reload": "loaded", "offload": "loaded"}
    calls = {"train": "train", "generate": "generate", "sleep": "sleep", "__init__": "init"}
    for n, c in enumerate(json.loads(line) for line in open(call_log)):
        pid, event, kind = c["pid"], c["event"], kinds.get(c["event"])
        agent = out.setdefault(names[pid], {k: [] for k in ("awake", "loaded", "train", "generate", "init", "sleep",
                                                            "plans")})
        if c.get("begin"):
            begun[pid, c["call"]] = (names[pid], event, n)
            if event in ("wake_up", "reload"):  # a second wake_up (the KV cache after the weights) extends the span
                opened.setdefault((pid, kind), n)
            continue
        first = begun.pop((pid, c["call"]))[2]
        if event in calls:
            agent[calls[event]].append((first, n))
        if event == "train":
            agent["plans"].append(c["plan"])
        if event in ("sleep", "offload") and (pid, kind) in opened:
            agent[kind].append((opened.pop((pid, kind)), n))
    for name, event, first in begun.values():  # calls that never ended
        if event in calls:
            out[name][calls[event]].append((first, float("inf")))
    for (pid, kind), first in opened.items():
        out[names[pid]][kind].append((first, float("inf")))
    return out


def overlaps(spans_a: list, spans_b: list) -> list:
    """The pairs of spans, one from each list, that share any instant."""
    return [(a, b) for a in spans_a for b in spans_b if a[0] < b[1] and b[0] < a[1]]
