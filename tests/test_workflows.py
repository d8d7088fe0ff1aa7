"""Who acts when: the chain (default), debate rounds, routing, the action limits and concurrency within a round,
through the real rollout (run_episode) with scripted engines: no model generates, the replies are canned.
The loop-until-agreement example is the README's, run verbatim in test_readme_example.py."""

import asyncio
import dataclasses
import functools
import json
from types import SimpleNamespace

import pytest

from openrlhf_mappa.coach import render_prompt
from openrlhf_mappa.envs.base import MultiAgentEnv
from openrlhf_mappa.envs.mathchat import MathChatEnv, extract_boxed, grade
from openrlhf_mappa.evaluation import evaluate, summarize
from openrlhf_mappa.rollout import AgentPolicy, run_episode
from openrlhf_mappa.team import load_topology
from conftest import REPO
from test_topology_env import RecordingCoach

TASK = {"id": "t1", "prompt": "Tom has 3 boxes of 4 apples and eats 2. How many apples are left?", "answer": "10"}


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


class Script:
    """Scripted engines for run_episode: agent k answers with its next canned reply. Records the prompt each
    generation got and which other generations were still in flight when it started."""

    def __init__(self, tokenizer, replies: dict):
        self.tokenizer, self.in_flight, self.calls = tokenizer, set(), []
        self.policies = {}
        for name, texts in replies.items():
            policy = AgentPolicy(engines=[], tokenizer=tokenizer, max_new_tokens=64, max_len=4096)
            policy.generate = functools.partial(self.generate, name, iter(texts))
            self.policies[name] = policy

    async def generate(self, name, texts, prompt_ids):
        self.calls.append({"agent": name, "prompt": self.tokenizer.decode(prompt_ids), "overlaps": set(self.in_flight)})
        self.in_flight.add(name)
        await asyncio.sleep(0.01)  # an engine takes time; a generation started concurrently is in flight meanwhile
        self.in_flight.discard(name)
        return self.tokenizer(next(texts), add_special_tokens=False)["input_ids"], False, []


def play(topology, script, tmp_path, task=TASK):
    coach = RecordingCoach()
    episode = asyncio.run(run_episode(topology, dict(task), script.policies, coach, str(tmp_path), step=1))
    return episode, coach.requests


def order(episode):
    return [(a.agent, a.turn, a.round, a.position) for a in episode.actions]


def write_topology(tmp_path, env, agents, **extra):
    raw = {"name": "t", "env": env, "coach_template": "{agent} {round} {position} {agent_output} PROCESS_SCORE:",
           "agents": [dict(name=n, model="m", role=n, prompt="{task}\n{history}", **row) for n, row in agents.items()],
           **extra}  # fmt: skip
    path = tmp_path / "topology.yaml"
    path.write_text(json.dumps(raw))  # JSON is valid YAML
    return str(path)


# ---------------------------------------------------------------- the chain (default)


def test_the_default_is_the_chain_one_agent_per_round(tokenizer, tmp_path):
    topology = load_topology(f"{REPO}/examples/configs/mathchat.yaml", model_override="tiny")
    script = Script(tokenizer, {
        "problem_solver": ["3 boxes of 4 apples is 12; eating 2 leaves 10."],
        "code_executor": ["```python\nprint(3 * 4 - 2)\n```", "The program printed 10."],
        "verifier": ["\\boxed{10}"],
    })  # fmt: skip
    episode, requests = play(topology, script, tmp_path)
    assert order(episode) == [("problem_solver", 0, 0, 0), ("code_executor", 0, 1, 1), ("code_executor", 1, 2, 2),
                              ("verifier", 0, 3, 3)]  # fmt: skip
    assert all(not c["overlaps"] for c in script.calls)  # one generation at a time
    assert episode.success and episode.action_limit == ""
    assert [(r.round, r.position) for r in requests] == [(0, 0), (1, 1), (2, 2), (3, 3)]
    assert [json.loads(episode.to_json())["actions"][i]["round"] for i in range(4)] == [0, 1, 2, 3]


