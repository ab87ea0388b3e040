"""Building blocks shared by the Qwen2-VL and Qwen2.5-VL vision towers.

Token layout: ``pixel_values`` rows are patches of all images concatenated, each image's
patches ordered frame by frame and, inside a frame, by spatial-merge block (the
``merge x merge`` patches that the merger fuses into one output token are adjacent).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import lru_cache

import torch
import torch.nn.functional as F
from torch import nn

from vlmserve.layers.fused import EAGER_OPS, quick_gelu
from vlmserve.layers.norm import LayerNorm, RMSNorm
from vlmserve.layers.vision_attention import varlen_attention
from vlmserve.models.vision.step_inputs import AttnSegments, TowerTensors, VisionInputs

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "quick_gelu": quick_gelu,  # FusedOps.quick_gelu replaces it (one kernel with triton)
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "swish": F.silu,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Activation function for a HF ``hidden_act`` name."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"unsupported vision hidden_act {name!r}")
    return _ACTIVATIONS[name]


def rope_theta(config) -> float:
    """Rotary base of a HF vision config (transformers 5.x ``rope_parameters``; default 1e4)."""
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(config, "rope_theta", 10000.0)))


class PatchEmbed(nn.Module):
    """Conv3d patchifier with kernel == stride, run as one matmul over flattened patches.

    The parameter keeps the checkpoint's conv layout ``proj.weight``
    ``[embed, C, T, P, P]``; rows of ``pixel_values`` are flattened in (C, T, P, P) order.
    """

    def __init__(
        self, patch_size: int, temporal_patch_size: int, in_channels: int, embed_dim: int,
        bias: bool = False,
    ) -> None:
        super().__init__()
        kernel = (temporal_patch_size, patch_size, patch_size)
        self.proj = nn.Conv3d(in_channels, embed_dim, kernel_size=kernel, stride=kernel, bias=bias)
        self.embed_dim = embed_dim

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight  # [embed, C, T, P, P]
        x = pixel_values.to(w.dtype).reshape(-1, w[0].numel())  # [num_patches, C*T*P*P]
        return F.linear(x, w.reshape(self.embed_dim, -1), self.proj.bias)  # [num_patches, embed]


class VisionRotary(nn.Module):
    """2-D rotary tables: the first half of the rotated pairs use the row index, the second the
    column index, with shared frequencies over ``head_dim // 4`` channels (rotate-half layout)."""

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 4:
            raise ValueError(f"vision head_dim must be divisible by 4, got {head_dim}")
        half = head_dim // 2
        inv_freq = 1.0 / theta ** (torch.arange(0, half, 2, dtype=torch.float32) / half)
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # [head_dim // 4]

    def forward(self, pos_hw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``pos_hw [N, 2]`` (row, col) -> float32 ``(cos, sin)``, each ``[N, head_dim]``."""
        inv_freq = self.inv_freq.to(pos_hw.device)
        freqs = (pos_hw.float()[:, :, None] * inv_freq).flatten(1)  # [N, head_dim/2]: h | w
        emb = torch.cat([freqs, freqs], dim=-1)  # [N, head_dim]
        return emb.cos(), emb.sin()


class VisionAttention(nn.Module):
    """Multi-head self-attention with fused ``qkv`` (bias) and 2-D rotary, over packed segments."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)
        self.attn_fn = None  # None: torch SDPA per equal-length group; else (q, k, v, cu, max)
        self.ops = EAGER_OPS

    def forward(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], seg: AttnSegments
    ) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # each [N, H, D]
        cos, sin = rotary
        q, k = self.ops.rotary_qk_float32(q, k, cos, sin)
        if self.attn_fn is None:
            out = varlen_attention(q, k, v, seg.cu_seqlens, seg.max_seqlen, plan=seg.plan)
        else:
            out = self.attn_fn(q, k, v, seg.cu_seqlens, seg.max_seqlen)  # [N, H, D]
        return self.proj(out.reshape(n, self.num_heads * self.head_dim))


class VisionMLP(nn.Module):
    """``fc2(act(fc1(x)))`` (Qwen2-VL)."""

    def __init__(self, dim: int, hidden_dim: int, act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.act_name = act
        self.act = get_activation(act)
        self.ops = EAGER_OPS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = self.ops.quick_gelu if self.act_name == "quick_gelu" else self.act
        return self.fc2(act(self.fc1(x)))


class GatedVisionMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with biases (Qwen2.5-VL)."""

    def __init__(self, dim: int, hidden_dim: int, act: str) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim)
        self.up_proj = nn.Linear(dim, hidden_dim)
        self.down_proj = nn.Linear(hidden_dim, dim)
        self.act = get_activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    """Pre-norm transformer block: ``x + attn(norm1(x))``, then ``x + mlp(norm2(x))``.

    Each residual add is folded into the norm after it: a block takes the previous block's
    MLP output (``delta``) with the stream before it and returns its own pair; the tower adds
    the last pair."""

    def __init__(
        self, dim: int, num_heads: int, mlp: nn.Module, norm: Callable[[int], nn.Module]
    ) -> None:
        super().__init__()
        self.norm1 = norm(dim)
        self.norm2 = norm(dim)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(
        self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], seg: AttnSegments,
        delta: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(mlp output, residual stream before it)``."""
        h, x = (self.norm1(x), x) if delta is None else self.norm1(delta, x)
        h, x = self.norm2(self.attn(h, rotary, seg), x)
        return self.mlp(h), x


class PatchMerger(nn.Module):
    """Fuse each ``merge x merge`` block: ``ln_q`` -> concat -> Linear -> GELU -> Linear."""

    def __init__(
        self, out_dim: int, context_dim: int, merge: int, norm: Callable[[int], nn.Module]
    ) -> None:
        super().__init__()
        self.in_dim = context_dim * merge**2
        self.ln_q = norm(context_dim)
        self.mlp = nn.Sequential(
            nn.Linear(self.in_dim, self.in_dim), nn.GELU(), nn.Linear(self.in_dim, out_dim)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).reshape(-1, self.in_dim))  # [N / merge^2, out_dim]


