"""A real OpenAI-compatible chat-completions server on 127.0.0.1, standing in for a paid coach API.

It scores by rule: the number of distinct characters in the agent's output (between `OUTPUT<<` and
`>>OUTPUT` in the coach prompt) mod 11; for agents listed in `mute` it answers garbage (no score).
A hindsight review (the default review template's `=== Action i of n: agent A, ...` blocks) is answered
with a JSON review: each action scored by `review_score` of its block, the lowest-scored one held
responsible; with "hindsight" in `mute` it answers prose instead. `delay_s` makes every answer slow, like a
real LLM coach. `reasoning` makes it a reasoning model that ignores any response_format: that text comes first
in a <think> block of the reply (Qwen3, DeepSeek-R1 served plainly), or in the message's separate
`reasoning_content` with `reasoning_field` (vLLM's reasoning parser). Used by the MAPPA end-to-end tests and by
benchmarks/coach_latency.py.
"""

import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COACH_TEMPLATE = "AGENT={agent}\nROLE={role}\nTASK={task}\nOUTPUT<<{agent_output}>>OUTPUT\nFEEDBACK={feedback}\nTRUTH={ground_truth}"
ACTION_BLOCK = re.compile(r"^=== Action (\d+) of (\d+): agent ", re.MULTILINE)


def review_score(block: str) -> int:
    """The rule server's hindsight score of one action's block of the review prompt."""
    return len(set(block)) % 11


def review_reply(prompt: str, mute) -> str:
    starts = list(ACTION_BLOCK.finditer(prompt))
    if "hindsight" in mute:
        return "On reflection, the second action was the weak link; I would give it 3 out of 10."
    ends = [m.start() for m in starts[1:]] + [prompt.index("The outcome of the episode:")]
    scores = [review_score(prompt[m.start() : end]) for m, end in zip(starts, ends)]
    worst = scores.index(min(scores)) + 1
    return json.dumps({"rationale": "rule server review", "responsible": worst,
                       "actions": [{"id": i, "score": s} for i, s in enumerate(scores, 1)]})


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][0]["content"]  # the original prompt, also on a format re-prompt
        self.server.requests.append({"prompt": prompt, "authorization": self.headers.get("Authorization"),
                                     "body": body})
        time.sleep(self.server.delay_s)
        agent = prompt.split("AGENT=", 1)[1].split("\n", 1)[0] if "AGENT=" in prompt else None
        if ACTION_BLOCK.search(prompt):
            content = review_reply(prompt, self.server.mute)
        elif agent in self.server.mute:
            content = "I refuse to grade this."
        else:
            output = prompt.split("OUTPUT<<", 1)[1].split(">>OUTPUT", 1)[0]
            content = f"Looks fine.\nPROCESS_SCORE: {len(set(output)) % 11}"
        message = {"role": "assistant", "content": content}
        if self.server.reasoning is not None and self.server.reasoning_field:
            message["reasoning_content"] = self.server.reasoning
        elif self.server.reasoning is not None:
            message["content"] = f"<think>\n{self.server.reasoning}\n</think>\n\n{content}"
        reply = {
            "id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
        }
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


class CoachServer:
    def __init__(self, delay_s: float = 0.0, mute=(), reasoning: str = None, reasoning_field: bool = False):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.delay_s, self.httpd.mute, self.httpd.requests = delay_s, set(mute), []
        self.httpd.reasoning, self.httpd.reasoning_field = reasoning, reasoning_field

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.httpd.server_port}/v1"

    @property
    def requests(self):
        return self.httpd.requests

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
