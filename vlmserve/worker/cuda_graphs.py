"""CUDA graphs of the language model's decode step, one per padded batch size.

Decode-only steps replay a captured graph instead of launching every kernel from Python.
The graph reads persistent buffers (token ids, positions: one row, viewed as the model's
position scheme takes them; KV slots, block tables, context lengths) that each step fills by
copy; rows past the real batch are padding that writes its KV into a scratch block nobody
owns. Image rows never enter a decode step (placeholders are prompt tokens), so multimodal
requests decode on graphs too. Steps with prefill chunks run eagerly.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from vlmserve.layers.attention import AttentionMetadata
from vlmserve.layers.linear_metadata import LinearAttentionMetadata, conv_rows

logger = logging.getLogger(__name__)


def capture_graph(fn, pool, error_mode: str = "global") -> tuple[torch.cuda.CUDAGraph, Any]:
    """A graph of ``fn`` in ``pool`` and its output (computed once the graph is replayed):
    two eager runs on a side stream first (Triton compiles; cuDNN and cuBLAS choose), then
    the capture on that stream (``error_mode``: torch's ``capture_error_mode``).

    Not `torch.cuda.graph`: it synchronizes the device and empties the caching allocators
    (device and pinned host) before every capture, so that a graph captured while serving
    (a vision bucket met for the first time) would stall the step loop and make later
    allocations fresh cudaMalloc or cudaHostAlloc calls. The capture itself runs no work, so the
    side stream's pending warm-up runs need no wait."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        for _ in range(2):
            fn()
        graph.capture_begin(pool=pool, capture_error_mode=error_mode)
        try:
            out = fn()
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)
    return graph, out


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, 64, 8)) + list(range(64, 513, 32))
    return [s for s in sizes if s <= max_batch] or [1]


