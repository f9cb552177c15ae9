"""The short speed table of `mmpg doctor` (a figure, never a pass mark: a row FAILS only when it raises; out of
memory is NOT RUN), measured in
this process on a text-only Qwen2 built from a config, with the bench's batch builder (`mmpg.bench.batch`):

    speed/forward   grouped vs repeated forward + backward of one prompt of P tokens and G responses of S tokens;
                    the FLOPs model's ceiling for that shape beside it (`mmpg.bench.flops.rho_flops`)
    speed/decode    greedy decoding of G responses behind one prompt of P tokens: cascade (each prompt's K/V read
                    once for its G rows) vs copy (the prefill's cache copied G ways)

CPU: P 1024, S 32, G 8 on the tiny model (seconds); CUDA: P 8192, S 128, G 16, bf16, a larger LM (hidden 1024, 8
layers). Each timing is the median of 2 after one warm-up. For real sizes run `mmpg bench` (see its presets).
"""

from __future__ import annotations

import statistics
import time

import torch

from mmpg.doctor.results import Row

CPU_SHAPE = {"P": 1024, "S": 32, "G": 8, "dtype": torch.float32,
             "spec": {"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                      "intermediate_size": 256}}
CUDA_SHAPE = {"P": 8192, "S": 128, "G": 16, "dtype": torch.bfloat16,
              "spec": {"hidden_size": 1024, "num_layers": 8, "num_heads": 16, "num_kv_heads": 2,
                       "intermediate_size": 2816}}


def _time(fn, device: torch.device, repeats: int = 2) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _shape(device: torch.device) -> dict:
    return CUDA_SHAPE if device.type == "cuda" else CPU_SHAPE


def out_of_memory(fn):
    """A speed row that runs out of device memory is NOT RUN (the shape does not fit this GPU), not a failed path."""
    def row(device: torch.device) -> Row:
        try:
            return fn(device)
        except torch.OutOfMemoryError as err:
            torch.cuda.empty_cache()
            return Row("speed", f"speed/{fn.__name__.removesuffix('_row')}", f"speed: {fn.__name__}", "NOT RUN", "",
                       f"out of memory at {_shape(device)['P']} tokens: {str(err).splitlines()[0][:120]}")
    return row


@out_of_memory
def forward_row(device: torch.device) -> Row:
    from mmpg.bench.batch import make_inputs
    from mmpg.bench.flops import rho_flops
    from mmpg.doctor.checks import tiny_model
    from mmpg.grouping import grouped_logprobs, repeated_logprobs
    from mmpg.models.geometry import from_config_dict

    s = _shape(device)
    t0 = time.perf_counter()
    model, ids = tiny_model("qwen2", device, s["dtype"], s["spec"])
    prompt, cids, cmask, info = make_inputs(model, {"P": s["P"], "S": s["S"], "G": s["G"]}, ids, device)

    def step(fn):
        def run():
            model.zero_grad(set_to_none=True)
            fn(model, prompt, cids, cmask, [s["G"]]).sum().backward()
        return run

    grouped, repeated = _time(step(grouped_logprobs), device), _time(step(repeated_logprobs), device)
    ceiling = rho_flops(from_config_dict(model.config.to_dict(), "qwen2"), info["P"], s["S"], s["G"])
    figure = (f"grouped {grouped * 1e3:.0f} ms vs repeated {repeated * 1e3:.0f} ms: {repeated / grouped:.2f}x "
              f"(FLOPs ceiling {ceiling:.2f}x)" if ceiling else "")
    return Row("speed", "speed/forward", f"forward + backward, P {info['P']}, S {s['S']}, G {s['G']} "
               f"({str(s['dtype']).split('.')[-1]}, {device.type})", "PASS", figure, "", time.perf_counter() - t0)


@out_of_memory
def decode_row(device: torch.device) -> Row:
    from mmpg.bench.batch import make_inputs
    from mmpg.doctor.checks import tiny_model
    from mmpg.rollout.engine import SamplingParams
    from mmpg.rollout.hf import HFEngine

    s = _shape(device)
    t0 = time.perf_counter()
    model, ids = tiny_model("qwen2", device, s["dtype"], s["spec"])
    prompt = make_inputs(model, {"P": s["P"], "S": s["S"], "G": s["G"]}, ids, device)[0]
    sampling = SamplingParams(max_new_tokens=s["S"], temperature=0.0, stop_token_ids=())
    took = {}
    for decode in ("copy", "cascade"):
        engine = HFEngine(model, ids["tokenizer"], decode=decode)
        took[decode] = _time(lambda: engine.generate_groups(prompt, s["G"], sampling), device)
    figure = (f"cascade {took['cascade'] * 1e3:.0f} ms vs copy {took['copy'] * 1e3:.0f} ms: "
              f"{took['copy'] / took['cascade']:.2f}x")
    return Row("speed", "speed/decode", f"greedy decoding of G {s['G']} x {s['S']} tokens behind P {s['P']} "
               f"({str(s['dtype']).split('.')[-1]}, {device.type})", "PASS", figure, "", time.perf_counter() - t0)
