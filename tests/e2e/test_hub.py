"""`vlmserve serve org/name`: a model named by Hugging Face id, read offline from the Hub cache
that HF_HUB_CACHE names (laid out by tests/hub_cache.py), served under that name. (The
resolution itself, in process: tests/models/test_hub.py.)"""

from __future__ import annotations

from pathlib import Path

import openai

from tests.e2e.test_server_procs import ServeProc
from tests.hub_cache import add_snapshot


def test_serve_a_model_by_id_from_the_cache(tmp_path: Path, tiny_qwen2_vl_path: Path) -> None:
    cache = tmp_path / "hub"
    add_snapshot(cache, "org/tiny", tiny_qwen2_vl_path)
    srv = ServeProc(model="org/tiny",
                    env={"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"})
    try:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["org/tiny"]
        resp = client.chat.completions.create(
            model="org/tiny", messages=[{"role": "user", "content": "Hello!"}], max_tokens=4,
            temperature=0, extra_body={"ignore_eos": True})
        assert resp.usage.completion_tokens == 4 and resp.choices[0].finish_reason == "length"
    finally:
        srv.kill()
