"""What a Qwen vision tower reads beside the pixels, built on the host from the patch grids,
and the same padded to a fixed shape for a CUDA graph.

A tower's forward is split in two: `VisionInputs` (host tensors from the grids: each row's
rotary position, the attention segments, the window order of Qwen2.5-VL, the learned-position
taps of Qwen3-VL) and the tower's ``run`` (device work only, reading `TowerTensors`). The
eager path moves the inputs to the device as they are; a CUDA graph (`worker/vision_graphs.py`)
reads them padded to its bucket: `padded_layout` says the bucket of a step, `pack_padded`
writes its inputs into one int32 and one float32 buffer whose device copies the graph reads.

Padding rows are isolated: they form attention segments of their own (none longer than the
bucket's bound), sit at rotary position (0, 0), read the pixels of their own rows, and are
merged only among themselves (their count is a multiple of the merge unit), so the real rows'
outputs are those of the eager forward.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from vlmserve.layers.vision_attention import VarlenPlan, build_varlen_plan
from vlmserve.utils import to_device


@dataclass
class AttnSegments:
    """Attention segmentation for one forward: device ``cu_seqlens``, a bound on every
    segment's length, and the torch backend's launch plan (None in a graph, whose attention
    takes device ``cu_seqlens`` alone)."""

    cu_seqlens: torch.Tensor  # [num_seqs + 1] int32
    max_seqlen: int
    plan: VarlenPlan | None

    @classmethod
    def build(cls, seqlens: torch.Tensor, device: torch.device, plan: bool = True
              ) -> AttnSegments:
        """From host ``seqlens [num_seqs]``; ``plan``: the torch backend's launch plan too
        (an attention that takes device ``cu_seqlens`` needs none)."""
        cu = F.pad(seqlens.cumsum(0), (1, 0)).to(torch.int32)  # [num_seqs + 1]
        if plan:
            launches = build_varlen_plan(cu, device=device)
            return cls(to_device(cu, device), launches.max_seqlen, launches)
        return cls(to_device(cu, device), int(seqlens.max()) if seqlens.numel() else 0, None)


@dataclass
class TowerTensors:
    """A step's `VisionInputs` on the device, as the tower's ``run`` reads them."""

    pos: torch.Tensor  # [N, 2]
    segments: dict[str, AttnSegments]
    gather: torch.Tensor | None = None  # [N]
    scatter: torch.Tensor | None = None  # [N / unit]
    tap_index: torch.Tensor | None = None  # [N, 4]
    tap_weight: torch.Tensor | None = None  # [N, 4] float32


@dataclass
class VisionInputs:
    """A vision step's host inputs beside its pixels (N rows, `unit` rows merged into one)."""

    pos: torch.Tensor  # [N, 2] each row's rotary (row, col), in the order the blocks see rows
    segments: dict[str, torch.Tensor]  # attention segment lengths of each set the blocks use
    unit: int  # rows merged into one output row
    gather: torch.Tensor | None = None  # [N] the pixel row each block row reads (windows)
    scatter: torch.Tensor | None = None  # [N / unit] each merged row's output row
    tap_index: torch.Tensor | None = None  # [N, 4] learned position table taps
    tap_weight: torch.Tensor | None = None  # [N, 4] their bilinear weights

    @property
    def rows(self) -> int:
        return self.pos.shape[0]

    def to_device(self, device: torch.device, plan: bool = True) -> TowerTensors:
        """The eager path's tensors (copies from the host without waiting for the stream);
        ``plan``: with the torch attention's launch plans."""
        def dev(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else to_device(t, device)
        segments = {k: AttnSegments.build(v, device, plan) for k, v in self.segments.items()}
        return TowerTensors(dev(self.pos), segments, dev(self.gather), dev(self.scatter),
                            dev(self.tap_index), dev(self.tap_weight))


def bucket_rows(n: int, smallest: int = 256) -> int:
    """A size bucket at or above ``n``: ``smallest``, else ``n`` rounded up to a quarter of
    its power of two (at most 25% padding: 1025 -> 1280)."""
    if n <= smallest:
        return smallest
    step = 1 << max(n.bit_length() - 3, 0)
    return -(-n // step) * step


def _pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class PaddedLayout:
    """A graph's fixed shapes: ``rows`` block rows and, per segment set, ``(count, bound)``:
    the cu_seqlens entries (padded with empty segments) and the longest segment's bound."""

    rows: int
    unit: int
    segments: tuple[tuple[str, int, int], ...]
    gather: bool
    scatter: bool
    taps: bool
    int_size: int = field(init=False)  # int32 words of `pack_padded`'s first buffer

    def __post_init__(self) -> None:
        r = self.rows
        size = 2 * r + sum(n + 1 for _, n, _ in self.segments)
        size += r * self.gather + r // self.unit * self.scatter + 4 * r * self.taps
        object.__setattr__(self, "int_size", size)

    def views(self, ints: torch.Tensor, floats: torch.Tensor | None) -> TowerTensors:
        """`TowerTensors` viewing the packed buffers (device copies, for a graph)."""
        r, at = self.rows, 0

        def take(n: int) -> torch.Tensor:
            nonlocal at
            at += n
            return ints[at - n:at]
        pos = take(2 * r).view(r, 2)
        segments = {name: AttnSegments(take(n + 1), bound, None)
                    for name, n, bound in self.segments}
        gather = take(r) if self.gather else None
        scatter = take(r // self.unit) if self.scatter else None
        tap_index = take(4 * r).view(r, 4) if self.taps else None
        tap_weight = floats.view(r, 4) if self.taps else None
        return TowerTensors(pos, segments, gather, scatter, tap_index, tap_weight)


def _pad_segments(lengths: torch.Tensor, pad: int, bound: int) -> list[int]:
    """The segment lengths with ``pad`` rows after them, in segments of at most ``bound``."""
    return lengths.tolist() + [bound] * (pad // bound) + ([pad % bound] if pad % bound else [])


def padded_layout(inputs: VisionInputs, rows: int) -> PaddedLayout:
    """The bucket of ``inputs`` padded to ``rows`` (a multiple of the unit, at least N):
    per set, its longest segment's bound rounded up (`bucket_rows`, from 16) and the count of
    segments with the padding's rounded up to a power of two."""
    pad = rows - inputs.rows
    sets = []
    for name, lengths in inputs.segments.items():
        bound = bucket_rows(int(lengths.max()) if lengths.numel() else 1, smallest=16)
        sets.append((name, _pow2(len(_pad_segments(lengths, pad, bound))), bound))
    return PaddedLayout(rows, inputs.unit, tuple(sets), inputs.gather is not None,
                        inputs.scatter is not None, inputs.tap_index is not None)


def pack_padded(inputs: VisionInputs, layout: PaddedLayout, ints: torch.Tensor,
                floats: torch.Tensor | None) -> None:
    """Write ``inputs`` padded to ``layout`` into host buffers (int32 ``[layout.int_size]``;
    float32 ``[rows * 4]`` with taps) in the order `PaddedLayout.views` reads them."""
    n, r, unit = inputs.rows, layout.rows, layout.unit
    parts = [F.pad(inputs.pos, (0, 0, 0, r - n)).flatten()]
    for name, count, bound in layout.segments:
        lengths = _pad_segments(inputs.segments[name], r - n, bound)
        cu = torch.tensor([0, *lengths], dtype=torch.int64).cumsum(0)
        parts.append(F.pad(cu, (0, count + 1 - cu.numel()), value=r))
    if layout.gather:  # padding rows read their own rows
        parts.append(torch.cat([inputs.gather, torch.arange(n, r)]))
    if layout.scatter:
        parts.append(torch.cat([inputs.scatter, torch.arange(n // unit, r // unit)]))
    if layout.taps:
        parts.append(F.pad(inputs.tap_index, (0, 0, 0, r - n)).flatten())
        floats.copy_(F.pad(inputs.tap_weight, (0, 0, 0, r - n)).flatten())
    torch.cat([p.to(torch.int32) for p in parts], out=ints)
