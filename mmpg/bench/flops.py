"""FLOPs model of one GRPO training step (forward + backward) with and without the shared-prefix grouping.

One prompt of P tokens (video placeholders included) with G responses of S tokens each:

    repeated  G rows of [prompt | response]              T_rep = G (P + S) tokens
    grouped   one row [prompt | r_1 | ... | r_G]         T_grp = P + G S tokens

Per decoder layer, forward FLOPs = linear part + attention part (a multiply-add = 2 FLOPs):

    linear     2 T (h·Hq·d + 2 h·Hkv·d + Hq·d·h + 3 h·I)       q, k, v, o projections and the gated MLP
    attention  4 Hq·d · pairs                                   Q·Kᵀ and P·V over the (query, key) pairs computed
    LM head    2 h V per position whose logits are taken        only response-predicting positions, in both variants

    pairs, causal (what exact kernels compute):
        repeated  G (P+S)²/2
        grouped   P²/2 + G (S P + S²/2)                         prefix causal; each response: whole prefix + own past
    pairs, dense (the masked half counted too, as FLOPs counters and padded-mask kernels do):
        repeated  G (P+S)²
        grouped   P² + G S (P+S)

A vision tower (VL families) encodes the video's patches G times when repeated and once when grouped:
    per block  2 n (4 h_v² + 3 h_v I_v) + 4 h_v · n · f          n patches, each attending f patches (its frame)
plus the patch merger. Backward costs 2× forward for every term, so step FLOPs = 3 × forward and the ratios below do
not depend on it.

Ceilings printed beside every measurement:
    ρ_lin   = G (P+S) / (P + G S)                               token ratio: the linear layers' (and activations') gain
    ρ_attn  = causal repeated pairs / causal grouped pairs      the attention kernels' gain
    ρ_flops = step FLOPs repeated / step FLOPs grouped          for a concrete model (its dims), LM head and vision in
and, for a whole GRPO step (`mmpg bench --levels step`), one ceiling per phase:
    ρ_rollout = generate(num_return_sequences=G) FLOPs / shared-prefix rollout FLOPs    only the prefill differs
    ρ_fwd     = repeated / grouped forward FLOPs                the reference model's no-grad logprobs
    ρ_step    = naive / mmpg FLOPs of rollout + reference forward + update

The paper's figures (arXiv 2506.05433; README of the upstream package: FLOPs at prefix lengths 4096/8192/16384 over
prefix/suffix ratios) are reproduced by `paper_reduction`: the step-FLOPs ratio of a Qwen2.5-7B-sized LM
(h 3584, 28 layers, 28 q / 4 kv heads, I 18944) at P = 4096 with the attention scores counted **dense** and the LM
head on response positions — e.g. G = 8, P/S = 32: 6.54× (paper 6.60×, −1.0 %); G = 16: 10.78× (paper 10.9×,
−1.1 %). Derivation: with P/S = 32 the token ratio alone is 8·33/40 = 6.60 and 16·33/48 = 11.0, so the paper's
numbers are the token ratio pulled down slightly by terms that do not shrink with grouping (the response×prefix
attention block, the LM head on responses); a dense score count keeps the attention ratio above the causal one
(G=16: 11.2 dense vs 8.4 causal), which is what keeps 10.9 so close to 11.0. No single accounting reproduces both
to the printed digit (6.60 needs an attention share < 0.5 %, 10.9 a share of 2–6 %); the dense count with any
3B–72B Qwen2.5 shape stays within 1.5 % of both. Where we depart: our own ceiling `rho_flops` counts causal pairs
(the exact kernels skip the masked half in both variants), which is stricter — 6.45× and 10.56× for the same model
— because the response×prefix block is not halved by causality while the repeated prefix's self-attention is.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class VisionDims:
    """Vision tower sizes. `mlp_mats`: 3 for a gated MLP (Qwen2.5-VL), 2 for a plain one (Qwen3-VL)."""

    hidden: int
    depth: int
    intermediate: int
    out_hidden: int  # the LM hidden size the merger projects to
    merge: int = 2  # spatial merge: merge² patches per LM token
    mlp_mats: int = 3


@dataclasses.dataclass(frozen=True)
class ModelDims:
    """Decoder sizes. head_dim defaults to hidden // heads."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int | None = None
    vision: VisionDims | None = None

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def linear_per_token(self) -> int:
        """Forward FLOPs of one layer's projections and MLP for one token."""
        h, d = self.hidden, self.d
        return 2 * (h * self.heads * d + 2 * h * self.kv_heads * d + self.heads * d * h + 3 * h * self.intermediate)

    def attn_per_pair(self) -> int:
        """Forward FLOPs of one (query, key) pair in one layer: Q·Kᵀ and P·V over all query heads."""
        return 4 * self.heads * self.d


