"""FLOPs model of one GRPO training step (forward + backward) with and without the shared-prefix grouping, and the
ceilings printed beside every bench measurement. One prompt of P tokens (video placeholders included), G responses
of S tokens: repeated = G rows [prompt | response], T = G (P + S) tokens; grouped = one row [prompt | r_1 | ... |
r_G], T = P + G S. Per decoder layer, forward FLOPs (a multiply-add = 2):

    linear     2 T (h·Hq·d + 2 h·Hkv·d + Hq·d·h + 3 h·I)     q, k, v, o projections and the gated MLP
    attention  4 Hq·d · pairs                                 pairs, causal (what exact kernels compute): repeated
                                                              G (P+S)²/2, grouped P²/2 + G (S P + S²/2); dense (the
                                                              masked half counted too): G (P+S)², P² + G S (P+S)
    LM head    2 h V per position whose logits are taken      response-predicting positions only, in both variants
    vision     per block 2 n (4 h_v² + 3 h_v I_v) + 4 h_v n f, plus the merger: n patches, each attending the f of
               its frame; G times repeated, once grouped
Backward costs 2 × forward for every term, so no ratio depends on it. The ceilings:
    ρ_lin   = G (P+S) / (P + G S)      the token ratio: the linear layers' (and activations') gain
    ρ_attn  = causal pairs, repeated / grouped
    ρ_flops = step FLOPs, repeated / grouped, for a concrete model (`Geometry`), LM head and vision included
    ρ_rollout, ρ_fwd, ρ_step: per phase of a whole GRPO step (`--levels step`): generate(num_return_sequences=G) over
              the shared-prefix rollout (only the prefill differs), the reference's no-grad forward, and all three
`paper_reduction` is the paper's accounting (arXiv 2506.05433: dense attention, a Qwen2.5-7B-sized LM); `rho_flops`
counts causal pairs, as the exact kernels compute, which is stricter (docs/performance.md).
"""

from __future__ import annotations

from mmpg.models.geometry import QWEN2_5_7B, Geometry, Vision


def linear_per_token(g: Geometry) -> int:
    """Forward FLOPs of one layer's projections and MLP for one token."""
    h, d = g.hidden, g.d
    return 2 * (h * g.heads * d + 2 * h * g.kv_heads * d + g.heads * d * h + 3 * h * g.intermediate)


