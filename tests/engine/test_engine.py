"""Engine behaviour beyond greedy parity: sampling, stops, detokenization, bad input, chat."""

from __future__ import annotations

import base64
import io
import json

import pytest

from tests.engine.helpers import (
    busy_twice,
    chat_prompt,
    make_image,
    mixed_prompts,
    trace_preprocessing,
)
from vlmserve import LLM, SamplingParams
from vlmserve.errors import (
    InvalidImageError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
)
from vlmserve.models.processing import ChatTemplateOptions
from vlmserve.request import RequestStatus


@pytest.fixture(scope="module")
def llm(vlmserve_cache):
    return LLM("tiny-qwen2-vl", dtype="float32", device="cpu", max_num_batched_tokens=64)


def greedy(n=12, **kw):
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def test_text_is_incremental_decode_of_tokens(llm):
    tok = llm.get_tokenizer()
    for out in llm.generate(mixed_prompts(llm), greedy(16), use_tqdm=False):
        c = out.outputs[0]
        assert c.text == tok.decode(c.token_ids, skip_special_tokens=True)


def test_stop_string_truncates_and_finishes(llm):
    prompt = chat_prompt(llm, "Say something.", [make_image(56, 56, 5)])
    full = llm.generate(prompt, greedy(16), use_tqdm=False)[0].outputs[0]
    stop = full.text[4:7]
    assert stop and full.text.find(stop) >= 4
    out = llm.generate(prompt, greedy(16, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.find(stop)]
    kept = llm.generate(prompt, greedy(16, stop=[stop], include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert kept.text == full.text[: full.text.find(stop) + len(stop)]


def test_stop_token_ids_and_max_tokens(llm):
    prompt = chat_prompt(llm, "Hello there.", [])
    full = llm.generate(prompt, greedy(12), use_tqdm=False)[0].outputs[0]
    assert len(full.token_ids) == 12 and full.finish_reason == "length"
    target = full.token_ids[5]
    first = full.token_ids.index(target)
    out = llm.generate(prompt, greedy(12, stop_token_ids=[target]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == full.token_ids[: first + 1] and out.finish_reason == "stop"


def test_eos_stops_unless_ignored(llm):
    eos = llm.engine.eos_token_ids[0]
    prompt = chat_prompt(llm, "Hello there.", [])
    full = llm.generate(prompt, greedy(12, stop_token_ids=[]), use_tqdm=False)[0].outputs[0]
    # make eos the token the model emits third: stop there without ignore_eos
    llm.engine.eos_token_ids = (full.token_ids[2],)
    try:
        out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0.0),
                           use_tqdm=False)[0].outputs[0]
    finally:
        llm.engine.eos_token_ids = (eos,)
    first = full.token_ids.index(full.token_ids[2])
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[: first + 1]


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(llm):
    prompt = chat_prompt(llm, "Pick words.", [make_image(84, 84, 6)])
    a = llm.generate([prompt] * 2, SamplingParams(max_tokens=16, temperature=1.0, seed=123,
                                                  ignore_eos=True), use_tqdm=False)
    b = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=123,
                                            ignore_eos=True), use_tqdm=False)
    assert a[0].outputs[0].token_ids == a[1].outputs[0].token_ids == b[0].outputs[0].token_ids
    others = {tuple(llm.generate(prompt, SamplingParams(max_tokens=16, temperature=1.5, seed=s,
                                                        ignore_eos=True),
                                 use_tqdm=False)[0].outputs[0].token_ids) for s in range(4)}
    assert len(others) > 1
    g = llm.generate(prompt, greedy(16), use_tqdm=False)[0].outputs[0].token_ids
    k1 = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0.8, top_k=1, seed=1,
                                             ignore_eos=True), use_tqdm=False)
    p0 = llm.generate(prompt, SamplingParams(max_tokens=16, temperature=0.8, top_p=1e-6,
                                             seed=1, ignore_eos=True), use_tqdm=False)
    assert k1[0].outputs[0].token_ids == g == p0[0].outputs[0].token_ids


