"""Offline side by side on one GPU: the same requests through vlmserve, vLLM or transformers.
  python sbs.py ENGINE CKPT N [option=value ...]     ENGINE: vlmserve | vllm | hf
Requests (W1): N prompts, each one random image of 448, 672 or 896 px square (seeded) and the same
~60-token text; OUT_TOK output tokens each (env, default 128; 1 = prefill + vision only), no EOS.
A warm-up on 16 other images comes first. Then batch-1 decode: (time of 528 tokens - time of 16)
/ 512, best of 3 (BS1=0 skips it). Prints one 'RESULT {json}' line per figure. Engine options
(`max_num_seqs=512`, ...) go to the engine's constructor; vLLM's defaults otherwise."""
import json
import os
import random
import sys
import time

import numpy as np
import torch
from PIL import Image

SIZES = [448, 672, 896]
TEXT = "describe this picture in detail and tell me what the animals are doing near the red chair " * 2
PROMPTS = {  # SBS_PROMPT picks the model family's chat format
    "qwen": "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>" + TEXT
            + "<|im_end|>\n<|im_start|>assistant\n",
    "llava_next": "[INST] <image>\n" + TEXT + " [/INST]",
    "gemma": "<start_of_turn>user\n<start_of_image>" + TEXT
             + "<end_of_turn>\n<start_of_turn>model\n",
}
PROMPT = PROMPTS[os.environ.get("SBS_PROMPT", "qwen")]
OUT_TOK = int(os.environ.get("OUT_TOK", "128"))


def images(n, seed_offset=0):
    rng = random.Random(seed_offset)
    return [Image.fromarray(np.random.default_rng(seed_offset + i).integers(0, 255, (s, s, 3), dtype=np.uint8))
            for i, s in enumerate(rng.choice(SIZES) for _ in range(n))]


def options(args):
    out = {}
    for a in args:
        k, v = a.split("=", 1)
        out[k] = {"True": True, "False": False}.get(v, int(v) if v.lstrip("-").isdigit() else v)
    return out


def engine(name, ckpt, opts):
    if name == "vlmserve":
        from vlmserve import LLM, SamplingParams
        llm = LLM(model=ckpt, **opts)
    else:
        from vllm import LLM, SamplingParams
        llm = LLM(model=ckpt, **{"max_model_len": 4096, "gpu_memory_utilization": 0.85,
                                 "limit_mm_per_prompt": {"image": 1}, "mm_processor_cache_gb": 0,
                                 "seed": 0, **opts})
    return (lambda inputs, sp: llm.generate(inputs, sp, use_tqdm=False)), SamplingParams


def timed(gen, inputs, sp):
    torch.cuda.synchronize(); t = time.perf_counter()
    outs = gen(inputs, sp)
    torch.cuda.synchronize()
    return time.perf_counter() - t, outs


def run(name, ckpt, n, opts):
    t0 = time.perf_counter()
    gen, SP = engine(name, ckpt, opts)
    init_s = time.perf_counter() - t0
    sp = SP(max_tokens=OUT_TOK, ignore_eos=True, temperature=0)
    gen([{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in images(16, 10_000)], sp)
    dt, outs = timed(gen, [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in images(n)], sp)
    print("RESULT", json.dumps(dict(
        engine=name, options=opts, requests=n, output_len=OUT_TOK, seconds=dt, requests_per_s=n / dt,
        output_tokens_per_s=sum(len(o.outputs[0].token_ids) for o in outs) / dt,
        prompt_tokens=sum(len(o.prompt_token_ids) for o in outs), init_s=init_s)), flush=True)
    if os.environ.get("BS1", "1") == "1":
        one = [{"prompt": PROMPT, "multi_modal_data": {"image": images(1)[0]}}]
        best = lambda k: min(timed(gen, one, SP(max_tokens=k, ignore_eos=True, temperature=0))[0]
                             for _ in range(3))
        best(16)
        print("RESULT", json.dumps(dict(engine=name, options=opts, checkpoint=ckpt,
                                        decode_batch1_ms=(best(528) - best(16)) / 512 * 1e3)), flush=True)


def run_hf(ckpt, n):
    """transformers generate, static batches of 64 grouped by image size (its own processor)."""
    from transformers import AutoModelForImageTextToText, AutoProcessor
    proc = AutoProcessor.from_pretrained(ckpt)
    m = AutoModelForImageTextToText.from_pretrained(ckpt, dtype=torch.bfloat16).cuda().eval()
    groups = {}
    for im in images(n):
        groups.setdefault(im.size[0], []).append(im)

    def gen(imgs):
        enc = proc(text=[PROMPT] * len(imgs), images=imgs, return_tensors="pt").to("cuda")
        with torch.no_grad():
            g = m.generate(**enc, max_new_tokens=OUT_TOK, min_new_tokens=OUT_TOK, do_sample=False)
        return g.shape[0] * (g.shape[1] - enc["input_ids"].shape[1])

    gen(images(4, 10_000))
    torch.cuda.synchronize(); t = time.perf_counter()
    ntok = sum(gen(g[i:i + 64]) for g in groups.values() for i in range(0, len(g), 64))
    torch.cuda.synchronize(); dt = time.perf_counter() - t
    print("RESULT", json.dumps(dict(engine="transformers", requests=n, output_len=OUT_TOK, seconds=dt,
                                    requests_per_s=n / dt, output_tokens_per_s=ntok / dt)), flush=True)


if __name__ == "__main__":
    name, ckpt = sys.argv[1], sys.argv[2]
    if name == "hf":
        run_hf(ckpt, int(sys.argv[3]))
    else:
        run(name, ckpt, int(sys.argv[3]), options(sys.argv[4:]))
