"""The server's own options (`ServerConfig`) and the command line's flags: the engine's
options and the server's, each field a flag (`vlmserve.flags`, which the benchmarks share).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from vlmserve.flags import add_engine_options, add_field_options, engine_kwargs
from vlmserve.sampling_params import MAX_LOGPROBS

__all__ = ["ServerConfig", "add_engine_options", "add_server_options", "engine_kwargs"]


def _opt(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


def _port(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is in 0-65535 (0: any free one), not {value}")
    return value


_port.__name__ = "port"

MM_MODALITIES = ("image", "video")
DEFAULT_MM_LIMIT = 8


def _mm_limit(text: str) -> int | dict[str, int]:
    """--limit-mm-per-prompt: an int (images and videos together) or vLLM's JSON object of
    per-modality limits ('{"image": 2, "video": 1}')."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(
            f"expected an integer or a JSON object such as '{{\"image\": 2, \"video\": 1}}', "
            f"not {text!r}") from None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a non-negative integer or a JSON object, "
                                         f"not {text!r}")
    for key, n in value.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise argparse.ArgumentTypeError(f"{key}: expected a non-negative integer, not {n!r}")
        if key not in MM_MODALITIES and n:  # vLLM's audio: 0 asks for nothing
            raise argparse.ArgumentTypeError(
                f"{key}: this server takes {' and '.join(MM_MODALITIES)} only")
    return {k: n for k, n in value.items() if k in MM_MODALITIES}


_mm_limit.__name__ = "limit"

