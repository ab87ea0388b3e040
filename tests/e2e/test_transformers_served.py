"""A model of the transformers backend served: `vlmserve serve FOLDER --model-impl transformers`
(its prompts and images through the checkpoint's own processor in the front end's
preprocessing process) answers a chat with an image as the offline `LLM` does, streamed and
not."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import openai

from tests.e2e.test_server_procs import ServeProc
from tests.engine.helpers import make_image
from tests.models.hf_tiny import build_tiny
from vlmserve import LLM, SamplingParams


def _data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def test_served_like_offline(tmp_path: Path) -> None:
    path = str(build_tiny("idefics3", tmp_path / "idefics3"))  # tiles with markers between
    image = make_image(64, 48, 7)
    messages = [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": _data_url(image)}},
        {"type": "text", "text": "What is in this picture?"}]}]
    llm = LLM(path, model_impl="transformers", dtype="float32", device="cpu")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    (offline,) = llm.chat(messages, params, use_tqdm=False)
    del llm
    srv = ServeProc("--model-impl", "transformers", "--preprocess-workers", "1", model=path)
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        kw = dict(model=path, messages=messages, max_tokens=6, temperature=0,
                  extra_body={"ignore_eos": True})
        resp = client.chat.completions.create(**kw)
        assert resp.choices[0].message.content == offline.outputs[0].text
        assert resp.usage.prompt_tokens == len(offline.prompt_token_ids)
        streamed = "".join(c.choices[0].delta.content or ""
                           for c in client.chat.completions.create(stream=True, **kw)
                           if c.choices)
        assert streamed == offline.outputs[0].text
    finally:
        srv.kill()
