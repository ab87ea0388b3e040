"""Shared pieces of the engine tests: deterministic images and prompts, the HF oracle."""

from __future__ import annotations

import threading

import numpy as np
import torch
from PIL import Image

from vlmserve.multimodal.inputs import pixel_values


def make_image(width: int, height: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def make_mp4(count: int = 12, width: int = 64, height: int = 48, fps: int = 6) -> bytes:
    """A small MPEG-4 clip of random frames, made with PyAV."""
    from vlmserve.benchmarks.client import encode_mp4

    rng = np.random.default_rng(count)
    return encode_mp4(rng.integers(0, 256, (count, height, width, 3), np.uint8), fps)


def make_smooth_mp4(count: int, width: int, height: int, fps: int = 8) -> bytes:
    """An MPEG-4 clip of a gradient that changes colour frame by frame: a file of a camera's
    size that stays small and encodes fast (random pixels do neither)."""
    from vlmserve.benchmarks.client import encode_mp4

    frames = np.empty((count, height, width, 3), np.uint8)
    frames[..., 0] = np.linspace(0, 255, width, dtype=np.uint8)
    frames[..., 1] = np.linspace(0, 255, height, dtype=np.uint8)[:, None]
    frames[..., 2] = (np.arange(count, dtype=np.uint8) * 7)[:, None, None]
    return encode_mp4(frames, fps)


def chat_prompt(llm, text: str, images: list[Image.Image]) -> dict:
    parts = [{"type": "image", "image": img} for img in images] + [{"type": "text", "text": text}]
    return llm.chat_prompt([{"role": "user", "content": parts}])


def check_second_turn(llm, check, oracle, image: Image.Image, params):
    """A chat's turn 1 about ``image``, then its turn 2 through ``check`` (against
    ``oracle``): turn 2 takes turn 1's prompt from the prefix cache (all but its last
    block) and encodes no image. Returns turn 2's prompt."""
    turn1 = [{"role": "user", "content": [{"type": "image", "image": image},
                                          {"type": "text", "text": "What is this?"}]}]
    first = llm.generate(llm.chat_prompt(turn1), params, use_tqdm=False)[0]
    turn2 = llm.chat_prompt(turn1 + [{"role": "assistant", "content": first.outputs[0].text},
                                     {"role": "user", "content": "And what colour is it?"}])
    before = llm.engine.get_stats()
    check(llm, oracle, [turn2])
    after = llm.engine.get_stats()
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] >= len(
        first.prompt_token_ids) - 16
    assert after["num_images_encoded"] == before["num_images_encoded"]
    return turn2


def mixed_prompts(llm) -> list[dict]:
    """8 requests: different prompt lengths, 0-3 images of different sizes."""
    specs = [
        ("Hi.", []),
        ("Describe the picture in detail, please.", [(56, 56)]),
        ("What is in these images? Compare them.", [(84, 112), (112, 84), (140, 140)]),
        ("A longer question about the scene: what colours appear, and where?", [(224, 224)]),
        ("Count.", [(56, 84), (84, 56)]),
        ("Tell me a story about a robot who learns to paint.", []),
        ("Two images.", [(112, 112), (168, 112)]),
        ("Look closely at the texture of this photograph.", [(196, 252)]),
    ]
    return [chat_prompt(llm, text, [make_image(w, h, 10 * i + j) for j, (w, h) in
                                    enumerate(sizes)])
            for i, (text, sizes) in enumerate(specs)]


