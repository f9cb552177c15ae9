"""The shape of a model, read from a checkpoint's config.json (no weights) or taken from a released preset.

One `Geometry` (the decoder) with an optional `Vision` (the vision tower) is what every size-dependent number of mmpg
starts from: the FLOPs ceilings (`mmpg.bench.flops`), the memory and time plan (`mmpg.plan`) and the doctor's speed
rows. `from_config_dict` is the one reader of a config.json (Qwen2.5-VL and Qwen3-VL: `text_config` +
`vision_config`; text-only Qwen2 / Qwen3: sizes at the top level). `MODELS` holds the released sizes, each written
once; `QWEN2_5_7B` is the Qwen2.5-VL-7B LM without its vision tower.

Parameter count of one decoder layer (Qwen2 / Qwen2.5-VL: q, k, v biases; Qwen3 / Qwen3-VL: q/k RMSNorm instead):

    attention  h·Hq·d + 2·h·Hkv·d + Hq·d·h  (+ Hq·d + 2·Hkv·d biases | + 2·d norms)
    MLP        3·h·I                          gated (gate, up, down)
    norms      2·h
    model      L·layer + V·h (embedding) + V·h (LM head, unless tied) + h (final norm)

Vision tower (patch p, temporal patch t, C = 3 channels, hidden hv, MLP width Iv, depth D, merge m):
    patch embed  C·t·p²·hv;  block  4·hv² + 4·hv (qkv, proj) + mats·hv·Iv + (mats-1)·Iv + hv (MLP, biases) + norms
    merger       (hv·m²)² + hv·m² + hv·m²·out + out (+ its norm); Qwen3-VL adds a position table (n_pos·hv) and one
                 merger per deepstack tap.
`tests/test_plan.py` checks the count against models built on the meta device from the tiny configs.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from mmpg.errors import UserError


@dataclasses.dataclass(frozen=True)
class Vision:
    """Vision tower sizes."""

    hidden: int
    depth: int
    intermediate: int
    out_hidden: int  # the LM hidden size the merger projects to
    patch: int = 14
    temporal_patch: int = 2
    merge: int = 2  # spatial merge: merge² patches per LM token
    mlp_mats: int = 3  # 3: gated MLP (Qwen2.5-VL), 2: plain (Qwen3-VL)
    position_embeddings: int = 0  # Qwen3-VL's learned position table
    deepstack: int = 0  # Qwen3-VL: extra mergers feeding LM layers

    @property
    def patch_dim(self) -> int:
        """Values of one patch in pixel_values_videos: C·t·p²."""
        return 3 * self.temporal_patch * self.patch ** 2

    def params(self) -> int:
        hv, iv, m2 = self.hidden, self.intermediate, self.merge ** 2
        mlp = self.mlp_mats * hv * iv + (self.mlp_mats - 1) * iv + hv
        norms = 2 * hv * (2 if self.mlp_mats == 2 else 1)  # LayerNorm (weight + bias) in Qwen3-VL, RMSNorm in 2.5
        block = 4 * hv * hv + 4 * hv + mlp + norms
        merger = (hv * m2) ** 2 + hv * m2 + hv * m2 * self.out_hidden + self.out_hidden
        merger_norm = 2 * hv if self.mlp_mats == 2 else hv
        embed = self.patch_dim * hv + (hv if self.mlp_mats == 2 else 0)
        deep = self.deepstack * (merger + 2 * hv * m2)  # deepstack mergers norm the merged width
        return embed + self.depth * block + merger + merger_norm + self.position_embeddings * hv + deep

    def merger_params(self) -> int:
        """The patch merger's parameters (`visual.merger`: its norm and two-layer MLP), what model.train_merger
        trains."""
        hv, m2 = self.hidden, self.merge ** 2
        norm = 2 * hv if self.mlp_mats == 2 else hv
        return norm + (hv * m2) ** 2 + hv * m2 + hv * m2 * self.out_hidden + self.out_hidden


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Decoder sizes (and the vision tower of a VL model). head_dim 0 means hidden // heads."""

    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    head_dim: int = 0
    tied: bool = False
    qk_norm: bool = False  # Qwen3 family: q/k RMSNorm, no q/k/v biases
    vision: Vision | None = None

    @property
    def d(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def layer_params(self) -> int:
        h, d, hq, hkv = self.hidden, self.d, self.heads, self.kv_heads
        attn = h * hq * d + 2 * h * hkv * d + hq * d * h + (2 * d if self.qk_norm else hq * d + 2 * hkv * d)
        return attn + 3 * h * self.intermediate + 2 * h

    def lm_params(self) -> int:
        return self.layers * self.layer_params() + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden

    def params(self) -> int:
        return self.lm_params() + (self.vision.params() if self.vision else 0)

    def lora_params(self, r: int, targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj")) -> int:
        """Adapter parameters: r·(in + out) per targeted linear of every decoder layer."""
        h, qd, kvd, i = self.hidden, self.heads * self.d, self.kv_heads * self.d, self.intermediate
        shapes = {"q_proj": (h, qd), "k_proj": (h, kvd), "v_proj": (h, kvd), "o_proj": (qd, h),
                  "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}
        return self.layers * sum(r * sum(shapes[t]) for t in targets if t in shapes)


def _q25_vision(out: int) -> Vision:
    return Vision(hidden=1280, depth=32, intermediate=3420, out_hidden=out, patch=14)


def _q3_vision(out: int, big: bool) -> Vision:
    return Vision(hidden=1152 if big else 1024, depth=27 if big else 24, intermediate=4304 if big else 4096,
                  out_hidden=out, patch=16, mlp_mats=2, position_embeddings=2304, deepstack=3)


# Published configs (config.json of each Hugging Face repository). Qwen3-VL's vision numbers (depth 24/27, width
# 1024/1152, MLP 4096/4304, 2304 position embeddings, 3 deepstack taps) are the ones least certain here: check them
# against a downloaded config.json (`--model-config`) before relying on a plan to the last gigabyte.
MODELS = {
    "qwen2.5-vl-3b": Geometry("Qwen2.5-VL-3B", 2048, 36, 16, 2, 11008, 151936, tied=True, vision=_q25_vision(2048)),
    "qwen2.5-vl-7b": Geometry("Qwen2.5-VL-7B", 3584, 28, 28, 4, 18944, 152064, vision=_q25_vision(3584)),
    "qwen2.5-vl-32b": Geometry("Qwen2.5-VL-32B", 5120, 64, 40, 8, 27648, 152064, vision=_q25_vision(5120)),
    "qwen2.5-vl-72b": Geometry("Qwen2.5-VL-72B", 8192, 80, 64, 8, 29568, 152064, vision=_q25_vision(8192)),
    "qwen3-vl-2b": Geometry("Qwen3-VL-2B", 2048, 28, 16, 8, 6144, 151936, 128, tied=True, qk_norm=True,
                            vision=_q3_vision(2048, False)),
    "qwen3-vl-4b": Geometry("Qwen3-VL-4B", 2560, 36, 32, 8, 9728, 151936, 128, tied=True, qk_norm=True,
                            vision=_q3_vision(2560, False)),
    "qwen3-vl-8b": Geometry("Qwen3-VL-8B", 4096, 36, 32, 8, 12288, 151936, 128, qk_norm=True,
                            vision=_q3_vision(4096, True)),
    "qwen3-vl-32b": Geometry("Qwen3-VL-32B", 5120, 64, 64, 8, 25600, 151936, 128, qk_norm=True,
                             vision=_q3_vision(5120, True)),
    # text-only, for the long-context point (Qwen3-8B: hidden 4096, 36 layers, 32/8 heads of 128, I 12288)
    "qwen3-8b": Geometry("Qwen3-8B", 4096, 36, 32, 8, 12288, 151936, 128, qk_norm=True),
}
# The paper's FLOPs figures are for a Qwen2.5-7B-sized LM (`mmpg.bench.flops.paper_reduction`).
QWEN2_5_7B = dataclasses.replace(MODELS["qwen2.5-vl-7b"], name="Qwen2.5-7B", vision=None)


def from_config_dict(cfg: dict, name: str) -> Geometry:
    """Geometry of a transformers config.json (VL: text_config + vision_config; text-only: top level); `name` names
    the model in errors and plans. A loaded config object gives its dict by `config.to_dict()`."""
    text = cfg.get("text_config") or cfg
    need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
    missing = [k for k in need if k not in text]
    if missing:
        raise UserError(f"{name}: config.json lacks {', '.join(missing)}; is it a Qwen-VL or Qwen checkpoint?")
    qwen3 = cfg.get("model_type", "").startswith("qwen3")
    vision = None
    vc = cfg.get("vision_config")
    if vc:
        vision = Vision(hidden=vc.get("hidden_size", vc.get("embed_dim", 1280)), depth=vc["depth"],
                        intermediate=vc.get("intermediate_size", 4 * vc.get("hidden_size", 1280)),
                        out_hidden=vc.get("out_hidden_size", text["hidden_size"]), patch=vc.get("patch_size", 14),
                        temporal_patch=vc.get("temporal_patch_size", 2), merge=vc.get("spatial_merge_size", 2),
                        mlp_mats=2 if qwen3 else 3,
                        position_embeddings=vc.get("num_position_embeddings", 0) if qwen3 else 0,
                        deepstack=len(vc.get("deepstack_visual_indexes", [])) if qwen3 else 0)
    heads = text["num_attention_heads"]
    return Geometry(name, text["hidden_size"], text["num_hidden_layers"], heads,
                    text.get("num_key_value_heads", heads), text["intermediate_size"], text["vocab_size"],
                    text.get("head_dim") or text["hidden_size"] // heads,
                    tied=bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
                    qk_norm=qwen3, vision=vision)


def resolve(path: str) -> Geometry:
    """A preset name (qwen2.5-vl-7b, Qwen/Qwen2.5-VL-7B-Instruct, ...) or a folder holding config.json."""
    p = Path(path).expanduser()
    if (p / "config.json").is_file():
        return from_config_dict(json.loads((p / "config.json").read_text()), p.name)
    key = path.rsplit("/", 1)[-1].lower().replace("-instruct", "").replace("-thinking", "")
    if key in MODELS:
        return MODELS[key]
    raise UserError(f"model {path!r}: no config.json there and not a preset; give a checkpoint folder or one of "
                    f"{', '.join(MODELS)}")
