"""Run many episodes at once over the agents' vLLM engines, the environment and the coach.

Each agent generates on its own engines, from messages rendered with its own chat template; the environment
chooses who acts when (`MultiAgentEnv.next_agents`), and the agents of one round generate concurrently. A
prompt too long for max_len - max_new_tokens loses its oldest history entries (`env.observe(..., omit=k)`), or
is skipped when its fixed part alone is too long (`Episode.skipped_actions`). An action's coach request is
submitted as soon as its tool feedback exists and awaited when the episode is complete, so coach latency
overlaps with generation, and in training with the updates of agents whose verdicts are in; in hindsight mode
(coach.judge_episode) one review follows the episode's outcome.

In training the run's event loop runs in a thread of its own (RolloutRunner), and each step's rollout returns
a handle (RolloutHandle) that the trainer reads from its threads: the episodes once the agents are done, each
member's verdicts once all of them are in, and completion.
"""

import asyncio
import collections
import concurrent.futures
import contextlib
import functools
import inspect
import itertools
import os
import sysconfig
import threading
import time
import traceback
import uuid
import weakref
from dataclasses import dataclass, field

from openrlhf_mappa.coach import Coach, CoachRequest, judge_episode
from openrlhf_mappa.envs.base import returned_problem
from openrlhf_mappa.episode import Action, Episode

# The authors' coach sees the first 2,000 characters of a code run's output (coach_utils.py:
# tool_observation[:2000]); a topology's `coach_input: ours` shows it as the agent saw it instead.
COACH_TOOL_CHARS = 2000


class SyncGate:
    """One agent's generations and the syncs of its weights to its engines (`version`: how many it has had).
    With async training a sync lands while the next step generates: it waits for the agent's generations in
    flight and holds new ones back, so every action is made by one version of its weights; with partial
    rollouts (`wait=False`) the engines pause instead, and an action in flight finishes on the new version.
    Generations run on the rollout's event loop, syncs in the trainer's threads."""

    def __init__(self):
        self.cond, self.active, self.syncing, self.version = threading.Condition(), 0, False, 0
        # {"version", "start", "end"} of each sync (unix seconds), until the trainer writes them out
        self.log = []

    async def enter(self) -> int:
        while True:  # polled, not a blocking wait: the event loop runs every other episode meanwhile
            with self.cond:
                if not self.syncing:
                    self.active += 1
                    return self.version
            await asyncio.sleep(0.01)

    def leave(self) -> int:
        with self.cond:
            self.active -= 1
            self.cond.notify_all()
            return self.version

    @contextlib.contextmanager
    def sync(self, wait: bool = True):
        with self.cond:
            self.syncing = True
            if wait:
                self.cond.wait_for(lambda: self.active == 0)
        start = time.time()
        try:
            yield
        finally:
            with self.cond:
                self.version, self.syncing = self.version + 1, False
                self.log.append({"version": self.version, "start": start, "end": time.time()})


