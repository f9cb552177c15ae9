"""LoRA (peft) on the language model, in-process: the grouped forward equals the repeated one through peft's
wrappers (logprobs and every adapter's gradient, float32, both families, also with gradient checkpointing), only
adapters train, vision modules are never caught by leaf names, the adapters-off forward is the base checkpoint's,
and bad target lists are one clear error. End-to-end runs (GRPO, SFT, resume, ZeRO-3) are in test_lora_train.py."""

from __future__ import annotations

import pytest
import torch

from batches import completions, vl_batch
from grouping_check import compare

from mmpg.config import LoraConfig
from mmpg.errors import UserError
from mmpg.grouping import grouped_logprobs
from mmpg.models.lora import apply_lora, is_lora, reference_model, resolve_targets, trainable_summary

VL = ["qwen2_5_vl", "qwen3_vl"]
VIDEOS, GROUPS, LENGTHS = [(4, 84, 56), None, (6, 56, 112)], [1, 3, 4], [4, 1, 7, 2, 5, 3, 8, 6]


def lora_model(load_tiny, tiny_dirs, family, seed=0, **kw):
    """The tiny model with r=4 adapters on q/k/v/o and the MLP of every text layer, lora_B random (with B = 0, the
    peft default, every lora_A gradient is 0 and the comparison would be trivial)."""
    model, processor = load_tiny(family)
    cfg = LoraConfig(r=4, alpha=8, **kw)
    apply_lora(model, cfg, tiny_dirs[family], freeze_vision=True)
    return randomize_b(model, seed), processor


