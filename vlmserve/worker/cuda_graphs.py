"""CUDA graphs of the language model's decode step, one per padded batch size.

Decode-only steps replay a captured graph instead of launching every kernel from Python.
The graph reads persistent buffers (token ids, positions with the three mRoPE rows, KV
slots, block tables, context lengths) that each step fills by copy; rows past the real batch
are padding that writes its KV into a scratch block nobody owns. Image rows never enter a
decode step (placeholders are prompt tokens), so multimodal requests decode on graphs too.
Steps with prefill chunks run eagerly.
"""

from __future__ import annotations

import logging

import torch

from vlmserve.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, 64, 8)) + list(range(64, 513, 32))
    return [s for s in sizes if s <= max_batch] or [1]


class DecodeGraphs:
    def __init__(self, model, kv_caches: list[torch.Tensor], max_batch: int, max_blocks: int,
                 block_size: int, scratch_block: int, device: torch.device) -> None:
        self.model = model
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.scratch_block = scratch_block
        self.sizes = capture_sizes(max_batch)
        n = self.sizes[-1]
        rows = 3 if model.uses_mrope else 1
        self.ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(rows, n, dtype=torch.int64, device=device)
        self.slots = torch.full((n,), scratch_block * block_size, dtype=torch.int64,
                                device=device)
        self.block_tables = torch.full((n, max_blocks), scratch_block, dtype=torch.int64,
                                       device=device)
        self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        pool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.sizes):  # largest first: smaller ones reuse its memory
            fn = self._forward_fn(bs, kv_caches)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(2):
                    fn()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = fn()
            self.graphs[bs] = (graph, out)
        torch.cuda.synchronize()
        logger.info("captured decode CUDA graphs for batch sizes %s", self.sizes)

    def _forward_fn(self, bs: int, kv_caches):
        meta = AttentionMetadata(
            slot_mapping=self.slots[:bs], query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs], block_tables=self.block_tables[:bs],
            max_query_len=1, max_seq_len=self.max_blocks * self.block_size,
            block_size=self.block_size)
        positions = self.positions[:, :bs] if self.positions.shape[0] == 3 else \
            self.positions[0, :bs]

        def fn():
            embeds = self.model.embed_tokens(self.ids[:bs])
            return self.model(embeds, positions, kv_caches, meta)

        return fn

    def max_batch(self) -> int:
        return self.sizes[-1]

    def run(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
            block_tables: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Host tensors for B decode tokens -> hidden states [B, hidden] (a graph output
        view, valid until the next replay)."""
        B = ids.shape[0]
        bs = next(s for s in self.sizes if s >= B)
        self.ids[:B].copy_(ids, non_blocking=True)
        self.positions[:, :B].copy_(positions, non_blocking=True)
        self.slots[:B].copy_(slots, non_blocking=True)
        self.block_tables[:B, : block_tables.shape[1]].copy_(block_tables, non_blocking=True)
        self.block_tables[:B, block_tables.shape[1]:].fill_(self.scratch_block)
        self.seq_lens[:B].copy_(seq_lens, non_blocking=True)
        if bs > B:  # padding rows: harmless tokens writing to the scratch block
            self.ids[B:bs].zero_()
            self.positions[:, B:bs].zero_()
            self.slots[B:bs].fill_(self.scratch_block * self.block_size)
            self.block_tables[B:bs].fill_(self.scratch_block)
            self.seq_lens[B:bs].fill_(1)
        graph, out = self.graphs[bs]
        graph.replay()
        return out[:B]
