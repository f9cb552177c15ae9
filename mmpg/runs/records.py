"""Rollout records: one `GroupRecord` per prompt per step (a line of rollouts/step_*.jsonl), holding its G responses.

    GroupRecord(step, group_index, sample_id, video, duration, query, gt_span, media_key, responses=[
        ResponseRecord(text, parsed_span, rewards={"overall": ..., "format": ..., "iou": ...}, advantage, length,
                       finish_reason),
        ... G of them ...])

NaN/inf are written as null; `from_json` reads null back as NaN in float fields (rewards, advantage, duration) so a
record keeps its types. Unknown keys are ignored (a later version 1 writer may add fields); a "v" newer than
LAYOUT_VERSION raises.
"""

from __future__ import annotations

import dataclasses
import math

from mmpg.runs.files import check_version, jsonable
from mmpg.runs.layout import LAYOUT_VERSION

FINISH_REASONS = ("stop", "length")  # as mmpg.rollout.engine.FINISH_STOP / FINISH_LENGTH


def _span(value, name: str) -> list[float] | None:
    if value is None:
        return None
    span = [_float(x) for x in jsonable(value)]
    if len(span) != 2:
        raise ValueError(f"{name} must be [start_s, end_s], got {value!r}")
    return span


def _float(value) -> float:
    return math.nan if value is None else float(value)


def _need(d: dict, keys: tuple[str, ...], what: str) -> None:
    missing = [k for k in keys if k not in d]
    if missing:
        raise ValueError(f"{what} record lacks {', '.join(missing)}: {str(d)[:200]}")


_OPTIONAL_TOKENS = ("token_ids", "logprobs", "train_logprobs", "turns")


@dataclasses.dataclass(kw_only=True)
class ResponseRecord:
    """One sampled response and how it was scored."""

    text: str  # the decoded response, special tokens skipped
    parsed_span: list[float] | None  # [start_s, end_s] in seconds parsed from the text; None if it did not parse
    rewards: dict[str, float]  # reward components by name, "overall" among them (the one advantages use)
    advantage: float  # the group-normalised advantage the loss used for every token of this response
    length: int  # response tokens, the stop token included
    finish_reason: str  # "stop" (ended with a stop token) or "length" (hit max_new_tokens)
    # logging.rollout_logprobs only (else None), one entry per response token: its ids, the sampling engine's
    # logprobs (the behaviour policy's) and the trainer's recompute before the update (pi_old), which the loss and
    # its importance weights were computed from
    token_ids: list[int] | None = None
    logprobs: list[float] | None = None
    train_logprobs: list[float] | None = None
    # multi-turn rollouts (the zoom tool) only, else None: the trajectory in order, the model's turns
    # {"model": text} and the tool's {"zoom": [start_s, end_s], "frames": n} (a clip of n frames shown) or
    # {"error": reason}; `text` is
    # the last model turn (the answer the reward read)
    turns: list[dict] | None = None

    def __post_init__(self):
        self.parsed_span = _span(self.parsed_span, "ResponseRecord.parsed_span")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(
                f"ResponseRecord.finish_reason must be one of {FINISH_REASONS}, got {self.finish_reason!r}"
            )
        self.rewards = {str(k): _float(v) for k, v in self.rewards.items()}
        self.advantage = _float(self.advantage)
        self.length = int(self.length)

    def to_json(self) -> dict:
        return jsonable(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, d: dict) -> ResponseRecord:
        keys = tuple(f.name for f in dataclasses.fields(cls))
        _need(d, tuple(k for k in keys if k not in _OPTIONAL_TOKENS), "response")
        return cls(**{k: d[k] for k in keys if k in d})


@dataclasses.dataclass(kw_only=True)
class GroupRecord:
    """One prompt of one step and its G responses (the rows of one group, in sampling order)."""

    v: int = LAYOUT_VERSION  # layout version of the record
    step: int  # training step (the optimizer step the rollouts were sampled for)
    group_index: int  # position of the prompt in the step's batch, 0..B-1 (across all ranks)
    sample_id: str  # the dataset's id of the sample
    video: str  # path of the video file, as the dataset gave it
    duration: float  # video length in seconds
    query: str  # the natural-language query to ground
    gt_span: list[float]  # [start_s, end_s] ground-truth moment in seconds
    media_key: str | None = None  # folder under media/ with thumbnails of the video; None if none were written
    # the weights that sampled the responses: those after training step policy_version (0: the initial weights);
    # staleness = step - 1 - policy_version, the updates between them and the weights trained (rollout.max_staleness).
    # None in records written before this field existed (read as synchronous).
    policy_version: int | None = None
    responses: list[ResponseRecord] = dataclasses.field(default_factory=list)  # [G]

    def __post_init__(self):
        self.step, self.group_index, self.duration = int(self.step), int(self.group_index), _float(self.duration)
        self.sample_id, self.video = str(self.sample_id), str(self.video)
        self.policy_version = None if self.policy_version is None else int(self.policy_version)
        self.gt_span = _span(self.gt_span, "GroupRecord.gt_span")
        if self.gt_span is None:
            raise ValueError("GroupRecord.gt_span must be [start_s, end_s], got None")
        self.responses = [r if isinstance(r, ResponseRecord) else ResponseRecord.from_json(r) for r in self.responses]

    @property
    def staleness(self) -> int:
        """Updates between the weights that sampled this group and those it trained (0: synchronous)."""
        return 0 if self.policy_version is None else self.step - 1 - self.policy_version

    def to_json(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "responses"}
        d["responses"] = [r.to_json() for r in self.responses]
        return jsonable(d)

    @classmethod
    def from_json(cls, d: dict) -> GroupRecord:
        check_version(d, f"rollout record of step {d.get('step')}")
        keys = tuple(f.name for f in dataclasses.fields(cls))
        _need(d, tuple(k for k in keys if k not in ("v", "media_key", "policy_version", "responses")), "group")
        kwargs = {k: d[k] for k in keys if k in d}
        kwargs["responses"] = [ResponseRecord.from_json(r) for r in d.get("responses") or []]
        return cls(**kwargs)
