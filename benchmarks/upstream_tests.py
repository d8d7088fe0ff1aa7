"""OpenRLHF's own unit tests against each upstream-candidate patch in patches/: does a patch break upstream?

For the pinned release with no patch and then with each patches/*.patch applied (tests/conftest.openrlhf_copy:
a copy of the installed package), copies the `tests/` folder of an OpenRLHF checkout beside it, applies the
patch's own change to those tests where it carries one (`<patch>.tests.diff`, the test hunk of the same pull
request), and runs them with the copy first on PYTHONPATH. Prints each test that does not pass, per copy, and
exits 1 when a test that passes unpatched fails with a patch. The wheel on PyPI ships no tests and CI reaches
no other host, so this runs by hand against a checkout (e.g. the v0.11.0 tag, the nearest to the pinned
0.11.2):

    git -C OpenRLHF archive v0.11.0 tests | tar -x -C /tmp/openrlhf-v0.11.0
    .venv/bin/python benchmarks/upstream_tests.py /tmp/openrlhf-v0.11.0/tests

The results are recorded in patches/__init__.py and benchmarks/README.md ("Upstream's tests").
"""

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from conftest import openrlhf_copy  # noqa: E402


def run_upstream_tests(tests: Path, patch: str | None, workdir: Path) -> dict:
    """{test id: outcome} for upstream's `tests` run against the installed openrlhf with `patch` applied."""
    copy = Path(openrlhf_copy(workdir, *([patch] if patch else [])))
    shutil.copytree(tests, copy / "tests")  # upstream's tests find the package at tests/../openrlhf
    test_change = ROOT / "patches" / (str(patch).removesuffix(".patch") + ".tests.diff")
    if patch and test_change.exists():
        subprocess.run(["patch", "-p1", "-i", str(test_change)], cwd=copy, check=True, capture_output=True)
    env = dict(os.environ, PYTHONPATH=str(copy), MAPPA_CPU_MODE="0", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", "tests"],
                          cwd=copy, env=env, capture_output=True, text=True, timeout=900)  # fmt: skip
    summary = re.findall(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) (\S+)", proc.stdout, re.M)
    return {test: outcome for outcome, test in summary}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("tests", type=Path, help="the tests/ folder of an OpenRLHF checkout")
    args = parser.parse_args()
    patches = sorted(p.name for p in (ROOT / "patches").glob("*.patch"))
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for patch in [None, *patches]:
            outcomes = run_upstream_tests(args.tests, patch, Path(tmp) / (patch or "unpatched"))
            results[patch] = outcomes
    stock = results.pop(None)
    print(f"unpatched: {sum(o == 'PASSED' for o in stock.values())} of {len(stock)} passed; not passing:")
    for test, outcome in sorted(stock.items()):
        if outcome != "PASSED":
            print(f"    {outcome} {test}")
    broken = 0
    for patch, outcomes in results.items():
        regressions = [test for test, outcome in outcomes.items() if outcome != "PASSED" == stock.get(test)]
        broken += len(regressions)
        passed = sum(o == "PASSED" for o in outcomes.values())
        print(f"{patch}: {passed} of {len(outcomes)} passed, {len(regressions)} that pass unpatched fail")
        for test in regressions:
            print(f"    {outcomes[test]} {test}")
    sys.exit(1 if broken else 0)


if __name__ == "__main__":
    main()
