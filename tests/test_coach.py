"""Coach backends against a real local HTTP server speaking OpenAI's chat-completions format (it stands in
for a paid API and injects faults: 429 with Retry-After, 5xx, hangs, malformed bodies, bad scores), the verdict
cache, and the offline heuristic coach."""

import asyncio
import base64
import dataclasses
import json
import os
import socket
import sqlite3
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from openrlhf_mappa.coach import CoachRequest, build_coach, openai_compat, render_prompt
from openrlhf_mappa.coach.cache import VerdictCache
from openrlhf_mappa.coach.heuristic import HeuristicCoach
from openrlhf_mappa.coach.openai_compat import OpenAICoach
from openrlhf_mappa.episode import ToolFeedback, Verdict
from openrlhf_mappa.rollout import AgentPolicy

TEMPLATE = (
    "Task: {task}\nRole: {role}\nOutput: {agent_output}\nFeedback: {feedback}\nTruth: {ground_truth}\nPROCESS_SCORE:"
)


class FaultyOpenAI(BaseHTTPRequestHandler):
    """POST /v1/chat/completions. Replies come from `server.scripts[marker]` for a request whose body holds that
    marker (a list per request, whatever else is in flight), else from `server.script` (a list consumed one per
    request), then `server.reply` forever. A reply is a dict: content, status, headers, hang (seconds), raw (bytes body),
    refuse_schema (answer 400 when the request has a response_format). GET /v1/models answers
    `server.models`: a dict of status, body (JSON-able) and hang."""

    def do_GET(self):
        headers = {k.lower(): v for k, v in self.headers.items()}
        with self.server.lock:
            self.server.seen.append({"path": self.path, "headers": headers, "body": None, "t": time.monotonic()})
        time.sleep(self.server.models.get("hang", 0))
        data = json.dumps(self.server.models.get("body", {})).encode()
        try:
            self.send_response(self.server.models.get("status", 200))
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client already gave up (timeout tests)

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        headers = {k.lower(): v for k, v in self.headers.items()}  # header names are case-insensitive
        with self.server.lock:
            self.server.seen.append({"path": self.path, "headers": headers, "body": body, "t": time.monotonic()})
            own = next((replies for marker, replies in self.server.scripts.items() if marker in json.dumps(body)), None)
            reply = own.pop(0) if own else self.server.script.pop(0) if self.server.script else self.server.reply
            self.server.in_flight += 1
            self.server.max_in_flight = max(self.server.max_in_flight, self.server.in_flight)
        try:
            time.sleep(reply.get("hang", 0) + self.server.delay_s)
            status, extra_headers = reply.get("status", 200), reply.get("headers", {})
            if reply.get("refuse_schema") and "response_format" in body:
                status, reply = 400, {"error": "response_format json_schema is not supported by this model"}
            if "raw" in reply:
                data = reply["raw"]
            elif status == 200:
                message = {"role": "assistant", "content": reply.get("content", "")}
                data = json.dumps({
                    "id": "chatcmpl-test", "object": "chat.completion", "created": 0, "model": body["model"],
                    "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                    "usage": {"prompt_tokens": 11, "completion_tokens": 3, "total_tokens": 14},
                }).encode()
            else:
                text = reply.get("error", f"injected {status}")
                data = json.dumps({"error": {"message": text, "type": "server_error"}}).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            for k, v in extra_headers.items():
                self.send_header(k, v)
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client already gave up (timeout tests)
        finally:
            with self.server.lock:
                self.server.in_flight -= 1

    def do_CONNECT(self):  # as a forward proxy for an https coach: record the tunnel request, then refuse it
        with self.server.lock:
            headers = {k.lower(): v for k, v in self.headers.items()}
            self.server.seen.append({"path": self.path, "headers": headers, "body": None, "t": time.monotonic()})
        self.send_response(502)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), FaultyOpenAI)
    httpd.daemon_threads = True
    httpd.block_on_close = False
    httpd.seen, httpd.script, httpd.scripts, httpd.reply, httpd.delay_s = [], [], {}, {}, 0.0
    httpd.models = {"body": {"object": "list", "data": [{"id": "coach-model", "object": "model"}]}}
    httpd.lock, httpd.in_flight, httpd.max_in_flight = threading.Lock(), 0, 0
    httpd.url = f"http://127.0.0.1:{httpd.server_address[1]}/v1"
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


def make_coach(url, **kwargs):
    # Short backoff so retry tests take fractions of a second; the schedule itself is tested separately.
    kwargs = dict(dict(timeout_s=5.0, backoff_s=0.01, max_backoff_s=0.05, template=TEMPLATE), **kwargs)
    cache = VerdictCache(kwargs.pop("cache_path", None))  # memory, and SQLite where a path is given
    return OpenAICoach(model="coach-model", base_url=url, cache=cache, **kwargs)


def score_all(url, requests, **kwargs):
    async def run():
        coach = make_coach(url, **kwargs)
        try:
            return await asyncio.gather(*(coach.score(r) for r in requests))
        finally:
            await coach.aclose()

    return asyncio.run(run())


def openai_score(server, reply, script=(), request=None, **kwargs):
    server.reply, server.script = reply, list(script)
    return score_all(server.url, [request or make_request()], **kwargs)[0]


def test_openai_score_parses(server):
    v = openai_score(server, {"content": "Good reasoning.\nPROCESS_SCORE: 8.5"})
    assert (v.status, v.score, v.coach, v.retries) == ("ok", 8.5, "openai:coach-model", 0)
    assert (v.tokens_in, v.tokens_out) == (11, 3)
    assert v.latency_s > 0
    assert len(server.seen) == 1


@pytest.mark.parametrize("content, score", [
    ("PROCESS_SCORE: 7", 7.0), ("7/10", 7.0), ("**7**", 7.0), ("7.5", 7.5), ('{"score": 7, "rationale": "ok"}', 7.0),
    ('{"rationale": "fine", "score": 9.5}', 9.5), ("**PROCESS_SCORE:** 3", 3.0), ("process_score = 0", 0.0),
    ('```json\n{"rationale": "r", "score": 10}\n```', 10.0),
])
def test_openai_text_formats(server, content, score):
    # the three sources of a score (JSON, the key line, a bare number) through the client; the adversarial
    # corpus is in tests/test_score_parsing.py
    v = openai_score(server, {"content": content})
    assert (v.status, v.score) == ("ok", score)


@pytest.mark.parametrize("content", [
    "I think it is pretty good overall.", "PROCESS_SCORE: 11", "PROCESS_SCORE: -2", '{"score": 12}',
    '{"score": "high"}', "", "I would rate it 4 out of 10.", "Score: 3",
])
def test_openai_unscorable_reply_is_parse_error_after_bounded_reprompts(server, content):
    v = openai_score(server, {"content": content}, format_retries=2)
    assert (v.status, v.score) == ("parse_error", None)
    assert len(server.seen) == 3 and v.retries == 2  # the first reply + 2 re-prompts, then give up
    assert repr(content)[1:-1][:40] in v.rationale


