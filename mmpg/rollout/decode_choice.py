"""Which decode path the HF engine takes, checked where it runs: the cascade kernels against copy decoding.

The chain (`kernel_chain`), fastest first, each tried until one passes the check:

    rollout.decode=auto|cascade, cascade_backend=auto:  CUDA  flash (flash-attn with its LSE, when usable and the
                                                              model is fp16/bf16) -> sdpa -> math -> copy
                                                        CPU   sdpa (torch's CPU flash kernel) -> math -> copy
    cascade_backend=flash|sdpa|math:                    that kernel -> copy
    rollout.decode=copy:                                copy (nothing to check)

The check (`DecodeChoice._check_current`) greedily decodes the batch's longest and shortest prompt with G_max rows
each for `STEPS` tokens, by the candidate and by copy decoding, and passes when the tokens agree (a tie within the
bound counts as agreement) and max |logprob difference| <= the dtype's bound (`mmpg.grouping.bounds.bound_for`);
a kernel that raises fails. It runs on the first batch and again only when a batch's longest prompt or largest group
goes past what was checked (an `Envelope`); a kernel that fails is dropped with one warning line (kernel, figure,
versions) and the next is checked at once; every choice is recorded (`mmpg.choices.record("decode_kernel", ...)`).
rollout.decode_check: auto (on for CUDA, off on the CPU, where the kernels are tested), on, off. Synced decoding
(ZeRO-3) decides by vote: a rank checks when any rank needs to, until every rank's kernel passed.
"""

from __future__ import annotations

import logging

import torch

from mmpg import choices
from mmpg.grouping.inputs import prompt_attention_mask
from mmpg.grouping.bounds import bound_for
from mmpg.grouping.selfcheck import Envelope, versions
from mmpg.rollout.cascade_kernels import CASCADE_KERNELS

log = logging.getLogger("mmpg.rollout")

CHECK_MODES = ("auto", "on", "off")
STEPS = 4  # greedy tokens the check decodes per row
COPY = "copy"


