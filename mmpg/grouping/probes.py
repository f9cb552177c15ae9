"""What the self-check measures besides the logprobs: the gradient of the loss, and a leak probe that does not depend
on the weights (`mmpg.grouping.selfcheck` runs both on the step's first micro-batch).

Gradient probe. A zero vector d_l [H] (float32, requires grad) is added to the input hidden states of every decoder
layer l, and the loss is L = sum_{i,t} w_it logp_it with fixed random weights w, nonzero on the first and last
response of every group only (the reference needs those rows alone). Then dL/dd_l = sum over the row's tokens of
dL/dh_l(token) is the same number in the grouped forward and the repeated one: a prefix token the grouped row holds
once feeds all G responses, so its gradient is the sum of its G copies'. Every attention backward above l (dq, dk,
dv) flows into it, so a backward wrong anywhere (a kernel's backward, a mask applied in forward only, a fault only
while autograd records) moves it. No parameter gradient is taken (`torch.autograd.grad` on the probes only), so it
runs alike under ZeRO 0-3, LoRA and a frozen tower and leaves the optimizer's gradients alone. The probe's logprobs
are taken at temperature PROBE_TEMPERATURE (logits / 8), whatever the run's: at a token the model is sure of
(p -> 1, a checkpoint sampling what it was fine-tuned on) the gradient of log p is 1 - p, which float32 computes to
about (rounding of the logits) / (1 - p) relative in either layout: 1e-3 at p = 0.999, the two layouts' gradients
then differ by rounding alone, above any bound that still sees a fault (measured on a tiny model trained to
memorize its completions: 9e-4 at temperature 1 in float32, and the same comparison in float64 2e-6). At logits / 8
no token is that sure and the comparison measures the layouts again; the backward runs through the same layers. Under sequence
parallelism the group sums the shards' figures and divides by sp (each rank's loss is the whole row's). The repeated
reference runs one row at a time, so its memory is one prompt + response.

Leak probe. In the first and last response of every group the tokens after the first are replaced by a token t*
found nowhere in the batch, its embedding by a large random vector (the tokens that place a clip inside a response,
its placeholders and vision start and end, stay: the clip's features keep their places). Nothing else can see them under the layout's
rule: every other response's logprobs, and the changed responses' first logprob (the prefix/response boundary), must
stay bit for bit as they were (a masked key adds an exact zero), whatever the weights; a sibling leak that moves a
confident model's logprobs by 4e-6, under the 1e-4 bound, moves these by orders more.
"""

from __future__ import annotations

import contextlib

import torch

from mmpg.grouping.inputs import placeholder_token_ids
from mmpg.grouping.logprobs import keep_head_logits
from mmpg.grouping.patch import base_model, model_kind

PROBE_TEMPERATURE = 8.0  # the gradient probe's logprobs: logits / 8 (module docstring)
SEED = 20_260_502  # the loss weights, the probe token and its embedding: the same on every rank and every call
LEAK_SCALE = 16.0  # the probe token's embedding: this many times the row's embedding RMS


def decoder_layers(model) -> list[torch.nn.Module]:
    """The text model's decoder layers (Qwen2.5-VL / Qwen3-VL / text-only Qwen)."""
    inner = base_model(model).model
    text = inner.language_model if model_kind(model) == "vl" else inner
    return list(text.layers)


def _hidden_size(model) -> int:
    return int(model.config.get_text_config().hidden_size)


@contextlib.contextmanager
def layer_probes(model):
    """Inside: every decoder layer's input hidden states get + d_l; yields the list of d_l ([H] float32 zeros that
    require grad, on the embedding's device)."""
    device = base_model(model).get_input_embeddings().weight.device
    layers = decoder_layers(model)
    deltas = [torch.zeros(_hidden_size(model), device=device, requires_grad=True) for _ in layers]

    def hook(delta):
        def pre(module, args, kwargs):
            if args:
                return (args[0] + delta.to(args[0].device, args[0].dtype),) + tuple(args[1:]), kwargs
            h = kwargs["hidden_states"]
            return args, {**kwargs, "hidden_states": h + delta.to(h.device, h.dtype)}
        return pre

    handles = [layer.register_forward_pre_hook(hook(d), with_kwargs=True) for layer, d in zip(layers, deltas)]
    try:
        yield deltas
    finally:
        for handle in handles:
            handle.remove()


def end_rows(group_sizes) -> list[int]:
    """The first and the last response of every group (the rows of the gradient probe's loss)."""
    rows, start = [], 0
    for g in group_sizes:
        rows += sorted({start, start + g - 1})
        start += g
    return rows