# ---------------------------------------------------------------- the authors' prompts (MathChat)

AUTHORS_SUFFIX = "\n\nPlease reason step by step, and put your final answer within \\boxed{}."
# No Qwen3 tokenizer is available offline here: this template, written for the test, drops the reasoning of an
# assistant turn before the last user message as Qwen3's does, and renders the rest as ChatML.
DROPS_REASONING = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}{%- set content = m['content'] %}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CODER_FIRST = ("<think>\nThree boxes of four apples make twelve; two are eaten.\n</think>\n\n"
               "```python\nprint(3 * 4 - 2)\n```")


def qwen3_like_tokenizer():
    from openrlhf_mappa.tools.tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.chat_template = DROPS_REASONING
    return tokenizer


@pytest.mark.parametrize("keep_reasoning", [True, False])
def test_mathchat_prompts_carry_the_authors_suffix_and_the_agents_earlier_reasoning(tmp_path, keep_reasoning):
    """mathchat.yaml, through the real rollout and a template that drops earlier reasoning: every agent's prompt
    and the coach's {task} end the problem with the authors' suffix; the Code Executor's second prompt shows its
    first action as generated, <think> included (the authors' raw text), unless keep_reasoning: false (the
    template's rendering, the behaviour before)."""
    shipped = load_topology(f"{REPO}/examples/configs/mathchat.yaml", model_override="tiny")
    assert shipped.keep_reasoning is True and shipped.problem_suffix == AUTHORS_SUFFIX
    tokenizer = qwen3_like_tokenizer()
    script = Script(tokenizer, {
        "problem_solver": ["3 boxes of 4 apples is 12; eating 2 leaves 10."],
        "code_executor": [CODER_FIRST, "The program printed 10."],
        "verifier": ["\\boxed{10}"],
    })  # fmt: skip
    topology = dataclasses.replace(shipped, keep_reasoning=keep_reasoning)
    episode, requests = play(topology, script, tmp_path)
    problem = TASK["prompt"] + AUTHORS_SUFFIX
    assert [problem in a.prompt_text for a in episode.actions] == [True] * 4
    assert [r.task for r in requests] == [problem] * 4
    assert all(problem in render_prompt(topology.coach_template, r) for r in requests)
    earlier = f"<|im_start|>assistant\n{CODER_FIRST}<|im_end|>\n<|im_start|>user\n#### Output of the code\nstdout:\n10"
    dropped = earlier.replace(CODER_FIRST, CODER_FIRST.split("\n\n", 1)[1])
    second = episode.actions[2]
    assert (second.agent, second.turn) == ("code_executor", 1)
    assert (earlier in second.prompt_text, dropped in second.prompt_text) == (keep_reasoning, not keep_reasoning)
    assert second.prompt_ids == tokenizer(second.prompt_text, add_special_tokens=False)["input_ids"]


def test_eval_prompts_carry_the_authors_suffix(tmp_path):
    """Evaluation renders its tasks through the same topology and environment: the suffix is there too."""
    topology = load_topology(f"{REPO}/examples/configs/mathchat.yaml", model_override="tiny")
    script = Script(qwen3_like_tokenizer(), {"problem_solver": ["12 - 2 = 10."], "code_executor": ["It is 10."],
                                             "verifier": ["\\boxed{10}"]})
    (episode,) = asyncio.run(evaluate(topology, [dict(TASK, type="")], script.policies, 1, str(tmp_path)))
    assert [TASK["prompt"] + AUTHORS_SUFFIX in a.prompt_text for a in episode.actions] == [True] * 3