def flash_usable(device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Whether flash-attn can run the cascade kernel here: (usable, reason)."""
    if dtype not in (torch.float16, torch.bfloat16):
        return False, f"flash-attn has no {str(dtype).removeprefix('torch.')} kernels"
    from mmpg.grouping.backends.probe import flash_status

    return flash_status(device)


def kernel_chain(decode: str, backend: str, device: torch.device, dtype: torch.dtype) -> list[str]:
    """The candidates in order (module docstring), ending with "copy"."""
    if decode == COPY:
        return [COPY]
    if backend != "auto":
        return [backend, COPY]
    if device.type == "cpu":
        return ["sdpa", "math", COPY]
    fast = ["flash"] if flash_usable(device, dtype)[0] else []
    return fast + ["sdpa", "math", COPY]


def check_enabled(mode: str, device: torch.device) -> bool:
    if mode not in CHECK_MODES:
        raise ValueError(f"decode_check={mode!r}; choose one of {', '.join(CHECK_MODES)}")
    return mode == "on" or (mode == "auto" and device.type == "cuda")


def compare(reference, candidate, bound: float) -> tuple[bool, float, str]:
    """Two greedy rollouts of the same rows (logprobs on) -> (agree, max |logprob difference|, what differed)."""
    ids_a, ids_b = reference.completion_ids, candidate.completion_ids
    lp_a, lp_b = reference.logprobs, candidate.logprobs
    diff = (lp_a - lp_b).abs()  # [n, STEPS]
    worst = 0.0
    for i in range(ids_a.shape[0]):
        differ = (ids_a[i] != ids_b[i]).nonzero()
        upto = int(differ[0]) + 1 if differ.numel() else ids_a.shape[1]  # the differing step is compared too
        row = float(diff[i, :upto].max()) if upto else 0.0
        if not row <= worst:  # NaN wins
            worst = row
        if differ.numel() and not row <= bound:
            t = int(differ[0])
            return False, row, f"row {i} token {t}: {int(ids_b[i, t])} instead of {int(ids_a[i, t])}"
    return bool(worst <= bound), worst, ""


class DecodeChoice:
    """The engine's current decode path and what has been checked for it (module docstring)."""

    def __init__(self, decode: str, backend: str, check: str):
        if backend not in CASCADE_KERNELS:
            raise ValueError(f"unknown cascade attention backend {backend!r}; choose one of "
                             f"{', '.join(CASCADE_KERNELS)}")
        check_enabled(check, torch.device("cpu"))  # checks the name
        self.decode, self.backend, self.check = decode, backend, check
        self.chain: list[str] | None = None  # candidates left, the current one first
        self.envelope = Envelope()  # (longest prompt, G_max, 0) checked for the current kernel

    @property
    def current(self) -> str:
        return self.chain[0]

    def choose(self, engine, prompt_inputs, sizes: list[int], device: torch.device) -> str:
        """The path for this batch: a kernel name (cascade decoding) or "copy". Checks it first when needed."""
        if self.chain is None:
            self.chain = kernel_chain(self.decode, self.backend, device, _dtype(engine.model))
            why = "rollout.decode=copy" if self.decode == COPY else self._unchecked(device)
            choices.record("decode_kernel", self.current, why)
        if not check_enabled(self.check, device) or self.decode == COPY:
            return self.current
        lengths = prompt_attention_mask(prompt_inputs).sum(dim=1).tolist()  # [B] tokens of each prompt
        dims = (max(lengths), max(sizes), 0)
        need = not self.envelope.covers(dims) and self.current != COPY
        if engine.all_done is not None:
            need = not engine.all_done(not need)
        while need:
            ok = self._check_current(engine, prompt_inputs, lengths, max(sizes), engine.all_done is not None)
            if engine.all_done is not None:
                need = not engine.all_done(ok)
            else:
                need = not ok
        self.envelope.grow(dims)
        return self.current

    def _unchecked(self, device) -> str:
        return "" if check_enabled(self.check, device) else "unchecked (decode_check off)"

    def _check_current(self, engine, prompt_inputs, lengths: list[int], g_max: int, synced: bool) -> bool:
        """Check the current kernel on the batch's slice; on failure drop it (one warning line) and record the next.
        Returns whether the current kernel passed. `synced`: every rank runs the same forwards, so a rank already
        down to copy decoding runs the check's forwards too (copy against copy).

        The slice: the longest prompt and the shortest (most left padding), each with G_max rows, so the prefix block
        is as long and the folded query block (G_max · GQA ratio rows) as tall as in the batch. Both paths differ only
        in the attention's reduction order (one softmax vs parts merged by log-sum-exp), the rounding the grouped
        forward's self-check bounds (1e-4 in float32; 1.6 / 2.0 · u · layers in bf16 / fp16). A token that differs
        counts only if the two chosen tokens' logprobs differ by more than the bound (else a tie the two roundings
        broke differently; the rows are compared up to it). Cost: 2 prefills of at most 2 prompts and
        2 · (STEPS - 1) decode forwards of at most 2 · G_max rows (token 0 comes from the prefill)."""
        kernel = self.current
        if kernel == COPY and not synced:
            return True
        picks = sorted({max(range(len(lengths)), key=lengths.__getitem__),
                        min(range(len(lengths)), key=lengths.__getitem__)})
        bound = bound_for(engine.model, _dtype(engine.model))
        try:
            reference, candidate = engine.check_decode(prompt_inputs, picks, g_max, STEPS, kernel)
            ok, figure, where = compare(reference, candidate, bound)
            reason = f"max |logprob difference| {figure:.3g} vs copy decoding (bound {bound:.3g})" + \
                (f", {where}" if where else "")
        except Exception as err:  # noqa: BLE001 - any failure of an unproven kernel drops it
            ok, reason = False, f"raised {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        if ok or kernel == COPY:
            log.info("decode kernel %s passed its check (%s; prompt <= %d tokens, G <= %d)", kernel, reason,
                     max(lengths), g_max)
            return True
        self.chain.pop(0)
        self.envelope = Envelope()
        log.warning("cascade decoding: kernel %s failed its check against copy decoding (%s; %s); next: %s", kernel,
                    reason, versions(), self.current)
        choices.record("decode_kernel", self.current, f"{kernel} dropped: {reason}; {versions()}")
        return False


def _dtype(model) -> torch.dtype:
    return model.get_input_embeddings().weight.dtype
