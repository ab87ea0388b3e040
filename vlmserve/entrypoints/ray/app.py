"""vlmserve on a Ray cluster (`pip install vlmserve[ray]`): a Ray Serve application of three
deployments (docs/ray.md).

    OpenAIIngress  (HTTP: every route of `vlmserve serve`, streamed)
        |  DeploymentHandle, routed by AffinityRequestRouter (router.py): a chat's next turn
        v  to the replica holding its prefix; request body in, response chunks out (Ray's
    LLMServer x N  transport, any node)
        each: AsyncLLM + its engine-core process (its TP ranks; the GPUs Ray gave it) and the
        HTTP app of `vlmserve serve`, called in-process
        |  HTTP POST /v1/encode, embedding rows inline (bytes handles: any node)
        v
    EncoderServer x M (optional)  `vlmserve serve --role encoder` as a child process

    serve run vlmserve.entrypoints.ray.app:build_app model=tiny-qwen2-vl
    serve deploy deploy/ray_serve.yaml

Ray places the replicas (`ray_actor_options`: CPUs, GPUs, custom resources), scales them
(`num_replicas` or `autoscaling_config`, passed through) and restarts one that dies (its
health check fails when its engine core is gone); its in-flight streams end with an error
event (or a 503 before the response began), the others go on, new requests go to the live
replicas.
"""


import asyncio
import collections
import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgspec
import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from vlmserve.config import EngineConfig
from vlmserve.entrypoints.args import ServerConfig
from vlmserve.entrypoints.ray.router import AffinityRequestRouter, request_key
from vlmserve.utils import start_children

logger = logging.getLogger("vlmserve.ray")
_KEYED = ("/v1/chat/completions", "/v1/completions")
_HOP = {"content-length", "transfer-encoding", "connection", "keep-alive"}
_DICT_ARGS = ("engine", "server", "router", "llm", "encoder", "ingress")


def _node_ip() -> str:
    """The address other nodes reach this one by: the one its `ray start` registered
    (`--node-ip-address`), not the one `ray.util.get_node_ip_address` guesses from a route."""
    node = ray.get_runtime_context().get_node_id()
    for n in ray.nodes():
        if n["NodeID"] == node:
            return n["NodeManagerAddress"]
    return ray.util.get_node_ip_address()


# `vlmserve ...` that dies with the process `{}` (asked first thing; where that process is
# already gone, it exits): no preexec_fn, which is unsafe in a process with threads
_DIE_WITH_PARENT_THEN_CLI = (
    "import os, sys; from vlmserve.utils import die_with_parent; die_with_parent(); "
    "os.getppid() == {} or sys.exit('its Ray replica is gone'); "
    "from vlmserve.entrypoints.cli import main; main()")


def _tail(pipe: Any, lines: int = 40) -> collections.deque:
    """The last `lines` lines of a child's output `pipe`, kept while a thread copies it all
    to this process's stderr (which Ray writes to the replica's log)."""
    kept: collections.deque = collections.deque(maxlen=lines)

    def copy() -> None:
        for line in iter(pipe.readline, b""):
            text = line.decode(errors="replace")
            kept.append(text)
            sys.stderr.write(text)

    threading.Thread(target=copy, daemon=True, name="vlmserve-encoder-stderr").start()
    return kept


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class LLMServer:
    """One LLM replica: `AsyncLLM` (its engine core a child process) and the HTTP app of
    `vlmserve serve`, whose routes `forward` calls in-process."""

    async def __init__(self, engine: dict[str, Any], server: dict[str, Any] | None = None,
                       encoder: DeploymentHandle | None = None) -> None:
        from vlmserve.entrypoints.openai.server import build_app
        from vlmserve.frontend.async_llm import AsyncLLM

        server = dict(server or {})
        if encoder is not None:  # images encoded by an encoder replica, rows inline
            server.update(encoder_url=await encoder.url.remote(), encoder_transport="bytes")
        self.cfg = cfg = ServerConfig(**server)
        config = EngineConfig.from_kwargs(**engine)
        self.engine = await asyncio.to_thread(
            AsyncLLM, config, log_level=cfg.log_level,
            preprocess_workers=cfg.preprocess_workers,
            encoder_urls=[u for u in (cfg.encoder_url or "").split(",") if u],
            encoder_transport=cfg.encoder_transport,
            image_cache_bytes=cfg.processed_image_cache_mb << 20)
        if cfg.served_model_name is None:
            self.cfg = cfg = ServerConfig(**{**server, "served_model_name": engine["model"]})
        self.app = build_app(self.engine, cfg)
        self.replica = serve.get_replica_context().replica_id.unique_id

    async def forward(self, method: str, path: str, headers: list[tuple[bytes, bytes]],
                      body: bytes, route_key: Any = None, route_to: str | None = None,
                      route_loads: dict[str, int] | None = None) -> AsyncIterator[Any]:
        """One HTTP request through the app: (status, headers) first, then body chunks.
        `route_key` / `route_to` are the router's (router.py)."""
        queue: asyncio.Queue = asyncio.Queue()
        sent = False

        async def receive() -> dict:
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # the client stays until the response ends
            return {"type": "http.disconnect"}

        path, _, query = path.partition("?")
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": method, "scheme": "http", "path": path, "raw_path": path.encode(),
                 "query_string": query.encode(), "headers": headers, "root_path": "",
                 "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80)}
        task = asyncio.create_task(self.app(scope, receive, queue.put))
        try:
            while True:
                get = asyncio.create_task(queue.get())
                await asyncio.wait({get, task}, return_when=asyncio.FIRST_COMPLETED)
                if not get.done():
                    get.cancel()
                    task.result()  # raises what the app raised
                    return
                msg = get.result()
                if msg["type"] == "http.response.start":
                    yield (msg["status"], [*msg.get("headers", []),
                                           (b"x-vlmserve-replica", self.replica.encode()),
                                           (b"x-vlmserve-pid", str(os.getpid()).encode())])
                elif msg["type"] == "http.response.body":
                    if msg.get("body"):
                        yield msg["body"]
                    if not msg.get("more_body"):
                        return
        finally:
            task.cancel()  # the client left: the stream aborts its request
            with contextlib.suppress(BaseException):
                await task

    async def stats(self, route_to: str | None = None) -> dict[str, Any]:
        return {"replica": self.replica, "pid": os.getpid(), **await self.engine.get_stats()}

    async def reset_prefix_cache(self, route_to: str | None = None,
                                 route_reset: bool = False) -> str:
        """Empty this replica's prefix cache (`route_reset`: the router's tables too): its id."""
        await self.engine.reset_prefix_cache()
        return self.replica

    async def check_health(self) -> None:
        if not self.engine.is_running:
            raise RuntimeError("the engine core is gone")

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.engine.shutdown(5)