@dataclass
class AgentPolicy:
    """What the rollout needs of one agent: its engines, tokenizer and generation limits."""

    engines: list  # RolloutRayActor handles of this agent only
    tokenizer: object
    max_new_tokens: int
    max_len: int  # prompt + response tokens, as the engines were built with
    sampling: dict = field(default_factory=dict)  # temperature, top_p
    adapter: str = None  # a LoRA agent's name: its engines (its pool's) generate with its adapter
    # its trainer's: generations vs weight syncs, and the version
    gate: SyncGate = field(default_factory=SyncGate)
    # Ask vLLM for each sampled token's log-prob only where something reads them (logprobs_read): they come
    # back as a Python object per token over Ray, the largest part of MAPPA's generation overhead
    # (benchmarks/README.md).
    logprobs: bool = True
    _next: itertools.count = field(default_factory=itertools.count)

    @classmethod
    def of(cls, args, spec, engines: list, tokenizer, temperature: float, **kw):
        """Agent `spec`'s policy as a run and `mappa eval` build it: its max_new_tokens (the topology's,
        else --rollout.max_new_tokens), --data.max_len, sampling at `temperature` with --rollout.top_p; kw:
        adapter, gate, logprobs."""
        return cls(engines, tokenizer, spec.max_new_tokens or args.rollout.max_new_tokens, args.data.max_len,
                   dict(temperature=temperature, top_p=args.rollout.top_p), **kw)

    def prompt_ids(self, messages: list, keep_reasoning: bool = False) -> tuple:
        """(text, ids, too_long): the messages chat-templated, and whether they exceed max_len -
        max_new_tokens. keep_reasoning: each assistant message as written, <think> included, whatever the
        template drops."""
        shown = messages
        if keep_reasoning:
            # The template renders a marker in place of each reply (nothing in it to drop), then the reply
            # goes back: the agent reads its earlier actions as it generated them, as the authors' raw-text
            # prompts.
            nonce = uuid.uuid4().hex
            shown = [dict(m, content=f"<reply {i} {nonce}>") if m["role"] == "assistant" else m
                     for i, m in enumerate(messages)]
        text = self.tokenizer.apply_chat_template(shown, tokenize=False, add_generation_prompt=True)
        for message, marked in zip(messages, shown):
            if message is not marked:
                if text.count(marked["content"]) != 1:
                    raise ValueError(f"the chat template of {self.tokenizer.name_or_path} does not show an "
                                     f"earlier reply as written, so its reasoning cannot be kept: set "
                                     f"keep_reasoning: false in the topology")
                text = text.replace(marked["content"], message["content"])
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return text, ids, len(ids) > self.max_len - self.max_new_tokens

    def shorten(self, observe, entries: int, keep_reasoning: bool = False) -> tuple:
        """For a prompt too long in full: (text, ids, too_long, k) of observe(k) for the fewest oldest history
        entries k left out that fits; when even k = entries is too long, that prompt, too_long True. A binary
        search over k: at most 1 + ceil(log2(entries)) tokenizations."""
        best = self.prompt_ids(observe(entries), keep_reasoning)
        if best[2]:
            return (*best, entries)
        lo, hi = 0, entries  # observe(lo) is too long, observe(hi) fits
        while hi - lo > 1:
            mid = (lo + hi) // 2
            found = self.prompt_ids(observe(mid), keep_reasoning)
            lo, hi, best = (mid, hi, best) if found[2] else (lo, mid, found)
        return (*best, hi)

    async def sample(self, prompt_ids: list) -> tuple:
        """(generate's result, its weights' version when it started, and when it ended), through the sync
        gate."""
        version = await self.gate.enter()
        try:
            generated = await self.generate(prompt_ids)
        finally:
            version_end = self.gate.leave()  # read under the gate's lock, as it ends
        return generated, version, version_end

    async def generate(self, prompt_ids: list):
        """(response ids, truncated, each response token's sampling log-prob: [] when not asked for)."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=self.max_new_tokens, logprobs=1 if self.logprobs else None,
                                **self.sampling)
        engine = self.engines[next(self._next) % len(self.engines)]
        if self.adapter:
            output = (await engine.generate_as.remote(self.adapter, prompt_ids, params)).outputs[0]
        else:
            output = (await engine.generate.remote(prompt_ids, params)).outputs[0]
        # logprobs=1 returns the top token's and the sampled one's: the sampled one is always there.
        logprobs = [step[token].logprob for token, step in zip(output.token_ids, output.logprobs or [])]
        return list(output.token_ids), output.finish_reason == "length", logprobs


def logprobs_read(args) -> bool:
    """Whether a training run reads the engines' sampling log-probs: OpenRLHF's off-policy correction
    (--algo.advantage.is_correction_level), --mappa.ppo_ratio rollout, async training (its mismatch metrics
    measure how far behind the engines are) or --mappa.logprob_metrics. Else none is asked for, as
    OpenRLHF."""
    return (args.algo.advantage.is_correction_level != "off" or args.mappa.ppo_ratio == "rollout"
            or args.train.async_enable or args.mappa.logprob_metrics)


class EnvFailed(Exception):
    """An exception raised by the episode's environment: it ends that episode (a counted failure), not the
    run."""


def env_call(env_name: str, what: str, fn, *args, **kwargs):
    """fn(*args) on the environment's behalf; what it raises comes back as EnvFailed, naming the env's method
    and the line in the env's own code (the deepest frame outside the standard library). A return the hook may
    not give (envs.base.returned_problem) is an EnvFailed too, naming the hook and the value."""
    try:
        value = fn(*args, **kwargs)
    except Exception as e:
        frames = traceback.extract_tb(e.__traceback__)
        paths = sysconfig.get_paths()
        ours = lambda f: f.filename.startswith(paths["purelib"]) or not f.filename.startswith(paths["stdlib"])
        where = next((f for f in reversed(frames) if ours(f)), frames[-1])
        where = f"{where.filename}, line {where.lineno}"
        raise EnvFailed(f"{env_name}.{what} raised {type(e).__name__}: {e} ({where})") from e
    problem = returned_problem(what, value)
    if problem:
        raise EnvFailed(f"{env_name}.{what} returned {value!r:.200}: {problem}")
    return value


async def run_episode(topology, task: dict, policies: dict, coach: Coach, workspace: str, step: int,
                      coach_bias: str = None, coach_mode: str = "per_action", handle=None,
                      index: int = 0) -> Episode:
    """One episode, the `index`th of `handle` (RolloutHandle; by default one of its own). An exception raised
    by its environment ends this episode only: `Episode.env_error` says what and where, the outcome is a
    failure and its actions train nothing (the trainer stops the run when too many do:
    --mappa.env.max_failure_fraction). Generation and coach errors are not contained. The handle hears when
    the agents are done, before the verdicts still coming are awaited, and each verdict as it lands."""
    handle = handle or RolloutHandle(step, topology)
    episode_id = f"s{step}-{task.get('id', '')}-{uuid.uuid4().hex[:8]}"
    os.makedirs(workspace, exist_ok=True)
    episode = Episode(episode_id=episode_id, task_id=str(task.get("id", "")), task_type=task.get("type", ""),
                      step=step)
    requests, verdict_futures = [], []
    t0 = episode.timings["start"] = time.time()
    try:
        env = env_call(topology.env, "__init__", topology.make_env, task, workspace)
        call = functools.partial(env_call, type(env).__name__)
        episode.task_type = call("task_type", getattr, env, "task_type")
        async for request in play(topology, env, call, policies, episode, coach_bias):
            requests.append(request)
            if coach_mode != "hindsight":
                verdict_futures.append(asyncio.ensure_future(coach.score(request)))  # submitted, not awaited
            if coach_mode == "per_action":  # its final verdict: on the action as soon as it comes
                verdict_futures[-1].add_done_callback(
                    functools.partial(handle.record_verdict, episode.actions[-1]))
        episode.timings["rollout_s"] = time.time() - t0
        episode.outcome = ended(episode, call("outcome", env.outcome))
    except EnvFailed as e:
        episode.env_error, episode.outcome = str(e), {"success": False}
        episode.timings["rollout_s"] = time.time() - t0
    handle.agents_done(index, episode)
    if episode.env_error:
        # The verdicts already asked for are awaited (and paid for): kept in the record, never trained on.
        verdicts = await asyncio.gather(*verdict_futures)
        parts, episode.review = [{} for _ in verdicts], None
    else:
        judged = await judge_episode(coach, coach_mode, requests, episode.outcome, verdict_futures)
        verdicts, parts, episode.review = judged
    for action, verdict, part in zip(episode.actions, verdicts, parts):
        action.verdict, action.verdict_parts = verdict, part
        handle.landed(action)
    episode.timings["end"] = time.time()
    episode.timings["coach_wait_s"] = episode.timings["end"] - t0 - episode.timings["rollout_s"]
    return episode


class RolloutHandle:
    """One step's rollout as the trainer reads it, top to bottom, each part a future that the rollout sets
    once, on the run's event loop: `episodes` once the agents are done (verdicts may still be coming);
    `verdicts[member]` once every verdict on that member's actions is in (its actions, in episode order; a
    member trains the actions of the agents `members` maps to it); `complete` once every verdict is in
    (RolloutRunner.start). A rollout that fails or is cancelled sets its error on every part not yet set
    (ended): no reader waits on a future that nothing would set."""

    def __init__(self, step: int, topology, episodes: int = 1, members: dict = None, progress=None):
        self.step, self.progress, self.complete = step, progress, None
        self.members = members or {a.name: a.name for a in topology.agents}  # agent -> member: each its own
        self.played = [None] * episodes  # each episode once its agents are done, in task order
        self.t0, self.seconds = time.time(), None  # seconds: from the start until the agents were done
        self.episodes = concurrent.futures.Future()
        self.verdicts = {member: concurrent.futures.Future() for member in self.members.values()}
        self.actions = collections.defaultdict(list)  # member -> its actions, once the agents are done
        # member -> the ids of those with no verdict yet: ids, since a per-action verdict lands twice (as it
        # comes, and again with its episode's verdicts)
        self.waiting = collections.defaultdict(set)

    def agents_done(self, index: int, episode: Episode) -> None:
        """The `index`th episode's agents are done; once every episode's are, `episodes` is set, and the
        verdicts of each member whose actions have them all already."""
        self.played[index] = episode
        if self.progress:
            self.progress(1)
        if None in self.played:
            return
        self.seconds = time.time() - self.t0
        for ep in self.played:
            for action in ep.actions:
                member = self.members[action.agent]
                self.actions[member].append(action)
                if action.verdict is None:
                    self.waiting[member].add(id(action))
        settle(self.episodes, list(self.played))
        for member in self.verdicts:
            if not self.waiting[member]:
                settle(self.verdicts[member], self.actions[member])

    def record_verdict(self, action: Action, future: asyncio.Future) -> None:
        """A per-action coach request's done-callback: its verdict on its action as soon as it comes."""
        # an error reaches the rollout through its gather
        if not future.cancelled() and future.exception() is None:
            action.verdict = future.result()
            self.landed(action)

    def landed(self, action: Action) -> None:
        """`action` has its verdict: once the agents are done, its member's verdicts are set with the last."""
        member = self.members[action.agent]
        self.waiting[member].discard(id(action))
        if self.seconds is not None and not self.waiting[member]:
            settle(self.verdicts[member], self.actions[member])

    def ended(self, error: BaseException = None) -> None:
        """The rollout ended, `error` if it failed or was cancelled: every part not yet set is set, to the
        error, or to what it holds (a verdict that never came has nothing left to come)."""
        settle(self.episodes, list(self.played), error)
        for member, future in self.verdicts.items():
            settle(future, self.actions[member], error)


