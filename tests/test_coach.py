"""Coach backends against a real local HTTP server speaking OpenAI's chat-completions format, and the
offline heuristic coach."""

import asyncio
import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from openrlhf_mappa.coach import CoachRequest, build_coach, parse_score, render_prompt

TEMPLATE = (
    "Task: {task}\nRole: {role}\nOutput: {agent_output}\nFeedback: {feedback}\nTruth: {ground_truth}\nSCORE:"
)


class FakeOpenAI(BaseHTTPRequestHandler):
    """POST /v1/chat/completions; what it answers is set by the test in `server.reply`."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        headers = {k.lower(): v for k, v in self.headers.items()}  # httpx sends lower-case names
        self.server.seen.append({"path": self.path, "headers": headers, "body": body})
        reply = self.server.reply
        time.sleep(reply.get("delay", 0))
        status = reply.get("status", 200)
        if status == 200:
            payload = {
                "id": "chatcmpl-test",
                "object": "chat.completion",
                "created": 0,
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": reply.get("content", "")},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14},
            }
        else:
            payload = {"error": {"message": "server exploded", "type": "server_error"}}
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client already gave up (timeout test)

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    httpd.daemon_threads = True
    httpd.block_on_close = False
    httpd.seen, httpd.reply = [], {}
    threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def make_request(**overrides):
    fields = dict(
        episode_id="ep0",
        agent="verifier",
        turn=0,
        role="You verify the solution and give the final answer.",
        task="What is 3 * 6?",
        task_type="math",
        agent_input="Solver says 18.",
        agent_output="The answer is \\boxed{18}.",
        feedback="",
    )
    fields.update(overrides)
    return CoachRequest(**fields)


def openai_score(server, reply, request=None, **kwargs):
    server.reply = reply
    kwargs.setdefault("timeout_s", 5.0)
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"

    async def run():
        coach = build_coach("openai", model="coach-model", base_url=url, template=TEMPLATE, **kwargs)
        try:
            return await coach.score(request or make_request())
        finally:
            await coach.aclose()

    return asyncio.run(run())


def test_openai_score_parses(server):
    v = openai_score(server, {"content": "Good reasoning.\nSCORE: 8.5"})
    assert (v.status, v.score, v.coach) == ("ok", 8.5, "openai:coach-model")
    assert (v.tokens_in, v.tokens_out) == (11, 3)
    assert v.latency_s > 0


def test_openai_garbage_is_parse_error(server):
    v = openai_score(server, {"content": "I think it is pretty good overall."})
    assert (v.status, v.score) == ("parse_error", None)
    assert "pretty good" in v.rationale


def test_openai_out_of_range_is_parse_error(server):
    v = openai_score(server, {"content": "SCORE: 11"})
    assert (v.status, v.score) == ("parse_error", None)


def test_openai_empty_content_is_parse_error(server):
    v = openai_score(server, {"content": ""})
    assert (v.status, v.score) == ("parse_error", None)


def test_openai_http_500_is_api_error(server):
    v = openai_score(server, {"status": 500})
    assert (v.status, v.score) == ("api_error", None)
    assert len(server.seen) == 1  # max_retries=0: one failed call, one verdict


def test_openai_slow_server_is_timeout(server):
    v = openai_score(server, {"delay": 1.0, "content": "SCORE: 9"}, timeout_s=0.2)
    assert (v.status, v.score) == ("timeout", None)


def test_openai_connection_refused_is_api_error():
    with socket.socket() as s:  # a port that was free a moment ago, so nothing listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    class Closed:
        server_address = ("127.0.0.1", port)
        reply = {}

    v = openai_score(Closed, {})
    assert (v.status, v.score) == ("api_error", None)


def test_openai_request_carries_prompt_model_and_key(server, monkeypatch):
    monkeypatch.setenv("MY_COACH_KEY", "sk-test-123")
    request = make_request(feedback="stdout:\n18")
    openai_score(server, {"content": "SCORE: 7"}, request=request, api_key_env="MY_COACH_KEY")
    seen = server.seen[-1]
    assert seen["path"] == "/v1/chat/completions"
    assert seen["headers"]["authorization"] == "Bearer sk-test-123"
    assert seen["body"]["model"] == "coach-model"
    assert seen["body"]["temperature"] == 0
    prompt = seen["body"]["messages"][0]["content"]
    assert prompt == render_prompt(TEMPLATE, request)
    for text in ("What is 3 * 6?", "You verify the solution", "\\boxed{18}", "stdout:\n18", "(not available)"):
        assert text in prompt


def test_parse_score():
    assert parse_score("reasoning...\nSCORE: 7") == 7.0
    assert parse_score("process_score: 3.5") == 3.5
    assert parse_score("SCORE: 2 at first, but on reflection SCORE: 6") == 6.0
    assert parse_score("PROCESS_SCORE: **10**") == 10.0
    assert parse_score("SCORE: -1") is None
    assert parse_score("SCORE: 10.5") is None
    assert parse_score("no score here, 7/10") is None
    assert parse_score("") is None


def test_render_prompt_fields_and_unknown_field():
    request = make_request(feedback="", ground_truth="18")
    assert render_prompt("{feedback}|{ground_truth}|{turn}", request) == "(none)|18|0"
    with pytest.raises(ValueError, match=r"\{answer\}.*agent_output"):
        render_prompt("Answer: {answer}", request)


def test_build_coach_errors():
    with pytest.raises(ValueError, match="--mappa.coach.model"):
        build_coach("openai", base_url="http://x/v1", template=TEMPLATE)
    with pytest.raises(ValueError, match="--mappa.coach.base_url.*--mappa.coach.template"):
        build_coach("openai", model="m")
    with pytest.raises(ValueError, match="heuristic, openai"):
        build_coach("gpt4")
    with pytest.raises(ValueError, match="unknown field"):  # a bad template fails when the coach is built
        build_coach("openai", model="m", base_url="http://x/v1", template="{nope}")


def heuristic_score(**overrides):
    return asyncio.run(build_coach("heuristic").score(make_request(**overrides)))


def test_heuristic_correct_boxed_answer_is_10():
    v = heuristic_score(agent_output="So 3*6 = \\boxed{18.0}", ground_truth="18")
    assert (v.status, v.score, v.coach) == ("ok", 10.0, "heuristic")
    assert "heuristic" in v.rationale and "answer rule" in v.rationale


def test_heuristic_nested_boxed_fraction():
    v = heuristic_score(agent_output="First \\boxed{3}, no wait: \\boxed{\\frac{1}{2}}", ground_truth="0.5")
    assert v.score == 10.0
    assert "\\frac{1}{2}" in v.rationale
    assert heuristic_score(agent_output="$\\boxed{\\dfrac{2}{4}}$", ground_truth="1/2").score == 10.0


def test_heuristic_wrong_answer_scores_lower():
    right = heuristic_score(agent_output="\\boxed{18}", ground_truth="18")
    wrong = heuristic_score(agent_output="\\boxed{19}", ground_truth="18")
    unanswered = heuristic_score(agent_output="I am not sure.", ground_truth="18")
    assert right.score > wrong.score > unanswered.score


def test_heuristic_tool_feedback():
    role = "You write Python code in ```python blocks to compute the answer."
    code = "```python\nprint(3 * 6)\n```"
    ran = heuristic_score(role=role, agent_output=code, feedback="stdout:\n18")
    crashed = heuristic_score(
        role=role,
        agent_output=code,
        feedback="[exit code 1]\nstderr:\nTraceback (most recent call last):\n  File ...\nNameError: name 'x'",
    )
    timed_out = heuristic_score(role=role, agent_output=code, feedback="[timed out]")
    no_code = heuristic_score(role=role, agent_output="The answer is 18.", runs_code=True)
    assert ran.score > crashed.score > no_code.score
    # the code rule follows what the agent does (runs_code), not words in its role text
    assert heuristic_score(role=role, agent_output="The answer is 18.").score > no_code.score
    assert timed_out.score == crashed.score
    metric_printed = heuristic_score(role=role, agent_output=code, feedback="stdout:\nmean squared error: 0.3")
    assert metric_printed.score == ran.score  # "error" in a metric name is not a failure


def test_heuristic_reasonableness_varies_and_is_deterministic():
    role = "You draft the reasoning."
    short = heuristic_score(role=role, agent_output="Multiply.")
    numeric = heuristic_score(role=role, agent_output="Multiply 3 by 6.")
    long = heuristic_score(role=role, agent_output="Multiply 3 by 6, " + "carefully " * 150)
    empty = heuristic_score(role=role, agent_output="   ")
    assert empty.score < short.score < numeric.score < long.score <= 6.9
    # the readability bonus separates outputs the rules alone would tie (an untrained model's bytes)
    garbled = heuristic_score(role=role, agent_output="\u00e9\u00e8\u00ea\u00eb x")
    assert garbled.score < heuristic_score(role=role, agent_output="abcd x").score
    assert "readability" in garbled.rationale
    assert heuristic_score(role=role, agent_output="Multiply 3 by 6.") == numeric  # the whole verdict
