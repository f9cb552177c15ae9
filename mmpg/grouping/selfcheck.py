"""The self-check: the grouped forward (or a rollout engine) against the repeated forward, in the user's own
environment — dtype, attention backend, device, transformers / torch / flash-attn versions — before training trusts it.

    check = SelfCheck("on")                                   # "on": stop on a mismatch, "warn": log and go on, "off"
    if check.needed(model, dims=(P, S, G)):                   # the first call, and whenever the envelope grows
        metrics = check.run(model, inputs, ids, mask, [G])    # no gradient; raises SelfCheckError when "on"

The envelope is what has been checked so far, per (backend, dtype): the longest prefix P, the longest response S and
the largest group G of a checked group. A batch that goes past it on any axis (or a new backend or dtype) is checked
again on one real group, so a kernel path that only long prompts or large groups take (a different flash tile, a
varlen split) is covered when training first reaches it (as unsloth's envelope-aware shared-prefix check does).

Bounds on max |grouped - repeated| over the group's response tokens, per dtype:
  * float32: 1e-4 (the equivalence tests measure <= 1e-6 on every tiny model; a wrong forward is off by >= 1e-2).
  * bfloat16 / float16: the two forwards round differently (other reduction orders and tile splits), and the
    difference grows with depth. Measured on the CPU (2026-12-01, tiny random Qwen2.5-VL and Qwen3-VL, hidden
    64/256/512, 2/4/8 layers, 3 seeds, responses up to 24 tokens): the max difference was 0.26-0.40 x u x L in bf16
    (u = 2^-8, L = decoder layers; 0.0020, 0.0062, 0.0117 at L = 2, 4, 8) and 0.31-0.50 x u x L in fp16 (u = 2^-11).
    The bound is 4x the worst measured ratio: bf16 1.6 x u x L (0.18 for 28 layers), fp16 2.0 x u x L (0.027). A
    forward that drops the video was off by 0.04-0.28 on those tiny models and by far more on a trained one, where
    the answer depends on the frames.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import transformers

from mmpg.grouping.backends import compute_dtype, resolve_backend
from mmpg.grouping.logprobs import grouped_logprobs, repeated_logprobs

log = logging.getLogger("mmpg.grouping")

MODES = ("on", "warn", "off")
FLOAT32_BOUND = 1e-4
# max |difference| per unit roundoff u and decoder layer (module docstring: 4x the worst measured ratio)
PER_LAYER_ULPS = {torch.bfloat16: (2.0 ** -8, 1.6), torch.float16: (2.0 ** -11, 2.0)}


class SelfCheckError(RuntimeError):
    """The grouped forward disagreed with the repeated one beyond the dtype's bound (one line: figure, versions)."""


def bound_for(model, dtype: torch.dtype) -> float:
    """The largest max |grouped - repeated| logprob difference accepted in `dtype` for this model (docstring)."""
    if dtype not in PER_LAYER_ULPS:
        return FLOAT32_BOUND
    unit, ratio = PER_LAYER_ULPS[dtype]
    layers = int(getattr(model.config.get_text_config(), "num_hidden_layers", 1) or 1)
    return ratio * unit * layers


def versions() -> str:
    """torch, transformers and flash-attn versions, for the error line."""
    try:
        import flash_attn

        flash = getattr(flash_attn, "__version__", "installed")
    except ImportError:
        flash = "not installed"
    return f"torch {torch.__version__}, transformers {transformers.__version__}, flash-attn {flash}"


@dataclasses.dataclass
class Envelope:
    """The largest prefix, response and group checked so far (for one backend and dtype)."""

    prefix: int = 0
    response: int = 0
    group: int = 0

    def covers(self, dims: tuple[int, int, int]) -> bool:
        return dims[0] <= self.prefix and dims[1] <= self.response and dims[2] <= self.group

    def grow(self, dims: tuple[int, int, int]) -> None:
        self.prefix, self.response, self.group = (max(a, b) for a, b in
                                                  zip((self.prefix, self.response, self.group), dims))


