"""Start-up warm-up: every kernel variant a step can launch is compiled before the first
request, and the runner is left exactly as it was.

Triton compiles a kernel once per distinct (constexpr values, `num_warps` / `num_stages`,
argument dtypes, integer arguments equal to 1 or divisible by 16, pointers aligned to 16
bytes); integers named in `do_not_specialize` only carry their type (i32 / i64). What selects
a variant of each kernel here, and what covers it:

layers/triton_attention.py
- `_paged_attn_kernel` (every LM layer). Fixed per engine: G, HEAD_DIM, D_PAD, BLOCK_SIZE,
  DOT_PREC (dtype), the pointer dtypes (model and KV dtype; block tables int64 in eager
  steps, int32 in CUDA graphs), the strides of q (a view of the QKV output), of the KV cache
  and of `out` (always contiguous), alignments (buffers fresh or offset by whole rows). Per
  step: BLOCK_M / BLOCK_Q (prefill 64 or 128 rows by chunk length and tokens; decode
  max(16, G); fp32 32), BLOCK_N / num_warps / num_stages (16-bit decode: 64/2/2 from two waves
  of programs up, else 128/4/2), SEARCH_ITERS (0: one program range per request; else the
  binary-search depth, 4, 8, 12, ... by batch size) and SPLIT_KV (decode with few programs,
  by batch, KV heads and the longest context). Sizes and the block-table stride are runtime
  ints. Covered: CUDA-graph batch sizes when captured (ModelRunner init); every eager variant
  by `warmup_plan.plan_paged` (the same launch function over every step shape the limits
  allow), replayed on the real KV cache with q laid out as the model's (recorded from the
  real steps below, one-token steps apart).
- `_merge_splits_kernel`: SPLITS_PAD (next power of two of the split count, 2..64) and
  num_warps (2 or 4 by D_PAD * splits); covered by the same plan.
- `_varlen_attn_kernel` (vision towers with the `triton` backend): BLOCK_M / BLOCK_N /
  num_warps by the longest segment (<= 16, 32, 64, more; fp32 one tile) and SEARCH_ITERS by
  the number of segments (frames or windows, up to one per embedding row of the step's
  encoder budget). Covered by `plan_varlen`, replayed with q / k / v laid out as the tower's.
layers/triton_ops.py
- `_norm_kernel` (HAS_RESIDUAL, LAYER, BLOCK from the width), `_silu_mul_kernel` (BLOCK from
  the width), `_rotary_cache_kernel` (WRITE_CACHE, head counts, HALF) and, for one-token steps
  only, `_gemv_kernel` (K, NORM, HAS_RES, HAS_BIAS, GATED, tiles from K) and
  `_qkv_rope_kernel` (HAS_RES: none in layer 0, HAS_BIAS, HALF, K): every argument is a width,
  stride or count of the model, so one variant per call site. Covered by the real steps:
  a prefill step mixing chunks and images, a mixed prefill + decode step, a decode-shaped
  eager step, a decode-only step (graphs), a one-token eager step.
- `_quick_gelu_kernel` (Qwen2-VL vision MLP): its size argument (numel) is specialised, so
  numel % 16 == 0 or not depends on the step's patch count unless the MLP width is a multiple
  of 16. Covered by replaying rows 4..19 (every residue) at the recorded width.
layers/fused.py (`fused_ops="compile"`): `torch.compile(dynamic=True)` specialises sizes 0
and 1 (one token vs more) and dtypes per call site; covered by the same real steps and the
vision forward. CUDA graphs were compiled (and captured) before this runs.

Not covered (not Triton): the cuDNN graphs of the torch vision attention backend are built
per (batch, length) shape; only those of the warm-up's own images (`image_sizes`) are.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from vlmserve.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from vlmserve.layers.attention import build_attention_metadata, triton_available
from vlmserve.layers.attention_launch import cdiv, num_sms
from vlmserve.sampling_params import SamplingParams
from vlmserve.worker.encoder_runner import EncoderRunner
from vlmserve.worker.mm_embedding_store import MMEmbeddingStore
from vlmserve.worker.warmup_plan import Limits, plan_paged, plan_varlen

DEFAULT_IMAGE_SIZES: tuple[tuple[int, int], ...] = ((224, 224), (280, 168))


@dataclass(frozen=True)
class _Layout:
    """Strides, storage offset and dtype of a tensor, to make one of another length that
    specialises the same (alignment included: fresh storages are aligned alike)."""

    tail: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    dtype: torch.dtype

    @classmethod
    def of(cls, t: torch.Tensor) -> _Layout:
        return cls(tuple(t.shape[1:]), t.stride(), t.storage_offset(), t.dtype)

    def span(self, rows: int) -> int:
        shape = (rows, *self.tail)
        return self.offset + 1 + sum((n - 1) * s for n, s in zip(shape, self.stride))

    def make(self, rows: int, device: torch.device, base: torch.Tensor | None = None
             ) -> torch.Tensor:
        """A zero tensor of `rows` rows laid out alike (a view of `base` if given)."""
        if base is None:
            base = torch.zeros(self.span(rows), dtype=self.dtype, device=device)
        return base.as_strided((rows, *self.tail), self.stride, self.offset)


class _Recorder:
    """Calls `fn`, keeping the layouts of the tensor arguments of the first call for each
    `key(args)` (and the first call's other arguments), and every distinct tail of
    positional arguments past the first `head` (a layer's window and soft-cap)."""

    def __init__(self, fn, key=lambda *args: None, head: int | None = None) -> None:
        self.fn, self.key, self.head = fn, key, head
        self.layouts: dict = {}
        self.args: tuple = ()
        self.tails: set[tuple] = set()

    def __call__(self, *args, **kwargs):
        if self.head is not None:
            self.tails.add(tuple(args[self.head:]))
        key = self.key(*args)
        if key not in self.layouts:
            self.layouts[key] = [_Layout.of(a) if isinstance(a, torch.Tensor) else None
                                 for a in args]
            self.args = self.args or args
        return self.fn(*args, **kwargs)


def _image(width: int, height: int, seed: int) -> Image.Image:
    y, x, c = np.ogrid[:height, :width, :3]
    return Image.fromarray(((7 * y + 3 * x + 50 * c + 31 * seed) % 256).astype(np.uint8))


class _RunnerState:
    """What a step changes in the runner: put aside before the warm-up (the warm-up runs on
    a store, encoder runner and request table of its own, without the timeline) and put
    back after it."""

    _FIELDS = ("requests", "_paused_generators", "store", "encoder", "timeline",
               "_num_results", "num_graph_steps")

    def __init__(self, runner, kv_blocks: int) -> None:
        self.fields = {k: getattr(runner, k) for k in self._FIELDS}
        tensors = [runner.sampled, *runner._host_tokens]
        # (not a linear layer's state pools: every slot is free before the first request,
        # and a request's first step starts from zeros or a restored snapshot)
        # (each cache once: layers that read another's share its tensor)
        tensors += [kv[:, :kv_blocks] for kv in {id(kv): kv for kv in runner.kv_caches}.values()
                    if isinstance(kv, torch.Tensor) and kv.dim() > 1]
        g = runner.graphs
        if g is not None:
            tensors += [g.dev64, g.dev32] + [t for st in g.staging for t in (st.host64,
                                                                              st.host32)]
            self.graph_runs = g.num_runs
            self.rows = [(list(st.row_owner), list(st.row_blocks)) for st in g.staging]
        self.tensors = [(t, t.clone()) for t in tensors]

    @staticmethod
    def scratch(runner, image_rows: int) -> None:
        runner.requests, runner._paused_generators, runner.timeline = {}, {}, None
        runner.store = MMEmbeddingStore(runner.device, runner.model.row_width, runner.dtype,
                                        offload=runner.store.offload, buffer_rows=image_rows,
                                        host_rows=image_rows)
        runner.encoder = EncoderRunner(runner.model, runner.device, runner.dtype, runner.store)

    def restore(self, runner) -> None:
        for k, v in self.fields.items():
            setattr(runner, k, v)
        with torch.inference_mode():  # the graph buffers are inference tensors on CUDA
            for dst, src in self.tensors:
                dst.copy_(src)
        g = runner.graphs
        if g is not None:
            g.num_runs = self.graph_runs
            for st, (owner, blocks) in zip(g.staging, self.rows):
                st.row_owner[:], st.row_blocks[:] = owner, blocks


def run_warmup(runner, limits: Limits, processor, *, fused_ops=None,
               vision_attention_fn=None,
               image_sizes: Sequence[tuple[int, int]] = DEFAULT_IMAGE_SIZES) -> float:
    """Drive every kernel variant once (see the module docstring); returns seconds spent.

    `processor`: the model's input processor (prompts and images as admission makes them);
    `fused_ops` / `vision_attention_fn`: what the model was given. On the CPU only the real
    steps run (eager kernels, nothing to compile: a fraction of a second on a tiny model)."""
    start = time.perf_counter()
    model, device = runner.model, runner.device
    prompts = _prompts(processor, image_sizes, limits.max_model_len)
    kv_blocks = min(sum(cdiv(len(p.prompt_token_ids) + 4, runner.block_size)
                        for p in prompts), runner.num_blocks)
    saved = _RunnerState(runner, kv_blocks)
    paged = _Recorder(runner.attention_fn, key=lambda q, *a: q.shape[0] == 1, head=4)
    vision = _Recorder(vision_attention_fn) if vision_attention_fn is not None else None
    gelu = _Recorder(fused_ops.quick_gelu) if fused_ops is not None else None
    try:
        _RunnerState.scratch(runner, sum(img.length for img in prompts[0].images))
        model.set_attention_backend(paged)
        if vision is not None:
            model.set_vision_attention_backend(vision)
        if gelu is not None:
            fused_ops.quick_gelu = gelu
        with torch.inference_mode():
            _real_steps(runner, prompts)
            if device.type == "cuda" and triton_available(device):
                _replay(runner, limits, paged, vision, gelu, fused_ops, prompts[0])
    finally:
        model.set_attention_backend(runner.attention_fn)
        if vision is not None:
            model.set_vision_attention_backend(vision_attention_fn)
        if gelu is not None:
            fused_ops.quick_gelu = gelu.fn
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        saved.restore(runner)
    return time.perf_counter() - start


def _prompts(processor, image_sizes: Sequence[tuple[int, int]], max_len: int) -> list:
    """A prompt with the images, a text prompt of a dozen tokens or more, a one-token one;
    each at most `max_len` - 4 tokens (the images are left out of a prompt too long)."""
    words = processor.process("warm up " * 12, None, [])
    words = processor.process(None, words.prompt_token_ids[:max_len - 4], [])
    assert len(words.prompt_token_ids) >= 5, f"max_model_len {max_len} is too short"
    parts = [{"type": "image"}] * len(image_sizes) + [{"type": "text", "text": "Warm up."}]
    text = processor.apply_chat_template([{"role": "user", "content": parts}])
    images = [_image(w, h, i) for i, (w, h) in enumerate(image_sizes)]
    with_images = processor.process(text, None, images)
    if len(with_images.prompt_token_ids) > max_len - 4:
        with_images = words
    one = processor.process(None, words.prompt_token_ids[:1], [])
    return [with_images, words, one]


def _real_steps(runner, prompts: list) -> None:
    """Six steps of three fake requests through `execute_model`, read back as the engine
    does with async scheduling (a step's tokens after the next step is launched)."""
    vis, text, one = prompts
    p0, p1 = len(vis.prompt_token_ids), len(text.prompt_token_ids)
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    blocks = iter(range(1 << 30))
    slots = iter(range(1 << 30))  # linear-attention state slots, where the model has them

    def new(rid: str, p) -> NewRequestData:
        n = cdiv(len(p.prompt_token_ids) + 4, runner.block_size)
        table = [next(blocks) % runner.num_blocks for _ in range(n)]
        return NewRequestData(rid, list(p.prompt_token_ids), len(p.prompt_token_ids),
                              [img.feature for img in p.images], p.prompt_positions,
                              p.position_offset, greedy, (), table, 0,
                              [list(table) for _ in runner.kv_groups[1:]],
                              state_slot=(next(slots) % runner.linear.num_slots
                                          if runner.linear is not None else None))

    def step(scheduled: dict[str, int], computed: dict[str, int], **kw):
        cached = [CachedRequestData(rid, [], n, [[] for _ in runner.kv_groups[1:]])
                  for rid, n in computed.items()]
        return runner.execute_model(SchedulerOutput(
            cached_requests=cached, num_scheduled_tokens=scheduled, **kw))

    results = [step({"w0": p0, "w1": p1 - 4}, {}, new_requests=[new("w0", vis), new("w1", text)],
                    encoder_inputs={img.mm_hash: img for img in vis.images})]
    # a decode beside a prefill chunk; a decode-shaped step with a prompt's last token (eager)
    results.append(step({"w0": 1, "w1": 3}, {"w0": p0, "w1": p1 - 4}))
    results.pop(0).get()
    results.append(step({"w0": 1, "w1": 1}, {"w0": p0 + 1, "w1": p1 - 1}))
    results.pop(0).get()
    results.append(step({"w0": 1, "w1": 1}, {"w0": p0 + 2, "w1": p1}))  # decode only: graphs
    results.pop(0).get()
    results.append(step({"w2": 1}, {}, new_requests=[new("w2", one)],  # one token, eager
                        finished_request_ids={"w0", "w1"},
                        free_encoder_hashes=[img.mm_hash for img in vis.images]))
    for r in results:
        r.get()
    step({}, {}, finished_request_ids={"w2"})
    assert not runner.requests and runner.store.num_entries == 0


def _replay(runner, limits: Limits, paged: _Recorder, vision: _Recorder | None,
            gelu: _Recorder | None, fused_ops, vis) -> None:
    """The variants the real steps did not reach, from the recorded layouts (CUDA)."""
    from vlmserve.layers import triton_attention as ta

    device = runner.device

    if runner.attention_fn is ta.paged_attention_triton and paged.layouts:
        q_any, kv, _, scale = paged.args[:4]
        heads, head_dim = q_any.shape[1:]
        plan = plan_paged(limits, heads, kv.shape[-2], head_dim, q_any.dtype == torch.float32,
                          num_sms(device), decode_tile=ta.DECODE_TILE,
                          min_split_tokens=ta._MIN_SPLIT_TOKENS)
        for query_lens, seq_lens in plan.shapes():
            one = sum(query_lens) == 1
            q = (paged.layouts.get(one) or paged.layouts[not one])[0].make(sum(query_lens),
                                                                          device)
            tables = [[j % runner.num_blocks for j in range(cdiv(s, runner.block_size))]
                      for s in seq_lens]
            meta = build_attention_metadata(list(query_lens), list(seq_lens), tables,
                                            runner.block_size, device)
            for tail in sorted(paged.tails, key=repr):  # every window and soft-cap seen
                paged.fn(q, kv, meta, scale, *tail)
    if vision is not None and vision.fn is ta.varlen_attention_triton and vision.layouts:
        layouts = vision.layouts[None][:3]
        rows = sum(img.length for img in vis.images)
        per_row = max(vision.args[0].shape[0] // max(rows, 1), 1)
        lim = Limits(limits.max_num_seqs, limits.max_num_batched_tokens,
                     limits.max_model_len, limits.max_encoder_rows, per_row)
        for lens in plan_varlen(lim, layouts[0].dtype == torch.float32).values():
            cu = torch.tensor((0, *lens), dtype=torch.int64).cumsum(0).to(torch.int32)
            n = sum(lens)  # q, k and v: views of one buffer, as of the tower's QKV output
            base = torch.zeros(max(lay.span(n) for lay in layouts), dtype=layouts[0].dtype,
                               device=device)
            q, k, v = (lay.make(n, device, base) for lay in layouts)
            vision.fn(q, k, v, cu.to(device), max(lens))
    if gelu is not None and fused_ops.kind == "triton" and gelu.layouts:
        lay = gelu.layouts[None][0]
        for rows in range(4, 20):
            gelu.fn(lay.make(rows, device))
