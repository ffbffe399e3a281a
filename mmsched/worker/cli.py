"""``mmsched worker``: its flags, and running it until SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--frontend", default="ipc:///tmp/mmsched.sock", help="mmsched's frontend (ipc:///tmp/mmsched.sock)")
    p.add_argument("--listen", default="127.0.0.1:8000", metavar="HOST:PORT", help="HTTP address (127.0.0.1:8000)")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="directory with tokenizer.json, preprocessor_config.json, config.json (configs/hf-tiny)")
    p.add_argument("--transport", choices=("pooled", "shm", "inline"), default="pooled",
                   help="how pixel values reach mmsched (pooled)")
    p.add_argument("--pool-mb", type=float, default=64.0, metavar="MB", help="size of the pooled segment (64)")
    p.add_argument("--shm-prefix", default="mmsched_", help="segment name prefix, as the server's (mmsched_)")
    p.add_argument("--max-body-mb", type=float, default=16.0, metavar="MB", help="largest request body (16); 413 beyond")
    p.add_argument("--max-concurrency", type=int, default=64, metavar="N", help="requests at once (64); 503 beyond")
    p.add_argument("--max-tokens", type=int, default=256, metavar="N", help="largest max_tokens accepted (256)")
    p.add_argument("--max-images", type=int, default=16, metavar="N", help="images per request (16); 400 beyond")
    p.add_argument("--max-pixels", type=float, default=8.0, metavar="MPIX",
                   help="pixels of all a request's images together, in millions (8); 400 beyond")
    p.add_argument("--max-connections", type=int, default=256, metavar="N",
                   help="open HTTP connections (256); one more closes one waiting for its first "
                        "request's headers or idle between requests, else gets 503 and is closed")
    p.add_argument("--header-timeout", type=float, default=10.0, metavar="S",
                   help="seconds for a connection's request headers to arrive, for an idle keep-alive "
                        "connection, and for a client that stops reading its responses (10); then it is closed")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="seconds to read a body, and to wait for mmsched (60)")


def main(args: argparse.Namespace) -> int:
    try:
        import PIL  # noqa: F401
        import tokenizers  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        print(f"mmsched worker: needs the hf extra (pip install 'mmsched[hf]'): {exc}", file=sys.stderr)
        return 2
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        return asyncio.run(_serve(args))
    return uvloop.run(_serve(args))


async def _serve(args: argparse.Namespace) -> int:
    from aiohttp import web

    from ..client import Client
    from ..engines.hf import SHIPPED
    from .. import log
    from ..log import event
    from ..producers.shm_pool import ShmPool
    from .app import Worker
    from .guard import Guard
    from .prep import Preprocessor

    log.setup(-1, role="worker")
    prep = Preprocessor(args.model or str(SHIPPED), max_new_tokens=args.max_tokens, max_images=args.max_images,
                        max_pixels=int(args.max_pixels * 1e6))
    host, _, port = args.listen.rpartition(":")
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        asyncio.get_running_loop().add_signal_handler(sig, stop.set)
    pool = ShmPool(int(args.pool_mb * (1 << 20)), args.shm_prefix) if args.transport == "pooled" else None
    try:
        async with Client(args.frontend, shm_prefix=args.shm_prefix, timeout=args.timeout, shm_pool=pool) as client:
            guard = Guard(args.max_connections, args.header_timeout)
            worker = Worker(prep, client, transport=args.transport, max_concurrency=args.max_concurrency,
                            timeout=args.timeout, middlewares=[guard.middleware])
            runner = web.AppRunner(worker.app(int(args.max_body_mb * (1 << 20))), handler_cancellation=True,
                                   access_log=None, keepalive_timeout=args.header_timeout,
                                   # a body no handler read (a GET's; one answered 503 first) is read
                                   # and dropped so the answer arrives, for this long at most
                                   lingering_time=args.header_timeout)
            await runner.setup()
            guard.server = runner.server
            site = await asyncio.get_running_loop().create_server(guard, host or "127.0.0.1", int(port))
            worker.live.start()
            event("worker_listening", address=f"http://{host or '127.0.0.1'}:{port}", frontend=args.frontend)
            await stop.wait()
            site.close()
            await worker.live.stop()
            await runner.cleanup()
            event("worker_stopped")
    finally:
        if pool is not None:
            pool.close()
    return 0
