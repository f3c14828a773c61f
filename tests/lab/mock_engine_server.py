"""A scripted OpenAI-compatible SSE engine, run as a subprocess with engine-like flags, so the
tuner and the sweep can start it "per probed config" exactly as they start a real server.

Per request: first token after ``ttft_ms(budget)``, then one token every ``tpot_ms(budget)``;
``--max-num-seqs`` requests run at once, the rest wait (a semaphore). Known functions:
    ttft_ms = 40 * (budget / 512) ** 1.5      (512: 40, 1024: 113, 2048: 320, 4096: 905)
    tpot_ms = 12 * 512 / budget               (512: 12, 1024: 6, 2048: 3, 4096: 1.5)
so with 32 output tokens a bigger budget is faster end to end while TTFT grows.
``--fail-requests`` answers every chat request with HTTP 500; ``--ignore-sigterm`` makes the
process survive SIGTERM (the stopper must SIGKILL it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal

from aiohttp import web


def ttft_ms(budget: int) -> float:
    return 40.0 * (budget / 512) ** 1.5


def tpot_ms(budget: int) -> float:
    return 12.0 * 512 / budget


def _chunk(
    content: str | None = None, usage: dict | None = None, finish: str | None = None
) -> bytes:
    obj: dict = {"id": "x", "object": "chat.completion.chunk", "model": "mock-engine"}
    if usage is not None and content is None:
        obj["choices"] = []
    else:
        delta = {} if content is None else {"content": content}
        obj["choices"] = [{"index": 0, "delta": delta, "finish_reason": finish}]
    if usage is not None:
        obj["usage"] = usage
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def make_app(args: argparse.Namespace) -> web.Application:
    sem = asyncio.Semaphore(args.max_num_seqs)
    state = {"running": 0, "waiting": 0}

    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        if args.fail_requests:
            return web.json_response({"error": {"message": "scripted failure"}}, status=500)
        n = int(body.get("max_tokens", 16))
        state["waiting"] += 1
        async with sem:
            state["waiting"] -= 1
            state["running"] += 1
            try:
                resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
                await resp.prepare(request)
                await asyncio.sleep(ttft_ms(args.max_num_batched_tokens) / 1000)
                for i in range(n):
                    if i:
                        await asyncio.sleep(tpot_ms(args.max_num_batched_tokens) / 1000)
                    await resp.write(_chunk("tok "))
                await resp.write(_chunk(finish="length"))
                usage = {"prompt_tokens": 7, "completion_tokens": n, "total_tokens": n + 7}
                await resp.write(_chunk(usage=usage))
                await resp.write(b"data: [DONE]\n\n")
                return resp
            finally:
                state["running"] -= 1

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "mock-engine"}]})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics(_: web.Request) -> web.Response:
        lines = [
            "# TYPE poise:num_requests_running gauge",
            f"poise:num_requests_running {state['running']}",
            "# TYPE poise:num_requests_waiting gauge",
            f"poise:num_requests_waiting {state['waiting']}",
            "# TYPE poise:kv_cache_usage_perc gauge",
            f"poise:kv_cache_usage_perc {state['running'] / 16}",
            "# TYPE poise:num_preemptions counter",
            "poise:num_preemptions_total 0",
        ]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--scheduling-policy", default="fifo")
    p.add_argument("--fail-requests", action="store_true")
    p.add_argument("--ignore-sigterm", action="store_true")
    args = p.parse_args()
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    web.run_app(
        make_app(args),
        host="127.0.0.1",
        port=args.port,
        print=None,
        handle_signals=not args.ignore_sigterm,
    )


if __name__ == "__main__":
    main()