@pytest.mark.parametrize("kwargs, word", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"),
    ({"top_p": 0.0}, "top_p"), ({"top_k": -5}, "top_k"), ({"stop": [""]}, "stop"),
    ({"output_kind": "deltas"}, "output_kind"),
])
def test_invalid_sampling_params(kwargs, word):
    with pytest.raises(InvalidSamplingParamsError, match=word):
        SamplingParams(**kwargs)


def _png_bytes(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def test_bad_input_rejected_while_others_are_served(llm):
    engine = llm.engine
    good = [chat_prompt(llm, "First.", [make_image(56, 84, 7)]),
            chat_prompt(llm, "Second.", [make_image(112, 56, 8)])]
    expected = [o.outputs[0].token_ids for o in llm.generate(good, greedy(), use_tqdm=False)]
    one_pad = chat_prompt(llm, "Two?", [make_image(56, 56, 9)])["prompt"]
    bad_cases = [
        ({"prompt": one_pad, "multi_modal_data": {"image": [make_image(56, 56, 1)] * 2}},
         InvalidRequestError, "placeholder"),
        ({"prompt": one_pad, "multi_modal_data": {"image": b"not an image at all"}},
         InvalidImageError, "image 1 of the request"),
        ({"prompt": one_pad, "multi_modal_data": {"image": "data:image/png;base64,"
                                                  + base64.b64encode(b"junk").decode()}},
         InvalidImageError, "image 1 of the request"),
        ({"prompt": one_pad, "multi_modal_data": {"image": _zero_image()}},
         InvalidImageError, "zero"),
        ({"prompt_token_ids": [10**9]}, InvalidRequestError, "vocabulary"),
        ({"prompt_token_ids": [5] * 40000}, PromptTooLongError, "maximum context length"),
    ]
    engine.add_request(good[0], greedy(), request_id="g0")
    for i, (prompt, exc, words) in enumerate(bad_cases):
        with pytest.raises(exc, match=words):
            engine.add_request(prompt, greedy(), request_id=f"bad{i}")
        engine.step()  # the good request keeps running in between
    with pytest.raises(InvalidSamplingParamsError):
        engine.add_request(good[1], SamplingParams(max_tokens=-1))
    engine.add_request(good[1], greedy(), request_id="g1")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert [done["g0"], done["g1"]] == expected
    assert not any(rid.startswith("bad") for rid in engine.scheduler.requests)


def _zero_image():
    from PIL import Image

    return Image.new("RGB", (0, 0))


def test_chat_with_data_url_and_file_path(llm, tmp_path):
    img = make_image(84, 56, 11)
    path = tmp_path / "img.png"
    img.save(path)
    url = "data:image/png;base64," + base64.b64encode(_png_bytes(img)).decode()
    outs = []
    for src in (url, str(path), f"file://{path}"):
        messages = [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": src}},
            {"type": "text", "text": "What is this?"}]}]
        outs.append(llm.chat(messages, greedy(), use_tqdm=False)[0].outputs[0].token_ids)
    direct = llm.generate(chat_prompt(llm, "What is this?", [img]), greedy(), use_tqdm=False)
    assert outs[0] == outs[1] == outs[2] == direct[0].outputs[0].token_ids


