"""openrlhf_mappa: MAPPA (per-action coach rewards for multi-agent teams) on OpenRLHF.

GPU clusters: `pip install -r requirements.txt && pip install .`
CPU machines (tests, demo, laptops): `make install` (pinned stack in requirements-cpu.txt).
"""

import os

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildPyWithPth(build_py):
    """Ship openrlhf_mappa_cpu.pth at the top of site-packages: it installs the import hook that turns
    on the CPU patches in every Python process (Ray workers, vLLM engines) when no CUDA device exists;
    on a CUDA machine the hook changes nothing."""

    def run(self):
        super().run()
        self.copy_file("openrlhf_mappa_cpu.pth", os.path.join(self.build_lib, "openrlhf_mappa_cpu.pth"))


setup(
    name="openrlhf_mappa",
    version="0.1.0",
    description="MAPPA: multi-agent finetuning with per-action process rewards from an AI coach, on OpenRLHF",
    packages=find_packages(include=["openrlhf_mappa", "openrlhf_mappa.*"]) + ["openrlhf_mappa.patches"],
    package_dir={"openrlhf_mappa.patches": "patches"},
    package_data={"openrlhf_mappa": ["data/*"]},
    python_requires=">=3.10",
    # Everything MAPPA imports itself (tests/test_launch.py checks it against the source), though OpenRLHF
    # already requires some: a dependency used directly is declared directly. vLLM comes with OpenRLHF's extra.
    install_requires=[
        "openrlhf[vllm]==0.11.2", "torch", "transformers", "tokenizers", "huggingface-hub", "ray[default]", "einops",
        "tqdm", "aiohttp", "yarl", "pyyaml", "numpy", "pandas", "scikit-learn", "math-verify", "deepspeed", "peft",
        "safetensors", "scipy", "matplotlib",
    ],
    entry_points={"console_scripts": ["mappa=openrlhf_mappa.tools.mappa:main"]},
    cmdclass={"build_py": BuildPyWithPth},
)
