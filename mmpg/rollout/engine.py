"""The rollout engine interface: B prompts in, G_b sampled responses per prompt out, laid out for `grouped_logprobs`.

    engine.generate_groups(prompt_inputs, group_size, SamplingParams(...)) -> Rollout

`prompt_inputs` is the processor output for the B prompts (as `grouped_logprobs` takes it); `group_size` is one int for
every prompt or a list of B ints. The `Rollout` holds N = sum(G_b) responses, the rows of prompt b contiguous and in
prompt order, so `grouped_logprobs(model, prompt_inputs, r.completion_ids, r.completion_mask, r.group_sizes)` scores
exactly what was sampled. Engines: `mmpg.rollout.hf.HFEngine` (the training model itself, each prompt prefilled once);
a vLLM engine can implement the same method later.
"""

from __future__ import annotations

import abc
import dataclasses
import numbers
from collections.abc import Sequence

import torch

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
    reproducible for a fixed `SamplingParams.seed`, and leave the caller's model state (train/eval mode) unchanged."""

    @abc.abstractmethod
    def generate_groups(self, prompt_inputs, group_size: int | Sequence[int],
                        sampling: SamplingParams) -> Rollout:
        """prompt_inputs: processor output for B >= 1 prompts (left or right padded); group_size: int or B ints."""


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