def test_a_template_that_hides_earlier_replies_cannot_keep_their_reasoning():
    tokenizer = qwen3_like_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }}{% endif %}"
                               "{% endfor %}")
    policy = AgentPolicy(engines=[], tokenizer=tokenizer, max_new_tokens=8, max_len=4096)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": CODER_FIRST},
                {"role": "user", "content": "10"}]
    assert policy.prompt_ids(messages)[0] == "q10"  # the template's own rendering
    with pytest.raises(ValueError, match="does not show an earlier reply as written.*keep_reasoning: false"):
        policy.prompt_ids(messages, keep_reasoning=True)


# ---------------------------------------------------------------- debate


def test_debate_rounds_run_concurrently_then_the_judge_decides(tokenizer, tmp_path):
    topology = load_topology(f"{REPO}/examples/configs/debate.yaml", model_override="tiny")
    script = Script(tokenizer, {
        "debater_a": ["A0: 3 * 4 = 12, so \\boxed{12}.", "A1: B is right, 12 - 2 = 10: \\boxed{10}."],
        "debater_b": ["B0: 3 * 4 - 2 = 10, so \\boxed{10}.", "B1: A forgot the 2 eaten: \\boxed{10}."],
        "judge": ["Both end at 10: \\boxed{10}"],
    })  # fmt: skip
    episode, requests = play(topology, script, tmp_path)
    assert order(episode) == [("debater_a", 0, 0, 0), ("debater_b", 0, 0, 1), ("debater_a", 1, 1, 2),
                              ("debater_b", 1, 1, 3), ("judge", 0, 2, 4)]  # fmt: skip
    # Concurrency: in each debate round debater_b's generation starts while debater_a's is in flight; the
    # judge's starts alone.
    assert [(c["agent"], c["overlaps"]) for c in script.calls] == [
        ("debater_a", set()), ("debater_b", {"debater_a"}), ("debater_a", set()), ("debater_b", {"debater_a"}),
        ("judge", set())]  # fmt: skip
    prompt = {(c["agent"], i): c["prompt"] for i, c in enumerate(script.calls)}
    # Round 0: nobody has argued yet. Round 1: each sees the other's round-0 argument (never its round-1 one,
    # generated at the same time) and its own round-0 argument as its earlier chat turn.
    assert "A0" not in prompt["debater_b", 1] and "B0" not in prompt["debater_a", 0]
    assert "B0" in prompt["debater_a", 2] and "A0" in prompt["debater_a", 2] and "B1" not in prompt["debater_a", 2]
    assert "A0" in prompt["debater_b", 3] and "A1" not in prompt["debater_b", 3]
    # In the order it happened: each its own argument first, then the other's of the same round as the next turn.
    assert prompt["debater_a", 2].index("A0") < prompt["debater_a", 2].index("B0")
    assert prompt["debater_b", 3].index("B0") < prompt["debater_b", 3].index("A0")
    assert all(tag in prompt["judge", 4] for tag in ("A0", "B0", "A1", "B1"))
    assert episode.outcome == {"success": True, "answer": "10", "answered": True} and episode.action_limit == ""
    # The coach knows where each action stands, and only the judge is judged against the answer.
    assert [(r.agent, r.round, r.position, r.ground_truth) for r in requests] == [
        ("debater_a", 0, 0, None), ("debater_b", 0, 1, None), ("debater_a", 1, 2, None), ("debater_b", 1, 3, None),
        ("judge", 2, 4, "10")]  # fmt: skip
    shown = render_prompt(topology.coach_template, requests[3])
    assert "Agent: debater_b; this is its action number 1, taken in round 1 of the debate (action 3 of" in shown


# ---------------------------------------------------------------- routing


class RouterEnv(MultiAgentEnv):
    """The router names the specialist who answers (the first specialist its reply names); then the episode ends."""

    def next_agents(self, turns, last):
        router, *specialists = self.topology.agents
        if not last:
            return [router]
        if router.name in last:
            return [s for s in specialists if s.name in self.history[-1].response][:1]
        return []

    def outcome(self):
        answer = extract_boxed(self.history[-1].response)
        return {"success": grade(answer, self.task["answer"]), "answer": answer}


