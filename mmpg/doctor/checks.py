"""The path checks of `mmpg doctor`, each on a tiny random-weight model or random tensors built here, each against the
exact path it must equal:

    grouped/<backend>/<family>/<dtype>  grouped_logprobs(backend) vs repeated_logprobs: max |dlogp| over the masked entries
                                 and the worst parameter's ||g_grouped - g_repeated|| / ||g_repeated|| after the
                                 backward of a weighted sum. Bounds: float32 1e-5 / 1e-4 (the equivalence tests');
                                 bf16 (flash) the self-check's bound for the model (`bounds.bound_for`) / 5e-2.
    cascade/<kernel>/<dtype>     cascade_kernels.attend(kernel) vs attend("math") on a left-padded batch: max
                                 |dout| and |dlse|. Bounds: float32 1e-5, bf16 2e-2 (out) / 1e-2 (lse).
    decode/<kernel>/<family>     HFEngine greedy decoding, cascade with the kernel vs the copy path: the same tokens.

    decode/auto/<family>         what the engine's own choice (`rollout.decode=auto`, its check on) takes here, and why
                                 (`mmpg.choices`: "decode_kernel").

The model is built from a config (no download): 2 layers, hidden 64, 4 query / 2 KV heads (GQA), two prompts of
different lengths (left padded), one video each for the VL families (Qwen3-VL: one temporal patch, since the bench's
builder writes no per-frame timestamps), unequal group sizes 3 and 2, unequal response lengths. MMPG_DOCTOR_FAULT=<row id> (or a prefix of one) shifts that row's fast-path result by 0.1 before the
comparison: how a test proves a faulty path FAILS and is named.
"""

from __future__ import annotations

import os
import time

import torch

from mmpg.doctor.results import Row

FP32_LOGP, FP32_GRAD = 1e-5, 1e-4
BF16_GRAD = 5e-2
KERNEL_BOUNDS = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 1e-2)}  # (out, lse)
TINY = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 128}
FAULT_SHIFT = 0.1


def faulty(row_id: str) -> bool:
    """Whether MMPG_DOCTOR_FAULT names this row (comma-separated ids or id prefixes)."""
    wanted = [w.strip() for w in os.environ.get("MMPG_DOCTOR_FAULT", "").split(",") if w.strip()]
    return any(row_id == w or row_id.startswith(w.rstrip("/") + "/") for w in wanted)


def tiny_model(family: str, device: torch.device, dtype: torch.dtype = torch.float32, spec: dict | None = None):
    """(model in train mode, ids: video / vision_start / vision_end token ids and the tokenizer) from a config."""
    from mmpg.bench.model import build_model

    return build_model({"family": family, "spec": spec or TINY, "dtype": str(dtype).split(".")[-1]}, device)


def padded_prompts(model, ids: dict, device, lengths=(40, 52)) -> dict:
    """Two prompts of the given lengths, the shorter left padded (pad id 0, attention_mask 0), one video each for a
    VL model (`mmpg.bench.batch.make_inputs`)."""
    from mmpg.bench.batch import make_inputs

    case = {"S": 1, "G": 1}
    if model.config.model_type == "qwen3_vl":  # one temporal patch: the bench's builder writes no per-frame timestamps
        vc = model.config.vision_config
        side = 2 * vc.patch_size * vc.spatial_merge_size
        case["video"] = (vc.temporal_patch_size, side, side)
    parts = [make_inputs(model, {**case, "P": P}, ids, device, seed=1 + b)[0] for b, P in enumerate(lengths)]
    width = max(p["input_ids"].shape[1] for p in parts)
    out: dict = {}
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        if key in parts[0]:
            out[key] = torch.cat([torch.nn.functional.pad(p[key], (width - p[key].shape[1], 0)) for p in parts])
    for key in ("pixel_values_videos", "video_grid_thw"):
        if key in parts[0]:
            out[key] = torch.cat([p[key] for p in parts])
    return out