class _Staging:
    """Pinned host inputs of one decode step: int64 [ids | positions | slots | sampled rows
    | the other KV groups' slots | linear-attention state slots, with `scratch_state`] and
    int32 [seq_lens | block table rows | the other KV groups' block table rows], with the
    owner of each table row. `scratch_block`: the first KV group's scratch block,
    `extra_scratch` the other groups' (their extra blocks); `scratch_state`: the state
    pools' scratch slot, where padding rows write (None: no linear-attention layers)."""

    def __init__(self, n: int, max_blocks: int, block_size: int, scratch_block: int,
                 extra_scratch: tuple[int, ...] = (), scratch_state: int | None = None
                 ) -> None:
        pin = torch.cuda.is_available()
        self.n, self.block_size, self.scratch_block = n, block_size, scratch_block
        self.scratch = (scratch_block, *extra_scratch)
        groups = len(self.scratch)
        self.state_row = 3 + groups if scratch_state is not None else None
        self.host64 = torch.zeros(3 + groups + (scratch_state is not None), n,
                                  dtype=torch.int64, pin_memory=pin)
        if scratch_state is not None:
            self.host64[self.state_row] = scratch_state
        self.scratch_state = scratch_state
        self.host32 = torch.empty(n + groups * n * max_blocks, dtype=torch.int32,
                                  pin_memory=pin)
        self.np64, self.np32 = self.host64.numpy(), self.host32.numpy()
        tables = self.np32[n:].reshape(groups, n, max_blocks)
        self.tables = list(tables)
        self.table = self.tables[0]
        self.slot_rows = [2] + list(range(4, 3 + groups))  # np64's slot row of each group
        for g, scratch in enumerate(self.scratch):
            tables[g] = scratch
            # padding rows write to the scratch block
            self.np64[self.slot_rows[g]] = scratch * block_size
        self.np64[3] = -1
        self.np32[:n] = 1
        self.row_owner: list[object] = [None] * n  # request state whose blocks fill the row
        self.row_blocks = [0] * n  # how many of its blocks are written (in every group)

    def fill(self, states, bs: int) -> None:
        """Rows 0..len(states)-1 for the decode states, padding rows up to `bs`."""
        bsz, scratch = self.block_size, self.scratch_block
        extra = len(self.scratch) > 1
        np64, np32, table = self.np64, self.np32, self.table
        owner, blocks = self.row_owner, self.row_blocks
        for i, st in enumerate(states):
            p = st.num_computed_tokens
            if p < len(st.token_ids):
                np64[0, i], np64[3, i] = st.token_ids[p], -1
            else:  # sampled by the previous step, still in flight
                np64[3, i] = st.sample_row
            np64[1, i] = p + st.position_offset
            np64[2, i] = st.block_ids[p // bsz] * bsz + p % bsz
            if self.state_row is not None:
                np64[self.state_row, i] = st.state_slot
            np32[i] = p + 1
            have = blocks[i] if owner[i] is st else 0
            if have < len(st.block_ids):
                table[i, have:len(st.block_ids)] = st.block_ids[have:]
            for g, ids in enumerate(st.extra_block_ids if extra else (), 1):
                np64[self.slot_rows[g], i] = ids[p // bsz] * bsz + p % bsz
                if have < len(ids):
                    self.tables[g][i, have:len(ids)] = ids[have:]
            if have < len(st.block_ids):
                owner[i], blocks[i] = st, len(st.block_ids)
        for i in range(len(states), bs):  # padding: harmless tokens writing to the scratch block
            if owner[i] is not None:
                for g, t in enumerate(self.tables):
                    t[i, :blocks[i]] = self.scratch[g]
                owner[i], blocks[i] = None, 0
            np64[:4, i] = (0, 0, scratch * bsz, -1)
            for g in range(1, len(self.scratch)):
                np64[self.slot_rows[g], i] = self.scratch[g] * bsz
            if self.state_row is not None:
                np64[self.state_row, i] = self.scratch_state
            np32[i] = 1


def decode_linear_metadata(slots: torch.Tensor, kernel: int) -> LinearAttentionMetadata:
    """The linear layers' metadata of a decode graph of ``len(slots)`` rows, whose state
    slots the graph reads from ``slots`` (a persistent buffer)."""
    bs, device = slots.shape[0], slots.device
    index, state_index = conv_rows([1] * bs, kernel)
    return LinearAttentionMetadata(
        query_start_loc=torch.arange(bs + 1, device=device), state_slots=slots,
        has_initial_state=torch.ones(bs, dtype=torch.bool, device=device),
        query_lens_cpu=[1] * bs, has_initial_state_cpu=[True] * bs, state_slots_cpu=[],
        conv_index=torch.from_numpy(index).to(device),
        conv_state_index=torch.from_numpy(state_index).to(device), conv_write_slots=slots)


class DecodeGraphs:
    """Captured decode steps (embedding, decoder, lm_head) over persistent device inputs.

    Inputs travel in two host-to-device copies per step from pinned staging buffers: an int64
    block [ids | positions | slots | sampled rows] and an int32 block [seq_lens | block table
    rows]. A request whose input token was sampled by the previous step and not read back yet
    (async scheduling) names its row of the runner's `sampled` buffer instead of an id; the
    graph picks it up on the device. Block table rows are rewritten on the host only when a
    row changes owner or its request gains blocks, so a step's host work is a few numpy stores
    per request. Two staging sets alternate: with async scheduling the host fills step N+1's
    while step N's copy may still be queued (step N-1, which used the other set, is done).
    """

    def __init__(self, model, kv_caches: list, sampled: torch.Tensor,
                 max_batch: int, max_blocks: int, block_size: int,
                 scratch_blocks: list[int], device: torch.device, linear=None) -> None:
        """`scratch_blocks`: each KV group's extra block (its number of blocks); `linear`:
        the linear-attention layers' states (`worker/linear_states.LinearStates`), whose
        slots are graph inputs too."""
        self.model = model
        self.sampled = sampled
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.sizes = capture_sizes(max_batch)
        n = self.n = self.sizes[-1]
        self.num_groups = len(scratch_blocks)
        self.linear = linear
        self.staging = [_Staging(n, max_blocks, block_size, scratch_blocks[0],
                                 tuple(scratch_blocks[1:]),
                                 linear.scratch_slot if linear is not None else None)
                        for _ in range(2)]
        self.num_runs = 0
        self.dev64 = self.staging[0].host64.to(device)
        self.dev32 = self.staging[0].host32.to(device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.forwards: dict[int, object] = {}
        pool = torch.cuda.graph_pool_handle()
        torch.cuda.empty_cache()  # once, at start-up: the graphs' pool may take what is cached
        for bs in reversed(self.sizes):  # largest first: smaller ones reuse its memory
            fn = self._forward_fn(bs, kv_caches)
            self.graphs[bs] = capture_graph(fn, pool)
            # the graph reads tensors the forward's closure made (the linear layers' gather
            # indices): keep them alive, or their memory is reused under the graph
            self.forwards[bs] = fn
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def _table(self, group: int, bs: int) -> torch.Tensor:
        first = self.n + group * self.n * self.max_blocks
        return self.dev32[first:first + bs * self.max_blocks].view(bs, self.max_blocks)

    def _forward_fn(self, bs: int, kv_caches):
        slot_rows = self.staging[0].slot_rows
        metas = [AttentionMetadata(
            slot_mapping=self.dev64[slot_rows[g], :bs],
            query_start_loc=self.query_start_loc[:bs + 1], seq_lens=self.dev32[:bs],
            block_tables=self._table(g, bs), max_query_len=1,
            max_seq_len=self.max_blocks * self.block_size, block_size=self.block_size)
            for g in range(self.num_groups)]
        meta = metas[0]
        if self.num_groups > 1:
            meta.groups = metas[1:]
        if self.linear is not None:  # every row continues its state at its slot
            meta.linear = decode_linear_metadata(
                self.dev64[self.staging[0].state_row, :bs], self.linear.kernel)
        positions = self.model.position_scheme.for_tokens(self.dev64[1, :bs])

        src = self.dev64[3, :bs]

        def fn():
            ids = torch.where(src >= 0, self.sampled[src.clamp(min=0)], self.dev64[0, :bs])
            embeds = self.model.embed_tokens(ids)
            hidden = self.model(embeds, positions, kv_caches, meta)
            return self.model.compute_logits(hidden)

        return fn

    def max_batch(self) -> int:
        return self.sizes[-1]

    def run(self, states) -> torch.Tensor:
        """One decode token for each request state (past its prompt) -> float32 logits
        [B, vocab] (a graph output view, valid until the next replay)."""
        B = len(states)
        bs = next(s for s in self.sizes if s >= B)
        stage = self.staging[self.num_runs % 2]
        self.num_runs += 1
        stage.fill(states, bs)
        self.dev64[:, :bs].copy_(stage.host64[:, :bs], non_blocking=True)
        n32 = self.n + bs * self.max_blocks
        self.dev32[:n32].copy_(stage.host32[:n32], non_blocking=True)
        for g in range(1, self.num_groups):  # the other KV groups' table rows
            first = self.n + g * self.n * self.max_blocks
            self.dev32[first:first + bs * self.max_blocks].copy_(
                stage.host32[first:first + bs * self.max_blocks], non_blocking=True)
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:B]
