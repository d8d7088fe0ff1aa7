"""What a run leaves in its run directory and its loggers: metrics.jsonl (and wandb, tensorboard),
episodes.jsonl, syncs.jsonl, eval.jsonl and eval/, all read back by `mappa report` and resume.py; each step's
metrics (step_metrics), assembled from the step's episodes and the agents' updates; and how each agent acts
(behaviour_metrics), which evaluations report too."""

import json
import os

import torch

from openrlhf_mappa import rewards


class RunLog:
    def __init__(self, args, run_dir: str):
        self.run_dir, self.loggers = run_dir, []
        os.makedirs(run_dir, exist_ok=True)
        if args.logger.wandb.key or args.logger.tensorboard_dir:
            from openrlhf.utils.logging_utils import TensorboardLogger, WandbLogger

            self.loggers = [cls(args) for cls, on in ((WandbLogger, args.logger.wandb.key),
                                                       (TensorboardLogger, args.logger.tensorboard_dir))
                            if on]

    def append(self, name: str, records: list):
        with open(os.path.join(self.run_dir, name), "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)

    def metrics(self, step: int, metrics: dict):
        self.append("metrics.jsonl", [{"step": step, **metrics}])
        clean = {k: v for k, v in metrics.items() if v is not None}
        for logger in self.loggers:
            logger.log_train(step, clean)

    def episodes(self, episodes: list):
        with open(os.path.join(self.run_dir, "episodes.jsonl"), "a", encoding="utf-8") as f:
            f.writelines(ep.to_json() + "\n" for ep in episodes)

    def syncs(self, step: int, trainees: list):
        """Each weight sync of this step's updates: agent, the version it made, start and end."""
        for ag in trainees:
            self.append(
                "syncs.jsonl", [{"step": step, "agent": ag.spec.name, **sync} for sync in ag.trainer.gate.log]
            )
            ag.trainer.gate.log.clear()

    def evaluation(self, step: int, dataset: str, summary: dict, problems: list, grader: str = None):
        """One line in eval.jsonl (read by `mappa report` and `mappa paper-table`, which heads `accuracy` with
        the environment's `grader`), the per-problem results in eval/, the loggers' eval/."""
        os.makedirs(os.path.join(self.run_dir, "eval"), exist_ok=True)
        with open(
            os.path.join(self.run_dir, "eval", f"{dataset}-step{step}.json"), "w", encoding="utf-8"
        ) as f:
            json.dump(
                {"step": step, "dataset": dataset, "summary": summary, "problems": problems}, f, indent=1
            )
        self.append("eval.jsonl", [{"step": step, "dataset": dataset, "grader": grader, **summary}])
        for logger in self.loggers:
            logger.log_eval(step, {f"{dataset}/{k}": v for k, v in summary.items()})

    def close(self):
        for logger in self.loggers:
            logger.close()


def step_metrics(args, topology, agents, owner, episodes, batches, status, dropped, counts, kl_coef) -> dict:
    """The step's outcome, coach and per-agent training metrics (topology.AGENT_METRICS names the per-agent
    keys). `owner`: who trains each agent's actions; batches, status, dropped: per trainee, from its
    update."""
    c = args.mappa.coach
    m = {
        "outcome/success_rate": sum(ep.success for ep in episodes) / len(episodes),
        # episodes stopped by an agent's max_actions or max_episode_actions (failures; see rollout.py)
        "outcome/action_limit_episodes": sum(bool(ep.action_limit) for ep in episodes),
        # episodes ended by an exception in the environment (failures that train nothing; see rollout.py)
        "outcome/env_failed_episodes": sum(bool(ep.env_error) for ep in episodes),
        "coach/left_out": counts["left_out"],
        "reward_scale": topology.reward_scale,
        **({f"coach/fallback_{c.on_failure}": counts["fallback"]} if c.on_failure != "skip" else {}),
    }
    m.update(behaviour_metrics(episodes, [ag.spec.name for ag in agents]))
    for ag in agents:
        name = ag.spec.name
        scored = [a.verdict.score for ep in episodes for a in ep.actions
                  if a.agent == name and a.verdict and a.verdict.score is not None]  # fmt: skip
        p = f"agent/{name}/"
        m[p + "coach_score"] = sum(scored) / len(scored) if scored else None
        m[p + "outcome_success"] = m["outcome/success_rate"]
        m[p + "truncated_left_out"] = counts["truncated_left_out"].get(name, 0)
        if owner[name] != name:  # a shared policy's training metrics are under the first agent's name
            continue
        m[p + "trained_actions"] = sum(len(exp.sequences) for exp in batches.get(name, []))
        m[p + "dropped_for_batching"] = dropped[name]
        # Rows in its batch at zero loss (--mappa.batch_semantics authors: truncated or unscored;
        # advantage 0).
        m[p + "zero_loss_rows"] = sum(a.zero_loss and a.advantage is not None
                                      for ep in episodes for a in ep.actions if owner[a.agent] == name)
        if name in counts.get("optimizer_steps", {}):  # since the run started, as MappaTrainer counts them
            m[p + "optimizer_steps"] = counts["optimizer_steps"][name]
        m[p + "updated"] = int(name in status)
        m[p + "kl_coef"] = kl_coef[name]
        if args.train.async_enable and counts["staleness"].get(name):  # in updates of its own weights
            lag = counts["staleness"][name]
            m.update({p + "staleness_mean": sum(lag) / len(lag), p + "staleness_max": max(lag),
                      p + "stale_left_out": counts["stale_left_out"].get(name, 0)})
        if args.algo.dynamic_filtering_enable:
            filtered, kept, groups = counts["filtered"].get(name, (0, 0, 0))
            m[p + "filtered_actions"] = filtered
            # in %, as upstream
            m[p + "dynamic_filtering_pass_rate"] = 100 * kept / groups if groups else None
        if name in status:  # upstream's train status (all but its text sample), and a LoRA agent's sync sizes
            m.update({p + k: v for k, v in status[name].items() if isinstance(v, (int, float))})
            m.update({p + k: v for k, v in ag.trainer.synced.items()})
        if name in batches:
            m.update({p + k: v for k, v in rewards.logprob_mismatch(batches[name]).items()})
            if not args.algo.kl.use_loss:  # else the KL is the loss term, in upstream's status
                m[p + "kl"] = torch.cat([exp.info["kl"] for exp in batches[name]]).mean().item()
    return m


def behaviour_metrics(episodes: list, agent_names: list) -> dict:
    """`agent/<name>/<metric>`: how each agent acts, whatever it is rewarded for. action_length in response
    tokens; tool_error_rate over all actions, code_error_rate over those whose code ran; prompt_truncated
    counts prompts that left history out, prompt_too_long_skipped actions not taken (Episode.skipped_actions);
    answer_format_rate only for agents that owe a final answer (MultiAgentEnv.answer_formatted)."""
    m = {}
    for name in agent_names:
        acts = [a for ep in episodes for a in ep.actions if a.agent == name]
        ran = [a for a in acts if a.feedback.ran]
        owed = [a.formatted for a in acts if a.formatted is not None]
        p = f"agent/{name}/"
        m[p + "num_actions"] = len(acts)
        m[p + "action_length"] = sum(len(a.response_ids) for a in acts) / len(acts) if acts else None
        m[p + "tool_use_rate"] = len(ran) / len(acts) if acts else None
        m[p + "tool_error_rate"] = sum(a.feedback.error for a in acts) / len(acts) if acts else None
        m[p + "code_error_rate"] = sum(a.feedback.error for a in ran) / len(ran) if ran else None
        m[p + "truncated_rate"] = sum(a.truncated for a in acts) / len(acts) if acts else None
        m[p + "prompt_truncated"] = sum(a.prompt_truncated for a in acts)
        skipped = [s for ep in episodes for s in ep.skipped_actions if s["agent"] == name]
        m[p + "prompt_too_long_skipped"] = len(skipped)
        if owed:
            m[p + "answer_format_rate"] = sum(owed) / len(owed)
    return m
