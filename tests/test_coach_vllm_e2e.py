"""An open-weight coach for real: vLLM's OpenAI-compatible server (`python -m vllm.entrypoints.openai.api_server`,
what `vllm serve` runs) on a tiny random model on CPU, scored through OpenAICoach.

A random tiny model answers garbage, so with structured output off every verdict must come back as a clean parse
error after its one re-prompt (never a score taken from the numbers the garbage holds, never an API error). vLLM
on CPU accepts the JSON-schema `response_format`, so with structured output on, the constrained replies must be
JSON (they start with "{") and the coach must keep asking for the schema.
"""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from openrlhf_mappa.coach import CoachRequest
from openrlhf_mappa.coach.openai_compat import OpenAICoach

TEMPLATE = "Judge this action of agent {agent} ({role}).\nOutput: {agent_output}\nEnd with PROCESS_SCORE: <0-10>."


@pytest.fixture
def vllm_coach_server(tiny_model, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "vllm.log", "w")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model, "--served-model-name",
           "tiny-coach", "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024", "--enforce-eager"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"))
    url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.time() + 300
        while True:
            try:
                urllib.request.urlopen(f"{url}/models", timeout=2)
                break
            except OSError:
                if proc.poll() is not None or time.time() > deadline:
                    pytest.fail(f"vLLM server did not come up; log:\n{(tmp_path / 'vllm.log').read_text()[-3000:]}")
                time.sleep(1)
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@pytest.mark.e2e
def test_vllm_served_tiny_coach_gives_clean_parse_errors(vllm_coach_server):
    requests = [CoachRequest(f"e{i}", "solver", 0, "Problem Solver", "2 + 2?", "math", "2 + 2?", f"It is {i}.", "")
                for i in range(4)]

    async def score(structured):
        coach = OpenAICoach(model="tiny-coach", base_url=vllm_coach_server, template=TEMPLATE,
                            structured=structured, max_tokens=48, timeout_s=120, max_retries=1, format_retries=1)
        try:
            return await asyncio.gather(*(coach.score(r) for r in requests)), coach.use_schema
        finally:
            await coach.aclose()

    for structured in ("auto", "off"):
        verdicts, schema_kept = asyncio.run(score(structured))
        for v in verdicts:
            assert v.status in ("ok", "parse_error"), v.rationale  # a real server: no API error, no timeout
            assert (v.status == "ok") == (v.score is not None) and v.tokens_in > 0 and v.tokens_out > 0
        if structured == "off":
            # Free text from a random model: a parse error each, after its one re-prompt, whatever numbers it holds.
            assert [(v.status, v.score, v.retries) for v in verdicts] == [("parse_error", None, 1)] * 4, verdicts
            assert all("last reply: " in v.rationale for v in verdicts)
        else:
            assert schema_kept  # vLLM took the schema: no fallback to text
            for v in verdicts:  # constrained to JSON: a score only where the JSON object carries one in range
                reply = v.rationale if v.status == "ok" else v.rationale.split("last reply: ", 1)[1]
                assert reply.lstrip("'\"").startswith("{"), v.rationale
                assert v.score is None or 0 <= v.score <= 10