def test_chat_template_options(llm):
    """vLLM's chat options: no generation prompt; the last, assistant message continued
    (no end of turn: the answer goes on from its text, as a plain prompt of that text does);
    another template with variables; contradictory or reserved settings refused."""
    convo = [{"role": "user", "content": "Count to three."}]
    plain = llm.chat_prompt(convo)["prompt"]
    assert plain.endswith("<|im_start|>assistant\n")
    no_gen = llm.chat_prompt(convo, options=ChatTemplateOptions(add_generation_prompt=False))
    assert plain.startswith(no_gen["prompt"]) and not no_gen["prompt"].endswith(
        "assistant\n")
    partial = [*convo, {"role": "assistant", "content": "One, two,"}]
    options = ChatTemplateOptions(add_generation_prompt=False, continue_final_message=True)
    text = llm.chat_prompt(partial, options=options)["prompt"]
    assert text == plain + "One, two,"
    got = llm.chat(partial, greedy(), use_tqdm=False, add_generation_prompt=False,
                   continue_final_message=True)
    assert got[0].outputs[0].token_ids == llm.generate(text, greedy(), use_tqdm=False)[
        0].outputs[0].token_ids
    template = ("{% for m in messages %}[{{ m['role'] }}|{{ greeting }}]{{ m['content'] }}"
                "{% endfor %}{% if add_generation_prompt %}>{% endif %}")
    custom = llm.chat(convo, greedy(), use_tqdm=False, chat_template=template,
                      chat_template_kwargs={"greeting": "hi"})[0]
    assert custom.prompt == "[user|hi]Count to three.>"
    with pytest.raises(InvalidRequestError, match="continue_final_message"):
        ChatTemplateOptions(continue_final_message=True)
    with pytest.raises(InvalidRequestError, match="tokenize"):
        ChatTemplateOptions(kwargs={"tokenize": True})


def test_unsupported_content_part_rejected(llm):
    with pytest.raises(InvalidRequestError, match="input_audio"):
        llm.chat([{"role": "user", "content": [{"type": "input_audio"}]}], greedy())


def test_final_only_and_delta_requests_report_the_same_result(llm):
    engine = llm.engine
    prompts = mixed_prompts(llm)[:4]
    reports: dict[str, list] = {}
    for kind in ("cumulative", "final_only", "delta"):
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, greedy(6, stop=["zz"], output_kind=kind),
                               request_id=f"{kind}{i}")
    while engine.has_unfinished_requests():
        for out in engine.step():
            reports.setdefault(out.request_id, []).append(out)
    for i in range(len(prompts)):
        cumulative, final = reports[f"cumulative{i}"], reports[f"final_only{i}"]
        assert len(cumulative) == 6 and len(final) == 1 and final[0].finished
        assert final[0].outputs[0] == cumulative[-1].outputs[0]
        deltas = [o.outputs[0] for o in reports[f"delta{i}"]]  # each token once
        assert [len(d.token_ids) for d in deltas] == [1] * 6
        assert "".join(d.text for d in deltas) == cumulative[-1].outputs[0].text


def test_abort_frees_everything(llm):
    engine = llm.engine
    for i, prompt in enumerate(mixed_prompts(llm)):
        engine.add_request(prompt, greedy(50), request_id=f"ab{i}")
    for _ in range(3):
        engine.step()
    engine.abort_request([f"ab{i}" for i in range(8)])
    engine.step()
    s = engine.get_stats()
    assert s["num_running"] == s["num_waiting"] == 0
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]
    assert s["encoder_cache_referenced"] == 0
    assert s["mm_embedding_entries"] == s["encoder_cache_entries"]
    assert RequestStatus.FINISHED_ABORTED.value == "abort"