def settle(future: concurrent.futures.Future, value, error: BaseException = None) -> None:
    """Set `future` to `value`, or to `error` (which its result() raises), unless a failure set it first."""
    if future.done():
        return
    if error is None:
        future.set_result(value)
    else:
        future.set_exception(error)


async def play(topology, env, call, policies: dict, episode: Episode, coach_bias: str = None):
    """The agents act, round by round as env.next_agents says, until it names no agent or a round would pass a
    limit (`episode.action_limit`). Actions are recorded in `episode`; each one's coach request is yielded as
    soon as its tool feedback exists, so that the caller can submit it at once."""
    # An env whose own observe() takes no `omit` cannot leave history out: its over-long prompts are skipped.
    can_omit = "omit" in inspect.signature(env.observe).parameters
    for round_, agents, turns, last in rounds(topology, env, call, episode):
        # The round's agents all see the history as it was before the round: they generate concurrently, and
        # step in the order next_agents gave.
        prompts = [fit_prompt(env, call, policies[spec.name], spec, turns[spec.name], can_omit=can_omit,
                              keep_reasoning=topology.keep_reasoning)
                   for spec in agents]
        generations = (policies[spec.name].sample(p[2]) for spec, p in zip(agents, prompts) if not p[3])
        generated = iter(await asyncio.gather(*generations))
        for spec, (messages, prompt_text, prompt_ids, too_long, omitted) in zip(agents, prompts):
            policy, turn = policies[spec.name], turns[spec.name]
            if too_long:
                # Even its system message, prompt and task alone do not fit: no action (nothing generated,
                # nothing trained, no coach); next_agents hears None for it (the chain then moves to the next
                # agent).
                budget = policy.max_len - policy.max_new_tokens
                skipped = {"agent": spec.name, "turn": turn, "prompt_tokens": len(prompt_ids),
                           "budget": budget}
                episode.skipped_actions.append(skipped)
                last[spec.name] = None
                continue
            (response_ids, truncated, logprobs), version, version_end = next(generated)
            # Its weight versions: its own agent's, and each other agent's that acted in an earlier round,
            # whose output its input can hold (as that action recorded its own; a view hiding an agent still
            # counts it). An agent that acted more than once counts at its oldest version: the input is as
            # stale as that.
            versions = {}
            for a in episode.actions:
                if a.agent != spec.name and a.round < round_:
                    versions[a.agent] = min(versions.get(a.agent, a.versions[a.agent]), a.versions[a.agent])
            response_text = policy.tokenizer.decode(response_ids, skip_special_tokens=True)
            result = last[spec.name] = await asyncio.to_thread(call, "step", env.step, spec, turn,
                                                               response_text)
            action = Action(
                episode_id=episode.episode_id, agent=spec.name, turn=turn, round=round_,
                position=len(episode.actions), prompt_ids=prompt_ids, response_ids=response_ids,
                prompt_text=prompt_text, response_text=response_text, truncated=truncated,
                formatted=call("answer_formatted", env.answer_formatted, spec, response_text),
                prompt_truncated=omitted > 0, feedback=result.feedback, rollout_logprobs=logprobs,
                versions={**versions, spec.name: version}, version_end=version_end,
            )
            # coach_bias is kept with the action only when shown, so that re-scoring sends the prompt it saw.
            truncated_at = policy.max_new_tokens if truncated else None
            ours = topology.coach_input == "ours"
            feedback = result.feedback.as_text(files=ours)
            feedback = feedback if ours else feedback[:COACH_TOOL_CHARS]
            action.coach_request = dict(
                role=spec.role, task=call("task_text", getattr, env, "task_text"),
                task_type=episode.task_type,
                agent_input=messages_text(messages), feedback=feedback, cut_off_note=ours,
                ground_truth=call("coach_ground_truth", env.coach_ground_truth, spec),
                env_grade=call("judge", env.judge, spec, response_text, result.feedback, truncated_at),
                is_final_agent=spec is topology.agents[-1], runs_code=spec.runs_code,
                truncated_at=truncated_at, round=action.round, position=action.position,
                **({"coach_bias": coach_bias} if coach_bias is not None else {}),
            )
            episode.actions.append(action)
            yield CoachRequest(episode.episode_id, spec.name, turn, agent_output=response_text,
                               **action.coach_request)