@pytest.mark.parametrize("route, acted", [
    ("This is counting: arithmetic.", ["router", "arithmetic"]),
    ("Shapes: geometry.", ["router", "geometry"]),
    ("No idea.", ["router"]),  # names nobody: the episode ends after the router
])  # fmt: skip
def test_routing_by_an_agents_output(tokenizer, tmp_path, route, acted):
    topology = load_topology(write_topology(tmp_path, "test_workflows:RouterEnv",
                                            {"router": {}, "arithmetic": {}, "geometry": {}}))  # fmt: skip
    script = Script(tokenizer, {"router": [route], "arithmetic": ["\\boxed{10}"], "geometry": ["\\boxed{7}"]})
    episode, _ = play(topology, script, tmp_path / "ws")
    assert [a.agent for a in episode.actions] == acted
    assert [a.round for a in episode.actions] == list(range(len(acted)))
    assert episode.success == (acted[-1] == "arithmetic") and episode.action_limit == ""


# ---------------------------------------------------------------- limits


class ForeverEnv(MultiAgentEnv):
    """Never ends by itself: every agent, every round. Its outcome claims success, which a stopped episode
    must not keep."""

    def next_agents(self, turns, last):
        return list(self.topology.agents)

    def outcome(self):
        return {"success": True}


def test_an_agent_asked_beyond_its_max_actions_ends_the_episode_as_a_failure(tokenizer, tmp_path):
    topology = load_topology(write_topology(tmp_path, "test_workflows:ForeverEnv", {"a": {"max_actions": 3}}))
    episode, requests = play(topology, Script(tokenizer, {"a": ["again"] * 10}), tmp_path / "ws")
    assert order(episode) == [("a", 0, 0, 0), ("a", 1, 1, 1), ("a", 2, 2, 2)] and len(requests) == 3
    assert episode.action_limit == "agent 'a' asked to act beyond its max_actions 3; more than max_episode_actions 3 actions"
    assert episode.outcome == {"success": False} and not episode.success
    assert json.loads(episode.to_json())["action_limit"] == episode.action_limit
    summary, _ = summarize([episode, episode], ["a"], [dict(TASK)])
    assert summary["action_limit_episodes"] == 2 and summary["accuracy"] == 0.0


def test_max_episode_actions_caps_an_episode_and_never_splits_a_round(tokenizer, tmp_path):
    path = write_topology(tmp_path, "test_workflows:ForeverEnv", {"a": {"max_actions": 9}, "b": {"max_actions": 9}},
                          max_episode_actions=5)  # fmt: skip
    topology = load_topology(path)
    assert topology.max_episode_actions == 5
    episode, _ = play(topology, Script(tokenizer, {"a": ["x"] * 9, "b": ["y"] * 9}), tmp_path / "ws")
    # rounds of two: 2, 4, then a third round would make 6 > 5, so it is not started
    assert [(a.agent, a.round) for a in episode.actions] == [("a", 0), ("b", 0), ("a", 1), ("b", 1)]
    assert episode.action_limit == "more than max_episode_actions 5 actions" and not episode.success


def test_a_finished_workflow_is_not_a_limit(tokenizer, tmp_path):
    """The debate uses its whole budget (2 x 2 + 1 = the sum of max_actions) and ends by itself."""
    topology = load_topology(f"{REPO}/examples/configs/debate.yaml", model_override="tiny")
    assert topology.max_episode_actions is None
    script = Script(tokenizer, {"debater_a": ["1", "2"], "debater_b": ["3", "4"], "judge": ["\\boxed{9}"]})
    episode, _ = play(topology, script, tmp_path)
    assert len(episode.actions) == 5 and episode.action_limit == "" and episode.outcome["answer"] == "9"


