"""One padding id (`mmpg.grouping.inputs.pad_token_id`): the HF engine's finished rows, the vLLM engine's rows and
the repeated forward's left padding hold the same id, whichever of generation_config, the text config and eos sets it.
And the forwards' logprobs do not depend on that id (it only fills masked positions)."""

from __future__ import annotations

import pytest
import torch

from batches import completions, processor_batch, random_video, text_batch, QUESTIONS
from mmpg.grouping import grouped_logprobs, repeated_logprobs
from mmpg.grouping.inputs import check_completions, pad_token_id
from mmpg.grouping.logprobs import _repeated_rows
from mmpg.rollout import HFEngine, SamplingParams
from mmpg.rollout.vllm import VLLMEngine

# (generation_config.pad_token_id, text config pad_token_id, generation_config.eos_token_id) -> the padding id
CASES = {
    "generation_config": ((7, 9, 11), 7),  # the generation config wins over the text config
    "text_config": ((None, 9, 11), 9),
    "eos": ((None, None, [11, 12]), 11),  # neither pad set: the first eos id, as `model.generate` pads
    "nothing": ((None, None, None), 0),  # a bare config: 0, a valid id of any vocabulary
}


def _with_ids(model, gen_pad, text_pad, eos):
    model.generation_config.pad_token_id = gen_pad
    model.config.get_text_config().pad_token_id = text_pad
    model.generation_config.eos_token_id = eos
    return model


def _hf_padding(model, tokenizer) -> torch.Tensor:
    """The ids after the end of the HF engine's rows: prompt 0's rows stop at a token prompt 1's row never emits."""
    inputs = text_batch(tokenizer, 2)
    engine = HFEngine(model, tokenizer)
    free = engine.generate_groups(inputs, 1, SamplingParams(max_new_tokens=4, temperature=0, stop_token_ids=()))
    stop = next(int(t) for t in free.completion_ids[0] if t not in free.completion_ids[1])
    out = engine.generate_groups(inputs, [2, 1], SamplingParams(max_new_tokens=4, temperature=0,
                                                                 stop_token_ids=(stop,)))
    return out.completion_ids[out.completion_mask == 0]


def _vllm_padding(model, tokenizer) -> torch.Tensor:
    """The ids after the end of the vLLM engine's rows, built from two server answers of 3 and 1 tokens."""
    engine = VLLMEngine.__new__(VLLMEngine)  # no server: only the answer -> Rollout step runs
    engine.model, engine.processor = model, tokenizer
    answers = [[{"token_ids": [5, 6, 7], "finish_reason": "stop"}], [{"token_ids": [8], "finish_reason": "length"}]]
    out = engine._rollout(answers, [1, 1], SamplingParams(logprobs=False))
    return out.completion_ids[out.completion_mask == 0]


def _forward_padding(model, tokenizer) -> torch.Tensor:
    """The ids left of the rows the repeated forward builds (prompt + completion, left-padded to the longest)."""
    inputs = text_batch(tokenizer, 2)
    ids, mask = completions([1, 1], [1, 6], vocab=100)
    rows = _repeated_rows(model, inputs, check_completions(inputs, ids, mask, [1, 1]))
    return rows["input_ids"][rows["attention_mask"] == 0]


@pytest.mark.parametrize("case", sorted(CASES))
def test_engines_and_forwards_pad_with_one_id(case, load_tiny):
    (gen_pad, text_pad, eos), expected = CASES[case]
    model, tokenizer = load_tiny("qwen2")
    model = _with_ids(model, gen_pad, text_pad, eos)
    assert pad_token_id(model) == expected
    for site, padding in [("HFEngine", _hf_padding(model, tokenizer)), ("VLLMEngine", _vllm_padding(model, tokenizer)),
                          ("repeated forward", _forward_padding(model, tokenizer))]:
        assert padding.numel() > 0, f"{site}: nothing was padded"
        assert padding.unique().tolist() == [expected], f"{site} pads with {padding.unique().tolist()}, not {expected}"


def test_logprobs_do_not_depend_on_the_padding_id(load_tiny, monkeypatch):
    # why one rule is safe for the forwards: padding sits where the attention mask is 0, so pad id 0 and the rule's
    # id give bitwise the same logprobs. Prompts 0 and 2 share a video, so the grouped forward reorders and pads them
    # again (`select_prompts`); the repeated forward left-pads its rows.
    import mmpg.grouping.logprobs as logprobs

    model, processor = load_tiny("qwen2_5_vl")
    videos = [random_video(4, 56, 84, 0), random_video(6, 56, 112, 1)]
    texts = [processor.apply_chat_template([{"role": "user", "content": [
        {"type": "video"}, {"type": "text", "text": QUESTIONS[b] * (b + 1)}]}], tokenize=False,
        add_generation_prompt=True) for b in range(3)]
    meta = [{"fps": 2.0, "total_num_frames": n, "frames_indices": list(range(n))} for n in (4, 6, 4)]
    inputs = processor_batch(processor, texts, [videos[0], videos[1], videos[0]], meta)
    sizes = [2, 1, 2]
    ids, mask = completions(sizes, [5, 3, 7, 2, 6], vocab=100)
    rule = pad_token_id(model)
    assert rule != 0
    results, asked = {}, []
    for pad in (0, rule):
        monkeypatch.setattr(logprobs, "pad_token_id", lambda m, pad=pad: asked.append(pad) or pad)
        with torch.no_grad():
            results[pad] = (grouped_logprobs(model, inputs, ids, mask, sizes, share=True),
                            repeated_logprobs(model, inputs, ids, mask, sizes))
    assert asked == [0, 0, rule, rule], asked  # the grouped (reordered) and the repeated forward padded
    (grouped_0, repeated_0), (grouped, repeated) = results.values()
    assert len(results) == 2 and torch.equal(grouped, grouped_0) and torch.equal(repeated, repeated_0)
