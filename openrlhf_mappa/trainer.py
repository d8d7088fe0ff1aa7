"""The team loop: each agent is its own policy with its own ZeRO-3 actor group, reference group and vLLM
engines (OpenRLHF's classes, built by launch.py); MappaTrainer drives them all, one step at a time. A LoRA agent
(topology `lora`) has no reference group and shares its base model's engine pool (agent_trainer.py).

One step:  rollout (all episodes at once) -> per agent, as soon as its own coach verdicts are in: per-action
rewards -> OpenRLHF Experiences (actor/ref log-probs, KL) -> token rewards, return-to-go, whitening (rewards.py)
-> agent k's experiences train agent k's actor only -> agent k's weights go to agent k's engines only.
"""

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import random
import threading
import time

import ray
import torch
from tqdm import tqdm

from openrlhf_mappa import resume, rewards
from openrlhf_mappa.coach.audit import BiasAudit, CoachFailure, check_failures, coach_step_metrics
from openrlhf_mappa.console import console, step_line
from openrlhf_mappa.evaluation import NoCoach, behaviour_metrics, evaluate, format_table, summarize
from openrlhf_mappa.health import RunStopped, untrained_reasons
from openrlhf_mappa.launch import distinct, owners
from openrlhf_mappa.rollout import AgentPolicy, rollout


def experience_of(action):
    """One action as an OpenRLHF Experience: the sequence is prompt + response, and the action mask
    (shifted by one, as OpenRLHF's) covers the response tokens only, so tool output never trains. The rollout
    log-probs (vLLM's) sit on the action mask's positions, where OpenRLHF's PolicyLoss reads them."""
    from openrlhf.trainer.ppo_utils.experience import Experience

    seq = action.prompt_ids + action.response_ids
    action_mask = torch.zeros(len(seq), dtype=torch.bool)
    action_mask[len(action.prompt_ids) :] = True
    reward = torch.tensor([action.reward], dtype=torch.float32)
    rollout_log_probs = None
    if len(action.rollout_logprobs) == len(action.response_ids):
        rollout_log_probs = torch.zeros(1, len(seq) - 1)
        rollout_log_probs[0, len(action.prompt_ids) - 1 :] = torch.tensor(action.rollout_logprobs)
    return Experience(
        sequences=torch.tensor([seq]),
        attention_mask=torch.ones(1, len(seq), dtype=torch.long),
        action_mask=action_mask[1:].unsqueeze(0),
        rollout_log_probs=rollout_log_probs,
        rewards=reward,
        response_length=torch.tensor([float(len(action.response_ids))]),
        truncated=torch.tensor([action.truncated]),
        total_length=torch.tensor([float(len(seq))]),
        prompts=[action.prompt_text],
        labels=[""],
        info={"reward": reward, "response_length": torch.tensor([float(len(action.response_ids))])},
    )


