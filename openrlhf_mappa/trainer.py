"""The team loop: each agent is its own policy (its own ZeRO-3 actor and reference groups and vLLM engines,
built by launch.py; a LoRA agent shares its base's engine pool and has no reference group), one step at a
time.

Reading order of one step, the method:
  fit -> rollouts -> start: rollout.RolloutRunner.start plays the step's episodes on the agents' engines, the
      coach scoring each action as it is made (not awaited), and returns the step's handle
      (rollout.RolloutHandle) -> collect: the agents are done, verdicts may still be coming
  step: the handle's episodes -> StopRules.env_failures -> rewards.mark_stale -> update_team: per agent, at
      once (per_agent): agent_step: the handle's verdicts of its actions (a future: all are in)
      -> rewards.assign_rewards -> rewards.batch_rule -> rewards.experiences (its OpenRLHF experience maker:
      actor/ref log-probs, KL) -> advantages (rewards.compute_advantages: token rewards, return-to-go,
      whitening) -> update (its OpenRLHF trainer's train_step, then its weights to its own engines only);
      with --mappa.norm_scope global the advantages wait for the whole team's batches
  -> coach_metrics -> StopRules.failed -> metrics (run_log.step_metrics) -> StopRules.stop_reason -> timings
"""

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import os
import random
import time

import ray
from tqdm import tqdm

from openrlhf_mappa import placement, resume, rewards
from openrlhf_mappa.coach.audit import BiasAudit, coach_step_metrics
from openrlhf_mappa.console import console, step_line
from openrlhf_mappa.evaluation import (NoCoach, asks_answer, coach_cost, evaluate, format_table, summarize,
                                      train_overlap)
from openrlhf_mappa.health import RunStopped, StopRules
from openrlhf_mappa.launch import distinct, owners
from openrlhf_mappa.rollout import AgentPolicy, RolloutHandle, RolloutRunner, logprobs_read
from openrlhf_mappa.run_log import RunLog, step_metrics


