"""Health of a run: a dead engine or actor stops it promptly, naming the component (Watchdog); a slow start-up
says what it waits for (StartupWatchdog); a run that cannot usefully go on stops with the reason
(RunStopped)."""

import glob
import os
import signal
import threading
import time

import ray
from tqdm import tqdm

from openrlhf_mappa.coach.audit import CoachFailure, check_failures
from openrlhf_mappa.console import console
from openrlhf_mappa.launch import components


class RunStopped(RuntimeError):
    """The run cannot usefully go on: too many of a step's episodes failed in the environment, or no agent
    trained for --mappa.max_untrained_steps steps in a row. The message says why and what to change."""


def find_dead(agents: list, timeout_s: float = 5.0) -> list:
    """'agent X: component' for each dead process. A ping to a dead actor fails at once; a busy live one
    just does not answer within the timeout, which is fine: only a failed ping counts as dead."""
    pings = {h.__ray_ready__.remote(): f"agent {name!r}: {what}" for name, what, h in components(agents)}
    ready, _ = ray.wait(list(pings), num_returns=len(pings), timeout=timeout_s)
    dead = []
    for ref in ready:
        try:
            ray.get(ref)
        except ray.exceptions.RayActorError:
            dead.append(pings[ref])
    return dead


class Watchdog(threading.Thread):
    """Stops the run promptly when one agent's engine or actor dies, naming it.

    Without it, a dead vLLM engine can hang the run: its actor blocks in the weight broadcast's collective
    until the collective's timeout (10 minutes). Every `interval_s` the watchdog pings all components; on a
    death it records which and interrupts the main thread (SIGINT ends a blocking ray.get), and if that does
    not end the process within a grace period, it exits hard. Steps already logged stay on disk."""

    def __init__(self, agents: list, interval_s: float = 5.0, grace_s: float = 60.0):
        super().__init__(daemon=True, name="mappa-watchdog")
        self.agents, self.interval_s, self.grace_s = agents, interval_s, grace_s
        self.dead, self.reason, self.done = [], None, threading.Event()

    def check(self):
        """Why the run must stop now, or None."""
        self.dead = find_dead(self.agents)
        return f"{'; '.join(self.dead)} died" if self.dead else None

    def run(self):
        while not self.done.wait(self.interval_s):
            self.reason = self.check()
            if self.reason:
                print(f"[mappa] stopping: {self.reason}", file=console.err, flush=True)
                # Repeated: a SIGINT that lands in a finalizer or callback is only printed ("Exception
                # ignored").
                deadline = time.time() + self.grace_s
                while time.time() < deadline:
                    os.kill(os.getpid(), signal.SIGINT)
                    if self.done.wait(5.0):
                        return
                os._exit(1)


def startup_waits(models: list) -> list:
    """What a slow start-up may be waiting for, as far as the driver can see: a build lock in the extension
    cache (a build killed midway leaves it, and every later build of that op waits for it to go), a placement
    group Ray cannot place (no free GPU), a model still downloading from the hub."""
    from huggingface_hub.constants import HF_HUB_CACHE
    from torch.utils.cpp_extension import get_default_build_root

    seen = []
    cache = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    for lock in glob.glob(os.path.join(cache, "**", "lock"), recursive=True):
        seen.append(f"the build lock {lock} ({time.time() - os.path.getmtime(lock):.0f} s old; "
                    f"a build killed midway leaves it: delete it if no build is running)")
    for pg in ray.util.placement_group_table().values():
        if pg["state"] == "PENDING":
            free = ray.available_resources().get("GPU", 0)
            seen.append(
                f"a placement group Ray cannot place: {list(pg['bundles'].values())}, {free:g} GPUs free"
            )
    for model in models:
        parts = glob.glob(
            os.path.join(HF_HUB_CACHE, "models--" + model.replace("/", "--"), "blobs", "*.incomplete")
        )
        if parts and not os.path.isdir(model):
            seen.append(
                f"the download of {model} ({sum(map(os.path.getsize, parts)) / 2**20:.0f} MiB so far)"
            )
    return seen


