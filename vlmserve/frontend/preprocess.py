"""A front end's request preprocessing: prompt -> checked `AddRequest` frames, in the front
end's threads or in a pool of processes of its own (image decoding, hashing and tokenization
then take no share of the front end's interpreter lock, so a burst of images does not stall
its event loop and streams; a process that dies is replaced and only the request it ran is
retried: frontend/process_pool.py)."""

from __future__ import annotations

import dataclasses

import torch

from vlmserve.config import ModelConfig, StructuredOutputsConfig
from vlmserve.core.admission import AdmissionLimits
from vlmserve.encoder.client import EncoderClient, EncoderUnavailableError
from vlmserve.engine.messages import AddRequest, Decoder, Encoder, ImageData
from vlmserve.errors import InvalidSamplingParamsError, PromptTooLongError
from vlmserve.frontend.process_pool import ProcessPool
from vlmserve.inputs.processor import ImageLoader, InputProcessor, PromptInput
from vlmserve.layers.grammar import check_grammar_limits
from vlmserve.models.metadata import load_model_processor
from vlmserve.multimodal.inputs import MultiModalFeature, ProcessedPrompt
from vlmserve.sampling_params import SamplingParams
from vlmserve.utils import die_with_parent, freeze_startup_heap, limit_host_threads


def preprocess(input_processor: InputProcessor, limits: AdmissionLimits,
                eos_token_ids: tuple[int, ...], encoder: Encoder, prompt: PromptInput,
                params: SamplingParams, request_id: str, image_loader: ImageLoader,
                default_max_tokens: int | None = None,
                grammar_limits: StructuredOutputsConfig | None = None
                ) -> tuple[str | None, list[int], list, list[MultiModalFeature]]:
    """(prompt text, prompt token ids, the `AddRequest` frames, where its images sit: what
    routing among data-parallel engines reads) of one request; bad input
    raises an `InvalidRequestError`. A max_tokens given must fit the context after the
    prompt (a 400, as vLLM's); None becomes `default_max_tokens` (the server's) where it fits,
    or as many as the context leaves room for. A structured output is checked against
    `grammar_limits` (the engine's) before its grammar is parsed. Images travel as pixels
    (`send_to_encoders` then has encoder servers encode them, if the server has any)."""
    if params.structured_outputs is not None and grammar_limits is not None:
        check_grammar_limits(params.structured_outputs, grammar_limits)
    input_processor.check_sampling(params)
    processed = input_processor.process(prompt, image_loader)
    n = len(processed.prompt_token_ids)
    reason = limits.check(n, [img.length for img in processed.images],
                          [img.name for img in processed.images])
    if reason is not None:
        raise PromptTooLongError(reason)
    if params.max_tokens is not None:
        reason = limits.check_max_tokens(n, params.max_tokens)
        if reason is not None:
            raise InvalidSamplingParamsError(reason)
    elif default_max_tokens is not None:  # the server's cap, within what fits
        params = dataclasses.replace(
            params, max_tokens=max(1, min(default_max_tokens, limits.max_model_len - n)))
    images = [ImageData(img.mm_hash, img.offset, img.length, img.encoder_meta, img.pixels,
                        img.embeds) for img in processed.images]
    msg = AddRequest(
        request_id, processed.prompt_token_ids, images,
        processed.prompt_positions, processed.position_offset, params, eos_token_ids)
    return (processed.prompt, processed.prompt_token_ids, encoder.encode(msg),
            [img.feature for img in processed.images])


