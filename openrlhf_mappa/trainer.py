"""The team loop: each agent is its own policy (its own ZeRO-3 actor and reference groups and vLLM engines, built
by launch.py; a LoRA agent shares its base's engine pool and has no reference group), one step at a time.

One step:  rollout (all episodes at once) -> per agent, as soon as its own coach verdicts are in: per-action
rewards -> OpenRLHF Experiences (actor/ref log-probs, KL) -> token rewards, return-to-go, whitening (rewards.py)
-> agent k's experiences train agent k's actor only -> agent k's weights go to agent k's engines only.
"""

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import os
import random
import threading
import time

import ray
from tqdm import tqdm

from openrlhf_mappa import resume, rewards
from openrlhf_mappa.coach.audit import BiasAudit, CoachFailure, check_failures, coach_step_metrics
from openrlhf_mappa.console import console, step_line
from openrlhf_mappa.evaluation import NoCoach, coach_cost, evaluate, format_table, summarize, train_overlap
from openrlhf_mappa.health import RunStopped, env_failures, untrained_reasons
from openrlhf_mappa.launch import distinct, owners
from openrlhf_mappa.rollout import AgentPolicy, rollout
from openrlhf_mappa.run_log import RunLog, step_metrics


class MappaTrainer:
    def __init__(self, args, topology, agents: list, coach, tasks: list, run_dir: str, eval_sets: dict = None):
        self.args, self.topology, self.agents, self.coach, self.tasks = args, topology, agents, coach, tasks
        self.run_dir, self.eval_sets = run_dir, eval_sets or {}  # eval_sets: dataset name -> tasks
        # Who trains whose actions: each agent its own (a shared policy: the first's); a trained coach its verdicts.
        self.coach_agent = getattr(coach, "agent", None)
        self.trainees = owners(agents) + [self.coach_agent] * bool(self.coach_agent)
        owner_of_actor = {id(ag.actor): ag.spec.name for ag in self.trainees}
        self.owner = {ag.spec.name: owner_of_actor[id(ag.actor)] for ag in agents + self.trainees}
        self.mappa = args.mappa
        # The most updates an action's weights (or its trained coach's) may be behind when its step trains.
        self.bound = self.mappa.max_staleness if self.mappa.max_staleness is not None else args.train.async_queue_size
        # The outcome baseline trains on no verdict: asking an API coach anyway would cost money for nothing.
        # --mappa.coach.score_outcome_runs asks it all the same, for a comparison that is logged, never trained on.
        self.scored = self.mappa.reward == "process" or self.mappa.coach.score_outcome_runs
        self.rollout_coach = coach if self.scored else NoCoach("outcome baseline: not scored")
        # Evaluation's grader (the authors' accuracy: evaluation.coach_graded) is the rollouts' coach, its cost
        # counted; for a trained coach its reference judge, lest the coach's eval verdicts become its training.
        self.eval_coach = coach.reference if self.coach_agent else self.rollout_coach
        if self.eval_coach.template is None:  # a hindsight-only coach: no per-action prompt to grade with
            self.eval_coach = NoCoach("evaluation: the coach has no per-action prompt (coach_template)")
        self.eval_overlap = {name: len(train_overlap(tasks, ts)) for name, ts in self.eval_sets.items()}
        self.bias_audit = BiasAudit(self.mappa.coach.bias_threshold, self.mappa.coach.bias_window)
        self.coach_cost_usd = 0.0
        self.optimizer_steps = {ag.spec.name: 0 for ag in self.trainees}  # each actor's, since the run started
        # The coach template in use (an index into topology.coach_stages) and the first step it scored.
        self.stage, self.stage_since, self.stage_waits_noted = 0, 1, set()
        # Steps in a row in which no agent trained, and the message that stops the run (--mappa.max_untrained_steps).
        self.untrained_steps, self.stalled = 0, None
        self.policies, self.eval_policies = ({ag.spec.name: AgentPolicy(
            ag.engines, ag.tokenizer, ag.args.rollout.max_new_tokens, args.data.max_len,
            dict(temperature=temperature, top_p=args.rollout.top_p), ag.trainer.adapter, ag.trainer.gate)
            for ag in agents + self.trainees}
            for temperature in (args.rollout.temperature, args.eval.temperature))
        if self.coach_agent:
            coach.attach(self.policies[self.coach_agent.spec.name])
        # One event loop for the whole run: the coach's HTTP client and its semaphore belong to the loop
        # they were first used on, so a fresh asyncio.run() per step would break them at step 2.
        self.loop = asyncio.new_event_loop()
        self.out = RunLog(args, run_dir)

    def batches(self, start_step: int):
        """(step, tasks) for every step of every pass over the data; each task repeated n_samples times."""
        bs, n = self.args.rollout.batch_size, self.args.rollout.n_samples_per_prompt
        steps_per_pass = len(self.tasks) // bs
        for step in range(start_step, steps_per_pass * self.args.train.num_episodes):
            rng = random.Random(self.args.train.seed + step // steps_per_pass)
            order = list(range(len(self.tasks)))
            rng.shuffle(order)
            chunk = order[(step % steps_per_pass) * bs : (step % steps_per_pass + 1) * bs]
            yield step + 1, [self.tasks[i] for i in chunk for _ in range(n)]

    def resume(self, step: int):
        """Continue after step `step`: logs cut back to it, every agent's engines given its loaded weights, and the
        driver's own state as the team checkpoint left it (resume.driver_state)."""
        resume.truncate_logs(self.run_dir, step)
        if not step:
            return
        self.coach_cost_usd, stage, episodes_by_step, saved = resume.driver_state(
            self.args.ckpt.path, self.run_dir, step, self.bias_audit.window.maxlen)
        resume.load_team(self.trainees, step, saved)
        self.optimizer_steps.update(saved.get("optimizer_steps", {}))
        if stage:  # its name was checked against the topology by resume.check_resume
            self.set_stage([s.name for s in self.topology.coach_stages].index(stage["name"]), stage["since_step"])
            print(f"[mappa] coach criteria: resuming with coach template {stage['name']!r} (in use since step "
                  f"{stage['since_step']})", file=console.out, flush=True)
        for k in sorted(episodes_by_step):
            self.bias_audit.update(episodes_by_step[k])

    def fit(self, start_step: int = 0):
        total = (len(self.tasks) // self.args.rollout.batch_size) * self.args.train.num_episodes
        every = self.args.eval.steps
        with self.loop_running():
            if start_step == 0:
                # Each LoRA adapter's first load into its pool (launch.build_agents): its version 1, made by no step.
                self.out.syncs(0, self.trainees)
                self.evaluate(0)  # the untrained models: the baseline every later evaluation compares with
            steps = tqdm(total=total, initial=start_step, desc="MAPPA steps", file=console.err)
            t_step = time.time()
            for step, episodes, t_rollout, complete in self.rollouts(start_step):
                t_wait = time.time() - t_step  # async: the part of the rollout that training did not hide
                metrics = {**self.learn(step, episodes, t_rollout, t_step, complete), "timing/rollout_wait": t_wait}
                self.out.metrics(step, metrics)
                steps.update(1)
                tqdm.write(step_line(step, total, metrics, [ag.spec.name for ag in self.agents]), file=console.err)
                if self.stalled:
                    raise RunStopped(self.stalled)
                self.advance_criteria(step, metrics)  # before the checkpoint, which records the template in use
                if (every > 0 and step % every == 0) or step == total:
                    self.evaluate(step)
                if self.args.ckpt.save_steps > 0 and step % self.args.ckpt.save_steps == 0:
                    self.save_checkpoints(step)
                t_step = time.time()
            steps.close()
            ray.get([ref for ag in self.trainees for ref in ag.actor.async_save_model()])
        self.out.close()
        self.loop.run_until_complete(self.coach.aclose())

    @contextlib.contextmanager
    def loop_running(self):
        """The run's event loop (rollouts, coach, evaluation) in a thread of its own, so that the team trains while
        verdicts are still coming, and with --train.async_enable while the next steps' episodes are generated."""
        thread = threading.Thread(target=self.loop.run_forever, name="mappa-rollout", daemon=True)
        thread.start()
        try:
            yield
        finally:
            self.loop.call_soon_threadsafe(self.loop.stop)
            thread.join()

    def wait_for(self, coroutine):
        """The coroutine's result, run on the run's event loop (in its thread during fit)."""
        if self.loop.is_running():
            return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()
        return self.loop.run_until_complete(coroutine)

    def rollouts(self, start_step: int):
        """(step, its episodes, the rollout's seconds, its future) for every step after start_step, as soon as the
        agents are done (verdicts may still be coming: the future is done when all are in). Each step is generated
        when its turn comes, or with --train.async_enable up to --train.async_queue_size steps ahead."""
        ahead = self.args.train.async_queue_size if self.args.train.async_enable else 0
        pending = collections.deque()  # (step, its progress bar, its rollout's futures)
        for step, tasks in self.batches(start_step):
            bar = tqdm(total=len(tasks), desc=f"step {step} rollout", unit="episode", leave=False, file=console.err)
            if not ahead:
                with self.engines_awake():  # asleep again for the updates: the verdicts to come need no engine
                    played = self.collect(step, bar, self.start_rollout(step, tasks, bar.update))
                yield played
                continue
            pending.append((step, bar, self.start_rollout(step, tasks, bar.update)))
            if len(pending) > ahead:
                yield self.collect(*pending.popleft())
        while pending:
            yield self.collect(*pending.popleft())

    def start_rollout(self, step: int, tasks: list, progress=None) -> tuple:
        """The step's rollout, started on the run's event loop: futures of (its episodes, seconds) once the agents
        are done, and of its episodes once every verdict is in too."""
        played, t0 = concurrent.futures.Future(), time.time()
        done = lambda episodes: played.set_result((episodes, time.time() - t0))
        return played, asyncio.run_coroutine_threadsafe(self.rollout_of(step, tasks, progress, done), self.loop)

    @staticmethod
    def collect(step: int, bar, futures: tuple) -> tuple:
        """(step, episodes, seconds, the rollout's future) once the agents are done; the rollout's error if any."""
        played, complete = futures
        with bar:
            concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)
            if not played.done():
                complete.result()  # it ended before the agents were done: its error
            return step, *played.result(), complete

    async def rollout_of(self, step: int, tasks: list, progress=None, played=None) -> list:
        """The step's episodes on the agents' engines as they are now, scored by the coach (rollout.rollout)."""
        c = self.mappa.coach
        bias = self.bias_audit.prompt_text() if c.show_bias else None  # the steps before this one
        return await rollout(self.topology, tasks, self.policies, self.rollout_coach,
                             os.path.join(self.run_dir, "workspaces"), step, coach_bias=bias,
                             coach_mode=c.mode if self.scored else "per_action", progress=progress, played=played)

    @contextlib.contextmanager
    def engines_awake(self):
        """With --vllm.enable_sleep: every agent's engines awake while the team generates (an episode passes
        through all agents), and asleep after, when colocated actors use their memory."""
        from openrlhf.trainer.ray.vllm_engine import batch_vllm_engine_call

        engines = distinct([eng for ag in self.trainees for eng in ag.engines])  # a LoRA pool's serve several agents
        if self.args.vllm.enable_sleep:
            batch_vllm_engine_call(engines, "wake_up")
        try:
            yield
        finally:
            if self.args.vllm.enable_sleep:
                batch_vllm_engine_call(engines, "sleep")

    def train_step(self, step: int, tasks: list, progress=None) -> dict:
        """One synchronous step on `tasks`: the rollout, then learn."""
        t_start = time.time()
        with self.loop_running():
            with self.engines_awake():
                _, episodes, t_rollout, complete = self.collect(step, contextlib.nullcontext(),
                                                                self.start_rollout(step, tasks, progress))
            return self.learn(step, episodes, t_rollout, t_start, complete)

    def learn(self, step: int, episodes: list, t_rollout: float, t_start: float, complete) -> dict:
        """The step's episodes to rewards, each agent's experiences and its update; returns the step's metrics.
        `episodes`: the agents are done; `complete`: the rollout's future, done when every verdict is in too."""
        # Known as the agents are done: before any update.
        env_stop = env_failures(step, episodes, self.mappa.env.max_failure_fraction, self.run_dir)
        lags = rewards.mark_stale(episodes, {ag.spec.name: ag.trainer.gate.version for ag in self.agents}, self.bound)
        # β per agent: its OpenRLHF KL controller's (adaptive with --algo.kl.target), read before training moves it.
        kl_coef = {ag.spec.name: ag.trainer.kl_ctl.value for ag in self.trainees}
        try:
            made = {} if env_stop else self.update_team(step, episodes, complete, kl_coef)
        finally:  # every verdict in, even when an update failed: none is left in flight, paid for and lost
            concurrent.futures.wait([complete])
        complete.result()  # the rollout's error, if it failed after the agents were done
        c = self.mappa.coach
        coach_metrics = coach_step_metrics(episodes, c.price_in, c.price_out)
        coach_metrics.update(self.bias_audit.update(episodes))
        # A trained coach's reward terms, its agreement with the reference and the reference's cost.
        coach_metrics.update({k: v for m in made.values() for k, v in m["terms"].items()})
        self.coach_cost_usd += coach_metrics.get("coach/cost_usd", 0.0)
        if c.price_in or c.price_out:
            coach_metrics["coach/cost_usd_total"] = self.coach_cost_usd
        stop = env_stop and RunStopped(env_stop)
        if self.scored and not stop and not self.coach_agent:  # verdicts paid for but mostly failed: stop
            try:
                check_failures(episodes, coach_metrics, c.max_failure_fraction)
            except CoachFailure as e:
                stop = CoachFailure(f"step {step}: {e} The step's episodes are in {self.run_dir}/episodes.jsonl.")
        if stop:  # before the step's checkpoint (a resume starts from the one before), keeping what it produced
            self.out.episodes(episodes)
            failed = sum(bool(ep.env_error) for ep in episodes)
            self.out.metrics(step, {**coach_metrics, "outcome/env_failed_episodes": failed})
            raise stop

        batches = {name: m["batch"] for name, m in made.items() if m["batch"]}
        status = {name: m["status"] for name, m in made.items() if "status" in m}
        dropped = {name: m["dropped"] for name, m in made.items()}
        agents = owners(self.agents)  # the trainees but a trained coach
        learned = {name for name, m in made.items() if any(not a.zero_loss for a in m["kept"])}  # a row with a loss
        untrained = untrained_reasons([ag for ag in agents if ag.spec.name not in learned], self.owner,
                                      episodes, dropped, self.mappa.train_truncated)
        for name, why in untrained.items():
            tqdm.write(f"[mappa] step {step}: agent {name!r} trained on nothing: {why}", file=console.err)
        self.untrained_steps = (self.untrained_steps + 1) * (len(untrained) == len(agents) and step > c.warmup_steps)
        most = self.mappa.max_untrained_steps
        if most and self.untrained_steps >= most:
            self.stalled = (f"no agent trained in {self.untrained_steps} steps in a row (--mappa.max_untrained_steps "
                            f"{most}); at step {step}, "
                            + "; ".join(f"agent {n!r}: {why}" for n, why in untrained.items()))

        self.out.episodes(episodes)
        self.out.syncs(step, self.trainees)
        counts = rewards.merge_counts([m["counts"] for m in made.values()])
        self.count_optimizer_steps(made)
        metrics = step_metrics(self.args, self.topology, self.agents + self.trainees[len(agents) :], self.owner,
                               episodes, batches, status, dropped,
                               {**counts, "staleness": lags, "optimizer_steps": self.optimizer_steps}, kl_coef)
        metrics.update(coach_metrics)
        if self.coach_agent:  # the safeguard: a trained coach's agreement with its reference, held out
            self.stalled = self.stalled or self.coach.agreement_stop(step, metrics)
        # The agents' phases overlap (each starts when its verdicts are in): each phase's time is the slowest
        # agent's, or on the team's shared GPUs, where they take turns, the sum of all.
        total = sum if self.mappa.colocate == "team" else lambda ts: max(ts, default=0.0)
        metrics.update({f"timing/{k}": total([m.get(k, 0.0) for m in made.values()])
                        for k in ("experience", "train", "sync")})
        metrics.update({"timing/rollout": t_rollout, "timing/step": time.time() - t_start,
                        "timing/coach_wait": max((m["coach_wait"] for m in made.values()), default=0.0)})
        if self.topology.coach_stages:
            metrics["coach/template_stage"] = self.stage  # 0-based, in coach_templates' order
        return metrics

    def update_team(self, step: int, episodes: list, complete, kl_coef: dict) -> dict:
        """Each agent's part of the step, from its verdicts to its weights on its engines: {agent: its rewards'
        counts, batch (OpenRLHF Experiences), kept actions, dropped count, update status, timings}. An agent starts
        as soon as its own verdicts are in, so that only the last waits on the last ones; with --mappa.norm_scope
        global, whose advantages are whitened over the whole team's batches, all experiences come first."""
        algo, c, t_start = self.args.algo, self.mappa.coach, time.time()
        # A trained coach's version before its update of this step: the agents and the coach judge its verdicts'
        # staleness by the same one (read later in an agent's thread, it could be the one that update made).
        coach_now = self.coach_agent.trainer.gate.version if self.coach_agent else None

        def prepare(ag) -> dict:
            name, terms = ag.spec.name, {}
            if ag is self.coach_agent:  # its verdicts' own actions, once all are in, rewarded by its terms
                concurrent.futures.wait([complete])
                t0, (mine, terms) = time.time(), self.coach.rewarded(episodes, coach_now, self.bound)
                counts = {**rewards.merge_counts([]), "trainable": sum(a.reward is not None for a in mine)}
            else:
                self.verdicts_in(name, episodes, complete)
                t0 = time.time()
                own = [dataclasses.replace(ep, actions=[a for a in ep.actions if self.owner[a.agent] == name])
                       for ep in episodes]  # the same Action objects: rewards land on the step's records
                mine = [a for ep in own for a in ep.actions]
                if self.coach_agent:  # never a verdict from a coach more than the bound behind
                    self.coach.stale_verdicts(mine, coach_now, self.bound)
                counts = rewards.assign_rewards(
                    own, self.mappa.reward, c.on_failure, c.neutral_score, self.topology.reward_scale,
                    self.mappa.train_truncated, c.standardize_task_type, self.mappa.norm_scope,
                    self.mappa.outcome_score, algo.dynamic_filtering_range if algo.dynamic_filtering_enable else None,
                    self.mappa.batch_semantics)
            kept, dropped = rewards.batch_rule(mine, self.args.train, step)
            batch = rewards.experiences(ag.trainer.experience_maker, kept) if kept else []
            return {"counts": counts, "kept": kept, "dropped": dropped, "batch": batch, "coach_wait": t0 - t_start,
                    "experience": time.time() - t0, "terms": terms}

        def advantages(made: dict) -> None:  # each trained action's record shows its row's mean advantage
            batches = {name: m["batch"] for name, m in made.items() if m["batch"]}
            advantage_of = rewards.compute_advantages(batches, kl_coef, self.mappa.norm_scope, algo.advantage.gamma,
                                                      std_norm=not algo.advantage.no_std_norm,
                                                      actions={name: made[name]["kept"] for name in batches})
            for name, advantage_B in advantage_of.items():
                # Each row's action, by upstream's index into the rows given: token budgets regroup them.
                rows = [i for exp in batches[name] for i in exp.index]
                for i, adv in zip(rows, advantage_B):
                    made[name]["kept"][i].advantage = adv
                for exp in batches[name]:
                    exp.kl = None  # consumed by the advantages; OpenRLHF's actor does not read it

        def train(ag, m: dict) -> dict:  # agent k's experiences train agent k's actor, then go to its engines
            if m["batch"]:
                t0, batch = time.time(), m["batch"]
                if self.mappa.ppo_ratio == "rollout":  # copies: the step's metrics compare the two log-probs
                    batch = [e if e.rollout_log_probs is None else
                             dataclasses.replace(e, action_log_probs=e.rollout_log_probs) for e in batch]
                m["status"] = ag.trainer.train_step(batch, step)[0]
                m["sync"] = m["status"]["timing/broadcast"]
                m["train"] = time.time() - t0 - m["sync"]
            return m

        def whole(ag) -> dict:
            m = prepare(ag)
            advantages({ag.spec.name: m})
            return train(ag, m)

        if not rewards.NORM_SCOPES[self.mappa.norm_scope][1]:
            return self.per_agent(whole, self.trainees)
        made = self.per_agent(prepare, self.trainees)
        advantages(made)
        return self.per_agent(lambda ag: train(ag, made[ag.spec.name]), self.trainees)

    def count_optimizer_steps(self, made: dict) -> None:
        """Add the optimizer steps of each agent's update to its count (agent/<name>/optimizer_steps). OpenRLHF's
        actor steps once per --train.batch_size rows, per epoch; with --train.dynamic_batch_enable its replay buffer
        takes at most the rows it was planned for per epoch: rollout batch x samples per prompt x the agent's most
        actions an episode (launch.actor_args)."""
        train, rollout = self.args.train, self.args.rollout
        specs = {ag.spec.name: ag.spec for ag in self.trainees}
        for name, m in made.items():
            if "status" not in m:  # no update
                continue
            steps = len(m["kept"]) // train.batch_size
            if train.dynamic_batch_enable:
                most = self.topology.most_actions(specs[name], self.mappa.shared_policy)
                steps = min(steps, rollout.batch_size * rollout.n_samples_per_prompt * most // train.batch_size)
            self.optimizer_steps[name] += steps * train.max_epochs

    def verdicts_in(self, name: str, episodes: list, complete) -> None:
        """Wait until every verdict on agent `name`'s actions of the step is in; the rollout's error if it failed."""
        mine = [a for ep in episodes for a in ep.actions if self.owner[a.agent] == name]
        while not complete.done() and any(a.verdict is None for a in mine):
            time.sleep(0.02)  # the verdicts land on the rollout's thread (rollout.record_verdict)
        if complete.done():
            complete.result()

    def per_agent(self, fn, agents: list) -> dict:
        """{agent: fn(agent)}: at once for agents on GPUs of their own (--mappa.colocate none or agent), one after
        another on the team's shared GPUs, where each agent's phase needs the memory the others' would take."""
        if self.mappa.colocate == "team":
            return {ag.spec.name: fn(ag) for ag in agents}
        with concurrent.futures.ThreadPoolExecutor(max(1, len(agents))) as pool:
            return dict(zip([ag.spec.name for ag in agents], pool.map(fn, agents)))

    def advance_criteria(self, step: int, metrics: dict):
        """After step `step`: when the rule of the next template in the topology's coach_templates holds on this
        step's metrics, that template scores from step + 1 on. Stages advance in order, one per step at most;
        a metric with no value this step (e.g. a code error rate when no code ran) switches nothing."""
        stages = self.topology.coach_stages
        if self.stage + 1 >= len(stages):
            return
        stage = stages[self.stage + 1]
        value = step if stage.metric == "step" else metrics.get(stage.metric)
        if stage.holds(value):
            tqdm.write(f"[mappa] coach criteria: after step {step}, {stage.metric} = {value:g} ({stage.when}): coach "
                       f"template {stages[self.stage].name!r} -> {stage.name!r}, in use from step {step + 1}",
                       file=console.out)
            self.set_stage(self.stage + 1, step + 1)
        elif value is None and stage.name not in self.stage_waits_noted:
            self.stage_waits_noted.add(stage.name)
            tqdm.write(f"[mappa] coach criteria: step {step} logged no value of {stage.metric}; coach template "
                       f"{stage.name!r} waits for a step where {stage.when}", file=console.out)

    def set_stage(self, index: int, since: int):
        self.stage, self.stage_since = index, since
        self.coach.template = self.topology.coach_stages[index].template

    def evaluate(self, step: int):
        """Every --eval.dataset, n samples per task at --eval.temperature, on the current weights, graded by the
        environment and by the coach (eval_coach): a line per dataset in eval.jsonl (read by `mappa report` and
        `mappa paper-table`), the per-problem results in eval/, and the loggers' eval/ namespace."""
        ev, names, c = self.args.eval, [ag.spec.name for ag in self.agents], self.mappa.coach
        for dataset, tasks in self.eval_sets.items():
            workspace = os.path.join(self.run_dir, "workspaces", f"eval-{dataset}")
            total = len(tasks) * ev.n_samples_per_prompt
            with self.engines_awake(), tqdm(total=total, desc=f"evaluation {dataset}", unit="episode", leave=False,
                                            file=console.err) as bar:
                episodes = self.wait_for(evaluate(self.topology, tasks, self.eval_policies, ev.n_samples_per_prompt,
                                                  workspace, step, bar.update, self.eval_coach))
            summary, problems = summarize(episodes, names, tasks)
            summary.update(coach_cost(episodes, c.price_in, c.price_out))  # counted in the run's total cost too
            self.coach_cost_usd += summary.get("coach/cost_usd", 0.0)
            if self.eval_overlap.get(dataset):  # allowed by --mappa.allow_eval_overlap: on every record of it
                summary["train_overlap"] = self.eval_overlap[dataset]
            self.out.evaluation(step, dataset, summary, problems)
            tqdm.write(f"[mappa] evaluation after step {step}\n{format_table({dataset: summary})}", file=console.err)

    def save_checkpoints(self, step: int):
        """Every agent's checkpoint, then the team's marker with the driver's state that resume() reads back."""
        state = {"step": step, "coach_cost_usd": self.coach_cost_usd,
                 "kl_coef": {ag.spec.name: ag.trainer.kl_ctl.value for ag in self.trainees},  # adaptive KL moves it
                 "versions": {ag.spec.name: ag.trainer.gate.version for ag in self.trainees},
                 "optimizer_steps": self.optimizer_steps}
        if self.topology.coach_stages:  # the template in use for the next step
            name = self.topology.coach_stages[self.stage].name
            state["coach_template"] = {"name": name, "since_step": self.stage_since}
        resume.save_team(self.trainees, self.args.ckpt, state)
