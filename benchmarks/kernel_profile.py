"""Where the GPU's time goes, kernel by kernel, for one checkpoint offline (torch.profiler):
  python benchmarks/kernel_profile.py CKPT [option=value ...]
Two phases after a warm-up: `images`, N requests (PROF_N, default 64) of one random image each
(benchmarks/sbs.py's W1 requests, its SBS_PROMPT) with OUT_TOK (default 32) output tokens; and
`decode`, 16 text requests decoding 256 tokens each, mostly batch-16 decode steps. For each, the
wall time, the device's busy time and the 25 kernels with the most device time (calls, total ms,
share), then the host's side: the CUDA API calls by their total time on the host (a copy or
event call that lasts far longer than its peers waited for the device) and the 15 torch ops
with the most host time of their own. Engine options go to `LLM(...)` as in sbs.py."""
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(__file__))
from sbs import PROMPT, images, options  # noqa: E402

from vlmserve import LLM, SamplingParams  # noqa: E402


def table(prof, wall_s: float, label: str) -> None:
    rows = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.device_time > 0:
            calls, us = rows.get(e.name, (0, 0.0))
            rows[e.name] = (calls + 1, us + e.device_time)
    busy = sum(us for _, us in rows.values()) / 1e3
    print(f"=== {label}: wall {wall_s * 1e3:.0f} ms, kernels {busy:.0f} ms "
          f"({busy / (wall_s * 1e3):.0%} of wall)")
    for name, (calls, us) in sorted(rows.items(), key=lambda r: -r[1][1])[:25]:
        print(f"{us / 1e3:9.1f} ms {us / 1e3 / busy:6.1%} {calls:7d}  {name[:110]}")


def host_table(prof) -> None:
    api, ops = {}, {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CPU:
            continue
        rows = api if e.name.startswith("cu") else ops if e.name.startswith("aten::") else None
        if rows is not None:
            calls, us, most = rows.get(e.name, (0, 0.0, 0.0))
            rows[e.name] = (calls + 1, us + e.self_cpu_time_total,
                            max(most, e.self_cpu_time_total))
    for label, rows, top in (("CUDA API calls", api, 12), ("torch ops, own host time", ops, 15)):
        print(f"--- {label}: total ms, calls, longest ms")
        for name, (calls, us, most) in sorted(rows.items(), key=lambda r: -r[1][1])[:top]:
            print(f"{us / 1e3:9.1f} ms {calls:7d} {most / 1e3:8.2f}  {name[:90]}")


def main() -> None:
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    ckpt, opts = sys.argv[1], options(sys.argv[2:])
    llm = LLM(model=ckpt, **opts)
    n, out_tok = int(os.environ.get("PROF_N", "64")), int(os.environ.get("OUT_TOK", "32"))

    def mm(ims):
        return [{"prompt": PROMPT, "multi_modal_data": {"image": im}} for im in ims]
    sp = SamplingParams(max_tokens=out_tok, ignore_eos=True, temperature=0)
    text = [f"{i} tell me a long story about the sea and the sky and the birds" for i in range(16)]
    dec = SamplingParams(max_tokens=256, ignore_eos=True, temperature=0)
    llm.generate(mm(images(16, 10_000)), sp, use_tqdm=False)
    llm.generate(text, dec, use_tqdm=False)
    for label, run in (("images", lambda: llm.generate(mm(images(n)), sp, use_tqdm=False)),
                       ("decode", lambda: llm.generate(text, dec, use_tqdm=False))):
        sync()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t = time.perf_counter()
            run()
            sync()
            wall = time.perf_counter() - t
        table(prof, wall, label)
        host_table(prof)


if __name__ == "__main__":
    main()