class WrongAnswerEnv(ForeverEnv):
    returns = None

    def next_agents(self, turns, last):
        return self.returns(self.topology.agents) if not last else []


@pytest.mark.parametrize("returns", [
    lambda agents: ["a"],  # a name, not the AgentSpec
    lambda agents: [agents[0], agents[0]],  # the same agent twice in one round
    lambda agents: agents[0],  # one AgentSpec, not a list
])  # fmt: skip
def test_next_agents_must_name_this_topologys_agents_once_per_round(tokenizer, tmp_path, monkeypatch, returns):
    monkeypatch.setattr(WrongAnswerEnv, "returns", staticmethod(returns))
    topology = load_topology(write_topology(tmp_path, "test_workflows:WrongAnswerEnv", {"a": {"max_actions": 2}}))
    with pytest.raises(ValueError, match=r"WrongAnswerEnv.next_agents returned .*: expected a list of this topology's"):
        play(topology, Script(tokenizer, {"a": ["x", "y"]}), tmp_path / "ws")


# ---------------------------------------------------------------- topology checks


@pytest.mark.parametrize("value", [0, "5", True, 2.5])
def test_max_episode_actions_must_be_a_positive_integer(tmp_path, value):
    path = write_topology(tmp_path, "mathchat", {"a": {}}, max_episode_actions=value)
    with pytest.raises(ValueError, match=rf"{path}: 'max_episode_actions' must be an integer >= 1"):
        load_topology(path)


def test_a_view_may_name_a_later_agent_only_outside_the_chain(tmp_path):
    agents = {"a": {"view": ["b"]}, "b": {}}
    with pytest.raises(ValueError, match="names 'b', which acts after it"):
        load_topology(write_topology(tmp_path, "mathchat", agents))  # the chain: b has not acted yet
    topology = load_topology(write_topology(tmp_path, "test_workflows:RouterEnv", agents))
    assert topology.agents[0].view.agents == ("b",)


# ---------------------------------------------------------------- weight versions (async training)


def debate_round_trip(tokenizer):
    """The debate topology with scripted replies: two rounds of both debaters, then the judge."""
    topology = load_topology(f"{REPO}/examples/configs/debate.yaml", model_override="tiny")
    script = Script(tokenizer, {
        "debater_a": ["A0: \\boxed{12}.", "A1: \\boxed{10}."], "debater_b": ["B0: \\boxed{10}.", "B1: \\boxed{10}."],
        "judge": ["\\boxed{10}"],
    })  # fmt: skip
    return topology, script


def test_each_action_records_its_agents_weight_versions(tokenizer, tmp_path):
    # Each agent's engines at another version: an action records its own agent's, and the version each agent of an
    # earlier round acted with; never a same-round agent's (generated at the same time, not in its input).
    topology, script = debate_round_trip(tokenizer)
    for name, version in (("debater_a", 4), ("debater_b", 7), ("judge", 1)):
        script.policies[name].gate.version = version
    episode, _ = play(topology, script, tmp_path)
    assert [(a.agent, a.versions, a.version_end) for a in episode.actions] == [
        ("debater_a", {"debater_a": 4}, 4), ("debater_b", {"debater_b": 7}, 7),
        ("debater_a", {"debater_a": 4, "debater_b": 7}, 4), ("debater_b", {"debater_a": 4, "debater_b": 7}, 7),
        ("judge", {"debater_a": 4, "debater_b": 7, "judge": 1}, 1)]  # fmt: skip
    assert json.loads(episode.to_json())["actions"][4]["versions"] == {"debater_a": 4, "debater_b": 7, "judge": 1}


