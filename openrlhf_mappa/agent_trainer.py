"""One agent's OpenRLHF trainer: MappaTrainer (trainer.py) runs the team's loop and hands each agent's
experiences to its AgentTrainer, whose train_step is OpenRLHF's own. LoRA agents share their base model's
engines (PoolEngine), train only their adapter (LoraActor), use their own actor with the adapter off as
reference, and sync the adapter alone, in PEFT format. Its own module because OpenRLHF's trainer loads
DeepSpeed and vLLM.
"""

import asyncio
import functools
import json
import os
import tempfile
from copy import deepcopy

import ray
import torch
from openrlhf.trainer.ppo_trainer import BasePPOTrainer
from openrlhf.trainer.ppo_utils.experience import Experience
from openrlhf.trainer.ppo_utils.experience_maker import RemoteExperienceMaker
from openrlhf.trainer.ray.ppo_actor import PolicyModelActor
from openrlhf.trainer.ray.vllm_engine import RolloutRayActor, batch_vllm_engine_call
from openrlhf.utils.seqlen_balancing import get_minimum_num_micro_batch_size, get_seqlen_balanced_partitions

from openrlhf_mappa.rollout import SyncGate


class MappaExperienceMaker(RemoteExperienceMaker):
    """OpenRLHF's experience maker for one agent, its forwards (log-probs, KL) unchanged."""

    def split_rollout_samples(self, rollout_samples):
        """Upstream's split, but with token budgets (--train.dynamic_batch_enable) its count of micro-batches,
        the fewest that hold --rollout.max_tokens_per_gpu each, is rounded up to a multiple of the
        data-parallel ranks where upstream rounds it down: its balanced split then put up to ~1.8x the budget
        in one at 8 ranks, more than the plan (placement.micro_tokens) holds. Never more micro-batches than
        samples."""
        a = self.args
        if not a.train.dynamic_batch_enable:
            return super().split_rollout_samples(rollout_samples)
        for i, sample in enumerate(rollout_samples):
            sample.index = [i]
        lengths = [int(s.total_length.item()) for s in rollout_samples]
        ring, tp = a.ds.ring_attn_size, a.ds.tensor_parallel_size
        ranks = a.actor.num_nodes * a.actor.num_gpus_per_node // ring // tp
        fewest = get_minimum_num_micro_batch_size(lengths, a.rollout.max_tokens_per_gpu, ring, tp)
        count = max(ranks, min(-(-fewest // ranks) * ranks, len(lengths) // ranks * ranks))
        return [Experience.concat_experiences([rollout_samples[i] for i in part], self.tokenizer.pad_token_id)
                for part in get_seqlen_balanced_partitions(lengths, count, False)]

    def make_experience_batch(self, experiences):
        # Already finished by rewards.compute_advantages: upstream's advantage hook sees one agent's rows
        # (scope global whitens the team's) and its group baseline breaks when an agent acts a varying number
        # of times.
        return experiences


class AgentTrainer(BasePPOTrainer):
    """OpenRLHF's trainer over one agent's actor, reference and engines; train_step runs as upstream's, and
    broadcast_to_vllm reaches this agent's engines only, through its gate (versions; async training waits for
    the agent's generations in flight or, with partial rollouts, pauses its engines). `adapter`: a LoRA
    agent's name, served by its pool."""

    def __init__(self, strategy, actor, ref, engines, tokenizer, adapter=None):
        super().__init__(strategy, actor, None, None, ref, engines, tokenizer)
        self.experience_maker = MappaExperienceMaker(actor, None, None, ref, self.kl_ctl, strategy, tokenizer)
        self.adapter, self.synced = adapter, {}  # synced: the last sync's bytes, and a full-model sync's
        self.gate = SyncGate()

    def broadcast_to_vllm(self):
        partial = self.args.train.partial_rollout_enable
        with self.gate.sync(wait=not partial):
            if partial:  # in-flight requests are kept, and finish on the new weights
                batch_vllm_engine_call(self.vllm_engines, "pause_generation")
            try:
                self.send_weights()
            finally:
                if partial:
                    batch_vllm_engine_call(self.vllm_engines, "resume_generation")

    def send_weights(self):
        if self.adapter is None:
            super().broadcast_to_vllm()
        else:  # OpenRLHF's sync sends every weight under peft's names, which vLLM rejects (OpenRLHF #1349)
            if self.args.vllm.enable_sleep:
                batch_vllm_engine_call(self.vllm_engines, "wake_up", tags=["weights"])
            files, base_params = next(
                r for r in ray.get(self.actor_model_group.async_run_method("adapter_files")) if r
            )
            ray.get([e.load_adapter.remote(self.adapter, files) for e in self.vllm_engines])
            self.synced = {
                "sync_mib": sum(map(len, files.values())) / 2**20,
                "full_sync_mib": 2 * base_params / 2**20,
            }
        if self.args.mappa.colocate == "team" and self.args.vllm.enable_sleep:
            # The next agent trains on the team's GPUs now. vLLM sleeps only a fully awake engine: the sync
            # woke the weights, the KV cache wakes before the sleep.
            batch_vllm_engine_call(self.vllm_engines, "wake_up", tags=["kv_cache"])
            batch_vllm_engine_call(self.vllm_engines, "sleep")


class AdapterOff:
    """A LoRA agent's reference group: its own actor ranks, forward with the adapter disabled (the base
    model), so no reference model is loaded."""

    def __init__(self, actor):
        self.actor = actor

    def async_run_method_batch(self, method_name, **kwargs):
        return self.actor.async_run_method_batch(
            {"forward": "forward_base"}.get(method_name, method_name), **kwargs
        )

    def async_run_method(self, method_name, *args, **kwargs):
        return self.actor.async_run_method(method_name, *args, **kwargs)


@ray.remote(num_gpus=1)
class LoraActor(PolicyModelActor.__ray_actor_class__):
    """A LoRA agent's actor rank: OpenRLHF's, its model wrapped by peft (--ds.lora.* in the agent's args)."""

    def init_model_from_pretrained(self, strategy, pretrain, max_steps=None, vllm_engines=None):
        if strategy.args.ds.load_in_4bit:
            # bitsandbytes adds each 4-bit weight's quantization constants to the state dict: DeepSpeed's
            # strict load refuses them on resume, and upstream's HF export asserts on them (its QLoRA
            # checkpoints fail so). The fresh 4-bit base rebuilds them alike, and an export needs the adapter
            # alone.
            strategy.load_ckpt = functools.partial(strategy.load_ckpt, load_module_strict=False)
            strategy.save_model = self.save_adapter
        # No weight-sync group with the engines: only the adapter travels, through Ray (adapter_files).
        super().init_model_from_pretrained(strategy, pretrain, max_steps, None)

    def forward_base(self, **kwargs):
        with self.actor.model.module.disable_adapter():
            return self.forward(**kwargs)

    def save_adapter(self, model, tokenizer, output_dir, **kwargs):
        """An HF export of the adapter alone, in PEFT format, with the model's config and tokenizer (what
        upstream's strategy.save_model writes for a LoRA actor). Every rank joins the gather; its callers wait
        for all ranks."""
        files = self.adapter_files()
        if files is not None:
            os.makedirs(output_dir, exist_ok=True)
            for name, data in files[0].items():
                with open(os.path.join(output_dir, name), "wb") as f:
                    f.write(data)
            self.actor.model.module.config.to_json_file(os.path.join(output_dir, "config.json"))
            tokenizer.save_pretrained(output_dir)

    def adapter_files(self):
        """On rank 0: the adapter's files as `save_pretrained` writes them (vLLM's loader takes those names)
        and the base model's parameter count; None on the other ranks, which join the ZeRO-3 gather."""
        import deepspeed
        from peft import get_peft_model_state_dict
        from safetensors.torch import save

        model = self.actor.model.module
        lora = [p for n, p in model.named_parameters() if "lora_" in n]
        with deepspeed.zero.GatheredParameters(lora, enabled=self.strategy.args.ds.zero_stage == 3):
            if torch.distributed.get_rank() != 0:
                return None
            tensors = {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}
        config = {
            k: sorted(v) if isinstance(v, set) else v
            for k, v in model.peft_config["default"].to_dict().items()
        }
        base = 0
        for n, p in model.named_parameters():
            # A 4-bit weight (QLoRA) packs two parameters a byte; its quant_state keeps the unpacked shape.
            if "lora_" not in n:
                base += (p.quant_state.shape.numel() if hasattr(p, "quant_state")
                         else getattr(p, "ds_numel", p.numel()))
        return {
            "adapter_model.safetensors": save(tensors),
            "adapter_config.json": json.dumps(config).encode(),
        }, base


@ray.remote
class PoolEngine(RolloutRayActor.__ray_actor_class__):
    """An engine of a LoRA pool (vLLM with enable_lora): the base model once, each agent's adapter by name.
    Every request carries an adapter: vLLM may compute one without, batched with LoRA requests, with an
    adapter's."""

    async def load_adapter(self, name: str, files: dict):
        """Replace (or add) adapter `name`, loaded in place from this engine's own directory, between steps;
        the prefix cache, keyed by adapter name, is reset."""
        from vllm.lora.request import LoRARequest

        if not hasattr(self, "adapters"):
            self.adapters, self.adapter_dir = {}, tempfile.mkdtemp(prefix="mappa-lora-")
        path = os.path.join(self.adapter_dir, name)
        os.makedirs(path, exist_ok=True)
        for file, data in files.items():
            with open(os.path.join(path, file), "wb") as f:
                f.write(data)
        lora_id = self.adapters[name].lora_int_id if name in self.adapters else len(self.adapters) + 1
        self.adapters[name] = LoRARequest(name, lora_id, path)
        await self.llm.add_lora(LoRARequest(name, lora_id, path, load_inplace=True))
        await self.llm.reset_prefix_cache()

    # vLLM's pause is a state, not a count: two agents of the pool syncing at once (partial rollouts, the
    # trainer's threads) would each pause and resume these engines, and the first to finish would lift the
    # other's pause in the middle of its sync. Engines pause at the first pauser and resume at the last; the
    # lock keeps a second pauser from going on before the first pause is done. (Ray runs an async actor's
    # calls on one event loop.) Made on first use, as `adapters`: Ray pickles the actor class, and a lock (or
    # functools.cached_property's own, on Python 3.11) cannot be pickled.
    pausers, pause_lock = 0, None

    async def pause_generation(self):
        self.pause_lock = self.pause_lock or asyncio.Lock()
        async with self.pause_lock:
            self.pausers += 1
            if self.pausers == 1:
                await super().pause_generation()

    async def resume_generation(self):
        async with self.pause_lock:
            self.pausers -= 1
            if self.pausers == 0:
                await super().resume_generation()

    async def generate_as(self, name: str, prompt_token_ids, sampling_params):
        """upstream's generate, with adapter `name`."""
        from vllm.inputs import TokensPrompt
        from vllm.utils import random_uuid

        final = None
        async for output in self.llm.generate(TokensPrompt(prompt_token_ids=prompt_token_ids),
                                              deepcopy(sampling_params), request_id=random_uuid(),
                                              lora_request=self.adapters[name]):
            final = output
        return final