def batch_dims(prompt_inputs, completion_mask, group_sizes) -> tuple[int, int, int]:
    """(P, S, G) of a batch of groups: the longest prompt (tokens), the longest response, the largest group."""
    attn = prompt_inputs.get("attention_mask")
    prefix = int(attn.sum(dim=1).max()) if attn is not None else int(prompt_inputs["input_ids"].shape[1])
    return prefix, int(completion_mask.sum(dim=1).max()), max(int(g) for g in group_sizes)


class SelfCheck:
    """Grouped (or an engine's) logprobs vs the repeated forward of the same rows; see the module docstring."""

    def __init__(self, mode: str = "on", what: str = "grouped forward"):
        if mode not in MODES:
            raise ValueError(f"self-check mode {mode!r}; choose one of {', '.join(MODES)}")
        self.mode, self.what = mode, what
        self.envelopes: dict[tuple[str, torch.dtype], Envelope] = {}

    def key(self, model, backend: str | None = None) -> tuple[str, torch.dtype]:
        device = model.get_input_embeddings().weight.device
        dtype = compute_dtype(model, device)
        return resolve_backend(backend or getattr(model, "_mmpg_backend", "auto"), device, dtype), dtype

    def needed(self, model, dims: tuple[int, int, int], backend: str | None = None) -> bool:
        """Whether a group of `dims` (P, S, G) lies outside what was checked for this backend and dtype."""
        if self.mode == "off":
            return False
        env = self.envelopes.get(self.key(model, backend))
        return env is None or not env.covers(dims)

    def run(self, model, prompt_inputs, completion_ids, completion_mask, group_sizes, *, temperature: float = 1.0,
            chunk_size: int = 2048, candidate: torch.Tensor | None = None, backend: str | None = None,
            reduce_max=None, share: bool = True) -> dict:
        """Compare on one real group (or a few), no gradient; grow the envelope. `candidate` [N, S]: logprobs to
        check instead of the grouped forward's (an engine's). `reduce_max(float) -> float`: the max over ranks (all
        ranks call `run` together under ZeRO-3). `share`: as `grouped_logprobs` (the path the caller's forward takes).
        Returns the check/* metrics; raises `SelfCheckError` in mode "on"."""
        key = self.key(model, backend)
        with torch.no_grad():
            if candidate is None:
                candidate = grouped_logprobs(model, prompt_inputs, completion_ids, completion_mask, group_sizes,
                                             backend=backend, temperature=temperature, chunk_size=chunk_size,
                                             share=share)
            reference = repeated_logprobs(model, prompt_inputs, completion_ids, completion_mask, group_sizes,
                                          temperature=temperature)
        mask = completion_mask.to(reference.device).bool()
        diff = float((candidate.to(reference.device) - reference).abs().masked_fill(~mask, 0).max())
        if reduce_max is not None:
            diff = float(reduce_max(diff))
        dims = batch_dims(prompt_inputs, completion_mask, group_sizes)
        env = self.envelopes.setdefault(key, Envelope())
        env.grow(dims)
        bound = bound_for(model, key[1])
        metrics = {"check/grouped_vs_repeated_max": diff, "check/bound": bound, "check/prefix_max": env.prefix,
                   "check/response_max": env.response, "check/group_max": env.group}
        if not diff <= bound:  # NaN fails too
            line = (f"self-check: the {self.what} differs from the repeated forward by {diff:.3g} (max |logprob "
                    f"difference|, bound {bound:.3g} for {str(key[1]).removeprefix('torch.')}) on a group of P={dims[0]}"
                    f" S={dims[1]} G={dims[2]}, backend {key[0]}, {versions()}: training on it would use wrong "
                    "gradients; report it, or try another backend / transformers release")
            if self.mode == "on":
                raise SelfCheckError(line + " (algorithm.self_check=warn goes on anyway)")
            log.warning("%s", line)
        else:
            log.info("self-check passed: %s vs repeated forward max |difference| %.3g <= %.3g (P<=%d, S<=%d, G<=%d, "
                     "%s, %s)", self.what, diff, bound, env.prefix, env.response, env.group, key[0],
                     str(key[1]).removeprefix("torch."))
        return metrics
