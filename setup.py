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
    install_requires=["openrlhf==0.11.2", "aiohttp", "pyyaml"],
    entry_points={"console_scripts": ["mappa=openrlhf_mappa.cli.mappa:main"]},
    cmdclass={"build_py": BuildPyWithPth},
)
