"""Executes one `SchedulerOutput`: encoder, embedding merge, LM forward over paged KV, sampling.

The runner keeps a copy of each running request's state (tokens, where its images sit,
blocks); the scheduler sends full data for new requests and deltas afterwards, and the
encoder's inputs of a step's images with that step.

`execute_model` returns as soon as the step is queued on the device: its sampled tokens
stay in a device buffer (`sampled`) and are copied to the host asynchronously, and
`StepResult.get()` waits for them (and for the log-probabilities of the requests that asked,
computed by the sampler next to the tokens and copied back alike). A step scheduled before
the previous step's tokens were read back (async scheduling) takes those tokens straight
from `sampled` on the device.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from vlmserve.config import StructuredOutputsConfig
from vlmserve.core.kv_cache_groups import FULL, CacheGroupSpec
from vlmserve.core.scheduler_output import NewRequestData, SchedulerOutput
from vlmserve.distributed.parallel_state import TensorParallel
from vlmserve.layers.attention import (
    add_group_metadata,
    build_attention_metadata,
    get_paged_attention_backend,
)
from vlmserve.layers.gated_deltanet import get_linear_attention_backend
from vlmserve.layers.grammar import (
    RequestGrammar,
    allocate_bitmask,
    apply_bitmask,
    fill_bitmasks,
)
from vlmserve.layers.grammar_compile import GrammarCompiler
from vlmserve.layers.sampler import (
    TokenHistory,
    compute_logprobs,
    compute_prompt_logprobs,
    logprob_dict,
    logprob_rows,
    sample,
)
from vlmserve.utils import to_device
from vlmserve.worker.cuda_graphs import DecodeGraphs
from vlmserve.worker.encoder_runner import EncoderRunner
from vlmserve.worker.kv_cache import allocate_kv_caches, set_kv_scales
from vlmserve.worker.linear_states import LINEAR, LinearStates, layer_kind_names
from vlmserve.worker.mm_embedding_store import HostShare, MMEmbeddingStore
from vlmserve.worker.timeline import DeviceTimeline


@dataclass
class CachedRequestState(NewRequestData):
    """The worker's copy of a running request; `token_ids` grows as sampled tokens are read
    back. `in_flight` tokens are sampled but not read back yet; the newest sampled token is
    row `sample_row` of the runner's `sampled` buffer."""

    generator: torch.Generator | None = None
    in_flight: int = 0
    sample_row: int = -1
    history: TokenHistory | None = None  # penalized requests': token counts on the device
    grammar: RequestGrammar | None = None  # structured output (the sampling rank only)