class HFOracle:
    """Greedy `generate` of the transformers model on exactly our processed inputs."""

    def __init__(self, path, arch: str, device: str = "cpu") -> None:
        import transformers

        cls = getattr(transformers, arch)
        self.model = cls.from_pretrained(str(path), dtype=torch.float32).to(device).eval()
        self.model.generation_config.eos_token_id = None  # run to max_new_tokens, never stop
        self.device = device
        self._cache: dict = {}

    @torch.inference_mode()
    def generate(self, processed, max_new_tokens: int, **video_kwargs) -> list[int]:
        """``video_kwargs``: Qwen2.5-VL's ``second_per_grid_ts`` for the prompt's videos."""
        key = (tuple(processed.prompt_token_ids), max_new_tokens,
               tuple(img.mm_hash for img in processed.images), repr(video_kwargs))
        if key in self._cache:
            return self._cache[key]
        tokens, _ = self._generate(processed, max_new_tokens, **video_kwargs)
        self._cache[key] = tokens
        return tokens

    @torch.inference_mode()
    def generate_with_logits(self, processed, max_new_tokens: int
                             ) -> tuple[list[int], torch.Tensor]:
        """Greedy tokens and the raw logits each was chosen from: [max_new_tokens, vocab]
        float32 on the CPU."""
        tokens, logits = self._generate(processed, max_new_tokens, output_logits=True)
        return tokens, torch.cat(logits).float().cpu()

    @torch.inference_mode()
    def score(self, processed, output_ids: list[int]) -> torch.Tensor:
        """The raw logits each of `output_ids` was sampled from, one forward over the prompt
        and those tokens: [len(output_ids), vocab] float32 on the CPU."""
        ids, kwargs = self._inputs(processed, list(output_ids[:-1]))
        logits = self.model(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs).logits
        n = len(processed.prompt_token_ids)
        return logits[0, n - 1:n - 1 + len(output_ids)].float().cpu()

    def _generate(self, processed, max_new_tokens: int, **generate_kwargs):
        from transformers import GenerationConfig

        ids, kwargs = self._inputs(processed)
        # no eos: generate runs to max_new_tokens like our ignore_eos (min_new_tokens would
        # instead mask eos out of the logits, which changes the greedy path)
        cfg = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
        out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                  generation_config=cfg, return_dict_in_generate=True,
                                  **generate_kwargs, **kwargs)
        tokens = out.sequences[0, ids.shape[1]:].tolist()
        assert len(tokens) == max_new_tokens, "transformers stopped early"
        return tokens, out.logits

    def _inputs(self, processed, extra_ids: list[int] = ()):
        """input_ids [1, prompt + extra] and the image (and video) inputs, on the oracle's
        device."""
        ids = torch.tensor([processed.prompt_token_ids + list(extra_ids)])
        kwargs = {}
        video_token = getattr(self.model.config, "video_token_id", None)
        is_video = [processed.prompt_token_ids[img.offset] == video_token
                    for img in processed.images]
        # transformers 5.2x computes mRoPE positions only when told which tokens are images
        # (1) and videos (2)
        mm = torch.zeros_like(ids)
        for kind, name in ((False, ""), (True, "_videos")):
            items = [img for img, v in zip(processed.images, is_video) if v == kind]
            if items:
                kwargs["pixel_values" + name] = pixel_values(items)
                grid = "video_grid_thw" if kind else "image_grid_thw"
                kwargs[grid] = torch.tensor([img.encoder_meta for img in items])
            for img in items:
                mm[0, img.offset:img.offset + img.length] = 2 if kind else 1
        if processed.images:
            kwargs["mm_token_type_ids"] = mm
        return ids.to(self.device), {k: v.to(self.device) for k, v in kwargs.items()}


def busy_twice(step_result) -> bool:
    """A `StepResult.ready` stand-in: every step reports the device busy twice, then done."""
    step_result.polls = getattr(step_result, "polls", 0) + 1
    return step_result.polls > 2


def trace_preprocessing(engine, set_attr=setattr) -> list[tuple[bool, threading.Thread]]:
    """Wrap the engine's `step` and `process_requests` (through `set_attr`, e.g. pytest's
    `monkeypatch.setattr` to undo it); every preprocessing appends (inside a step?, thread)."""
    step, process = engine.step, engine.process_requests
    in_step, where = [False], []

    def traced_step(*args):
        in_step[0] = True
        try:
            return step(*args)
        finally:
            in_step[0] = False

    def traced_process(*args):
        where.append((in_step[0], threading.current_thread()))
        return process(*args)

    set_attr(engine, "step", traced_step)
    set_attr(engine, "process_requests", traced_process)
    return where


def assert_prompts_hit(llm, prompts: list, encoded: int) -> None:
    """The prompts, run again, came mostly from the prefix cache: over 80% of their tokens
    hit, and no image was encoded since `encoded` (every image lay inside a hit)."""
    s = llm.engine.get_stats()
    assert s["prefix_cache_hit_tokens"] > 0.8 * sum(
        len(llm.engine.input_processor.process(p).prompt_token_ids) for p in prompts)
    assert s["num_images_encoded"] == encoded


class GatedLoader:
    """An image loader for a preprocessing process that, before loading, leaves a file
    `started-PID-N` in `folder` and waits until `folder/gate` exists: a test knows which
    processes are busy with a request and holds them there (picklable)."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def __call__(self, src):
        import os
        import time
        import uuid

        from vlmserve.multimodal.image import load_image

        marker = os.path.join(self.folder, f"started-{os.getpid()}-{uuid.uuid4().hex}")
        open(marker, "w").close()  # noqa: SIM115 - an empty file
        deadline = time.monotonic() + 120  # bounds a broken test only
        while not os.path.exists(os.path.join(self.folder, "gate")):
            assert time.monotonic() < deadline, "the gate never opened"
            time.sleep(0.01)
        return load_image(src)


class KillingLoader:
    """An image loader that kills the process it runs in (a request whose input crashes its
    preprocessing process; picklable)."""

    def __call__(self, src):
        import os
        import signal

        os.kill(os.getpid(), signal.SIGKILL)


def watch_live_blocks(llm) -> list[list[int]]:
    """A list that fills, at each scheduling of ``llm``'s engine, with each running request's
    live blocks in every KV group (`KVCacheManager.num_live_blocks`)."""
    sched = llm.engine.core.scheduler
    live: list[list[int]] = []
    schedule = sched.schedule

    def watched():
        out = schedule()
        live.extend(sched.kv.num_live_blocks(r.request_id) for r in sched.running)
        return out

    sched.schedule = watched
    return live