def send_to_encoders(client: EncoderClient, frames: list, hidden_size: int | None) -> list:
    """The `AddRequest` frames with the images an encoder server encoded as embedding
    handles, without their pixels (the others, sent recently or known to the server, keep
    their pixels for the core). Runs on a front end's thread while the request waits for the
    encoder servers: no preprocessing process waits for them."""
    msg = Decoder(AddRequest).decode(frames)
    # images given encoded (multi_modal_embeddings) are not sent again
    todo = [img for img in msg.images if img.embeds is None and img.handle is None]
    if not todo:
        return frames
    for img, enc in zip(todo, client.encode(todo), strict=True):
        if enc is None:
            continue
        if hidden_size is not None and enc.handle.shape[1:] != (hidden_size,):
            raise EncoderUnavailableError(
                f"the encoder server returned rows of width {enc.handle.shape[1:]} for a "
                f"model whose embeddings have {hidden_size}: does it serve the same model?")
        img.pixels, img.handle = _NO_PIXELS, enc.handle
    return Encoder().encode(msg)


_NO_PIXELS = torch.empty((0, 0, 3), dtype=torch.uint8)
# (input processor, limits, eos ids, message encoder) in a pool process
_worker: tuple | None = None
_grammar_limits: StructuredOutputsConfig | None = None  # the engine's, in a pool process


def encoder_client(urls: tuple[str, ...], transport: str, consumer: str | None,
                   limits: AdmissionLimits) -> EncoderClient | None:
    """A front end's client of the encoder servers at `urls`, if any, for the engine core
    `consumer` (its `consumer_id`) with these limits."""
    return EncoderClient(urls, transport, consumer=consumer,
                         consumer_rows=limits.encoder_cache_rows) if urls else None


def _init_worker(mc: ModelConfig, limits: AdmissionLimits, eos_token_ids: tuple[int, ...],
                 image_cache_bytes: int = 0, threads: int = 1,
                 grammar_limits: StructuredOutputsConfig | None = None) -> None:
    global _worker, _grammar_limits
    die_with_parent()
    limit_host_threads(threads)  # the pool's processes are its parallelism
    path, hf_config, model_processor = load_model_processor(mc)
    _worker = (InputProcessor.for_model(path, hf_config, model_processor,
                                        image_cache_bytes=image_cache_bytes),
               limits, eos_token_ids, Encoder())
    _grammar_limits = grammar_limits
    freeze_startup_heap()


def preprocess_in_worker(prompt: PromptInput, params: SamplingParams, request_id: str,
                          image_loader: ImageLoader, default_max_tokens: int | None = None
                          ) -> tuple[str | None, list[int], list, list[MultiModalFeature]]:
    assert _worker is not None
    text, token_ids, frames, features = preprocess(*_worker, prompt, params, request_id,
                                                   image_loader, default_max_tokens,
                                                   _grammar_limits)
    return text, token_ids, [bytes(f) for f in frames], features  # one copy each, pickled


def process_in_worker(prompt: PromptInput) -> ProcessedPrompt:
    """A prompt processed as the offline engine does (`InputProcessor.process`, its images
    loaded from what the prompt holds), in a pool process; no limits checked."""
    assert _worker is not None
    return _worker[0].process(prompt)


def tokenize_in_worker(prompt: PromptInput, image_loader: ImageLoader) -> list[int]:
    """A prompt's token ids as the engine would run them (each image's placeholder expanded
    to its rows), in a pool process; no limits checked."""
    assert _worker is not None
    return _worker[0].process(prompt, image_loader).prompt_token_ids


def start_pool(workers: int, mc: ModelConfig, limits: AdmissionLimits,
               eos_token_ids: tuple[int, ...], wait: bool = True,
               image_cache_bytes: int = 0, threads: int = 1,
               grammar_limits: StructuredOutputsConfig | None = None) -> ProcessPool:
    """Start `workers` preprocessing processes, each running torch on `threads` intra-op
    threads (resizing); with `wait`, wait until each has loaded the model's processor (so the
    first requests do not pay for it); `mc`: the model and its processor's options. A process
    that dies is replaced, the request it was running retried once (`ProcessPool`)."""
    return ProcessPool(workers, _init_worker,
                       (mc, limits, eos_token_ids, image_cache_bytes, threads,
                        grammar_limits), wait=wait, name="preprocessing")