class StepResult:
    """The tokens one step sampled: `get()` waits for them once, appends them to the request
    states still alive, and returns {request id: token}. After `get()`, `logprobs` holds
    {request id: {token id: logprob}} for the requests that asked (`SamplingParams.logprobs`;
    see `layers/sampler.logprob_dict`), and `prompt_logprobs` {request id: (index of the
    first prompt token scored, a {token id: logprob} per token, the token's rank per token)}
    for the prompt chunks of requests that asked (`SamplingParams.prompt_logprobs`). `event`
    (CUDA) marks the end of the step on the device."""

    def __init__(self, runner: ModelRunner | None = None, states=(), host=None,
                 host_logprobs=None, host_prompt=None) -> None:
        # the runner's live request states (not the runner: it keeps its last result, and a
        # cycle would hold the whole model until a full collection)
        self._live = runner.requests if runner is not None else {}
        self._states, self._host = list(states), host
        # (rows of `states`, ids [M, 1 + k], values [M, 1 + k]) on the host, or None
        self._host_logprobs = host_logprobs
        # ([(request id, first token scored, tokens, k)], ids, values, ranks) on the host
        self._host_prompt = host_prompt
        self._tokens: dict[str, int] | None = (None if self._states or host_prompt is not None
                                               else {})
        self.logprobs: dict[str, dict[int, float]] = {}
        self.prompt_logprobs: dict[str, tuple[int, list[dict[int, float]], list[int]]] = {}
        self.event: torch.cuda.Event | None = None
        self.start: torch.cuda.Event | None = None  # the step's first event (its timeline's)
        # an event after the step's vision tower (CUDA, steps that encode), and the host's
        # milliseconds launching the tower: what the step trace splits a step by
        self.encoded: torch.cuda.Event | None = None
        self.encode_launch_ms: float | None = None
        self.encode_launch_cpu_ms: float | None = None

    def ready(self) -> bool:
        """Whether the device has finished the step (`get` would not wait)."""
        return self.event is None or self.event.query()

    def get(self) -> dict[str, int]:
        if self._tokens is None:
            if self.event is not None:
                self.event.synchronize()
            tokens = self._host.tolist() if self._host is not None else []
            for st, tok in zip(self._states, tokens):
                st.in_flight -= 1
                if self._live.get(st.request_id) is st:
                    st.token_ids.append(tok)
            self._tokens = {st.request_id: tok for st, tok in zip(self._states, tokens)}
            if self._host_logprobs is not None:
                rows, ids, values = self._host_logprobs
                for i, row_ids, row_values in zip(rows, ids.tolist(), values.tolist()):
                    st = self._states[i]
                    self.logprobs[st.request_id] = logprob_dict(
                        row_ids, row_values, st.sampling_params.logprobs)
            if self._host_prompt is not None:
                scored, ids, values, ranks = self._host_prompt
                ids, values, ranks, row = ids.tolist(), values.tolist(), ranks.tolist(), 0
                for rid, first, count, k in scored:
                    self.prompt_logprobs[rid] = (first, [
                        logprob_dict(ids[i], values[i], k) for i in range(row, row + count)],
                        ranks[row:row + count])
                    row += count
        return self._tokens


