"""The scheduler half of the vLLM connector: which prompt chunks to load, which to save.

It never moves KV bytes and never waits on the store for long. A request's first call to
:meth:`SchedulerSide.get_num_new_matched_tokens` starts ONE batched ``Lookup`` of all its
loadable chunk keys on a small thread pool and waits a few milliseconds for it; if the answer is
not there yet it tells vLLM "not known yet" (``None``), and vLLM asks again on a later step while
it schedules other requests. A lookup that fails or outlives ``lookup_timeout_s`` is a miss;
then, for ``retry_after_s``, a store that was unavailable gets neither lookups nor saves, and one
that was only slow gets no lookups (its saves have deadlines of their own).

Per step, :meth:`SchedulerSide.build_connector_meta` hands the workers the loads recorded by
``update_state_after_alloc`` and the saves of every prompt chunk that this step completes and the
store lacks. A request that had saves planned is reported as "still saving" by
``request_finished``; the workers report it done through ``get_finished`` once they no longer read
its blocks.

Roles (``kv_transfer_config.kv_role``, :data:`KV_ROLES`): ``kv_both`` loads and saves;
``kv_producer`` (a prefill engine) never looks up or loads and saves every computed whole prompt
chunk, then reports in the request's output ``kv_transfer_params`` how many chunks are in the
store or on their way (:data:`HANDOFF_KEY`); ``kv_consumer`` (a decode engine) loads every whole
prompt chunk it can and never saves. The producer's puts are asynchronous (they may still be
running when its response is sent), so a request that arrives with the producer's count in its
``kv_transfer_params`` looks up again, without holding the scheduler, until the store holds that
many leading chunks or ``handoff_wait_s`` has passed, then loads what is there.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.client.cost_model import context_scale, prefill_work
from kvstore.errors import (
    DeadlineExceededError,
    KVStoreError,
    StoreUnavailableError,
)
from kvstore.integrations.paged.groups import anchor_group
from kvstore.integrations.store_client import StoreClient
from kvstore.integrations.vllm.common import (
    Breaker,
    ConnectorSettings,
    LoadSpec,
    StepPlan,
    base_namespace,
    engine_groups,
    engine_shape,
    make_hasher,
    warm_up,
)
from kvstore.integrations.vllm.cost import LoadDecider, hidden_size, token_bytes
from kvstore.integrations.vllm.hybrid import GroupLayout, null_block_id, scheme_block_size
from kvstore.integrations.vllm.retention import request_retention
from kvstore.integrations.vllm.roles import HANDOFF_KEY, KV_ROLES, _handoff_chunks, kv_role
from kvstore.integrations.vllm.scheme import open_scheme
from kvstore.integrations.vllm.stats import ConnectorCounters
from kvstore.key_scheme import namespace_to_json
from kvstore.keys import ChunkHasher
from kvstore.retention import KEEP, Retention

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["HANDOFF_KEY", "KV_ROLES", "SchedulerSide", "kv_role"]

logger = logging.getLogger(__name__)

# How long one scheduler call may wait for a lookup before answering "not known yet". A loopback
# lookup takes well under this, so the usual request is decided on its first pass; a slow store
# costs each scheduler step at most this much.
_INLINE_WAIT_S = 0.005
# A chunk planned for saving is not planned again for this long (another request with the same
# prefix in the same batch would otherwise store it twice); after it, a chunk the store still
# lacks (say, its put failed) may be saved again.
_RECENT_SAVE_S = 30.0
_RECENT_SAVE_MAX = 1 << 16
# While a hand-off waits for the producer's chunks, the store is asked again this often.
_HANDOFF_RETRY_S = 0.01


@dataclass(slots=True)
class _RequestState:
    """What the scheduler half knows about one request."""

    keys: list[bytes]  # every full prompt chunk
    group_keys: list[list[bytes]]  # each KV cache group's keys of them
    loadable: int  # chunks that may be loaded: at least one prompt token is always computed
    future: Future[int] | None = None
    deadline: float = 0.0
    hits: int | None = None  # leading chunks the store holds, once known
    tiers: list[str] | None = None  # the tier holding each of them, once known
    load: int | None = None  # of those, the chunks to load (the cost model's plan), once decided
    load_from: int = 0  # num_computed_tokens vLLM presented with the answer
    saved: int = 0  # chunks [0, saved) are in the store or planned for saving
    has_saves: bool = False
    prompt_len: int = 0
    expect: int = 0  # leading chunks a producer reported stored (hand-off), else 0
    retention: Retention = KEEP  # what its kv_transfer_params ask (vllm_retention)
    wait_until: float = 0.0  # until when lookups are repeated for them
    next_lookup: float = 0.0  # no new lookup before this


class SchedulerSide:
    """The scheduler half of :class:`kvstore.integrations.vllm.KVStoreConnector`."""

    def __init__(
        self,
        settings: ConnectorSettings,
        vllm_config: VllmConfig,
        kv_cache_config: KVCacheConfig,
        client: StoreClient | None = None,
    ) -> None:
        """``client`` replaces the store client the scheduler would open (tests pass stand-ins)."""
        self.role = kv_role(vllm_config)
        self._loads = self.role != "kv_producer"
        self._saves = self.role != "kv_consumer"
        groups = engine_groups(kv_cache_config)
        shape = engine_shape(vllm_config, kv_cache_config, 0, anchor_group(groups))
        # Lookups use rank 0's keys: every rank saves the same chunks, and a rank whose own
        # chunk is missing reports a failed load, which vLLM recomputes.
        self._base = base_namespace(vllm_config, shape, settings, tp_rank=0)
        self._client = settings.open_client(self._base) if client is None else client
        self._breaker = Breaker(settings.retry_after_s, reconnected=self._client.when_reconnected)
        # The chunk size and hash algorithm are the store's (vllm_scheme).
        scheme_shape = dataclasses.replace(shape, block_size=scheme_block_size(groups))
        self.scheme = open_scheme(settings, self._client, self._base, scheme_shape, self._breaker)
        self._settings = settings = self.scheme.settings
        #: The engine's KV cache groups and their hit rules (kvstore.integrations.vllm.hybrid).
        self.layout = GroupLayout(groups, settings.chunk_size)
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvstore-lookup")
        # A lookup that outlives its (short) deadline stops lookups only: a loaded store is not
        # a dead one, and saves, with deadlines of their own, still reach it.
        self._slow = Breaker(
            settings.retry_after_s,
            warning="kvstore lookup too slow (%s); not looking up for %.1f s (saves go on)",
        )
        self._hashers: dict[tuple[str, str], ChunkHasher] = {}
        self._requests: dict[str, _RequestState] = {}
        self._pending_loads: list[LoadSpec] = []
        self._recent_saves: OrderedDict[bytes, float] = OrderedDict()
        self._kv_cache_manager: KVCacheManager | None = None
        self.counters = ConnectorCounters()
        # Load or recompute (kvstore.integrations.vllm.cost).
        self._bytes_per_token = token_bytes(shape)
        self._scale = context_scale(hidden_size(vllm_config))
        self.decider = LoadDecider(
            settings.load_policy,
            chunk_tokens=settings.chunk_size,
            chunk_bytes=settings.chunk_size * self._bytes_per_token,
            scale=self._scale,
        )
        # Connect now, off the critical path: the first call on a fresh channel pays for it.
        self._pool.submit(warm_up, self._client, self._breaker, settings.lookup_timeout_s)
        logger.info(
            "kvstore connector (scheduler, %s) -> %s, chunk %d tokens, namespace %s; "
            "kvstore router --namespace '%s'",
            self.role,
            settings.target,
            settings.chunk_size,
            self._base,
            namespace_to_json(self._base),
        )

    def bind_kv_cache_manager(self, manager: KVCacheManager) -> None:
        """Keep the cache manager: it has the block ids a save reads from."""
        self._kv_cache_manager = manager

    # -- lookups ----------------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` the store can supply; ``None`` = not known yet."""
        state = self._state(request)  # a producer still needs it: saves are planned from it
        if not self.layout.active:
            if state.keys:
                self.counters.record_unsupported(self.layout.unsupported)
                state.keys = []  # counted once; nothing of it is looked up or saved
            return 0, False
        if state.loadable == 0 or not self._loads:
            return 0, False
        if self.decider.rates_due(time.monotonic()):
            self._pool.submit(self._refresh_rates).add_done_callback(_log_failure)
        hits = self._poll_lookup(state)
        if hits is None:
            return None, False
        hit_tokens = self._planned(request, state, hits, num_computed_tokens)
        if hit_tokens <= num_computed_tokens:
            return 0, False
        state.load_from = num_computed_tokens
        # A hybrid engine's loads are asynchronous: vLLM cannot map a block id that failed to
        # load back to a request when ids are per group, only a failed request (worker half).
        return hit_tokens - num_computed_tokens, self.layout.hybrid

    def _planned(
        self, request: Request, state: _RequestState, hits: int, num_computed_tokens: int
    ) -> int:
        """Tokens of the leading hits worth loading: the cost model decides once per request."""
        hits = min(hits, state.loadable)
        if state.load is None:
            tiers = (state.tiers or [])[:hits]
            if len(tiers) < hits:  # an answer without tiers (never from a real store): load
                tiers += [""] * (hits - len(tiers))
            plan = self.decider.decide(request.request_id, tiers, num_computed_tokens)
            state.load = plan.load
            chunk = self._settings.chunk_size
            held = min(num_computed_tokens // chunk, hits)
            self.counters.record_declined(max(hits - max(plan.load, held), 0) * chunk)
            if plan.load < hits:
                # Bring the declined chunks up into dram in the background: recomputed now,
                # the next request with this prefix finds them in the fast tier.
                self._pool.submit(self._prefetch, state.keys[max(plan.load, held) : hits])
        return min(state.load, hits) * self._settings.chunk_size

    def _prefetch(self, keys: list[bytes]) -> None:
        if not keys:
            return
        try:
            self._client.prefetch(keys, timeout=self._settings.lookup_timeout_s)
        except KVStoreError as exc:
            logger.debug("kvstore prefetch of declined chunks failed: %s", exc)

    def _refresh_rates(self) -> None:
        """Fetch the store's measured tier rates for the cost model (off the scheduler)."""
        try:
            stats = self._client.stats(timeout=self._settings.lookup_timeout_s)
        except KVStoreError as exc:
            logger.debug("kvstore stats for the load plan failed: %s", exc)
            return
        self.decider.take_store_stats(stats)
        logger.debug("kvstore load plan inputs: %s", self.decider.inputs())

    def _state(self, request: Request) -> _RequestState:
        state = self._requests.get(request.request_id)
        if state is None:
            keys = self._keys(request)
            prompt_len = len(request.prompt_token_ids or ())
            chunk = self._settings.chunk_size
            state = _RequestState(
                keys=keys,
                group_keys=self.layout.keys(keys),
                loadable=min(len(keys), max(prompt_len - 1, 0) // chunk),
                prompt_len=prompt_len,
                expect=_handoff_chunks(request) if self._loads else 0,
                retention=request_retention(
                    getattr(request, "kv_transfer_params", None), request.request_id
                ),
            )
            if state.expect:
                state.wait_until = time.monotonic() + self._settings.handoff_wait_s
            self._requests[request.request_id] = state
        return state

    def _keys(self, request: Request) -> list[bytes]:
        tokens = request.prompt_token_ids
        # Multimodal placeholders and prompt embeddings are not described by token ids alone,
        # so such requests would alias other prompts' keys: they neither load nor save.
        if (
            tokens is None
            or request.mm_features
            or getattr(request, "prompt_embeds", None) is not None
        ):
            return []
        lora = request.lora_request
        lora_id = f"{lora.lora_name}@{lora.lora_path}" if lora is not None else ""
        salt = request.cache_salt or ""
        hasher = self._hashers.get((lora_id, salt))
        if hasher is None:
            hasher = make_hasher(self._settings, self._base, lora_id, salt)
            self._hashers[(lora_id, salt)] = hasher
        return [bytes(key) for key in hasher.keys(tokens)]

    def _poll_lookup(self, state: _RequestState) -> int | None:
        if state.hits is not None:
            return state.hits
        if state.future is None:
            if state.next_lookup and time.monotonic() < state.next_lookup:
                return None  # a hand-off's next lookup is not due yet
            if self._lookups_off():
                state.hits = 0
                self.counters.record_lookup(state.loadable * self._settings.chunk_size, 0, None)
                return 0
            timeout = self._settings.lookup_timeout_s
            keys = self.layout.lookup_keys(state.group_keys, state.loadable)
            state.future = self._pool.submit(self._lookup, state, keys, timeout)
            # The RPC's own deadline normally ends it; this covers a call stuck before it.
            state.deadline = time.monotonic() + 2 * timeout
        try:
            hits = state.future.result(timeout=_INLINE_WAIT_S)
        except TimeoutError:
            if time.monotonic() < state.deadline:
                return None
            logger.warning("kvstore lookup still pending after its deadline; treating as a miss")
            state.future.cancel()
            hits = 0
        except StoreUnavailableError as exc:
            self._breaker.trip(exc)
            hits = 0
        except DeadlineExceededError as exc:
            self._slow.trip(exc)
            hits = 0
        except KVStoreError as exc:
            logger.warning("kvstore lookup failed, treating as a miss: %s", exc)
            hits = 0
        state.future = None
        if self._handoff_pending(state, hits):
            return None
        state.hits = hits
        state.saved = max(state.saved, hits)
        chunk = self._settings.chunk_size
        self.counters.record_lookup(state.loadable * chunk, min(hits, state.loadable) * chunk, None)
        return hits

    def _handoff_pending(self, state: _RequestState, hits: int) -> bool:
        """Whether to look up again: a producer said more chunks are on their way to the store."""
        want = min(state.expect, state.loadable)
        if hits >= want or self._lookups_off():
            return False
        now = time.monotonic()
        if now < state.wait_until:
            state.next_lookup = now + _HANDOFF_RETRY_S
            return True
        logger.warning(
            "kvstore hand-off: %d of the %d chunks the producer saved reached the store within "
            "handoff_wait_s=%.1f; computing the rest",
            hits,
            want,
            self._settings.handoff_wait_s,
        )
        return False

    def _lookups_off(self) -> bool:
        return self._breaker.is_open() or self._slow.is_open()

    def _lookup(self, state: _RequestState, keys: list[bytes], timeout: float) -> int:
        started = time.perf_counter()
        answer = self._client.lookup_tiers(keys, timeout=timeout)
        hits, tiers = self.layout.hit(answer, state.loadable)
        state.tiers = tiers  # read once the future is done
        seconds = time.perf_counter() - started
        self.counters.record_lookup_latency(seconds)
        logger.debug(
            "kvstore lookup: %d keys -> %d hits in %.2f ms", len(keys), hits, seconds * 1e3
        )
        return hits

    # -- the step plan -----------------------------------------------------------------------

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        """Record the load of ``num_external_tokens`` tokens into the request's new blocks."""
        if num_external_tokens <= 0:
            return
        state = self._requests.get(request.request_id)
        if state is None:  # vLLM asked another connector; nothing of ours to load
            return
        self._pending_loads.extend(
            self.layout.load_specs(
                request.request_id,
                state.group_keys,
                blocks.get_block_ids(),
                state.load_from,
                state.load_from + num_external_tokens,
                null_block_id(self._kv_cache_manager),
            )
        )

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> StepPlan:
        """This step's loads (recorded since the last call) and saves; resets the loads."""
        meta = StepPlan(
            loads=self._pending_loads,
            preempted_req_ids=set(scheduler_output.preempted_req_ids or ()),
            chunk_size=self._settings.chunk_size,
        )
        self._pending_loads = []
        scheduled = scheduler_output.num_scheduled_tokens
        now = time.monotonic()
        self.decider.step_planned(self._step_work(scheduler_output), now)
        if self._saves and not self._breaker.is_open():
            for new in scheduler_output.scheduled_new_reqs:
                done = new.num_computed_tokens + scheduled.get(new.req_id, 0)
                self._plan_save(meta, new.req_id, done, now)
            cached = scheduler_output.scheduled_cached_reqs
            for req_id, computed in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
                self._plan_save(meta, req_id, computed + scheduled.get(req_id, 0), now)
        return meta

    def _step_work(self, scheduler_output: SchedulerOutput) -> float:
        """The step's prefill work (:func:`~kvstore.client.cost_model.prefill_work` units)."""
        scheduled = scheduler_output.num_scheduled_tokens
        scale = self._scale
        work = 0.0
        for new in scheduler_output.scheduled_new_reqs:
            start = new.num_computed_tokens
            work += prefill_work(start, start + scheduled.get(new.req_id, 0), scale)
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, start in zip(cached.req_ids, cached.num_computed_tokens, strict=True):
            work += prefill_work(start, start + scheduled.get(req_id, 0), scale)
        return work

    def update_connector_output(self, loaded_tokens: int, load_seconds: Sequence[float]) -> None:
        """A step's output arrived: it ends the step's timing; ``loaded_tokens`` (over all
        ranks) and each rank's ``load_seconds`` are the workers' loads in it."""
        ranks = len(load_seconds)
        load_s = sum(load_seconds) / ranks if ranks else 0.0
        self.decider.step_done(time.monotonic(), load_s)
        if loaded_tokens > 0 and ranks:
            self.decider.loads_done(loaded_tokens // ranks * self._bytes_per_token, load_s)

    def _plan_save(self, meta: StepPlan, req_id: str, computed: int, now: float) -> None:
        """Plan saving the prompt chunks that are complete once this step has run."""
        state = self._requests.get(req_id)
        if state is None or self._kv_cache_manager is None or not state.retention.stores:
            return
        ready = min(computed, state.prompt_len) // self._settings.chunk_size
        ready = min(ready, len(state.keys))
        if ready <= state.saved:
            return
        # The block table as it is now: blocks a sliding window dropped (null) are not saved.
        block_ids = self._kv_cache_manager.get_block_ids(req_id)
        chunks: list[int] = []
        for index in range(state.saved, ready):
            key = state.keys[index]
            # A retained request puts again what another just saved: the store retains it then.
            recent = now - self._recent_saves.get(key, -math.inf) < _RECENT_SAVE_S
            if recent and state.retention.is_default:
                continue
            self._remember_save(key, now)
            chunks.append(index)
        state.saved = ready
        specs = self.layout.save_specs(
            req_id,
            state.group_keys,
            block_ids,
            chunks,
            state.retention,
            null_block_id(self._kv_cache_manager),
        )
        if specs:
            meta.saves.extend(specs)
            state.has_saves = True

    def _remember_save(self, key: bytes, now: float) -> None:
        self._recent_saves[key] = now
        self._recent_saves.move_to_end(key)
        while len(self._recent_saves) > _RECENT_SAVE_MAX:
            self._recent_saves.popitem(last=False)

    def request_finished(
        self, request: Request, block_ids: object
    ) -> tuple[bool, dict[str, Any] | None]:
        """True while the workers may still read this request's blocks for a save; a
        producer's output also says how many leading chunks it stored (:data:`HANDOFF_KEY`)."""
        state = self._requests.pop(request.request_id, None)
        if state is None:
            return False, None
        if state.future is not None:
            state.future.cancel()
        params = {HANDOFF_KEY: state.saved} if self.role == "kv_producer" and state.keys else None
        return state.has_saves, params

    def take_stats(self) -> dict[str, Any] | None:
        """The lookups' figures since the last call (``None`` if none)."""
        return self.counters.take()

    def shutdown(self) -> None:
        """Stop the lookup pool and close the client."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()


def _log_failure(future: Future[None]) -> None:
    """A background call of the scheduler half that failed unexpectedly: say so."""
    if not future.cancelled() and (exc := future.exception()) is not None:
        logger.warning("kvstore background call failed: %r", exc, exc_info=exc)