def rounds(topology, env, call, record):
    """The episode's rounds, as env.next_agents names them: (round, its agents, each agent's actions so far,
    `last`: what env.step returned to each of them, which the caller fills), until next_agents names no agent
    or the round would pass a limit (`record.action_limit`: the episode is a failure, ended). The one round
    loop of the rollout (play) and of team.play; `call(hook, fn, *args)`: fn(*args), its return checked."""
    turns, last, round_ = {a.name: 0 for a in topology.agents}, {}, 0
    while agents := call("next_agents", env.next_agents, turns, last):
        check_round(type(env).__name__, topology, agents)
        record.action_limit = over_limit(topology, turns, agents)
        # a workflow that would go on forever (or past its budget) ends here, a failure
        if record.action_limit:
            return
        last = {}
        yield round_, agents, turns, last
        for spec in agents:
            turns[spec.name] += 1
        round_ += 1


def ended(record, outcome: dict) -> dict:
    """The episode's outcome: the env's, or where a limit stopped it (`record.action_limit`) a failure,
    whatever the env says: it never reached its end."""
    return {**outcome, "success": False} if record.action_limit else outcome


def check_round(env_name: str, topology, agents) -> None:
    """A ValueError unless next_agents returned a list of this topology's AgentSpecs, each at most once."""
    ids = [id(a) for a in agents] if isinstance(agents, (list, tuple)) else None
    if ids is None or not set(ids) <= {id(a) for a in topology.agents} or len(set(ids)) < len(ids):
        shown = [getattr(a, "name", a) for a in agents] if ids is not None else agents
        raise ValueError(f"{env_name}.next_agents returned {shown!r}: expected a list of this "
                         f"topology's AgentSpecs (env.topology.agents), each at most once per round")


