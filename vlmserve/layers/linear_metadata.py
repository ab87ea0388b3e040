"""The linear-attention layers' view of a step (`LinearAttentionMetadata`), built once per
step on the host: each sequence's tokens, state slot and whether it continues a state, the
causal convolution's gather rows, and everything a layer would otherwise read back from the
device (the recurrence's passes over chunks cut at prefix-cache snapshots, the single-token
sequences' rows, fla's chunk indices and the host starts), copied without waiting for it."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from vlmserve.utils import to_device

CHUNK = 64  # tokens per chunk of the torch chunked form (transformers' and fla's)


@dataclass
class LinearAttentionMetadata:
    """A step's sequences as the linear-attention layers read them; built once per step.

    ``snapshots``: (sequence, tokens into its chunk, slot) for states asked for inside a
    chunk (0 < tokens < its length): the layer leaves there, in that slot, the sequence's
    states as they stood after those tokens (a state at a chunk's end is a copy of the
    running slot after the step: the caller's)."""

    query_start_loc: torch.Tensor  # [B + 1] int64: each sequence's first token in the step
    state_slots: torch.Tensor  # [B] int64: each sequence's slot of the state pools
    has_initial_state: torch.Tensor  # [B] bool: whether it continues a state (else zeros)
    query_lens_cpu: list[int]
    has_initial_state_cpu: list[bool]
    state_slots_cpu: list[int]
    conv_index: torch.Tensor | None = None  # [T, kernel] the convolution's rows (`conv_rows`)
    # [B + S, kernel - 1] rows that become the conv states written at `conv_write_slots`
    # (each sequence's at its slot, then the S snapshots')
    conv_state_index: torch.Tensor | None = None
    conv_write_slots: torch.Tensor | None = None
    snapshots: list[tuple[int, int, int]] = field(default_factory=list)
    # the recurrence's passes when a chunk holds snapshots (`snapshot_passes`); the
    # single-token sequences' token rows and sequence indices (the torch recurrence's)
    passes: list[SnapshotPass] = field(default_factory=list)
    single_rows: torch.Tensor | None = None
    single_seqs: torch.Tensor | None = None
    # with a sequence of several tokens: `query_start_loc` on the host, and each chunk of
    # CHUNK tokens as (sequence, chunk within it) [chunks, 2] (fla's `chunk_indices`), so
    # that fla's chunked kernel reads no length back from the device
    query_start_loc_cpu: torch.Tensor | None = None
    chunk_indices: torch.Tensor | None = None
    _decode_only: bool | None = field(default=None, repr=False)

    @property
    def decode_only(self) -> bool:
        if self._decode_only is None:
            self._decode_only = all(n == 1 for n in self.query_lens_cpu)
        return self._decode_only


@dataclass
class SnapshotPass:
    """One pass of the recurrence over a step whose chunks hold snapshots: the token
    ``rows`` of every sequence's piece in it, their metadata, and the state copies
    ``(src, dst)`` to snapshot slots after it (None: none)."""

    rows: torch.Tensor
    meta: LinearAttentionMetadata
    copies: tuple[torch.Tensor, torch.Tensor] | None


def _to_device(device: torch.device):
    def dev(a, dtype=torch.int64) -> torch.Tensor:
        return to_device(torch.as_tensor(np.asarray(a), dtype=dtype), device)
    return dev


def _rule_metadata(query_lens: list[int], state_slots: list[int],
                   has_initial_state: list[bool], device: torch.device,
                   **conv) -> LinearAttentionMetadata:
    """The recurrence's metadata of sequences of ``query_lens`` tokens (copies to the
    device that never wait for it)."""
    dev = _to_device(device)
    starts = np.zeros(len(query_lens) + 1, dtype=np.int64)
    np.cumsum(query_lens, out=starts[1:])
    singles = [i for i, n in enumerate(query_lens) if n == 1]
    chunked = {}
    if len(singles) < len(query_lens):
        counts = -(-np.asarray(query_lens, dtype=np.int64) // CHUNK)
        first = np.repeat(np.cumsum(counts) - counts, counts)
        chunked = {"query_start_loc_cpu": torch.from_numpy(starts),
                   "chunk_indices": dev(np.stack([np.repeat(np.arange(len(counts)), counts),
                                                  np.arange(counts.sum()) - first], 1))}
    return LinearAttentionMetadata(
        query_start_loc=dev(starts), state_slots=dev(state_slots),
        has_initial_state=dev(has_initial_state, torch.bool),
        query_lens_cpu=list(query_lens), has_initial_state_cpu=list(has_initial_state),
        state_slots_cpu=list(state_slots),
        single_rows=dev(starts[singles]) if singles else None,
        single_seqs=dev(singles) if singles else None, **chunked, **conv)


def snapshot_passes(meta: LinearAttentionMetadata, device: torch.device
                    ) -> list[SnapshotPass]:
    """The recurrence's passes over a step whose chunks hold ``meta.snapshots``: each chunk
    cut at its snapshots; pass j runs every sequence's j-th piece (from the state the previous
    pass left at its slot), then copies the states asked for at the pieces' ends to their
    snapshot slots."""
    cuts: dict[int, list[int]] = {}
    for i, n, _ in meta.snapshots:
        cuts.setdefault(i, []).append(n)
    lens_cpu = meta.query_lens_cpu
    bounds = [[0, *sorted(set(cuts.get(i, ()))), n] for i, n in enumerate(lens_cpu)]
    starts = np.concatenate([[0], np.cumsum(lens_cpu)]).astype(np.int64)
    dev = _to_device(device)
    passes = []
    for j in range(max(len(b) for b in bounds) - 1):
        members = [i for i, b in enumerate(bounds) if len(b) - 1 > j]
        rows = np.concatenate([np.arange(starts[i] + bounds[i][j], starts[i] + bounds[i][j + 1])
                               for i in members])
        piece = _rule_metadata(
            [bounds[i][j + 1] - bounds[i][j] for i in members],
            [meta.state_slots_cpu[i] for i in members],
            [meta.has_initial_state_cpu[i] if j == 0 else True for i in members], device)
        done = [(meta.state_slots_cpu[i], slot) for i, n, slot in meta.snapshots
                if len(bounds[i]) > j + 1 and n == bounds[i][j + 1]]
        copies = tuple(dev(c) for c in zip(*done)) if done else None
        passes.append(SnapshotPass(dev(rows), piece, copies))
    return passes


def conv_rows(query_lens: list[int], kernel: int,
              snapshots: list[tuple[int, int]] = ()) -> tuple[np.ndarray, np.ndarray]:
    """Gather indices of the causal convolution over ``rows = [states of the B sequences
    (kernel - 1 rows each) | the step's T tokens]``: ``[T, kernel]`` (each token's window,
    oldest first) and ``[B + S, kernel - 1]`` (each sequence's last inputs, its new state;
    then those before each of the S (sequence, tokens into its chunk) `snapshots`)."""
    w = kernel - 1
    lens = np.asarray(query_lens, dtype=np.int64)
    B, T = len(lens), int(lens.sum())
    starts = np.zeros(B, dtype=np.int64)
    np.cumsum(lens[:-1], out=starts[1:])
    seq = np.repeat(np.arange(B), lens)  # [T]
    local = np.arange(T) - starts[seq]  # [T] position in its sequence

    def window(seq_of, pos_of, width):
        rel = pos_of[:, None] - w + np.arange(width)[None, :]  # position of each input
        own = B * w + starts[seq_of][:, None] + rel  # a token of this step
        state = seq_of[:, None] * w + w + rel  # a row of the sequence's previous inputs
        return np.where(rel >= 0, own, state)

    ends = np.asarray([(i, n) for i, n in enumerate(query_lens)] + list(snapshots),
                      dtype=np.int64).reshape(-1, 2)
    return window(seq, local, kernel), window(ends[:, 0], ends[:, 1], w)


def build_linear_metadata(query_lens: list[int], state_slots: list[int],
                          has_initial_state: list[bool], kernel: int,
                          device: torch.device,
                          snapshots: list[tuple[int, int, int]] = ()
                          ) -> LinearAttentionMetadata:
    """``query_lens[i]`` tokens of sequence i, whose states live at slot ``state_slots[i]``
    and hold its past when ``has_initial_state[i]``; ``snapshots``: (sequence, tokens into
    its chunk, slot) inside chunks (see `LinearAttentionMetadata`)."""
    assert all(0 < n < query_lens[i] for i, n, _ in snapshots), snapshots
    index, state_index = conv_rows(query_lens, kernel, [(i, n) for i, n, _ in snapshots])
    dev = _to_device(device)
    meta = _rule_metadata(
        query_lens, state_slots, has_initial_state, device, conv_index=dev(index),
        conv_state_index=dev(state_index),
        conv_write_slots=dev(list(state_slots) + [slot for *_, slot in snapshots]),
        snapshots=list(snapshots))
    if snapshots:  # once per step: every layer runs the same passes
        meta.passes = snapshot_passes(meta, device)
    return meta
