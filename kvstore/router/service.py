"""The router: per request, tokenize, name the chunks, ask the index, score, proxy.

:meth:`Router.decide` is the decision (chunk keys, one index query, scoring), what the
benchmark times; :meth:`Router.handle` serves one HTTP connection. The index is optional and
never fails a request: without ``cluster.url``/``redis.url``, after a failed or slow query (its
deadline sized from measured latency: :mod:`.index_query`) or without token ids, requests are
routed by load and the provisional entries alone. Every decision's reason is counted and, at
DEBUG, logged (:mod:`.decision`).

In P/D mode (``router.prefill`` and ``router.decode``) a :class:`~kvstore.router.pd.PrefillStage`
runs each completion on a prefill replica first; the decision then picks among decode replicas.

Bad input never costs more than its bounds: a body is at most ``router.max_body_bytes``; one of
more than :data:`INLINE_BODY_BYTES` (or any, with a tokenizer) is parsed and tokenized on one
worker thread (:mod:`.body`, whose steps hold the interpreter a few ms a MiB at most), so the
event loop keeps answering ``/health`` and other requests meanwhile; a prompt names at most
:data:`MAX_CHUNKS` chunks. A malformed request is answered 4xx with what is wrong, logged in one
line.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvstore.cluster.index import ClusterIndex, Holding
from kvstore.router.body import ParsedBody, TokenIds, parse_body
from kvstore.router.decision import FALLBACK_REASONS, DecisionRecord, reason_for
from kvstore.router.fleet_keys import FleetKeys
from kvstore.router.index_query import AdaptiveDeadline, IndexQuery
from kvstore.router.keys import RouterKeys
from kvstore.router.lookup import ScriptIndex
from kvstore.router.metrics import RouterMetrics
from kvstore.router.pd import PrefillStage
from kvstore.router.proxy import (
    BadRequest,
    ClientGone,
    Request,
    UpstreamError,
    forward,
    read_request,
    respond,
)
from kvstore.router.scoring import Decision, Provisional, Replica, Scorer
from kvstore.router.tokenize import Tokenizer, prompt_tokens

__all__ = ["Index", "Router"]

logger = logging.getLogger(__name__)

_ROUTED = ("/v1/completions", "/v1/chat/completions")
#: A body this small (without a tokenizer) is parsed on the event loop: well under a millisecond.
INLINE_BODY_BYTES = 64 * 1024
#: The most chunks of a prompt the router names and asks the index about (1M tokens at the
#: default chunk_size of 256): a longer prompt is routed by its first MAX_CHUNKS chunks, so the
#: hashing, the index query and the provisional entries of one request stay bounded.
MAX_CHUNKS = 4096
#: How long a closed connection may take to flush what is left for its client before it is
#: aborted (a client that stopped reading must not hold a handler forever).
CLOSE_WAIT_S = 10.0
#: After refusing a request whose body was not read: how long, and how many bytes of it, are
#: read and dropped before closing (closing with unread bytes sends a reset, which can destroy
#: the answer before the client reads it).
LINGER_S = 1.0
LINGER_BYTES = 1 << 20

#: What the router asks the index (ClusterIndex, or ScriptIndex on a single Redis).
Index = ClusterIndex | ScriptIndex


class Router:
    """Decides and proxies; holds the scorer's load, the index reader and the metrics."""

    def __init__(
        self,
        replicas: Sequence[Replica],
        keys: RouterKeys | None,
        index: Index | None,
        *,
        prefill: PrefillStage | None = None,
        tokenizer: Tokenizer | None = None,
        provisional_ttl_s: float = 5.0,
        hit_weight: float = 2.0,
        request_cost_tokens: int = 256,
        index_retry_s: float = 1.0,
        index_timeout_s: float = 0.1,
        index_timeout_max_s: float = 1.0,
        policy: str = "kv",
        max_body_bytes: int = 16 * 1024**2,
        clock: Callable[[], float] = time.monotonic,
        fleet_index: ClusterIndex | None = None,
    ) -> None:
        self.keys = keys  # None (P/D mode without router.namespace): routed by load
        self.index = IndexQuery(
            index, AdaptiveDeadline(index_timeout_s, index_timeout_max_s), index_retry_s, clock
        )
        self.prefill = prefill
        self.tokenizer = tokenizer
        self.metrics = RouterMetrics()
        #: The fleet's published key schemes (with ``fleet_index``); ``keys`` is then only the
        #: fallback while no node publishes one.
        self.fleet: FleetKeys | None = None
        if fleet_index is not None:
            self.fleet = FleetKeys(fleet_index, self.metrics, keys, clock=clock)
        self.scorer = Scorer(
            replicas,
            keys.chunk_size if keys is not None else 1,
            hit_weight,
            request_cost_tokens,
            Provisional(provisional_ttl_s, clock),
            policy,
        )
        self.max_body_bytes = max_body_bytes
        self.metrics.index_deadline.set(self.index.deadline.seconds)
        for reason in FALLBACK_REASONS:  # every fallback series shows, at 0 until it happens
            self.metrics.fallbacks.labels(reason)
        self._decisions = 0
        # The connections being served: a handler's task is referenced from here until it ends.
        # asyncio's loop holds tasks only weakly and the stream protocol drops its reference
        # once the client's connection is lost; a handler of a client that hung up, still
        # connecting to its upstream, was collected mid-request ("Task was destroyed but it is
        # pending!", naming wait_closed: where its finally was when the collector closed it;
        # ~50 in 800 hang-ups, issue 30). :meth:`drain` ends them at shutdown.
        self._handlers: set[asyncio.Task[None]] = set()
        # One thread: one large body's work buffers at a time, and the tokenizer (not safe to
        # call from two threads at once) only ever called from it.
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kvstore-router-body")

    def close(self) -> None:
        """Stop the body-parsing thread (bodies queued for it are dropped)."""
        self._reader.shutdown(wait=False, cancel_futures=True)

    async def drain(self) -> None:
        """Cancel the connections still being served and wait for them to end."""
        handlers = list(self._handlers)
        for task in handlers:
            task.cancel()
        await asyncio.gather(*handlers, return_exceptions=True)

    async def decide(
        self,
        tokens: Sequence[int] | TokenIds | None,
        cache_salt: str = "",
        lora_id: str = "",
        model: str | None = None,
    ) -> tuple[Decision, list[bytes]]:
        """Choose a replica for a prompt (``None``: token ids unknown) of ``model`` and count
        why; only its first :data:`MAX_CHUNKS` chunks count. Replicas whose node's key scheme
        differs from the fleet's are not credited with cached prefixes (:mod:`.fleet_keys`)."""
        started = time.perf_counter()
        keys: list[bytes] = []
        holdings: Mapping[str, Holding] = {}
        fallback, asked, index_seconds = "", False, 0.0
        deadline = self.index.deadline.seconds
        namer = self.fleet.keys_for(model) if self.fleet is not None else self.keys
        if tokens is None:
            fallback = "no_tokens"
        elif namer is None:
            fallback = "no_namespace"
        else:
            named = tokens[: MAX_CHUNKS * namer.chunk_size]
            keys = namer.keys(named, lora_id, cache_salt)
            self.scorer.chunk_size = namer.chunk_size
            if keys and self.scorer.policy == "kv":  # the baselines never ask the index
                asked = True
                holdings, fallback, index_seconds = await self.index.holders(keys)
                refused = self.fleet.refused if self.fleet is not None else {}
                if refused:  # their entries name chunks otherwise: never credit them
                    holdings = {n: h for n, h in holdings.items() if n not in refused}
        count = 0 if tokens is None else len(tokens)
        decision = self.scorer.choose(keys, count, holdings)
        m = self.metrics
        m.decision_seconds.observe(time.perf_counter() - started)
        if asked:
            if fallback in ("index_timeout", "index_error"):
                m.index_errors.inc()
            elif not fallback:
                m.index_seconds.observe(index_seconds)
            m.index_deadline.set(self.index.deadline.seconds)
        self._decisions += 1
        decision = dataclasses.replace(decision, reason=reason_for(decision, fallback))
        record = DecisionRecord(
            self._decisions, decision, fallback, asked, count, index_seconds, deadline
        )
        record.count(m)
        record.log()
        return decision, keys

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve one connection: one request, then close."""
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
            task.add_done_callback(self._handlers.discard)
        request: Request | None = None
        try:
            try:
                request = await read_request(reader, writer, self.max_body_bytes)
                if request is not None:
                    await self._serve(request, writer)
            except BadRequest as exc:  # raised before any byte of an answer went out
                self._log_refusal(writer, request, exc)
                await respond(writer, exc.status, {"error": str(exc)})
                await _linger(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away
        except Exception:  # a bug: logged once here, not as asyncio's unhandled exception
            logger.exception("serving a request failed")
        finally:
            writer.close()
            try:
                async with asyncio.timeout(CLOSE_WAIT_S):
                    await writer.wait_closed()
            except TimeoutError:  # the client stopped reading: drop what it did not take
                writer.transport.abort()
            except OSError:
                pass  # the connection failed as it closed: nothing left to do

    @staticmethod
    def _log_refusal(
        writer: asyncio.StreamWriter, request: Request | None, exc: BadRequest
    ) -> None:
        """The one line a refused request is logged in."""
        peer = writer.get_extra_info("peername")
        client = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else "?"
        what = f"{request.method} {request.target[:200]}" if request is not None else "a request"
        logger.info("refused %s from %s: %d %s", what, client, exc.status, exc)

    async def _serve(self, request: Request, writer: asyncio.StreamWriter) -> None:
        path = request.target.split("?", 1)[0]
        if path == "/health":
            await respond(writer, 200, {"status": "ok", "replicas": len(self.scorer.replicas)})
        elif path == "/metrics":
            await respond(writer, 200, generate_latest(self.metrics.registry), CONTENT_TYPE_LATEST)
        elif path == "/v1/models" and request.method == "GET":
            await self._proxy(request, writer, list(self.scorer.replicas), None, [], 0)
        elif path in _ROUTED and request.method == "POST":
            try:
                body, tokens = await self._read_body(request, path)
            except BadRequest:
                raise
            except Exception:  # a bug: answered, never a dropped connection
                logger.exception("reading a %s body failed", path)
                await respond(writer, 500, {"error": "internal error reading the request body"})
                return
            count = 0 if tokens is None else len(tokens)
            if self.prefill is not None:
                decode = await self.prefill.run(request, body, count)
                if decode is not None:  # else the decode replica computes the whole prompt
                    request.body = body.encode(decode)
            salt, model = body.value.get("cache_salt"), body.value.get("model")
            decision, keys = await self.decide(
                tokens,
                salt if isinstance(salt, str) else "",
                model=model if isinstance(model, str) else None,
            )
            del tokens  # not held while the response streams
            prefill = count - decision.predicted_hit_tokens
            await self._proxy(request, writer, list(decision.ranked), decision, keys, prefill)
        else:
            await respond(writer, 404, {"error": f"no route {request.method} {path}"})

    async def _read_body(self, request: Request, path: str) -> tuple[ParsedBody, TokenIds | None]:
        """The body of a completion and its prompt's token ids; :class:`BadRequest` if the body
        is not what it should be."""
        kind = (request.header("content-type") or "application/json").split(";")[0]
        kind = kind.strip().lower()
        if kind != "application/json" and not kind.endswith("+json"):
            raise BadRequest(400, f"Content-Type is {kind[:80]!r}: send application/json")

        def read() -> tuple[ParsedBody, TokenIds | None]:
            body = parse_body(request.body)
            return body, prompt_tokens(path, body, self.tokenizer)

        if self.tokenizer is None and len(request.body) <= INLINE_BODY_BYTES:
            return read()
        return await asyncio.get_running_loop().run_in_executor(self._reader, read)

    async def _proxy(
        self,
        request: Request,
        writer: asyncio.StreamWriter,
        ranked: list[Replica],
        decision: Decision | None,
        keys: list[bytes],
        prefill: int,
    ) -> None:
        """Send to the first replica that answers; account its load while it works."""
        scorer, m = self.scorer, self.metrics
        for replica in ranked:
            if decision is not None:
                scorer.dispatched(replica, keys, prefill)
                m.in_flight.labels(replica.url).set(scorer.load[replica.url].in_flight)
            done = False

            def first_byte(replica: Replica = replica) -> None:
                if decision is not None:
                    scorer.prefilled(replica, prefill)

            try:
                await forward(replica.url, request, writer, first_byte)
                m.responses.labels(replica.url, "ok").inc()
                done = True
            except ClientGone:  # its response had begun: no other replica is tried
                m.responses.labels(replica.url, "client_gone").inc()
                raise
            except (ConnectionError, OSError):  # the upstream broke after its head went out
                m.responses.labels(replica.url, "upstream_error").inc()
                raise
            except UpstreamError as exc:
                logger.warning("replica %s: %s; trying the next", replica.url, exc)
                m.responses.labels(replica.url, "upstream_error").inc()
                if decision is not None:
                    scorer.prefilled(replica, prefill)
            finally:
                if decision is not None:
                    scorer.finished(replica)
                    m.in_flight.labels(replica.url).set(scorer.load[replica.url].in_flight)
            if done:
                return
        await respond(writer, 502, {"error": "no replica answered"})


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """End our side (the answer is out), then drop what the client still sends, within bounds."""
    if not writer.can_write_eof():
        return
    writer.write_eof()
    dropped = 0
    with contextlib.suppress(TimeoutError, ConnectionError):
        async with asyncio.timeout(LINGER_S):
            while dropped < LINGER_BYTES and (data := await reader.read(1 << 16)):
                dropped += len(data)