def over_limit(topology, turns: dict, agents: list) -> str:
    """Why the round `agents` may not be played ("" when it may): an agent past its max_actions, or the
    episode past the topology's max_episode_actions (default: the sum of the agents' max_actions)."""
    limit = topology.max_episode_actions or sum(a.max_actions for a in topology.agents)
    over = [f"agent {a.name!r} asked to act beyond its max_actions {a.max_actions}"
            for a in agents if turns[a.name] >= a.max_actions]
    if sum(turns.values()) + len(agents) > limit:
        over.append(f"more than max_episode_actions {limit} actions")
    return "; ".join(over)


def fit_prompt(env, call, policy: AgentPolicy, spec, turn: int, can_omit: bool,
               keep_reasoning: bool) -> tuple:
    """(messages, text, ids, too_long, omitted): the agent's input, its oldest history left out as far as
    needed (where the env's observe() can leave it out: `can_omit`)."""
    messages = call("observe", env.observe, spec, turn)
    prompt_text, prompt_ids, too_long = policy.prompt_ids(messages, keep_reasoning)
    if not (too_long and can_omit):
        return messages, prompt_text, prompt_ids, too_long, 0
    observe = functools.partial(call, "observe", env.observe, spec, turn)
    *fitted, omitted = policy.shorten(lambda k: observe(omit=k), len(env.history), keep_reasoning)
    return observe(omit=omitted), *fitted, omitted


