"""Runs the vision tower once per step on every image due that step, across requests."""

from __future__ import annotations

import torch

from vlmserve.multimodal.inputs import ImageInput
from vlmserve.worker.mm_embedding_store import MMEmbeddingStore


class _PixelStaging:
    """Two pinned host buffers, used in turn, that carry a step's pixels to the device in one
    asynchronous copy. A copy from pageable memory would wait for the stream first (stalling
    the step in flight); a buffer is refilled only after its previous copy has finished."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: list[torch.Tensor | None] = [None, None]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.turn = 0

    def to_device(self, parts: list[torch.Tensor]) -> torch.Tensor:
        if self.device.type != "cuda":
            return torch.cat(parts).to(self.device)
        i, self.turn = self.turn, 1 - self.turn
        if self.copied[i] is not None:
            self.copied[i].synchronize()
        rows, cols, dtype = sum(p.shape[0] for p in parts), parts[0].shape[1], parts[0].dtype
        buf = self.buffers[i]
        if buf is None or buf.dtype != dtype or buf.numel() < rows * cols:
            buf = torch.empty(rows * cols * 5 // 4, dtype=dtype, pin_memory=True)
            self.buffers[i] = buf
        host = buf[:rows * cols].view(rows, cols)
        torch.cat(parts, out=host)
        pixels = host.to(self.device, non_blocking=True)
        self.copied[i] = torch.cuda.Event()
        self.copied[i].record()
        return pixels


class EncoderRunner:
    def __init__(self, model, device: torch.device, store: MMEmbeddingStore) -> None:
        self.model = model
        self.device = device
        self.store = store
        self.staging = _PixelStaging(device)
        self.num_images = 0
        self.num_batches = 0

    def run(self, images: list[ImageInput]) -> None:
        """Encode `images` in ONE forward (batch > 1) and store each image's rows by hash.

        Images go in by size, largest first, so that equal sizes sit together and the vision
        attention runs on them as one batch without gathering; the grid stays on the host
        (the tower plans its launches from it without a device sync).
        """
        unique = {img.mm_hash: img for img in images if img.mm_hash not in self.store}
        if not unique:
            return
        images = sorted(unique.values(), key=lambda img: -img.length)
        pixels = self.staging.to_device([img.pixel_values for img in images])
        grid = torch.tensor([img.grid_thw for img in images], dtype=torch.int64)
        rows = self.model.encode_images(pixels, grid)  # [sum(length), hidden]
        assert rows.shape[0] == sum(img.length for img in images), (
            f"vision tower returned {rows.shape[0]} rows for {[i.length for i in images]}")
        for img, part in zip(images, rows.split([img.length for img in images])):
            self.store.put(img.mm_hash, part)
        self.num_images += len(images)
        self.num_batches += 1