def test_seeded_sampling_survives_preemption(vlmserve_cache):
    prompts = mixed_prompts(LLM("tiny-qwen2-vl", dtype="float32", device="cpu"))
    params = [SamplingParams(max_tokens=10, temperature=1.0, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    roomy = LLM("tiny-qwen2-vl", dtype="float32", device="cpu", max_num_batched_tokens=128)
    tight = LLM("tiny-qwen2-vl", dtype="float32", device="cpu", max_num_batched_tokens=128,
                num_kv_blocks=24, block_size=8)
    a = roomy.generate(prompts, params, use_tqdm=False)
    b = tight.generate(prompts, params, use_tqdm=False)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_generate_with_a_bad_prompt_raises_and_leaves_the_engine_clean(llm):
    good = chat_prompt(llm, "Fine.", [make_image(56, 56, 3)])
    bad = {"prompt": good["prompt"], "multi_modal_data": {"image": b"garbage"}}
    with pytest.raises(InvalidImageError, match="image 1 of the request"):
        llm.generate([good, good, bad, good], greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    s = llm.engine.get_stats()
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]
    assert llm.generate(good, greedy(), use_tqdm=False)[0].outputs[0].finish_reason == "length"


def test_async_scheduling_changes_no_output(vlmserve_cache):
    """Scheduling each step before the previous one's tokens are read back gives the same
    tokens and text as the synchronous loop: seeded sampling, stop strings and stop tokens
    (which finish a request whose next step is already running), preemption, and EOS."""
    probe = LLM("tiny-qwen2-vl", dtype="float32", device="cpu")
    prompts = mixed_prompts(probe)
    reference = probe.generate(prompts, greedy(8), use_tqdm=False)
    stop_text = reference[0].outputs[0].text[3:6]
    stop_token = reference[1].outputs[0].token_ids[4]
    params = [SamplingParams(max_tokens=10, temperature=0.9, seed=7 + i, ignore_eos=True)
              for i in range(len(prompts))]
    params[0] = greedy(12, stop=[stop_text])
    params[1] = greedy(12, stop_token_ids=[stop_token])
    params[2] = SamplingParams(max_tokens=12, temperature=0.0)  # EOS applies
    results = {}
    for mode in (False, True):
        llm = LLM("tiny-qwen2-vl", dtype="float32", device="cpu", max_num_batched_tokens=96,
                  num_kv_blocks=24, block_size=8, async_scheduling=mode)
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[mode] = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason)
                         for o in outs]
        assert llm.engine.scheduler.num_preemptions > 0
        s = llm.engine.get_stats()
        assert s["num_free_kv_blocks"] == s["num_kv_blocks"] and s["num_running"] == 0
        assert s["num_generated_tokens"] == sum(len(r[0]) for r in results[mode])
    assert results[True] == results[False]
    assert results[True][0][2] == "stop" and results[True][1][2] == "stop"


def test_generate_preprocesses_while_the_device_is_busy(llm, monkeypatch):
    """`LLM.generate` preprocesses prompts on the engine thread while a step runs on the
    device (simulated: each step reports busy twice before done), with the same outputs; a
    bad prompt found there raises after the step, leaving the engine clean."""
    from vlmserve.worker.model_runner import StepResult

    prompts = mixed_prompts(llm)
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy(), use_tqdm=False)]

    engine = llm.engine
    monkeypatch.setattr(StepResult, "ready", busy_twice)
    traced = trace_preprocessing(engine, monkeypatch.setattr)
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    inside = [in_step for in_step, _ in traced]
    assert len(inside) == len(prompts) and 0 < sum(inside) < len(prompts)

    bad = {"prompt": prompts[1]["prompt"], "multi_modal_data": {"image": b"garbage"}}
    traced.clear()
    with pytest.raises(InvalidImageError, match="image 1 of the request"):
        llm.generate(prompts[:4] + [bad] + prompts[4:], greedy(), use_tqdm=False)
    assert traced[-1][0], "the bad prompt should have been reached during a step"
    assert not engine.has_unfinished_requests()
    s = engine.get_stats()
    assert s["num_free_kv_blocks"] == s["num_kv_blocks"]


def test_device_timeline_counts_busy_and_idle_time(monkeypatch):
    """Steps' device time from their start/end events: busy inside steps, idle between one
    step's end and the next one's start; a step still running is counted later."""
    from vlmserve.worker.timeline import DeviceTimeline

    class FakeEvent:  # a timing event the "device" reached at `t_ms`, or not yet (None)
        def __init__(self, t_ms):
            self.t = t_ms

        def query(self):
            return self.t is not None

        def elapsed_time(self, other):
            return other.t - self.t

    times = iter([0.0, 5.0, 5.0, 9.0, 12.0, None])  # start/end of three steps
    monkeypatch.setattr(DeviceTimeline, "mark", staticmethod(lambda: FakeEvent(next(times))))
    timeline = DeviceTimeline()
    for _ in range(3):
        timeline.add(timeline.mark())
    # steps 1 and 2 back to back (5 + 4 ms busy); step 3 started 3 ms after step 2 ended
    assert (timeline.busy_s, timeline.idle_s) == pytest.approx((0.009, 0.0))  # 3 not done
    timeline._pending[0][1].t = 20.0
    timeline.collect()
    assert (timeline.busy_s, timeline.idle_s) == pytest.approx((0.017, 0.003))
    times = iter([30.0, 31.0])  # a step long after: no idle counted across a restart
    timeline.restart_idle()
    timeline.add(timeline.mark())
    assert (timeline.busy_s, timeline.idle_s) == pytest.approx((0.018, 0.003))


