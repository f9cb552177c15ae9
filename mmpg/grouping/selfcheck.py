"""The self-check: the grouped forward (or a rollout engine) against the repeated forward, in the user's own
environment — dtype, attention backend, device, transformers / torch / flash-attn versions — before training trusts it.

    check = SelfCheck("on")                                   # "on": stop on a mismatch, "warn": log and go on, "off"
    if check.needed(model, dims=(P, S, G)):                   # the first call, and whenever the envelope grows
        metrics = check.run(model, inputs, ids, mask, [G])    # no gradient; raises SelfCheckError when "on"

The envelope is what has been checked so far, per (backend, dtype): the longest prefix P, the longest response S and
the largest group G of a checked group. A batch that goes past it on any axis (or a new backend or dtype) is checked
again on one real group, so a kernel path that only long prompts or large groups take (a different flash tile, a
varlen split) is covered when training first reaches it (as unsloth's envelope-aware shared-prefix check does).

Precision. In a 16-bit run both forwards of the grouped-forward check compute in float32 on the run's own weights
(`mmpg.grouping.precise.float32_compute`: one module's float32 copy at a time): rounding along the two paths then
differs by ~1e-6 instead of growing with depth (bf16: 0.002-0.004 nat at 28 layers on tiny CPU models, against
0.04-0.28 nat for the faults the check exists to catch). Bounds on max |grouped - repeated| over response tokens:
  * float32 compute throughout (float32 runs; sdpa / lse_reference backends in 16-bit runs): 1e-4 (measured <= 1e-6
    on every tiny model, 28 layers included; a wrong forward is off by >= 1e-2).
  * flash / flex in a 16-bit run: their kernel runs in the run's dtype (flash has no float32 kernel, and the kernel
    is what is checked), the rest in float32. Measured (2026-12-01, CPU, tiny Qwen2.5-VL, 28 layers, 3 seeds, sdpa
    as the 16-bit kernel): 0.00066-0.00098 nat, up to 0.009 x u x L (u = 2^-8, L decoder layers). The bound is
    0.25 x u x L: 0.027 at 28 layers, 28x the worst measured noise, and under a 0.04 nat fault.
  * an engine's logprobs (`candidate`, evaluation's decode check) are 16-bit as the engine ran them: they are
    compared with the repeated forward in the run's dtype, bound 1.6 x u x L (bf16) / 2.0 x u x L (fp16) as measured
    on 2-8 layer tiny models (0.26-0.40 x u x L, 4x margin).
Cost of the precise check: the check's two forwards (no gradient) on one group in float32 compute: activations twice
their bf16 size, one module's float32 weights (at most vocab x hidden x 4 bytes: 2.2 GB for Qwen2.5-VL-7B), and
float32 matmul time (on a GPU several times the bf16 time) — once per envelope growth, not per step.

Fallback. A `flash` or `flex` backend that raises in the check or fails it is dropped with one warning line (backend,
figure or error, versions) and the check runs again on `sdpa`, which the model then keeps (`model._mmpg_backend`);
the run stops (mode "on") only when sdpa fails too. `choice` holds (backend, why) for the caller to record.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
import transformers

from mmpg.grouping.backends import compute_dtype, resolve_backend
from mmpg.grouping.logprobs import grouped_logprobs, repeated_logprobs
from mmpg.grouping.patch import base_model, set_grouping_options
from mmpg.grouping.precise import float32_compute

log = logging.getLogger("mmpg.grouping")

MODES = ("on", "warn", "off")
FLOAT32_BOUND = 1e-4
# max |difference| per unit roundoff u and decoder layer (module docstring): an engine's 16-bit logprobs, and a
# 16-bit kernel inside the float32 check
PER_LAYER_ULPS = {torch.bfloat16: (2.0 ** -8, 1.6), torch.float16: (2.0 ** -11, 2.0)}
KERNEL_PER_LAYER_ULPS = 0.25
FLOAT32_KERNELS = ("sdpa", "lse_reference")  # backends checked in float32 throughout
FALLBACK = "sdpa"


class SelfCheckError(RuntimeError):
    """The grouped forward disagreed with the repeated one beyond the dtype's bound (one line: figure, versions)."""


def _layers(model) -> int:
    return int(getattr(model.config.get_text_config(), "num_hidden_layers", 1) or 1)


def bound_for(model, dtype: torch.dtype) -> float:
    """The largest max |engine - repeated| logprob difference accepted when both run in `dtype` (docstring)."""
    if dtype not in PER_LAYER_ULPS:
        return FLOAT32_BOUND
    unit, ratio = PER_LAYER_ULPS[dtype]
    return ratio * unit * _layers(model)