class EncoderServer:
    """One encoder replica: `vlmserve serve --role encoder` as a child process, listening on
    this node's address (its ledger too, for LLM replicas on other nodes)."""

    def __init__(self, engine: dict[str, Any], server: dict[str, Any] | None = None) -> None:
        flags: list[str] = []
        for name, value in {**{k: v for k, v in engine.items() if k != "model"},
                            **(server or {})}.items():
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                flags.append(flag if value else "--no-" + flag[2:])
            elif value is not None:
                flags += [flag, str(value)]
        host = _node_ip()
        for _ in range(3):  # a free port can be taken before the server binds it
            port = _free_port(host)
            args = [sys.executable, "-c", _DIE_WITH_PARENT_THEN_CLI.format(os.getpid()),
                    "serve", engine["model"], "--role", "encoder", "--host", host, "--port",
                    str(port), "--encoder-ledger-address", f"tcp://{host}:{_free_port(host)}",
                    *flags]
            self.proc = start_children(
                lambda a=args: subprocess.Popen(a, stderr=subprocess.PIPE))
            self._stderr = _tail(self.proc.stderr)
            self._url = f"http://{host}:{port}"
            deadline = time.monotonic() + 600
            while not self._healthy():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            else:
                return
            self.proc.kill()
            self.proc.wait()
            logger.warning("the encoder server on %s exited (%s): %s", self._url,
                           self.proc.returncode, "".join(self._stderr)[-2000:])
        raise RuntimeError(f"the encoder server did not start on {host} (exit code "
                           f"{self.proc.returncode}): {''.join(self._stderr)[-2000:]}")

    def _healthy(self) -> bool:
        try:
            return httpx.get(self._url + "/health", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    def url(self) -> str:
        return self._url

    def check_health(self) -> None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the encoder server exited ({self.proc.returncode}): "
                               f"{''.join(self._stderr)[-2000:]}")

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.proc.terminate()
            self.proc.wait(10)


_app = FastAPI(title="vlmserve on Ray")


