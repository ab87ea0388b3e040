"""Engine configuration: one frozen dataclass per concern, gathered in `EngineConfig`.

Every field is an engine option under the same name in `LLM(...)`, the CLI and the server.
A field's `metadata["help"]` is its documentation (the CLI's `--help` reads it).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass, field
from typing import Any


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


# The batch limits a device gets when the user sets neither (`sized_scheduler_limits`), as vLLM
# sizes its defaults: large batches on a large GPU; a server takes half the step budget of an
# offline run, so that prefill chunks hold up its streams less. Rows: (least GPU memory in
# GiB, max_num_seqs, max_num_batched_tokens offline, serving), largest first; then the CPU's.
_GPU_SIZES = ((70, 512, 16384, 8192), (0, 256, 8192, 4096))
_CPU_SIZES = (64, 2048, 2048)


def _sizes_help(column: str) -> str:
    """`_GPU_SIZES` and `_CPU_SIZES` in words, for an option's help (the table is written once)."""
    where = [f"on a GPU of {row[0]} GiB or more" if row[0] else "on a smaller GPU"
             for row in _GPU_SIZES]
    if column == "seqs":
        parts = [f"{row[1]} {w}" for row, w in zip(_GPU_SIZES, where, strict=True)]
        return ", ".join(parts) + f", {_CPU_SIZES[0]} on the CPU"
    parts = [f"{row[2]:,} offline and {row[3]:,} serving {w}" if i == 0 else
             f"{row[2]:,} and {row[3]:,} {w}"
             for i, (row, w) in enumerate(zip(_GPU_SIZES, where, strict=True))]
    cpu = (f"{_CPU_SIZES[1]:,}" if _CPU_SIZES[1] == _CPU_SIZES[2]
           else f"{_CPU_SIZES[1]:,} and {_CPU_SIZES[2]:,}")
    return ", ".join(parts) + f", {cpu} on the CPU"


