"""A real OpenAI-compatible chat-completions server on 127.0.0.1, standing in for a paid coach API.

It scores by rule: the number of distinct characters in the agent's output (between `OUTPUT<<` and
`>>OUTPUT` in the coach prompt) mod 11; for agents listed in `mute` it answers garbage (no score).
`delay_s` makes every answer slow, like a real LLM coach. Used by the MAPPA end-to-end test and by
benchmarks/coach_latency.py.
"""

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

COACH_TEMPLATE = "AGENT={agent}\nROLE={role}\nTASK={task}\nOUTPUT<<{agent_output}>>OUTPUT\nFEEDBACK={feedback}\nTRUTH={ground_truth}"


class _Handler(BaseHTTPRequestHandler):
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        prompt = body["messages"][0]["content"]  # the original prompt, also on a format re-prompt
        self.server.requests.append({"prompt": prompt, "authorization": self.headers.get("Authorization")})
        time.sleep(self.server.delay_s)
        agent = prompt.split("AGENT=", 1)[1].split("\n", 1)[0]
        if agent in self.server.mute:
            content = "I refuse to grade this."
        else:
            output = prompt.split("OUTPUT<<", 1)[1].split(">>OUTPUT", 1)[0]
            content = f"Looks fine.\nPROCESS_SCORE: {len(set(output)) % 11}"
        reply = {
            "id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
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
    def __init__(self, delay_s: float = 0.0, mute=()):
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self.httpd.daemon_threads = True
        self.httpd.delay_s, self.httpd.mute, self.httpd.requests = delay_s, set(mute), []

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