def test_openai_reprompt_recovers_with_a_reminder(server):
    v = openai_score(server, {"content": "PROCESS_SCORE: 6"}, script=[{"content": "Looks solid to me."}])
    assert (v.status, v.score, v.retries) == ("ok", 6.0, 1)
    first, second = (r["body"]["messages"] for r in server.seen)
    # The same prompt plus a reminder; the unscorable reply is not sent back (it could overflow the context).
    assert len(second) == 1 and second[0]["content"].startswith(first[0]["content"])
    assert "`PROCESS_SCORE: <number from 0 to 10>`" in second[0]["content"].removeprefix(first[0]["content"])


def test_openai_prose_from_a_server_ignoring_the_schema_is_a_parse_error(server):
    # The server ignores response_format and answers prose full of numbers that are not the score, and not
    # the topology's key line even when reminded of it: no number is picked from it, and no score recorded.
    prose = ("The F1 score is 0.81 and 3 of 4 steps ran.\nStep 2: I'd say 7/10 for the code but 3/10 for the "
             "plan, so PROCESS_SCORE: 6 - a flawless action would score 10.\nSomewhere between 6 and 8.")
    v = openai_score(server, {"content": prose}, score_key="GRADE", format_retries=2)
    assert (v.status, v.score, v.retries, len(server.seen)) == ("parse_error", None, 2, 3)
    assert all("response_format" in r["body"] for r in server.seen)  # asked for the schema, got prose
    assert "no valid score in [0, 10] after 3 replies" in v.rationale and "F1 score is 0.81" in v.rationale
    prompt = server.seen[0]["body"]["messages"][0]["content"]
    for seen in server.seen[1:]:
        reminder = seen["body"]["messages"][0]["content"].removeprefix(prompt)
        assert "`GRADE: <number from 0 to 10>`" in reminder and "PROCESS_SCORE" not in reminder
    # the same coach takes the key it was given, and only that key
    assert openai_score(server, {"content": "Sound.\nGrade: 8"}, score_key="GRADE").score == 8.0
    with pytest.raises(ValueError, match="score key 'PROCESS SCORE'"):
        make_coach(server.url, score_key="PROCESS SCORE")


def test_openai_429_honours_retry_after(server, monkeypatch):
    sleeps, sleep = [], asyncio.sleep  # the waits the coach asks for, recorded on their way to the real sleep

    async def recorded(delay, *args, **kwargs):
        sleeps.append(delay)
        return await sleep(delay, *args, **kwargs)

    monkeypatch.setattr(asyncio, "sleep", recorded)
    script = [{"status": 429, "headers": {"Retry-After": "0.6"}}]
    v = openai_score(server, {"content": "PROCESS_SCORE: 7"}, script=script, backoff_s=0.01)
    assert (v.status, v.score, v.retries) == ("ok", 7.0, 1)
    assert [d for d in sleeps if d] == [pytest.approx(0.63, abs=0.031)]  # what the server asked (+ up to 10%), not 0.01 s


def test_openai_5xx_is_retried_then_succeeds(server):
    script = [{"status": 500}, {"status": 503}, {"status": 502}]
    v = openai_score(server, {"content": "PROCESS_SCORE: 4"}, script=script, max_retries=3)
    assert (v.status, v.score, v.retries) == ("ok", 4.0, 3)


def test_openai_persistent_500_is_api_error_within_the_retry_bound(server):
    v = openai_score(server, {"status": 500}, max_retries=2)
    assert (v.status, v.score) == ("api_error", None)
    assert len(server.seen) == 3 and v.retries == 2
    assert "after 3 attempts" in v.rationale


def test_openai_non_retryable_status_fails_at_once(server):
    v = openai_score(server, {"status": 401}, max_retries=4)
    assert (v.status, v.score, len(server.seen)) == ("api_error", None, 1)


def test_openai_hang_past_the_timeout_is_timeout(server):
    v = openai_score(server, {"hang": 3.0, "content": "PROCESS_SCORE: 9"}, timeout_s=0.3, max_retries=1)
    assert (v.status, v.score) == ("timeout", None)
    assert len(server.seen) == 2  # one retry, then the verdict


def test_openai_malformed_json_body_is_api_error(server):
    v = openai_score(server, {"raw": b'{"choices": [ {"message": '}, max_retries=1)
    assert (v.status, v.score) == ("api_error", None)


def test_openai_connection_refused_is_api_error():
    with socket.socket() as s:  # a port that was free a moment ago, so nothing listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    v = score_all(f"http://127.0.0.1:{port}/v1", [make_request()], max_retries=1)[0]
    assert (v.status, v.score, v.retries) == ("api_error", None, 1)


def test_openai_structured_output_auto_falls_back_to_text(server):
    server.reply = {"content": "PROCESS_SCORE: 5", "refuse_schema": True}
    verdicts = score_all(server.url, [make_request(turn=i) for i in range(3)], max_concurrency=1)
    assert [(v.status, v.score) for v in verdicts] == [("ok", 5.0)] * 3
    with_schema = [r for r in server.seen if "response_format" in r["body"]]
    assert len(with_schema) == 1  # refused once, then the coach stopped asking for the schema
    assert with_schema[0]["body"]["response_format"]["json_schema"]["schema"]["required"] == ["rationale", "score"]


def test_openai_other_400_is_final_and_keeps_the_schema(server):
    # A 400 that is not about the schema (here: context length) must neither be retried nor turn it off.
    server.reply = {"status": 400, "error": "This model's maximum context length is 2048 tokens."}
    v = openai_score(server, server.reply)
    assert (v.status, v.score, len(server.seen)) == ("api_error", None, 1)
    assert "maximum context length" in v.rationale and "response_format" in server.seen[0]["body"]


def test_openai_max_tokens_is_sent_when_set(server):
    openai_score(server, {"content": "PROCESS_SCORE: 5"}, max_tokens=64)
    openai_score(server, {"content": "PROCESS_SCORE: 5"})
    assert server.seen[0]["body"]["max_tokens"] == 64 and "max_tokens" not in server.seen[1]["body"]


def test_openai_structured_output_forced_and_refused_is_api_error(server):
    v = openai_score(server, {"content": "PROCESS_SCORE: 5", "refuse_schema": True}, structured="json_schema")
    assert (v.status, v.score, len(server.seen)) == ("api_error", None, 1)
    v = openai_score(server, {"content": "PROCESS_SCORE: 5"}, structured="off")
    assert v.score == 5.0 and "response_format" not in server.seen[-1]["body"]