def test_batch_limits_are_sized_to_the_device_unless_given(llm, caplog):
    """The engine runs with its config resolved for its device (`resolve_config`, whose
    values per role and device tests/core/test_resolve_config.py pins)."""
    sc = llm.engine.config.scheduler_config  # the fixture set only the step budget
    assert (sc.max_num_seqs, sc.max_num_batched_tokens) == (64, 64)
    assert sc.max_num_encoder_tokens_while_decoding is None  # offline: not capped
    # the encoder budget: the step budget, at least the largest image or video item (a
    # whole Qwen2-VL video) within the context length
    processor, core = llm.engine.core.model_processor, llm.engine.core
    largest = min(max(processor.max_image_tokens, processor.max_video_item_tokens),
                  core.max_model_len)
    assert sc.max_num_encoder_tokens == max(64, largest)
    assert llm.engine.scheduler.max_num_encoder_tokens == sc.max_num_encoder_tokens
    assert llm.engine.config.resolved.role == "offline"
    import logging

    with caplog.at_level(logging.INFO, logger="vlmserve.engine.core"):
        other = LLM("tiny-qwen2-vl", dtype="float32", device="cpu", max_num_seqs=3)
    sc = other.engine.config.scheduler_config
    assert (sc.max_num_seqs, sc.max_num_batched_tokens) == (3, 2048)
    line = next(r.getMessage() for r in caplog.records if "engine ready" in r.getMessage())
    for word in ("tiny-qwen2-vl", "cpu", "float32", "max_model_len", "KV cache",
                 "max_num_seqs 3", "max_num_batched_tokens 2048 (sized to the device)"):
        assert word in line, line


def test_periodic_stats_line_reports_token_rates(llm, caplog, monkeypatch):
    import logging

    import vlmserve.engine.core as core

    monkeypatch.setattr(core, "LOG_INTERVAL_S", 0.0)
    with caplog.at_level(logging.INFO, logger="vlmserve.engine.core"):
        llm.generate(chat_prompt(llm, "Rates.", [make_image(56, 56, 3)]), greedy(6),
                     use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records if "tokens/s" in r.getMessage()]
    assert lines and all("prompt" in ln and "generation" in ln and "prefix cache hit rate" in ln
                         for ln in lines)
    assert any(not ln.startswith("prompt 0 ") for ln in lines)  # the prefill was counted
    assert any("generation 0 " not in ln for ln in lines)


def test_step_trace_records_every_step(vlmserve_cache, tmp_path, monkeypatch):
    """`VLMSERVE_STEP_TRACE` writes one line per step read back: its prompt tokens, decodes
    and images add up to what the requests computed."""
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv("VLMSERVE_STEP_TRACE", str(path))
    llm = LLM("tiny-qwen2-vl", dtype="float32", device="cpu", max_num_batched_tokens=32)
    prompts = mixed_prompts(llm)
    outs = llm.generate(prompts, greedy(5), use_tqdm=False)
    llm.engine.shutdown()
    steps = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(steps) == llm.engine.core.num_steps
    # every token a step computed is a prompt token or a decode (prefix-cached ones are not
    # computed); each request had its 4 decodes
    assert (sum(s["prompt_tokens"] + s["decodes"] for s in steps)
            == llm.engine.core.num_computed_tokens)
    assert sum(s["decodes"] for s in steps) >= 4 * len(outs)
    assert sum(s["images"] for s in steps) == llm.engine.core.get_stats()["num_images_encoded"]
    assert all(s["launch"] <= s["done"] and s["launch_ms"] >= 0 for s in steps)
    assert all(s["device_ms"] is None and s["vision_ms"] is None  # timed on CUDA only
               and s["alloc_retries"] is None for s in steps)
    # the tower's launch is timed in the steps that encode, and only there
    assert all((s["vision_launch_ms"] is not None) == (s["images"] > 0) for s in steps)
    assert all(s["vision_launch_ms"] <= s["launch_ms"] for s in steps if s["images"])
    # and the core thread's CPU time in them: within their wall time (plus the clocks' grain)
    assert all(0 <= s["launch_cpu_ms"] <= s["launch_ms"] + 1 for s in steps)
    assert all((s["vision_launch_cpu_ms"] is not None) == (s["images"] > 0) for s in steps)
    assert all(s["vision_launch_cpu_ms"] <= s["vision_launch_ms"] + 1
               for s in steps if s["images"])


