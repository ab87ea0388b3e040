"""An image's tensors for the transformers backend as one uint8 tensor of their bytes.

The HF image processor's output for one image (``pixel_values`` and what the model's
``get_image_features`` reads besides, e.g. ``image_sizes``) travels from admission to the
encoder as one uint8 tensor (`ImageInput.pixels`: one copy to the device, like the native
models' pixels); their layout and the span's text tokens travel in ``encoder_meta``
(`pack_image`, `unpack_meta`), its small integer tensors (a grid, a size) as values there, so
that the tower reads them on the host.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

# what an image processor may return for an image and a model's `get_image_features` may
# read (an index into this tuple names the tensor in `encoder_meta`)
TENSOR_KEYS = ("pixel_values", "image_sizes", "image_grid_thw", "pixel_attention_mask",
               "spatial_shapes", "num_patches", "aspect_ratio_ids", "aspect_ratio_mask",
               "image_num_patches", "pixel_mask", "num_crops", "grids",
               "high_res_pixel_values", "num_local_patches", "pixel_values_local",
               "aspect_ratios", "batch_num_images", "image_position_ids")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.bool,
           torch.uint8)
_ALIGN = 8  # every tensor's bytes start on a multiple of this (a view as int64 needs it)
# integer tensors of at most this many values (an image's grid, its size) travel as values in
# ``encoder_meta``, not as bytes: the tower reads them on the host (`models/transformers_grids`)
_HOST_VALUES = 64


@dataclass(frozen=True)
class ImageLayout:
    """What ``encoder_meta`` says of one image (`unpack_meta`): how many of its span's tokens
    are image tokens, the span's other tokens (index in the span, token id), and each of its
    tensors as (name, dtype, shape) in the order of their bytes."""

    num_image_tokens: int
    text_tokens: tuple[tuple[int, int], ...]
    tensors: tuple[tuple[str, torch.dtype, tuple[int, ...]], ...]
    # the small integer tensors (grids, sizes), by name: their values, on the host
    host: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(_padded(math.prod(shape) * dtype.itemsize) for _, dtype, shape in self.tensors)


def _padded(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def pack_image(tensors: dict[str, torch.Tensor], span: Sequence[int], image_token_id: int,
               float_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, tuple[int, ...]]:
    """One image's tensors (the image processor's output for it) and its span's token ids ->
    (their bytes as one uint8 tensor, ``encoder_meta``). ``float_dtype``: floating tensors
    are carried in it (the model's dtype, which the tower casts them to anyway: the same
    values in fewer bytes). Each tensor is written once, into its place in the buffer."""
    text = [(i, t) for i, t in enumerate(span) if t != image_token_id]
    meta: list[int] = [len(span) - len(text), len(text)]
    for i, t in text:
        meta += [i, t]
    carried: list[tuple[torch.Tensor, torch.dtype]] = []
    meta.append(len(tensors))
    for key, t in tensors.items():
        if key not in TENSOR_KEYS:
            raise ValueError(f"the image processor gives {key!r}, which the transformers "
                             f"backend does not carry (it carries {', '.join(TENSOR_KEYS)})")
        if t.dtype not in _DTYPES:
            raise ValueError(f"the image processor gives {key!r} as {t.dtype}")
        dtype = float_dtype if float_dtype is not None and t.is_floating_point() else t.dtype
        meta += [TENSOR_KEYS.index(key), _DTYPES.index(dtype), t.dim(), *t.shape]
        if t.dtype in (torch.int64, torch.int32) and t.numel() <= _HOST_VALUES:
            meta += [1, *t.reshape(-1).tolist()]
            continue
        meta.append(0)
        carried.append((t, dtype))
    data = torch.empty(sum(_padded(t.numel() * d.itemsize) for t, d in carried),
                       dtype=torch.uint8)
    at = 0
    for t, dtype in carried:
        n = t.numel() * dtype.itemsize
        data[at:at + n].view(dtype).view(t.shape).copy_(t)
        data[at + n:at + _padded(n)] = 0
        at += _padded(n)
    return data, tuple(meta)


def unpack_meta(meta: Sequence[int]) -> ImageLayout:
    """`ImageLayout` of an ``encoder_meta`` made by `pack_image`."""
    it = iter(meta)
    num_image, num_text = next(it), next(it)
    text = tuple((next(it), next(it)) for _ in range(num_text))
    tensors, host = [], {}
    for _ in range(next(it)):
        key, dtype, ndim = TENSOR_KEYS[next(it)], _DTYPES[next(it)], next(it)
        shape = tuple(next(it) for _ in range(ndim))
        if next(it):
            host[key] = torch.tensor([next(it) for _ in range(math.prod(shape))],
                                     dtype=dtype).view(shape)
        else:
            tensors.append((key, dtype, shape))
    return ImageLayout(num_image, text, tuple(tensors), host)


def unpack_tensors(data: torch.Tensor, layout: ImageLayout) -> dict[str, torch.Tensor]:
    """An image's tensors: views of its bytes ``data`` (uint8, where they are), and its
    small integer tensors on the host."""
    out, at = dict(layout.host), 0
    for key, dtype, shape in layout.tensors:
        n = math.prod(shape) * dtype.itemsize
        out[key] = data[at:at + n].view(dtype).view(shape)
        at += _padded(n)
    return out