def test_openai_concurrency_and_rate_limits(server, monkeypatch):
    server.reply, server.delay_s = {"content": "PROCESS_SCORE: 1"}, 0.2
    verdicts = score_all(server.url, [make_request(turn=i) for i in range(6)], max_concurrency=2)
    assert all(v.status == "ok" for v in verdicts) and server.max_in_flight == 2
    server.seen.clear()
    server.delay_s = 0.0
    # The pacing read on a clock held still, its waits recorded rather than slept: each start takes the next slot,
    # 60/rpm = 0.2 s after the one before, whatever this machine's speed (no duration is measured).
    waits, sleep = [], asyncio.sleep
    clock = types.SimpleNamespace(monotonic=lambda: 1000.0, perf_counter=time.perf_counter, time=time.time)

    async def recorded(delay, *args):
        waits.append(delay)
        await sleep(0)

    monkeypatch.setattr(openai_compat, "time", clock)
    monkeypatch.setattr(openai_compat, "asyncio", types.SimpleNamespace(**dict(vars(asyncio), sleep=recorded)))
    score_all(server.url, [make_request(turn=i) for i in range(4)], rpm=300)
    assert sorted(waits) == pytest.approx([0.0, 0.2, 0.4, 0.6]) and len(server.seen) == 4


def test_openai_mixed_faults_never_invent_a_score(server):
    # 24 concurrent requests, each meeting its own faults in its own order (scripted per request, so that the
    # interleaving cannot change what one sees): each ends in the verdict its faults call for, with a score only
    # where the server sent one in range, after exactly the calls its retry bounds allow (max_retries 2 per reply,
    # format_retries 1), each retry counted.
    r500, r429, not_json = {"status": 500}, {"status": 429, "headers": {"Retry-After": "0"}}, {"raw": b"nope"}
    prose, out_of_range, three = {"content": "no idea"}, {"content": "PROCESS_SCORE: 42"}, {"content": "PROCESS_SCORE: 3"}
    cases = [  # the server's replies to one request, in order; its verdict's status and score
        ([three], "ok", 3.0),
        ([r500, r429, three], "ok", 3.0),
        ([r500, r500, r500], "api_error", None),  # 1 + max_retries calls, all failed
        ([not_json, not_json, not_json], "api_error", None),
        ([prose, three], "ok", 3.0),  # re-prompted once
        ([out_of_range, prose], "parse_error", None),  # out of range is no score, and no reason to look further
        ([prose, r429, r500, three], "ok", 3.0),  # the re-prompt's reply retried twice
        ([out_of_range, r500, r500, r500], "api_error", None),
    ] * 3
    server.scripts, server.reply = {f"[case {i:02d}]": list(replies) for i, (replies, _, _) in enumerate(cases)}, {"status": 401}
    requests = [make_request(turn=i, agent_output=f"The answer is 18. [case {i:02d}]") for i in range(len(cases))]
    verdicts = score_all(server.url, requests, max_retries=2, format_retries=1)
    calls = [sum(f"[case {i:02d}]" in json.dumps(r["body"]) for r in server.seen) for i in range(len(cases))]
    assert [(v.status, v.score) for v in verdicts] == [(status, score) for _, status, score in cases]
    assert calls == [len(replies) for replies, _, _ in cases]  # every scripted reply used, none more
    assert [v.retries for v in verdicts] == [n - 1 for n in calls]


def test_backoff_schedule_is_jittered_exponential_and_capped():
    coach = make_coach("http://127.0.0.1:9/v1", backoff_s=1.0, max_backoff_s=5.0)
    err = RuntimeError("x")
    for attempt, cap in ((1, 1.0), (2, 2.0), (3, 4.0), (6, 5.0)):
        waits = [coach.backoff(attempt, err) for _ in range(50)]
        assert all(cap * 0.5 <= w <= cap for w in waits) and len(set(waits)) > 1


def test_request_carries_prompt_model_and_key(server, monkeypatch):
    monkeypatch.setenv("MY_COACH_KEY", "sk-test-123")
    request = make_request(feedback="stdout:\n18")
    openai_score(server, {"content": "PROCESS_SCORE: 7"}, request=request, api_key_env="MY_COACH_KEY")
    seen = server.seen[-1]
    assert seen["path"] == "/v1/chat/completions"
    assert seen["headers"]["authorization"] == "Bearer sk-test-123"
    assert seen["body"]["model"] == "coach-model"
    assert seen["body"]["temperature"] == 0
    prompt = seen["body"]["messages"][0]["content"]
    assert prompt == render_prompt(TEMPLATE, request)
    for text in ("What is 3 * 6?", "You verify the solution", "\\boxed{18}", "stdout:\n18", "(not available)"):
        assert text in prompt


def test_verdict_cache_pays_once_across_restarts(server, tmp_path):
    server.reply = {"content": "PROCESS_SCORE: 8"}
    path = str(tmp_path / "cache.sqlite")
    first = score_all(server.url, [make_request(episode_id="run1")], cache_path=path)[0]
    # A new coach on the same file (a resumed run): same request in another episode -> no HTTP call.
    again = score_all(server.url, [make_request(episode_id="run2")], cache_path=path)[0]
    assert (first.cached, again.cached, again.score, len(server.seen)) == (False, True, 8.0, 1)
    # Anything the coach would see differently is a different key: output, template, model.
    score_all(server.url, [make_request(agent_output="other")], cache_path=path)
    assert len(server.seen) == 2
    prompt = render_prompt(TEMPLATE, make_request())
    assert VerdictCache.key("openai:a", prompt) != VerdictCache.key("openai:b", prompt)
    assert VerdictCache.key("openai:a", prompt) != VerdictCache.key("openai:a", render_prompt("x {task}", make_request()))
    assert len(VerdictCache(path)) == 2


def test_verdict_cache_never_stores_failures(server, tmp_path):
    path = str(tmp_path / "cache.sqlite")
    openai_score(server, {"status": 500}, max_retries=0, cache_path=path)
    v = openai_score(server, {"content": "PROCESS_SCORE: 2"}, cache_path=path)
    assert (v.status, v.score, v.cached, len(server.seen)) == ("ok", 2.0, False, 2)


def test_verdict_cache_reaches_disk_while_the_run_goes_on(server, tmp_path):
    # Verdicts are written in batches: without any close, a verdict reaches the disk by the flush scheduled FLUSH_S
    # seconds after it, so a run killed hard afterwards keeps it.
    server.reply, path = {"content": "PROCESS_SCORE: 6"}, str(tmp_path / "cache.sqlite")

    async def run():
        coach = make_coach(server.url, cache_path=path)
        # Awaits the flush the event loop schedules FLUSH_S after the verdict, then its write on the writer thread.
        scheduled, flush = asyncio.get_running_loop().create_future(), coach.cache.flush

        def first_flush_noted():
            write = flush()
            if not scheduled.done():
                scheduled.set_result(write)
            return write

        coach.cache.flush = first_flush_noted
        await coach.score(make_request())
        await asyncio.wrap_future(await asyncio.wait_for(scheduled, 60))
        rows = sqlite3.connect(path).execute("SELECT verdict FROM verdicts").fetchall()
        await coach.aclose()
        return rows

    rows = asyncio.run(run())
    assert len(rows) == 1 and json.loads(rows[0][0])["score"] == 6.0


