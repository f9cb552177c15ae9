"""The rollout engine interface: B prompts in, G_b sampled responses per prompt out, laid out for `grouped_logprobs`.

    engine.generate_groups(prompt_inputs, group_size, SamplingParams(...), prompt_seeds=..., videos=...) -> Rollout

`prompt_inputs` is the processor output for the B prompts (as `grouped_logprobs` takes it); `group_size` is one int for
every prompt or a list of B ints. The `Rollout` holds N = sum(G_b) responses, the rows of prompt b contiguous and in
prompt order, so `grouped_logprobs(model, prompt_inputs, r.completion_ids, r.completion_mask, r.group_sizes)` scores
exactly what was sampled. Engines: `mmpg.rollout.hf.HFEngine` (the training model itself, each prompt prefilled once)
and `mmpg.rollout.vllm.VLLMEngine` (a vLLM server with its own copy of the weights); `mmpg.rollout.build` makes the one
a config names.

What a trainer asks of an engine besides sampling is on `RolloutEngine` too, in the form an engine that samples with
the policy itself needs (the HF engine's: nothing to send, no length limit, no errors of a user's making, no overlap);
an engine that samples elsewhere overrides them. The trainer never asks which engine it holds.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import numbers
from collections.abc import Sequence

import torch

from mmpg.errors import UserError

FINISH_STOP = "stop"  # the row ended with a stop token (included in the completion, mask 1)
FINISH_LENGTH = "length"  # the row reached max_new_tokens without a stop token


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How responses are sampled. Checked on construction; a bad value raises a ValueError naming the field."""

    max_new_tokens: int = 256  # most tokens per response, the stop token included
    temperature: float = 1.0  # logits are divided by it; 0 means greedy (argmax of the raw logits)
    top_p: float = 1.0  # nucleus filter on the tempered distribution; 1 = off
    top_k: int = 0  # keep the k most likely tokens; 0 = off
    seed: int = 0  # seeds the torch.Generator that drives all sampling: same seed, inputs and model -> same tokens
    stop_token_ids: tuple[int, ...] | None = None  # None: the model's generation_config eos ids (<|im_end|> for Qwen)
    logprobs: bool = True  # also return the policy logprob of every sampled token (see mmpg.rollout.sampling)

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if self.stop_token_ids is not None:
            object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclasses.dataclass
class Rollout:
    """N = sum(group_sizes) responses; rows of prompt b contiguous and in prompt order."""

    completion_ids: torch.Tensor  # [N, S] long, right-padded with the pad id; S = the longest response
    completion_mask: torch.Tensor  # [N, S] long, 1 on each row's tokens (stop token included), then 0
    group_sizes: list[int]  # [B]
    texts: list[str]  # [N] decoded responses, special tokens skipped
    finish_reasons: list[str]  # [N] FINISH_STOP or FINISH_LENGTH
    logprobs: torch.Tensor | None = None  # [N, S] float32 policy logprobs under the temperature, 0 outside the mask

    @property
    def num_prompts(self) -> int:
        return len(self.group_sizes)

    @property
    def lengths(self) -> list[int]:
        """[N] tokens per response."""
        return self.completion_mask.sum(dim=1).tolist()

    @property
    def prompt_index(self) -> torch.Tensor:
        """[N] the prompt (0..B-1) each row answers."""
        return torch.repeat_interleave(torch.arange(len(self.group_sizes)), torch.tensor(self.group_sizes))


class RolloutEngine(abc.ABC):
    """Samples groups of responses. Implementations must return rows laid out as `Rollout` documents, be
    reproducible for a fixed `SamplingParams.seed` (or `prompt_seeds`), and leave the caller's model state (train/eval
    mode) unchanged. The members below `generate_groups` have the forms of an engine that samples with the trainer's
    policy itself; an engine with its own copy of the weights (a server) overrides them."""

    # what the last generate_groups call prefilled (`HFEngine.last_stats`: prompts, prefixes, prefix_tokens,
    # shared_prompts); None: the engine does not say (`mmpg.models.vision_calls.prefill_tokens` counts every prompt)
    last_stats: dict | None = None
    # prompt + response tokens the engine can hold; None: no limit of its own (the policy's memory is the limit).
    # A trainer leaves longer prompts out of its batches (`mmpg.rl.too_long`)
    max_model_len: int | None = None
    # () -> a context manager around forwards the engine runs that are not the rollout's own (the HF engine's decode
    # check): a caller that counts the policy's forwards pauses its counters there
    check_scope = contextlib.nullcontext
    # True: the engine samples with the trainer's policy itself, so an update reaches it without `sync_weights`
    samples_with_policy = True

    @abc.abstractmethod
    def generate_groups(self, prompt_inputs, group_size: int | Sequence[int], sampling: SamplingParams | None = None,
                        *, prompt_seeds: Sequence[int] | None = None, videos: Sequence | None = None) -> Rollout:
        """prompt_inputs: processor output for B >= 1 prompts (left or right padded); group_size: int or B ints;
        sampling: None for `SamplingParams()`. prompt_seeds: optional B ints; then prompt b's responses depend only
        on prompt_seeds[b], not on the other prompts of the batch. videos: the B prompts' decoded videos
        (`DecodedVideo`, None for a text-only prompt), for an engine that needs the frames themselves; an engine
        that reads the video from `prompt_inputs` ignores them."""

    def sync_weights(self) -> dict:
        """After each update, on every rank: give the engine the policy's new weights. Returns what was sent
        ({"tensors", "bytes", "seconds", "server_seconds"}; {} where nothing was). Here: nothing to send."""
        return {}

    def overlap_updates(self) -> None:
        """Get ready to sample (from another thread) while the trainer updates the policy (`rollout.max_staleness`
        >= 1). An engine that samples with the policy itself cannot: the policy is mid-update then."""
        raise UserError(f"{type(self).__name__} samples with the trainer's own model, so rollouts cannot overlap the "
                        "update (rollout.max_staleness >= 1 needs rollout.engine=vllm); use rollout.max_staleness=0")

    def user_error(self, error: Exception, prompts: Sequence[str] | None = None) -> str | None:
        """The one-line message for an `error` that `generate_groups` or `sync_weights` raised, when its cause is
        the user's to fix (a server gone or refusing, a prompt it cannot hold), naming the prompt at fault by
        `prompts` ([B] names, e.g. each sample's file:line); None when it is not (a bug: raise it as it is). Here
        every error is a bug."""
        return None


def group_sizes_for(group_size: int | Sequence[int], num_prompts: int) -> list[int]:
    """Normalize `group_size` (one int, or one per prompt) to a list of B ints >= 1, or raise a ValueError."""
    if num_prompts < 1:
        raise ValueError("the prompt batch is empty; generate_groups needs at least one prompt")
    sizes = [group_size] * num_prompts if isinstance(group_size, numbers.Integral) else list(group_size)
    if len(sizes) != num_prompts:
        raise ValueError(f"{len(sizes)} group sizes for {num_prompts} prompts; give one int or one per prompt")
    for b, g in enumerate(sizes):
        if isinstance(g, bool) or not isinstance(g, numbers.Integral) or g < 1:
            raise ValueError(f"group size of prompt {b} is {g!r}; every prompt needs an int >= 1 (responses)")
    return [int(g) for g in sizes]