class MappaTrainer:
    def __init__(self, args, topology, agents: list, coach, tasks: list, run_dir: str, eval_sets: dict = None):
        self.args, self.topology, self.agents, self.coach, self.tasks = args, topology, agents, coach, tasks
        self.run_dir = run_dir
        self.eval_sets = eval_sets or {}  # dataset name -> tasks
        # Who trains whose actions: each agent its own, or with a shared policy, all of them the first's.
        self.trainees = owners(agents)
        owner_of_actor = {id(ag.actor): ag.spec.name for ag in self.trainees}
        self.owner = {ag.spec.name: owner_of_actor[id(ag.actor)] for ag in agents}
        self.mappa = args.mappa
        # The outcome baseline trains on no verdict: asking an API coach anyway would cost money for nothing.
        # --mappa.coach.score_outcome_runs asks it all the same, for a comparison that is logged, never trained on.
        self.scored = self.mappa.reward == "process" or self.mappa.coach.score_outcome_runs
        self.rollout_coach = coach if self.scored else NoCoach("outcome baseline: not scored")
        self.bias_audit = BiasAudit(self.mappa.coach.bias_threshold, self.mappa.coach.bias_window)
        self.coach_cost_usd = 0.0
        # The coach template in use (an index into topology.coach_stages) and the first step it scored.
        self.stage, self.stage_since, self.stage_waits_noted = 0, 1, set()
        # Steps in a row in which no agent trained, and the message that stops the run (--mappa.max_untrained_steps).
        self.untrained_steps, self.stalled = 0, None
        os.makedirs(run_dir, exist_ok=True)
        self.policies, self.eval_policies = ({ag.spec.name: AgentPolicy(
            ag.engines, ag.tokenizer, ag.args.rollout.max_new_tokens, args.data.max_len,
            dict(temperature=temperature, top_p=args.rollout.top_p), ag.trainer.adapter, ag.trainer.gate)
            for ag in agents}
            for temperature in (args.rollout.temperature, args.eval.temperature))
        # One event loop for the whole run: the coach's HTTP client and its semaphore belong to the loop
        # they were first used on, so a fresh asyncio.run() per step would break them at step 2.
        self.loop = asyncio.new_event_loop()
        self.loggers = []
        if args.logger.wandb.key or args.logger.tensorboard_dir:
            from openrlhf.utils.logging_utils import TensorboardLogger, WandbLogger

            self.loggers = [cls(args) for cls, on in ((WandbLogger, args.logger.wandb.key),
                                                       (TensorboardLogger, args.logger.tensorboard_dir)) if on]

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
        resume.load_team(self.trainees, step)
        self.coach_cost_usd, stage, episodes_by_step, saved = resume.driver_state(
            self.args.ckpt.path, self.run_dir, step, self.bias_audit.window.maxlen)
        for ag in self.trainees:  # as the checkpoint's step left them (load_team's sync counted one more version)
            ag.trainer.kl_ctl.value = saved.get("kl_coef", {}).get(ag.spec.name, ag.trainer.kl_ctl.value)
            ag.trainer.gate.version = saved.get("versions", {}).get(ag.spec.name, ag.trainer.gate.version)
            ag.trainer.gate.log.clear()  # load_team's sync restored a version; it made none
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
                self.evaluate(0)  # the untrained models: the baseline every later evaluation compares with
            steps = tqdm(total=total, initial=start_step, desc="MAPPA steps", file=console.err)
            t_step = time.time()
            for step, episodes, t_rollout, complete in self.rollouts(start_step):
                t_wait = time.time() - t_step  # async: the part of the rollout that training did not hide
                metrics = {**self.learn(step, episodes, t_rollout, t_step, complete), "timing/rollout_wait": t_wait}
                self.log(step, metrics)
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
        for logger in self.loggers:
            logger.close()
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
        env_stop = self.env_failures(step, episodes)  # known as the agents are done: before any update
        bound = self.mappa.max_staleness if self.mappa.max_staleness is not None else self.args.train.async_queue_size
        lags = rewards.mark_stale(episodes, {ag.spec.name: ag.trainer.gate.version for ag in self.agents}, bound)
        # β per agent: its OpenRLHF KL controller's, fixed or adaptive (--algo.kl.target; upstream's train_step
        # updates it). Read before training, which moves it.
        kl_coef = {ag.spec.name: ag.trainer.kl_ctl.value for ag in self.trainees}
        try:
            made = {} if env_stop else self.update_team(step, episodes, complete, kl_coef)
        finally:  # every verdict in, even when an update failed: none is left in flight, paid for and lost
            concurrent.futures.wait([complete])
        complete.result()  # the rollout's error, if it failed after the agents were done
        c = self.mappa.coach
        coach_metrics = coach_step_metrics(episodes, c.price_in, c.price_out)
        coach_metrics.update(self.bias_audit.update(episodes))
        self.coach_cost_usd += coach_metrics.get("coach/cost_usd", 0.0)
        if c.price_in or c.price_out:
            coach_metrics["coach/cost_usd_total"] = self.coach_cost_usd
        if env_stop:
            self.write_episodes(episodes)
            self.log(step, {**coach_metrics, "outcome/env_failed_episodes": sum(bool(ep.env_error) for ep in episodes)})
            raise RunStopped(env_stop)
        self.stop_on_coach_failures(step, episodes, coach_metrics)

        batches = {name: m["batch"] for name, m in made.items() if m["batch"]}
        status = {name: m["status"] for name, m in made.items() if "status" in m}
        dropped = {name: m["dropped"] for name, m in made.items()}
        untrained = untrained_reasons([ag for ag in self.trainees if ag.spec.name not in batches], self.owner,
                                      episodes, dropped, self.mappa.train_truncated)
        for name, why in untrained.items():
            tqdm.write(f"[mappa] step {step}: agent {name!r} trained on nothing: {why}", file=console.err)
        self.untrained_steps = self.untrained_steps + 1 if len(untrained) == len(self.trainees) else 0
        most = self.mappa.max_untrained_steps
        if most and self.untrained_steps >= most:
            self.stalled = (f"no agent trained in {self.untrained_steps} steps in a row (--mappa.max_untrained_steps "
                            f"{most}); at step {step}, "
                            + "; ".join(f"agent {n!r}: {why}" for n, why in untrained.items()))

        self.write_episodes(episodes)
        self.write_syncs(step)
        counts = rewards.merge_counts([m["counts"] for m in made.values()])
        metrics = self.step_metrics(episodes, batches, status, dropped, {**counts, "staleness": lags}, kl_coef)
        metrics.update(coach_metrics)
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

        def prepare(ag) -> dict:
            name = ag.spec.name
            self.verdicts_in(name, episodes, complete)
            t0 = time.time()
            own = [dataclasses.replace(ep, actions=[a for a in ep.actions if self.owner[a.agent] == name])
                   for ep in episodes]  # the same Action objects: rewards land on the step's records
            counts = rewards.assign_rewards(own, self.mappa.reward, c.on_failure, c.neutral_score,
                                            self.topology.reward_scale, self.mappa.train_truncated,
                                            c.standardize_task_type, self.mappa.norm_scope, self.mappa.outcome_score,
                                            algo.dynamic_filtering_range if algo.dynamic_filtering_enable else None)
            kept, dropped = self.batch_rule([a for ep in own for a in ep.actions if a.reward is not None], step)
            batch = self.experiences(ag, kept) if kept else []
            return {"counts": counts, "kept": kept, "dropped": dropped, "batch": batch, "coach_wait": t0 - t_start,
                    "experience": time.time() - t0}

        def advantages(made: dict) -> None:  # each trained action's record shows its row's mean advantage
            batches = {name: m["batch"] for name, m in made.items() if m["batch"]}
            advantage_of = rewards.compute_advantages(batches, kl_coef, self.mappa.norm_scope, algo.advantage.gamma,
                                                      std_norm=not algo.advantage.no_std_norm)
            for name, advantage_B in advantage_of.items():
                # Each row's action, by upstream's index into the rows given: token budgets regroup them.
                rows = [i for exp in batches[name] for i in exp.index]
                for i, adv in zip(rows, advantage_B):
                    made[name]["kept"][i].advantage = adv
                for exp in batches[name]:
                    exp.kl = None  # consumed by the advantages; OpenRLHF's actor does not read it

        def train(ag, m: dict) -> dict:  # agent k's experiences train agent k's actor, then go to its engines
            if m["batch"]:
                t0 = time.time()
                m["status"] = ag.trainer.train_step(m["batch"], step)[0]
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

    @staticmethod
    def experiences(ag, actions: list) -> list:
        """Agent ag's actions as OpenRLHF Experiences with its actor's and reference's log-probs and KL."""
        maker = ag.trainer.experience_maker
        return maker.make_experience(maker.split_rollout_samples([experience_of(a) for a in actions]))

    def verdicts_in(self, name: str, episodes: list, complete) -> None:
        """Wait until every verdict on agent `name`'s actions of the step is in; the rollout's error if it failed."""
        mine = [a for ep in episodes for a in ep.actions if self.owner[a.agent] == name]
        while not complete.done() and any(a.verdict is None for a in mine):
            time.sleep(0.02)  # the verdicts land on the rollout's thread (rollout.record_verdict)
        if complete.done():
            complete.result()

    def env_failures(self, step: int, episodes: list):
        """Say how many of the step's episodes ended with an exception in the environment; the message that stops
        the run when more did than --mappa.env.max_failure_fraction, else None."""
        failed = [ep for ep in episodes if ep.env_error]
        if not failed:  # contained by the rollout: each is a failed episode that trains nothing (rollout.run_episode)
            return None
        limit = self.mappa.env.max_failure_fraction
        said = (f"{len(failed)} of {len(episodes)} episodes ended with an exception in the environment (they "
                f"train nothing). First: {failed[0].env_error}")
        tqdm.write(f"[mappa] step {step}: {said}", file=console.err)
        if len(failed) / len(episodes) > limit:
            return (f"step {step}: {said}. That is more than --mappa.env.max_failure_fraction {limit:g} of them; the "
                    f"step's episodes are in {self.run_dir}/episodes.jsonl.")
        return None

    def stop_on_coach_failures(self, step: int, episodes: list, coach_metrics: dict):
        """Stop the run, keeping the step's episodes and metrics on disk, when more of its verdicts failed than
        --mappa.coach.max_failure_fraction. Agents whose verdicts came first have updated in memory; the run stops
        before the step's checkpoint, so a resume starts from the one before."""
        if self.scored:  # verdicts paid for but mostly failed: stop, even when only logged
            try:
                check_failures(episodes, coach_metrics, self.mappa.coach.max_failure_fraction)
            except CoachFailure as e:  # keep what the step produced, so the failures can be inspected
                self.write_episodes(episodes)
                self.log(step, coach_metrics)
                said = f"step {step}: {e} The step's episodes are in {self.run_dir}/episodes.jsonl."
                raise CoachFailure(said) from None

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

    def batch_rule(self, actions: list, step: int):
        """Keep a whole number of global train batches (train.batch_size) per agent and step.

        DeepSpeed's gradient accumulation is fixed by train.batch_size, and data-parallel ranks with
        unequal micro-batch counts deadlock in all-reduce. So an agent whose action count varies (a Code
        Executor acting once or twice) trains on floor(n / B) * B of its actions, picked at random with a
        seeded RNG, and skips the update when n < B. Dropped actions are counted in the metrics."""
        B = self.args.train.batch_size
        keep = (len(actions) // B) * B
        picked = random.Random(self.args.train.seed * 1000003 + step).sample(actions, keep) if keep else []
        return picked, len(actions) - keep

    def step_metrics(self, episodes, batches, status, dropped, counts, kl_coef) -> dict:
        c = self.mappa.coach
        m = {
            "outcome/success_rate": sum(ep.success for ep in episodes) / len(episodes),
            # episodes stopped by an agent's max_actions or max_episode_actions (failures; see rollout.py)
            "outcome/action_limit_episodes": sum(bool(ep.action_limit) for ep in episodes),
            # episodes ended by an exception in the environment (failures that train nothing; see rollout.py)
            "outcome/env_failed_episodes": sum(bool(ep.env_error) for ep in episodes),
            "coach/left_out": counts["left_out"],
            "reward_scale": self.topology.reward_scale,
            **({f"coach/fallback_{c.on_failure}": counts["fallback"]} if c.on_failure != "skip" else {}),
        }
        m.update(behaviour_metrics(episodes, [ag.spec.name for ag in self.agents]))
        for ag in self.agents:
            name = ag.spec.name
            scored = [a.verdict.score for ep in episodes for a in ep.actions
                      if a.agent == name and a.verdict and a.verdict.score is not None]  # fmt: skip
            p = f"agent/{name}/"
            m[p + "coach_score"] = sum(scored) / len(scored) if scored else None
            m[p + "outcome_success"] = m["outcome/success_rate"]
            m[p + "truncated_left_out"] = counts["truncated_left_out"].get(name, 0)
            if self.owner[name] != name:  # a shared policy's training metrics are under the first agent's name
                continue
            m[p + "trained_actions"] = sum(len(exp.sequences) for exp in batches.get(name, []))
            m[p + "dropped_for_batching"] = dropped[name]
            m[p + "updated"] = int(name in status)
            m[p + "kl_coef"] = kl_coef[name]
            if self.args.train.async_enable and counts["staleness"].get(name):  # in updates of its own weights
                lag = counts["staleness"][name]
                m.update({p + "staleness_mean": sum(lag) / len(lag), p + "staleness_max": max(lag),
                          p + "stale_left_out": counts["stale_left_out"].get(name, 0)})
            if self.args.algo.dynamic_filtering_enable:
                filtered, kept, groups = counts["filtered"].get(name, (0, 0, 0))
                m[p + "filtered_actions"] = filtered
                m[p + "dynamic_filtering_pass_rate"] = 100 * kept / groups if groups else None  # in %, as upstream
            if name in status:  # upstream's train status (all but its text sample), and a LoRA agent's sync sizes
                m.update({p + k: v for k, v in status[name].items() if isinstance(v, (int, float))})
                m.update({p + k: v for k, v in ag.trainer.synced.items()})
            if name in batches:
                m.update({p + k: v for k, v in rewards.logprob_mismatch(batches[name]).items()})
                if not self.args.algo.kl.use_loss:  # else the KL is the loss term, in upstream's status
                    m[p + "kl"] = torch.cat([exp.info["kl"] for exp in batches[name]]).mean().item()
        return m

    def evaluate(self, step: int):
        """Every --eval.dataset, n samples per task at --eval.temperature, on the current weights: one line
        per dataset in eval.jsonl (read by `mappa report`), the per-problem results in eval/, and the
        loggers' eval/ namespace."""
        ev, names = self.args.eval, [ag.spec.name for ag in self.agents]
        for dataset, tasks in self.eval_sets.items():
            workspace = os.path.join(self.run_dir, "workspaces", f"eval-{dataset}")
            total = len(tasks) * ev.n_samples_per_prompt
            with self.engines_awake(), tqdm(total=total, desc=f"evaluation {dataset}", unit="episode", leave=False,
                                            file=console.err) as bar:
                episodes = self.wait_for(evaluate(self.topology, tasks, self.eval_policies, ev.n_samples_per_prompt,
                                                  workspace, step, bar.update))
            summary, problems = summarize(episodes, names, tasks)
            os.makedirs(os.path.join(self.run_dir, "eval"), exist_ok=True)
            with open(os.path.join(self.run_dir, "eval", f"{dataset}-step{step}.json"), "w", encoding="utf-8") as f:
                json.dump({"step": step, "dataset": dataset, "summary": summary, "problems": problems}, f, indent=1)
            with open(os.path.join(self.run_dir, "eval.jsonl"), "a", encoding="utf-8") as f:
                f.write(json.dumps({"step": step, "dataset": dataset, **summary}) + "\n")
            for logger in self.loggers:
                logger.log_eval(step, {f"{dataset}/{k}": v for k, v in summary.items()})
            tqdm.write(f"[mappa] evaluation after step {step}\n{format_table({dataset: summary})}", file=console.err)

    def write_episodes(self, episodes: list):
        with open(os.path.join(self.run_dir, "episodes.jsonl"), "a", encoding="utf-8") as f:
            for ep in episodes:
                f.write(ep.to_json() + "\n")

    def write_syncs(self, step: int):
        """Each weight sync of this step's updates to syncs.jsonl: agent, the version it made, start and end."""
        with open(os.path.join(self.run_dir, "syncs.jsonl"), "a", encoding="utf-8") as f:
            for ag in self.trainees:
                for sync in ag.trainer.gate.log:
                    f.write(json.dumps({"step": step, "agent": ag.spec.name, **sync}) + "\n")
                ag.trainer.gate.log.clear()

    def log(self, step: int, metrics: dict):
        with open(os.path.join(self.run_dir, "metrics.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        clean = {k: v for k, v in metrics.items() if v is not None}
        for logger in self.loggers:
            logger.log_train(step, clean)

    def save_checkpoints(self, step: int):
        """OpenRLHF-style resumable checkpoints (and HF exports with --ckpt.save_hf), one directory per agent; then
        the team's marker, with the driver's state that resume() reads back."""
        refs = []
        for ag in self.trainees:
            refs += ag.actor.async_run_method(
                method_name="save_checkpoint", tag=f"global_step{step}", client_states={"global_step": step}
            )
        ray.get(refs)
        state = {"step": step, "coach_cost_usd": self.coach_cost_usd,
                 "kl_coef": {ag.spec.name: ag.trainer.kl_ctl.value for ag in self.trainees},  # adaptive KL moves it
                 "versions": {ag.spec.name: ag.trainer.gate.version for ag in self.trainees}}
        if self.topology.coach_stages:  # the template in use for the next step
            name = self.topology.coach_stages[self.stage].name
            state["coach_template"] = {"name": name, "since_step": self.stage_since}
        resume.write_marker(self.args.ckpt.path, state)
        for ag in self.trainees:  # only now: the marker names a step all agents saved
            resume.rotate_checkpoints(ag.args.ckpt.path, self.args.ckpt.max_num)