def test_verdict_cache_write_failure_is_reported_not_fatal(tmp_path, caplog):
    # The file loses its table under the run (as a disk could vanish): the write fails on the writer thread,
    # the error is logged with the count, and the verdict is still served from memory.
    from openrlhf_mappa.episode import Verdict

    path = str(tmp_path / "cache.sqlite")
    cache = VerdictCache(path)
    other = sqlite3.connect(path)
    other.execute("DROP TABLE verdicts")
    other.close()
    verdict = Verdict(score=4.0, status="ok", rationale="PROCESS_SCORE: 4", coach="openai:m")
    cache.put("k", verdict)  # no event loop: handed to the writer at once
    cache.close()
    assert "could not write 1 verdicts" in caplog.text
    assert cache.get("k") == verdict


def test_proxy_from_the_environment_is_honoured(server, monkeypatch):
    # The fault server stands in for a forward proxy: a proxied request names the absolute URL of the coach.
    server.reply = {"content": "PROCESS_SCORE: 5"}
    monkeypatch.setenv("MY_COACH_KEY", "sk-test-123")
    proxy = f"alice:s3cret@127.0.0.1:{server.server_address[1]}"
    monkeypatch.setenv("HTTP_PROXY", f"http://{proxy}")
    monkeypatch.setenv("HTTPS_PROXY", f"http://{proxy}")
    monkeypatch.delenv("NO_PROXY", raising=False)
    monkeypatch.delenv("no_proxy", raising=False)
    basic = "Basic " + base64.b64encode(b"alice:s3cret").decode()
    v = score_all("http://coach.invalid:8000/v1", [make_request()], api_key_env="MY_COACH_KEY")[0]
    seen = server.seen[-1]
    assert (v.status, seen["path"]) == ("ok", "http://coach.invalid:8000/v1/chat/completions")
    assert (seen["headers"]["proxy-authorization"], seen["headers"]["authorization"]) == (basic, "Bearer sk-test-123")
    # An https coach is reached through a CONNECT tunnel: the proxy gets its own credentials, never the key.
    v = score_all("https://coach.invalid/v1", [make_request()], api_key_env="MY_COACH_KEY", max_retries=0)[0]
    seen = server.seen[-1]
    assert (v.status, v.score, seen["path"]) == ("api_error", None, "coach.invalid:443")
    assert seen["headers"]["proxy-authorization"] == basic and "sk-test-123" not in json.dumps(seen["headers"])
    # NO_PROXY: straight to the server, even with a proxy that would refuse the connection.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{dead}")
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    server.seen.clear()
    v = score_all(server.url, [make_request()], max_retries=0)[0]
    assert (v.status, server.seen[-1]["path"]) == ("ok", "/v1/chat/completions")


def test_probe_of_a_reachable_server_leaves_nothing_bound_to_its_loop(server, monkeypatch, caplog):
    monkeypatch.setenv("MY_COACH_KEY", "sk-test-123")
    server.reply = {"content": "PROCESS_SCORE: 7"}
    coach = make_coach(server.url, api_key_env="MY_COACH_KEY")
    asyncio.run(coach.probe())  # as the training CLI runs it: before, and outside, the loop of the verdicts
    seen = server.seen[-1]
    assert (seen["path"], seen["headers"]["authorization"]) == ("/v1/models", "Bearer sk-test-123")
    assert coach.session is None and "does not list" not in caplog.text

    async def run():
        try:
            return await coach.score(make_request())
        finally:
            await coach.aclose()

    v = asyncio.run(run())  # a new loop: the coach opens its own session there
    assert (v.status, v.score) == ("ok", 7.0) and coach.session is None


@pytest.mark.parametrize("models", [
    {"status": 404, "body": {"error": "not found"}},  # a server without a model listing
    {"status": 500},
    {"body": {"object": "list", "data": "not a list"}},
])
def test_probe_any_other_answer_means_reachable(server, models):
    server.models = models
    asyncio.run(make_coach(server.url).probe())
    assert server.seen[-1]["path"] == "/v1/models"


def test_probe_warns_when_the_model_is_not_listed(server, caplog):
    server.models = {"body": {"object": "list", "data": [{"id": "llama-3-8b"}, {"id": "qwen3-4b"}]}}
    asyncio.run(make_coach(server.url).probe())  # a warning, not a refusal: routers serve unlisted models
    assert f"coach server {server.url}/models does not list model 'coach-model'" in caplog.text
    assert "it lists: llama-3-8b, qwen3-4b" in caplog.text


@pytest.mark.parametrize("status", [401, 403])
def test_probe_refused_key_names_the_env_var(server, monkeypatch, status):
    monkeypatch.delenv("MY_COACH_KEY", raising=False)
    server.models = {"status": status, "body": {"error": {"message": "Invalid API key"}}}
    with pytest.raises(ValueError) as err:
        asyncio.run(make_coach(server.url, api_key_env="MY_COACH_KEY").probe())
    message = str(err.value)
    assert f"coach server {server.url}/models refused the API key (HTTP {status}" in message
    assert "Invalid API key" in message and "$MY_COACH_KEY, which is NOT set" in message


def test_probe_unreachable_server_raises(server):
    with socket.socket() as s:  # a port that was free a moment ago, so nothing listens on it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    with pytest.raises(ValueError, match=f"coach server {url}/models cannot be reached: ClientConnectorError"):
        asyncio.run(make_coach(url).probe())
    # The probe waits no longer than a request would (here 0.3 s): a server answering after 2 s times it out.
    server.models = {"hang": 2.0}
    with pytest.raises(ValueError, match=f"coach server {server.url}/models cannot be reached: .*Timeout"):
        asyncio.run(make_coach(server.url, timeout_s=0.3).probe())


def test_render_prompt_fields_and_unknown_field():
    request = make_request(feedback="", ground_truth="18")
    assert render_prompt("{feedback}|{ground_truth}|{turn}", request) == "(none)|18|0"
    # Fields are checked where a template is read (the topology, a tool's template file), once.
    from openrlhf_mappa.topology import PROMPT_FIELDS, check_template

    with pytest.raises(ValueError, match=r"^t.txt: unknown field \{answer\}; allowed fields: task, role,.*agent_output"):
        check_template("Answer: {answer}", PROMPT_FIELDS, "t.txt")


@pytest.mark.parametrize("topology_file", ["mathchat.yaml", "dsbench.yaml", "mathchat_own_rubric.yaml",
                                           "dsbench_own_rubric.yaml"])
def test_shipped_rubrics_invent_no_score(server, topology_file):
    """The shipped coach prompts (the authors' criteria; the earlier rubrics) through the client: a coach that
    answers prose full of numbers and the authors' outcome key alone gets no score; the authors' two-key reply
    trains on PROCESS_SCORE only (their outcome weight 0)."""
    from openrlhf_mappa.team import load_topology

    topology = load_topology(os.path.join(os.path.dirname(__file__), "..", "examples", "configs", topology_file))
    hostile = ("Files: 3 of 4 saved. Accuracy 0.85, so the cap is 9; I'd say 7/10 for the code and 3/10 for the "
               "plan.\nANSWER_CORRECT: 1")
    v = openai_score(server, {"content": hostile}, request=make_request(ground_truth="18"), format_retries=1,
                     template=topology.coach_template, score_key=topology.score_key)
    assert (v.status, v.score, len(server.seen)) == ("parse_error", None, 2)
    prompt = server.seen[0]["body"]["messages"][0]["content"]
    assert "The answer is \\boxed{18}." in prompt and "18" in prompt and "PROCESS_SCORE" in prompt
    v = openai_score(server, {"content": "The synthesis is right.\nPROCESS_SCORE: 6\nANSWER_CORRECT: 1"},
                     template=topology.coach_template, score_key=topology.score_key)
    assert (v.status, v.score) == ("ok", 6.0)


