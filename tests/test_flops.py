"""The FLOPs model behind the benchmark's ceilings: the paper's figures, and the formulas on hand-worked cases."""

from __future__ import annotations

import pytest

from mmpg.bench.flops import (
    attention_pairs, attn_per_pair, linear_per_token, paper_reduction, rho_attn, rho_flops, rho_lin, step_flops,
    vision_flops,
)
from mmpg.models.geometry import MODELS, QWEN2_5_7B, Geometry, Vision


@pytest.mark.parametrize("G, ratio, reported", [(8, 32, 6.60), (16, 32, 10.9)])
def test_paper_reductions_within_3_percent(G, ratio, reported):
    # arXiv 2506.05433 / the upstream README: FLOPs reduction at prefix/suffix = 32
    got = paper_reduction(G, ratio)
    assert abs(got / reported - 1) < 0.03, f"G={G}, P/S={ratio}: model {got:.3f} vs paper {reported}"


@pytest.mark.parametrize("G, reported", [(8, 6.60), (16, 10.9)])
def test_paper_reductions_hold_for_other_model_sizes_and_prefix_lengths(G, reported):
    # The reproduction is not tuned to one shape: Qwen2.5-3B- and 7B-sized LMs at P = 4096 and 8192 agree too.
    for dims in (QWEN2_5_7B, MODELS["qwen2.5-vl-3b"]):
        for P in (4096, 8192):
            got = paper_reduction(G, 32, P=P, dims=dims)
            assert abs(got / reported - 1) < 0.03, (dims, P, got)


def test_token_ratio_is_the_limit_of_the_paper_figures():
    # P/S = 32 -> P = 32 S. G=8: 8·33S / (32S + 8S) = 264/40 = 6.6; G=16: 16·33 / 48 = 11.0
    assert rho_lin(32, 1, 8) == pytest.approx(6.6)
    assert rho_lin(32, 1, 16) == pytest.approx(11.0)


def test_rho_lin_small_case():
    # P=4, S=2, G=3: repeated 3·(4+2) = 18 tokens, grouped 4 + 3·2 = 10 tokens -> 1.8
    assert rho_lin(4, 2, 3) == pytest.approx(1.8)


def test_attention_pairs_small_case():
    # P=4, S=2, G=3, causal:
    #   repeated: 3 · 6²/2 = 54
    #   grouped:  4²/2 + 3·(2·4 + 2²/2) = 8 + 3·10 = 38
    assert attention_pairs(4, 2, 3, grouped=False) == 54
    assert attention_pairs(4, 2, 3, grouped=True) == 38
    assert rho_attn(4, 2, 3) == pytest.approx(54 / 38)
    # dense: repeated 3·36 = 108; grouped 16 + 3·2·6 = 52
    assert attention_pairs(4, 2, 3, grouped=False, causal=False) == 108
    assert attention_pairs(4, 2, 3, grouped=True, causal=False) == 52


def test_ceilings_are_one_for_a_single_response():
    for P, S in ((100, 7), (4096, 256)):
        assert rho_lin(P, S, 1) == pytest.approx(1)
        assert rho_attn(P, S, 1) == pytest.approx(1)
        assert rho_flops(QWEN2_5_7B, P, S, 1) == pytest.approx(1)


def test_step_flops_small_case():
    # hidden 2, 1 layer, 1 head of 2, 1 kv head, intermediate 1, vocab 1.
    #   linear per token: 2·(q 2·2 + k,v 2·2·2 + o 2·2 + mlp 3·2·1) = 2·(4 + 8 + 4 + 6) = 44
    #   attention per pair: 4 · 1 head · 2 = 8;   LM head per response token: 2·2·1 = 4
    # P=4, S=2, G=3 (pairs 54 repeated, 38 grouped; 6 response tokens in both):
    #   repeated forward: 44·18 + 8·54 + 4·6 = 792 + 432 + 24 = 1248
    #   grouped forward:  44·10 + 8·38 + 4·6 = 440 + 304 + 24 = 768
    dims = Geometry("hand", hidden=2, layers=1, heads=1, kv_heads=1, intermediate=1, vocab=1)
    assert linear_per_token(dims) == 44 and attn_per_pair(dims) == 8
    assert step_flops(dims, 4, 2, 3, grouped=False) == 3 * 1248  # forward + backward = 3 x forward
    assert step_flops(dims, 4, 2, 3, grouped=True) == 3 * 768
    assert rho_flops(dims, 4, 2, 3) == pytest.approx(1248 / 768)  # 1.625
    # LM head on every position instead: repeated 24 -> 4·18 = 72, grouped 24 -> 4·10 = 40
    assert step_flops(dims, 4, 2, 3, grouped=False, head="all") == 3 * (792 + 432 + 72)
    assert step_flops(dims, 4, 2, 3, grouped=True, head="all") == 3 * (440 + 304 + 40)