def layer_norm(dim: int) -> nn.Module:
    """LayerNorm with the Qwen vision eps."""
    return LayerNorm(dim, eps=1e-6)


def rms_norm(dim: int) -> nn.Module:
    """RMSNorm with the Qwen vision eps."""
    return RMSNorm(dim, eps=1e-6)


def grid_list(grid_thw: torch.Tensor) -> list[tuple[int, int, int]]:
    """``grid_thw [num_images, 3]`` as host ints (one sync if on device)."""
    return [(int(t), int(h), int(w)) for t, h, w in grid_thw.tolist()]


@lru_cache(maxsize=256)
def _grid_positions(t: int, h: int, w: int, merge: int) -> torch.Tensor:
    """Host ``[t*h*w, 2]`` (row, col) of one grid's patches in spatial-merge block order."""
    if h % merge or w % merge:
        raise ValueError(
            f"grid h and w must be multiples of spatial_merge_size={merge}: {(t, h, w)}")
    within = torch.arange(h * w)  # index inside the frame
    block, in_block = within // merge**2, within % merge**2
    blocks_w = w // merge
    row = (block // blocks_w) * merge + in_block // merge
    col = (block % blocks_w) * merge + in_block % merge
    return torch.stack([row, col], dim=-1).repeat(t, 1)


def merge_order_positions(grids: list[tuple[int, int, int]], merge: int) -> torch.Tensor:
    """Host ``[num_patches, 2]`` (row, col) of every patch, in spatial-merge block order
    (computed once per grid shape: a step's images mostly share a few)."""
    if not grids:
        return torch.zeros(0, 2, dtype=torch.long)
    return torch.cat([_grid_positions(t, h, w, merge) for t, h, w in grids])


def frame_seqlens(grids: list[tuple[int, int, int]]) -> torch.Tensor:
    """Host ``[num_frames]`` patches per frame (full attention runs per frame, as HF does)."""
    return torch.tensor([h * w for t, h, w in grids for _ in range(t)], dtype=torch.long)


class VisionTowerBase(nn.Module):
    """Weight loading and dtype/device helpers shared by the towers; a Qwen tower's step:
    its host inputs (`step_inputs`, from the grids) and its device work (`run`), eager or
    replayed from a CUDA graph (`graphs`: a `worker/vision_graphs.VisionGraphs`)."""

    spatial_merge_size: int
    out_hidden_size: int
    graphs = None
    torch_attention = True  # SDPA until `set_attention_backend` gives another

    def step_inputs(self, grids: list[tuple[int, int, int]]) -> VisionInputs:
        raise NotImplementedError

    def run(self, pixel_values: torch.Tensor, inputs: TowerTensors) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """Encode a batch of images/videos.

        Args:
            pixel_values: ``[num_patches, C*T*P*P]``, images concatenated in ``grid_thw`` order.
            grid_thw: ``[num_images, 3]`` patch grid (t, h, w) per image.

        Returns:
            ``[num_patches // merge**2, out_hidden_size]``: image 0's tokens, then image 1's, ...
        """
        inputs = self.step_inputs(grid_list(grid_thw))
        if inputs.rows != pixel_values.shape[0]:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} rows, grid_thw "
                             f"implies {inputs.rows}")
        if self.graphs is not None:
            out = self.graphs.run(pixel_values, inputs)
            if out is not None:
                return out
        return self.run(pixel_values, inputs.to_device(self.device, self.torch_attention))

    def set_attention_backend(self, fn) -> None:
        """`fn(q, k, v, cu_seqlens, max_seqlen)` for every block, or None for torch SDPA."""
        self.torch_attention = fn is None  # its launches are planned on the host
        for module in self.modules():
            if isinstance(module, VisionAttention):
                module.attn_fn = fn

    @property
    def dtype(self) -> torch.dtype:
        return self.patch_embed.proj.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.patch_embed.proj.weight.device

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy ``(name, tensor)`` pairs (names relative to the tower) into parameters.

        Raises ``KeyError`` on unknown names and ``ValueError`` on shape mismatches.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        with torch.no_grad():
            for name, tensor in weights:
                if name not in params:
                    raise KeyError(f"unexpected vision weight {name!r}")
                param = params[name]
                if tuple(param.shape) != tuple(tensor.shape):
                    raise ValueError(
                        f"{name}: shape {tuple(tensor.shape)} != expected {tuple(param.shape)}"
                    )
                param.copy_(tensor.to(param.dtype))
                loaded.add(name)
        return loaded
