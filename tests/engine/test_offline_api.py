"""The offline API as the server's: `SamplingParams(n=...)` (n completions of a prompt, seeds
as the server's `n`), `CompletionOutput.cumulative_logprob`, vLLM's `image_pil` chat parts,
and `LLM.chat` fetching http(s) images under the server's fetch options (a real HTTP server
on 127.0.0.1)."""

from __future__ import annotations

import io
from collections.abc import Iterator

import pytest
from PIL import Image

from tests.engine.helpers import make_image
from tests.multimodal.test_fetch import PNG, Origin
from vlmserve import LLM, SamplingParams
from vlmserve.errors import InvalidImageError, InvalidRequestError, InvalidSamplingParamsError

MODEL = "tiny-qwen2-vl"


@pytest.fixture(scope="module")
def origin() -> Iterator[Origin]:
    o = Origin()
    yield o
    o.close()


@pytest.fixture(scope="module")
def llm(vlmserve_cache) -> LLM:
    # "localhost" may be reached although it is loopback; 127.0.0.1 written as such may not
    return LLM(MODEL, dtype="float32", device="cpu", max_num_batched_tokens=256,
               allowed_remote_hosts="localhost", max_remote_image_bytes=1 << 20)


def chat(text: str, *parts: dict) -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def tokens(outs) -> list[list[int]]:
    return [o.token_ids for o in outs[0].outputs]


def test_n_completions_of_one_prompt_with_the_servers_seeds(llm: LLM) -> None:
    """n=3 with seed 7: one RequestOutput with three outputs, indexed 0-2, which are the
    completions of seeds 7, 8 and 9 asked for one at a time."""
    params = dict(max_tokens=8, temperature=1.0, ignore_eos=True)
    prompts = ["A story about", "Another one"]
    outs = llm.generate(prompts, SamplingParams(n=3, seed=7, **params), use_tqdm=False)
    assert len(outs) == 2
    for prompt, out in zip(prompts, outs):
        assert [o.index for o in out.outputs] == [0, 1, 2]
        assert out.finished and all(o.finish_reason == "length" for o in out.outputs)
        one_by_one = [llm.generate(prompt, SamplingParams(seed=s, **params),
                                   use_tqdm=False)[0].outputs[0].token_ids for s in (7, 8, 9)]
        assert [o.token_ids for o in out.outputs] == one_by_one
        assert len({tuple(t) for t in one_by_one}) > 1  # the seeds differ, so do the samples
    # a chat with an image: its two completions from one preprocessing
    image = make_image(112, 84, 1)
    outs = llm.chat(chat("What is this?", {"type": "image", "image": image}),
                    SamplingParams(n=2, seed=3, **params), use_tqdm=False)
    single = [llm.chat(chat("What is this?", {"type": "image", "image": image}),
                       SamplingParams(seed=s, **params), use_tqdm=False)[0].outputs[0].token_ids
              for s in (3, 4)]
    assert tokens(outs) == single


def test_n_is_validated() -> None:
    for bad in (0, -1, 1.5, True, 129):
        with pytest.raises(InvalidSamplingParamsError, match="n must be"):
            SamplingParams(n=bad)


def test_cumulative_logprob_is_the_sum_of_the_sampled_tokens_logprobs(llm: LLM) -> None:
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=1, ignore_eos=True, logprobs=2)
    (out,) = llm.generate("The capital of France is", params, use_tqdm=False)[0].outputs
    expected = sum(lps[t] for lps, t in zip(out.logprobs, out.token_ids, strict=True))
    assert out.cumulative_logprob == pytest.approx(expected) and expected < 0
    # without logprobs asked for: None
    (plain,) = llm.generate("The capital of France is", SamplingParams(max_tokens=2),
                            use_tqdm=False)[0].outputs
    assert plain.cumulative_logprob is None
    # delta outputs report the whole output's sum so far, not the last step's
    engine = llm.engine
    rid = engine.add_request("The capital of France is", SamplingParams(
        max_tokens=6, temperature=1.0, seed=1, ignore_eos=True, logprobs=2,
        output_kind="delta"))
    sums, seen = [], []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id == rid:
                seen += [lps[t] for lps, t in zip(o.outputs[0].logprobs,
                                                 o.outputs[0].token_ids)]
                sums.append(o.outputs[0].cumulative_logprob)
    assert len(sums) > 1 and sums[-1] == pytest.approx(expected)
    assert sums[-2] == pytest.approx(sum(seen[:-1]))


