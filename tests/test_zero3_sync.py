"""The vLLM weight sync under DeepSpeed ZeRO-3: the tensors gathered from a model partitioned over 2 gloo ranks
(`tests/zero3_sync_worker.py` under torchrun) are `sync_tensors` of the whole model, bitwise, with and without LoRA
(merged W + scale B A), one tensor per gather or in pieces; and `rollout.engine=vllm` with ZeRO-3 passes the config
checks. The run against a real server is in test_vllm_engine.py (test_zero3_two_rank_grpo_run_syncs_the_whole_weights).
"""

from __future__ import annotations

import json

import pytest

from mmpg.config import load_config
from mmpg.errors import UserError
from mmpg.rl.trainer import check_grpo_config
from train_utils import run_forked

CASES = [f"everything={e},piece_bytes={b}" for e in (False, True) for b in (1, 512 * 2 ** 20)]


@pytest.fixture(scope="module")
def gathered(tmp_path_factory):
    out = tmp_path_factory.mktemp("zero3_sync") / "results.json"
    proc = run_forked("zero3_sync_worker:main", [str(out)], procs=2)  # two ranks, as torchrun starts them
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_gathered_sync_tensors_are_the_whole_models(gathered, kind):
    r = gathered[kind]
    assert r["partitioned"], "DeepSpeed must have partitioned every parameter (else nothing is gathered)"
    assert r["released"], "every gathered parameter must go back to its shard"
    for case in CASES:
        c = r[case]
        assert c["names_got"] == c["names_want"], (case, sorted(set(c["names_got"]) ^ set(c["names_want"]))[:6])
        assert not c["differ"], f"{kind} {case}: not bitwise the whole model's: {c['differ'][:6]}"
        assert c["devices"] == ["cpu"]
    one_by_one = r["everything=False,piece_bytes=1"]
    assert one_by_one["pieces"] == len(one_by_one["names_want"]) > r[CASES[1]]["pieces"] == 1
    if kind == "lora":  # the adapted blocks of the language model only: k_proj, o_proj ... sent too, merged q/v/up
        assert len(one_by_one["names_want"]) < len(r["everything=True,piece_bytes=1"]["names_want"])
        assert any(n.endswith("q_proj.weight") for n in one_by_one["names_want"])


def test_vllm_with_zero3_passes_the_config_checks(tmp_path):
    """ZeRO-3 (by stage, and by a DeepSpeed file) with rollout.engine=vllm is accepted; what cannot work still is not
    (vLLM's logprobs are at temperature 1)."""
    config = tmp_path / "zero3.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    base = ["rollout.engine=vllm", "rollout.n=2", "trainer.micro_batch_size=2", "data.batch_size=2"]
    for zero in (["deepspeed.zero_stage=3"], [f"deepspeed.config={config}"]):
        check_grpo_config(load_config(None, base + zero))
    with pytest.raises(UserError, match="rollout.temperature=0.7"):
        check_grpo_config(load_config(None, base + ["deepspeed.zero_stage=3", "rollout.temperature=0.7"]))