def completions(device, sizes=(3, 2), S: int = 7, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    """ids, mask [N, S]: random tokens, right padded, rows of unequal lengths."""
    from mmpg.bench.batch import TEXT_IDS

    gen = torch.Generator().manual_seed(seed)
    N = sum(sizes)
    ids = torch.randint(0, TEXT_IDS, (N, S), generator=gen)
    lengths = torch.tensor([S - (i % 3) for i in range(N)])
    mask = (torch.arange(S)[None] < lengths[:, None]).long()
    return (ids * mask).to(device), mask.to(device)


def _logps_and_grads(model, fn, weights):
    model.zero_grad(set_to_none=True)
    logps = fn()
    (logps * weights).sum().backward()
    return logps.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def grouped_row(family: str, backend: str, device: torch.device, dtype: torch.dtype) -> Row:
    """One grouped backend against the repeated forward: forward logprobs and every parameter's gradient."""
    from mmpg.grouping import grouped_logprobs, repeated_logprobs
    from mmpg.grouping.bounds import bound_for

    row_id = f"grouped/{backend}/{family}/{str(dtype).split('.')[-1]}"
    what = f"grouped forward, backend {backend}, {family} ({str(dtype).split('.')[-1]}, {device.type})"
    t0 = time.perf_counter()
    model, ids = tiny_model(family, device, dtype)
    prompts = padded_prompts(model, ids, device)
    cids, cmask = completions(device)
    sizes = [3, 2]
    weights = torch.linspace(0.5, 1.5, cids.numel(), device=device).view_as(cids)
    shift = FAULT_SHIFT if faulty(row_id) else 0.0
    g, g_grads = _logps_and_grads(
        model, lambda: grouped_logprobs(model, prompts, cids, cmask, sizes, backend=backend) + shift * cmask, weights)
    r, r_grads = _logps_and_grads(model, lambda: repeated_logprobs(model, prompts, cids, cmask, sizes), weights)
    dlogp = float(((g - r).abs() * cmask).max())
    rel = {n: float((g_grads[n] - ref).norm() / ref.norm().clamp_min(1e-30)) for n, ref in r_grads.items()
           if n in g_grads}
    worst = max(rel, key=rel.get)
    lbound, gbound = (FP32_LOGP, FP32_GRAD) if dtype == torch.float32 else (bound_for(model, dtype), BF16_GRAD)
    figure = f"max abs dlogp {dlogp:.2g} (bound {lbound:.2g}); grad rel {rel[worst]:.2g} (bound {gbound:.2g})"
    problems = []
    if set(g_grads) != set(r_grads):
        problems.append(f"parameters with gradients differ: {sorted(set(g_grads) ^ set(r_grads))[:3]}")
    if not dlogp <= lbound:
        problems.append(f"logprobs differ by {dlogp:.3g} > {lbound:.2g}")
    if not rel[worst] <= gbound:
        problems.append(f"gradient of {worst} differs by {rel[worst]:.3g} > {gbound:.2g}")
    return Row("grouped", row_id, what, "FAIL" if problems else "PASS", figure, "; ".join(problems),
               time.perf_counter() - t0)


def cascade_row(kernel: str, device: torch.device, dtype: torch.dtype) -> Row:
    """One cascade kernel against the math kernel: output and log-sum-exp on a left-padded batch with GQA folded."""
    from mmpg.rollout.cascade_kernels import attend

    name = str(dtype).split(".")[-1]
    row_id = f"cascade/{kernel}/{name}"
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(0)
    B, H, Lq, Lk, D = 3, 4, 6, 45, 64
    q, k, v = (torch.randn(B, H, n, D, generator=gen).to(device, dtype) for n in (Lq, Lk, Lk))
    key_mask = torch.ones(B, Lk, dtype=torch.bool)
    key_mask[1, :7] = False  # left padding of a shorter prompt
    key_mask[2, :30] = False
    key_mask = key_mask.to(device)
    out, lse = attend(q, k, v, key_mask, D ** -0.5, kernel)
    ref, ref_lse = attend(q, k, v, key_mask, D ** -0.5, "math")
    if faulty(row_id):
        out = out + FAULT_SHIFT
    dout = float((out.float() - ref.float()).abs().max())
    dlse = float((lse.float() - ref_lse.float()).abs().max())
    bout, blse = KERNEL_BOUNDS[dtype]
    figure = f"max abs dout {dout:.2g} (bound {bout:.2g}), max abs dlse {dlse:.2g} (bound {blse:.2g})"
    ok = dout <= bout and dlse <= blse
    return Row("cascade", row_id, f"cascade kernel {kernel} vs math ({name}, {device.type})",
               "PASS" if ok else "FAIL", figure, "" if ok else "the kernel disagrees with the math kernel",
               time.perf_counter() - t0)


def decode_row(kernel: str, family: str, device: torch.device, dtype: torch.dtype) -> Row:
    """Greedy decoding (what `mmpg eval` runs): cascade with the kernel vs the copy path, the same tokens."""
    from mmpg.rollout.engine import SamplingParams
    from mmpg.rollout.hf import HFEngine

    row_id = f"decode/{kernel}/{family}"
    t0 = time.perf_counter()
    model, ids = tiny_model(family, device, dtype)
    prompts = padded_prompts(model, ids, device)
    sampling = SamplingParams(max_new_tokens=12, temperature=0.0, stop_token_ids=(1,))
    runs = {}
    for decode in ("copy", "cascade"):
        # decode_check off: the kernel as given (with the check on, a faulty kernel would step down to copy and
        # this row would compare copy with copy)
        engine = HFEngine(model, ids["tokenizer"], decode=decode, cascade_backend=kernel, decode_check="off")
        runs[decode] = engine.generate_groups(prompts, [3, 2], sampling)
    a, b = runs["copy"], runs["cascade"]
    b_ids = b.completion_ids + (1 if faulty(row_id) else 0)
    same = a.completion_ids.shape == b_ids.shape and bool(torch.equal(a.completion_ids, b_ids))
    figure = f"{int(a.completion_mask.sum())} tokens, " + ("identical" if same else "DIFFERENT")
    if same and a.logprobs is not None and b.logprobs is not None:
        figure += f"; max abs dlogp {float((a.logprobs - b.logprobs).abs().max()):.2g}"
    return Row("decode", row_id, f"greedy decoding, cascade ({kernel}) vs copy, {family} "
               f"({str(dtype).split('.')[-1]}, {device.type})", "PASS" if same else "FAIL", figure,
               "" if same else "cascade decoding gave other tokens than the copy path", time.perf_counter() - t0)


def grouped_auto_row(device: torch.device) -> Row:
    """What `model.grouping_backend=auto` resolves to here for a bf16 model (`mmpg.grouping.backends.resolve_backend`:
    flash where usable, else sdpa); a run then checks it on its first batch (the self-check) and steps down."""
    from mmpg.grouping.backends import get_backend, resolve_backend

    name = resolve_backend("auto", device, torch.bfloat16)
    get_backend(name)  # imports: a backend that cannot load raises here
    return Row("grouped", "grouped/auto", f"the grouped backend model.grouping_backend=auto takes here (bfloat16, "
               f"{device.type})", "PASS", f"resolves to {name}", "")


def auto_row(family: str, device: torch.device, dtype: torch.dtype) -> Row:
    """The decode kernel `rollout.decode=auto` takes on this machine with its check on, from `mmpg.choices`."""
    from mmpg import choices
    from mmpg.rollout.engine import SamplingParams
    from mmpg.rollout.hf import HFEngine

    t0 = time.perf_counter()
    model, ids = tiny_model(family, device, dtype)
    engine = HFEngine(model, ids["tokenizer"], decode="auto", cascade_backend="auto", decode_check="on")
    engine.generate_groups(padded_prompts(model, ids, device), [3, 2],
                           SamplingParams(max_new_tokens=6, temperature=0.0, stop_token_ids=(1,)))
    chosen = choices.current().get("decode_kernel", {"value": "(not recorded)", "why": ""})
    return Row("decode", f"decode/auto/{family}", f"the decode kernel rollout.decode=auto takes here, {family} "
               f"({str(dtype).split('.')[-1]}, {device.type})", "PASS", f"chose {chosen['value']}",
               chosen["why"], time.perf_counter() - t0)


def guarded(fn, section: str, row_id: str, what: str, *args) -> Row:
    """fn(*args), or a FAIL row naming the exception it raised (a path that raises is a failed path)."""
    t0 = time.perf_counter()
    try:
        return fn(*args)
    except Exception as err:  # noqa: BLE001 - the report is the place for it
        first = str(err).splitlines()[0][:240] if str(err) else ""
        return Row(section, row_id, what, "FAIL", "", f"raised {type(err).__name__}: {first}",
                   time.perf_counter() - t0)