def messages_text(messages: list) -> str:
    """An agent's input as the coach reads it ({agent_input}): its messages without the chat template's
    special tokens. A lone user message as it is, as the authors' coach read the raw prompt; else each message
    under a `[role]` line."""
    if len(messages) == 1:
        return messages[0]["content"]
    return "\n\n".join(f"[{m['role']}]\n{m['content']}" for m in messages)


async def rollout(topology, tasks: list, policies: dict, coach: Coach, workspace_root: str, step: int,
                  coach_bias: str = None, coach_mode: str = "per_action", progress=None, handle=None) -> list:
    """All episodes of one step, concurrently, in task order. `coach_bias`: the coach's figures shown in every
    request of the step (--mappa.coach.show_bias); progress(1) is called as each episode's agents are done.
    `handle` (RolloutRunner.start's; by default one of its own) hears when the agents are done, while verdicts
    may still be coming, and each verdict as it lands: in mode per_action on its action as it comes, so that
    the trainer can train an agent whose verdicts are all in."""
    handle = handle or RolloutHandle(step, topology, len(tasks), progress=progress)
    try:
        episodes = await asyncio.gather(*(
            run_episode(topology, task, policies, coach,
                        os.path.join(workspace_root, f"step{step}", f"ep{i}"), step, coach_bias=coach_bias,
                        coach_mode=coach_mode, handle=handle, index=i)
            for i, task in enumerate(tasks)))
    except BaseException as error:  # failed or cancelled: the handle's readers hear it, none waits forever
        handle.ended(error)
        raise
    handle.ended()
    return episodes


class RolloutRunner:
    """The run's event loop in a thread of its own (running): each step's rollout (start), the coach and the
    evaluations run on it, so that the team trains while verdicts are still coming, and with
    --train.async_enable while the next steps' episodes are generated. One loop for the whole run: the coach's
    HTTP client and its semaphore belong to the loop they were first used on, so a fresh asyncio.run() per
    step would break them at step 2."""

    def __init__(self):
        # started: the handles still held
        self.loop, self.started = asyncio.new_event_loop(), weakref.WeakSet()

    @contextlib.contextmanager
    def running(self):
        thread = threading.Thread(target=self.loop.run_forever, name="mappa-rollout", daemon=True)
        thread.start()
        try:
            yield
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            thread.join()
            # A rollout still in flight (the run stopped) goes no further: whoever waits on its handle hears
            # so.
            for handle in self.started:
                handle.complete.cancel()
                handle.ended(concurrent.futures.CancelledError())

    def start(self, topology, tasks: list, policies: dict, coach: Coach, workspace_root: str, step: int,
              members: dict, coach_bias: str = None, coach_mode: str = "per_action",
              progress=None) -> RolloutHandle:
        """The step's rollout (rollout), started on the loop (running): its handle, whose verdicts are by
        member (`members`: agent -> who trains its actions) and `complete` once every verdict is in."""
        handle = RolloutHandle(step, topology, len(tasks), members, progress)
        coroutine = rollout(topology, tasks, policies, coach, workspace_root, step, coach_bias=coach_bias,
                            coach_mode=coach_mode, handle=handle)
        handle.complete = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        self.started.add(handle)
        return handle