def pass_order(tasks: list, batch_size: int, strata, rng: random.Random) -> list:
    """One pass's task indices, taken `batch_size` at a time. Without `strata`: one shuffle. With it (a
    task-row column, the topology's `batch_strata`), as the authors' StratifiedBatchSampler
    (distributed_sampler.py): each batch takes from each value's shuffled tasks its share of the batch
    (round(batch x share), at least 1; what the rounding leaves goes to the largest group), a group used up is
    drawn again in a new order, and the batch is shuffled; so every step sees e.g. DSBench's classification
    and regression tasks in their proportion."""
    order = list(range(len(tasks)))
    rng.shuffle(order)
    if not strata:
        return order
    found = {}
    for i in order:
        found.setdefault(str(tasks[i].get(strata, "")), []).append(i)
    groups = {value: found[value] for value in sorted(found)}
    sizes = {value: len(group) for value, group in groups.items()}
    counts, left = {}, batch_size
    for value, size in sizes.items():
        counts[value] = min(max(1, round(batch_size * size / len(tasks))), left, size)
        left -= counts[value]
    counts[max(sizes, key=sizes.get)] += left
    taken, used = [], dict.fromkeys(groups, 0)
    for _ in range(len(tasks) // batch_size):
        batch = []
        for value, count in counts.items():
            for _ in range(count):
                if used[value] == sizes[value]:
                    rng.shuffle(groups[value])
                    used[value] = 0
                batch.append(groups[value][used[value]])
                used[value] += 1
        rng.shuffle(batch)
        taken += batch
    return taken


@dataclasses.dataclass
class AgentStep:
    """One agent's part of a step (MappaTrainer.agent_step): its rewards' counts (rewards.assign_rewards), the
    actions its batch's rows are (rewards.batch_rule; upstream's exp.index points into them) and how many were
    left over, its OpenRLHF Experiences, a trained coach's reward terms, its update's status (None: no update)
    and its phases in seconds (coach_wait: from the start of the team's updates until its verdicts were
    in)."""

    counts: dict
    kept: list
    dropped: int
    batch: list
    terms: dict
    coach_wait: float
    experience: float
    status: dict = None
    train: float = 0.0
    sync: float = 0.0


class MappaTrainer:
    def __init__(self, args, topology, agents: list, coach, tasks: list, run_dir: str,
                 eval_sets: dict = None):
        self.args, self.topology, self.agents, self.coach, self.tasks = args, topology, agents, coach, tasks
        self.run_dir, self.eval_sets = run_dir, eval_sets or {}  # eval_sets: dataset name -> tasks
        # Who trains whose actions: each agent its own (a shared policy: the first's); a trained coach its
        # verdicts.
        self.coach_agent = getattr(coach, "agent", None)
        self.trainees = owners(agents) + [self.coach_agent] * bool(self.coach_agent)
        owner_of_actor = {id(ag.actor): ag.spec.name for ag in self.trainees}
        self.owner = {ag.spec.name: owner_of_actor[id(ag.actor)] for ag in agents + self.trainees}
        self.mappa = args.mappa
        # The most updates an action's weights (or its trained coach's) may be behind when its step trains.
        self.bound = (self.mappa.max_staleness if self.mappa.max_staleness is not None
                      else args.train.async_queue_size)
        # The outcome baseline trains on no verdict: asking an API coach anyway would cost money for nothing.
        self.scored = placement.scored(args)
        self.rollout_coach = coach if self.scored else NoCoach("outcome baseline: not scored")
        # Evaluation's grader (the authors' accuracy: evaluation.coach_graded) is the rollouts' coach, its
        # cost counted; for a trained coach its reference judge, lest the coach's eval verdicts become its
        # training.
        self.eval_coach = coach.reference if self.coach_agent else self.rollout_coach
        if self.eval_coach.template is None:  # a hindsight-only coach: no per-action prompt to grade with
            self.eval_coach = NoCoach("evaluation: the coach has no per-action prompt (coach_template)")
        self.eval_overlap = {name: len(train_overlap(tasks, ts)) for name, ts in self.eval_sets.items()}
        self.bias_audit = BiasAudit(self.mappa.coach.bias_threshold, self.mappa.coach.bias_window)
        self.coach_cost_usd = 0.0
        # each actor's, since the run started
        self.optimizer_steps = {ag.spec.name: 0 for ag in self.trainees}
        # The coach template in use (an index into topology.coach_stages) and the first step it scored.
        self.stage, self.stage_since, self.stage_waits_noted = 0, 1, set()
        # The stop rules, and the message that stops the run after the step that set it.
        self.stops = StopRules(self.mappa, run_dir, coach, self.scored, owners(agents), self.owner)
        self.stalled = None
        self.policies, self.eval_policies = ({ag.spec.name: AgentPolicy.of(
            args, ag.spec, ag.engines, ag.tokenizer, temperature, adapter=ag.trainer.adapter,
            gate=ag.trainer.gate, logprobs=logprobs) for ag in agents + self.trainees}
            for temperature, logprobs in ((args.rollout.temperature, logprobs_read(args)),
                                          (args.eval.temperature, False)))
        if self.coach_agent:
            coach.attach(self.policies[self.coach_agent.spec.name])
        self.runner = RolloutRunner()  # the run's event loop, in its own thread while fit runs
        self.out = RunLog(args, run_dir)

    def batches(self, start_step: int):
        """(step, tasks) for every step of every pass over the data; each task repeated n_samples times."""
        bs, n = self.args.rollout.batch_size, self.args.rollout.n_samples_per_prompt
        steps_per_pass = len(self.tasks) // bs
        for step in range(start_step, steps_per_pass * self.args.train.num_episodes):
            rng = random.Random(self.args.train.seed + step // steps_per_pass)
            order = pass_order(self.tasks, bs, self.topology.batch_strata, rng)
            chunk = order[(step % steps_per_pass) * bs : (step % steps_per_pass + 1) * bs]
            yield step + 1, [self.tasks[i] for i in chunk for _ in range(n)]

    def resume(self, step: int):
        """Continue after step `step`: logs cut back to it, every agent's engines given its loaded weights,
        and the driver's own state as the team checkpoint left it (resume.driver_state)."""
        resume.truncate_logs(self.run_dir, step)
        if not step:
            return
        self.coach_cost_usd, stage, episodes_by_step, saved = resume.driver_state(
            self.args.ckpt.path, self.run_dir, step, self.bias_audit.window.maxlen)
        resume.load_team(self.trainees, step, saved)
        self.optimizer_steps.update(saved.get("optimizer_steps", {}))
        if stage:  # its name was checked against the topology by resume.check_resume
            self.set_stage([s.name for s in self.topology.coach_stages].index(stage["name"]),
                           stage["since_step"])
            print(f"[mappa] coach criteria: resuming with coach template {stage['name']!r} (in use since "
                  f"step {stage['since_step']})", file=console.out, flush=True)
        for k in sorted(episodes_by_step):
            self.bias_audit.update(episodes_by_step[k])

    def fit(self, start_step: int = 0):
        total = (len(self.tasks) // self.args.rollout.batch_size) * self.args.train.num_episodes
        every = self.args.eval.steps
        with self.runner.running():
            if start_step == 0:
                # Each LoRA adapter's first load into its pool (launch.build_agents): its version 1, made by
                # no step.
                self.out.syncs(0, self.trainees)
                self.evaluate(0)  # the untrained models: the baseline every later evaluation compares with
            steps = tqdm(total=total, initial=start_step, desc="MAPPA steps", file=console.err)
            t_step = time.time()
            for run in self.rollouts(start_step):
                t_wait = time.time() - t_step  # async: the part of the rollout that training did not hide
                metrics = {**self.step(run, t_step), "timing/rollout_wait": t_wait}
                self.out.metrics(run.step, metrics)
                steps.update(1)
                tqdm.write(step_line(run.step, total, metrics, [ag.spec.name for ag in self.agents]),
                           file=console.err)
                if self.stalled:
                    raise RunStopped(self.stalled)
                # before the checkpoint, which records the template in use
                self.advance_criteria(run.step, metrics)
                if (every > 0 and run.step % every == 0) or run.step == total:
                    self.evaluate(run.step)
                if self.args.ckpt.save_steps > 0 and run.step % self.args.ckpt.save_steps == 0:
                    self.save_checkpoints(run.step)
                t_step = time.time()
            steps.close()
            ray.get([ref for ag in self.trainees for ref in ag.actor.async_save_model()])
        self.out.close()
        self.runner.loop.run_until_complete(self.coach.aclose())

    def step(self, run: RolloutHandle, t_start: float) -> dict:
        """One training step on a step's rollout whose agents are done (verdicts may still be coming:
        run.complete is done once every one is in): each agent's update, then the step's metrics. Sets
        `stalled` when a stop rule ends the run after this step; raises when the step itself failed
        (health.StopRules), or its rollout did."""
        step, episodes = run.step, run.episodes.result()
        env_stop = self.stops.env_failures(step, episodes)
        lags = rewards.mark_stale(episodes, {ag.spec.name: ag.trainer.gate.version for ag in self.agents},
                                  self.bound)
        # β per agent: its OpenRLHF KL controller's (adaptive with --algo.kl.target), read before training
        # moves it.
        kl_coef = {ag.spec.name: ag.trainer.kl_ctl.value for ag in self.trainees}
        try:
            parts = {} if env_stop else self.update_team(run, kl_coef)
        finally:  # every verdict in, even when an update failed: none is left in flight, paid for and lost
            concurrent.futures.wait([run.complete])
        run.complete.result()  # the rollout's error, if it failed after the agents were done
        coach_metrics = self.coach_metrics(episodes, parts)
        failed = self.stops.failed(step, episodes, coach_metrics, env_stop)
        self.out.episodes(episodes)  # a failed step's too: what it produced is kept
        if failed:  # before the step's checkpoint (a resume starts from the one before)
            env_failed = sum(bool(ep.env_error) for ep in episodes)
            self.out.metrics(step, {**coach_metrics, "outcome/env_failed_episodes": env_failed})
            raise failed
        self.out.syncs(step, self.trainees)
        self.count_optimizer_steps(parts)
        metrics = {**self.metrics(episodes, parts, lags, kl_coef), **coach_metrics}
        # a row with a loss
        learned = {name for name, part in parts.items() if any(not a.zero_loss for a in part.kept)}
        dropped = {name: part.dropped for name, part in parts.items()}
        self.stalled = self.stops.stop_reason(step, episodes, dropped, learned, metrics)
        return {**metrics, **self.timings(parts, run.seconds, t_start)}

    def update_team(self, run: RolloutHandle, kl_coef: dict) -> dict:
        """{agent: its part of the step (agent_step)}, each agent on GPUs of its own at once (per_agent). With
        --mappa.norm_scope global the advantages are whitened over the whole team's batches: every agent's
        experiences first, then the updates."""
        # A trained coach's version before its update of this step: the agents and the coach judge its
        # verdicts' staleness by the same one (read later in an agent's thread, it could be the one that
        # update made).
        coach_now = self.coach_agent.trainer.gate.version if self.coach_agent else None
        parts = self.per_agent(self.agent_step, run, kl_coef, coach_now, time.time())
        if self.mappa.norm_scope == "global":
            self.advantages(parts, kl_coef)
            parts = self.per_agent(self.update, run.step, parts)
        return parts

    def agent_step(self, ag, run: RolloutHandle, kl_coef: dict, coach_now, t_start: float) -> AgentStep:
        """Agent ag's part of the step, from its verdicts to its weights on its engines: it starts as soon as
        its own verdicts are in, so that only the last agent waits on the last ones. With --mappa.norm_scope
        global it stops at its experiences: the advantages are whitened over the whole team's batches
        (update_team)."""
        name, episodes, terms = ag.spec.name, run.episodes.result(), {}
        if ag is self.coach_agent:  # its verdicts' own actions, once all are in, rewarded by its terms
            concurrent.futures.wait([run.complete])
            t0, (mine, terms) = time.time(), self.coach.rewarded(episodes, coach_now, self.bound)
            counts = {**rewards.merge_counts([]), "trainable": sum(a.reward is not None for a in mine)}
        else:
            # its actions, once their verdicts are in; else the rollout's error
            mine = run.verdicts[name].result()
            t0 = time.time()
            if self.coach_agent:  # never a verdict from a coach more than the bound behind
                self.coach.stale_verdicts(mine, coach_now, self.bound)
            own = [dataclasses.replace(ep, actions=[a for a in ep.actions if self.owner[a.agent] == name])
                   for ep in episodes]  # the same Action objects: rewards land on the step's records
            c, algo = self.mappa.coach, self.args.algo
            counts = rewards.assign_rewards(
                own, self.mappa.reward, on_failure=c.on_failure, neutral_score=c.neutral_score,
                scale=self.topology.reward_scale, train_truncated=self.mappa.train_truncated,
                standardize_task_type=c.standardize_task_type, norm_scope=self.mappa.norm_scope,
                outcome_score=self.mappa.outcome_score, batch_semantics=self.mappa.batch_semantics,
                filter_range=algo.dynamic_filtering_range if algo.dynamic_filtering_enable else None)
        kept, dropped = rewards.batch_rule(mine, self.args.train, run.step)
        batch = rewards.experiences(ag.trainer.experience_maker, kept) if kept else []
        part = AgentStep(counts, kept, dropped, batch, terms, coach_wait=t0 - t_start,
                         experience=time.time() - t0)
        if self.mappa.norm_scope == "global":
            return part
        self.advantages({name: part}, kl_coef)
        return self.update(ag, run.step, {name: part})

    def advantages(self, parts: dict, kl_coef: dict) -> None:
        """Returns-to-go and whitened advantages on the batches of `parts` (rewards.compute_advantages, over
        each agent's batch or, with norm_scope global, all of them); each trained action records its row's
        mean."""
        algo = self.args.algo
        batches = {name: part.batch for name, part in parts.items() if part.batch}
        advantage_of = rewards.compute_advantages(
            batches, kl_coef, self.mappa.norm_scope, algo.advantage.gamma,
            std_norm=not algo.advantage.no_std_norm, actions={name: parts[name].kept for name in batches})
        for name, advantage_B in advantage_of.items():
            # Each row's action, by upstream's index into the rows given: token budgets regroup them.
            rows = [i for exp in batches[name] for i in exp.index]
            for i, adv in zip(rows, advantage_B):
                parts[name].kept[i].advantage = adv
            for exp in batches[name]:
                exp.kl = None  # consumed by the advantages; OpenRLHF's actor does not read it

    def update(self, ag, step: int, parts: dict) -> AgentStep:
        """Agent ag's experiences (its part of `parts`) train its actor only, then go to its engines only
        (OpenRLHF's train_step, which ends with the weight sync)."""
        part = parts[ag.spec.name]
        if not part.batch:
            return part
        t0, batch = time.time(), part.batch
        if self.mappa.ppo_ratio == "rollout":  # copies: the step's metrics compare the two log-probs
            batch = [e if e.rollout_log_probs is None
                     else dataclasses.replace(e, action_log_probs=e.rollout_log_probs) for e in batch]
        part.status = ag.trainer.train_step(batch, step)[0]
        part.sync = part.status["timing/broadcast"]
        part.train = time.time() - t0 - part.sync
        return part

    def per_agent(self, method, *args) -> dict:
        """{trainee: method(trainee, *args)}: at once for agents on GPUs of their own (--mappa.colocate none
        or agent), one after another on the team's shared GPUs, where each agent's phase needs the memory the
        others' would take."""
        if self.mappa.colocate == "team":
            return {ag.spec.name: method(ag, *args) for ag in self.trainees}
        with concurrent.futures.ThreadPoolExecutor(max(1, len(self.trainees))) as pool:
            started = {ag.spec.name: pool.submit(method, ag, *args) for ag in self.trainees}
        return {name: future.result() for name, future in started.items()}

    def coach_metrics(self, episodes: list, parts: dict) -> dict:
        """The step's verdicts by status, their cost (and the run's), the bias audit's figures, and a trained
        coach's reward terms, agreement with its reference and the reference's cost."""
        c = self.mappa.coach
        metrics = coach_step_metrics(episodes, c.price_in, c.price_out)
        metrics.update(self.bias_audit.update(episodes))
        for part in parts.values():
            metrics.update(part.terms)
        self.coach_cost_usd += metrics.get("coach/cost_usd", 0.0)
        if c.price_in or c.price_out:
            metrics["coach/cost_usd_total"] = self.coach_cost_usd
        return metrics

    def metrics(self, episodes: list, parts: dict, lags: dict, kl_coef: dict) -> dict:
        """The step's outcome and per-agent metrics (run_log.step_metrics) from its episodes and each agent's
        part."""
        agents = self.agents + self.trainees[len(owners(self.agents)) :]  # every agent, and a trained coach
        counts = {**rewards.merge_counts([part.counts for part in parts.values()]), "staleness": lags,
                  "optimizer_steps": self.optimizer_steps}
        metrics = step_metrics(
            self.args, self.topology, agents, self.owner, episodes,
            batches={name: part.batch for name, part in parts.items() if part.batch},
            status={name: part.status for name, part in parts.items() if part.status is not None},
            dropped={name: part.dropped for name, part in parts.items()}, counts=counts, kl_coef=kl_coef)
        if self.topology.coach_stages:
            metrics["coach/template_stage"] = self.stage  # 0-based, in coach_templates' order
        return metrics

    def timings(self, parts: dict, t_rollout: float, t_start: float) -> dict:
        """The step's phases in seconds. The agents' phases overlap (each starts when its verdicts are in):
        each phase's time is the slowest agent's, or on the team's shared GPUs, where they take turns, the sum
        of all."""
        phase = sum if self.mappa.colocate == "team" else max
        out = {f"timing/{k}": phase([getattr(part, k) for part in parts.values()] or [0.0])
               for k in ("experience", "train", "sync")}
        return {**out, "timing/rollout": t_rollout, "timing/step": time.time() - t_start,
                "timing/coach_wait": max((part.coach_wait for part in parts.values()), default=0.0)}

    def count_optimizer_steps(self, parts: dict) -> None:
        """Add the optimizer steps of each agent's update to its count (agent/<name>/optimizer_steps).
        OpenRLHF's actor steps once per --train.batch_size rows, per epoch; with --train.dynamic_batch_enable
        its replay buffer takes at most the rows it was planned for per epoch: rollout batch x samples per
        prompt x the agent's most actions an episode (launch.actor_args)."""
        train, rollout = self.args.train, self.args.rollout
        trainees = {ag.spec.name: ag for ag in self.trainees}
        for name, part in parts.items():
            if part.status is None:  # no update
                continue
            steps = len(part.kept) // train.batch_size
            if train.dynamic_batch_enable:
                most = trainees[name].most_actions(self.topology)
                steps = min(steps,
                            rollout.batch_size * rollout.n_samples_per_prompt * most // train.batch_size)
            self.optimizer_steps[name] += steps * train.max_epochs

    def rollouts(self, start_step: int):
        """Each step's rollout handle after start_step, collected: its agents are done (its verdicts may still
        be coming). Each step is generated when its turn comes, its engines awake for it, or with
        --train.async_enable up to --train.async_queue_size steps ahead."""
        ahead = self.args.train.async_queue_size if self.args.train.async_enable else 0
        pending = collections.deque()  # started rollouts with their progress bars, oldest first
        for step, tasks in self.batches(start_step):
            if not ahead:
                # asleep again for the updates: the verdicts to come need no engine
                with self.engines_awake():
                    run = self.collect(*self.start(step, tasks))
                yield run
                continue
            pending.append(self.start(step, tasks))
            if len(pending) > ahead:
                yield self.collect(*pending.popleft())
        while pending:
            yield self.collect(*pending.popleft())

    def start(self, step: int, tasks: list) -> tuple:
        """(the step's rollout handle, its progress bar): its episodes on the agents' engines as they are now,
        scored by the coach, on the run's event loop (rollout.RolloutRunner.start)."""
        c = self.mappa.coach
        bar = tqdm(total=len(tasks), desc=f"step {step} rollout", unit="episode", leave=False,
                   file=console.err)
        bias = self.bias_audit.prompt_text() if c.show_bias else None  # the steps before this one
        run = self.runner.start(
            self.topology, tasks, self.policies, self.rollout_coach, os.path.join(self.run_dir, "workspaces"),
            step, members=self.owner, coach_bias=bias, coach_mode=c.mode if self.scored else "per_action",
            progress=bar.update)
        return run, bar

    @staticmethod
    def collect(run: RolloutHandle, bar) -> RolloutHandle:
        """`run` once its agents are done, or its rollout failed before (`step` raises its error)."""
        with bar:
            concurrent.futures.wait([run.episodes])
        return run

    @contextlib.contextmanager
    def engines_awake(self):
        """With --vllm.enable_sleep: every agent's engines awake while the team generates (an episode passes
        through all agents), and asleep after, when colocated actors use their memory."""
        from openrlhf.trainer.ray.vllm_engine import batch_vllm_engine_call

        # a LoRA pool's serve several agents
        engines = distinct([eng for ag in self.trainees for eng in ag.engines])
        if self.args.vllm.enable_sleep:
            batch_vllm_engine_call(engines, "wake_up")
        try:
            yield
        finally:
            if self.args.vllm.enable_sleep:
                batch_vllm_engine_call(engines, "sleep")

    def advance_criteria(self, step: int, metrics: dict):
        """After step `step`: when the rule of the next template in the topology's coach_templates holds on
        this step's metrics, that template scores from step + 1 on. Stages advance in order, one per step at
        most; a metric with no value this step (e.g. a code error rate when no code ran) switches nothing."""
        stages = self.topology.coach_stages
        if self.stage + 1 >= len(stages):
            return
        stage = stages[self.stage + 1]
        value = step if stage.metric == "step" else metrics.get(stage.metric)
        if stage.holds(value):
            tqdm.write(f"[mappa] coach criteria: after step {step}, {stage.metric} = {value:g} "
                       f"({stage.when}): coach template {stages[self.stage].name!r} -> {stage.name!r}, in "
                       f"use from step {step + 1}", file=console.out)
            self.set_stage(self.stage + 1, step + 1)
        elif value is None and stage.name not in self.stage_waits_noted:
            self.stage_waits_noted.add(stage.name)
            tqdm.write(f"[mappa] coach criteria: step {step} logged no value of {stage.metric}; coach "
                       f"template {stage.name!r} waits for a step where {stage.when}", file=console.out)

    def set_stage(self, index: int, since: int):
        self.stage, self.stage_since = index, since
        self.coach.template = self.topology.coach_stages[index].template

    def evaluate(self, step: int):
        """Every --eval.dataset, n samples per task at --eval.temperature, on the current weights, graded by
        the environment and by the coach (eval_coach): a line per dataset in eval.jsonl (read by `mappa
        report` and `mappa paper-table`), the per-problem results in eval/, and the loggers' eval/
        namespace."""
        ev, names, c = self.args.eval, [ag.spec.name for ag in self.agents], self.mappa.coach
        for dataset, tasks in self.eval_sets.items():
            workspace = os.path.join(self.run_dir, "workspaces", f"eval-{dataset}")
            total = len(tasks) * ev.n_samples_per_prompt
            with self.engines_awake(), tqdm(total=total, desc=f"evaluation {dataset}", unit="episode",
                                            leave=False, file=console.err) as bar:
                graded = evaluate(self.topology, tasks, self.eval_policies, ev.n_samples_per_prompt,
                                  workspace, step, progress=bar.update, coach=self.eval_coach)
                # fit runs the loop
                episodes = asyncio.run_coroutine_threadsafe(graded, self.runner.loop).result()
            summary, problems = summarize(episodes, names, tasks, asks_answer(self.eval_coach))
            # counted in the run's total cost too
            summary.update(coach_cost(episodes, c.price_in, c.price_out))
            self.coach_cost_usd += summary.get("coach/cost_usd", 0.0)
            if self.eval_overlap.get(dataset):  # allowed by --mappa.allow_eval_overlap: on every record of it
                summary["train_overlap"] = self.eval_overlap[dataset]
            self.out.evaluation(step, dataset, summary, problems, self.topology.env_cls.grader)
            tqdm.write(f"[mappa] evaluation after step {step}\n{format_table({dataset: summary})}",
                       file=console.err)

    def save_checkpoints(self, step: int):
        """Every agent's checkpoint, then the team's marker with the driver's state that resume() reads
        back."""
        state = {"step": step, "coach_cost_usd": self.coach_cost_usd,
                 # adaptive KL moves it
                 "kl_coef": {ag.spec.name: ag.trainer.kl_ctl.value for ag in self.trainees},
                 "versions": {ag.spec.name: ag.trainer.gate.version for ag in self.trainees},
                 "optimizer_steps": self.optimizer_steps}
        if self.topology.coach_stages:  # the template in use for the next step
            name = self.topology.coach_stages[self.stage].name
            state["coach_template"] = {"name": name, "since_step": self.stage_since}
        resume.save_team(self.trainees, self.args.ckpt, state)
