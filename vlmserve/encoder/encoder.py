"""`MultimodalEncoder`: the vision tower of a checkpoint as a service of its own.

It loads only the tower's weights (``visual.*``: patch embedding, blocks, merger), preprocesses
prompts exactly as the engine's admission does (same token ids, content hashes, encoder
metadata, position data), runs every image of every given request through the tower in one
forward, and returns per request an `EncoderOutput` whose images carry embedding handles
(see handles.py) recorded in a `HandleLedger` until the consumer releases them or their lease
runs out.
With ``tensor_parallel_size=N`` it runs N ranks: rank 0 here, ranks 1..N-1 spawned
(`distributed/ranks.py`, on a group of their own, so an engine or another encoder in the same
process keeps theirs). Each call, rank 0 preprocesses and broadcasts the processed requests;
every rank takes its share of the call's distinct images (`split_by_rows`: largest first, each
to the rank with the fewest rows so far), runs it through its tower, and the rows are
all-gathered, so every rank holds every image's rows, as TensorRT-LLM's encoder ranks each held
full results. Only rank 0's outputs reach the caller, so only rank 0 exports handles; a
follower exports only with ``export_only_delivered=False`` (the negative control: its handles
sit in its own ledger, unopened, until their lease). A rank that dies or stops answering
(``tp_timeout``) fails the call with `EncoderRankError`, and every later call too.
"""

from __future__ import annotations

import contextlib
import sys
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vlmserve.config import EngineConfig, ModelConfig, resolve_config
from vlmserve.distributed.parallel_state import RankFailedError, TensorParallel, split_by_rows
from vlmserve.distributed.ranks import Followers
from vlmserve.encoder.ledger import HandleLedger, LedgerStats
from vlmserve.inputs.processor import InputProcessor, PromptInput
from vlmserve.layers.attention import triton_available
from vlmserve.layers.fused import FusedOps
from vlmserve.layers.vision_attention import get_vision_attention_backend, graph_attention
from vlmserve.models.loader import iter_safetensors, load_hf_config
from vlmserve.models.metadata import local_engine_config, model_processor
from vlmserve.models.quantization import checkpoint_quantization
from vlmserve.models.registry import resolve_model_class
from vlmserve.multimodal.inputs import ImageInput, ProcessedPrompt, encoder_order, pixel_values
from vlmserve.transfer.delivered import DeliveredImages
from vlmserve.transfer.encoded import EncodedImage, EncoderOutput
from vlmserve.utils import device_memory, resolve_device, resolve_dtype, to_device
from vlmserve.worker.vision_graphs import attach_vision_graphs

EncoderRankError = RankFailedError  # a rank of a tensor-parallel encoder failed


@dataclass
class Launched:
    """A forward `MultimodalEncoder.launch` queued: its requests, rows by content hash
    (still being computed on a GPU) and the event recorded behind them (None on the CPU)."""

    processed: list[ProcessedPrompt]
    transport: str
    export: bool
    rows: dict[str, torch.Tensor]
    done: torch.cuda.Event | None


@dataclass
class EncoderStats:
    requests: int = 0
    images: int = 0  # images in the requests
    encoded_images: int = 0  # distinct images through the tower
    batches: int = 0  # tower forwards
    handles_not_exported: int = 0  # images of requests this rank does not deliver
    known_images: int = 0  # answered as held by their consumer already (`delivered`)
    ledger: LedgerStats = field(default_factory=LedgerStats)
    # tensor-parallel rank 0 only: every rank's own stats, index = rank (rank 0's first)
    ranks: list[EncoderStats] = field(default_factory=list)


def encoder_input_processor(model_path: str | Path, hf_config, mc: ModelConfig | None = None
                            ) -> InputProcessor:
    """The engine's admission preprocessing for the checkpoint at ``model_path`` (tokenizer
    and image processor; no weights) with the model options ``mc`` (its image processor
    options, tokenizer folder, trust_remote_code; default: none): what an encoder and its
    server's front end share."""
    return InputProcessor.for_model(
        model_path, hf_config, model_processor(model_path, hf_config, mc or ModelConfig()))