def test_vision_tower_is_encoded_once_when_grouped():
    # vision hidden 2, depth 1, intermediate 1, merge 1, gated MLP, 4 patches attending 2 each:
    #   block: 2·4·(4·4 + 3·2·1) + 4·2·4·2 = 176 + 64 = 240;  merger: 2·4·(2² + 2·2) = 64  -> 304 per video
    v = Vision(hidden=2, depth=1, intermediate=1, out_hidden=2, merge=1)
    assert vision_flops(v, 4, 2) == 304
    dims = Geometry("hand", hidden=2, layers=1, heads=1, kv_heads=1, intermediate=1, vocab=1, vision=v)
    # the 3 repeated copies pay 3·304, the grouped forward 304 (on top of the text numbers above)
    assert step_flops(dims, 4, 2, 3, False, video_patches=4, frame_patches=2) == 3 * (1248 + 3 * 304)
    assert step_flops(dims, 4, 2, 3, True, video_patches=4, frame_patches=2) == 3 * (768 + 304)


def test_ceiling_ordering_for_long_prompts():
    # causal attention gains less than the linear layers (the response x prefix block is not shared), so the
    # combined ceiling lies between the two
    P, S, G = 4096, 256, 8
    lo, hi = rho_attn(P, S, G), rho_lin(P, S, G)
    assert lo < rho_flops(QWEN2_5_7B, P, S, G) < hi


def test_queries_of_one_video_token_counts_by_hand():
    # FACTS' figures at P 2048, t 30, S 128, G 8, Q 3: per query 3·(2078 + 1024) = 9306; tree (tails repeated per
    # response) 2048 + 24·158 = 5840; naive 24·2206 = 52944. Tree over per query: 9306 / 5840 = 1.593
    from mmpg.bench.flops import layout_tokens, rho_lin_q

    assert layout_tokens("per_query", 2048, 30, 128, 8, 3) == 9306
    assert layout_tokens("tree", 2048, 30, 128, 8, 3) == 5840
    assert layout_tokens("naive", 2048, 30, 128, 8, 3) == 52944
    assert rho_lin_q("tree", 2048, 30, 128, 8, 3) / rho_lin_q("per_query", 2048, 30, 128, 8, 3) == \
        pytest.approx(9306 / 5840)
    # Q = 1: per query is today's grouped forward of a prompt of P + t tokens
    assert rho_lin_q("per_query", 100, 5, 7, 4, 1) == pytest.approx(rho_lin(105, 7, 4))


def test_queries_of_one_video_attention_pairs_by_hand():
    # P 4, t 1, S 2, G 2, Q 2 (causal):
    #   naive:     QG (P+t+S)²/2 = 4 · 49/2 = 98
    #   per query: Q ((P+t)²/2 + G (S (P+t) + S²/2)) = 2 (12.5 + 2 (10 + 2)) = 73
    #   tree:      P²/2 + QG ((t+S) P + (t+S)²/2) = 8 + 4 (12 + 4.5) = 74
    # (tiny P: repeating the tails costs more than the prefix saves; at real sizes the tree wins)
    from mmpg.bench.flops import layout_pairs

    assert layout_pairs("naive", 4, 1, 2, 2, 2) == 98
    assert layout_pairs("per_query", 4, 1, 2, 2, 2) == 73
    assert layout_pairs("tree", 4, 1, 2, 2, 2) == 74


def test_queries_of_one_video_ceilings_order():
    # a long video shared by 3 queries: the tree beats per-query grouping in every phase, and each beats naive;
    # one query: the tree is per-query grouping
    from mmpg.bench.flops import ceilings_q, rollout_flops_q

    dims = Geometry("hand", hidden=256, layers=4, heads=4, kv_heads=2, intermediate=512, vocab=1000)
    per = ceilings_q(dims, "per_query", 2048, 32, 128, 8, 3)
    tree = ceilings_q(dims, "tree", 2048, 32, 128, 8, 3)
    for key in per:
        assert tree[key] > per[key] > 1, key
    one = ceilings_q(dims, "tree", 2048, 32, 128, 8, 1), ceilings_q(dims, "per_query", 2048, 32, 128, 8, 1)
    assert one[0] == pytest.approx(one[1])
    # the rollout's decode is the same in all three layouts: at G = S = 1 (no decode step) only prefills differ
    assert rollout_flops_q(dims, "tree", 10, 2, 1, 1, 1) == pytest.approx(rollout_flops_q(dims, "per_query", 10, 2,
                                                                                          1, 1, 1))


def test_true_tree_token_ceiling_by_hand():
    # FACTS: a true tree (each tail once per query) holds P + Q(t + GS) = 2048 + 3·(30 + 1024) = 5210 tokens at
    # P 2048, t 30, S 128, G 8, Q 3; over per-query grouping's 9306: 1.786
    from mmpg.bench.flops import rho_lin_q, rho_lin_true_tree

    assert rho_lin_true_tree(2048, 30, 128, 8, 3) == pytest.approx(52944 / 5210)
    assert rho_lin_true_tree(2048, 30, 128, 8, 3) / rho_lin_q("per_query", 2048, 30, 128, 8, 3) == \
        pytest.approx(9306 / 5210)
    assert rho_lin_true_tree(100, 5, 7, 4, 1) == pytest.approx(rho_lin_q("per_query", 100, 5, 7, 4, 1))
