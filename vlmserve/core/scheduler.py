"""Continuous-batching scheduler with chunked prefill through images.

One rule, every step: bring each request's `num_computed_tokens` up to its `num_tokens`
within the step's token budget. Prefill, chunked prefill and decode are that rule at
different sizes. Running requests go first (FCFS), then waiting ones. An image is encoded in
the step whose chunk first needs its rows, within a per-step encoder budget; if the budget
is spent, the chunk stops just before the image. When KV blocks run out, the most recently
arrived running request is preempted and later recomputed from scratch.

Progress is committed when a step is scheduled: `num_computed_tokens` advances by the chunk,
and a chunk that reaches the end of the known tokens adds a placeholder for the token it will
sample. So the next step can be scheduled before this one's tokens are read back (the engine's
async scheduling); `update_from_output` replaces placeholders with tokens and applies stops.
A request that stops while its next step is already scheduled just has that token dropped.

A step that raises in the worker fails no one it cannot blame (`fail_steps`): a request that
ran alone finishes with an error; the others are recomputed and become suspects, each run in
steps of its own (every other step, while others have work) until it finishes, so one bad
request cannot fail its neighbours twice.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from vlmserve.core.admission import AdmissionLimits
from vlmserve.core.chunk_plan import plan_chunk
from vlmserve.core.kv_cache_groups import CacheGroupSpec
from vlmserve.core.kv_cache_manager import KVCacheManager
from vlmserve.core.mm_cache_manager import EncoderCacheManager
from vlmserve.core.prefetch_plan import predict_next_rows
from vlmserve.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from vlmserve.core.suspects import Suspects
from vlmserve.request import Request, RequestStatus


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_free_kv_blocks: int
    encoder_cache_rows: int
    encoder_cache_entries: int
    encoder_cache_referenced: int
    num_preemptions: int
    num_images_encoded: int
    num_encoder_cache_hits: int
    num_encoder_cache_evictions: int
    prefix_cache_queried_tokens: int  # prompt tokens looked up at admission
    prefix_cache_hit_tokens: int  # of which found cached
    prefix_cache_hit_rate: float
    num_cached_kv_blocks: int


class Scheduler:
    def __init__(
        self,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        num_kv_blocks: int,
        block_size: int,
        max_num_encoder_tokens: int,
        encoder_cache_rows: int,
        enable_chunked_prefill: bool = True,
        max_num_prefill_tokens_while_decoding: int | None = None,
        max_num_encoder_tokens_while_decoding: int | None = None,
        retain_encoder_outputs: bool = False,
        plan_prefetch: bool = True,
        enable_prefix_caching: bool = False,
        whole_images: bool = False,
        cache_groups: Sequence[CacheGroupSpec] | None = None,
        num_snapshot_slots: int = 0,
    ) -> None:
        self.max_num_seqs = max_num_seqs
        self.plan_prefetch = plan_prefetch  # only the offloading worker reads the plan
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        # the model reads each image's tokens both ways: a prefill chunk never ends inside one
        self.whole_images = whole_images
        # image rows a step may encode, and the encoder cache's rows: both as resolved
        # (`config.resolve_config`), like every budget here
        self.max_num_encoder_tokens = max_num_encoder_tokens
        # prompt tokens a step with decodes may carry (None: no limit but the step budget)
        self.max_num_prefill_tokens_while_decoding = max_num_prefill_tokens_while_decoding
        # image rows such a step may encode beyond its first image (None: the encoder budget)
        self.max_num_encoder_tokens_while_decoding = max_num_encoder_tokens_while_decoding
        # `cache_groups`: one per attention kind of the model's layers (None: all full, one
        # group of `num_kv_blocks`); `num_snapshot_slots`: the linear group's snapshots
        self.kv = KVCacheManager(num_kv_blocks, block_size, enable_prefix_caching,
                                 groups=cache_groups, max_num_seqs=max_num_seqs,
                                 num_snapshot_slots=num_snapshot_slots,
                                 chunk_tokens=max_num_batched_tokens)
        self.encoder_cache = EncoderCacheManager(encoder_cache_rows,
                                                 retain=retain_encoder_outputs)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._on_worker: set[str] = set()  # requests whose state the worker holds
        # blocks the worker knows of, per request and KV group
        self._sent_blocks: dict[str, list[int]] = {}
        self._finished_ids: set[str] = set()
        self._preempted_ids: set[str] = set()
        self.num_preemptions = 0
        self._suspects = Suspects()  # were in a failed step: each runs alone (`fail_step`)
        self.num_failed_steps = 0

    # ---- admission -------------------------------------------------------------------------

    @property
    def limits(self) -> AdmissionLimits:
        """What admission checks against: front ends in other processes check the same."""
        return AdmissionLimits(
            max_model_len=self.max_model_len,
            max_num_batched_tokens=self.max_num_batched_tokens,
            enable_chunked_prefill=self.enable_chunked_prefill,
            max_kv_tokens=self.kv.max_kv_tokens,
            max_num_encoder_tokens=self.max_num_encoder_tokens,
            encoder_cache_rows=self.encoder_cache.capacity_rows,
            whole_images=self.whole_images)

    def check_admissible(self, req: Request) -> str | None:
        """Why a request can never be served with this configuration, or None."""
        return self.limits.check(req.num_prompt_tokens, [f.length for f in req.mm_features])

    def add_request(self, req: Request) -> None:
        reason = self.check_admissible(req)
        assert reason is None, reason
        assert req.request_id not in self.requests, f"duplicate request id {req.request_id}"
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def num_waiting_tokens(self) -> int:
        """Tokens the waiting requests still have to prefill."""
        return sum(r.num_tokens - r.num_computed_tokens for r in self.waiting)

    # How far a front end preprocesses ahead: synchronously while less than a step's tokens
    # wait; while the device is busy, up to a batch of requests and two steps of tokens, so
    # that the long prefill steps of one wave preprocess the next (docs/benchmarks.md, W1).

    def needs_requests(self) -> bool:
        """Less than one step's worth of prompt tokens waits: admit more before a step."""
        return self.num_waiting_tokens() < self.max_num_batched_tokens

    def has_room_ahead(self) -> bool:
        """Queueing one more request ahead is useful (fewer than `max_num_seqs` requests or
        two steps' worth of prompt tokens wait)."""
        return (len(self.waiting) < self.max_num_seqs
                or self.num_waiting_tokens() < 2 * self.max_num_batched_tokens)

    # ---- scheduling ------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        enc_budget = self.max_num_encoder_tokens
        preempted = False
        eligible = self._suspects.eligibility(self.running, self.waiting)
        capped = (self.max_num_prefill_tokens_while_decoding is not None
                  or self.max_num_encoder_tokens_while_decoding is not None)
        decoding = capped and any(eligible(r) and r.decodes_next for r in self.running)
        prefill_budget = self._prefill_budget(budget, decoding)
        # image rows a step with decodes may encode: both caps, but its first image always
        # fits (an image is encoded whole, and must not wait for the decodes to end)
        enc_soft = enc_budget
        if decoding:
            enc_soft = min(enc_budget, prefill_budget,
                           self.max_num_encoder_tokens_while_decoding or enc_budget)

        def plan(req: Request, tokens: int) -> tuple[int, list[int], int]:
            first = enc_budget if enc_budget == self.max_num_encoder_tokens else 0
            return plan_chunk(req, tokens, max(enc_soft, 0), first, self.encoder_cache,
                              whole_images=self.whole_images,
                              chunked=self.enable_chunked_prefill)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if not eligible(req):
                i += 1
                continue
            start = req.num_computed_tokens
            if req.num_placeholders and self._length_done(
                    req, len(req.output_token_ids) + req.num_placeholders):
                i += 1  # its in-flight token is its last: nothing more to compute
                continue
            if req.decodes_next:  # one token, past every image: nothing to plan
                num_new, enc_ids, enc_cost = 1, [], 0
            else:
                num_new, enc_ids, enc_cost = plan(req, min(budget, prefill_budget))
                prefill_budget -= num_new
                if num_new == 0:
                    i += 1
                    continue
            while not self.kv.allocate_slots(req.request_id, start + num_new, start,
                                             req.mm_features):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:
                break  # req itself was preempted; everything after it already was too
            self._commit_chunk(req, num_new, enc_ids, out)
            budget -= num_new
            enc_budget -= enc_cost
            enc_soft -= enc_cost
            i += 1

        budget = min(budget, prefill_budget)  # what new requests may take: prompt tokens
        while (self.waiting and budget > 0 and not preempted
               and len(self.running) < self.max_num_seqs):
            req = next((r for r in self.waiting if eligible(r)), None)
            if req is None:
                break
            hit = self.kv.admit_cached_prefix(req)
            remaining = req.num_tokens - req.num_computed_tokens
            num_new, enc_ids, enc_cost = 0, [], 0
            if self.enable_chunked_prefill or remaining <= budget:
                num_new, enc_ids, enc_cost = plan(req, budget)
            if num_new == 0 or not self.kv.allocate_slots(
                    req.request_id, req.num_computed_tokens + num_new,
                    req.num_computed_tokens, req.mm_features):
                if hit:  # not admitted after all: give the prefix back
                    self.kv.free(req.request_id)
                    req.num_computed_tokens = 0
                break
            if self.kv.enable_prefix_caching:
                self.kv.num_queried_tokens += req.num_tokens
                self.kv.num_hit_tokens += hit
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._commit_chunk(req, num_new, enc_ids, out)
            budget -= num_new
            enc_budget -= enc_cost
            enc_soft -= enc_cost

        out.free_encoder_hashes = self.encoder_cache.take_freed()
        out.finished_request_ids = self._finished_ids
        out.preempted_request_ids = self._preempted_ids & self._finished_ids
        self._finished_ids, self._preempted_ids = set(), set()
        if self.plan_prefetch:
            out.prefetch = predict_next_rows(
                self.running, self.waiting, self.max_num_seqs - len(self.running),
                self.max_num_batched_tokens,
                self._prefill_budget(self.max_num_batched_tokens,
                                     any(r.decodes_next for r in self.running)),
                self.encoder_cache)
        return out

    # ---- prefix caching --------------------------------------------------------------------

    def reset_prefix_cache(self) -> None:
        self.kv.reset_prefix_cache()
        for req in self.requests.values():  # what they hold now stays unkeyed
            req.num_registered_blocks = req.num_computed_tokens // self.kv.block_size

    def fail_step(self, failed: SchedulerOutput, lost: list[SchedulerOutput],
                  error: str) -> list[Request]:
        """Step `failed` raised in the worker, and the results of the steps `lost` (in flight
        with it) are gone too. If `failed` ran one request, that is the cause: it finishes
        with `FINISHED_ERROR` and is returned. Its requests otherwise, and those of the lost
        steps, are reset to recompute (their KV, in-flight tokens and the images encoded for
        them dropped); the failed step's become suspects, each run alone from now on until
        it finishes."""
        self.num_failed_steps += 1
        outs = [failed, *lost]
        for so in outs:  # the worker may not have taken these in: tell it again
            self._finished_ids |= so.finished_request_ids
            self._preempted_ids |= so.preempted_request_ids
        # images those steps encoded may never have reached the store: forget them
        self.encoder_cache.forget([h for so in outs for h in so.encoder_inputs])
        culprits = [self.requests[rid] for rid in failed.num_scheduled_tokens
                    if rid in self.requests]
        errored = []
        if len(failed.num_scheduled_tokens) == 1:
            errored = culprits
            for req in errored:
                req.error = error
                self.finish_request(req.request_id, RequestStatus.FINISHED_ERROR)
        else:
            self._suspects.ids.update(req.request_id for req in culprits)
        for rid in {rid for so in outs for rid in so.num_scheduled_tokens}:
            req = self.requests.get(rid)
            if req is None:
                continue
            req.num_placeholders = 0  # their tokens never come
            if req.status is RequestStatus.RUNNING:
                self.running.remove(req)
                self._preempt(req)
        return errored

    def _prefill_budget(self, budget: int, decoding: bool) -> int:
        """Prompt tokens a step of `budget` tokens may take: fewer when it carries decodes
        (`max_num_prefill_tokens_while_decoding`)."""
        cap = self.max_num_prefill_tokens_while_decoding
        if cap is not None and decoding:
            return min(cap, budget)
        return budget

    def _commit_chunk(
        self, req: Request, num_new: int, enc_ids: list[int], out: SchedulerOutput
    ) -> None:
        start = req.num_computed_tokens
        if start < req.images_end:
            self._commit_images(req, num_new, enc_ids, out)
        rid = req.request_id
        out.num_scheduled_tokens[rid] = num_new
        out.chunk_ends[rid] = start + num_new
        tables = self.kv.group_block_ids(rid)
        if rid in self._on_worker:
            sent = self._sent_blocks[rid]
            out.cached_requests.append(CachedRequestData(
                rid, tables[0][sent[0]:], start,
                [t[n:] for t, n in zip(tables[1:], sent[1:], strict=True)]))
        else:
            assert not req.num_placeholders, "a request is sent whole only with known tokens"
            self._on_worker.add(rid)
            out.new_requests.append(NewRequestData(
                request_id=rid,
                token_ids=list(req.all_token_ids),
                num_prompt_tokens=req.num_prompt_tokens,
                mm_features=req.mm_features,
                prompt_positions=req.prompt_positions,
                position_offset=req.position_offset,
                sampling_params=req.sampling_params,
                eos_token_ids=req.eos_token_ids,
                block_ids=list(tables[0]),
                num_computed_tokens=start,
                extra_block_ids=[list(t) for t in tables[1:]],
                state_slot=self.kv.state_slot(rid),
                restore_slot=self.kv.pop_restore(rid),
            ))
        self._sent_blocks[rid] = [len(t) for t in tables]
        out.snapshots += [(rid, pos, slot)
                          for pos, slot in self.kv.reserve_snapshots(req, start, start + num_new)]
        req.num_computed_tokens = start + num_new
        if start + num_new == req.num_tokens:  # reaches the end: the step samples a token
            req.num_placeholders += 1

    def _commit_images(
        self, req: Request, num_new: int, enc_ids: list[int], out: SchedulerOutput
    ) -> None:
        """Reference the images the chunk reads and reserve those it encodes."""
        start = req.num_computed_tokens
        needed = [img for img in req.mm_features
                  if img.offset < start + num_new and img.offset + img.length > start]
        new_hashes = {req.mm_features[idx].mm_hash for idx in enc_ids}
        # reuse present entries first, so that allocating new ones cannot evict them
        for img in needed:
            if img.mm_hash not in new_hashes:
                self.encoder_cache.add_ref(img.mm_hash, req.request_id)
        for idx in enc_ids:
            img = req.mm_features[idx]
            self.encoder_cache.allocate(img.mm_hash, img.length, req.request_id)
            out.encoder_inputs[img.mm_hash] = req.encoder_inputs[img.mm_hash]

    def _drop_from_worker(self, req: Request) -> None:
        if req.request_id in self._on_worker:
            self._on_worker.discard(req.request_id)
            self._finished_ids.add(req.request_id)
        self._sent_blocks.pop(req.request_id, None)

    def _release(self, req: Request) -> None:
        self.kv.free(req.request_id)
        self.encoder_cache.release_all(req.request_id, [img.mm_hash for img in req.mm_features])
        self._drop_from_worker(req)

    def _preempt(self, req: Request) -> None:
        self._release(req)
        self._preempted_ids.add(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the step --------------------------------------------------------------------

    def update_from_output(
        self, out: SchedulerOutput, sampled: dict[str, int]
    ) -> list[Request]:
        """After step `out` ran: release the images its chunks consumed, replace placeholders
        with the sampled tokens, finish requests that hit a stop token or a length limit.
        Returns the requests that got a new token."""
        updated = []
        for rid, end in out.chunk_ends.items():
            req = self.requests.get(rid)
            if req is None:
                continue  # finished or aborted since: its token, if any, is dropped
            if req.status is RequestStatus.RUNNING and end - out.num_scheduled_tokens[rid] \
                    < req.images_end:
                self._release_consumed_images(req, end)
            if self.kv.enable_prefix_caching and req.status is RequestStatus.RUNNING:
                self.kv.register_filled(req, end)
            token = sampled.get(rid)
            if token is None:
                continue
            # a request preempted after this step was scheduled still takes its token
            req.num_placeholders -= 1
            req.output_token_ids.append(token)
            updated.append(req)
            status = self._check_stop(req, token)
            if status is not None:
                self.finish_request(rid, status)
        return updated

    def _release_consumed_images(self, req: Request, done: int) -> None:
        needed = {img.mm_hash for img in req.mm_features if img.offset + img.length > done}
        for img in req.mm_features:
            if img.offset + img.length <= done and img.mm_hash not in needed:
                self.encoder_cache.release(img.mm_hash, req.request_id)

    def _length_done(self, req: Request, n_out: int) -> bool:
        """`n_out` output tokens reach max_tokens or max_model_len."""
        max_tokens = req.sampling_params.max_tokens
        return ((max_tokens is not None and n_out >= max_tokens)
                or req.num_prompt_tokens + n_out >= self.max_model_len)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        if len(req.output_token_ids) > sp.min_tokens and (
                token in sp.stop_token_ids
                or (not sp.ignore_eos and token in req.eos_token_ids)):
            return RequestStatus.FINISHED_STOPPED
        if self._length_done(req, len(req.output_token_ids)):
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(self, request_id: str, status: RequestStatus) -> None:
        """Finish (or abort) a request and release everything it holds."""
        assert status.finished
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        self._preempted_ids.discard(request_id)
        self._suspects.ids.discard(request_id)
        if req.status == RequestStatus.PREEMPTED:
            self._finished_ids.add(request_id)  # the worker still holds its paused generator
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = status
        self._release(req)

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            num_free_kv_blocks=self.kv.num_free_blocks,
            encoder_cache_rows=self.encoder_cache.used_rows,
            encoder_cache_entries=self.encoder_cache.num_entries,
            encoder_cache_referenced=self.encoder_cache.num_referenced,
            num_preemptions=self.num_preemptions,
            num_images_encoded=self.encoder_cache.num_encoded,
            num_encoder_cache_hits=self.encoder_cache.num_hits,
            num_encoder_cache_evictions=self.encoder_cache.num_evictions,
            prefix_cache_queried_tokens=self.kv.num_queried_tokens,
            prefix_cache_hit_tokens=self.kv.num_hit_tokens,
            prefix_cache_hit_rate=self.kv.num_hit_tokens / max(self.kv.num_queried_tokens, 1),
            num_cached_kv_blocks=self.kv.num_cached_blocks,
        )