# Reference shapes (public configs). The Qwen2.5-VL LMs are the Qwen2.5 LMs of the same size.
QWEN2_5_7B = ModelDims(hidden=3584, layers=28, heads=28, kv_heads=4, intermediate=18944, vocab=152064)
QWEN2_5_VL_3B = ModelDims(
    hidden=2048, layers=36, heads=16, kv_heads=2, intermediate=11008, vocab=151936,
    vision=VisionDims(hidden=1280, depth=32, intermediate=3420, out_hidden=2048))


# ---- ceilings that need no model ----------------------------------------------------------------------------------
def rho_lin(P: float, S: float, G: int) -> float:
    """Token ratio G(P+S) / (P+GS)."""
    return G * (P + S) / (P + G * S)


def attention_pairs(P: float, S: float, G: int, grouped: bool, causal: bool = True) -> float:
    """(query, key) pairs one layer's attention computes for one prompt with G responses."""
    if grouped:
        return P * P / 2 + G * (S * P + S * S / 2) if causal else P * P + G * S * (P + S)
    return G * (P + S) ** 2 / 2 if causal else G * (P + S) ** 2


def rho_attn(P: float, S: float, G: int, causal: bool = True) -> float:
    """Attention-score FLOPs ratio repeated / grouped (causal by default)."""
    return attention_pairs(P, S, G, False, causal) / attention_pairs(P, S, G, True, causal)