class StartupWatchdog(Watchdog):
    """A start-up never waits in silence. Every `warn_s` while engines and actors start, it names on the
    console the components not up yet and what they may be waiting for (startup_waits); after `timeout_s`
    it stops the run with that message, as Watchdog does."""

    def __init__(self, warn_s: float, timeout_s: float, models: list):
        super().__init__(agents=None, interval_s=min(5.0, warn_s))
        self.warn_s, self.timeout_s, self.models = warn_s, timeout_s, models
        self.t0, self.next_warn = time.time(), warn_s
        self.stage, self.components = None, []  # filled in by build_agents: (label, ref ready once it is up)

    def check(self):
        elapsed = time.time() - self.t0
        stop = elapsed >= self.timeout_s
        if elapsed < self.next_warn and not stop:
            return None
        watched = list(self.components)
        ready, _ = (
            ray.wait([r for _, r in watched], num_returns=len(watched), timeout=0) if watched else ([], [])
        )
        waiting = ([label for label, r in watched if r not in set(ready)]
                   + ([self.stage] if self.stage else []))
        seen = startup_waits(self.models)
        report = (f"start-up not done after {elapsed:.0f} s; not up yet: {', '.join(waiting) or 'none'}; "
                  f"waiting for: {'; '.join(seen) or 'nothing seen from here (still loading?)'}")
        if stop:
            return f"{report}. Stopped by --mappa.startup_timeout_s {self.timeout_s:g}."
        print(
            f"[mappa] {report}. Stops after --mappa.startup_timeout_s {self.timeout_s:g}.",
            file=console.err,
            flush=True,
        )
        self.next_warn += self.warn_s
        return None


def untrained_reasons(
    agents: list, owner: dict, episodes: list, dropped: dict, train_truncated: bool
) -> dict:
    """{agent: why it trained on no action this step}, for each of `agents` (its actions, or under a shared
    policy every role's: `owner` maps a role to the agent that trains it), each reason with its count and the
    flag that changes it."""
    out = {}
    for ag in agents:
        name, a = ag.spec.name, ag.args
        mine = [(ep, x) for ep in episodes for x in ep.actions if owner[x.agent] == name]
        skipped = sum(owner[s["agent"]] == name for ep in episodes for s in ep.skipped_actions)
        cut = {
            id(x)
            for ep, x in mine
            if not ep.env_error and x.truncated and not train_truncated and not x.stale
        }
        unscored, filtered, stale = {}, sum(x.filtered for _, x in mine), sum(x.stale for _, x in mine)
        for ep, x in mine:
            if x.reward is None and not ep.env_error and id(x) not in cut and not x.filtered and not x.stale:
                status = x.verdict.status if x.verdict else "missing"
                unscored[status] = unscored.get(status, 0) + 1
        env_failed = sum(bool(ep.env_error) for ep, _ in mine)
        of = f"of its {len(mine)} actions"
        limit = "its max_new_tokens in the topology" if ag.spec.max_new_tokens else "--rollout.max_new_tokens"
        why = [f"{len(cut)} {of} cut off at {limit} ({a.rollout.max_new_tokens} tokens) and left out: raise "
               f"it, or train them with --mappa.train_truncated"] if cut else []
        if unscored:
            statuses = ", ".join(f"{k} {n}" for k, n in unscored.items())
            why.append(
                f"{sum(unscored.values())} {of} without a coach score ({statuses}): --mappa.coach.on_failure "
                f"outcome or neutral trains them"
            )
        if filtered:
            why.append(f"{filtered} {of} in (task, agent) groups whose mean score is outside "
                       f"--algo.dynamic_filtering_range {tuple(a.algo.dynamic_filtering_range)} and left out")
        if stale:
            why.append(
                f"{stale} {of} made by weights, or judged by a trained coach, more than "
                f"--mappa.max_staleness updates old, or by one in its --mappa.coach.warmup_steps, and left "
                f"out"
            )
        if env_failed:
            why.append(
                f"{env_failed} {of} in episodes whose environment raised (env_error in episodes.jsonl)"
            )
        if dropped[name]:
            why.append(
                f"{dropped[name]} {of} left over by the batch rule, less than one --train.batch_size "
                f"({a.train.batch_size}) batch: lower --train.batch_size, or raise --rollout.batch_size"
            )
        if skipped:
            why.append(
                f"{skipped} actions not taken: the prompt did not fit --data.max_len ({a.data.max_len}) "
                f"minus {limit} even without its history: raise --data.max_len"
            )
        out[name] = "; ".join(why) or "the environment gave it no turn"
    return out


