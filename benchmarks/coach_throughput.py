"""Coach client throughput: N requests at concurrency C against a local OpenAI-compatible server that answers
every request after a fixed delay, as wall time over the ideal N * delay / C.

Run: .venv/bin/python benchmarks/coach_throughput.py [--requests 2000 --concurrency 64 --delay 0.05]

Two clients run side by side in one process run, against the same server (a separate process, aiohttp):
  coach  - the production path: OpenAICoach (openai SDK) behind the SQLite verdict cache, every request a
           cache miss, verdicts parsed;
  floor  - a bare aiohttp client posting the same JSON: what this machine allows at all, for scale.
"""

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time


def serve(port: int, delay: float):
    from aiohttp import web

    async def completions(request):
        body = await request.json()
        await asyncio.sleep(delay)
        message = {"role": "assistant", "content": "The code ran and the answer is right.\nSCORE: 7"}
        return web.json_response({
            "id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 200, "completion_tokens": 12, "total_tokens": 212},
        })

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)


def requests(n: int, tag: str):
    from openrlhf_mappa.coach import CoachRequest

    return [
        CoachRequest(f"{tag}{i}", "modeler", i % 4, "Modeler: trains a model on the engineered features.",
                     f"Task {i}: predict the price.", "regression", "Write code.", f"model.fit(X, y)  # {tag} {i}",
                     "stdout:\nR2 = 0.81\nfiles: model.pkl")
        for i in range(n)
    ]


async def run_coach(url: str, n: int, concurrency: int, cache_dir: str) -> float:
    from openrlhf_mappa.coach import build_coach

    template = "Role: {role}\nTask: {task}\nOutput: {agent_output}\nFeedback: {feedback}\nEnd with SCORE: <0-10>."
    coach = build_coach("openai", model="bench", base_url=url, template=template, max_concurrency=concurrency,
                        cache_path=os.path.join(cache_dir, "cache.sqlite"), structured="off")
    await asyncio.gather(*(coach.score(r) for r in requests(concurrency, "warm")))  # connections, imports
    batch = requests(n, "run")
    t0 = time.perf_counter()
    verdicts = await asyncio.gather(*(coach.score(r) for r in batch))
    wall = time.perf_counter() - t0
    await coach.aclose()
    bad = [v for v in verdicts if v.status != "ok" or v.cached]
    assert not bad, f"{len(bad)} verdicts not fresh and ok, e.g. {bad[0]}"
    return wall


async def run_floor(url: str, n: int, concurrency: int) -> float:
    import aiohttp

    semaphore = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        async def one(i):
            async with semaphore:
                body = {"model": "bench", "messages": [{"role": "user", "content": f"request {i} " * 40}], "temperature": 0}
                async with session.post(f"{url}/chat/completions", json=body) as response:
                    return (await response.json())["choices"][0]["message"]["content"]

        await asyncio.gather(*(one(i) for i in range(concurrency)))
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return time.perf_counter() - t0


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--delay", type=float, default=0.05, help="server answer time, seconds")
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
        with tempfile.TemporaryDirectory() as cache_dir:
            coach = asyncio.run(run_coach(url, args.requests, args.concurrency, cache_dir))
        floor = asyncio.run(run_floor(url, args.requests, args.concurrency))
    finally:
        server.terminate()
        server.wait()
    print(f"{args.requests} requests, concurrency {args.concurrency}, server delay {args.delay * 1000:.0f} ms, "
          f"ideal {ideal:.2f} s, {os.cpu_count()} CPU cores (the server shares them)")
    print(f"  coach (openai SDK + verdict cache): {coach:6.2f} s   ratio to ideal {coach / ideal:.2f}   (goal <= 1.25)")
    print(f"  floor (bare aiohttp client):        {floor:6.2f} s   ratio to ideal {floor / ideal:.2f}")


if __name__ == "__main__":
    main()