@serve.ingress(_app)
class OpenAIIngress:
    """The HTTP endpoint: each request to the LLM replica the router picks (chats and
    completions by affinity), its response streamed back; `/stats` every replica's."""

    def __init__(self, llm: DeploymentHandle) -> None:
        self.llm = llm.options(stream=True)
        self.calls = llm
        self.seen: set[str] = set()  # replicas that answered (their ids, from their responses)
        self.in_flight: dict[str, int] = {}  # responses being streamed, by replica

    async def _every_replica(self, method: str, **first_kwargs: Any) -> list[Any]:
        """`method` called on every replica (the first call with `first_kwargs`), each
        replica's result once; a replica that died meanwhile is left out."""
        from vlmserve.entrypoints.ray import router

        def rid(result: Any) -> str:
            return result["replica"] if isinstance(result, dict) else result

        results = [await getattr(self.calls, method).remote(**first_kwargs)]
        for other in (set(router.REPLICAS) | self.seen) - {rid(results[0])}:
            try:
                results.append(await getattr(self.calls, method).remote(route_to=other))
            except Exception as e:  # noqa: BLE001 - it died meanwhile
                logger.warning("replica %s did not answer %s: %s", other, method, e)
                self.seen.discard(other)
        return list({rid(r): r for r in results}.values())

    @_app.post("/reset_prefix_cache")
    async def reset_prefix_cache(self) -> Response:
        """Every replica's prefix cache emptied, and the router's tables with them."""
        self.seen = set(await self._every_replica("reset_prefix_cache", route_reset=True))
        return Response(status_code=200)

    @_app.get("/stats")
    async def stats(self) -> JSONResponse:
        from vlmserve.frontend.dp_client import merge_stats

        unique = await self._every_replica("stats")
        self.seen = {s["replica"] for s in unique}
        total = merge_stats(unique)
        total["replicas"] = total.pop("cores")
        return JSONResponse(total)

    @_app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE"])
    async def proxy(self, request: Request, path: str) -> Response:
        body = await request.body()
        key = None
        if request.method == "POST" and "/" + path in _KEYED:
            with contextlib.suppress(msgspec.DecodeError):
                data = msgspec.json.decode(body)
                key = request_key(data) if isinstance(data, dict) else None
        target = "/" + path + (f"?{request.url.query}" if request.url.query else "")
        headers = [(k.lower(), v) for k, v in request.headers.raw]
        for attempt in range(2):  # a replica that died before answering: once more
            gen = self.llm.forward.remote(request.method, target, headers, body,
                                          route_key=key, route_loads=dict(self.in_flight))
            try:
                status, out_headers = await gen.__anext__()
                break
            except StopAsyncIteration:
                return Response(status_code=500)
            except Exception as e:  # noqa: BLE001 - its replica died
                logger.warning("replica failed before answering (%s)%s", e,
                               "; retrying" if attempt == 0 else "")
                if attempt == 1:
                    return JSONResponse({"error": {
                        "message": f"the replica serving this request failed: {e}",
                        "type": "server_error", "code": 503}}, status_code=503)
        kept = {k.decode(): v.decode() for k, v in out_headers if k.decode() not in _HOP}
        replica = kept.get("x-vlmserve-replica", "")
        self.seen.add(replica)
        self.in_flight[replica] = self.in_flight.get(replica, 0) + 1
        sse = kept.get("content-type", "").startswith("text/event-stream")
        return StreamingResponse(self._rest(gen, sse, replica), status_code=status,
                                 headers=kept)

    async def _rest(self, gen: Any, sse: bool, replica: str) -> AsyncIterator[bytes]:
        try:
            async for chunk in gen:
                yield chunk
        except Exception as e:  # noqa: BLE001 - the replica died mid-response
            logger.warning("replica failed mid-response: %s", e)
            if sse:  # as `vlmserve serve` ends a stream when its engine core dies
                err = msgspec.json.encode({"error": {
                    "message": f"the engine core serving this request died: {e}",
                    "type": "server_error", "code": 503}})
                yield b"data: " + err + b"\n\ndata: [DONE]\n\n"
        finally:
            self.in_flight[replica] -= 1
            if not self.in_flight[replica]:
                del self.in_flight[replica]



def build_app(args: dict[str, Any]) -> serve.Application:
    """The application from its arguments (`serve run ...:build_app k=v` or a config file's
    `args`): `model` and `engine` (engine options, `LLM(...)`'s names), `server` (the
    server's: `vlmserve serve`'s names), `routing` (affinity or random), and per deployment
    (`llm`, `encoder`: none without it, `ingress`) Serve's options: `num_replicas` or
    `autoscaling_config`, `ray_actor_options` (num_cpus, num_gpus: a replica's tensor
    parallel size, resources), `max_ongoing_requests`, ..."""
    args = {k: json.loads(v) if k in _DICT_ARGS and isinstance(v, str) else v
            for k, v in args.items()}  # `serve run ... engine='{"dtype": "float32"}'`
    engine = {"model": args.get("model", "tiny-qwen2-vl"), **(args.get("engine") or {})}
    server = dict(args.get("server") or {})
    llm_opts = {"num_replicas": 1, **(args.get("llm") or {})}
    router = RequestRouterConfig(
        request_router_class=AffinityRequestRouter,
        request_router_kwargs={"mode": args.get("routing", "affinity"),
                               **(args.get("router") or {})})
    encoder = None
    if args.get("encoder"):
        enc_opts = {"num_replicas": 1, **args["encoder"]}
        encoder = serve.deployment(EncoderServer, name="EncoderServer", **enc_opts).bind(
            engine, {k: v for k, v in server.items() if k in ("log_level",)})
    llm = serve.deployment(LLMServer, name="LLMServer", request_router_config=router,
                           **llm_opts).bind(engine, server, encoder)
    ingress = serve.deployment(OpenAIIngress, name="OpenAIIngress",
                               **(args.get("ingress") or {}))
    return ingress.bind(llm)
