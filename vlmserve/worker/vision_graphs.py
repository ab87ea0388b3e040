"""CUDA graphs of the vision tower's step, one per bucket of patch rows and segments.

A vision step launches hundreds of kernels (32 blocks of a Qwen tower, a dozen each); for a
step of one or a few images the host's launching takes longer than the device's work. A step
of at most ``max_rows`` patch rows replays a graph instead: its pixels and its host inputs
(`models/vision/step_inputs.py`), padded to the bucket (`padded_layout`: rows rounded up to
a quarter of their power of two, each segment set's count and longest segment's bound), are
copied into the graph's buffers (the ints in one copy from a pinned buffer, two used in turn),
and the graph is replayed; its output rows are copied out before another graph may run.
Graphs are captured when their bucket is first met (that step runs twice eagerly, then is
captured and replayed), at most ``max_graphs`` of them; steps of other buckets,
or larger, run eagerly. All graphs share one memory pool: only one runs at a time, and its
output is copied out before the next replay.

A graph's attention takes device ``cu_seqlens`` (flash or triton): the tower's own, or, where
the tower's eager steps run SDPA (launches planned on the host), the graphs' own
(``attention``: SDPA keeps the large eager steps, with which the server ran more requests a
second at high concurrency than with flash, and the graphs take the small ones, whose host
launch outlasts their device work). Tensor parallelism over
the tower's weights (collectives inside) is not captured.
Without CUDA (``capture=False``) the same padded buffers run eagerly: the tests' check of the
padding on the CPU. Towers whose images are all one size (CLIP, SigLIP: `BatchGraphs`) have a
graph per power-of-two batch size.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from vlmserve.models.vision.clip import FixedSizeTower
from vlmserve.models.vision.common import VisionTowerBase
from vlmserve.models.vision.step_inputs import (
    PaddedLayout,
    TowerTensors,
    VisionInputs,
    bucket_rows,
    pack_padded,
    padded_layout,
)
from vlmserve.worker.cuda_graphs import capture_graph

logger = logging.getLogger(__name__)


@dataclass
class _Graph:
    layout: PaddedLayout
    pixels: torch.Tensor  # [rows, C*T*P*P] in the tower's dtype
    ints: torch.Tensor  # device int32 [layout.int_size]
    floats: torch.Tensor | None  # device float32 [rows * 4] (taps)
    tensors: TowerTensors  # views of ints / floats
    host: list[tuple[torch.Tensor, torch.Tensor | None]]  # pinned, used in turn
    copied: list[torch.cuda.Event | None]
    graph: torch.cuda.CUDAGraph | None = None
    out: torch.Tensor | None = None
    turn: int = 0


class VisionGraphs:
    """Replays ``tower``'s steps of at most ``max_rows`` rows from CUDA graphs."""

    def __init__(self, tower, max_rows: int, max_graphs: int = 32,
                 capture: bool | None = None, attention=None) -> None:
        """``attention``: the one the graphs capture where the tower's own is SDPA (whose
        launches are planned on the host: a graph cannot hold them); None: the tower's."""
        self.tower = tower
        self.attention = attention
        self.max_rows = max_rows
        self.max_graphs = max_graphs
        self.device = tower.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        self.graphs: dict[PaddedLayout, _Graph] = {}
        self.num_replays = 0  # steps replayed from a graph
        self.num_eager = 0  # steps of at most max_rows run eagerly (no room for their graph)

    def run(self, pixel_values: torch.Tensor, inputs: VisionInputs) -> torch.Tensor | None:
        """The step's output rows, or None where it runs eagerly (too large, or no room
        for another graph)."""
        n = inputs.rows
        if n == 0 or n > self.max_rows:
            return None
        rows = bucket_rows(n)
        rows += -rows % inputs.unit
        layout = padded_layout(inputs, rows)
        g = self.graphs.get(layout)
        if g is None:
            if len(self.graphs) >= self.max_graphs:
                self.num_eager += 1
                return None
            g = self.graphs[layout] = self._buffers(layout, pixel_values)
        self._fill(g, pixel_values, inputs)
        if not self.capture:
            g.out = self._run(g)
        elif g.graph is None:
            captured = _capture(lambda: self._run(g), self.pool)
            if captured is None:  # eager from now on, this step too
                self.graphs.pop(layout)
                self.max_rows = 0
                return None
            g.graph, g.out = captured
            logger.info("captured a vision CUDA graph of %d rows, segments %s (%d graphs)",
                        layout.rows, layout.segments, len(self.graphs))
        else:
            g.graph.replay()
        self.num_replays += 1
        return g.out[:n // inputs.unit].clone()

    def _run(self, g: _Graph) -> torch.Tensor:
        """The tower on the graph's buffers, with the graphs' attention where it has one."""
        if self.attention is None:
            return self.tower.run(g.pixels, g.tensors)
        self.tower.set_attention_backend(self.attention)  # the tower's own: SDPA (None)
        try:
            return self.tower.run(g.pixels, g.tensors)
        finally:
            self.tower.set_attention_backend(None)

    def _buffers(self, layout: PaddedLayout, pixel_values: torch.Tensor) -> _Graph:
        dev, pin = self.device, self.device.type == "cuda"
        floats = (torch.zeros(layout.rows * 4, dtype=torch.float32, device=dev)
                  if layout.taps else None)
        ints = torch.zeros(layout.int_size, dtype=torch.int32, device=dev)
        host = [(torch.zeros(layout.int_size, dtype=torch.int32, pin_memory=pin),
                 torch.zeros(layout.rows * 4, pin_memory=pin) if layout.taps else None)
                for _ in range(2)]
        pixels = torch.zeros(layout.rows, pixel_values.shape[1], dtype=self.tower.dtype,
                             device=dev)
        return _Graph(layout, pixels, ints, floats, layout.views(ints, floats), host,
                      [None, None])

    def _fill(self, g: _Graph, pixel_values: torch.Tensor, inputs: VisionInputs) -> None:
        """The step's inputs into the graph's buffers (padding rows keep stale pixels: they
        only meet each other)."""
        i, g.turn = g.turn, 1 - g.turn
        if g.copied[i] is not None:
            g.copied[i].synchronize()
        ints, floats = g.host[i]
        pack_padded(inputs, g.layout, ints, floats)
        g.ints.copy_(ints, non_blocking=True)
        if floats is not None:
            g.floats.copy_(floats, non_blocking=True)
        if self.device.type == "cuda":
            g.copied[i] = torch.cuda.Event()
            g.copied[i].record()
        g.pixels[:inputs.rows].copy_(pixel_values)



def _capture(fn, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
    """A graph of ``fn`` and its output, computed (a replay after the capture); None, logged,
    where the capture fails (the tower then runs eagerly)."""
    try:
        graph, out = capture_graph(fn, pool, "thread_local")
    except Exception:
        logger.exception("a vision CUDA graph could not be captured: vision steps run "
                         "eagerly from now on")
        return None
    graph.replay()
    return graph, out


class BatchGraphs:
    """Replays a `FixedSizeTower`'s batches of at most ``max_batch`` images from CUDA
    graphs, one per power-of-two batch size, captured when first met (padding images: the
    stale pixels of earlier batches, each image computed alone). Without CUDA
    (``capture=False``) the padded batch runs eagerly."""

    def __init__(self, tower, max_batch: int, capture: bool | None = None) -> None:
        self.tower = tower
        self.max_batch = max_batch
        cuda = next(tower.parameters()).device.type == "cuda"
        self.capture = cuda if capture is None else capture
        self.pool = torch.cuda.graph_pool_handle() if self.capture else None
        # (batch, image shape, dtype) -> (pixels buffer, graph, output)
        self.graphs: dict[tuple, tuple[torch.Tensor, torch.cuda.CUDAGraph | None,
                                       torch.Tensor | None]] = {}
        self.num_replays = 0

    def run(self, pixel_values: torch.Tensor) -> torch.Tensor | None:
        n = pixel_values.shape[0]
        if n == 0 or n > self.max_batch:
            return None
        key = (1 << (n - 1).bit_length(), tuple(pixel_values.shape[1:]), pixel_values.dtype)
        if key not in self.graphs:
            self.graphs[key] = (pixel_values.new_zeros(key[0], *key[1]), None, None)
        pixels, graph, out = self.graphs[key]
        pixels[:n].copy_(pixel_values)
        if not self.capture:
            out = self.tower.run(pixels)
        elif graph is None:
            captured = _capture(lambda: self.tower.run(pixels), self.pool)
            if captured is None:  # eager from now on, this batch too
                del self.graphs[key]
                self.max_batch = 0
                return None
            graph, out = captured
            self.graphs[key] = (pixels, graph, out)
            logger.info("captured a vision CUDA graph of %d images", key[0])
        else:
            graph.replay()
        self.num_replays += 1
        return out[:n].clone()


def attach_vision_graphs(model: torch.nn.Module, max_rows: int, max_graphs: int = 32,
                         attention=None) -> int:
    """Give each vision tower of ``model`` its graphs (a Qwen tower `VisionGraphs`; a CLIP
    or SigLIP tower `BatchGraphs` of batches up to ``max_rows`` patch rows); how many got
    them. A Qwen tower whose attention is SDPA (launches planned on the host) runs its eager
    steps so and its graphs with ``attention`` (one launch over device ``cu_seqlens``: flash
    or triton, `graph_attention`): SDPA served more requests a second than flash at high
    concurrency, the graphs' launch is the shorter on small steps."""
    count = 0
    for m in model.modules():
        if isinstance(m, VisionTowerBase):
            sdpa = m.torch_attention
            if sdpa and attention is None:
                raise ValueError("vision CUDA graphs of a Qwen tower need an attention over "
                                 "device cu_seqlens (flash or triton) to capture; its eager "
                                 "attention is torch's SDPA, whose launches are planned on "
                                 "the host")
            m.graphs = VisionGraphs(m, max_rows, max_graphs,
                                    attention=attention if sdpa else None)
        elif isinstance(m, FixedSizeTower):
            m.graphs = BatchGraphs(m, max(max_rows // m.tokens_per_image, 1))
        else:
            continue
        count += 1
    return count