def test_an_agent_that_acted_twice_counts_at_its_oldest_version(tokenizer, tmp_path):
    # A sync of debater_a's weights lands between its two rounds: its second reply is made by version 5, its first
    # by 4. The judge saw both, so its action is as stale as the older one: it records debater_a at 4 (issue 51:
    # the newest, 5, understated how far behind the judge's input was).
    topology, script = debate_round_trip(tokenizer)
    gate = script.policies["debater_a"].gate
    gate.version = 4
    generate = script.policies["debater_a"].generate

    async def then_sync(prompt_ids):
        out = await generate(prompt_ids)
        gate.version += 1  # the trainer's sync, after this generation and before the next round's
        return out

    script.policies["debater_a"].generate = then_sync
    episode, _ = play(topology, script, tmp_path)
    assert [(a.agent, a.versions.get("debater_a")) for a in episode.actions] == [
        ("debater_a", 4), ("debater_b", None), ("debater_a", 5), ("debater_b", 4), ("judge", 4)]


def test_versions_when_syncs_land_between_rounds_and_mid_generation(tokenizer, tmp_path):
    # Weight syncs through the real gates, from threads as the trainer's, while debater_a's first generation is held
    # open: first debater_b's (waiting, as without partial rollouts, for its round-0 generation to leave the gate),
    # so it lands between b's rounds; then debater_a's, partial (wait=False), in the middle of that generation. The
    # engines are Script's stand-ins (no model: what counts is the order, and an engine held open until a sync lands).
    topology, script = debate_round_trip(tokenizer)
    a, b = (script.policies[name] for name in ("debater_a", "debater_b"))
    a_generate, b_generate, b_returned = a.generate, b.generate, asyncio.Event()

    def sync(gate, wait):  # the trainer's sync; no weights behind this gate, only its versions
        with gate.sync(wait=wait):
            pass

    async def b_round_0_returns(prompt_ids):
        out = await b_generate(prompt_ids)
        b_returned.set()  # it entered the gate at version 0
        return out

    async def a_held_open(prompt_ids):
        if not a.gate.log:  # its first generation, until both syncs have landed
            await asyncio.wait_for(b_returned.wait(), 30)
            await asyncio.wait_for(asyncio.to_thread(sync, b.gate, True), 30)
            await asyncio.wait_for(asyncio.to_thread(sync, a.gate, False), 30)
        return await a_generate(prompt_ids)

    a.generate, b.generate = a_held_open, b_round_0_returns
    episode, _ = play(topology, script, tmp_path)
    # An action's own version is its agent's at the START of its generation (A0: 0, though it ended on 1), and
    # every other agent's is the one that agent's actions recorded (their oldest), not its gate's now (both at 1).
    assert [(x.agent, x.versions, x.version_end) for x in episode.actions] == [
        ("debater_a", {"debater_a": 0}, 1), ("debater_b", {"debater_b": 0}, 0),
        ("debater_a", {"debater_a": 1, "debater_b": 0}, 1), ("debater_b", {"debater_a": 0, "debater_b": 1}, 1),
        ("judge", {"debater_a": 0, "debater_b": 0, "judge": 0}, 0)]  # fmt: skip
    assert (a.gate.version, b.gate.version, [s["version"] for s in a.gate.log + b.gate.log]) == (1, 1, [1, 1])