@pytest.mark.parametrize("recipe, model", [("train_mappa_mathchat.sh", "gemini-2.5-flash"),
                                           ("train_mappa_dsbench.sh", "gemini-2.5-pro")])
@pytest.mark.parametrize("reasoning_field", [False, True])
def test_the_recipes_coach_scores_the_verdict_after_a_reasoning_coachs_thinking(recipe, model, reasoning_field,
                                                                                 tmp_path):
    """The GPU scripts' coach (run for real; their flags through the real parser and build_coach), pointed at a
    reasoning coach on 127.0.0.1 that ignores any schema and weighs a score of 9 in its reasoning: the verdict
    after the reasoning is the score (4), and a reply whose only score line is in its reasoning is a parse error,
    never 9. The reasoning comes in a <think> block of the reply, or apart (`reasoning_content`). The request
    is free text (no response_format) at temperature 0, to the authors' coach model by default."""
    from coach_server import COACH_TEMPLATE, CoachServer
    from conftest import REPO, submit_script
    from openrlhf_mappa.cli.train_mappa_ray import parse_args
    from openrlhf_mappa.team import load_topology

    thinking = "The code runs, so PROCESS_SCORE: 9 at first sight; but it never checks the answer."
    with CoachServer(mute={"silent"}, reasoning=thinking, reasoning_field=reasoning_field) as server:
        submitted, _ = submit_script(os.path.join(REPO, "examples", "scripts", recipe), tmp_path,
                                     MAPPA_COACH_BASE_URL=server.base_url, MAPPA_COACH_MODEL="")
        args = parse_args(submitted[submitted.index("openrlhf_mappa.cli.train_mappa_ray") + 1:])
        topology = load_topology(os.path.join(REPO, args.mappa.topology))
        requests = [make_request(agent="verifier", agent_output="abcd"), make_request(agent="silent")]

        async def run():  # the template: the rule server's, which says whom to mute and what to score
            coach = build_coach(args.mappa.coach, template=COACH_TEMPLATE, score_key=topology.score_key,
                                review_template=topology.review_template)
            try:
                return await asyncio.gather(*(coach.score(r) for r in requests))
            finally:
                await coach.aclose()

        scored, unscored = asyncio.run(run())
    assert (scored.status, scored.score) == ("ok", 4.0)  # "abcd": 4 distinct characters, the rule server's score
    assert (unscored.status, unscored.score) == ("parse_error", None)
    assert len(server.requests) == 1 + 1 + args.mappa.coach.format_retries  # the silent one re-prompted, in vain
    bodies = [r["body"] for r in server.requests]
    assert [("response_format" in b, b["temperature"], b["model"]) for b in bodies] == [(False, 0, model)] * 4


def test_build_coach_errors():
    from openrlhf_mappa.cli.train_mappa_ray import coach_flags

    flags = lambda **given: types.SimpleNamespace(**{**coach_flags()[0], "kind": "openai", **given})
    with pytest.raises(ValueError, match="--mappa.coach.model"):
        build_coach(flags(base_url="http://x/v1"), template=TEMPLATE)
    with pytest.raises(ValueError, match="coach kind 'openai' needs --mappa.coach.base_url$"):
        build_coach(flags(model="m"))  # no template: a coach that only reviews episodes may have none
    # A bad template is refused where it is read (topology.check_template: test_topology_env, test_bad_input).


def heuristic_score(**overrides):
    return asyncio.run(HeuristicCoach().score(make_request(**overrides)))


def mathchat_grade(output: str, answer: str = "18", feedback=None):
    """MathChatEnv's grade of its last agent's reply, as the rollout puts it in the coach request."""
    from openrlhf_mappa.envs.mathchat import MathChatEnv
    from openrlhf_mappa.topology import AgentSpec, Topology

    agent = AgentSpec(name="verifier", model="m", role="r", prompt="{task}")
    topology = Topology(name="t", env="mathchat", agents=[agent], coach_template="{agent_output}")
    env = MathChatEnv(topology, {"prompt": "What is 3 * 6?", "answer": answer}, "/nonexistent")
    return env.judge(agent, output, feedback or ToolFeedback(), None)


def math_score(output: str, answer: str = "18"):
    return heuristic_score(agent_output=output, ground_truth=answer, env_grade=mathchat_grade(output, answer))


def test_heuristic_correct_boxed_answer_is_10():
    v = math_score("So 3*6 = \\boxed{18.0}")
    assert (v.status, v.score, v.coach) == ("ok", 10.0, "heuristic")
    assert "heuristic" in v.rationale and "answer rule" in v.rationale


def test_heuristic_nested_boxed_fraction():
    v = math_score("First \\boxed{3}, no wait: \\boxed{\\frac{1}{2}}", "0.5")
    assert v.score == 10.0
    assert "\\frac{1}{2}" in v.rationale
    assert math_score("$\\boxed{\\dfrac{2}{4}}$", "1/2").score == 10.0


def test_heuristic_wrong_answer_scores_lower():
    right, wrong, unanswered = math_score("\\boxed{18}"), math_score("\\boxed{19}"), math_score("I am not sure.")
    assert right.score > wrong.score > unanswered.score
    assert (wrong.score, unanswered.score) == (2.9, 0.9)  # 2 and 0, + 0.9 for all-readable text


def test_heuristic_reads_no_ground_truth_text():
    # The ground truth is text for an LLM coach (DSBench's contract lines, the relay's goal, an answer): the
    # offline coach takes the environment's grade instead, and parses no prose another room writes.
    plain = heuristic_score(agent_output="x7")
    for text in ("7", "Required reply: \\d", "Missing inputs (earlier): none\nMissing outputs (own): model.pkl"):
        assert heuristic_score(agent_output="x7", ground_truth=text) == plain
    # MathChat leaves a code run to the coach's tool rule; a grade given is taken as it is
    assert mathchat_grade("\\boxed{18}", feedback=ToolFeedback(stdout="18", exit_code=0)) is None
    assert heuristic_score(agent_output="\\boxed{18}", env_grade=(10.0, "env", False)).score == 10.0


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


class ScriptedPolicy:
    """Stands in for an agent's vLLM engine (the rollout's only model-dependent part) with a fixed reply,
    so the rollout, the environment and the coach client run for real without loading a model."""

    def __init__(self, reply):
        from openrlhf_mappa.rollout import SyncGate

        self.reply, self.tokenizer, self.gate = reply, self, SyncGate()

    sample = AgentPolicy.sample  # generate() behind the gate, as the real one

    def prompt_ids(self, messages, keep_reasoning=False):
        return messages[-1]["content"], [1, 2, 3], False

    async def generate(self, prompt_ids):
        return [4, 5], False, []

    def decode(self, ids, skip_special_tokens=True):
        return self.reply


