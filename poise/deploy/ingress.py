"""The OpenAI-compatible entry point: poise's router in front of the engine replicas.

Per request: tokenize the prompt as the replicas will (for the prefix table), ask the router
for a replica, forward the HTTP request to it (``EngineReplica.handle``) and relay what comes
back. Nothing reaches the client until the replica's first body chunk, so a replica that fails
before then costs a retry elsewhere, not an error; a stream already under way ends with an SSE
error event naming the replica. The failed replica leaves the rotation until its health check
answers again (Ray Serve restarts it). A client that leaves cancels the replica call, which
aborts the request in its engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any

from poise.deploy.merged_metrics import exposition
from poise.router import Router, RouteRequest
from poise.text import apply_chat_template, encode_prompt
from poise.text.tokenizer import normalize_messages

HEALTH_PROBE_S = 1.0


def _failure_types() -> tuple[type[BaseException], ...]:
    from ray.exceptions import ActorUnavailableError, RayActorError

    return (RayActorError, ActorUnavailableError)


def _error(status: int, message: str, err_type: str) -> Any:
    from starlette.responses import JSONResponse

    body = {"error": {"message": message, "type": err_type, "param": None, "code": status}}
    return JSONResponse(body, status_code=status)


def carries_output(chunk: bytes) -> bool:
    """Whether a response chunk holds generated output (text, a tool call, a finish): the
    router counts a request's prefill as done from then on. A chat stream's opening chunk
    carries only the role and comes when the engine takes the request, before any prefill."""
    for line in chunk.splitlines():
        line = line.strip().removeprefix(b"data:").strip()
        if not line.startswith(b"{"):
            continue
        try:
            obj = json.loads(line)
        except ValueError:
            return True  # not an event this reads: count it as output rather than stall
        for choice in obj.get("choices") or []:
            delta = choice.get("delta") or choice.get("message") or {}
            said = (choice.get("text"), choice.get("finish_reason"), delta.get("content"))
            if any(said) or delta.get("tool_calls"):
                return True
    return False


class Ingress:
    def __init__(self, handles: Mapping[str, Any], router: Router, tokenizer_source: str | None):
        self.handles, self.router = dict(handles), router
        self.tokenizer_source = tokenizer_source
        self._tokenizer: Any = None
        self._prober: asyncio.Task[None] | None = None

    # -- what the router needs to know -------------------------------------------------------
    def _token_ids(self, path: str, body: dict[str, Any]) -> list[int]:
        from poise.text.tokenizer import load_tokenizer

        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.tokenizer_source)
        if path.endswith("/chat/completions"):
            return apply_chat_template(self._tokenizer, normalize_messages(body.get("messages")))
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1:
            prompt = prompt[0]
        if isinstance(prompt, str):
            return encode_prompt(self._tokenizer, prompt)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt
        return []

    async def route_request(self, path: str, raw: bytes) -> tuple[RouteRequest, bool]:
        """The request as the router sees it, and whether it streams. A body the replica will
        refuse is routed by load alone (the replica answers with the error)."""
        try:
            body = json.loads(raw)
            ids = await asyncio.to_thread(self._token_ids, path, body)
            max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 256)
            cls = body.get("class")
            stream = bool(body.get("stream"))
        except Exception:  # the replica validates and answers; the router only places it
            return RouteRequest(uuid.uuid4().hex, [], 1), False
        return RouteRequest(
            uuid.uuid4().hex, ids, max_tokens, cls if isinstance(cls, str) else None
        ), stream

    # -- serving -----------------------------------------------------------------------------
    async def __call__(self, request: Any) -> Any:
        from starlette.responses import Response, StreamingResponse

        self._start_prober()
        path, method = request.url.path, request.method
        if method == "GET" and path == "/metrics":
            return Response(await self.metrics(), media_type="text/plain; version=0.0.4")
        if method == "GET" and path in ("/health", "/ready"):
            up = [n for n, r in self.router.replicas.items() if r.healthy]
            return Response(
                json.dumps({"replicas_healthy": up}),
                status_code=200 if up else 503,
                media_type="application/json",
            )
        raw = await request.body()
        req, stream = await self.route_request(path, raw)
        try:
            opened = await self._open(req, method, path, raw)
        except RuntimeError as exc:
            return _error(503, str(exc), "service_unavailable")
        start, first, gen, name = opened
        headers = {k: v for k, v in start["headers"] if k.lower() not in ("content-length",)}
        headers["x-poise-replica"] = name  # which replica answered (logs, tests, debugging)
        return StreamingResponse(
            self._relay(req.request_id, name, first, gen, stream),
            status_code=start["status"],
            headers=headers,
        )

    async def _open(self, req: RouteRequest, method: str, path: str, raw: bytes) -> tuple[Any, ...]:
        failures = _failure_types()
        failed: list[str] = []
        decision = self.router.route(req)
        while True:
            gen = (
                self.handles[decision.replica].options(stream=True).handle.remote(method, path, raw)
            )
            try:
                start = await gen.__anext__()
                try:
                    first = await gen.__anext__()
                except StopAsyncIteration:
                    first = None
                return start, first, gen, decision.replica
            except failures:
                self.router.on_failure(decision.replica)
                failed.append(decision.replica)
                decision = self.router.retry(req, failed)  # RuntimeError when none is left

    async def _relay(
        self, rid: str, name: str, first: bytes | None, gen: Any, stream: bool
    ) -> AsyncIterator[bytes]:
        started = False

        def output(chunk: bytes) -> None:  # the router hears of the first output only
            nonlocal started
            if not started and carries_output(chunk):
                started = True
                self.router.on_tokens(rid)

        try:
            if first is not None:
                output(first)
                yield first
            async for chunk in gen:
                output(chunk)
                yield chunk
        except _failure_types() as exc:
            self.router.on_failure(name)
            msg = f"replica {name} failed mid-response ({type(exc).__name__}); the request was cut"
            err = {"error": {"message": msg, "type": "replica_failed", "param": None, "code": 502}}
            yield (f"data: {json.dumps(err)}\n\n" if stream else json.dumps(err)).encode()
        finally:
            with contextlib.suppress(Exception):
                gen.cancel()  # the client left (or we are done): abort in the replica
            self.router.on_finish(rid)

    async def metrics(self) -> bytes:
        texts: dict[str, str] = {}
        for name, handle in self.handles.items():
            if self.router.replicas[name].healthy:
                with contextlib.suppress(Exception):
                    texts[name] = await asyncio.wait_for(handle.metrics.remote(), 10.0)
        return exposition(texts, self.router)

    # -- rejoining ---------------------------------------------------------------------------
    def _start_prober(self) -> None:
        if self._prober is None or self._prober.done():
            self._prober = asyncio.get_running_loop().create_task(self._probe())

    async def _probe(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_PROBE_S)
            for name, replica in self.router.replicas.items():
                if replica.healthy:
                    continue
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.handles[name].check_health.remote(), 5.0)
                    self.router.mark_up(name)
