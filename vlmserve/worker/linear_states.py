"""The linear-attention state pools of a model with Gated DeltaNet layers, or other layers that
keep a state per sequence (LFM2's short convolutions): the worker's half of the linear cache
group, `core/kv_cache_groups.StatePool`.

Each linear layer holds a conv state pool ``[slots + 1, kernel - 1, conv_dim]`` (the model's
dtype) and a recurrent state pool ``[slots + 1, v_heads, k_dim, v_dim]`` (float32); a model
whose layers keep a conv state alone declares an empty recurrent shape (``(0,)``: its pool
holds nothing). Both are allocated once at start: ``slots`` is the manager's running slots
(max_num_seqs) plus its snapshot slots; the extra last slot is scratch, where the padded rows
of a decode graph write. A step (`LinearStates.prepare`): new requests that resume from a
snapshot get its states copied into their running slot first; the layers read and write the
running slots (`metadata`); states asked for at the end of a request's chunk are copied to
their snapshot slots after the forward (`finish`), those inside a chunk are left there by the
layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from vlmserve.layers.linear_metadata import LinearAttentionMetadata, build_linear_metadata
from vlmserve.utils import to_device

#: the layer kinds of `VisionLanguageModel.layer_kinds` that hold states instead of KV
LINEAR = "linear"


def state_bytes_per_slot(model, dtype: torch.dtype) -> int:
    """Device bytes one state slot takes over all of the model's linear layers."""
    kinds = layer_kind_names(model)
    if LINEAR not in kinds:
        return 0
    conv, ssm = model.linear_state_shapes()
    per_layer = (torch.Size(conv).numel() * dtype.itemsize
                 + torch.Size(ssm).numel() * torch.float32.itemsize)
    return per_layer * kinds.count(LINEAR)


def layer_kind_names(model) -> list[str]:
    """Each decoder layer's cache kind (`core.kv_cache_groups.KINDS`, from the model's
    `layer_kinds`): all full attention for a model that declares none."""
    kinds = getattr(model, "layer_kinds", None)
    return [k.kind for k in kinds] if kinds else ["full"] * model.num_layers


@dataclass
class StepStates:
    """The linear layers' part of one eager step."""

    meta: LinearAttentionMetadata
    # (running slot, snapshot slot) to copy after the forward
    after: list[tuple[int, int]] = field(default_factory=list)


class LinearStates:
    """The pools of every linear layer, by decoder layer index."""

    def __init__(self, model, num_slots: int, device: torch.device, dtype: torch.dtype
                 ) -> None:
        conv, ssm = model.linear_state_shapes()
        self.kernel = conv[0] + 1
        self.num_slots = num_slots
        self.scratch_slot = num_slots
        self.layers = [i for i, k in enumerate(layer_kind_names(model)) if k == LINEAR]
        self.pools: dict[int, tuple[torch.Tensor, torch.Tensor]] = {
            i: (torch.zeros((num_slots + 1, *conv), dtype=dtype, device=device),
                torch.zeros((num_slots + 1, *ssm), dtype=torch.float32, device=device))
            for i in self.layers}
        self.device = device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.pools.values() for t in pair)

    def copy(self, pairs: list[tuple[int, int]]) -> None:
        """Every layer's states of slot ``src`` into slot ``dst``, for each (src, dst)."""
        if not pairs:
            return
        src, dst = (to_device(torch.tensor(c, dtype=torch.int64), self.device)
                    for c in zip(*pairs))
        for pair in self.pools.values():
            for pool in pair:
                pool.index_copy_(0, dst, pool.index_select(0, src))

    def prepare(self, states, query_lens: list[int], snapshots: list[tuple[str, int, int]]
                ) -> StepStates:
        """The step's metadata for ``states`` (the runner's request states, in step order)
        scheduled ``query_lens`` tokens each; ``snapshots``: the scheduler's (request id,
        position, snapshot slot)."""
        index = {st.request_id: i for i, st in enumerate(states)}
        inside, after = [], []
        for rid, pos, slot in snapshots:
            i = index[rid]
            st = states[i]
            offset = pos - st.num_computed_tokens
            assert 0 < offset <= query_lens[i], (rid, pos, st.num_computed_tokens)
            if offset == query_lens[i]:
                after.append((st.state_slot, slot))
            else:
                inside.append((i, offset, slot))
        meta = build_linear_metadata(
            query_lens, [st.state_slot for st in states],
            [st.num_computed_tokens > 0 for st in states], self.kernel, self.device, inside)
        return StepStates(meta, after)
