"""Physical storage of image embeddings (encoder outputs), keyed by content hash.

The scheduler's `EncoderCacheManager` decides which entries exist; this store holds their
tensors and hands the model runner exactly the rows each chunk needs.

Without offload, entries stay on the compute device. With offload, each fresh encoder output
is copied to (pinned) host memory on a copy stream right after the encoder runs and its
device copy is dropped at the end of the step. Rows a chunk needs come back through two
ping-pong device buffers of one step's size: while step N reads buffer A, the rows the
scheduler predicts for step N+1 are copied host-to-device into buffer B on the copy stream.
Events order each copy before the reads of its buffer, and each overwrite of a buffer after
the reads of the step that used it last. Rows the prediction missed are copied on the spot
(counted), so a wrong guess costs time, never correctness. On the CPU there are no streams,
but the same code path and buffer rotation run.

Under tensor parallelism every rank needs every image's rows, but the ranks of one host hold
the offloaded rows once (`HostShare`): the host's leader keeps the host rows and the
ping-pong buffers; the other ranks keep only which entries exist and receive each step's
rows from the leader (one broadcast within the host, on the device), unless every row of the
step is fresh from this step's encoder, which every rank holds.
"""

from __future__ import annotations

import bisect
import contextlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass
class StoreStats:
    prefetch_hit_rows: int = 0  # rows read from a buffer filled ahead of time
    prefetch_miss_rows: int = 0  # rows the prediction missed, copied synchronously
    prefetch_waits: int = 0  # steps whose prefetch copy had not finished when needed
    host_pool_misses: int = 0  # offloaded entries that found no free range in the host rows
    peak_device_bytes: int = 0


@dataclass(frozen=True)
class HostShare:
    """This rank's part in holding offloaded rows once per host: whether it is the host's
    leader, and the broadcast of a tensor from the leader to the host's other ranks."""

    leader: bool
    broadcast: Callable[[torch.Tensor], torch.Tensor]