def build_encoder(hf_config, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    """The model class's image encoder alone (`build_encoder`: a vision tower, or a tower and
    its projector), uninitialised, on ``device``."""
    model_cls = resolve_model_class(hf_config)
    if not hasattr(model_cls, "build_encoder"):
        raise ValueError(f"{model_cls.__name__} has no image encoder to serve")
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            encoder = model_cls.build_encoder(hf_config)
    finally:
        torch.set_default_dtype(old)
    return encoder.eval()


class MultimodalEncoder:
    """The vision tower of ``model`` with the engine's preprocessing.

    Takes `LLM`'s option names (``model``, ``dtype``, ``device``, ``seed``,
    ``vision_attention_backend``, ``fused_ops``, ...; the language model's options are
    accepted and unused). Encoder options:

        transport: default handle kind: ``auto`` (CUDA IPC on CUDA, shared memory on the
            CPU), ``shm``, ``cuda`` or ``bytes`` (for a consumer on another host).
        lease_s: seconds a consumer has to open and release a handle before it is reclaimed.
        ledger_address: zmq endpoint for release messages (default: a fresh ``ipc://``).
        rank: this process's tensor-parallel rank; only rank 0 delivers results, so only it
            exports handles (``encode(export=...)`` overrides per call).
        export_only_delivered: False switches that rule off: every rank exports (the negative
            control: a follower's handles are never opened and wait for their lease).
        tensor_parallel_size: N > 1 spawns ranks 1..N-1 (a GPU each on CUDA, gloo on the
            CPU); each call's images are split among the ranks by rows and the rows gathered
            on every rank. ``rank`` must then be 0.
        tp_timeout_s: how long a rank waits for the others in a call before it gives up with
            `EncoderRankError` (at start, for them to load: at least 300 s); a rank that dies
            is noticed at once. Default: `LLM`'s ``tp_timeout``.
    """

    def __init__(self, model: str = "tiny-qwen2-vl", *, transport: str = "auto",
                 lease_s: float = 30.0, ledger_address: str | None = None, rank: int = 0,
                 export_only_delivered: bool = True, tp_timeout_s: float | None = None,
                 _group: TensorParallel | None = None, **kwargs: Any) -> None:
        # _group: a follower rank's group (`serve_follower`)
        # a model given by name becomes its folder here, once (the followers get the folder)
        config = local_engine_config(EngineConfig.from_kwargs(model=model, **kwargs))
        world = config.parallel_config.tensor_parallel_size
        self.followers: Followers | None = None  # rank 0 of a tensor-parallel encoder
        self.group = _group  # the ranks' group (set on every rank when world > 1)
        self.device = resolve_device(config.model_config.device,
                                     rank if config.tensor_parallel else None)
        self.dtype = resolve_dtype(config.model_config.dtype, self.device)
        self.config = resolve_config(
            config, "encoder", self.device.type, device_memory(self.device),
            triton=triton_available(self.device), dtype=str(self.dtype).removeprefix("torch."))
        mc = self.config.model_config
        try:
            if world > 1 and _group is None:
                if rank != 0:
                    raise ValueError("a tensor-parallel encoder starts its ranks 1..N-1 "
                                     f"itself; create it with rank=0 (got rank={rank})")
                options = {**kwargs, "tokenizer": mc.tokenizer, "transport": transport,
                           "lease_s": lease_s, "export_only_delivered": export_only_delivered}
                timeout = (tp_timeout_s if tp_timeout_s is not None
                           else self.config.parallel_config.tp_timeout)
                self.followers = Followers(world, serve_follower, (mc.model, options), mc.device,
                                           timeout, name="vlmserve-encoder-tp")
                self.group = self.followers.connect(self.device)
            self._load(mc)
            # which images each consumer holds (its released handles): see delivered.py
            self.delivered = DeliveredImages()
            self.ledger = HandleLedger(ledger_address, lease_s=lease_s,
                                       on_free=self.delivered.freed)
            if self.group is not None:
                self.group.barrier()  # every rank loaded (a follower's error is raised here)
        except BaseException:
            if self.followers is not None:
                self.followers.stop(abort=True)
            raise
        self.transport = transport
        self.rank = rank
        # image rows one forward of the encoder server takes (`encode` itself takes any)
        self.max_rows_per_forward = self.config.scheduler_config.max_num_encoder_tokens
        self.export_only_delivered = export_only_delivered
        self._stats = EncoderStats()
        self._export_stream: torch.cuda.Stream | None = None

    def _load(self, mc) -> None:
        self.model_path = Path(mc.model)  # a folder (`local_engine_config`)
        self.hf_config = load_hf_config(self.model_path, mc.model_impl,
                                        trust_remote_code=mc.trust_remote_code)
        model_cls = resolve_model_class(self.hf_config)
        torch.manual_seed(mc.seed)
        self.vision = build_encoder(self.hf_config, self.dtype, self.device)
        # only the encoder's tensors are read from disk
        loaded = self.vision.load_weights(iter_safetensors(
            self.model_path, model_cls.encoder_prefixes,
            quant=checkpoint_quantization(self.hf_config)))
        missing = {n for n, _ in self.vision.named_parameters()} - loaded
        if missing:
            raise ValueError(f"checkpoint {self.model_path} lacks vision weights: "
                             f"{sorted(missing)[:8]}")
        ops = FusedOps.for_device(mc.fused_ops, self.device)
        for module in self.vision.modules():
            if hasattr(module, "ops"):
                module.ops = ops
        self.vision.set_attention_backend(
            get_vision_attention_backend(mc.vision_attention_backend, self.device,
                                         self.dtype))
        if self.config.resolved.vision_cuda_graph_max_rows:
            attach_vision_graphs(self.vision, self.config.resolved.vision_cuda_graph_max_rows,
                                 attention=graph_attention(self.device, self.dtype))
        self.input_processor = encoder_input_processor(self.model_path, self.hf_config, mc)
        self.model_processor = self.input_processor.model_processor

    @property
    def delivers(self) -> bool:
        """Whether this rank's results reach the caller (rank 0)."""
        return self.rank == 0

    @property
    def hidden_size(self) -> int:
        return self.vision.out_hidden_size

    def process(self, prompt: PromptInput) -> ProcessedPrompt:
        """The engine's admission preprocessing (raises `InvalidRequestError` on bad input)."""
        return self.input_processor.process(prompt)

    @torch.inference_mode()
    def encode(self, requests: Sequence[PromptInput | ProcessedPrompt],
               transport: str | None = None, export: bool | None = None
               ) -> list[EncoderOutput]:
        """Preprocess ``requests``, run all their images through the tower in ONE forward
        and return an `EncoderOutput` per request, in order.

        Each image occurrence gets a handle of its own (``transport``, default the encoder's)
        when ``export`` (default: `delivers`) holds, or always with
        ``export_only_delivered=False``; else its ``handle`` is None and nothing is held.
        With tensor parallelism the processed requests go to every rank first (each encodes
        its share; the other ranks' ``export`` is their default); a rank that died or stopped
        answering raises `EncoderRankError`.
        """
        return self.finish(self.launch(requests, transport, export))

    @torch.inference_mode()
    def launch(self, requests: Sequence[PromptInput | ProcessedPrompt],
               transport: str | None = None, export: bool | None = None) -> Launched:
        """`encode`'s first half: the tower's forward queued on the device, nothing exported
        yet; `finish` exports. Another call's forward may be launched in between (it runs
        behind this one), so the device has the next forward while the host exports."""
        processed = [r if isinstance(r, ProcessedPrompt) else self.process(r) for r in requests]
        transport = transport or self.transport
        if self.followers is not None:
            self.group.check()
            self.group.broadcast_object(("encode", processed, transport))
        return self._launch(processed, transport, export)

    def _launch(self, processed: list[ProcessedPrompt], transport: str,
                export: bool | None) -> Launched:
        if export is None:
            export = self.delivers
        export = export or not self.export_only_delivered
        rows = self._rows([img for p in processed for img in p.images])
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record()
        return Launched(processed, transport, export, rows, done)

    @torch.inference_mode()
    def finish(self, launched: Launched) -> list[EncoderOutput]:
        """`encode`'s second half: a handle per image occurrence (where this rank exports),
        an `EncoderOutput` per request. On CUDA the copies run on a stream of their own that
        waits for this forward only, not for any launched after it."""
        stream = None
        if launched.done is not None:
            if self._export_stream is None:
                self._export_stream = torch.cuda.Stream(self.device)
            stream = self._export_stream
            stream.wait_event(launched.done)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            outputs = self._export(launched)
            if stream is not None:
                stream.synchronize()  # the rows' last reader done: their memory may go
        return outputs

    def _export(self, launched: Launched) -> list[EncoderOutput]:
        rows, transport = launched.rows, launched.transport
        outputs = []
        s = self._stats
        for p in launched.processed:
            images = []
            for img in p.images:
                handle = (self.ledger.export(rows[img.mm_hash], transport) if launched.export
                          else None)
                s.handles_not_exported += handle is None
                images.append(EncodedImage(img.mm_hash, img.offset, img.length,
                                           tuple(img.encoder_meta), handle))
            outputs.append(EncoderOutput(p.prompt, list(p.prompt_token_ids), images,
                                         p.prompt_positions, p.position_offset))
            s.requests += 1
            s.images += len(images)
        return outputs

    @torch.inference_mode()
    def _encode_processed(self, processed: list[ProcessedPrompt], transport: str,
                          export: bool | None) -> list[EncoderOutput]:
        """`encode` after the preprocessing: every rank of a tensor-parallel encoder runs
        this on the same requests."""
        return self.finish(self._launch(processed, transport, export))

    def _rows(self, images: list[ImageInput]) -> dict[str, torch.Tensor]:
        """Rows of every distinct image (by content hash). Largest first, equal sizes
        together (as the engine's encoder runner orders them); with tensor parallelism each
        rank runs its share (`split_by_rows`) and the rows are all-gathered: every rank ends
        with every image's rows. A rank whose share fails makes every rank raise."""
        unique = encoder_order({img.mm_hash: img for img in images}.values())
        if self.group is None:
            return self._run_tower(unique)
        if not unique:
            return {}
        lengths = [img.length for img in unique]
        shares = split_by_rows(lengths, self.group.world_size)
        mine = [unique[i] for i in shares[self.group.rank]]
        error = None
        try:
            own = self._run_tower(mine)
            own = torch.cat([own[img.mm_hash] for img in mine]) if mine else torch.empty(
                (0, self.hidden_size), dtype=self.dtype, device=self.device)
        except Exception as e:  # noqa: BLE001 - the other ranks must hear of it
            error = e
        # every rank makes the same collectives, whether its share failed or not
        if not self.group.all_true(error is None):
            why = None if error is None else f"{type(error).__name__}: {error}"
            errors = self.group.all_gather_object(why)
            if error is not None:
                raise error
            raise RuntimeError("encoder rank(s) failed this call: " + "; ".join(
                f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None))
        rows = self.group.gather_rows(lengths, shares, own)
        return {img.mm_hash: r for img, r in zip(unique, rows, strict=True)}

    def _run_tower(self, unique: list[ImageInput]) -> dict[str, torch.Tensor]:
        """Rows of ``unique`` (distinct, in order) from one forward: uint8 pixels to the
        device in one copy, then transformed there; each image's ``encoder_meta`` as it is."""
        if not unique:
            return {}
        parts = [img.pixels for img in unique]
        if self.device.type != "cpu":
            sizes = [p.numel() for p in parts]
            flat = torch.cat([p.reshape(-1) for p in parts])
            flat = to_device(flat, self.device)
            parts = [v.view(p.shape) for v, p in zip(flat.split(sizes), parts, strict=True)]
        pixels = pixel_values(unique, parts, self.dtype)  # the tower's input
        out = self.vision(pixels, [img.encoder_meta for img in unique])  # [sum(length), hidden]
        lengths = [img.length for img in unique]
        assert out.shape[0] == sum(lengths), (
            f"vision tower returned {out.shape[0]} rows for {lengths}")
        self._stats.encoded_images += len(unique)
        self._stats.batches += 1
        return {img.mm_hash: part for img, part in zip(unique, out.split(lengths))}

    def _own_stats(self) -> EncoderStats:
        s = self._stats
        return EncoderStats(s.requests, s.images, s.encoded_images, s.batches,
                            s.handles_not_exported, self.delivered.known_images,
                            self.ledger.stats())

    def get_stats(self) -> EncoderStats:
        """This rank's stats; on rank 0 of a tensor-parallel encoder also every rank's, in
        ``ranks`` (gathered now)."""
        own = self._own_stats()
        if self.followers is not None:
            self.group.check()
            self.group.broadcast_object(("stats",))
            own.ranks = self.group.all_gather_object(self._own_stats())
        return own

    def shutdown(self) -> None:
        """Stop the other ranks (each closes its ledger), reclaim every live handle and stop
        the ledger."""
        try:
            if self.followers is not None:
                self.followers.stop()
        finally:
            self.ledger.close()

    def __enter__(self) -> MultimodalEncoder:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def serve_follower(tp: TensorParallel, model: str, options: dict[str, Any]) -> None:
    """A follower rank (spawned by `distributed/ranks.py`): its encoder, then rank 0's
    broadcasts until None: ``("encode", processed, transport)`` runs the call's share and
    builds this rank's outputs (dropped: they reach nobody); ``("stats",)`` all-gathers the
    stats. Its ledger is closed on the way out (shared-memory segments unlinked)."""
    enc = MultimodalEncoder(model, rank=tp.rank, _group=tp, **options)
    try:
        while (msg := tp.broadcast_object()) is not None:
            if msg[0] == "encode":
                try:
                    enc._encode_processed(msg[1], msg[2], export=None)
                except RankFailedError:
                    raise
                except Exception:  # noqa: BLE001 - failed here alone (the ranks agreed on it,
                    traceback.print_exc(file=sys.stderr)  # or an export): still in step
            elif msg[0] == "stats":
                tp.all_gather_object(enc._own_stats())
    finally:
        enc.ledger.close()
