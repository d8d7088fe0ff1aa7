"""One agent's OpenRLHF trainer. MappaTrainer (trainer.py) runs the team's loop, rollout -> coach -> advantages,
and hands each agent's experiences to that agent's AgentTrainer, whose train_step is OpenRLHF's own.

A module of its own because importing OpenRLHF's trainer loads DeepSpeed and vLLM (seconds): the launcher's
checks before Ray, `mappa report` and the unit tests import trainer.py without paying for it.
"""

from openrlhf.trainer.ppo_trainer import BasePPOTrainer
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ray.vllm_engine import batch_vllm_engine_call


class MappaExperienceMaker(RemoteExperienceMaker):
    """OpenRLHF's experience maker for one agent. MappaTrainer uses its split into micro-batches and its actor
    and reference forwards (log-probs, KL) as they are."""

    def make_experience_batch(self, experiences):
        # MAPPA's rewards come per action from the coach, and its advantages span the team (--mappa.norm_scope
        # global): the team makes every agent's experiences and sets the advantages before train_step.
        return experiences


class AgentTrainer(BasePPOTrainer):
    """OpenRLHF's trainer over one agent's actor, reference and engines. train_step runs as upstream's: the
    experiences go to this agent's actor ranks; ppo_train fits them (with --ds.enable_sleep, reloading the
    actor's states before and offloading them after); broadcast_to_vllm sends the weights to this agent's
    engines only (with --vllm.enable_sleep, waking their weights first); the KL controller updates."""

    def __init__(self, strategy, actor, ref, engines, tokenizer):
        super().__init__(strategy, actor, None, None, ref, engines, tokenizer)
        self.experience_maker = MappaExperienceMaker(actor, None, None, ref, self.kl_ctl, strategy, tokenizer)

    def broadcast_to_vllm(self):
        super().broadcast_to_vllm()
        if self.args.mappa.colocate == "team" and self.args.vllm.enable_sleep:
            # On the team's GPUs the next agent trains now, so these engines go back to sleep. vLLM sleeps only
            # a fully awake engine: the sync woke the weights, the KV cache wakes before the sleep.
            batch_vllm_engine_call(self.vllm_engines, "wake_up", tags=["kv_cache"])
            batch_vllm_engine_call(self.vllm_engines, "sleep")
