"""Model-level variants: one training step (logprobs of G responses, a loss, backward) on a random-weight model.

    repeated  `mmpg.grouping.repeated_logprobs`: the prompt (and its video) repeated G times, the model's own forward
    upstream  the PyPI package `prefix_grouper` wired through transformers' registry, as its README does: its
              `register_attention()` plus `attn_implementation="prefix_grouper_attention"`, the packed row
              [prompt | r_1 | ... | r_G] with positions 0..P-1, P..P+S-1 per response, the `PrefixGrouper` passed as a
              forward kwarg and the inner attention function our bottom-right-causal SDPA (`attention.upstream_sdpa`,
              registered under `mmpg_bench_upstream_sdpa`). Text-only families only: for Qwen-VL the package needs
              its copied modeling file (vision tower once, mRoPE positions), which we do not copy.
    mmpg      `mmpg.grouping.grouped_logprobs` (backend from the case, default: the model's).

The model is the family's real transformers class built from `mmpg.toy.models.tiny_config` with the case's sizes
(any size: a Qwen2.5-VL-3B shape on a GPU too), random weights, `vocab` overridable; its prompts come from
`mmpg.bench.batch` (a VL prompt holds one synthetic video given as patches, sized so the prompt has ~P tokens). All
variants take their logits at response-predicting positions only (`head_logprobs`, chunked) except `repeated`,
which uses the model's forward with `logits_to_keep = S + 1`.
"""

from __future__ import annotations

import functools

import torch

UPSTREAM_INNER = "mmpg_bench_upstream_sdpa"


@functools.lru_cache(maxsize=4)
def _tokenizer(vocab_size: int):
    from mmpg.toy.tokenizer import build_tokenizer

    return build_tokenizer(vocab_size, 0)


def model_config(case: dict):
    """(transformers config, tokenizer) for the case's family and sizes (`spec`: TinySpec fields; `vocab` and
    `vision_intermediate` override the tiny defaults, e.g. for a Qwen2.5-VL-3B shape)."""
    from mmpg.toy.models import TinySpec, tiny_config

    spec = TinySpec(**case["spec"])
    tokenizer = _tokenizer(spec.vocab_size)
    config = tiny_config(case["family"], spec, tokenizer)
    if case.get("vocab"):
        config.get_text_config().vocab_size = case["vocab"]
    if case.get("vision_intermediate") and hasattr(config, "vision_config"):
        config.vision_config.intermediate_size = case["vision_intermediate"]
    return config, tokenizer


def build_model(case: dict, device: torch.device):
    """(model, ids): the case's model in the case's dtype (default float32), in train mode; ids holds the
    video/vision_start/vision_end token ids (None for text-only) and the tokenizer."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from mmpg.toy.models import VL_FAMILIES

    config, tokenizer = model_config(case)
    config._attn_implementation = "sdpa"
    auto = AutoModelForImageTextToText if case["family"] in VL_FAMILIES else AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        model = auto.from_config(config, dtype=getattr(torch, case.get("dtype", "float32")))
    if case.get("grad_ckpt"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = {name: getattr(config, f"{name}_token_id", None) for name in ("video", "vision_start", "vision_end")}
    ids["tokenizer"] = tokenizer
    return model.train(), ids


def set_generation_ids(model) -> None:
    """Give `model.generation_config` its text config's eos id and the padding id of
    `mmpg.grouping.inputs.pad_token_id` (the one rule), so `generate`, the HF engine and a saved copy vLLM serves stop
    and pad alike."""
    from mmpg.grouping.inputs import pad_token_id

    model.generation_config.eos_token_id = model.config.get_text_config().eos_token_id
    model.generation_config.pad_token_id = pad_token_id(model)


def _upstream_logprobs(model, prompt, completion_ids):
    """The upstream package's grouped forward: [G, S] float32 logprobs (text-only models)."""
    from prefix_grouper import PrefixGrouper

    from mmpg.grouping import head_logprobs

    P, (G, S) = prompt["input_ids"].shape[1], completion_ids.shape
    device = completion_ids.device
    grouper = PrefixGrouper([[P] + [S] * G], device=device)
    ids = torch.cat([prompt["input_ids"][0], completion_ids.reshape(-1)])[None]  # [1, P + G·S]
    pos = torch.cat([torch.arange(P, device=device), (P + torch.arange(S, device=device)).repeat(G)])[None]
    marker = torch.ones(1, 1, 0, 0, dtype=torch.bool, device=device)  # a 4-D mask passes mask creation untouched
    hidden = model.model(input_ids=ids, position_ids=pos, attention_mask=marker, use_cache=False,
                         prefix_grouper=grouper, prefix_grouper_attn_func=UPSTREAM_INNER).last_hidden_state
    # suffix outputs with the last prefix position in front: [G, S + 1, H]; position t predicts token t
    _, _, suffix, _ = grouper.split_output(hidden, include_prefix_last=1)
    flat = head_logprobs(model.get_output_embeddings(), suffix[:, :S].reshape(G * S, -1), completion_ids.reshape(-1))
    return flat.view(G, S)


def _wire_upstream(model) -> None:
    from prefix_grouper.utils.register_transformers import register_attention
    from transformers import AttentionInterface

    from mmpg.bench.attention import upstream_sdpa

    def inner(module, query, key, value, attention_mask, *args, scaling=None, **kwargs):
        return upstream_sdpa(query, key, value, attention_mask, scaling=scaling), None

    register_attention()
    AttentionInterface.register(UPSTREAM_INNER, inner)
    model.set_attn_implementation("prefix_grouper_attention")


def setup(case: dict, device: torch.device):
    """(prepare, step, info) for one variant: model and inputs are built here (outside the memory window; prepare
    is None), `step()` is one training step."""
    from mmpg.bench.batch import forward_tokens, make_inputs
    from mmpg.grouping import grouped_logprobs, repeated_logprobs

    variant = case["variant"]
    model, ids = build_model(case, device)
    if variant == "upstream" and ids["video"] is not None:
        raise NotImplementedError("upstream prefix_grouper needs its copied modeling file for VL models")
    prompt, completion_ids, completion_mask, info = make_inputs(model, case, ids, device)
    G = completion_ids.shape[0]
    if variant == "upstream":
        _wire_upstream(model)

    def logprobs():
        if variant == "repeated":
            return repeated_logprobs(model, prompt, completion_ids, completion_mask, [G])
        if variant == "mmpg":
            return grouped_logprobs(model, prompt, completion_ids, completion_mask, [G], backend=case.get("backend"))
        return _upstream_logprobs(model, prompt, completion_ids)

    def step():
        model.zero_grad(set_to_none=True)
        loss = -(logprobs() * completion_mask).sum() / completion_mask.sum()
        loss.backward()

    info["tokens"] = forward_tokens(info["P"], case["S"], G, shared=variant != "repeated")
    return None, step, info
