"""Coach client throughput: N requests at concurrency C against a local OpenAI-compatible server that answers
every request after a fixed delay, as wall time over the ideal N * delay / C.

Run: .venv/bin/python benchmarks/coach_throughput.py [--requests 2000 --concurrency 64 --delay 0.05 --rounds 5]

Two clients run side by side in one process run, against the same server (a separate process), in
alternating order for `--rounds` rounds; the medians are the result (single rounds vary by about ±0.05 here):
  coach  - the production path: OpenAICoach behind the SQLite verdict cache, every request a cache miss,
           verdicts parsed;
  floor  - a bare aiohttp client posting JSON of the same size: what this machine allows at all, for scale.
"""

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time


def serve(port: int, delay: float):
    """A chat-completions server at the level of asyncio's protocol callbacks: it answers each request after
    `delay` seconds with a fixed reply, spending a few microseconds of CPU on it, so the benchmark measures the
    client (a framework server on the second of two cores added its own queueing to every round trip)."""
    body = json.dumps({
        "id": "x", "object": "chat.completion", "created": 0, "model": "bench",
        "choices": [{"index": 0, "finish_reason": "stop",
                     "message": {"role": "assistant", "content": "The code ran and the answer is right.\nPROCESS_SCORE: 7"}}],
        "usage": {"prompt_tokens": 200, "completion_tokens": 12, "total_tokens": 212},
    }).encode()
    reply = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)

    class Connection(asyncio.Protocol):  # HTTP/1.1 keep-alive: requests one after another, each with a body
        def connection_made(self, transport):
            self.transport, self.buffer = transport, b""

        def data_received(self, data):
            self.buffer += data
            while (head_end := self.buffer.find(b"\r\n\r\n")) >= 0:
                length = re.search(rb"(?im)^content-length:\s*(\d+)", self.buffer[:head_end])
                end = head_end + 4 + (int(length.group(1)) if length else 0)
                if len(self.buffer) < end:
                    return
                self.buffer = self.buffer[end:]
                asyncio.get_running_loop().call_later(delay, self.answer)

        def answer(self):
            if not self.transport.is_closing():
                self.transport.write(reply)

    async def main():
        server = await asyncio.get_running_loop().create_server(Connection, "127.0.0.1", port, backlog=1024)
        await server.serve_forever()

    asyncio.run(main())


def requests(n: int, tag: str):
    from openrlhf_mappa.coach import CoachRequest

    return [
        CoachRequest(f"{tag}{i}", "modeler", i % 4, "Modeler: trains a model on the engineered features.",
                     f"Task {i}: predict the price.", "regression", "Write code.", f"model.fit(X, y)  # {tag} {i}",
                     "stdout:\nR2 = 0.81\nfiles: model.pkl")
        for i in range(n)
    ]


async def run_coach(url: str, n: int, concurrency: int, cache_dir: str) -> tuple:
    from openrlhf_mappa.coach.openai_compat import OpenAICoach

    template = "Role: {role}\nTask: {task}\nOutput: {agent_output}\nFeedback: {feedback}\nEnd with PROCESS_SCORE: <0-10>."
    coach = OpenAICoach(model="bench", base_url=url, template=template, max_concurrency=concurrency,
                        cache_path=os.path.join(cache_dir, "cache.sqlite"), structured="off")
    await asyncio.gather(*(coach.score(r) for r in requests(concurrency, "warm")))  # connections, imports
    batch = requests(n, "run")
    t0, cpu0 = time.perf_counter(), time.process_time()
    verdicts = await asyncio.gather(*(coach.score(r) for r in batch))
    wall = time.perf_counter() - t0
    await coach.aclose()  # writes the last verdicts to disk: their CPU counts, though nobody waits for it
    cpu = time.process_time() - cpu0
    bad = [v for v in verdicts if v.status != "ok" or v.cached]
    assert not bad, f"{len(bad)} verdicts not fresh and ok, e.g. {bad[0]}"
    return wall, cpu


async def run_floor(url: str, n: int, concurrency: int) -> tuple:
    import aiohttp

    semaphore = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def one(i):
            async with semaphore:
                body = {"model": "bench", "messages": [{"role": "user", "content": f"request {i} " * 40}], "temperature": 0}
                async with session.post(f"{url}/chat/completions", json=body) as response:
                    return (await response.json())["choices"][0]["message"]["content"]

        await asyncio.gather(*(one(i) for i in range(concurrency)))
        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(one(i) for i in range(n)))
        return time.perf_counter() - t0, time.process_time() - cpu0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--delay", type=float, default=0.05, help="server answer time, seconds")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--serve", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        return serve(args.serve, args.delay)

    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, __file__, "--serve", str(port), "--delay", str(args.delay)])
    url = f"http://127.0.0.1:{port}/v1"
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.1).close()
                break
            except OSError:
                time.sleep(0.1)
        ideal = args.requests * args.delay / args.concurrency
        print(f"{args.requests} requests, concurrency {args.concurrency}, server delay {args.delay * 1000:.0f} ms, "
              f"ideal {ideal:.2f} s, {os.cpu_count()} CPU cores (the server shares them)")
        # The machine's own share: one request at a time already takes longer than the delay (timer wake-ups,
        # the loopback round trip), and no client at any concurrency does better than that ratio.
        lone = asyncio.run(run_floor(url, 30, 1))[0] / 30
        print(f"  one request alone (30 in a row, bare aiohttp): {lone * 1000:.1f} ms round trip, "
              f"{lone / args.delay:.3f} x the server delay")
        runs = {"coach": [], "floor": []}  # (wall s, CPU s of this process) per round
        for round_ in range(args.rounds):
            for name in ("coach", "floor") if round_ % 2 == 0 else ("floor", "coach"):
                with tempfile.TemporaryDirectory() as cache_dir:
                    run = run_coach(url, args.requests, args.concurrency, cache_dir) if name == "coach" else \
                        run_floor(url, args.requests, args.concurrency)
                    runs[name].append(asyncio.run(run))
            print(f"  round {round_ + 1}: coach {runs['coach'][-1][0] / ideal:.2f}, floor {runs['floor'][-1][0] / ideal:.2f}")
    finally:
        server.terminate()
        server.wait()
    wall = {name: statistics.median(w for w, _ in r) for name, r in runs.items()}
    cpu_ms = {name: statistics.median(c for _, c in r) / args.requests * 1000 for name, r in runs.items()}
    print(f"median of {args.rounds}:")
    print(f"  coach (OpenAICoach + verdict cache): {wall['coach']:6.2f} s   ratio to ideal {wall['coach'] / ideal:.2f}"
          f"   CPU {cpu_ms['coach']:.2f} ms/request   (goal <= 1.25)")
    print(f"  floor (bare aiohttp client):         {wall['floor']:6.2f} s   ratio to ideal {wall['floor'] / ideal:.2f}"
          f"   CPU {cpu_ms['floor']:.2f} ms/request")
    print(f"  coach / floor: {wall['coach'] / wall['floor']:.2f}")


if __name__ == "__main__":
    main()