def test_image_pil_part_is_read_as_an_image(llm: LLM) -> None:
    image = make_image(112, 84, 2)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    pil = llm.chat(chat("Describe.", {"type": "image_pil", "image_pil": image}), greedy,
                   use_tqdm=False)
    ref = llm.chat(chat("Describe.", {"type": "image", "image": image}), greedy,
                   use_tqdm=False)
    assert tokens(pil) == tokens(ref)
    assert len(pil[0].prompt_token_ids) > 20  # the image's rows are in the prompt
    with pytest.raises(InvalidRequestError, match="image_pil part holds a PIL image"):
        llm.chat(chat("Describe.", {"type": "image_pil", "image_pil": "photo.jpg"}), greedy,
                 use_tqdm=False)


def test_chat_fetches_http_images_under_the_servers_rules(llm: LLM, origin: Origin) -> None:
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    allowed = origin.url("/img.png", host="localhost")
    fetched = llm.chat(chat("Describe.", {"type": "image_url", "image_url": {"url": allowed}}),
                       greedy, use_tqdm=False)
    image = Image.open(io.BytesIO(PNG))
    ref = llm.chat(chat("Describe.", {"type": "image_pil", "image_pil": image}), greedy,
                   use_tqdm=False)
    assert tokens(fetched) == tokens(ref)
    assert origin.hits.count("/img.png") == 1
    # loopback not named in allowed_remote_hosts: refused, as the server refuses it (one
    # message for every cause), numbered from 1 among the request's images
    private = origin.url("/img.png")
    with pytest.raises(InvalidImageError, match=f"^could not fetch image 3: {private}$"):
        llm.chat(chat("Both.", {"type": "image_pil", "image_pil": image},
                      {"type": "image_url", "image_url": {"url": allowed}},
                      {"type": "image_url", "image_url": {"url": private}}), greedy,
                 use_tqdm=False)
    # above max_remote_image_bytes (10 MB without a Content-Length): refused while reading
    big = origin.url("/endless", host="localhost")
    with pytest.raises(InvalidImageError, match=f"^could not fetch image 1: {big}$"):
        llm.chat(chat("Big.", {"type": "image_url", "image_url": {"url": big}}), greedy,
                 use_tqdm=False)
    origin.endless_done.wait(30)
    assert origin.endless_cut.is_set()


def test_chat_refuses_http_images_when_remote_images_are_off(vlmserve_cache,
                                                            origin: Origin) -> None:
    llm = LLM(MODEL, dtype="float32", device="cpu", allow_remote_images=False,
              allowed_remote_hosts="localhost")
    url = origin.url("/img.png", host="localhost")
    before = len(origin.hits)
    with pytest.raises(InvalidImageError, match="remote image URLs are not allowed"):
        llm.chat(chat("Describe.", {"type": "image_url", "image_url": {"url": url}}),
                 SamplingParams(max_tokens=1), use_tqdm=False)
    assert len(origin.hits) == before


@pytest.mark.slow  # starts preprocessing processes
@pytest.mark.parametrize("impl", ["native", "transformers"])
def test_preprocess_workers_change_no_output(vlmserve_cache, impl: str) -> None:
    """Prompts preprocessed by `preprocess_workers` processes ahead of the engine: the same
    greedy tokens, in input order, as on the engine's thread (with a batch of the step budget
    so that prompts queue); a bad image among them raises as it does there and leaves the
    engine serving."""
    from tests.engine.helpers import mixed_prompts

    kw = dict(dtype="float32", device="cpu", model_impl=impl, max_num_batched_tokens=256)
    plain = LLM("tiny-qwen2-vl", **kw)
    pooled = LLM("tiny-qwen2-vl", preprocess_workers=2, **kw)
    prompts = mixed_prompts(plain)
    params = [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, n=2)] * 4
    want = plain.generate(prompts, params, use_tqdm=False)
    got = pooled.generate(prompts, params, use_tqdm=False)
    assert [[o.token_ids for o in out.outputs] for out in got] == [
        [o.token_ids for o in out.outputs] for out in want]
    assert pooled._pool is not None and len(pooled._pool.pids()) == 2
    bad = {"prompt": prompts[1]["prompt"], "multi_modal_data": {"image": [b"not an image"]}}
    with pytest.raises(InvalidImageError):
        pooled.generate(prompts[:3] + [bad] + prompts[3:], params[0], use_tqdm=False)
    assert not pooled.engine.has_unfinished_requests()
    again = pooled.generate(prompts[:2], params[:2], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [
        o.outputs[0].token_ids for o in want[:2]]
