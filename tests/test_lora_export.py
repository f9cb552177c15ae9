"""LoRA checkpoints as plain models: `mmpg export` (merged weights load with from_pretrained and give the in-memory
merged model's logits), the weight-sync tensors (plain HF names, merged values, whole fused blocks), and one clear
line with exit status 2 for an adapter whose base is gone. Tiny Qwen2.5-VL and Qwen3-VL, float32."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from batches import vl_batch
from lora_utils import adapter_checkpoint, peft_policy

from mmpg.cli import main
from mmpg.models.lora_export import hf_name, is_adapter_checkpoint, sync_tensors

VIDEOS = [(4, 56, 84), None]
ATOL = 1e-6  # float32, the same weights: the logits agree to rounding (measured: exactly)


def _logits(model, inputs) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**inputs).logits.float()


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_export_loads_with_from_pretrained_and_gives_the_merged_logits(family, tiny_dirs, tmp_path, capsys):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    base = tiny_dirs[family]
    peft_model, processor = peft_policy(base)
    peft_model.save_pretrained(tmp_path / "adapter")
    processor.save_pretrained(tmp_path / "adapter")
    merged = copy.deepcopy(peft_model).merge_and_unload()
    assert is_adapter_checkpoint(tmp_path / "adapter") and not is_adapter_checkpoint(base)

    code = main(["export", "--checkpoint", str(tmp_path / "adapter"), "--out", str(tmp_path / "out")])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "LoRA adapter merged into" in out.out
    files = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= files
    assert "adapter_config.json" not in files and not any(p.name.startswith(".out.tmp") for p in tmp_path.iterdir())
    loaded = AutoModelForImageTextToText.from_pretrained(tmp_path / "out", dtype=torch.float32)
    inputs = vl_batch(AutoProcessor.from_pretrained(tmp_path / "out"), family, VIDEOS)
    got, want = _logits(loaded, inputs), _logits(merged, inputs)
    base_logits = _logits(AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32), inputs)
    diff = float((got - want).abs().max())
    print(f"\n{family}: export vs in-memory merged max |logit diff| {diff:.1e}; the adapter moved the logits by "
          f"{float((want - base_logits).abs().max()):.2e}")
    assert diff <= ATOL
    assert float((want - base_logits).abs().max()) > 1e-3, "the adapter should change the outputs"
    assert json.loads((tmp_path / "out" / "mmpg_export.json").read_text())["adapter_merged"] is True

    # a second export into the same folder is refused unless --overwrite
    assert main(["export", "--checkpoint", str(tmp_path / "adapter"), "--out", str(tmp_path / "out")]) == 2
    assert "not empty; pass --overwrite" in capsys.readouterr().err


def test_export_of_a_full_weight_checkpoint_resaves_it(tiny_dirs, tmp_path, capsys):
    from transformers import AutoModelForImageTextToText, AutoProcessor

    base = tiny_dirs["qwen2_5_vl"]
    assert main(["export", "--checkpoint", str(base), "--out", str(tmp_path / "out")]) == 0
    assert "full-weight checkpoint, re-saved" in capsys.readouterr().out
    inputs = vl_batch(AutoProcessor.from_pretrained(tmp_path / "out"), "qwen2_5_vl", VIDEOS)
    a = _logits(AutoModelForImageTextToText.from_pretrained(tmp_path / "out", dtype=torch.float32), inputs)
    b = _logits(AutoModelForImageTextToText.from_pretrained(base, dtype=torch.float32), inputs)
    assert torch.equal(a, b)


def test_missing_base_is_one_line_and_exit_2(tiny_dirs, tmp_path, capsys):
    ckpt = adapter_checkpoint(tiny_dirs["qwen2_5_vl"], tmp_path / "adapter")
    config = json.loads((ckpt / "adapter_config.json").read_text())
    gone = tmp_path / "moved_away" / "qwen2_5_vl"
    config["base_model_name_or_path"] = str(gone)
    (ckpt / "adapter_config.json").write_text(json.dumps(config))
    annotations = tmp_path / "ann.jsonl"
    annotations.write_text(json.dumps({"video": "a.mp4", "duration": 10.0, "query": "x", "span": [1.0, 2.0]}) + "\n")
    for argv in (["export", "--checkpoint", str(ckpt), "--out", str(tmp_path / "out")],
                 ["eval", "--checkpoint", str(ckpt), "--annotations", str(annotations), "--videos", str(tmp_path),
                  "--out", str(tmp_path / "eval")]):
        code = main(argv)
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("mmpg: error:")]
        assert code == 2 and len(lines) == 1, err
        assert str(ckpt) in lines[0] and str(gone) in lines[0] and "base model" in lines[0], lines[0]
        assert "put the base checkpoint back" in lines[0]
        assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_hf_names():
    assert hf_name("base_model.model.model.language_model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.language_model.layers.0.self_attn.q_proj.weight"
    assert hf_name("base_model.model.model.language_model.layers.0.self_attn.q_proj.lora_A.default.weight") is None
    assert hf_name("base_model.model.lm_head.modules_to_save.default.weight") == "lm_head.weight"
    assert hf_name("base_model.model.lm_head.original_module.weight") is None
    assert hf_name("model.language_model.norm.weight") == "model.language_model.norm.weight"


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_sync_tensors_are_the_merged_models_under_plain_names(family, tiny_dirs):
    """Only q_proj, v_proj and up_proj adapted: the sync still sends k_proj, o_proj, gate_proj, down_proj and the
    biases of those blocks (vLLM reloads fused qkv / gate_up layers whole), each value the merged model's."""
    peft_model, _ = peft_policy(tiny_dirs[family], modules=("q_proj", "v_proj", "up_proj"))
    merged = dict(copy.deepcopy(peft_model).merge_and_unload().named_parameters())
    with torch.no_grad():
        step = sync_tensors(peft_model)
        every = sync_tensors(peft_model, everything=True)
    assert set(every) == set(merged)
    assert all(torch.equal(every[n], merged[n]) for n in merged)
    assert set(step) <= set(merged) and all(torch.equal(step[n], merged[n]) for n in step)
    blocks = {n for n in merged if ".language_model.layers." in n and (".self_attn." in n or ".mlp." in n)}
    assert set(step) == blocks, sorted(set(step) ^ blocks)[:6]
    base = dict(peft_model.get_base_model().named_parameters())
    q = "model.language_model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(step[q], base[q.replace(".weight", ".base_layer.weight")]), "merged, not the base"
    # the policy as mmpg.models.lora hands it around: the transformers model with the adapters injected, no shell
    with torch.no_grad():
        inner = sync_tensors(peft_model.get_base_model())
    assert set(inner) == set(step) and all(torch.equal(inner[n], step[n]) for n in step)