class StopRules:
    """Every rule that stops a run which cannot usefully go on, each message with the reason and the flag that
    changes it. A step's own failure (its environment raised in too many episodes, its coach failed too often)
    stops it before its metrics and its checkpoint (`failed`); a run that stopped learning (no agent trained
    for --mappa.max_untrained_steps steps in a row, a trained coach drifted from its reference) once the step
    is logged (`stop_reason`). `team`: the agents that train (launch.owners), `owner`: who trains each agent's
    actions."""

    def __init__(self, mappa, run_dir: str, coach, scored: bool, team: list, owner: dict):
        self.mappa, self.run_dir, self.coach, self.scored, self.team, self.owner = (
            mappa, run_dir, coach, scored, team, owner)
        self.trained_coach = getattr(coach, "agent", None) is not None
        self.untrained_steps = 0  # steps in a row in which no agent trained

    def env_failures(self, step: int, episodes: list):
        """Say how many of the step's episodes ended with an exception in the environment; the message that
        stops the run when more did than --mappa.env.max_failure_fraction, else None. Known as the agents are
        done."""
        failed, limit = [ep for ep in episodes if ep.env_error], self.mappa.env.max_failure_fraction
        # contained by the rollout: each is a failed episode that trains nothing (rollout.run_episode)
        if not failed:
            return None
        said = (f"{len(failed)} of {len(episodes)} episodes ended with an exception in the environment (they "
                f"train nothing). First: {failed[0].env_error}")
        tqdm.write(f"[mappa] step {step}: {said}", file=console.err)
        if len(failed) / len(episodes) > limit:
            return (
                f"step {step}: {said}. That is more than --mappa.env.max_failure_fraction {limit:g} of them; "
                f"the step's episodes are in {self.run_dir}/episodes.jsonl."
            )
        return None

    def failed(self, step: int, episodes: list, coach_metrics: dict, env_stop: str):
        """The step's own failure, once every verdict is in: RunStopped for its environment's (env_failures),
        CoachFailure when more than --mappa.coach.max_failure_fraction of the verdicts paid for failed; else
        None. A trained coach's parse errors never stop the run: its format term trains them away."""
        if env_stop:
            return RunStopped(env_stop)
        if not self.scored or self.trained_coach:
            return None
        try:
            check_failures(episodes, coach_metrics, self.mappa.coach.max_failure_fraction)
        except CoachFailure as e:
            return CoachFailure(f"step {step}: {e} The step's episodes are in {self.run_dir}/episodes.jsonl.")
        return None

    def stop_reason(self, step: int, episodes: list, dropped: dict, learned: set, metrics: dict):
        """After the step's updates: say on the console why each agent that trained on no action did not
        (untrained_reasons); the message that stops the run after --mappa.max_untrained_steps such steps in a
        row for every agent (not counting a trained coach's --mappa.coach.warmup_steps), or when a trained
        coach's held-out agreement fell (its agreement_stop); else None. `learned`: the agents with a row that
        has a loss."""
        untrained = untrained_reasons([ag for ag in self.team if ag.spec.name not in learned], self.owner,
                                      episodes, dropped, self.mappa.train_truncated)
        for name, why in untrained.items():
            tqdm.write(f"[mappa] step {step}: agent {name!r} trained on nothing: {why}", file=console.err)
        counted = len(untrained) == len(self.team) and step > self.mappa.coach.warmup_steps
        self.untrained_steps = self.untrained_steps + 1 if counted else 0
        most = self.mappa.max_untrained_steps
        if most and self.untrained_steps >= most:
            return (
                f"no agent trained in {self.untrained_steps} steps in a row "
                f"(--mappa.max_untrained_steps {most}); at step {step}, "
                + "; ".join(f"agent {n!r}: {why}" for n, why in untrained.items())
            )
        return self.coach.agreement_stop(step, metrics) if self.trained_coach else None