@pytest.mark.parametrize("adapter", [None, "a"])
@pytest.mark.parametrize("partial", [False, True])
def test_a_weight_sync_waits_for_generations_in_flight_unless_partial(partial, adapter, monkeypatch):
    # The real AgentTrainer.broadcast_to_vllm (conftest's StandIn replaces it elsewhere) in a trainer thread, while a
    # generation through AgentPolicy.sample and the trainer's gate is in flight on the rollout's event loop. Without
    # partial rollouts the sync waits for it and holds a new one back until it ends; with them it pauses the engines,
    # sends and resumes while that generation runs on, which ends on the new version. Stand-ins: the engines and the
    # actor group (what send_weights sends through) are recorders and ray.get passes their values on: no vLLM or
    # DeepSpeed runs, the point is the order of the calls against a generation held open until the sync has moved.
    # A LoRA agent (adapter "a") sends its adapter's files to its pool's engines instead of every weight.
    import threading

    import ray

    from openrlhf_mappa.agent_trainer import AgentTrainer
    from openrlhf_mappa.cli.train_mappa_ray import parse_args

    partial_flag = ["--train.partial_rollout_enable"] if partial else []
    args = parse_args(["--mappa.topology", "t.yaml", "--train.async_enable", *partial_flag])
    calls, moved = [], threading.Event()

    class Recorder:  # an engine (each method's .remote) and the actor group (async_run_method): logs the gate's state
        def __getattr__(self, method):
            return SimpleNamespace(remote=lambda *a, **kw: log(method))

        def async_run_method(self, method_name):
            log(method_name)
            return [({"adapter_model.safetensors": b"x"}, 10)] if method_name == "adapter_files" else [None]

    def log(what):
        calls.append((what, gate.version, gate.active))
        moved.set()

    monkeypatch.setattr(ray, "get", lambda refs: refs)
    trainer = AgentTrainer(SimpleNamespace(args=args), Recorder(), None, [Recorder()], None, adapter=adapter)
    gate, sync = trainer.gate, threading.Thread(target=trainer.broadcast_to_vllm)
    # Where a sync starts to wait is in no record: the gate's own wait_for is logged there, and still does the wait.
    wait_for = gate.cond.wait_for

    def logged_wait_for(predicate):
        log("sync waits")
        return wait_for(predicate)

    gate.cond.wait_for = logged_wait_for
    policy = AgentPolicy(engines=[], tokenizer=None, max_new_tokens=8, max_len=64, gate=gate)
    held_back = []

    async def generate(prompt_ids):
        log(f"generation {prompt_ids[0]} starts")
        if prompt_ids == [1]:  # held open until the sync has waited or sent (partial: until it has ended)
            sync.start()
            if partial:
                await asyncio.to_thread(sync.join, 30)
            else:
                assert await asyncio.to_thread(moved.wait, 30), "the sync neither waited nor sent"
                held_back.append(asyncio.ensure_future(policy.sample([2])))  # asked for while the sync is pending
                await asyncio.sleep(0)  # one pass of the loop: it asks the gate once
            log("generation 1 ends")
        return [7], False, [-0.5]

    policy.generate = generate

    async def scenario():
        first = await policy.sample([1])
        return [first] + [await asyncio.wait_for(g, 30) for g in held_back]

    results = asyncio.run(scenario())
    sync.join(timeout=30)
    if adapter:  # what a LoRA sync sends in place of upstream's broadcast, at the same point
        sent = [c for c in calls if c[0] in ("adapter_files", "load_adapter")]
        assert [c[0] for c in sent] == ["adapter_files", "load_adapter"] and sent[0][1:] == sent[1][1:]
        i = calls.index(sent[0])
        calls[i:i + 2] = [("broadcast_to_vllm", *sent[0][1:])]
    assert not sync.is_alive() and [s["version"] for s in gate.log] == [1] and gate.version == 1  # one sync, one more
    if partial:  # (what, the gate's version, generations in the gate): paused, sent, resumed, then generation 1 ends
        assert calls == [("generation 1 starts", 0, 1), ("pause_generation", 0, 1), ("broadcast_to_vllm", 0, 1),
                         ("resume_generation", 0, 1), ("generation 1 ends", 1, 1)]
        assert [r[1:] for r in results] == [(0, 1)]  # begun on version 0, ended on 1
    else:  # the sync waited for generation 1 to leave the gate; generation 2, asked for meanwhile, began after it
        assert calls == [("generation 1 starts", 0, 1), ("sync waits", 0, 1), ("generation 1 ends", 0, 1),
                         ("broadcast_to_vllm", 0, 0), ("generation 2 starts", 1, 1)]
        assert [r[1:] for r in results] == [(0, 0), (1, 1)]