def test_offline_llm_needs_no_serving_packages(vlmserve_cache) -> None:
    """`LLM` runs without the server's packages (pyzmq, msgspec, FastAPI, uvicorn,
    prometheus-client, aiohttp, pybase64): a bare GPU image with torch and transformers runs
    the offline benchmarks as they are."""
    import os
    import subprocess
    import sys

    code = (
        "import sys\n"
        "for m in ('zmq', 'msgspec', 'fastapi', 'uvicorn', 'prometheus_client', 'aiohttp',"
        " 'pybase64'):\n"
        "    sys.modules[m] = None  # an import of it fails\n"
        "from vlmserve import LLM, SamplingParams\n"
        "from tests.engine.helpers import chat_prompt, make_image\n"
        "llm = LLM('tiny-qwen2-vl', dtype='float32', device='cpu')\n"
        "p = chat_prompt(llm, 'Hi', [make_image(56, 56, 1)])\n"
        "out = llm.generate([p], SamplingParams(max_tokens=3, temperature=0.0,"
        " ignore_eos=True), use_tqdm=False)\n"
        "print(len(out[0].outputs[0].token_ids))\n")
    env = {**os.environ, "VLMSERVE_CACHE": str(vlmserve_cache)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300, env=env, cwd=os.path.dirname(os.path.dirname(
                              os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "3"


def test_a_dropped_llm_frees_its_model_and_leaves_the_callers_heap_alone(vlmserve_cache):
    """The in-process engine freezes nothing (`gc.freeze` is for our own processes: there it
    pinned every dropped `LLM`'s model, KV cache and pinned host pool for good, so a process
    building several ran out of host memory), and a dropped `LLM` is collected with its
    model."""
    import gc
    import weakref

    from vlmserve import LLM, SamplingParams

    frozen = gc.get_freeze_count()
    llm = LLM("tiny-qwen2-vl", dtype="float32", device="cpu")
    llm.generate(["Free me."], SamplingParams(max_tokens=3), use_tqdm=False)
    assert gc.get_freeze_count() == frozen
    model = weakref.ref(llm.engine.executor.runner.model)
    runner = weakref.ref(llm.engine.executor.runner)
    del llm
    gc.collect()
    assert runner() is None and model() is None


@pytest.mark.parametrize("budget", [-(2.0 ** 30), 100.0])
def test_no_room_for_one_kv_block_is_refused_at_start(vlmserve_cache, monkeypatch, budget):
    """A device whose free memory within gpu_memory_utilization holds no KV block (another
    engine holds it; or less than a block's bytes are left) is refused at start with a line
    naming the setting, not served with a one-block cache that limits every request to 16
    tokens."""
    from vlmserve.executor.uniproc import UniprocExecutor

    monkeypatch.setattr(UniprocExecutor, "_memory_budget", lambda self, config: budget)
    with pytest.raises(RuntimeError, match="no device memory is left for the KV cache.*"
                                           "raise gpu_memory_utilization"):
        LLM("tiny-qwen2-vl", dtype="float32", device="cpu")
