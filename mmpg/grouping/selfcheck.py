"""The self-check: the grouped forward (or a rollout engine) against the repeated forward, in the user's own
environment (dtype, attention backend, device, transformers / torch / flash-attn versions), before training trusts it.

    check = SelfCheck("on")                                   # "on": stop on a mismatch, "warn": log and go on, "off"
    if check.needed(model, dims=(P, S, G)):                   # the first call, and whenever the envelope grows
        metrics = check.run(model, inputs, ids, mask, sizes, gradients=True)  # raises SelfCheckError when "on"

It runs on what the caller passes, one of the step's own micro-batches as the update packs it (several groups per
row, shared videos, sequence-parallel shards), since a fault in a row's second group never runs when one group is
checked alone. Figures, each against its bound (`mmpg.grouping.bounds`): the logprobs without gradient (in float32
compute on the run's own weights for a 16-bit run, `mmpg.grouping.precise`, so rounding does not hide a fault); with
`gradients`, the leak probe and, with autograd recording, the logprobs and the layer-input gradients of a fixed loss
(`mmpg.grouping.probes`), which catch a fault of the backward alone. docs/grouping.md ("Guards") has the cost.
The envelope is what has been checked, per (backend, dtype): the longest prefix P, response S and largest group G. A
batch past it on any axis is checked again, so a kernel path that only long prompts or large groups take (another
flash tile, a varlen split) is covered when training first reaches it.
Fallback: a model's own `flash` / `flex` backend that raises or fails is dropped with one warning line and the check
runs again on `sdpa`, which the model keeps (`GroupingState.backend`); `choice` holds (backend, why) for the caller
to record. Mode "on" stops only when sdpa fails too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
import transformers

from mmpg.grouping import probes, sequence
from mmpg.grouping.backends import compute_dtype, resolve_backend
from mmpg.grouping.bounds import LEAK_BOUND, bound_for, gradient_bound, precise_bound
from mmpg.grouping.inputs import completion_visuals_per_row, pad_token_id, select_prompts
from mmpg.grouping.logprobs import grouped_forward, grouped_logprobs, repeated_logprobs
from mmpg.grouping.patch import base_model, grouping_state, set_grouping_options
from mmpg.grouping.precise import float32_compute

log = logging.getLogger("mmpg.grouping")

MODES = ("on", "warn", "off")
FALLBACK = "sdpa"


class SelfCheckError(RuntimeError):
    """The grouped forward disagreed with the repeated one beyond the dtype's bound (one line: figure, versions)."""


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
    the engine bound). `choice`: (backend, why) after a grouped-forward check, `why` naming a fallback."""

    def __init__(self, mode: str = "on", what: str = "grouped forward", precise: bool = True):
        if mode not in MODES:
            raise ValueError(f"self-check mode {mode!r}; choose one of {', '.join(MODES)}")
        self.mode, self.what, self.precise = mode, what, precise
        self.envelopes: dict[tuple[str, torch.dtype], Envelope] = {}
        self.choice: tuple[str, str] | None = None
        self.failure = ""  # the last check's failure line ("" when it passed), for the caller to record

    def key(self, model, backend: str | None = None) -> tuple[str, torch.dtype]:
        device = model.get_input_embeddings().weight.device
        dtype = compute_dtype(model, device)
        return resolve_backend(backend or grouping_state(model).backend, device, dtype), dtype

    def needed(self, model, dims: tuple[int, int, int], backend: str | None = None) -> bool:
        """Whether a group of `dims` (P, S, G) lies outside what was checked for this backend and dtype."""
        if self.mode == "off":
            return False
        env = self.envelopes.get(self.key(model, backend))
        return env is None or not env.covers(dims)

    def _logprob_figures(self, model, key, args, kwargs, candidate, reduce_max, named: bool, leak: bool,
                         own_mask=None) -> Figures:
        """The no-grad comparison (and the leak probe): an exception in a grouped forward that may fall back (not
        `named`, not sdpa) counts as an infinite difference (every rank still joins `reduce_max`), its first line kept.
        """
        figures = Figures()
        try:
            with torch.no_grad():
                if candidate is not None:
                    bound = bound_for(model, key[1])
                    reference = repeated_logprobs(*args, temperature=kwargs["temperature"],
                                                  completion_visuals=kwargs["completion_visuals"])
                    figures.add("logprobs", _masked_max(candidate, reference, args[3] if own_mask is None else
                                                        own_mask), bound)
                    return figures.reduced(reduce_max)
                precise = self.precise
                bound, kernel = precise_bound(model, key[0], key[1]) if precise else (bound_for(model, key[1]), None)
                device = model.get_input_embeddings().weight.device
                scope = float32_compute(base_model(model), kernel) if precise else contextlib.nullcontext()
                with torch.autocast(device.type, enabled=False) if precise else contextlib.nullcontext(), scope:
                    result = grouped_forward(*args, backend=key[0], **kwargs)
                    grouped, figures.shared_prompts = result.logprobs, result.shared_prompts
                    reference = repeated_logprobs(*args, temperature=kwargs["temperature"],
                                                  completion_visuals=kwargs["completion_visuals"])
                    figures.add("logprobs", _masked_max(grouped, reference, args[3]), bound)
                    if leak:
                        def again(ids):
                            return grouped_logprobs(args[0], args[1], ids, *args[3:], backend=key[0], **kwargs)
                        figures.add("leak", probes.leak_probe(model, again, args[1], *args[2:], grouped)[0], LEAK_BOUND)
        except Exception as err:  # noqa: BLE001 - a kernel that raises is a failed check (and maybe a fallback)
            if candidate is not None or named or key[0] == FALLBACK:
                raise
            figures.failed(err, precise_bound(model, key[0], key[1])[0], ["logprobs"] + (["leak"] if leak else []))
        return figures.reduced(reduce_max)

    def _gradient_figures(self, model, key, args, kwargs, reduce_max, named: bool) -> Figures:
        """The comparison with autograd recording: the logprobs of a forward with grad, and the probes' gradients
        (`mmpg.grouping.probes`), grouped (the whole micro-batch) against repeated (one row at a time; every rank
        runs as many rows as the rank with most, ZeRO-3 gathers in lockstep). In the run's dtype, at the probe's
        temperature (`probes.PROBE_TEMPERATURE`: a model sure of its tokens would make the comparison one of rounding)."""
        model_, prompt_inputs, ids, mask, sizes = args
        kwargs = dict(kwargs, temperature=probes.PROBE_TEMPERATURE)
        figures = Figures()
        chosen = probes.end_rows(sizes)  # the loss's rows: the first and last response of every group
        weights = probes.loss_weights(mask, chosen)
        group = grouping_state(model_).sequence_group
        sp = sequence.group_size(group)
        try:
            logp, grads = probes.probe_gradients(
                model_, lambda: grouped_logprobs(*args, backend=key[0], **kwargs), weights, group, sp)
            total = int(reduce_max(float(len(chosen)))) if reduce_max is not None else len(chosen)
            ref_logp, ref_grads = torch.zeros_like(logp), torch.zeros_like(grads)
            for n in range(total):
                i = chosen[min(n, len(chosen) - 1)]  # past this rank's rows: its last again, weight 0 (lockstep)
                b = next(b for b in range(len(sizes)) if sum(sizes[:b + 1]) > i)
                one = select_prompts(model_, prompt_inputs, [b], pad_token_id(model_))
                clips = kwargs["completion_visuals"]
                row_logp, row_grads = probes.probe_gradients(
                    model_, lambda: repeated_logprobs(model_, one, ids[i:i + 1], mask[i:i + 1], [1],
                                                      temperature=kwargs["temperature"],
                                                      completion_visuals=[clips[i]] if clips else None),
                    weights[i:i + 1] * (1.0 if n < len(chosen) else 0.0))
                if n < len(chosen):
                    ref_logp[i] = row_logp[0].to(ref_logp.device)
                    ref_grads += row_grads.to(ref_grads.device)
        except Exception as err:  # noqa: BLE001 - as in `_logprob_figures`
            if named or key[0] == FALLBACK:
                raise
            figures.failed(err, bound_for(model, key[1]), ["logprobs_with_grad", "gradients"])
            return figures.reduced(reduce_max)
        rows = torch.zeros_like(mask)
        rows[chosen] = 1
        # at the probe's temperature a logit error e moves a logprob by about e / T: scaled back, the figure is in
        # the units of the no-grad one (the run's temperature 1) and takes its bound
        figures.add("logprobs_with_grad", probes.PROBE_TEMPERATURE * _masked_max(logp, ref_logp, mask * rows),
                    bound_for(model, key[1]))
        figures.add("gradients", probes.relative_difference(grads, ref_grads), gradient_bound(model, key[1]))
        return figures.reduced(reduce_max)

    def _measure(self, model, key, args, kwargs, candidate, reduce_max, named: bool, gradients: bool,
                 own_mask=None) -> Figures:
        figures = self._logprob_figures(model, key, args, kwargs, candidate, reduce_max, named, leak=gradients,
                                        own_mask=own_mask)
        if gradients and candidate is None:
            figures.extend(self._gradient_figures(model, key, args, kwargs, reduce_max, named))
        return figures

    def run(self, model, prompt_inputs, completion_ids, completion_mask, group_sizes, *, temperature: float = 1.0,
            chunk_size: int = 2048, candidate: torch.Tensor | None = None, backend: str | None = None,
            reduce_max=None, share: bool = True, gradients: bool = False, completion_visuals=None,
            own_mask=None) -> dict:
        """Compare on real groups (or a few), no gradient; grow the envelope. `candidate` [N, S]: logprobs to
        check instead of the grouped forward's (an engine's). `reduce_max(float) -> float`: the max over ranks (all
        ranks call `run` together under ZeRO-3). `share`: as `grouped_logprobs` (the path the caller's forward takes).
        `gradients`: also the training check: the leak probe, and the logprobs and probe gradients of a forward with
        autograd recording (module docstring; a trainer passes its step's first micro-batch).
        `completion_visuals`: as `grouped_forward`'s (a trajectory tree: the clips inside the responses); `own_mask`
        [N, S]: where a `candidate` has logprobs of its own (the model's turns, not the tool's), default the mask.
        The model's own flash / flex backend (`backend` None) that fails falls back to sdpa (module docstring); one
        asked for by name is checked as it is. Returns the check/* metrics; raises
        `SelfCheckError` in mode "on"."""
        key = self.key(model, backend)
        args = (model, prompt_inputs, completion_ids, completion_mask, group_sizes)
        if completion_visuals is not None:  # one dict per row, so that a row's reference takes its own clips
            completion_visuals = completion_visuals_per_row(model, completion_ids, completion_mask,
                                                            completion_visuals)
        kwargs = {"temperature": temperature, "chunk_size": chunk_size, "share": share,
                  "completion_visuals": completion_visuals}
        named = backend is not None
        figures = self._measure(model, key, args, kwargs, candidate, reduce_max, named, gradients, own_mask)
        why = ""
        if candidate is None and backend is None and key[0] != FALLBACK and not figures.ok:
            dtype = str(key[1]).removeprefix("torch.")
            why = f"{key[0]} {figures.failure(short=True)} in the self-check ({dtype}, {versions()})"
            log.warning("self-check: grouped backend %s; falling back to %s", why, FALLBACK)
            set_grouping_options(model, backend=FALLBACK)
            key = self.key(model, FALLBACK)
            figures = self._measure(model, key, args, kwargs, candidate, reduce_max, named, gradients)
        if candidate is None:
            self.choice = (key[0], why or (self.choice[1] if self.choice and self.choice[0] == key[0] else ""))
        return self._verdict(key, figures, prompt_inputs, completion_mask, group_sizes)

    def _verdict(self, key, figures: Figures, prompt_inputs, completion_mask, group_sizes) -> dict:
        dims = batch_dims(prompt_inputs, completion_mask, group_sizes)
        env = self.envelopes.setdefault(key, Envelope())
        env.grow(dims)
        diff, bound = figures.get("logprobs")
        metrics = {"check/grouped_vs_repeated_max": diff, "check/bound": bound, "check/prefix_max": env.prefix,
                   "check/response_max": env.response, "check/group_max": env.group,
                   "check/shared_prompts": figures.shared_prompts}
        for name, metric in (("leak", "leak_max"), ("logprobs_with_grad", "with_grad_max"),
                             ("gradients", "gradient_rel_max")):
            if name in figures.items:
                metrics[f"check/{metric}"], metrics[f"check/{metric.rsplit('_', 1)[0]}_bound"] = figures.get(name)
        dtype = str(key[1]).removeprefix("torch.")
        self.failure = ""
        if not figures.ok:
            line = (f"self-check: the {self.what} {figures.failure(dtype)} on {len(group_sizes)} group(s) of "
                    f"P<={dims[0]} S<={dims[1]} G<={dims[2]}, backend {key[0]}, {versions()}: training on it would use "
                    "wrong gradients; report it, or try another backend / transformers release")
            self.failure = line
            if self.mode == "on":
                raise SelfCheckError(line + " (algorithm.self_check=warn goes on anyway)")
            log.warning("%s", line)
        else:
            log.info("self-check passed: %s vs repeated forward %s (P<=%d, S<=%d, G<=%d, %s, %s)", self.what,
                     figures.summary(), env.prefix, env.response, env.group, key[0], dtype)
        return metrics


def _masked_max(candidate: torch.Tensor, reference: torch.Tensor, mask: torch.Tensor) -> float:
    """max |candidate - reference| over the response tokens (`mask` [N, S])."""
    keep = mask.to(reference.device).bool()
    return float((candidate.to(reference.device) - reference).abs().masked_fill(~keep, 0).max())


# What each figure says when it fails (`Figures.failure`).
FAILURES = {
    "logprobs": ("differs from the repeated forward by {diff:.3g} (max |logprob difference|, bound {bound:.3g} for "
                 "{dtype})"),
    "leak": ("leaks between responses: changing some responses moved the logprobs that cannot see them by {diff:.3g} "
             "(bound {bound:.3g}: a masked token adds an exact zero)"),
    "logprobs_with_grad": ("differs from the repeated forward by {diff:.3g} while autograd records (max |logprob "
                           "difference|, bound {bound:.3g} for {dtype})"),
    "gradients": ("has gradients {diff:.3g} off the repeated forward's (max relative difference of the layer-input "
                  "gradients, bound {bound:.3g} for {dtype})"),
}
# ... and in the one line of a fallback
SHORT = {"logprobs": "differs", "leak": "leaks (probe)", "logprobs_with_grad": "differs with autograd recording",
         "gradients": "has gradients off"}


class Figures:
    """The check's figures: name -> (max difference, bound), in the order measured; `error` when a kernel raised."""

    def __init__(self):
        self.items: dict[str, tuple[float, float]] = {}
        self.error = ""
        self.shared_prompts = 0  # prompts the checked grouped forward packed behind another's shared part

    def add(self, name: str, diff: float, bound: float) -> None:
        self.items[name] = (float(diff), float(bound))

    def get(self, name: str) -> tuple[float, float]:
        return self.items.get(name, (float("inf"), 0.0))

    def extend(self, other: "Figures") -> None:
        self.items.update(other.items)
        self.error = self.error or other.error
        self.shared_prompts = max(self.shared_prompts, other.shared_prompts)

    def failed(self, err: Exception, bound: float, names: list[str]) -> None:
        """A kernel raised: every figure of `names` is infinite (so every rank reduces the same names in order)."""
        self.error = f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}"
        self.items = {name: (float("inf"), self.items.get(name, (0.0, bound))[1]) for name in names}

    def reduced(self, reduce_max) -> "Figures":
        """The max over ranks of every figure (all ranks call this with the same names in the same order)."""
        if reduce_max is not None:
            for name, (diff, bound) in list(self.items.items()):
                self.items[name] = (float(reduce_max(diff)), bound)
        return self

    @property
    def ok(self) -> bool:
        return not self.error and all(diff <= bound for diff, bound in self.items.values())  # NaN fails too

    def failure(self, dtype: str = "", short: bool = False) -> str:
        if self.error:
            return f"raised {self.error}"
        name, (diff, bound) = next((n, v) for n, v in self.items.items() if not v[0] <= v[1])
        if short:
            return f"{SHORT[name]} by {diff:.3g} > bound {bound:.3g}"
        return FAILURES[name].format(diff=diff, bound=bound, dtype=dtype)

    def summary(self) -> str:
        return ", ".join(f"{name} {diff:.3g} <= {bound:.3g}" for name, (diff, bound) in self.items.items())