def test_a_step_with_too_many_failed_verdicts_stops(server, tmp_path):
    from openrlhf_mappa.coach.audit import CoachFailure, check_failures, coach_step_metrics
    from openrlhf_mappa.rollout import rollout
    from openrlhf_mappa.team import load_topology

    (tmp_path / "t.yaml").write_text(
        "name: t\nenv: mathchat\ncoach_template: 'Output: {agent_output} PROCESS_SCORE:'\nagents:\n"
        + "".join(f"  - {{name: {n}, model: unused, role: r, prompt: '{{task}}'}}\n" for n in ("solver", "verifier"))
    )
    topology = load_topology(str(tmp_path / "t.yaml"))
    policies = {"solver": ScriptedPolicy("It is 4."), "verifier": ScriptedPolicy("\\boxed{4}")}
    server.script = [{"status": 500}] * 4 + [{"content": "PROCESS_SCORE: 6"}] * 4  # 8 verdicts, in any order
    tasks = [{"id": str(i), "prompt": "2 + 2?", "answer": "4"} for i in range(4)]

    async def run():
        coach = OpenAICoach(model="m", base_url=server.url, template=topology.coach_template, max_retries=0)
        try:
            return await rollout(topology, tasks, policies, coach, str(tmp_path / "ws"), step=1)
        finally:
            await coach.aclose()

    episodes = asyncio.run(run())
    m = coach_step_metrics(episodes)
    assert (m["coach/verdicts_api_error"], m["coach/verdicts_ok"], m["coach/failure_fraction"]) == (4, 4, 0.5)
    assert all(ep.success for ep in episodes)
    check_failures(episodes, m, max_fraction=0.5)  # exactly at the limit: the step trains
    with pytest.raises(CoachFailure, match="50% of the coach's verdicts failed.*'api_error': 4.*injected 500"):
        check_failures(episodes, m, max_fraction=0.4)


@pytest.fixture
def saved_run(tmp_path):
    """A run's episodes.jsonl (5 episodes of solver + verifier judged by the heuristic coach, the last line cut
    off as by a kill), the coach_server template in template.txt, and the `mappa` command's environment."""
    from coach_server import COACH_TEMPLATE
    from conftest import REPO
    from openrlhf_mappa.rollout import rollout
    from openrlhf_mappa.team import load_topology

    (tmp_path / "t.yaml").write_text(
        "name: t\nenv: mathchat\ncoach_template: 'Output: {agent_output} PROCESS_SCORE:'\nagents:\n"
        + "".join(f"  - {{name: {n}, model: unused, role: r, prompt: '{{task}}'}}\n" for n in ("solver", "verifier"))
    )
    topology = load_topology(str(tmp_path / "t.yaml"))
    replies = ["It is 4.", "Maybe 5?", "\\boxed{4}", "\\boxed{5}", "I think 4, since 2+2 = 4."]
    episodes = []
    for i, reply in enumerate(replies):  # a run's episodes.jsonl, judged by the heuristic coach
        policies = {"solver": ScriptedPolicy(reply), "verifier": ScriptedPolicy(replies[-1 - i])}
        task = [{"id": str(i), "prompt": "2 + 2?", "answer": "4"}]
        episodes += asyncio.run(rollout(topology, task, policies, HeuristicCoach(), str(tmp_path / "ws"), 1))
    path = tmp_path / "episodes.jsonl"
    lines = [ep.to_json() for ep in episodes]
    path.write_text("\n".join(lines) + "\n" + lines[0][:50])  # the last line cut off, as by a kill
    (tmp_path / "template.txt").write_text(COACH_TEMPLATE)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    return path, lines, env


def mappa_coach_score(path, out, url, *flags, env):
    import subprocess

    from conftest import MAPPA

    cmd = [MAPPA, "coach", "score", "--episodes", str(path), "--out", str(out), "--mappa.coach.model", "judge-2",
           "--mappa.coach.base_url", url, "--mappa.coach.structured", "off", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def test_mappa_coach_score_rescores_saved_episodes(saved_run, tmp_path):
    from coach_server import CoachServer

    path, lines, env = saved_run
    out = tmp_path / "rescored.jsonl"
    template = ("--template", str(tmp_path / "template.txt"))
    with CoachServer(mute={"verifier"}) as server:  # scores the solver, answers garbage for the verifier
        proc = mappa_coach_score(path, out, server.base_url, *template, env=env)
        # half the verdicts failed: at the default --mappa.coach.max_failure_fraction 0.5 that passes, above 0.4 not
        strict = mappa_coach_score(path, tmp_path / "strict.jsonl", server.base_url, *template,
                                   "--mappa.coach.max_failure_fraction", "0.4", env=env)
    assert proc.returncode == 0, proc.stderr
    assert strict.returncode == 1 and (tmp_path / "strict.jsonl.summary.json").exists()
    assert "5 of 10 verdicts failed (more than --mappa.coach.max_failure_fraction 0.4)" in strict.stderr
    assert "line 6 is cut off" in proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 10
    for row in rows:
        assert row["before"]["coach"] == "heuristic" and row["before"]["status"] == "ok"
        assert row["after"]["coach"] == "openai:judge-2"
        if row["agent"] == "solver":
            assert row["after"]["status"] == "ok" and row["after"]["score"] is not None
        else:
            assert (row["after"]["status"], row["after"]["score"]) == ("parse_error", None)
    summary = json.loads((tmp_path / "rescored.jsonl.summary.json").read_text())
    solver = [r for r in rows if r["agent"] == "solver"]
    diffs = [r["after"]["score"] - r["before"]["score"] for r in solver]
    assert summary["solver"]["both_scored"] == 5 and summary["verifier"]["both_scored"] == 0
    assert summary["solver"]["mean_diff_after_minus_before"] == pytest.approx(sum(diffs) / 5)
    assert summary["verifier"]["after_statuses"] == {"parse_error": 5}
    assert "agreement of openai:judge-2 (after) with heuristic (before)" in proc.stdout

    path.write_text(lines[0] + "\n{broken\n" + lines[1] + "\n")
    proc = mappa_coach_score(path, out, "http://127.0.0.1:9/v1", *template, env=env)
    assert proc.returncode != 0 and "episodes.jsonl: line 2: broken JSON" in proc.stderr


def test_mappa_coach_score_fails_when_most_verdicts_fail(saved_run, tmp_path):
    # A coach answering garbage: every verdict fails, the command says so and why, and writes its files.
    from coach_server import COACH_TEMPLATE, CoachServer

    path, _, env = saved_run
    out = tmp_path / "rescored.jsonl"
    with CoachServer(mute={"solver", "verifier"}) as server:
        proc = mappa_coach_score(path, out, server.base_url, "--template", str(tmp_path / "template.txt"), env=env)
    assert proc.returncode == 1
    assert "10 of 10 verdicts failed (more than --mappa.coach.max_failure_fraction 0.5)" in proc.stderr
    first_failure = proc.stderr.split("First failure: ", 1)[1]
    assert first_failure.startswith("parse_error: ") and "no valid score in [0, 10] after 3 replies" in first_failure
    assert "I refuse to grade this." in first_failure
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["after"]["status"] for r in rows] == ["parse_error"] * 10
    assert json.loads((tmp_path / "rescored.jsonl.summary.json").read_text())["all"]["after_statuses"] == {"parse_error": 10}

    # The key comes from --topology: a coach stating PROCESS_SCORE lines fails a topology that asks for GRADE,
    # unless --score-key overrides it.
    topology = {"name": "t", "env": "mathchat", "coach_template": COACH_TEMPLATE, "score_key": "GRADE",
                "agents": [{"name": "solver", "model": "unused", "role": "r", "prompt": "{task}"}]}
    (tmp_path / "grade.yaml").write_text(json.dumps(topology))
    with CoachServer() as server:
        by_topology = mappa_coach_score(path, out, server.base_url, "--mappa.topology", str(tmp_path / "grade.yaml"),
                                        env=env)
        overridden = mappa_coach_score(path, out, server.base_url, "--mappa.topology", str(tmp_path / "grade.yaml"),
                                       "--score-key", "PROCESS_SCORE", env=env)
    assert by_topology.returncode == 1 and "10 of 10 verdicts failed" in by_topology.stderr
    assert "last reply: 'Looks fine.\\nPROCESS_SCORE: " in by_topology.stderr
    assert overridden.returncode == 0, overridden.stderr