def loss_weights(completion_mask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """[N, S] fixed random weights in [0.5, 1.5) on the response tokens of `rows`, 0 elsewhere (the probe's loss)."""
    gen = torch.Generator().manual_seed(SEED)
    chosen = torch.zeros(completion_mask.shape[0], 1)
    chosen[rows] = 1.0
    return (torch.rand(completion_mask.shape, generator=gen) + 0.5) * completion_mask.float().cpu() * chosen


def probe_gradients(model, logprobs_fn, weights: torch.Tensor, sequence_group=None, sp: int = 1
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [N, S] detached, gradients [layers, H] of sum(weights * logprobs) with respect to each layer's probe)
    of `logprobs_fn()` (one forward with grad). `sequence_group`, `sp`: the shards' sum (module docstring)."""
    with torch.enable_grad(), layer_probes(model) as deltas, keep_head_logits():
        logp = logprobs_fn()
        loss = (logp * weights.to(logp.device)).sum()
        grads = torch.autograd.grad(loss, deltas, allow_unused=True)
    out = torch.stack([torch.zeros_like(d) if g is None else g.float() for g, d in zip(grads, deltas)])
    if sp > 1:
        torch.distributed.all_reduce(out, group=sequence_group)
        out = out / sp
    return logp.detach().float(), out


def relative_difference(candidate: torch.Tensor, reference: torch.Tensor) -> float:
    """max over layers of max |candidate_l - reference_l| / max |reference_l| (rows [layers, H]); a layer whose
    reference is all zero compares in absolute terms."""
    scale = reference.abs().amax(dim=1).clamp_min(1e-30)
    diff = (candidate.to(reference.device) - reference).abs().amax(dim=1)
    return float(torch.where(reference.abs().amax(dim=1) > 0, diff / scale, diff).max())


def _probe_token(model, prompt_inputs, completion_ids) -> int:
    """A token id found nowhere in the batch and not a visual placeholder (the same on every rank)."""
    vocab = int(model.config.get_text_config().vocab_size)
    used = set(torch.unique(prompt_inputs["input_ids"]).tolist()) | set(torch.unique(completion_ids).tolist())
    used |= set(placeholder_token_ids(model))
    gen = torch.Generator().manual_seed(SEED)
    for candidate in torch.randperm(vocab, generator=gen).tolist():
        if candidate not in used:
            return int(candidate)
    raise ValueError("the leak probe found no token id absent from the batch")


def perturbed_rows(group_sizes, lengths) -> list[int]:
    """The rows the leak probe perturbs: the first and the last response of every group, when longer than 1 token."""
    return [i for i in end_rows(group_sizes) if lengths[i] > 1]


@contextlib.contextmanager
def probe_embedding(model, token: int):
    """Inside: the embedding of `token` is a fixed random vector LEAK_SCALE times the row's embedding RMS."""
    embed = base_model(model).get_input_embeddings()

    def hook(module, args, out):
        hit = (args[0] == token)
        if not bool(hit.any()):
            return out
        gen = torch.Generator().manual_seed(SEED + 1)
        noise = torch.randn(out.shape[-1], generator=gen).to(out.device, out.dtype)
        rms = out.detach().float().pow(2).mean().sqrt().to(out.dtype)
        return torch.where(hit[..., None], noise * rms * LEAK_SCALE, out)

    handle = embed.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _visual_token_ids(model) -> torch.Tensor:
    """The ids that place a vision input in a sequence (placeholders, vision start and end): kept when a row is
    perturbed, so the clips inside responses keep their places and positions."""
    config = model.config
    names = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
    return torch.tensor([i for i in (getattr(config, n, None) for n in names) if i is not None], dtype=torch.long)


def leak_probe(model, grouped_fn, prompt_inputs, completion_ids, completion_mask, group_sizes,
               base: torch.Tensor) -> tuple[float, int]:
    """(max |change| of the logprobs nothing perturbed can reach, number of entries compared) when the leak probe's
    rows are perturbed (module docstring); `grouped_fn(completion_ids) -> [N, S]` runs the grouped forward as the check
    ran it, `base` [N, S] its logprobs unperturbed."""
    lengths = [int(n) for n in completion_mask.sum(dim=1).tolist()]
    rows = perturbed_rows(group_sizes, lengths)  # maybe none: the forward still runs (ranks in lockstep, ZeRO-3)
    token = _probe_token(model, prompt_inputs, completion_ids)
    ids = completion_ids.clone()
    keep = completion_mask.bool().clone()
    visual = _visual_token_ids(model).to(ids.device)
    for i in rows:
        tail = ids[i, 1:lengths[i]]  # a clip's tokens (a trajectory tree) stay, so its features still have a place
        ids[i, 1:lengths[i]] = torch.where(torch.isin(tail, visual), tail, torch.full_like(tail, token))
        keep[i, 1:] = False  # its own later tokens changed; its first logprob must not
    with probe_embedding(model, token):
        changed = grouped_fn(ids)
    diff = (changed.to(base.device) - base).abs().masked_fill(~keep.to(base.device), 0)
    return float(diff.max()), int(keep.sum())