_UVICORN_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _max_logprobs(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= value <= MAX_LOGPROBS:
        raise argparse.ArgumentTypeError(
            f"must be in 0-{MAX_LOGPROBS} (the engine computes at most {MAX_LOGPROBS} "
            f"log-probabilities per token), not {value}")
    return value


_max_logprobs.__name__ = "int"


@dataclass(frozen=True)
class ServerConfig:
    """Options of the OpenAI-compatible server (`vlmserve serve`), beside the engine's."""

    host: str = _opt(
        "0.0.0.0", "Address to listen on: every interface by default, as vLLM (a container's "
        "port mapping must reach it); 127.0.0.1 keeps the server to this host.", group="frontend")
    port: int = _opt(8000, "Port to listen on (0-65535).", type=_port, group="frontend")
    served_model_name: tuple[str, ...] | str | None = _opt(
        None, "Model names clients may use in requests' `model`, as vLLM: one or more; the "
        "first is the one responses report (default: the model argument).", nargs="+",
        group="model")
    allowed_local_media_path: str | None = _opt(
        None, "Directory from which requests may read images by path or file:// URL; "
        "local paths are refused when unset.", group="multimodal")
    allow_remote_images: bool = _opt(
        False, "Fetch http(s) image URLs given in requests (in the front-end process, public "
        "addresses only: see --allowed-remote-hosts).", group="multimodal")
    allowed_remote_hosts: str | None = _opt(
        None, "Comma-separated host names (matched exactly as written in a URL or redirect), "
        "IP addresses and CIDR networks that remote image URLs may reach although they are "
        "loopback, private, link-local or otherwise not public; every such address is "
        "refused otherwise (default: none).", group="multimodal")
    remote_image_timeout: float = _opt(
        10.0, "Seconds for fetching one remote image in all (name lookup, connects, "
        "redirects, body), not per read.", group="multimodal")
    max_remote_image_bytes: int = _opt(
        32 << 20, "Largest remote image to fetch, in bytes (checked against Content-Length "
        "and while reading).", group="multimodal")
    remote_image_fetch_workers: int = _opt(
        8, "Remote images each front end fetches at once (more wait their turn); fetching "
        "never holds up requests without remote images.", group="multimodal")
    limit_mm_per_prompt: int | dict[str, int] = _opt(
        DEFAULT_MM_LIMIT, "Most images and videos in one request: a number for both together, "
        "or vLLM's JSON object of per-modality limits ('{\"image\": 2, \"video\": 1}'; a "
        f"modality it leaves out: {DEFAULT_MM_LIMIT}).", type=_mm_limit, group="multimodal")
    video_num_frames: int = _opt(
        32, "Frames sampled evenly from each video a request sends as a file (video_url), as "
        "vLLM's default; every frame within --max-image-pixels.", group="multimodal")
    max_image_pixels: int | None = _opt(
        8192 * 4096, "Largest image (width x height, from its header, before decoding) a "
        "request may send; 8192x4096 holds an 8K frame or a 32 MP photo and decodes to "
        "about 100 MB of RGB (the model's processor shrinks anything over ~12.8 M pixels "
        "anyway); unlimited if unset.", group="multimodal")
    max_request_pixels: int | None = _opt(
        8192 * 8192, "Most pixels of all of one request's images together, checked from "
        "their headers before any is decoded (about 200 MB of RGB); unlimited if unset.",
        group="multimodal")
    max_image_bytes: int | None = _opt(
        96 << 20, "Largest decoded size of one image, from its header: width x height x "
        "bands x bytes per band, so RGBA counts 4 bytes a pixel and 16-bit gray 2 (the "
        "default, 96 MiB, is an RGB image at the pixel limit); unlimited if unset.",
        group="multimodal")
    max_request_bytes: int = _opt(64 << 20, "Largest request body in bytes (413 beyond it).",
        group="frontend")
    log_level: str = _opt("info", "Log level of the server: debug, info, warning, error.",
                          choices=("debug", "info", "warning", "error"), group="frontend")
    uvicorn_log_level: str | None = _opt(
        None, "Log level of uvicorn, the HTTP server (vLLM's flag; default: --log-level).",
        choices=_UVICORN_LEVELS, group="frontend")
    disable_log_requests: bool = _opt(
        False, "Log no line per request (uvicorn's access log; vLLM's flag).", group="frontend")
    max_logprobs: int = _opt(
        MAX_LOGPROBS, "Most log-probabilities per token a request may ask for (logprobs, "
        "top_logprobs, prompt_logprobs), as vLLM's flag; more is a 400 naming it.",
        type=_max_logprobs, group="frontend")
    api_key: str | None = _opt(
        None, "Key clients must send as `Authorization: Bearer KEY` to the /v1 endpoints "
        "(401 otherwise); also read from VLMSERVE_API_KEY.", group="frontend")
    health_stall_timeout: float = _opt(
        60.0, "/health answers 503 when the engine has had requests and computed no token for "
        "this many seconds, or does not answer within it.", group="expert")
    request_body_timeout: float = _opt(
        30.0, "Seconds a client may take to send a request's body (408 after).", group="expert")
    request_header_timeout: float = _opt(
        10.0, "Seconds a connection may take to send a request's line and headers, from its "
        "opening or the end of its last response; it is closed after (with a 408 if they "
        "had begun).", group="expert")
    timeout_keep_alive: int = _opt(
        5, "Seconds an idle connection is kept open after a response (uvicorn's option).",
        group="expert")
    limit_concurrency: int | None = _opt(
        None, "Most connections each front end keeps open: one beyond it closes the "
        "connection that has waited longest for a request's headers, or, when every "
        "connection has a request in progress, is answered 503 and closed (default: the "
        "file limit, which the server raises to its hard limit up to 65536, less 256 files "
        "for its own use).", group="expert")
    max_prompt_chars: int | None = _opt(
        None, "Most characters of text in one request (its messages or prompt), checked "
        "before tokenizing (default: 32 per token of the context length).", group="frontend")
    default_max_tokens: int | None = _opt(
        None, "Output tokens of a request that gives no max_tokens (default: up to the "
        "model's context length).", group="frontend")
    api_server_count: int = _opt(
        1, "HTTP front-end processes on the one port (preprocessing, detokenization, SSE), "
        "all served by one engine-core process.", group="frontend")
    data_parallel_size: int = _opt(
        1, "Engine cores serving the model side by side (vLLM's flag; -dp the same): each on "
        "its own GPU, or group of --tensor-parallel-size GPUs (CUDA_VISIBLE_DEVICES; fewer "
        "GPUs than that: cores share them, each within --gpu-memory-utilization), all on the "
        "CPU otherwise; every front end routes each request to one (--dp-routing). A core "
        "that dies fails only its own requests.", aliases=("-dp",), group="parallel")
    dp_routing: str = _opt(
        "affinity", "How requests are spread over --data-parallel-size engine cores: "
        "affinity (to the core that recently served the longest prefix of the request's "
        "tokens and images, as a chat's next turn; the least loaded one when nothing matches "
        "or that core is much busier) or random (the baseline).",
        choices=("affinity", "random"), group="parallel")
    preprocess_workers: int = _opt(
        2, "Processes per front end that fetch, decode, resize and hash images and tokenize "
        "prompts (0: threads of the front end, which then share its interpreter lock with "
        "HTTP and streaming).", group="multimodal")
    role: str = _opt(
        "llm", "What this server runs: `llm` (the whole model, OpenAI API) or `encoder` (the "
        "vision tower alone: POST /v1/encode returns embedding handles for LLM servers "
        "started with --encoder-url).", choices=("llm", "encoder"), group="encoder")
    encoder_url: str | None = _opt(
        None, "Comma-separated base URLs of encoder servers (`--role encoder`): requests' "
        "images are encoded there (round-robin; the next URL when one fails), except "
        "images encoded recently (the encoder cache holds them).", group="encoder")
    encoder_api_key: str | None = _opt(
        None, "Key to send to encoder servers started with --api-key (also read from "
        "VLMSERVE_ENCODER_API_KEY).", group="encoder")
    encoder_transport: str = _opt(
        "auto", "Embedding handles to ask encoder servers for: auto (CUDA IPC or shared "
        "memory from a server on this host, bytes from another host), shm, cuda or bytes.",
        group="encoder")
    accept_encoder_handles: str = _opt(
        "bytes", "Comma-separated handle kinds a client may send in a completion's "
        "multi_modal_embeddings (what an encoder server's POST /v1/encode with a prompt "
        "returns): bytes (the rows inline) by default; add shm and cuda only for trusted "
        "clients on this host (such a handle names memory the server then reads).", group="encoder")
    encoder_lease: float = _opt(
        30.0, "With --role encoder: seconds an LLM server has to open an embedding handle "
        "before its rows are reclaimed.", group="encoder")
    encoder_ledger_address: str | None = _opt(
        None, "With --role encoder: zmq endpoint where consumers report opened and released "
        "handles (default: an ipc:// socket, this host only; tcp://HOST:PORT for others).",
        group="encoder")
    processed_image_cache_mb: int = _opt(
        128, "MiB of processed images (content hash, resized pixels) each preprocessing "
        "process keeps by source (data URLs, fetched bytes): a chat that sends the same "
        "images every turn decodes and resizes them once (0: off).", group="multimodal")
    chat_template: str | None = _opt(
        None, "A Jinja chat template instead of the model's: a file's path, or the template "
        "itself.", group="frontend")
    enable_auto_tool_choice: bool = _opt(
        False, "Serve tool_choice \"auto\" (the default when a request has tools): the model "
        "decides whether to call tools, and its calls are read from its text by "
        "--tool-call-parser.", group="structured")
    max_tools: int = _opt(
        128, "Most tools one request may send (OpenAI's limit); their schemas also count "
        "toward --max-grammar-bytes when the answer is held to them.", group="structured")
    tool_call_parser: str | None = _opt(
        None, "The model's tool-call format, for --enable-auto-tool-choice: hermes "
        "(<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>: Qwen2-VL, Qwen2.5-VL).",
        group="structured")
    reasoning_parser: str | None = _opt(
        None, "A reasoning model's thinking apart from its answer: qwen3 or deepseek_r1 (one "
        "rule for both: the text in <think>...</think>, or from a <think> the chat template "
        "opened, goes to the message's reasoning and reasoning_content fields).",
        group="structured")
    shutdown_timeout: float = _opt(
        30.0, "On SIGTERM, seconds in-flight requests may take to finish before they are "
        "ended with an error.", group="frontend")

    def served_model_names(self) -> tuple[str, ...]:
        """--served-model-name's names (a string is one); empty when unset."""
        names = self.served_model_name
        return (names,) if isinstance(names, str) else tuple(names or ())

    def mm_limit(self, modality: str) -> int:
        """--limit-mm-per-prompt for one modality ("image" or "video"); with a number, the
        number, which bounds them together."""
        v = self.limit_mm_per_prompt
        return v.get(modality, DEFAULT_MM_LIMIT) if isinstance(v, dict) else v

    def chat_template_text(self) -> str | None:
        """--chat-template's template: the file's text, or the value itself; a missing file
        or a template that does not parse raises `ValueError` naming it."""
        value = self.chat_template
        if value is None:
            return None
        if os.path.isfile(value):
            with open(value, encoding="utf-8") as f:
                value = f.read()
        elif "{" not in value:  # a path, not a template
            raise ValueError(f"--chat-template: no such file: {value}")
        import jinja2

        try:
            jinja2.Environment().parse(value)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"--chat-template does not parse: {e}") from None
        return value

    @classmethod
    def from_args(cls, args: Any) -> ServerConfig:
        """Pick this class's fields from a namespace (absent ones keep their defaults)."""
        names = [f.name for f in dataclasses.fields(cls)]
        given = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
        return cls(**{n: tuple(v) if isinstance(v, list) else v for n, v in given.items()})


def add_server_options(parser: argparse.ArgumentParser) -> list[str]:
    """The server's options as flags, each in its `flags.GROUPS` section."""
    return add_field_options(parser, dataclasses.fields(ServerConfig))