def precise_bound(model, backend: str, dtype: torch.dtype) -> tuple[float, torch.dtype | None]:
    """(bound, kernel dtype) of the float32 grouped-forward check of a `dtype` run on `backend` (docstring)."""
    if dtype not in PER_LAYER_ULPS or backend in FLOAT32_KERNELS:
        return FLOAT32_BOUND, None
    return KERNEL_PER_LAYER_ULPS * PER_LAYER_ULPS[dtype][0] * _layers(model), dtype


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
    """Grouped (or an engine's) logprobs vs the repeated forward of the same rows; see the module docstring.
    `precise`: the grouped-forward check of a 16-bit run in float32 compute (default; False: in the run's dtype with
    the engine bound, as before). `choice`: (backend, why) after a grouped-forward check, `why` naming a fallback."""

    def __init__(self, mode: str = "on", what: str = "grouped forward", precise: bool = True):
        if mode not in MODES:
            raise ValueError(f"self-check mode {mode!r}; choose one of {', '.join(MODES)}")
        self.mode, self.what, self.precise = mode, what, precise
        self.envelopes: dict[tuple[str, torch.dtype], Envelope] = {}
        self.choice: tuple[str, str] | None = None

    def key(self, model, backend: str | None = None) -> tuple[str, torch.dtype]:
        device = model.get_input_embeddings().weight.device
        dtype = compute_dtype(model, device)
        return resolve_backend(backend or getattr(base_model(model), "_mmpg_backend", "auto"), device, dtype), dtype

    def needed(self, model, dims: tuple[int, int, int], backend: str | None = None) -> bool:
        """Whether a group of `dims` (P, S, G) lies outside what was checked for this backend and dtype."""
        if self.mode == "off":
            return False
        env = self.envelopes.get(self.key(model, backend))
        return env is None or not env.covers(dims)

    def _measure(self, model, key, args, kwargs, candidate, reduce_max, named: bool) -> tuple[float, float, str]:
        """(max |difference| over ranks, bound, error): an exception in a grouped forward that may fall back (not
        `named`, not sdpa) counts as an infinite difference (every rank still joins `reduce_max`), its first line is
        returned."""
        error = ""
        try:
            with torch.no_grad():
                if candidate is not None:
                    bound = bound_for(model, key[1])
                    reference = repeated_logprobs(*args, temperature=kwargs["temperature"])
                elif self.precise:
                    bound, kernel = precise_bound(model, key[0], key[1])
                    device = model.get_input_embeddings().weight.device
                    with torch.autocast(device.type, enabled=False), float32_compute(base_model(model), kernel):
                        candidate = grouped_logprobs(*args, backend=key[0], **kwargs)
                        reference = repeated_logprobs(*args, temperature=kwargs["temperature"])
                else:
                    bound = bound_for(model, key[1])
                    candidate = grouped_logprobs(*args, backend=key[0], **kwargs)
                    reference = repeated_logprobs(*args, temperature=kwargs["temperature"])
            mask = args[3].to(reference.device).bool()
            diff = float((candidate.to(reference.device) - reference).abs().masked_fill(~mask, 0).max())
        except Exception as err:  # noqa: BLE001 - a kernel that raises is a failed check (and maybe a fallback)
            if candidate is not None or named or key[0] == FALLBACK:
                raise
            bound, diff = precise_bound(model, key[0], key[1])[0], float("inf")
            error = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
        if reduce_max is not None:
            diff = float(reduce_max(diff))
        return diff, bound, error

    def run(self, model, prompt_inputs, completion_ids, completion_mask, group_sizes, *, temperature: float = 1.0,
            chunk_size: int = 2048, candidate: torch.Tensor | None = None, backend: str | None = None,
            reduce_max=None, share: bool = True) -> dict:
        """Compare on one real group (or a few), no gradient; grow the envelope. `candidate` [N, S]: logprobs to
        check instead of the grouped forward's (an engine's). `reduce_max(float) -> float`: the max over ranks (all
        ranks call `run` together under ZeRO-3). `share`: as `grouped_logprobs` (the path the caller's forward takes).
        The model's own flash / flex backend (`backend` None) that fails falls back to sdpa (module docstring); one
        asked for by name is checked as it is. Returns the check/* metrics; raises
        `SelfCheckError` in mode "on"."""
        key = self.key(model, backend)
        args = (model, prompt_inputs, completion_ids, completion_mask, group_sizes)
        kwargs = {"temperature": temperature, "chunk_size": chunk_size, "share": share}
        diff, bound, error = self._measure(model, key, args, kwargs, candidate, reduce_max, backend is not None)
        why = ""
        if candidate is None and backend is None and key[0] != FALLBACK and not diff <= bound:
            why = (f"{key[0]} {'raised ' + error if error else f'differs by {diff:.3g} > bound {bound:.3g}'} in the "
                   f"self-check ({str(key[1]).removeprefix('torch.')}, {versions()})")
            log.warning("self-check: grouped backend %s; falling back to %s", why, FALLBACK)
            set_grouping_options(model, backend=FALLBACK)
            key = self.key(model, FALLBACK)
            diff, bound, error = self._measure(model, key, args, kwargs, candidate, reduce_max, backend is not None)
        if candidate is None:
            self.choice = (key[0], why or (self.choice[1] if self.choice and self.choice[0] == key[0] else ""))
        return self._verdict(key, diff, bound, prompt_inputs, completion_mask, group_sizes)

    def _verdict(self, key, diff, bound, prompt_inputs, completion_mask, group_sizes) -> dict:
        dims = batch_dims(prompt_inputs, completion_mask, group_sizes)
        env = self.envelopes.setdefault(key, Envelope())
        env.grow(dims)
        metrics = {"check/grouped_vs_repeated_max": diff, "check/bound": bound, "check/prefix_max": env.prefix,
                   "check/response_max": env.response, "check/group_max": env.group}
        dtype = str(key[1]).removeprefix("torch.")
        if not diff <= bound:  # NaN fails too
            line = (f"self-check: the {self.what} differs from the repeated forward by {diff:.3g} (max |logprob "
                    f"difference|, bound {bound:.3g} for {dtype}) on a group of P={dims[0]} S={dims[1]} G={dims[2]}, "
                    f"backend {key[0]}, {versions()}: training on it would use wrong gradients; report it, or try "
                    "another backend / transformers release")
            if self.mode == "on":
                raise SelfCheckError(line + " (algorithm.self_check=warn goes on anyway)")
            log.warning("%s", line)
        else:
            log.info("self-check passed: %s vs repeated forward max |difference| %.3g <= %.3g (P<=%d, S<=%d, G<=%d, "
                     "%s, %s)", self.what, diff, bound, env.prefix, env.response, env.group, key[0], dtype)
        return metrics
