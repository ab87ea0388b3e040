"""Embedding handles on the wire: typed msgspec structs (msgpack between processes, JSON over
HTTP with bytes as base64), never pickle, so a handle from an encoder server can be read by a
front end and forwarded to the engine core without running code that came with it.

    to_wire(handle) -> ShmWire | CudaWire | BytesWire      from_wire(wire) -> EmbeddingHandle
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Sequence
from typing import Annotated, Any

import msgspec
import torch

from vlmserve.transfer.encoded import EncodedImage, EncoderOutput
from vlmserve.transfer.handles import (
    ROW_DTYPES,
    BytesHandle,
    CudaIpcHandle,
    EmbeddingHandle,
    HandleError,
    ShmHandle,
    check_segment_name,
)


class _Common(msgspec.Struct, tag_field="kind", kw_only=True):
    handle_id: str
    shape: tuple[int, ...]
    dtype: str
    release_address: str | None
    expires_at: float


class ShmWire(_Common, tag="shm"):
    segment: str


class BytesWire(_Common, tag="bytes"):
    data: bytes


class CudaWire(_Common, tag="cuda"):
    """The fields of ``reduce_tensor``'s rebuild arguments that are data (the classes and the
    rebuild function are fixed on the consumer's side)."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int
    typed_storage: bool
    device: int
    ipc_handle: bytes
    storage_size_bytes: int
    storage_offset_bytes: int
    ref_counter_handle: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool
    block_offset: int | None = None  # pooled: the rows' byte offset in the shared block


HandleWire = ShmWire | BytesWire | CudaWire


def to_wire(h: EmbeddingHandle) -> HandleWire:
    common = dict(handle_id=h.handle_id, shape=tuple(h.shape), dtype=h.dtype,
                  release_address=h.release_address, expires_at=h.expires_at)
    if isinstance(h, ShmHandle):
        return ShmWire(**common, segment=h.segment)
    if isinstance(h, BytesHandle):
        return BytesWire(**common, data=h.data)
    if isinstance(h, CudaIpcHandle):
        (_, size, stride, offset, storage_cls, _, device, ipc_handle, size_bytes, offset_bytes,
         _, rc_handle, rc_offset, event_handle, event_sync) = h.args
        return CudaWire(**common, size=tuple(size), stride=tuple(stride), offset=offset,
                        typed_storage=storage_cls is torch.storage.TypedStorage,
                        device=int(device), ipc_handle=ipc_handle,
                        storage_size_bytes=size_bytes, storage_offset_bytes=offset_bytes,
                        ref_counter_handle=rc_handle, ref_counter_offset=rc_offset,
                        event_handle=event_handle, event_sync_required=event_sync,
                        block_offset=h.block_offset)
    raise TypeError(f"no wire form for {type(h).__name__}")


def from_wire(w: HandleWire) -> EmbeddingHandle:
    common = (w.handle_id, tuple(w.shape), w.dtype, w.release_address, w.expires_at)
    if w.dtype not in ROW_DTYPES:
        raise HandleError(f"handle {w.handle_id}: dtype {w.dtype!r}: embedding rows are one "
                          f"of {', '.join(ROW_DTYPES)}")
    if len(w.shape) != 2 or not all(0 <= d < 1 << 40 for d in w.shape):
        raise HandleError(f"handle {w.handle_id}: shape {list(w.shape)}: embedding rows are "
                          "[rows, width]")
    if isinstance(w, ShmWire):
        check_segment_name(w.segment)
        return ShmHandle(*common, segment=w.segment)
    if isinstance(w, BytesWire):
        return BytesHandle(*common, data=w.data)
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    storage_cls = torch.storage.TypedStorage if w.typed_storage else torch.UntypedStorage
    # a pooled handle shares its whole block (bytes); a tensor of its own, the rows
    tensor_dtype = torch.uint8 if w.block_offset is not None else getattr(torch, w.dtype)
    args = (torch.Tensor, torch.Size(w.size), tuple(w.stride), w.offset, storage_cls,
            tensor_dtype, w.device, w.ipc_handle, w.storage_size_bytes,
            w.storage_offset_bytes, False, w.ref_counter_handle, w.ref_counter_offset,
            w.event_handle, w.event_sync_required)
    return CudaIpcHandle(*common, rebuild=rebuild_cuda_tensor, args=args,
                         block_offset=w.block_offset)


# ---- POST /v1/encode -----------------------------------------------------------------------


class PixelImage(msgspec.Struct, kw_only=True):
    """An image already preprocessed by an LLM server's front end: its content hash, its
    ``encoder_meta`` and token count (``length``) as the model's processor gave them, and its
    resized uint8 pixels of ``shape`` (``[H, W, 3]``, or ``[tiles, S, S, 3]`` for LLaVA-NeXT);
    the encoder does not decode, resize or hash it again."""

    mm_hash: str
    encoder_meta: tuple[int, ...]
    length: int
    shape: tuple[int, ...]
    pixels: bytes


def pixel_image(img: Any) -> PixelImage:
    """A preprocessed `ImageInput` as the encoder receives it."""
    return PixelImage(mm_hash=img.mm_hash, encoder_meta=tuple(img.encoder_meta),
                      length=img.length, shape=tuple(img.pixels.shape),
                      pixels=img.pixels.contiguous().numpy().tobytes())


class EncodeRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """``images``: image URLs (``data:`` URLs; http(s) and local paths where the encoder
    server allows them) or `PixelImage`s. ``transport``: the handle kind, ``auto`` (CUDA IPC on
    a CUDA encoder, shared memory on a CPU one: both need the consumer on the same host),
    ``shm``, ``cuda`` or ``bytes`` (inline, for a consumer on another host). With ``prompt``
    (text with one image placeholder per image, image URLs only), the answer is the whole
    `EncoderOutputWire` of that prompt, for an LLM server's ``multi_modal_embeddings``.
    ``consumer``: the id of the LLM server that opens the handles (without a prompt): images
    whose handles it recently opened and released are answered without one (delivered.py);
    ``consumer_rows``: the rows its encoder cache holds."""

    images: list[str | PixelImage]
    transport: str = "auto"
    prompt: str | None = None
    consumer: Annotated[str, msgspec.Meta(min_length=1, max_length=128)] | None = None
    consumer_rows: Annotated[int, msgspec.Meta(ge=1)] | None = None


class EncodedImageWire(msgspec.Struct, kw_only=True):
    mm_hash: str
    length: int  # embedding rows == the image's placeholder tokens
    encoder_meta: tuple[int, ...]
    handle: HandleWire | None  # None: the request's consumer holds its rows already
    offset: int = 0  # its placeholder run's start in the prompt (with a prompt)


class EncoderOutputWire(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """An `EncoderOutput` on the wire: the prompt as the engine's admission would expand
    it, its position data, and its images with their handles."""

    prompt: str | None
    prompt_token_ids: list[int]
    images: list[EncodedImageWire]
    prompt_positions: list[list[int]] | None = None
    position_offset: int = 0


def output_to_wire(out: Any, handles: Sequence[HandleWire] | None = None
                   ) -> EncoderOutputWire:
    """`EncoderOutput` -> `EncoderOutputWire` (its handles must exist: a delivering rank);
    or a `ProcessedPrompt` with its images' ``handles`` (wire form, in order)."""
    if handles is None:
        handles = [to_wire(i.handle) for i in out.images]
    return EncoderOutputWire(
        prompt=out.prompt, prompt_token_ids=list(out.prompt_token_ids),
        images=[EncodedImageWire(mm_hash=i.mm_hash, length=i.length,
                                 encoder_meta=tuple(i.encoder_meta), handle=h, offset=i.offset)
                for i, h in zip(out.images, handles, strict=True)],
        prompt_positions=(None if out.prompt_positions is None
                          else out.prompt_positions.tolist()),
        position_offset=out.position_offset)


def output_from_wire(w: EncoderOutputWire, kinds: Sequence[str] = ("bytes",)) -> Any:
    """`EncoderOutputWire` -> `EncoderOutput` from a client; handles of a kind not in
    ``kinds`` are refused (`ValueError`): a shared-memory segment name or a CUDA IPC handle
    from a client would let it make the server read memory it names. Every handle's release
    address is dropped (the server contacts no address a client names; a producer reclaims
    what it holds at the lease), and each bytes or shared-memory handle gets an id of its own
    (a client's retry, or one image's rows given twice, is no second open of one handle).
    What the rest says is checked against what the server computes by the admission
    (`InputProcessor`)."""
    for i, img in enumerate(w.images):
        kind = type(img.handle).__name__.removesuffix("Wire").lower()
        if img.handle is None:
            raise ValueError(f"image {i}: no handle of its rows")
        if kind not in kinds:
            raise ValueError(f"image {i}: {kind} handles are not accepted here (only "
                             f"{', '.join(kinds)}; see --accept-encoder-handles)")
    positions = None
    if w.prompt_positions is not None:
        try:
            positions = torch.tensor(w.prompt_positions, dtype=torch.int64)
        except (TypeError, ValueError, OverflowError, RuntimeError) as e:
            raise ValueError(f"prompt_positions: not a table of 64-bit integers ({e})") from None
    handles = []
    for i, img in enumerate(w.images):
        fresh = ({} if isinstance(img.handle, CudaWire)
                 else {"handle_id": f"client-{uuid.uuid4().hex}"})
        try:
            handles.append(from_wire(msgspec.structs.replace(img.handle, release_address=None,
                                                             **fresh)))
        except HandleError as e:
            raise ValueError(f"image {i}: {e}") from None
    return EncoderOutput(w.prompt, list(w.prompt_token_ids),
                         [EncodedImage(i.mm_hash, i.offset, i.length, tuple(i.encoder_meta), h)
                          for i, h in zip(w.images, handles, strict=True)],
                         positions, w.position_offset)


class EncodeResponse(msgspec.Struct, kw_only=True):
    images: list[EncodedImageWire]


def open_handles(images: Sequence[Any], device: torch.device) -> list[torch.Tensor | None]:
    """Each image's rows: its ``embeds``, or its ``handle`` opened once (on ``device`` for a
    CUDA handle, on the host otherwise) and released. If one fails (`HandleError`), the
    handles not opened yet are released unread before the error is raised."""
    out: list[torch.Tensor | None] = []
    for i, img in enumerate(images):
        if img.handle is None:
            out.append(img.embeds)
            continue
        try:
            h = from_wire(img.handle)
            if len(h.shape) != 2 or h.shape[0] != img.length:
                h.release()
                raise HandleError(f"handle {h.handle_id}: rows {tuple(h.shape)} for an image "
                                  f"of {img.length} tokens")
            try:
                rows = h.open(device if isinstance(h, CudaIpcHandle) else "cpu")
            except HandleError:
                raise
            except Exception as e:  # a mapping or copy that fails: this request's problem
                raise HandleError(f"handle {h.handle_id}: {type(e).__name__}: {e}") from e
        except BaseException:
            for rest in images[i + 1:]:
                if rest.handle is not None:
                    with contextlib.suppress(Exception):
                        from_wire(rest.handle).release()
            raise
        out.append(rows)
    return out