def randomize_b(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    return model


@pytest.mark.parametrize("family", VL)
def test_grouped_equals_repeated_through_lora(family, load_tiny, tiny_dirs):
    model, processor = lora_model(load_tiny, tiny_dirs, family)
    inputs = vl_batch(processor, family, VIDEOS, "left")
    ids, mask = completions(GROUPS, LENGTHS, model.config.text_config.vocab_size, seed=3)
    max_diff, worst_rel, grads = compare(model, inputs, ids, mask, GROUPS)
    layers = model.config.text_config.num_hidden_layers
    assert set(grads) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(grads) == 2 * 7 * layers and all("lora_" in n for n in grads)  # A and B of 7 projections per layer
    assert all(float(g.abs().max()) > 0 for g in grads.values()), "every adapter tensor gets a gradient"
    print(f"{family}: logprob max diff {max_diff:.2e}, worst relative adapter gradient diff {worst_rel:.2e}")


def test_lora_on_the_vision_tower_when_named(load_tiny, tiny_dirs):
    """A dotted entry names vision modules explicitly (model.freeze_vision=false): their adapters get exact gradients
    through the vision tower, which the grouped forward runs once per prompt."""
    model, processor = load_tiny("qwen2_5_vl")
    apply_lora(model, LoraConfig(r=4, alpha=8, target_modules=["q_proj", "attn.qkv"]), tiny_dirs["qwen2_5_vl"],
               freeze_vision=False)
    randomize_b(model, 1)
    inputs = vl_batch(processor, "qwen2_5_vl", VIDEOS, "left")
    ids, mask = completions(GROUPS, LENGTHS, model.config.text_config.vocab_size, seed=3)
    _, _, grads = compare(model, inputs, ids, mask, GROUPS)
    vision = [n for n in grads if n.startswith("model.visual.")]
    assert vision and all(".attn.qkv.lora_" in n for n in vision)
    assert len(grads) == 2 * (model.config.text_config.num_hidden_layers + model.config.vision_config.depth)


@pytest.mark.parametrize("family", VL)
def test_lora_with_gradient_checkpointing(family, load_tiny, tiny_dirs):
    """peft + checkpointing: the first checkpointed layer gets an input that requires grad (peft enables it), and
    the adapters' gradients are those of the forward without checkpointing."""
    from mmpg.models.loading import load_policy

    model, processor = lora_model(load_tiny, tiny_dirs, family)
    inputs = vl_batch(processor, family, VIDEOS, "left")
    ids, mask = completions(GROUPS, LENGTHS, model.config.text_config.vocab_size, seed=3)
    _, _, plain = compare(model, inputs, ids, mask, GROUPS)
    # as training loads it: checkpointing on, then the adapters; the same adapter values as above
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_" in n}
    model = load_policy(tiny_dirs[family], gradient_checkpointing=True, freeze_vision=True,
                        lora=LoraConfig(r=4, alpha=8))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(adapters[n])
    model.train()
    assert model.is_gradient_checkpointing and is_lora(model)
    _, _, checkpointed = compare(model, inputs, ids, mask, GROUPS)
    for name, g in plain.items():
        rel = float((checkpointed[name] - g).norm() / g.norm())
        assert rel <= 1e-5, f"{name}: checkpointed gradient differs by {rel:.2e}"


@pytest.mark.parametrize("family", VL)
def test_adapters_off_forward_is_the_base_checkpoint(family, load_tiny, tiny_dirs):
    """The KL reference with LoRA: the policy with its adapters off gives the logprobs of the base checkpoint loaded
    separately, bit for bit, and the adapters are on again afterwards (also after an error inside the block)."""
    model, processor = lora_model(load_tiny, tiny_dirs, family)
    base, _ = load_tiny(family)
    inputs = vl_batch(processor, family, VIDEOS, "right")
    ids, mask = completions(GROUPS, LENGTHS, model.config.text_config.vocab_size, seed=5)
    with torch.no_grad():
        on = grouped_logprobs(model, inputs, ids, mask, GROUPS)
        with reference_model(model) as ref:
            off = grouped_logprobs(ref, inputs, ids, mask, GROUPS)
        expected = grouped_logprobs(base, inputs, ids, mask, GROUPS)
        again = grouped_logprobs(model, inputs, ids, mask, GROUPS)
        with pytest.raises(KeyError), reference_model(model):
            raise KeyError("inside the block")
        after_error = grouped_logprobs(model, inputs, ids, mask, GROUPS)
    assert float((off - expected).abs().max()) <= 1e-6
    assert float((on - off).abs().max()) > 1e-3, "random lora_B must change the policy"
    assert torch.equal(on, again) and torch.equal(on, after_error)
    assert all(p.requires_grad for n, p in model.named_parameters() if "lora_" in n)


def test_targets_stay_in_the_language_model(load_tiny, tiny_dirs):
    """Qwen2.5-VL's vision blocks have mlp.gate_proj / up_proj / down_proj too: leaf names never reach them."""
    model, _ = load_tiny("qwen2_5_vl")
    assert any(n.startswith("model.visual.") and n.endswith("mlp.gate_proj") for n, _ in model.named_modules())
    targets = resolve_targets(model, ["q_proj", "gate_proj"], freeze_vision=True)
    assert targets and all(n.startswith("model.language_model.layers.") for n in targets)
    assert len(targets) == 2 * model.config.text_config.num_hidden_layers
    visual = resolve_targets(model, ["attn.qkv"], freeze_vision=False)  # a dotted name reaches the vision tower
    assert visual and all(n.startswith("model.visual.blocks.") for n in visual)
    apply_lora(model, LoraConfig(r=4, alpha=8), tiny_dirs["qwen2_5_vl"], freeze_vision=True)
    assert is_lora(model) and not any("lora_" in n for n, _ in model.model.visual.named_parameters())
    summary = trainable_summary(model)
    layers = model.config.text_config.num_hidden_layers
    assert summary["lora"]["modules"] == 7 * layers and 0 < summary["trainable"] < summary["total"] / 10
    assert summary["text"].startswith("trainable parameters: ") and f"LoRA r=4 on {7 * layers} modules" in \
        summary["text"]
    print(summary["text"])


@pytest.mark.parametrize("entries, freeze, words", [
    (["q_proj", "qq_proj"], True, ["'qq_proj' matches no module", "q_proj, "]),
    (["visual.merger.mlp.0"], True, ["'visual.merger.mlp.0' names vision-tower modules", "freeze_vision=false"]),
])
def test_bad_targets_are_one_line(load_tiny, entries, freeze, words):
    model, _ = load_tiny("qwen2_5_vl")
    with pytest.raises(UserError) as err:
        resolve_targets(model, entries, freeze_vision=freeze)
    text = str(err.value)
    assert "\n" not in text and all(w in text for w in words), text


def test_a_peft_model_shell_is_unwrapped(load_tiny, tiny_dirs):
    """Code that holds the PeftModel itself (its `.model` is the ForConditionalGeneration, not the inner Qwen model)
    gets the same logprobs from the grouped and repeated forwards and the same model in the rollout engine."""
    from mmpg.grouping import repeated_logprobs
    from mmpg.models.lora import lora_handle
    from mmpg.rollout import HFEngine

    model, processor = lora_model(load_tiny, tiny_dirs, "qwen3_vl")
    shell = lora_handle(model).peft
    inputs = vl_batch(processor, "qwen3_vl", VIDEOS[:1], "left")
    ids, mask = completions(GROUPS[:1], LENGTHS[:1], model.config.text_config.vocab_size)
    with torch.no_grad():
        for fn in (grouped_logprobs, repeated_logprobs):
            assert torch.equal(fn(shell, inputs, ids, mask, GROUPS[:1]), fn(model, inputs, ids, mask, GROUPS[:1]))
    assert HFEngine(shell, processor).model is model


def test_without_dropout_makes_the_deterministic_passes_deterministic(load_tiny, tiny_dirs):
    # model.lora.dropout > 0: the update's forward draws masks (two grouped forwards differ), but inside
    # `without_dropout` the grouped forward equals itself and the repeated one (the self-check, old and reference
    # logprobs run there), and the dropout modules are back in train mode afterwards, also after an error
    from mmpg.grouping import repeated_logprobs
    from mmpg.models.lora import without_dropout

    model, processor = lora_model(load_tiny, tiny_dirs, "qwen2_5_vl", dropout=0.5)
    inputs = vl_batch(processor, "qwen2_5_vl", VIDEOS, "left")
    ids, mask = completions(GROUPS, LENGTHS, model.config.text_config.vocab_size, seed=3)
    args = (model, inputs, ids, mask, GROUPS)
    drops = [m for n, m in model.named_modules() if ".lora_dropout." in f".{n}."]
    assert drops and all(m.training for m in drops)
    with torch.no_grad():
        torch.manual_seed(0)
        noisy = (grouped_logprobs(*args) - grouped_logprobs(*args)).abs().max()
        assert noisy > 1e-3, "dropout 0.5 on the adapters changes the logprobs"
        with without_dropout(model):
            assert not any(m.training for m in drops)
            diff = (grouped_logprobs(*args) - repeated_logprobs(*args)).abs().max()
        assert diff <= 1e-5, diff
        assert all(m.training for m in drops)
        with pytest.raises(RuntimeError), without_dropout(model):
            raise RuntimeError("inside")
        assert all(m.training for m in drops)
