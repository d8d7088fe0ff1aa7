import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAPPA = os.path.join(os.path.dirname(sys.executable), "mappa")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A tiny model built by the real `mappa tiny-model` console script."""
    out = str(tmp_path_factory.mktemp("models") / "tiny")
    subprocess.run([MAPPA, "tiny-model", out, "--seed", "0"], check=True, capture_output=True, timeout=300)
    return out