class ModelRunner:
    def __init__(self, model, device: torch.device, dtype: torch.dtype, num_blocks: int,
                 block_size: int, *, mm_offload: bool = False, max_num_batched_tokens: int = 0,
                 attention_backend: str = "torch", cuda_graph_max_batch: int = 0,
                 max_model_len: int = 0, encoder_cache_rows: int = 0,
                 tp: TensorParallel | None = None, encoder_tp: bool = False,
                 cache_groups: Sequence[CacheGroupSpec] | None = None,
                 num_state_slots: int = 0, linear_attention_backend: str = "torch",
                 kv_dtype: torch.dtype | None = None,
                 kv_scales: dict[int, tuple[float, float]] | None = None) -> None:
        """`kv_dtype`: the KV tensors' (None: `dtype`; e4m3: an FP8 cache, each attention
        layer given its (k_scale, v_scale) from `kv_scales`, 1.0 where it has none)."""
        self.model = model
        # tensor parallelism: every rank uses rank 0's sampled tokens, so no rank's state
        # depends on its logits being bitwise equal to rank 0's
        self.tp = tp
        self.device = device
        self.dtype = dtype
        self.block_size = block_size
        # a linear-attention layer's cache: its state pools (`num_state_slots` slots:
        # worker/linear_states.py)
        self.linear: LinearStates | None = None
        if LINEAR in layer_kind_names(model):
            self.linear = LinearStates(model, num_state_slots, device, dtype)
            model.set_linear_attention_backend(
                get_linear_attention_backend(linear_attention_backend, device))
        # the KV groups (`core/kv_cache_groups.py`; default: one full group of every layer)
        # and their tensors (worker/kv_cache.py; a linear layer's: its state pools)
        groups = [g for g in cache_groups or () if g.kind.kind != "linear"] or [
            CacheGroupSpec(FULL, tuple(range(model.num_layers)), num_blocks)]
        self.kv_groups = groups
        self.num_blocks = min(g.num_blocks for g in groups)  # a block id valid in every group
        self.kv_caches = allocate_kv_caches(model, groups, block_size, kv_dtype or dtype,
                                            device, self.linear)
        set_kv_scales(model, self.kv_caches, kv_scales or {})
        self.attention_fn = get_paged_attention_backend(attention_backend, device)
        model.set_attention_backend(self.attention_fn)
        share = (HostShare(tp.is_host_leader, tp.broadcast_in_host)
                 if tp is not None and tp.host_group is not None else None)
        self.store = MMEmbeddingStore(device, model.row_width, dtype, offload=mm_offload,
                                      buffer_rows=max_num_batched_tokens,
                                      host_rows=encoder_cache_rows, host_share=share)
        self.encoder = EncoderRunner(model, device, dtype, self.store,
                                     tp if encoder_tp else None)
        # the last step's sampled tokens on the device, and two host buffers for reading
        # them back (one per step in flight)
        rows = max(max_num_batched_tokens, 1)
        self.sampled = torch.zeros(rows, dtype=torch.int64, device=device)
        pin = device.type == "cuda"
        self._host_tokens = [torch.zeros(rows, dtype=torch.int64, pin_memory=pin)
                             for _ in range(2)]
        self._num_results = 0
        self.requests: dict[str, CachedRequestState] = {}
        # structured outputs: set by the engine core on the rank whose tokens are sampled
        # (`enable_structured_outputs`); None elsewhere (its tokens come from that rank)
        self.grammars: GrammarCompiler | None = None
        self._num_grammars = 0  # running requests with a grammar
        self._last_result: StepResult | None = None
        self._paused_generators: dict[str, torch.Generator | None] = {}
        self._paused_grammars: dict[str, Future] = {}  # preempted requests' compiled grammars
        self.graphs: DecodeGraphs | None = None
        self.num_graph_steps = 0
        self.timeline = DeviceTimeline() if device.type == "cuda" else None
        if cuda_graph_max_batch > 0:
            with torch.inference_mode():
                self.graphs = DecodeGraphs(model, self.kv_caches, self.sampled,
                                           cuda_graph_max_batch,
                                           -(-max_model_len // block_size), block_size,
                                           [g.num_blocks for g in groups], device,
                                           self.linear)

    def warmup(self, limits, processor, *, fused_ops=None, vision_attention_fn=None,
               image_sizes=None) -> float:
        """Compile every kernel variant a step can launch and leave the runner as it was
        (worker/warmup.py); returns the seconds spent."""
        from vlmserve.worker import warmup

        return warmup.run_warmup(self, limits, processor, fused_ops=fused_ops,
                                 vision_attention_fn=vision_attention_fn,
                                 image_sizes=warmup.DEFAULT_IMAGE_SIZES if image_sizes is None
                                 else image_sizes)

    def enable_structured_outputs(self, tokenizer, vocab_size: int,
                                  eos_token_ids: tuple[int, ...],
                                  limits: StructuredOutputsConfig | None = None) -> None:
        """Hold the requests that ask for structured output to it (this process samples;
        ``vocab_size``: the logits' width; ``limits``: what a grammar may ask and take)."""
        self.grammars = GrammarCompiler(tokenizer, vocab_size, eos_token_ids, limits)

    # ---- state -----------------------------------------------------------------------------

    def _update_states(self, so: SchedulerOutput) -> None:
        for rid in so.finished_request_ids:
            state = self.requests.pop(rid, None)
            if state is not None and state.grammar is not None:
                self._num_grammars -= 1
            if rid in so.preempted_request_ids:
                # a resumed request continues its random stream instead of restarting it
                # (and keeps its compiled grammar; its matcher starts over)
                if state is not None:
                    self._paused_generators[rid] = state.generator
                    if state.grammar is not None:
                        self._paused_grammars[rid] = state.grammar.compiled
            else:
                self._paused_generators.pop(rid, None)
                self._paused_grammars.pop(rid, None)
        self.store.free(so.free_encoder_hashes)
        for new in so.new_requests:
            sp = new.sampling_params
            gen = self._paused_generators.pop(new.request_id, None)
            if gen is None and sp.seed is not None and not sp.greedy:
                gen = torch.Generator(device=self.device).manual_seed(sp.seed)
            state = self.requests[new.request_id] = CachedRequestState(
                **{**vars(new), "token_ids": list(new.token_ids),
                   "block_ids": list(new.block_ids),
                   "extra_block_ids": [list(t) for t in new.extra_block_ids]},
                generator=gen)
            if sp.structured_outputs is not None and self.grammars is not None:
                compiled = self._paused_grammars.pop(new.request_id, None)
                if compiled is None:
                    compiled = self.grammars.take(new.request_id, sp.structured_outputs)
                state.grammar = RequestGrammar(new.request_id, compiled)
                self._num_grammars += 1
        if self.linear is not None:  # resumed from a prefix-cache snapshot: its states
            self.linear.copy([(new.restore_slot, new.state_slot) for new in so.new_requests
                              if new.restore_slot is not None])
        for cached in so.cached_requests:
            state = self.requests[cached.request_id]
            state.block_ids.extend(cached.new_block_ids)
            for table, new_ids in zip(state.extra_block_ids, cached.new_extra_block_ids,
                                      strict=True):
                table.extend(new_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    # ---- one step --------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> StepResult:
        """Queue the step; its result holds the token sampled for each request whose chunk
        reached the end of its tokens."""
        start = self.timeline.mark() if self.timeline is not None else None
        self._update_states(so)
        self.store.begin_step()
        try:
            encoded = launch_ms = cpu_ms = None
            if so.encoder_inputs:  # the tower's launch timed (wall and this thread's CPU)
                began, began_cpu = time.perf_counter(), time.thread_time()
                self.encoder.run(so.encoder_inputs)
                encoded = self.timeline.mark() if start is not None else None
                launch_ms = 1e3 * (time.perf_counter() - began)
                cpu_ms = 1e3 * (time.thread_time() - began_cpu)
            self.store.prefetch(so.prefetch)  # overlaps with this step's compute
            result = self._run_lm(so)
        finally:
            self.store.end_step()
        result.encoded, result.encode_launch_ms = encoded, launch_ms
        result.encode_launch_cpu_ms = cpu_ms
        if start is not None:  # one event ends the step, for the timeline and the read-back
            result.event = self.timeline.add(start)
            result.start = start
        return result

    def _run_lm(self, so: SchedulerOutput) -> StepResult:
        if so.is_empty:
            return StepResult()
        states = [self.requests[rid] for rid in so.num_scheduled_tokens]
        query_lens = list(so.num_scheduled_tokens.values())
        host_prompt = None
        if (self.graphs is not None and len(states) <= self.graphs.max_batch()
                and all(n == 1 and st.num_computed_tokens >= st.num_prompt_tokens
                        for st, n in zip(states, query_lens))):
            self.num_graph_steps += 1
            logits = self.graphs.run(states)  # [B, vocab]
            to_sample = states
            if self.linear is not None and so.snapshots:  # decodes completing a block: the
                # states at their end
                self.linear.copy([(self.requests[rid].state_slot, slot)
                                  for rid, _, slot in so.snapshots])
        else:
            hidden, to_sample, prompt = self._forward_eager(states, query_lens, so.snapshots)
            host_prompt = self._prompt_logprobs(*prompt) if prompt is not None else None
            if not to_sample:  # prefill chunks only: nothing to sample
                return StepResult(self, host_prompt=host_prompt)
            logits = self.model.compute_logits(hidden)  # [N, vocab]
        params = [st.sampling_params for st in to_sample]
        logits = self._apply_grammars(to_sample, logits)
        history, banned = self._penalty_inputs(to_sample, logits.shape[1])
        tokens = sample(logits, params, [st.generator for st in to_sample], history, banned)
        if self.tp is not None:
            self.tp.broadcast_tensor(tokens)
        for i, h in enumerate(history or ()):
            if h is not None:
                h.count(tokens[i:i + 1])
        n = len(to_sample)
        self.sampled[:n].copy_(tokens)
        host = self._host_tokens[self._num_results % 2][:n]
        self._num_results += 1
        host.copy_(tokens, non_blocking=True)
        host_logprobs = None
        rows = logprob_rows(params)
        if rows:  # only in steps where a request asked
            ids, values = compute_logprobs(logits, tokens, rows,
                                           max(params[i].logprobs for i in rows))
            if ids.device.type != "cpu":  # pinned (the caching host allocator): no sync
                ids, values = (torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(
                    t, non_blocking=True) for t in (ids, values))
            host_logprobs = (rows, ids, values)
        for i, st in enumerate(to_sample):
            st.in_flight += 1
            st.sample_row = i
        self._last_result = StepResult(self, to_sample, host, host_logprobs, host_prompt)
        return self._last_result

    def _prompt_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor,
                         scored: list[tuple[str, int, int, int]]) -> tuple:
        """The log-probabilities of a step's scored prompt tokens, on their way to the host
        (pinned on CUDA: no wait here)."""
        out = compute_prompt_logprobs(self.model.compute_logits, hidden, targets,
                                      max(k for *_, k in scored))
        if out[0].device.type != "cpu":
            out = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(
                t, non_blocking=True) for t in out)
        return (scored, *out)

    def _apply_grammars(self, states: list[CachedRequestState], logits: torch.Tensor
                        ) -> torch.Tensor:
        """``logits`` with each structured request's disallowed tokens at -inf (in place: the
        log-probabilities see the mask). Its matcher needs every token sampled so far: a
        token still in flight (async scheduling) is read back first, which waits for the
        previous step only (this step's forward is queued behind it, so the device stays
        busy while the host fills the bitmask)."""
        if not self._num_grammars:  # the usual step: nothing per row
            return logits
        rows = [i for i, st in enumerate(states) if st.grammar is not None and st.grammar.active]
        if not rows:
            return logits
        if any(states[i].in_flight for i in rows):
            self._last_result.get()
        rows = [i for i in rows
                if states[i].grammar.catch_up(states[i].token_ids[states[i].num_prompt_tokens:])]
        if not rows:
            return logits
        bitmask = allocate_bitmask(len(rows), self.grammars.vocab_size)
        fill_bitmasks([states[i].grammar for i in rows], list(range(len(rows))), bitmask)
        return apply_bitmask(logits, bitmask, rows)

    def _penalty_inputs(self, states: list[CachedRequestState], vocab: int
                        ) -> tuple[list[TokenHistory | None] | None, list[list[int]] | None]:
        """Per row to sample: a penalized request's token history (built at its first sampled
        token, when nothing is in flight and `token_ids` is complete) and the tokens it may
        not sample yet (before min_tokens are out, read back or in flight: its stop tokens and
        EOS); each list None when no row has any (the usual step)."""
        history: list[TokenHistory | None] | None = None
        banned: list[list[int]] | None = None
        for i, st in enumerate(states):
            sp = st.sampling_params
            if sp.penalized:
                if st.history is None:
                    st.history = TokenHistory(sp, st.token_ids, st.num_prompt_tokens, vocab,
                                              self.device)
                history = history or [None] * len(states)
                history[i] = st.history
            if sp.min_tokens and (len(st.token_ids) - st.num_prompt_tokens + st.in_flight
                                  < sp.min_tokens):
                banned = banned or [[] for _ in states]
                banned[i] = [*sp.stop_token_ids, *(() if sp.ignore_eos else st.eos_token_ids)]
        return history, banned

    def _forward_eager(self, states, query_lens, snapshots=()):
        """Any mix of prefill chunks and decodes. Returns the hidden states of the tokens to
        sample from, their requests, and for the prompt tokens whose log-probabilities were
        asked for (`prompt_logprobs`, before the request's first token) the hidden states
        that predict them, the tokens and [(request id, index of the first, count, k)]
        (None when no chunk has any)."""
        token_ids: list[int] = []
        text_pos: list[int] = []  # index + the request's position offset, of every token
        # (flat offset, the processor's positions of those prompt tokens)
        prompt_spans: list[tuple[int, torch.Tensor]] = []
        seq_lens = []
        dest_rows: list[int] = []
        spans: list[tuple[str, int, int]] = []
        sample_index: list[int] = []
        to_sample = []
        from_sampled: list[tuple[int, int]] = []  # (flat index, row of `sampled`)
        scored_rows: list[int] = []  # flat rows whose logits score the next prompt token
        scored_tokens: list[int] = []
        scored: list[tuple[str, int, int, int]] = []
        base = 0
        for st, n in zip(states, query_lens):
            start, end = st.num_computed_tokens, st.num_computed_tokens + n
            known = len(st.token_ids)
            assert end <= known + st.in_flight
            token_ids.extend(st.token_ids[start:end])
            if end > known:  # a decode of the token the previous step sampled
                assert st.in_flight and start == known
                from_sampled.append((base, st.sample_row))
                token_ids.append(0)
            if st.prompt_positions is not None and start < st.num_prompt_tokens:
                prompt_spans.append(
                    (base, st.prompt_positions[:, start:min(end, st.num_prompt_tokens)]))
            offset = st.position_offset
            text_pos.extend(range(start + offset, end + offset))
            seq_lens.append(end)
            for img in st.mm_features:
                lo, hi = max(start, img.offset), min(end, img.offset + img.length)
                if lo < hi:
                    spans.append((img.mm_hash, lo - img.offset, hi - img.offset))
                    dest_rows.extend(range(base + lo - start, base + hi - start))
            k = st.sampling_params.prompt_logprobs
            if k is not None and known == st.num_prompt_tokens and not st.in_flight:
                last = min(end, known - 1)  # position i scores token i + 1
                if start < last:
                    scored_rows.extend(range(base, base + last - start))
                    scored_tokens.extend(st.token_ids[start + 1:last + 1])
                    scored.append((st.request_id, start + 1, last - start, k))
            base += n
            if end == known + st.in_flight:
                sample_index.append(base - 1)
                to_sample.append(st)

        ids = to_device(torch.tensor(token_ids, dtype=torch.int64), self.device)
        if from_sampled:
            flat, rows = torch.tensor(from_sampled, dtype=torch.int64).t()
            ids[to_device(flat, self.device)] = self.sampled[to_device(rows, self.device)]
        embeds = self.model.embed_tokens(ids)  # [T, hidden]
        rows = self.store.gather(spans)  # [len(dest_rows), row width]
        extra = {}
        if rows is not None:
            dest = to_device(torch.tensor(dest_rows, dtype=torch.int64), self.device)
            extra = self.model.merge_image_rows(embeds, dest, rows)
        pos = to_device(self.model.position_scheme.build(text_pos, prompt_spans), self.device)
        meta = build_attention_metadata(query_lens, seq_lens, [st.block_ids for st in states],
                                        self.block_size, self.device)
        if getattr(self.model, "bidirectional_images", False):  # each image's tokens, both ways
            meta.bidirectional = [
                (i, f.offset, f.offset + f.length)
                for i, (st, n) in enumerate(zip(states, query_lens, strict=True))
                for f in st.mm_features
                if f.offset < st.num_computed_tokens + n
                and f.offset + f.length > st.num_computed_tokens]
        elif getattr(self.model, "bidirectional_prompt", False):  # the prompt's, both ways
            meta.bidirectional = [
                (i, 0, st.num_prompt_tokens) for i, st in enumerate(states)
                if st.num_computed_tokens < st.num_prompt_tokens]
        if len(self.kv_groups) > 1:
            add_group_metadata(meta, [[st.extra_block_ids[g] for st in states]
                                      for g in range(len(self.kv_groups) - 1)])
        step_states = None
        if self.linear is not None:
            step_states = self.linear.prepare(states, query_lens, list(snapshots))
            meta.linear = step_states.meta
        hidden = self.model(embeds, pos, self.kv_caches, meta, **extra)  # [T, hidden]
        if step_states is not None:
            self.linear.copy(step_states.after)
        prompt = None
        if scored:
            rows, tokens = (to_device(torch.tensor(v, dtype=torch.int64), self.device)
                            for v in (scored_rows, scored_tokens))
            prompt = hidden.index_select(0, rows), tokens, scored
        if not sample_index:
            return None, [], prompt
        index = to_device(torch.tensor(sample_index, dtype=torch.int64), self.device)
        return hidden.index_select(0, index), to_sample, prompt

