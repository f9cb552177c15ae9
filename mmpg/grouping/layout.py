"""The packed group layout: where each prefix and response sits in one padding-free row.

For B prompts with prefix lengths P_b and responses of lengths S_b1..S_bG_b, the packed row is

    [ prefix_0 | r_0,1 | ... | r_0,G0 | prefix_1 | r_1,1 | ... ]        T = sum_b (P_b + sum_g S_bg) tokens

Attention rule (what every backend computes):
    prefix token  -> earlier tokens of its own prefix (causal)
    response token -> the whole prefix of its group + earlier tokens of its own response

`GroupLayout` holds this as index tensors, built once per grouped forward and shared by every layer (and by the
recomputation under gradient checkpointing, since it travels in the layer's kwargs). Its tensors live on one device;
a model spread over several devices (`device_map`) gets one copy per device through `for_device`, so a kernel is
never handed an index or cu_seqlens tensor on another device than its q/k/v.
"""

from __future__ import annotations

import dataclasses
from functools import cached_property

import torch


@dataclasses.dataclass(eq=False)
class GroupLayout:
    """Positions of prefixes and responses in the packed row. Lengths are Python ints (known before the forward)."""

    prefix_lens: list[int]  # [B]
    response_lens: list[list[int]]  # [B][G_b], every entry >= 1
    device: torch.device
    backend: str = "sdpa"
    # keys the grouped forward handed to the model's forward for the model to consume (the visual inputs):
    # the grouped attention raises if one arrives in its kwargs (the model ignored it; `mmpg.grouping.attention`)
    model_inputs: tuple[str, ...] = ()
    # [B][G_b] leading tokens of each row that are inputs, not scored: a shared video's per-query tail
    # (`mmpg.grouping.shares`); None = every row token is a response token
    row_skip: list[list[int]] | None = None
    # the row spread over a sequence-parallel group (`mmpg.grouping.sequence.SequenceShard`): attention runs as
    # Ulysses (`mmpg.grouping.ulysses`) on the whole row for this rank's heads; None: the whole row is here
    sequence: object | None = None
    # deterministic attention backward where the backend has a choice (flash-attn's `deterministic=`; the model's
    # `GroupingState.deterministic`, set by `apply_grouped_attention`)
    deterministic: bool = False
    # the dtype the attention kernel runs in when the rest computes in float32 (`mmpg.grouping.precise`); None: q/k/v's
    kernel_dtype: torch.dtype | None = None

    def __post_init__(self):
        self.device = torch.device(self.device)
        if len(self.prefix_lens) != len(self.response_lens):
            raise ValueError(f"{len(self.prefix_lens)} prefixes but {len(self.response_lens)} response groups")
        starts, pos = [], 0
        for p, lens in zip(self.prefix_lens, self.response_lens):
            if p < 1 or not lens or min(lens) < 1:
                raise ValueError(f"every prefix and response needs >= 1 token (prefix {p}, responses {lens})")
            starts.append(pos)
            pos += p + sum(lens)
        self.group_starts: list[int] = starts  # [B] offset of prefix b in the row
        self.total: int = pos  # T

    # ---- spans, as Python ints ------------------------------------------------------------------------------------
    def prefix_span(self, b: int) -> tuple[int, int]:
        s = self.group_starts[b]
        return s, s + self.prefix_lens[b]

    def responses_span(self, b: int) -> tuple[int, int]:
        """All responses of group b, contiguous right after its prefix."""
        s = self.group_starts[b] + self.prefix_lens[b]
        return s, s + sum(self.response_lens[b])

    def for_device(self, device: torch.device) -> GroupLayout:
        """This layout with its tensors on `device` (itself when it is there already); built once per device."""
        device = torch.device(device)
        if device == self.device:
            return self
        copies = self.__dict__.setdefault("_per_device", {})
        if device not in copies:
            copies[device] = dataclasses.replace(self, device=device)
        return copies[device]

    @property
    def num_groups(self) -> int:
        return len(self.prefix_lens)

    @property
    def flat_response_lens(self) -> list[int]:
        return [s for lens in self.response_lens for s in lens]

    # ---- index tensors, built lazily and cached (one layout per forward) --------------------------------------------
    def _arange(self, spans):
        idx = [torch.arange(a, b) for a, b in spans]
        return torch.cat(idx).to(self.device) if idx else torch.zeros(0, dtype=torch.long, device=self.device)

    @cached_property
    def prefix_index(self) -> torch.Tensor:
        """[sum P_b] row positions of all prefix tokens, group by group."""
        return self._arange(self.prefix_span(b) for b in range(self.num_groups))

    @cached_property
    def response_index(self) -> torch.Tensor:
        """[sum S] row positions of all response tokens, group by group, response by response."""
        return self._arange(self.responses_span(b) for b in range(self.num_groups))

    def _skips(self, b: int) -> list[int]:
        return self.row_skip[b] if self.row_skip is not None else [0] * len(self.response_lens[b])

    @cached_property
    def target_index(self) -> torch.Tensor:
        """[sum scored] row positions of the scored tokens: every response token, past each row's skipped tail."""
        out = []
        for b in range(self.num_groups):
            start = self.responses_span(b)[0]
            for s, k in zip(self.response_lens[b], self._skips(b)):
                out.append(torch.arange(start + k, start + s))
                start += s
        return torch.cat(out).to(self.device) if out else torch.zeros(0, dtype=torch.long, device=self.device)

    @cached_property
    def predictor_index(self) -> torch.Tensor:
        """[sum scored] row position whose hidden state predicts each scored token (`target_index`).

        Token t of a row is predicted at t-1 of the same row; a row's token 0 (no tail) at the last prefix token."""
        out = []
        for b in range(self.num_groups):
            last_prefix = self.prefix_span(b)[1] - 1
            start = self.responses_span(b)[0]
            for s, k in zip(self.response_lens[b], self._skips(b)):
                if k == 0:
                    out.append(torch.tensor([last_prefix]))
                    out.append(torch.arange(start, start + s - 1))
                else:
                    out.append(torch.arange(start + k - 1, start + s - 1))
                start += s
        return torch.cat(out).to(self.device)

    @cached_property
    def response_segment_ids(self) -> list[torch.Tensor]:
        """Per group: [R_b] index of the response (0..G_b-1) each of its response tokens belongs to."""
        return [
            torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens)).to(self.device)
            for lens in self.response_lens
        ]

    def cu_seqlens(self, kind: str) -> tuple[torch.Tensor, int]:
        """Cumulative lengths (int32, as FlashAttention's varlen functions take them) and the max length, built once.

        kind: "prefix" (one segment per prefix), "group_responses" (all responses of a group as one query segment),
        "response" (one segment per response)."""
        cache = self.__dict__.setdefault("_cu_seqlens_cache", {})
        if kind not in cache:
            cache[kind] = self._cu_seqlens(kind)
        return cache[kind]

    def _cu_seqlens(self, kind: str) -> tuple[torch.Tensor, int]:
        lens = {
            "prefix": self.prefix_lens,
            "group_responses": [sum(lens) for lens in self.response_lens],
            "response": self.flat_response_lens,
        }[kind]
        cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int32), 0)
        return cu.to(self.device), max(lens)

    def token_labels(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[T] group id of every token, and [T] global response id (-1 for prefix tokens)."""
        group = torch.empty(self.total, dtype=torch.int32)
        resp = torch.full((self.total,), -1, dtype=torch.int32)
        rid = 0
        for b in range(self.num_groups):
            start, end = self.responses_span(b)
            group[self.prefix_span(b)[0]:end] = b
            for s in self.response_lens[b]:
                resp[start:start + s] = rid
                rid += 1
                start += s
        return group.to(self.device), resp.to(self.device)

    def dense_mask(self) -> torch.Tensor:
        """[T, T] bool, True where attention is allowed. Tests use this rule; backends never build it (it is
        quadratic in the packed length)."""
        group, resp = self.token_labels()
        i = torch.arange(self.total, device=group.device)
        causal = i[None, :] <= i[:, None]
        same_group = group[None, :] == group[:, None]
        visible_key = (resp[None, :] == -1) | (resp[None, :] == resp[:, None])
        return causal & same_group & visible_key


def pick_rows(hidden: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """hidden[index] ([n, H] of [T, H]), whose backward is the same in every run. `index` names a row more than once
    (the last prefix token predicts the first token of each of its G responses), so the backward adds several
    gradients into one row: on a CPU the backward of `hidden[index]` (`index_put_` with accumulate) adds them with
    atomic adds from all threads in whatever order they come, and two runs of one seed part by ~1e-7; `index_select`'s
    (`index_add_`) adds them in index order. On CUDA it is the other way round (torch's notes on reproducibility)."""
    return hidden.index_select(0, index) if hidden.device.type == "cpu" else hidden[index]
