"""Runs the vision tower once per step on every image due that step, across requests."""

from __future__ import annotations

import torch

from vlmserve.multimodal.inputs import ImageInput
from vlmserve.worker.mm_embedding_store import MMEmbeddingStore


class EncoderRunner:
    def __init__(self, model, device: torch.device, store: MMEmbeddingStore) -> None:
        self.model = model
        self.device = device
        self.store = store
        self.num_images = 0
        self.num_batches = 0

    def run(self, images: list[ImageInput]) -> None:
        """Encode `images` in ONE forward (batch > 1) and store each image's rows by hash."""
        images = [img for img in images if img.mm_hash not in self.store]
        if not images:
            return
        # each image's pixels copied on their own, then joined on the device
        pixels = torch.cat([img.pixel_values.to(self.device, non_blocking=True)
                            for img in images])
        grid = torch.tensor([img.grid_thw for img in images], dtype=torch.int64)
        rows = self.model.encode_images(pixels, grid.to(self.device))  # [sum(length), hidden]
        assert rows.shape[0] == sum(img.length for img in images), (
            f"vision tower returned {rows.shape[0]} rows for {[i.length for i in images]}")
        for img, part in zip(images, rows.split([img.length for img in images])):
            self.store.put(img.mm_hash, part)
        self.num_images += len(images)
        self.num_batches += 1