class _Events:
    """CUDA events on CUDA; on the CPU, stand-ins that are always complete."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None

    def record(self, stream=None):
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(stream or torch.cuda.current_stream())
        return ev

    @staticmethod
    def done(ev) -> bool:
        return ev is None or ev.query()

    def wait(self, ev, stream=None) -> None:
        if ev is not None:
            (stream or torch.cuda.current_stream()).wait_event(ev)


class _HostRows:
    """Host rows for offloaded entries, carved from one tensor allocated once (pinned on
    CUDA): page-locking an image-sized piece took 1-2 ms on the H200 host, which would
    otherwise land on the engine thread in every step that encodes an image, until the cache
    budget has been filled once.

    Ranges are taken first fit and merged with their neighbours when given back. A range given
    back is reused only after the copies queued on it before have finished (`events`, one per
    stream that touches host rows).
    """

    def __init__(self, rows: int, hidden_size: int, dtype: torch.dtype, pin: bool) -> None:
        self.buf = torch.empty(rows, hidden_size, dtype=dtype, pin_memory=pin)
        self.free: list[list[int]] = [[0, rows]] if rows else []  # [start, length], sorted
        self.pending: deque[tuple[list, int, int]] = deque()  # (events, start, length)

    def take(self, n: int) -> torch.Tensor | None:
        """``n`` contiguous rows, or None if no free range is that long."""
        while self.pending and all(_Events.done(e) for e in self.pending[0][0]):
            _, start, length = self.pending.popleft()
            self._release(start, length)
        for i, (start, length) in enumerate(self.free):
            if length >= n:
                if length == n:
                    del self.free[i]
                else:
                    self.free[i] = [start + n, length - n]
                return self.buf[start:start + n]
        return None

    def owns(self, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() == self.buf.untyped_storage().data_ptr()

    def give_back(self, t: torch.Tensor, events: list) -> None:
        start = t.storage_offset() // self.buf.stride(0)
        self.pending.append((events, start, t.shape[0]))

    def _release(self, start: int, length: int) -> None:
        i = bisect.bisect(self.free, [start, length])
        if i < len(self.free) and start + length == self.free[i][0]:  # merge the next one
            length += self.free.pop(i)[1]
        if i and self.free[i - 1][0] + self.free[i - 1][1] == start:  # and the previous one
            self.free[i - 1][1] += length
        else:
            self.free.insert(i, [start, length])


class MMEmbeddingStore:
    def __init__(self, device: torch.device, hidden_size: int, dtype: torch.dtype,
                 offload: bool = False, buffer_rows: int = 0, host_rows: int = 0,
                 host_share: HostShare | None = None) -> None:
        """``host_rows``: the host rows allocated up front for offloaded entries (the encoder
        cache's capacity); an entry that finds no free range there gets its own tensor.
        ``host_share``: with offload, a tensor-parallel rank that shares its host with others
        (a rank not the leader holds no host rows and no buffers)."""
        self.device = device
        self.offload = offload
        self.hidden_size, self.dtype = hidden_size, dtype
        self.share = host_share if offload else None
        self.holds_rows = self.share is None or self.share.leader
        if not self.holds_rows:
            buffer_rows = host_rows = 0
        self.stats = StoreStats()
        self._device: dict[str, torch.Tensor] = {}  # entries kept on the device
        self._host: dict[str, torch.Tensor] = {}  # offloaded entries
        self._fresh: dict[str, torch.Tensor] = {}  # encoded this step, still on the device
        # running byte counts of `_device` and `_host` (the stats are read after every step:
        # no sums over the entries there)
        self._device_bytes = 0
        self._host_bytes = 0
        self._buffer_bytes = 0  # the ping-pong buffers, fixed
        self._ev = _Events(device)
        # (op, buffer, step) of the latest ping-pong operations, bounded: a server runs forever
        self.trace: deque[tuple] = deque(maxlen=4096)
        self.step = 0
        if offload:
            self._buffers = [torch.empty(buffer_rows, hidden_size, dtype=dtype, device=device)
                             for _ in range(2)]
            self._buffer_bytes = sum(_nbytes(b) for b in self._buffers)
            self._copy_done = [None, None]  # prefetch into buffer i finished
            self._read_done = [None, None]  # the last step reading buffer i finished reading
            self._layout: list[dict[str, list[tuple[int, int, int]]]] = [{}, {}]
            self._used = [0, 0]  # rows of buffer i taken by its layout
            self.cur = 1  # begin_step flips to buffer 0 for the first step
            self._pool = _HostRows(host_rows, hidden_size, dtype, pin=self._ev.cuda)

    # ---- entries ---------------------------------------------------------------------------

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._device or mm_hash in self._host or mm_hash in self._fresh

    def put(self, mm_hash: str, rows: torch.Tensor) -> None:
        """rows: [num_rows, hidden], fresh from the vision tower. An entry already stored
        under ``mm_hash`` is replaced (freed first)."""
        if mm_hash in self._device or mm_hash in self._host:
            self.free([mm_hash])
        if not self.offload:
            if rows.untyped_storage().nbytes() != _nbytes(rows):
                # a view into the encoder's batch would keep the whole batch alive while the
                # counters and the cache's budget charge only these rows
                rows = rows.clone()
            self._device_bytes += _nbytes(rows)
            self._device[mm_hash] = rows
            self._note_peak()
            return
        self._fresh[mm_hash] = rows
        if not self.holds_rows:  # the host's leader holds them
            self._host[mm_hash] = None
            return
        host = self._pool.take(rows.shape[0])
        if host is None:  # the pool is fragmented or too small: a tensor of its own
            self.stats.host_pool_misses += 1
            host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=self._ev.cuda)
        if self._ev.cuda:
            computed = self._ev.record()
            with torch.cuda.stream(self._ev.copy_stream):
                self._ev.wait(computed, self._ev.copy_stream)
                host.copy_(rows, non_blocking=True)
            rows.record_stream(self._ev.copy_stream)
        else:
            host.copy_(rows)
        self._host_bytes += _nbytes(host)
        self._host[mm_hash] = host

    def free(self, hashes: list[str]) -> None:
        events = None
        for h in hashes:
            self._device_bytes -= _nbytes_or_0(self._device.pop(h, None))
            host = self._host.pop(h, None)
            self._host_bytes -= _nbytes_or_0(host)
            if host is not None and self._pool.owns(host):
                if events is None:  # after every copy queued so far, on either stream
                    events = [self._ev.record(self._ev.copy_stream), self._ev.record()]
                self._pool.give_back(host, events)

    # ---- one step --------------------------------------------------------------------------

    def begin_step(self) -> None:
        """A new engine step: it reads the buffer the previous step prefetched into."""
        self.step += 1
        if self.offload:
            self.cur ^= 1

    def prefetch(self, spans: list[tuple[str, int, int]]) -> None:
        """Copy rows the NEXT step is expected to need into the other buffer, on the copy
        stream, once the step that last read that buffer is done with it."""
        if not self.offload or not self.holds_rows:
            return
        nxt = self.cur ^ 1
        if not spans:  # nothing to copy (decode steps): no stream work at all
            self._layout[nxt], self._used[nxt], self._copy_done[nxt] = {}, 0, None
            return
        self.trace.append(("wait_reads", nxt, self.step))
        layout, used = {}, 0
        buf = self._buffers[nxt]
        stream = self._ev.copy_stream
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with ctx:
            self._ev.wait(self._read_done[nxt], stream)
            for h, start, end in spans:
                src = self._host.get(h)
                n = end - start
                if src is None or used + n > buf.shape[0]:
                    continue
                buf[used:used + n].copy_(src[start:end], non_blocking=True)
                layout.setdefault(h, []).append((start, end, used))
                used += n
            self._copy_done[nxt] = self._ev.record(stream)
        self.trace.append(("prefetch", nxt, self.step))
        self._layout[nxt], self._used[nxt] = layout, used

    def gather(self, spans: list[tuple[str, int, int]]) -> torch.Tensor | None:
        """The rows [start, end) of each (hash, start, end), concatenated: [rows, hidden]."""
        if not spans:
            return None
        if not self.offload:
            return torch.cat([self._device[h][s:e] for h, s, e in spans])
        if self.share is None or all(h in self._fresh for h, _, _ in spans):
            return self._gather_offloaded(spans)
        if self.share.leader:
            return self.share.broadcast(self._gather_offloaded(spans))
        rows = sum(e - s for _, s, e in spans)
        return self.share.broadcast(torch.empty(rows, self.hidden_size, dtype=self.dtype,
                                                device=self.device))

    def _gather_offloaded(self, spans: list[tuple[str, int, int]]) -> torch.Tensor:
        cur, buf = self.cur, self._buffers[self.cur]
        if not self._ev.done(self._copy_done[cur]):
            self.stats.prefetch_waits += 1
        self._ev.wait(self._copy_done[cur])
        self.trace.append(("read", cur, self.step))
        parts = []
        for h, s, e in spans:
            if h in self._fresh:
                parts.append(self._fresh[h][s:e])
                continue
            hit = next((off + s - a for a, b, off in self._layout[cur].get(h, ())
                        if a <= s and e <= b), None)
            if hit is not None:
                parts.append(buf[hit:hit + e - s])
                self.stats.prefetch_hit_rows += e - s
                continue
            self.stats.prefetch_miss_rows += e - s
            used = self._used[cur]
            if used + e - s <= buf.shape[0]:
                buf[used:used + e - s].copy_(self._host[h][s:e], non_blocking=True)
                self._used[cur] = used + e - s
                parts.append(buf[used:used + e - s])
            else:
                parts.append(self._host[h][s:e].to(self.device, non_blocking=True))
        out = torch.cat(parts)  # the only read of the buffer this step
        self._read_done[cur] = self._ev.record()
        return out

    def end_step(self) -> None:
        """Drop the device copies of this step's fresh outputs (the host copies stay)."""
        self._note_peak()
        self._fresh.clear()

    # ---- accounting ------------------------------------------------------------------------

    def _note_peak(self) -> None:
        self.stats.peak_device_bytes = max(self.stats.peak_device_bytes, self.bytes_on_device)

    # O(1) each: running counts kept by put and free (a fresh output's device copy, dropped
    # at the end of its step, is not counted)

    @property
    def num_entries(self) -> int:
        return len(self._device) + len(self._host)

    @property
    def bytes_on_device(self) -> int:
        """Embedding bytes held on the device: kept entries plus the ping-pong buffers."""
        return self._device_bytes + self._buffer_bytes

    @property
    def bytes_on_host(self) -> int:
        return self._host_bytes

    @property
    def host_pool_bytes(self) -> int:
        """Host memory reserved up front for offloaded entries."""
        return _nbytes(self._pool.buf) if self.offload else 0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _nbytes_or_0(t: torch.Tensor | None) -> int:
    return 0 if t is None else _nbytes(t)

