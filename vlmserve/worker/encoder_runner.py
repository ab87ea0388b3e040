"""Runs the vision tower once per step on every image due that step, across requests."""

from __future__ import annotations

import torch

from vlmserve.distributed.parallel_state import TensorParallel, split_by_rows
from vlmserve.multimodal.inputs import ImageInput, encoder_order, pixel_values
from vlmserve.worker.mm_embedding_store import MMEmbeddingStore


class _PixelStaging:
    """Two pinned host buffers, used in turn, that carry a step's uint8 pixels to the device
    in one asynchronous copy. A copy from pageable memory would wait for the stream first
    (stalling the step in flight); a buffer is refilled only after its previous copy has
    finished."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def to_device(self, parts: list[torch.Tensor]) -> list[torch.Tensor]:
        """``parts`` (uint8) as views of one device tensor, in order and shape."""
        if self.device.type != "cuda":
            return parts
        i, self.turn = self.turn, 1 - self.turn
        if self.copied[i] is not None:
            self.copied[i].synchronize()
        sizes = [p.numel() for p in parts]
        buf = self.buffers[i]
        if buf is None or buf.numel() < sum(sizes):
            buf = torch.empty(sum(sizes) * 5 // 4, dtype=torch.uint8, pin_memory=True)
            self.buffers[i] = buf
        host = buf[:sum(sizes)]
        torch.cat([p.reshape(-1) for p in parts], out=host)
        flat = host.to(self.device, non_blocking=True)
        self.copied[i] = torch.cuda.Event()
        self.copied[i].record()
        return [v.view(p.shape) for v, p in zip(flat.split(sizes), parts, strict=True)]


class EncoderRunner:
    def __init__(self, model, device: torch.device, dtype: torch.dtype,
                 store: MMEmbeddingStore, tp: TensorParallel | None = None) -> None:
        self.model = model
        self.device = device
        self.dtype = dtype  # the vision tower's
        self.store = store
        # tensor parallelism, data mode: each rank encodes a share of the images (rank 0
        # holds every image's pixels and sends each rank those of its share) and the rows are
        # all-gathered (every rank's store holds every image, as the LM needs)
        self.tp = tp
        self.staging = _PixelStaging(device)
        self.num_images = 0  # images encoded for this engine (by every rank together)
        self.num_own_images = 0  # of them, by this rank's tower
        self.pixel_bytes_received = 0  # from rank 0, for this rank's tower (data mode)
        self.num_batches = 0

    def run(self, inputs: dict[str, ImageInput]) -> None:
        """Encode the images of `inputs` (by content hash) in ONE forward (batch > 1) and
        store each image's rows by hash.

        Images go in `encoder_order` (most rows first, equal batch keys together); each
        image's `encoder_meta` goes to the model's `encode_images` as the processor made it.
        With tensor parallelism (data mode) every rank calls it with the same images, whose
        pixels only rank 0 needs to hold (`ImageInput.without_pixels` elsewhere).
        """
        unique = {h: img for h, img in inputs.items() if h not in self.store}
        for h, img in list(unique.items()):
            if img.embeds is not None:  # encoded elsewhere: only the copy is left
                self.store.put(h, img.embeds.to(self.device, self.dtype))
                del unique[h]
        if not unique:
            return
        images = encoder_order(unique.values())
        lengths = [img.length for img in images]
        if self.tp is None:
            parts = self._encode(images, [img.pixels for img in images]).split(lengths)
        else:  # every rank takes this branch with the same images (the same step)
            shares = split_by_rows(lengths, self.tp.world_size)
            mine = [images[i] for i in shares[self.tp.rank]]
            pixels = self.tp.scatter_from_first([[images[i].pixels for i in share]
                                                 for share in shares])
            if self.tp.rank != 0:
                self.pixel_bytes_received += sum(p.nbytes for p in pixels)
            own = (self._encode(mine, pixels) if mine else
                   torch.empty(0, self.model.row_width, dtype=self.dtype, device=self.device))
            parts = self.tp.gather_rows(lengths, shares, own)
        for img, part in zip(images, parts, strict=True):
            self.store.put(img.mm_hash, part)
        self.num_images += len(images)

    def _encode(self, images: list[ImageInput], pixels: list[torch.Tensor]) -> torch.Tensor:
        """``images``' rows from one tower forward (``pixels``: theirs, on the host):
        [sum(lengths), hidden]."""
        pixels = self.staging.to_device(pixels)
        pixels = pixel_values(images, pixels, self.dtype)  # the tower's input
        rows = self.model.encode_images(pixels, [img.encoder_meta for img in images])
        assert rows.shape[0] == sum(img.length for img in images), (
            f"vision tower returned {rows.shape[0]} rows for {[i.length for i in images]}")
        self.num_own_images += len(images)
        self.num_batches += 1
        return rows