@dataclass(frozen=True)
class ModelConfig:
    model: str = _opt(
        "tiny-qwen2-vl", "Hugging Face checkpoint folder, built-in model name or Hugging Face "
        "model id (org/name: downloaded into the Hub's cache, or read from it offline with "
        "HF_HUB_OFFLINE=1; HF_TOKEN for gated and private models), tried in that order.",
        group="model")
    tokenizer: str | None = _opt(
        None, "Tokenizer (and chat template) folder or Hugging Face model id, when not the "
        "model's; the image processor is still the model's (default: the model's).", group="model")
    revision: str | None = _opt(
        None, "Branch, tag or commit hash of a Hugging Face model id (default: main).",
        group="model")
    tokenizer_revision: str | None = _opt(
        None, "Branch, tag or commit hash of a --tokenizer given as a Hugging Face model id "
        "(default: --revision if the tokenizer is the model's own id, else main).", group="model")
    download_dir: str | None = _opt(
        None, "Hugging Face cache folder that models given by id are downloaded into and read "
        "from (default: huggingface_hub's: $HF_HUB_CACHE, else $HF_HOME/hub, else "
        "~/.cache/huggingface/hub).", group="model")
    trust_remote_code: bool = _opt(
        False, "Let transformers run the Python code a checkpoint ships for its config, "
        "tokenizer or processor (its auto_map classes that transformers lacks); such a "
        "checkpoint is refused without it. Only for repositories you trust.", group="model")
    dtype: str = _opt("auto", "Weights and activations dtype: auto (bfloat16 on CUDA, float32 "
                      "on the CPU), float32, bfloat16, float16 (float and half: vLLM's names).",
                      choices=("auto", "float32", "bfloat16", "float16", "float", "half"),
                      group="model")
    device: str = _opt("auto", "Device: auto (cuda if available), cpu, cuda, cuda:N.",
                       group="model")
    max_model_len: int | None = _opt(
        None, "Longest prompt + output in tokens (default: the model's).", group="model")
    seed: int = _opt(0, "Seed for random sampling of requests that give no seed.", group="model")
    generation_config: str = _opt(
        "auto", "Default sampling parameters of requests that leave them unset: auto (the "
        "model's generation_config.json: its temperature, top_p, top_k, min_p, "
        "repetition_penalty and max_new_tokens, as vLLM does), vllm (none of it: "
        "SamplingParams' own defaults), or a folder holding a generation_config.json.",
        group="model")
    mm_processor_kwargs: dict[str, Any] | None = _opt(
        None, "Image processor options (vLLM's; JSON on the command line): for the Qwen "
        "models min_pixels and max_pixels (or size: {shortest_edge, longest_edge}), the pixel "
        "range every image is resized into, which decides its token count; LLaVA's take "
        "none. A request may give its own (mm_processor_kwargs) for its images.",
        group="multimodal")
    model_impl: str = _opt(
        "auto", "Which implementation runs the model (vLLM's --model-impl): auto (the "
        "native one where vlmserve has it, else transformers'), native, or transformers (the "
        "checkpoint's transformers model with the engine's paged attention, for any "
        "image-text-to-text architecture of transformers whose layers are all attention; "
        "one that cannot be served is refused at load, naming why).",
        choices=("auto", "native", "transformers"), group="model")
    quantization: str = _opt(
        "auto", "Weights of the language model's projections: auto (a block-wise FP8 "
        "checkpoint's held as FP8, computed by FP8 kernels on CUDA; under tensor "
        "parallelism where a rank's part starts on a block), none (an FP8 checkpoint's "
        "read back to dtype as they load), fp8 (an unquantized checkpoint's quantized to "
        "block-wise FP8, 128x128, as they load; without tensor parallelism). The FP8 "
        "kernels are not tuned yet: on an H100 the 2B decoded 1.8x slower with FP8 weights "
        "than in bfloat16 (the kernels have changed since, not measured yet), so none "
        "trades weight memory for speed.",
        choices=("auto", "none", "fp8"), group="model")
    attention_backend: str = _opt("auto", "Paged attention: auto (triton on CUDA), torch, triton.",
                                  choices=("auto", "torch", "triton"), group="expert")
    linear_attention_backend: str = _opt(
        "auto", "Linear attention (Gated DeltaNet layers): auto (fla on CUDA where "
        "flash-linear-attention is installed, else torch), torch, fla.",
        choices=("auto", "torch", "fla"), group="expert")
    vision_attention_backend: str = _opt(
        "torch", "Vision tower attention: torch (SDPA per equal-length group), flash (torch's "
        "varlen FlashAttention, one call for all images and windows; CUDA, fp16/bf16), triton "
        "(ours, one launch; CUDA) or auto (flash where it runs, else torch).",
        choices=("torch", "flash", "triton", "auto"), group="expert")
    enforce_eager: bool = _opt(False, "Never use CUDA graphs (they need the triton backend).",
        group="expert")
    vision_cuda_graph_max_rows: int = _opt(
        0, "Vision steps of at most this many patch rows replay CUDA graphs, one captured "
        "per size bucket when first met (CUDA; the Qwen towers' graphs run flash attention, "
        "or triton in float32, whatever the eager steps run; CLIP and SigLIP towers by batch "
        "size; not with "
        "--enforce-eager nor the tower's weights split by --mm-encoder-tp-mode weights; "
        "their memory is taken as they are captured, beside gpu_memory_utilization's "
        "share); 0: off.", group="expert")
    kernel_warmup: bool | None = _opt(
        None, "At start-up, compile every kernel variant a step can launch (fake requests "
        "through the model), so the first requests run at steady-state speed; default: on "
        "CUDA.", group="expert")
    fused_ops: str = _opt(
        "auto", "The decoder's norm/rotary/SiLU pieces: auto (triton on CUDA), eager, triton "
        "(one kernel each), compile (torch.compile, compiles at start-up).",
        choices=("auto", "eager", "triton", "compile"), group="expert")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = _opt(16, "Tokens per KV cache block.", group="cache")
    num_kv_blocks: int | None = _opt(
        None, "KV cache blocks; default: from gpu_memory_utilization on CUDA, else enough for "
        "max_num_seqs full-length sequences (at most 8192).", group="cache")
    gpu_memory_utilization: float = _opt(0.85, "Share of GPU memory the engine may use.",
        group="cache")
    mm_cache_gb: float = _opt(
        4.0, "Byte budget (GiB) for image embeddings: with offload, host memory reserved at "
        "start (pinned on CUDA); else device memory, taken as needed (an image or video "
        "of more rows than it holds is refused; the default holds any a model allows).",
        group="cache")
    enable_mm_cache: bool = _opt(
        True, "Keep embeddings of finished requests (LRU, by image content hash) for reuse.",
        group="cache")
    mm_embedding_offload: bool | None = _opt(
        None, "Keep image embeddings in pinned host memory and prefetch each chunk's rows; "
        "default: on with chunked prefill on CUDA.", group="cache")
    enable_prefix_caching: bool = _opt(
        True, "Reuse the KV blocks of a prompt's prefix computed for an earlier request (keyed "
        "by tokens and image content); images inside a reused prefix are not encoded.",
        group="cache")
    kv_cache_dtype: str = _opt(
        "auto", "The KV cache's dtype (vLLM's flag): auto (the model's dtype) or fp8 (also "
        "fp8_e4m3: float8 e4m3 with a per-tensor scale per layer for keys and one for "
        "values, the checkpoint's k_scale / v_scale where it has them, else 1.0; half the "
        "bytes per token, so about twice the tokens in the same memory; on "
        "the CPU or a GPU of compute capability 8.9 or newer with the triton kernels). "
        "Greedy output stays close, not identical: see docs/caching.md.",
        choices=("auto", "fp8", "fp8_e4m3"), group="cache")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int | None = _opt(
        None, "Most requests running at once (default: sized to the device by "
        f"`vlmserve.config.sized_scheduler_limits`: {_sizes_help('seqs')}).", group="scheduler")
    max_num_batched_tokens: int | None = _opt(
        None, "Token budget per engine step, prefill chunks + decodes (default: sized to the "
        f"device by `vlmserve.config.sized_scheduler_limits`: {_sizes_help('tokens')}).",
        group="scheduler")
    enable_chunked_prefill: bool = _opt(True, "Split long prompts into chunks across steps.",
        group="scheduler")
    max_num_encoder_tokens: int | None = _opt(
        None, "Image-embedding rows the vision tower may produce per step (default: the step "
        "budget, at least the model's largest image or video item within its context length: "
        "a whole Qwen2-VL video is one item; an encoder server's forward: the step budget).",
        group="scheduler")
    max_num_prefill_tokens_while_decoding: int | None = _opt(
        None, "Prompt tokens (prefill chunks) a step may carry while it also carries decodes, "
        "so running streams wait less behind new prompts; also the image rows such a step "
        "encodes beyond its first image (an image is encoded whole); a step without decodes "
        "still takes the whole step budget (needs chunked prefill; default: the step budget).",
        group="scheduler")
    max_num_encoder_tokens_while_decoding: int | None = _opt(
        None, "Image rows a step that also carries decodes may encode beyond its first image "
        "(an image is encoded whole), so running streams wait less behind the vision tower; "
        "prompt tokens are not capped (default: half the step budget when serving, none "
        "offline).", group="scheduler")
    async_scheduling: bool = _opt(
        True, "Schedule and launch each step before reading back the previous one's tokens, "
        "so the device does not wait for the host between steps (outputs come a step later).",
        group="expert")


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = _opt(
        1, "Ranks that split the language model's heads and MLP (one process per rank; "
        "a GPU each on CUDA, gloo on CPU); -tp is the same flag (vLLM's).", aliases=("-tp",),
        group="parallel")
    tp_timeout: float = _opt(
        300.0, "Seconds a tensor-parallel collective may wait for a rank before the engine "
        "gives up (a rank that died is noticed before each step, at once).", group="parallel")
    mm_encoder_tp_mode: str = _opt(
        "data", "The vision tower (and projector) under tensor parallelism: data (each rank "
        "encodes a share of a step's images with a whole copy of the tower, split by rows, "
        "and the rows are all-gathered), replicate (every rank encodes every image with a "
        "whole copy) or weights (the tower's heads and MLP split across the ranks like the "
        "language model's, all-reduced: each rank holds about 1/N of its weights and runs "
        "every image through its share). data is the default: vLLM measured it 10 to 45 "
        "percent faster than weights on several GPUs; weights saves device memory.",
        choices=("data", "replicate", "weights"), group="parallel")
    enable_expert_parallel: bool = _opt(
        False, "Mixture-of-experts layers (Qwen3-VL-MoE) under tensor parallelism: each rank "
        "holds a share of the experts whole, instead of every expert's share of the "
        "intermediate columns (the number of experts must divide by the ranks).", group="parallel")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Bounds on structured outputs (and tool calls, held to their schema): what a request may
    ask for, checked before anything compiles, and what one grammar's compile may take."""

    max_grammar_bytes: int = _opt(
        256 << 10, "Largest structured output a request may ask for, in bytes: its JSON "
        "schema (as JSON; with tool_choice \"required\" or a named function, the tools' "
        "schemas together), regular expression, grammar or choices together.", group="structured")
    max_grammar_nesting: int = _opt(
        64, "Deepest nesting of a JSON schema's objects and arrays a request may send.",
        group="structured")
    max_grammar_choices: int = _opt(1024, "Most choices of a request's `choice` output.",
        group="structured")
    grammar_compile_timeout: float = _opt(
        30.0, "Seconds one grammar may take to compile (in a compile process, which is "
        "ended after it); its request is refused naming this option.", group="structured")
    grammar_compile_workers: int = _opt(
        2, "Processes that compile grammars, each one grammar at a time, smallest first; "
        "grammars over 16 KiB never take the last free one.", group="structured")
    grammar_compile_memory_gb: float = _opt(
        2.0, "Memory (GiB) one grammar's compile may add to its process before it is ended "
        "and its request refused naming this option.", group="structured")

    def __post_init__(self) -> None:
        for name in ("max_grammar_bytes", "max_grammar_nesting", "max_grammar_choices",
                     "grammar_compile_workers"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("grammar_compile_timeout", "grammar_compile_memory_gb"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")


_SECTIONS = {
    "model_config": ModelConfig,
    "cache_config": CacheConfig,
    "scheduler_config": SchedulerConfig,
    "parallel_config": ParallelConfig,
    "structured_outputs_config": StructuredOutputsConfig,
}


ROLES = ("offline", "serving", "encoder")


@dataclass(frozen=True)
class Resolved:
    """What `resolve_config` derived beside the options it settled (those it writes into the
    options themselves: see there)."""

    role: str  # offline (`LLM`), serving (a server's engine core) or encoder
    device_type: str  # cuda, cpu, ...
    limits_sized: bool  # max_num_seqs or max_num_batched_tokens came from the device's table
    # image-embedding rows the encoder cache holds (mm_cache_gb over a row's bytes: the
    # scheduler's budget and, offloaded, the host rows); None for an encoder
    encoder_cache_rows: int | None
    cuda_graphs: bool  # decode steps replay CUDA graphs (CUDA, triton attention, not eager)
    # vision steps of at most this many rows replay CUDA graphs (0: none)
    vision_cuda_graph_max_rows: int = 0


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    structured_outputs_config: StructuredOutputsConfig = field(
        default_factory=StructuredOutputsConfig)
    # set by `resolve_config` (not an option): None while the options are as the user gave them
    resolved: Resolved | None = None

    @property
    def tensor_parallel(self) -> bool:
        """Whether the model is split across ranks (more than one)."""
        return self.parallel_config.tensor_parallel_size > 1

    @staticmethod
    def option_fields() -> list[dataclasses.Field]:
        """Every engine option, in order, across all sections."""
        return [f for cls in _SECTIONS.values() for f in dataclasses.fields(cls)]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from flat options (`model=..., max_num_seqs=...`); unknown names raise."""
        known = {f.name for f in cls.option_fields()}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s): {', '.join(unknown)}")
        parts = {}
        for name, section in _SECTIONS.items():
            names = {f.name for f in dataclasses.fields(section)}
            parts[name] = section(**{k: v for k, v in kwargs.items() if k in names})
        config = cls(**parts)
        config.validate()
        return config

    def validate(self) -> None:
        s, c = self.scheduler_config, self.cache_config
        if self.model_config.max_model_len is not None and self.model_config.max_model_len < 1:
            raise ValueError("max_model_len must be >= 1")
        if s.max_num_seqs is not None and s.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if s.max_num_batched_tokens is not None and s.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if s.max_num_prefill_tokens_while_decoding is not None:
            if s.max_num_prefill_tokens_while_decoding < 1:
                raise ValueError("max_num_prefill_tokens_while_decoding must be >= 1")
            if not s.enable_chunked_prefill:
                raise ValueError("max_num_prefill_tokens_while_decoding needs chunked prefill "
                                 "(a prompt longer than it could wait for ever)")
        if (s.max_num_encoder_tokens_while_decoding is not None
                and s.max_num_encoder_tokens_while_decoding < 1):
            raise ValueError("max_num_encoder_tokens_while_decoding must be >= 1")
        if c.block_size < 1:
            raise ValueError("block_size must be >= 1")
        if c.num_kv_blocks is not None and c.num_kv_blocks < 1:
            raise ValueError("num_kv_blocks must be >= 1")
        if self.parallel_config.tensor_parallel_size < 1:
            raise ValueError("tensor_parallel_size must be >= 1")
        for section in _SECTIONS.values():  # every option with choices
            for f in dataclasses.fields(section):
                modes, value = f.metadata.get("choices"), getattr(self._section(section), f.name)
                if modes and value not in modes:
                    raise ValueError(f"{f.name} must be one of {', '.join(modes)}, "
                                     f"got {value!r}")

        if self.model_config.quantization == "fp8" and self.tensor_parallel:
            raise ValueError("quantization='fp8' (quantizing as the weights load) does not run "
                             "under tensor parallelism; quantize the checkpoint once with "
                             "vlmserve.models.quantization.quantize_fp8_checkpoint and load "
                             "that (quantization='auto')")

    def _section(self, section: type) -> Any:
        return next(getattr(self, n) for n, cls in _SECTIONS.items() if cls is section)


def sized_scheduler_limits(device_type: str, device_memory: int | None, serving: bool
                           ) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) when the user sets neither: the table
    `_GPU_SIZES` (by the GPU's total memory; unknown: the smallest row) or `_CPU_SIZES`."""
    if device_type != "cuda":
        seqs, offline, served = _CPU_SIZES
    else:
        memory = device_memory or 0
        seqs, offline, served = next(row[1:] for row in _GPU_SIZES if memory >= row[0] * 2**30)
    return seqs, served if serving else offline


def auto_kernels(device_type: str, triton: bool, dtype: str | None) -> dict[str, str]:
    """What `auto` means for each kernel option on a device (`triton`: Triton kernels run
    there, i.e. CUDA with triton importable; `dtype`: the weights' dtype by name): triton paged
    attention and fused ops where Triton runs (else torch's reference and eager ops), torch's
    varlen FlashAttention for the vision tower on CUDA in float16 or bfloat16 (else SDPA),
    flash-linear-attention's kernels for linear attention where Triton runs and it is
    installed (else torch's)."""
    fla = triton and importlib.util.find_spec("fla") is not None
    return {"attention_backend": "triton" if triton else "torch",
            "linear_attention_backend": "fla" if fla else "torch",
            "fused_ops": "triton" if triton else "eager",
            "vision_attention_backend": ("flash" if device_type == "cuda"
                                         and dtype in ("float16", "bfloat16") else "torch")}


def _vision_graph_rows(config: EngineConfig, cuda: bool) -> int:
    """The rows under which vision steps replay CUDA graphs: the option's on CUDA, unless
    eager or the tower's weights are split (its collectives are not captured)."""
    rows = config.model_config.vision_cuda_graph_max_rows
    if rows < 0:
        raise ValueError(f"vision_cuda_graph_max_rows must be >= 0, got {rows}")
    if not rows or not cuda or config.model_config.enforce_eager or (
            config.tensor_parallel and config.parallel_config.mm_encoder_tp_mode == "weights"):
        return 0
    return rows


def resolve_config(config: EngineConfig, role: str, device_type: str,
                   device_memory: int | None = None, *, triton: bool = False,
                   dtype: str | None = None, max_image_tokens: int | None = None,
                   embedding_row_bytes: int | None = None, max_video_item_tokens: int = 0,
                   max_model_len: int | None = None,
                   prompt_whole: bool = False) -> EngineConfig:
    """`config` with every derived default settled for `role` on this device: the one place
    they are computed; every consumer reads the result, never an option's None or auto.

    `role`: offline (`LLM`), serving (the server's engine core: a server's batch limits and
    image rows beside decodes) or encoder (`MultimodalEncoder`, the encoder server's core).
    A tensor-parallel rank of the engine reads rank 0's result (sent to it at start); every
    rank of a tensor-parallel encoder resolves its own from the same options.
    The device: `device_type`, `device_memory` (a GPU's total bytes: `utils.device_memory`),
    `triton` (Triton kernels run there), `dtype` (the weights', by name: `utils.resolve_dtype`).
    The model, for the engine's roles: `max_image_tokens` (rows of its largest image),
    `max_video_item_tokens` (of its largest video encoder item: a whole Qwen2-VL video, a
    Qwen3-VL temporal patch; 0 without videos), `max_model_len` (its context, where known: no
    item longer can be served), `embedding_row_bytes` (one image embedding row in `dtype`) and
    `prompt_whole` (it reads its whole prompt both ways: each prompt computed in one step,
    chunked prefill and prefix caching off). The largest item is the larger of the first two,
    at most `max_model_len`.

    Written into the options:
    - max_num_seqs, max_num_batched_tokens: `sized_scheduler_limits` where unset (an encoder
      sized as an offline run);
    - max_num_encoder_tokens: the engine's encoder budget, unset: the step budget, at least the
      largest item (else one could never be scheduled: vLLM sizes it so too); an encoder's
      rows per tower forward, unset: the step budget;
    - max_num_encoder_tokens_while_decoding: a server's, unset: half its step budget (offline
      and an encoder: as given, None is no cap);
    - mm_embedding_offload (engine): unset, on with chunked prefill on CUDA;
    - kernel_warmup (engine): unset, on CUDA;
    - attention_backend, fused_ops, vision_attention_backend, linear_attention_backend:
      `auto` by `auto_kernels`.
    And `config.resolved` (`Resolved`): whether the batch limits were sized, the encoder
    cache's rows (mm_cache_gb's: a byte budget the user may set below the largest item, which
    admission then refuses naming it), whether decode steps replay CUDA graphs, the rows under
    which vision steps do (`_vision_graph_rows`). Whether
    tensor parallelism is on is `EngineConfig.tensor_parallel`.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
    if config.resolved is not None:
        raise ValueError("the config is resolved already (for the "
                         f"{config.resolved.role} role)")
    engine = role != "encoder"
    if engine and (max_image_tokens is None or not embedding_row_bytes):
        raise ValueError("the engine's options need the model's max_image_tokens and "
                         "embedding_row_bytes to be resolved")
    mc, cc, sc = config.model_config, config.cache_config, config.scheduler_config
    seqs, tokens = sized_scheduler_limits(device_type, device_memory, role == "serving")
    tokens = sc.max_num_batched_tokens or tokens
    largest_item = 0
    if engine:
        largest_item = max(max_image_tokens, max_video_item_tokens)
        if max_model_len:
            largest_item = min(largest_item, max_model_len)
    encoder_tokens = sc.max_num_encoder_tokens or max(tokens, largest_item)
    enc_decoding = sc.max_num_encoder_tokens_while_decoding
    if enc_decoding is None and role == "serving":
        enc_decoding = max(tokens // 2, 1)
    scheduler = dataclasses.replace(
        sc, max_num_seqs=sc.max_num_seqs or seqs, max_num_batched_tokens=tokens,
        max_num_encoder_tokens=encoder_tokens, max_num_encoder_tokens_while_decoding=enc_decoding,
        enable_chunked_prefill=sc.enable_chunked_prefill and not prompt_whole)

    auto = auto_kernels(device_type, triton, dtype)
    kernels = {name: auto[name] if getattr(mc, name) == "auto" else getattr(mc, name)
               for name in auto}
    cuda = device_type == "cuda"
    warmup, offload = mc.kernel_warmup, cc.mm_embedding_offload
    if engine and warmup is None:
        warmup = cuda
    if engine and offload is None:
        offload = scheduler.enable_chunked_prefill and cuda
    model = dataclasses.replace(mc, kernel_warmup=warmup, **kernels)
    cache = dataclasses.replace(cc, mm_embedding_offload=offload,
                                enable_prefix_caching=cc.enable_prefix_caching and not prompt_whole)
    resolved = Resolved(
        role=role, device_type=device_type,
        limits_sized=sc.max_num_seqs is None or sc.max_num_batched_tokens is None,
        encoder_cache_rows=(int(cc.mm_cache_gb * 2**30) // embedding_row_bytes if engine
                            else None),
        cuda_graphs=(engine and cuda and not mc.enforce_eager
                     and kernels["attention_backend"] == "triton"),
        vision_cuda_graph_max_rows=_vision_graph_rows(config, cuda))
    return dataclasses.replace(config, model_config=model, cache_config=cache,
                               scheduler_config=scheduler, resolved=resolved)