def test_merged_model_of_a_policy_with_injected_adapters(tiny_dirs):
    """The policy as mmpg.models.lora hands it around (the transformers model, adapters injected, no PeftModel
    shell): `merged_model` merges in place to the plain model's modules and the same weights as merge_and_unload."""
    from mmpg.models.lora_export import has_lora, merged_model

    peft_model, _ = peft_policy(tiny_dirs["qwen2_5_vl"])
    want = {n: p.clone() for n, p in copy.deepcopy(peft_model).merge_and_unload().named_parameters()}
    got = merged_model(peft_model.get_base_model())
    assert not has_lora(got) and type(got).__name__ == "Qwen2_5_VLForConditionalGeneration"
    params = dict(got.named_parameters())
    assert set(params) == set(want) and all(torch.equal(params[n], want[n]) for n in want)


def test_sync_tensors_without_lora_are_the_trainable_parameters(load_tiny):
    model, _ = load_tiny("qwen2_5_vl")
    model.model.visual.requires_grad_(False)
    got = sync_tensors(model)
    assert set(got) == {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(sync_tensors(model, everything=True)) == len(list(model.parameters()))


def test_export_never_overwrites_a_folder_holding_its_source(tiny_dirs, tmp_path, capsys):
    # --overwrite replaces --out whole: an --out that is, or holds, the adapter or its base is refused before anything
    # is loaded or removed
    run = tmp_path / "run"
    ckpt = adapter_checkpoint(tiny_dirs["qwen2_5_vl"], run / "checkpoints" / "step_00000002")
    for out in (ckpt, run, tmp_path):
        code = main(["export", "--checkpoint", str(ckpt), "--out", str(out), "--overwrite"])
        err = capsys.readouterr().err
        assert code == 2 and "which the export reads" in err, err
        assert (ckpt / "adapter_model.safetensors").is_file()
