"""The one model geometry (`mmpg.models.geometry`): its config.json reader on every supported family, the released
shapes it names, and the error of a config it cannot read."""

from __future__ import annotations

import pytest

from mmpg.errors import UserError
from mmpg.models.geometry import MODELS, QWEN2_5_7B, from_config_dict


@pytest.fixture(scope="module")
def tokenizer():
    from mmpg.toy.tokenizer import build_tokenizer

    return build_tokenizer(2048, 0)


# family -> (qk_norm, vision: None or (mlp_mats, patch, position_embeddings, deepstack taps))
FAMILIES = {"qwen2": (False, None), "qwen3": (True, None),
            "qwen2_5_vl": (False, (3, 14, 0, 0)), "qwen3_vl": (True, (2, 16, 256, 2))}


@pytest.mark.parametrize("family", FAMILIES)
def test_one_reader_for_every_family(family, tokenizer):
    # the tiny checkpoints' configs (mmpg.toy.models.tiny_config): sizes at the top level for the text-only families,
    # under text_config / vision_config for the VL ones
    from mmpg.toy.models import TinySpec, tiny_config

    spec = TinySpec(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128)
    g = from_config_dict(tiny_config(family, spec, tokenizer).to_dict(), family)
    assert (g.name, g.hidden, g.layers, g.heads, g.kv_heads, g.intermediate, g.d) == (family, 64, 2, 4, 2, 128, 16)
    assert g.vocab == len(tokenizer) and g.tied is False
    qk_norm, vision = FAMILIES[family]
    assert g.qk_norm is qk_norm
    if vision is None:
        assert g.vision is None
        return
    v = g.vision
    assert (v.mlp_mats, v.patch, v.position_embeddings, v.deepstack) == vision
    assert (v.depth, v.hidden, v.intermediate, v.out_hidden, v.merge) == (spec.vision_depth, spec.vision_hidden_size,
                                                                          2 * spec.vision_hidden_size, 64, 2)


def test_released_shapes_are_written_once():
    # Qwen2.5-7B's published parameter count, 7,615,616,512: the LM of the Qwen2.5-VL-7B preset, vision tower off
    assert QWEN2_5_7B.vision is None and QWEN2_5_7B.lm_params() == QWEN2_5_7B.params() == 7_615_616_512
    vl = MODELS["qwen2.5-vl-7b"]
    assert (QWEN2_5_7B.hidden, QWEN2_5_7B.layers, QWEN2_5_7B.heads, QWEN2_5_7B.kv_heads, QWEN2_5_7B.intermediate,
            QWEN2_5_7B.vocab) == (vl.hidden, vl.layers, vl.heads, vl.kv_heads, vl.intermediate, vl.vocab)
    assert vl.lm_params() == 7_615_616_512


def test_a_config_without_the_sizes_is_refused_by_name():
    with pytest.raises(UserError, match=r"^ckpt/llama: config.json lacks num_hidden_layers, intermediate_size; is it"):
        from_config_dict({"model_type": "llama", "hidden_size": 8, "num_attention_heads": 2, "vocab_size": 10},
                         "ckpt/llama")