def test_mappa_coach_score_asks_for_coach_template_only_where_it_sends_it(saved_run, tmp_path):
    # A topology without coach_template: a hindsight re-score sends one review per episode and needs none; a
    # per-action re-score would send it with every action, and is refused before any request, naming the file.
    from coach_server import ACTION_BLOCK, CoachServer

    path, _, env = saved_run
    topology = tmp_path / "no_template.yaml"
    topology.write_text("name: t\nenv: mathchat\nagents:\n  - {name: solver, model: unused, role: r, prompt: '{task}'}\n")
    out = tmp_path / "rescored.jsonl"
    with CoachServer() as server:
        hindsight = mappa_coach_score(path, out, server.base_url, "--mappa.topology", str(topology),
                                      "--mappa.coach.mode", "hindsight", env=env)
        per_action = mappa_coach_score(path, tmp_path / "per_action.jsonl", server.base_url, "--mappa.topology",
                                       str(topology), env=env)
        reviews = [r for r in server.requests if ACTION_BLOCK.search(r["prompt"])]
    assert hindsight.returncode == 0, hindsight.stderr
    assert len(reviews) == len(server.requests) == 5  # one review per saved episode, nothing else sent
    assert {json.loads(line)["after"]["source"] for line in out.read_text().splitlines()} == {"hindsight"}
    assert per_action.returncode == 1 and not (tmp_path / "per_action.jsonl").exists()
    assert (f"mappa coach score: {topology}: 'coach_template' is missing or empty; it must be a non-empty string (or "
            f"give coach_templates): coach mode per_action sends it to the coach with every action") in per_action.stderr


# --- Hindsight: one review per finished episode (--mappa.coach.mode hindsight | both) ---

def episode_requests():
    """A 3-action episode: a solver's draft, a code run that failed, a verifier's (wrong) boxed answer."""
    return [
        make_request(agent="solver", role="You draft the reasoning.", agent_output="Multiply 3 by 6."),
        make_request(agent="coder", role="You run Python.", agent_output="```python\nprint(x)\n```", runs_code=True,
                     feedback="[exit code 1]\nstderr:\nNameError: name 'x' is not defined"),
        make_request(agent="verifier", agent_output="\\boxed{19}", ground_truth="18"),
    ]


def judge(url, mode, replies, script=(), outcome=None, **kwargs):
    """judge_episode over episode_requests() with a coach at `url` (server replies set by the caller)."""
    from openrlhf_mappa.coach import judge_episode

    async def run():
        coach = make_coach(url, **kwargs)
        try:
            requests = episode_requests()
            pending = [asyncio.ensure_future(coach.score(r)) for r in requests] if mode != "hindsight" else []
            return await judge_episode(coach, mode, requests, outcome or {"success": False}, pending)
        finally:
            await coach.aclose()

    return asyncio.run(run())


REVIEW = {"content": json.dumps({"rationale": "the code broke it", "responsible": 2,
                                 "actions": [{"id": 1, "score": 6}, {"id": 2, "score": 1}, {"id": 3, "score": 4}]})}


def test_openai_review_is_one_request_per_episode_with_the_whole_trajectory(server):
    server.reply = REVIEW
    verdicts, parts, review = judge(server.url, "hindsight", REVIEW)
    assert len(server.seen) == 1  # one request for three actions
    assert (review.status, review.scores, review.responsible, review.rationale) == ("ok", [6.0, 1.0, 4.0], 1, "the code broke it")
    assert (review.tokens_in, review.tokens_out, review.coach) == (11, 3, "openai:coach-model")
    assert [v.score for v in verdicts] == [6.0, 1.0, 4.0] and parts == [{}, {}, {}]
    assert {v.source for v in verdicts} == {"hindsight"} and {v.tokens_in for v in verdicts} == {0}  # cost: the review's
    assert all("action 2 of 3 held responsible" in v.rationale for v in verdicts)
    body = server.seen[0]["body"]
    assert body["response_format"]["json_schema"]["name"] == "coach_review"
    prompt = body["messages"][0]["content"]
    # every agent's input, output and tool feedback, the ground truth, and the outcome
    for text in ("=== Action 1 of 3: agent solver", "Multiply 3 by 6.", "=== Action 2 of 3: agent coder",
                 "NameError: name 'x'", "\\boxed{19}", "Ground truth for this action: 18", "Solver says 18.",
                 '{"success": false}', "each action id from 1 to 3"):
        assert text in prompt, text


def test_a_hindsight_coach_needs_no_per_action_template(server):
    server.reply = REVIEW
    verdicts, _, review = judge(server.url, "hindsight", REVIEW, template=None)  # the topology gave no coach_template
    assert (review.status, [v.score for v in verdicts], len(server.seen)) == ("ok", [6.0, 1.0, 4.0], 1)


@pytest.mark.parametrize("content", [
    json.dumps({"rationale": "r", "responsible": 1, "actions": [{"id": 1, "score": 6}, {"id": 2, "score": 1}]}),
    json.dumps({"rationale": "r", "responsible": 1, "actions": [{"id": 1, "score": 6}, {"id": 1, "score": 1}, {"id": 3, "score": 4}]}),
    json.dumps({"rationale": "r", "responsible": 1, "actions": [{"id": 1, "score": 6}, {"id": 2, "score": 12}, {"id": 3, "score": 4}]}),
    "Action 2 broke it: I give it 1/10, the others 6 and 4.",
])
def test_openai_review_that_does_not_match_the_actions_gives_no_score_to_any(server, content):
    server.reply = {"content": content}
    verdicts, _, review = judge(server.url, "hindsight", None, format_retries=1)
    assert (review.status, review.scores, review.responsible, review.retries) == ("parse_error", None, None, 1)
    assert len(server.seen) == 2  # the reply and one re-prompt
    assert "no valid review of the 3 actions after 2 replies" in review.rationale
    assert [(v.status, v.score) for v in verdicts] == [("parse_error", None)] * 3
    reminder = server.seen[1]["body"]["messages"][0]["content"].removeprefix(server.seen[0]["body"]["messages"][0]["content"])
    assert "for each action id from 1 to 3" in reminder