# ---- the model-level FLOPs ------------------------------------------------------------------------------------------
def vision_flops(v: VisionDims, patches: int, frame_patches: int) -> float:
    """Forward FLOPs of the vision tower on one video of `patches` patches, each attending `frame_patches`."""
    per_block = 2 * patches * (4 * v.hidden ** 2 + v.mlp_mats * v.hidden * v.intermediate)
    per_block += 4 * v.hidden * patches * frame_patches
    m2 = v.merge ** 2
    merger = 2 * (patches // m2) * ((v.hidden * m2) ** 2 + v.hidden * m2 * v.out_hidden)
    return v.depth * per_block + merger


def forward_flops(dims: ModelDims, P: int, S: int, G: int, grouped: bool, *, causal: bool = True,
                  head: str = "responses", video_patches: int = 0, frame_patches: int = 0) -> float:
    """FLOPs of one forward (no backward) for one prompt of P tokens and G responses of S tokens, vision tower in.

    head: "responses" (logits only where they predict response tokens, G·S positions in both variants) or "all"
    (logits at every position, as a plain HF forward computes them). video_patches: patches of the prompt's video
    (0 for text-only); frame_patches: patches each patch attends to (per-frame attention)."""
    return _lm_forward(dims, P, S, G, grouped, causal, head) + _vision_forward(dims, G, grouped, video_patches,
                                                                                frame_patches)


def _lm_forward(dims: ModelDims, P, S, G, grouped: bool, causal: bool, head: str) -> float:
    tokens = P + G * S if grouped else G * (P + S)
    fwd = dims.layers * (dims.linear_per_token() * tokens
                         + dims.attn_per_pair() * attention_pairs(P, S, G, grouped, causal))
    head_tokens = G * S if head == "responses" else tokens
    return fwd + 2 * dims.hidden * dims.vocab * head_tokens


def _vision_forward(dims: ModelDims, G: int, grouped: bool, video_patches: int, frame_patches: int) -> float:
    if not video_patches or dims.vision is None:
        return 0.0
    return (1 if grouped else G) * vision_flops(dims.vision, video_patches, frame_patches or video_patches)


def step_flops(dims: ModelDims, P: int, S: int, G: int, grouped: bool, *, causal: bool = True,
               head: str = "responses", video_patches: int = 0, frame_patches: int = 0,
               train_vision: bool = True) -> float:
    """FLOPs of one forward+backward (3× forward) for one prompt of P tokens and G responses of S tokens; arguments
    as `forward_flops`. train_vision=False: a frozen vision tower (the trainer's `model.freeze_vision`) runs its
    forward only (1× instead of 3×)."""
    lm = _lm_forward(dims, P, S, G, grouped, causal, head)
    return 3 * lm + (3 if train_vision else 1) * _vision_forward(dims, G, grouped, video_patches, frame_patches)


def rho_flops(dims: ModelDims, P: int, S: int, G: int, **kwargs) -> float:
    """Combined ceiling: step FLOPs repeated / grouped (causal attention, LM head on responses by default)."""
    return step_flops(dims, P, S, G, False, **kwargs) / step_flops(dims, P, S, G, True, **kwargs)


def paper_reduction(G: int, prefix_over_suffix: float, P: int = 4096, dims: ModelDims = QWEN2_5_7B) -> float:
    """The paper's FLOPs reduction at group size G and prefix/suffix ratio (see the module docstring)."""
    S = P / prefix_over_suffix
    return rho_flops(dims, P, S, G, causal=False, head="responses")


# ---- one whole GRPO step: rollout + reference forward + update -----------------------------------------------------
def rollout_flops(dims: ModelDims, P: int, S: int, G: int, shared: bool, *, video_patches: int = 0,
                  frame_patches: int = 0) -> float:
    """FLOPs of sampling G responses of exactly S tokens for one prompt (forward only, KV cache):

        prefill  the prompt's P tokens once (shared: HFEngine) or G times (`generate(num_return_sequences=G)`),
                 causal (P²/2 pairs per copy), LM head on the last position of each copy
        video    encoded once in both: transformers >= 5 `generate` runs the vision tower before expanding the
                 inputs G ways and repeats only its output
        decode   the same in both: S - 1 one-token forwards per response (token 0 is sampled from the prefill's
                 logits), token t attending P + t keys: G (S-1) tokens, G (S-1)(P + S/2) pairs, LM head on each
    """
    layers, head = dims.layers, 2 * dims.hidden * dims.vocab
    copies = 1 if shared else G
    prefill = copies * (layers * (dims.linear_per_token() * P + dims.attn_per_pair() * P * P / 2) + head)
    steps = G * (S - 1)
    decode = layers * (dims.linear_per_token() * steps + dims.attn_per_pair() * steps * (P + S / 2)) + head * steps
    return prefill + decode + _vision_forward(dims, 1, True, video_patches, frame_patches)


def grpo_step_flops(dims: ModelDims, P: int, S: int, G: int, grouped: bool, *, reference: bool = True,
                    train_vision: bool = False, video_patches: int = 0, frame_patches: int = 0) -> float:
    """FLOPs of one GRPO step of one prompt: rollout (`rollout_flops`, shared when grouped) + the reference model's
    forward when the KL term is on (`forward_flops`) + the policy's forward and backward (`step_flops`)."""
    kw = {"video_patches": video_patches, "frame_patches": frame_patches}
    total = rollout_flops(dims, P, S, G, grouped, **kw) + step_flops(dims, P, S, G, grouped, train_vision=train_vision,
                                                                     **kw)
    return total + (forward_flops(dims, P, S, G, grouped, **kw) if reference else 0.0)


def rho_rollout(dims: ModelDims, P: int, S: int, G: int, **kwargs) -> float:
    """Rollout ceiling: `generate(num_return_sequences=G)` FLOPs / shared-prefix FLOPs (only the prefill differs)."""
    return rollout_flops(dims, P, S, G, False, **kwargs) / rollout_flops(dims, P, S, G, True, **kwargs)


def rho_forward(dims: ModelDims, P: int, S: int, G: int, **kwargs) -> float:
    """No-grad forward ceiling (the reference logprobs): repeated / grouped forward FLOPs."""
    return forward_flops(dims, P, S, G, False, **kwargs) / forward_flops(dims, P, S, G, True, **kwargs)


def rho_step(dims: ModelDims, P: int, S: int, G: int, **kwargs) -> float:
    """Whole-step ceiling: naive GRPO step FLOPs / mmpg GRPO step FLOPs (`grpo_step_flops`)."""
    return grpo_step_flops(dims, P, S, G, False, **kwargs) / grpo_step_flops(dims, P, S, G, True, **kwargs)


def dims_from_config(config) -> ModelDims:
    """ModelDims of a transformers config (text-only or VL; the VL vision tower included)."""
    text = config.get_text_config()
    heads = text.num_attention_heads
    vision = None
    vc = getattr(config, "vision_config", None)
    if vc is not None:
        gated = getattr(config, "model_type", "") == "qwen2_5_vl"
        vision = VisionDims(hidden=vc.hidden_size, depth=vc.depth, intermediate=vc.intermediate_size,
                            out_hidden=getattr(vc, "out_hidden_size", text.hidden_size),
                            merge=vc.spatial_merge_size, mlp_mats=3 if gated else 2)
    return ModelDims(hidden=text.hidden_size, layers=text.num_hidden_layers, heads=heads,
                     kv_heads=getattr(text, "num_key_value_heads", heads), intermediate=text.intermediate_size,
                     vocab=text.vocab_size, head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
                     vision=vision)