def attn_per_pair(g: Geometry) -> int:
    """Forward FLOPs of one (query, key) pair in one layer: Q·Kᵀ and P·V over all query heads."""
    return 4 * g.heads * g.d


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
def vision_flops(v: Vision, patches: int, frame_patches: int) -> float:
    """Forward FLOPs of the vision tower on one video of `patches` patches, each attending `frame_patches`."""
    per_block = 2 * patches * (4 * v.hidden ** 2 + v.mlp_mats * v.hidden * v.intermediate)
    per_block += 4 * v.hidden * patches * frame_patches
    m2 = v.merge ** 2
    merger = 2 * (patches // m2) * ((v.hidden * m2) ** 2 + v.hidden * m2 * v.out_hidden)
    return v.depth * per_block + merger


def forward_flops(dims: Geometry, P: int, S: int, G: int, grouped: bool, *, causal: bool = True,
                  head: str = "responses", video_patches: int = 0, frame_patches: int = 0) -> float:
    """FLOPs of one forward (no backward) for one prompt of P tokens and G responses of S tokens, vision tower in.

    head: "responses" (logits only where they predict response tokens, G·S positions in both variants) or "all"
    (logits at every position, as a plain HF forward computes them). video_patches: patches of the prompt's video
    (0 for text-only); frame_patches: patches each patch attends to (per-frame attention)."""
    return _lm_forward(dims, P, S, G, grouped, causal, head) + _vision_forward(dims, G, grouped, video_patches,
                                                                                frame_patches)


def _lm_forward(dims: Geometry, P, S, G, grouped: bool, causal: bool, head: str) -> float:
    tokens = P + G * S if grouped else G * (P + S)
    fwd = dims.layers * (linear_per_token(dims) * tokens
                         + attn_per_pair(dims) * attention_pairs(P, S, G, grouped, causal))
    head_tokens = G * S if head == "responses" else tokens
    return fwd + 2 * dims.hidden * dims.vocab * head_tokens


def _vision_forward(dims: Geometry, G: int, grouped: bool, video_patches: int, frame_patches: int) -> float:
    if not video_patches or dims.vision is None:
        return 0.0
    return (1 if grouped else G) * vision_flops(dims.vision, video_patches, frame_patches or video_patches)


def step_flops(dims: Geometry, P: int, S: int, G: int, grouped: bool, *, causal: bool = True,
               head: str = "responses", video_patches: int = 0, frame_patches: int = 0,
               train_vision: bool = True) -> float:
    """FLOPs of one forward+backward (3× forward) for one prompt of P tokens and G responses of S tokens; arguments
    as `forward_flops`. train_vision=False: a frozen vision tower (the trainer's `model.freeze_vision`) runs its
    forward only (1× instead of 3×)."""
    lm = _lm_forward(dims, P, S, G, grouped, causal, head)
    return 3 * lm + (3 if train_vision else 1) * _vision_forward(dims, G, grouped, video_patches, frame_patches)


def rho_flops(dims: Geometry, P: int, S: int, G: int, **kwargs) -> float:
    """Combined ceiling: step FLOPs repeated / grouped (causal attention, LM head on responses by default)."""
    return step_flops(dims, P, S, G, False, **kwargs) / step_flops(dims, P, S, G, True, **kwargs)


def paper_reduction(G: int, prefix_over_suffix: float, P: int = 4096, dims: Geometry = QWEN2_5_7B) -> float:
    """The paper's FLOPs reduction at group size G and prefix/suffix ratio: the step-FLOPs ratio with attention scores
    counted dense and the LM head on response positions, of a Qwen2.5-7B-sized LM at P = 4096 (6.54× at G 8 and
    10.78× at G 16 for P/S = 32, against the paper's 6.60× and 10.9×; why no accounting gives both: docs/notes.md)."""
    S = P / prefix_over_suffix
    return rho_flops(dims, P, S, G, causal=False, head="responses")


# ---- one whole GRPO step: rollout + reference forward + update -----------------------------------------------------
def rollout_flops(dims: Geometry, P: int, S: int, G: int, shared: bool, *, video_patches: int = 0,
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
    prefill = copies * (layers * (linear_per_token(dims) * P + attn_per_pair(dims) * P * P / 2) + head)
    steps = G * (S - 1)
    decode = layers * (linear_per_token(dims) * steps + attn_per_pair(dims) * steps * (P + S / 2)) + head * steps
    return prefill + decode + _vision_forward(dims, 1, True, video_patches, frame_patches)


def grpo_step_flops(dims: Geometry, P: int, S: int, G: int, grouped: bool, *, reference: bool = True,
                    train_vision: bool = False, video_patches: int = 0, frame_patches: int = 0) -> float:
    """FLOPs of one GRPO step of one prompt: rollout (`rollout_flops`, shared when grouped) + the reference model's
    forward when the KL term is on (`forward_flops`) + the policy's forward and backward (`step_flops`)."""
    kw = {"video_patches": video_patches, "frame_patches": frame_patches}
    total = rollout_flops(dims, P, S, G, grouped, **kw) + step_flops(dims, P, S, G, grouped, train_vision=train_vision,
                                                                     **kw)
    return total + (forward_flops(dims, P, S, G, grouped, **kw) if reference else 0.0)


def rho_rollout(dims: Geometry, P: int, S: int, G: int, **kwargs) -> float:
    """Rollout ceiling: `generate(num_return_sequences=G)` FLOPs / shared-prefix FLOPs (only the prefill differs)."""
    return rollout_flops(dims, P, S, G, False, **kwargs) / rollout_flops(dims, P, S, G, True, **kwargs)


def rho_forward(dims: Geometry, P: int, S: int, G: int, **kwargs) -> float:
    """No-grad forward ceiling (the reference logprobs): repeated / grouped forward FLOPs."""
    return forward_flops(dims, P, S, G, False, **kwargs) / forward_flops(dims, P, S, G, True, **kwargs)


def rho_step(dims: Geometry, P: int, S: int, G: int, **kwargs) -> float:
    """Whole-step ceiling: naive GRPO step FLOPs / mmpg GRPO step FLOPs (`grpo_step_flops`)."""
    return grpo_step_flops(dims, P, S, G, False, **kwargs) / grpo_step_flops(dims, P, S, G, True, **kwargs)


# ---- Q queries of one video: per-query grouping vs the tree (`mmpg.grouping.shares`) --------------------------------
# Each of Q queries has a prompt of P shared tokens (system text, video, template words) + t tail tokens (question,
# assistant header) and G responses of S tokens. Layouts of one step's forward, with their causal attention pairs:
#
#     naive      QG rows [shared | tail | response]              QG (P+t+S) tokens   QG (P+t+S)²/2
#     per query  Q rows [shared | tail | r_1 | ... | r_G]        Q (P+t+GS)          Q ((P+t)²/2 + G (S(P+t) + S²/2))
#     tree       one row [shared | tail_1 + r_1,1 | ...]          P + QG (t+S)        P²/2 + QG ((t+S) P + (t+S)²/2)
#
# (the tree repeats each tail per response: `mmpg.grouping.shares`). The vision tower encodes the video QG, Q and 1
# times. The LM head scores the QGS response-predicting positions in all three. Rollout: generate prefills QG copies
# of the P+t prompt, per query Q prompts, the tree the shared part once and each tail once against it; the decode is
# the same QG(S-1) one-token steps in all. The token ceilings over naive (`rho_lin_q`):
#     per query  QG(P+t+S) / (Q(P+t+GS)) = G(P+t+S) / (P+t+GS)
#     tree       QG(P+t+S) / (P + QG(t+S))
#     true tree  QG(P+t+S) / (P + Q(t+GS))     (each tail once per query: a third attention level; not built,
#                                               printed beside the others as what it would add)
# A lone query (Q = 1) is packed as per-query grouping in the tree too (`find_shares`: its whole prompt is its part).
LAYOUTS = ("naive", "per_query", "tree")


def _layout(layout: str, Q: int) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {', '.join(LAYOUTS)}")
    return "per_query" if layout == "tree" and Q == 1 else layout


def layout_tokens(layout: str, P, t, S, G: int, Q: int) -> float:
    """Tokens one step's forward holds for Q queries of one video (see above)."""
    layout = _layout(layout, Q)
    return {"naive": Q * G * (P + t + S), "per_query": Q * (P + t + G * S), "tree": P + Q * G * (t + S)}[layout]


def layout_pairs(layout: str, P, t, S, G: int, Q: int) -> float:
    """Causal (query, key) pairs per layer of one step's forward (see above)."""
    layout = _layout(layout, Q)
    if layout == "naive":
        return Q * G * (P + t + S) ** 2 / 2
    if layout == "per_query":
        return Q * ((P + t) ** 2 / 2 + G * (S * (P + t) + S * S / 2))
    return P * P / 2 + Q * G * ((t + S) * P + (t + S) ** 2 / 2)


def rho_lin_q(layout: str, P, t, S, G: int, Q: int) -> float:
    """Token ratio naive / layout."""
    return layout_tokens("naive", P, t, S, G, Q) / layout_tokens(layout, P, t, S, G, Q)


def rho_lin_true_tree(P, t, S, G: int, Q: int) -> float:
    """Token ratio naive / the true three-level tree (each tail once per query, not once per response)."""
    return layout_tokens("naive", P, t, S, G, Q) / (P + Q * (t + G * S) if Q > 1 else P + t + G * S)


def _encodes(layout: str, G: int, Q: int) -> int:
    layout = _layout(layout, Q)
    return {"naive": Q * G, "per_query": Q, "tree": 1}[layout]


def forward_flops_q(dims: Geometry, layout: str, P, t, S, G: int, Q: int, *, video_patches: int = 0,
                    frame_patches: int = 0) -> float:
    """One forward (no backward) of the step's Q·G responses in `layout`, LM head on response positions, vision in."""
    lm = dims.layers * (linear_per_token(dims) * layout_tokens(layout, P, t, S, G, Q)
                        + attn_per_pair(dims) * layout_pairs(layout, P, t, S, G, Q))
    lm += 2 * dims.hidden * dims.vocab * Q * G * S
    vision = 0.0
    if video_patches and dims.vision is not None:
        vision = _encodes(layout, G, Q) * vision_flops(dims.vision, video_patches, frame_patches or video_patches)
    return lm + vision


def update_flops_q(dims: Geometry, layout: str, P, t, S, G: int, Q: int, *, train_vision: bool = False,
                   **video) -> float:
    """Forward + backward of the policy: 3× the LM forward, the vision tower 3× when trained, else 1×."""
    total = forward_flops_q(dims, layout, P, t, S, G, Q, **video)
    vision = total - forward_flops_q(dims, layout, P, t, S, G, Q)
    return 3 * (total - vision) + (3 if train_vision else 1) * vision


def rollout_flops_q(dims: Geometry, layout: str, P, t, S, G: int, Q: int, *, video_patches: int = 0,
                    frame_patches: int = 0) -> float:
    """Sampling G responses of exactly S tokens for each of the Q queries (forward only, K/V cache): the prefill
    differs by layout (above), the decode is the same; the video is encoded once per prefill call of a prompt in
    naive and per query (transformers' generate encodes before expanding), once in the tree."""
    layers, head, lin, attn = dims.layers, 2 * dims.hidden * dims.vocab, linear_per_token(dims), attn_per_pair(dims)
    layout = _layout(layout, Q)
    full = layers * (lin * (P + t) + attn * (P + t) ** 2 / 2)
    if layout == "tree":
        prefill = layers * (lin * (P + Q * t) + attn * (P * P / 2 + Q * (t * P + t * t / 2))) + Q * head
    else:
        copies = Q * G if layout == "naive" else Q
        prefill = copies * (full + head)
    steps = Q * G * (S - 1)
    decode = layers * (lin * steps + attn * steps * (P + t + S / 2)) + head * steps
    vision = 0.0
    if video_patches and dims.vision is not None:
        vision = (1 if layout == "tree" else Q) * vision_flops(dims.vision, video_patches,
                                                                 frame_patches or video_patches)
    return prefill + decode + vision


def step_flops_q(dims: Geometry, layout: str, P, t, S, G: int, Q: int, *, reference: bool = True,
                 train_vision: bool = False, **video) -> float:
    """One GRPO step of the Q queries: rollout + reference forward (when the KL term is on) + the update."""
    total = rollout_flops_q(dims, layout, P, t, S, G, Q, **video)
    total += update_flops_q(dims, layout, P, t, S, G, Q, train_vision=train_vision, **video)
    return total + (forward_flops_q(dims, layout, P, t, S, G, Q, **video) if reference else 0.0)


def eval_flops_q(dims: Geometry, layout: str, P, t, S, Q: int, **video) -> float:
    """Greedy evaluation of Q queries of one video, one answer of S tokens each (the rollout with G = 1; naive is
    per query there: generate with one return sequence prefills each prompt once)."""
    return rollout_flops_q(dims, "per_query" if layout == "naive" else layout, P, t, S, 1, Q, **video)


def ceilings_q(dims: Geometry, layout: str, P, t, S, G: int, Q: int, *, reference: bool = True,
               train_vision: bool = False, **video) -> dict:
    """Per phase, FLOPs of naive / FLOPs of `layout`: rho_rollout, rho_fwd (reference), rho_flops (update),
    rho_step (all), rho_lin (tokens)."""
    def ratio(fn, **kw):
        return fn(dims, "naive", P, t, S, G, Q, **kw, **video) / fn(dims, layout, P, t, S, G, Q, **kw, **video)

    return {"rho_lin": rho_lin_q(layout, P, t, S, G, Q), "rho_rollout": ratio(rollout_flops_q),
            "rho_fwd": ratio(forward_flops_q), "rho_flops": ratio(update_flops_q, train_vision=train_vision),
            "rho_step": ratio(step_flops_q, reference=reference, train_vision=train_vision)}