def test_openai_review_reprompt_recovers(server):
    server.reply, server.script = REVIEW, [{"content": "Looks like action 2."}]
    _, _, review = judge(server.url, "hindsight", None)
    assert (review.status, review.scores, review.retries, len(server.seen)) == ("ok", [6.0, 1.0, 4.0], 1, 2)


def test_openai_review_api_failure_is_its_status_for_every_action(server):
    server.reply = {"status": 500}
    verdicts, _, review = judge(server.url, "hindsight", None, max_retries=1)
    assert (review.status, review.scores) == ("api_error", None)
    assert [(v.status, v.score) for v in verdicts] == [("api_error", None)] * 3


def test_both_mode_combines_per_action_and_hindsight_scores(server):
    # Per-action requests answer PROCESS_SCORE: 8 (or fail), the review as REVIEW: mean when both exist.
    server.reply = {"content": "PROCESS_SCORE: 8"}
    server.script = [{"content": "PROCESS_SCORE: 8"}] * 3 + [REVIEW]
    verdicts, parts, review = judge(server.url, "both", None)
    assert len(server.seen) == 4 and review.status == "ok"
    assert [v.score for v in verdicts] == [7.0, 4.5, 6.0] and {v.source for v in verdicts} == {"both"}
    assert [p["per_action"].score for p in parts] == [8.0] * 3 and [p["hindsight"].score for p in parts] == [6.0, 1.0, 4.0]
    assert all(v.rationale.startswith("mean of per-action and hindsight") for v in verdicts)
    # The review fails: the per-action scores stand alone, and say so.
    server.seen.clear()
    server.reply, server.script = {"content": "no idea"}, [{"content": "PROCESS_SCORE: 8"}] * 3
    verdicts, parts, review = judge(server.url, "both", None, format_retries=0)
    assert review.status == "parse_error" and [v.score for v in verdicts] == [8.0] * 3
    assert all(v.rationale.startswith("per-action only (the hindsight review failed)") for v in verdicts)


def test_combining_rule():
    from openrlhf_mappa.coach import combine

    ok8, ok3 = Verdict(8.0, "ok", "a", "c"), Verdict(3.0, "ok", "b", "c", source="hindsight")
    failed, timeout = Verdict(None, "parse_error", "prose", "c"), Verdict(None, "timeout", "slow", "c", source="hindsight")
    assert (combine(ok8, ok3).score, combine(ok8, ok3).status, combine(ok8, ok3).source) == (5.5, "ok", "both")
    assert combine(ok8, timeout).score == 8.0 and combine(ok8, timeout).rationale.startswith("per-action only")
    assert combine(failed, ok3).score == 3.0 and combine(failed, ok3).rationale.startswith("hindsight only")
    neither = combine(failed, timeout)
    assert (neither.score, neither.status) == (None, "parse_error") and "prose" in neither.rationale and "slow" in neither.rationale
    cached = dataclasses.replace(ok8, cached=True)
    assert combine(cached, dataclasses.replace(ok3, cached=True)).cached and not combine(cached, ok3).cached


def test_review_cache_pays_once_and_never_stores_failures(server, tmp_path):
    path = str(tmp_path / "cache.sqlite")
    server.reply = {"status": 500}
    judge(server.url, "hindsight", None, max_retries=0, cache_path=path)
    server.reply = REVIEW
    first = judge(server.url, "hindsight", None, cache_path=path)[2]
    again = judge(server.url, "hindsight", None, cache_path=path)[2]  # a new coach on the same file: a resumed run
    assert (first.cached, again.cached, again.scores, again.responsible, len(server.seen)) == (False, True, [6.0, 1.0, 4.0], 1, 2)
    # another outcome is another review
    judge(server.url, "hindsight", None, outcome={"success": True}, cache_path=path)
    assert len(server.seen) == 3


def test_heuristic_review_blames_the_first_action_that_broke_its_goal():
    from openrlhf_mappa.coach import judge_episode

    coach = HeuristicCoach()

    def review(requests, success):
        return asyncio.run(judge_episode(coach, "hindsight", requests, {"success": success}, []))

    requests = episode_requests()  # the coder's code failed, then the verifier answered wrong
    verdicts, _, r = review(requests, False)
    assert (r.status, r.responsible) == ("ok", 1) and "code failed" in r.rationale
    per_action = [asyncio.run(coach.score(q)).score for q in requests]
    assert [v.score for v in verdicts] == per_action  # the same rules score each action
    requests[1] = make_request(agent="coder", agent_output="```python\nprint(18)\n```", runs_code=True, feedback="stdout:\n18")
    assert review(requests, False)[2].responsible == 2  # now the verifier's wrong answer is the first break
    requests[2] = make_request(agent="verifier", agent_output="\\boxed{18}", ground_truth="18")
    assert review(requests, False)[2].rationale.endswith("no action broke its own goal; the last one gave the failed result")
    solved = review(requests, True)[2]
    assert solved.responsible == 2 and "succeeded" in solved.rationale
    assert review([], False) == ([], [], None)  # no action, nothing to review


def test_mappa_coach_score_mode_hindsight_reviews_each_episode_once(saved_run, tmp_path):
    from coach_server import CoachServer

    path, _, env = saved_run  # 5 episodes of 2 actions
    out, template = tmp_path / "hindsight.jsonl", ("--template", str(tmp_path / "template.txt"))
    with CoachServer() as server:
        proc = mappa_coach_score(path, out, server.base_url, *template, "--mappa.coach.mode", "hindsight", env=env)
        prompts = [r["prompt"] for r in server.requests]
    assert proc.returncode == 0, proc.stderr
    assert len(prompts) == 5 and all("=== Action 2 of 2: agent verifier" in p for p in prompts)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 10 and {(r["after"]["status"], r["after"]["source"]) for r in rows} == {("ok", "hindsight")}
    for episode_id in {r["episode_id"] for r in rows}:
        assert sorted(r["responsible"] for r in rows if r["episode_id"] == episode_id) == [False, True]

    with CoachServer(mute={"hindsight"}) as server:  # prose instead of a review: no action gets a score
        proc = mappa_coach_score(path, out, server.base_url, *template, "--mappa.coach.mode", "hindsight", env=env)
        assert len(server.requests) == 5 * 3  # each review re-prompted twice
    assert proc.returncode == 1 and "10 of 10 verdicts failed" in proc.stderr
    assert "no valid review of the 2 actions after 3 replies" in proc.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert {(r["after"]["status"], r["after"]["score"], r["responsible"]) for r in rows} == {("parse_error", None, None)}
