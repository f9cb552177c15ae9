"""Greedy answers for grounding samples with the shared-prefix engine (one response per prompt, temperature 0).

    predict(model, processor, samples, spec, template, batch_size=8, max_new_tokens=256) -> [Prediction]

Videos are decoded in the calling process (this is for held-out sets of tens to hundreds of samples during
training; `mmpg eval` shards larger sets over ranks). An unusable video gives a Prediction with `error` set.
"""

from __future__ import annotations

import dataclasses

from mmpg.data.dataset import GroundingCollator, GroundingDataset
from mmpg.rewards import parse_answer
from mmpg.rollout import HFEngine, SamplingParams


@dataclasses.dataclass
class Prediction:
    sample_id: str
    text: str  # the decoded answer ("" when the video could not be used)
    span: tuple[float, float] | None  # parsed [start, end] seconds, None when unparseable
    truth: tuple[float, float]
    error: str | None = None  # why the sample could not be evaluated


def predict(model, processor, samples, spec, template=None, batch_size: int = 8, max_new_tokens: int = 256,
            all_done=None) -> list[Prediction]:
    dataset = GroundingDataset(samples, spec, strict=False)
    collate = GroundingCollator(processor, template)
    engine = HFEngine(model, processor, all_done=all_done)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.0)
    out: list[Prediction] = []
    for start in range(0, len(samples), batch_size):
        items = [dataset[i] for i in range(start, min(len(samples), start + batch_size))]
        batch = collate(items)
        for it in items:
            if not it.ok:
                out.append(Prediction(it.sample.sample_id, "", None, tuple(it.sample.span), it.error))
        if len(batch) == 0:
            continue
        rollout = engine.generate_groups(batch.inputs, 1, sampling)
        for sample, text in zip(batch.samples, rollout.texts):
            parsed = parse_answer(text, sample.duration)
            out.append(Prediction(sample.sample_id, text, parsed.span if parsed.ok else None, tuple(sample.span)))
    return out
