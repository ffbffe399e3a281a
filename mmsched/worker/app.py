"""The worker's HTTP side (aiohttp): ``POST /v1/chat/completions`` and ``GET /health``.

Bounded everywhere: the body size (413), requests at once (503 past ``max_concurrency``),
reading the body and waiting for mmsched (``timeout``: 408/504), preparation (tokenizing,
decoding images) on a few threads off the event loop. mmsched's statuses pass through
(400, 500 naming the failed ranks, 503); while mmsched is known down (``Liveness``) a
chat is a 503 at once, and one in flight when it goes down is a 503 too. A caller who
goes away before the answer gets its request aborted inside mmsched. Every error,
unexpected ones included, is the JSON error shape (only HTTP that aiohttp cannot parse gets
aiohttp's plain-text 400 before any handler runs).
"""

from __future__ import annotations

import asyncio
import re
import logging
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from .. import client as mm
from ..log import event
from .liveness import Liveness, MmschedDown
from .prep import BadRequest, Preprocessor

log = logging.getLogger("mmsched.worker")

RID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
FEATURES = {"pooled": mm.pooled, "shm": mm.shm, "inline": mm.inline}


def error(status: int, message: str, **extra) -> web.Response:
    return web.json_response({"error": {"message": message, "code": status, **extra}}, status=status)


class Worker:
    def __init__(self, prep: Preprocessor, client: mm.Client, *, transport: str = "pooled",
                 max_concurrency: int = 64, timeout: float = 60.0, model: str = "mmsched-hf",
                 prep_threads: int = 2, middlewares=()):
        self.prep, self.client, self.feature = prep, client, FEATURES[transport]
        self.max_concurrency, self.timeout, self.model = max_concurrency, timeout, model
        self.active = 0
        self.live = Liveness(client)
        self._pool = ThreadPoolExecutor(prep_threads, thread_name_prefix="prep")  # bounds the CPU preparation takes
        self._middlewares = [*middlewares, errors]
        self._abandoned: set[asyncio.Task] = set()

    def app(self, max_body: int) -> web.Application:
        self.max_body = max_body
        app = web.Application(client_max_size=max_body, middlewares=self._middlewares)
        app.add_routes([web.post("/v1/chat/completions", self.chat), web.get("/health", self.health)])
        return app

    async def health(self, _request: web.Request) -> web.Response:
        try:
            await self.client.ping(timeout=2.0)
        except (asyncio.TimeoutError, asyncio.CancelledError):
            return error(503, "mmsched does not answer")
        return web.Response(text="ok\n")

    async def chat(self, request: web.Request) -> web.Response:
        if self.live.down:
            return error(503, "mmsched does not answer")
        if self.active >= self.max_concurrency:
            return error(503, f"worker busy: {self.active} requests in flight")
        self.active += 1
        try:
            try:
                body = await asyncio.wait_for(request.read(), self.timeout)
            except asyncio.TimeoutError:
                return error(408, "request body not received in time")
            except web.HTTPRequestEntityTooLarge:
                return error(413, f"body larger than {self.max_body} bytes")
            except web.RequestPayloadError as exc:  # not what its headers say (a gzip body that is not gzip)
                return error(400, f"request body could not be read: {exc}")
            except ConnectionResetError:  # the caller hung up mid-body: nothing sent to mmsched, nobody to answer
                event("caller_gone", stage="body", peer=request.remote)
                raise asyncio.CancelledError from None  # as aiohttp ends a handler whose caller went away
            rid = request.headers.get("X-Request-Id") or f"chatcmpl-{uuid.uuid4().hex}"
            if not RID.fullmatch(rid):
                return error(400, "X-Request-Id: 1-128 of [A-Za-z0-9._:-]")
            try:
                prepared = await asyncio.get_running_loop().run_in_executor(self._pool, self.prep.prepare, body)
            except BadRequest as exc:
                return error(400, str(exc))
            return await self._generate(rid, prepared)
        finally:
            self.active -= 1

    async def _generate(self, rid: str, prepared) -> web.Response:
        t0 = time.perf_counter()
        try:
            fut = self.client.send_request("generate", prepared.input_ids, [self.feature(p) for p in prepared.pixels],
                                           rid=rid, params={"max_new_tokens": prepared.max_new_tokens})
        except ValueError as exc:  # the rid is already in flight
            return error(400, str(exc))
        try:
            with self.live.watching(fut):
                res = await self.client.wait(rid, fut, self.timeout)
        except MmschedDown:
            return error(503, "mmsched stopped answering while this request was in flight")
        except asyncio.CancelledError:  # the caller went away (aiohttp cancels the handler)
            self._abandon(rid, fut)
            raise
        except asyncio.TimeoutError:
            self._abandon(rid, fut)
            return error(504, f"no answer from mmsched within {self.timeout} s")
        if res.status != 200:
            extra = {"failed_ranks": res.meta["failed_ranks"]} if "failed_ranks" in res.meta else {}
            return error(res.status if res.status in (400, 499, 500, 503) else 502, res.message or "", **extra)
        ids = list(res.output["output_ids"])
        text, finish = self.prep.decode(ids)
        return web.json_response({
            "id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}],
            "usage": {"prompt_tokens": len(prepared.input_ids), "completion_tokens": len(ids),
                      "total_tokens": len(prepared.input_ids) + len(ids)},
        }, headers={"X-Mmsched-Seconds": f"{time.perf_counter() - t0:.6f}",  # sent to answered
                    "X-Engine-Seconds": str(res.output.get("engine_s", ""))})

    def _abandon(self, rid: str, fut: asyncio.Future) -> None:
        """Abort inside mmsched, then wait for its one result (which frees the pooled slice)."""
        async def abort() -> None:
            await self.client.abort(rid)
            try:
                await self.client.wait(rid, fut, self.timeout)
            except (asyncio.TimeoutError, asyncio.CancelledError):
                pass

        task = asyncio.ensure_future(abort())
        self._abandoned.add(task)
        task.add_done_callback(self._abandoned.discard)


@web.middleware
async def errors(request: web.Request, handler):
    """An unexpected exception is a logged JSON 500, not aiohttp's bare page; aiohttp's own errors keep their status."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error(exc.status, exc.reason)
    except Exception as exc:  # noqa: BLE001 - the last line: whatever it was, the caller gets JSON
        log.exception("unexpected error on %s", request.path)
        return error(500, f"internal error: {type(exc).__name__}: {exc}")
