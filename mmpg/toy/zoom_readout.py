"""How far a zoom checkpoint reads its answer off the clip, on the toy zoom task's held-out test videos: the rule
policy's trajectory of each (overview -> the rule's zoom -> the answer copied from the clip's written times),
teacher-forced through the model's own forward (`repeated_logprobs`: [prompt | whole conversation], the clip's
frames in the tool's turn), as training forwards it. Two measures (docs/performance.md, twelfth attempt):

- the answer turn's loss by the role of each token: the start's digits before its units, its units digit, its
  tenths, the same three of the end, and every other token of the turn (nats per token); and the share of test videos
  whose start is argmax-right digit for digit. A model that answers from the window alone leaves the start's units
  and tenths near a guess (ln 10 = 2.30 nats over ten digits);
- attention: at the position that predicts the start's units digit, the clip's pairs of frames (each one written
  time, its tokens summed) ordered by each head's weight, the last layer's heads; the rank of the best pair that shows
  the flash (0 = the most attended; about (pairs - 1) / 2 at chance) and the share of the clip's weight on the
  flash's pairs.

Each checkpoint is read behind the prompt its run trained on (its run's config.yaml: frames, the zoom tool, the tool's
schema listed or not); the test videos are the dataset's (data.videos) test split, their scenes redrawn from the
task and seed that wrote it, nothing but the frames decoded. `bash scripts/zoom_learning.sh --readout CHECKPOINT ...`
reads the experiment's checkpoints (`mmpg.toy.demo.zoom_learning` shows it on its zoom SFT rows).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from mmpg.errors import UserError

ROLES = ("start_lead", "start_units", "start_tenths", "end_lead", "end_units", "end_tenths", "text")


@dataclasses.dataclass(frozen=True)
class Readout:
    count: int  # test trajectories teacher-forced
    nats: dict[str, float]  # mean loss per token of each role (ROLES; a role with no token is left out)
    start_right: float  # share whose start is argmax-right in every token
    attention_count: int  # of them, those whose attention was read
    flash_rank: list[float]  # per head of the last layer: mean rank of the best flash pair (0 = most attended)
    flash_weight: list[float]  # per head: mean share of the clip's attention on the flash's pairs
    pairs: float  # mean pairs per clip (chance rank about (pairs - 1) / 2)

    def line(self) -> str:
        nats = ", ".join(f"{k} {v:.2f}" for k, v in self.nats.items())
        return (f"{self.count} test videos: nats {nats}; start right {100 * self.start_right:.1f} %; last layer, "
                f"{self.attention_count} videos ({self.pairs:.1f} pairs a clip): flash pair's rank "
                + ", ".join(f"{r:.1f}" for r in self.flash_rank) + "; its weight "
                + ", ".join(f"{w:.3f}" for w in self.flash_weight))


def digit_roles(pieces: list[str]) -> list[str] | None:
    """The role (ROLES) of each token of an answer turn given its decoded pieces, by the piece's first character in
    `<answer>START to END</answer>`; None when the turn holds no such answer of two numbers with a decimal point."""
    text = "".join(pieces)
    a0 = text.find("<answer>")
    if a0 < 0:
        return None
    a0 += len("<answer>")
    mid, z = text.find(" to ", a0), text.find("</answer>", a0)
    if not (a0 < mid < z):
        return None
    numbers = (("start", a0, text[a0:mid]), ("end", mid + 4, text[mid + 4:z]))
    if any("." not in n or not n.replace(".", "", 1).isdigit() for _, _, n in numbers):
        return None

    def role(c: int) -> str:
        for name, base, number in numbers:
            if base <= c < base + len(number):
                j, dot = c - base, number.index(".")
                return f"{name}_tenths" if j > dot else f"{name}_units" if j == dot - 1 else \
                    "text" if j == dot else f"{name}_lead"
        return "text"

    roles, offset = [], 0
    for piece in pieces:
        roles.append(role(offset))
        offset += len(piece)
    return roles


def flash_rank(weights, shows: list[bool]) -> tuple[list[float], list[float]]:
    """weights [heads, pairs]: attention on each pair of a clip; -> per head, the rank of the best pair that shows
    the flash in that head's order (0 = the most attended) and the share of the head's clip weight on such pairs."""
    import torch

    shown = torch.tensor(shows, dtype=torch.bool)
    order = weights.argsort(-1, descending=True)  # [heads, pairs]: pair indices, most attended first
    ranks = [float(shown[order[h]].nonzero()[0, 0]) for h in range(weights.shape[0])]
    share = (weights[:, shown].sum(-1) / weights.sum(-1).clamp_min(1e-12)).tolist()
    return ranks, share


def held_out_trajectories(data: Path, task, seed: int):
    """The rule policy's trajectory of each test video of a zoom dataset folder (`write_zoom_dataset(data, n, seed,
    task)`: test.json) with its call out of the loss (the answer turn alone in it), parsed as `sft.trajectories`
    lines are, and each video's clip pairs that show the flash: [(Trajectory, shows)]. The scenes are redrawn from
    `task` and `seed`; a video that is not theirs (events.json) is refused."""
    from mmpg.sft.trajectories import parse_trajectory
    from mmpg.toy.zoom_task import QUERY, flash_pairs, rule_trajectory, zoom_scenes

    test = json.loads((data / "test.json").read_text(encoding="utf-8"))
    events = json.loads((data / "events.json").read_text(encoding="utf-8"))
    scenes = {s.video_id: s for s in zoom_scenes(len(events), seed, task)}
    out = []
    for video_id in test:
        scene = scenes.get(video_id)
        if scene is None or [scene.events[1].start, scene.events[1].end] != events[video_id]["flash"]:
            raise UserError(f"{data / 'events.json'}: {video_id} is not a video of {task} with seed {seed}; the "
                            "readout redraws its scenes from them")
        record = {"video": f"videos/{video_id}.mp4", "query": QUERY,
                  "span": [scene.events[1].start, scene.events[1].end], **rule_trajectory(scene, task)}
        record["messages"][0]["weight"] = 0
        trajectory = parse_trajectory(record, f"{data / 'test.json'}: {video_id}", data)
        out.append((trajectory, flash_pairs(scene, task, *record["window"])))
    return out


class _Captures:
    """Keeps, from the model's next forward, the last decoder layer's attention weights (eager attention returns
    them) and the LM head's logits."""

    def __init__(self, model):
        self.attention = self.logits = None
        self.handles = [model.model.language_model.layers[-1].self_attn.register_forward_hook(self._attention),
                        model.lm_head.register_forward_hook(self._logits)]

    def _attention(self, module, args, output):
        if output[1] is None:
            raise RuntimeError("the attention returned no weights: load the model with attn_implementation='eager'")
        self.attention = output[1].detach()

    def _logits(self, module, args, output):
        self.logits = output.detach()

    def close(self):
        for handle in self.handles:
            handle.remove()


def read_one(model, processor, prompt, ids, own, clip, shows: list[bool], attention: bool = True) -> dict:
    """One trajectory teacher-forced: `prompt` (processor inputs of one prompt), `ids` / `own` / `clip` its
    completion (`trajectory_completion`), `shows` its clip's pairs that show the flash. -> {"roles": the answer
    tokens' roles, "nats": their losses, "start_right": bool, and with `attention` "clip_weights": [heads, pairs] the
    last layer's weight on each pair at the position that predicts the start's units digit}."""
    import torch

    from mmpg.grouping.logprobs import repeated_logprobs

    tokenizer = processor.tokenizer
    seen = _Captures(model)
    try:
        with torch.no_grad():
            logp = repeated_logprobs(model, prompt, ids[None], torch.ones_like(ids)[None], [1],
                                     completion_visuals=[clip])[0]
    finally:
        seen.close()
    at = own.nonzero()[:, 0]
    roles = digit_roles([tokenizer.decode([int(t)]) for t in ids[at]])
    if roles is None or "start_units" not in roles:
        raise UserError("the answer turn holds no '<answer>S to E</answer>' of two decimal numbers")
    start = at[[j for j, r in enumerate(roles) if r.startswith("start_")]]
    # seen.logits[0, t] predicts completion token t (the forward keeps the completion's positions and one before)
    out = {"roles": roles, "nats": [-float(logp[t]) for t in at],
           "start_right": bool((seen.logits[0, start].argmax(-1) == ids[start]).all())}
    if attention:
        width = prompt["input_ids"].shape[1]
        query = width + int(at[roles.index("start_units")]) - 1  # the position that predicts the units digit
        pad = tokenizer.convert_tokens_to_ids("<|video_pad|>")
        clip_at = (ids == pad).nonzero()[:, 0] + width
        if clip_at.numel() % len(shows):
            raise UserError(f"{clip_at.numel()} clip tokens for {len(shows)} pairs of frames")
        heads = seen.attention.shape[1]
        out["clip_weights"] = seen.attention[0, :, query, clip_at].reshape(heads, len(shows), -1).sum(-1)
    return out


def readout(checkpoint: Path, cfg, items, attention: int = 48) -> Readout:
    """Teacher-force `items` (`held_out_trajectories`) through `checkpoint` behind `cfg`'s prompt, frames and zoom tool
    (the run's config): the answer turn's loss by role, the share of starts argmax-right, and for the first
    `attention` items the last layer's attention on the clip's flash pairs."""
    import dataclasses as dc

    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from mmpg.data.frame_cache import open_frame_cache
    from mmpg.data.prompts import build_prompt_inputs, get_template
    from mmpg.data.video import load_video
    from mmpg.sft.trajectories import trajectory_completion
    from mmpg.train.setup import video_spec, zoom_environment

    if cfg.data.template != "zoom":
        raise UserError(f"{checkpoint}: its run trained with data.template {cfg.data.template!r}; the readout "
                        "teacher-forces zoom trajectories behind the prompt a run trained on: give a checkpoint of a "
                        "zoom run (data.template zoom)")
    processor = AutoProcessor.from_pretrained(checkpoint)
    model = AutoModelForImageTextToText.from_pretrained(checkpoint, attn_implementation="eager",
                                                        dtype=torch.float32).eval()
    family = model.config.model_type
    cache = open_frame_cache(cfg.data.frame_cache, cfg.data.frame_cache_gb)
    decode = cache.frames if cache is not None else load_video
    spec, env = video_spec(cfg, family), zoom_environment(cfg, family, cache)
    template = dc.replace(get_template(cfg.data.template), list_tools=cfg.lists_tools("sft"))
    stop = model.generation_config.eos_token_id
    stop = stop if isinstance(stop, int) else stop[0]
    nats = {r: [] for r in ROLES}
    right, ranks, shares, pairs = [], [], [], []
    for k, (trajectory, shows) in enumerate(items):
        sample = trajectory.sample
        video = decode(sample.video, spec, sample.clip_start, sample.clip_end)
        prompt = build_prompt_inputs(processor, [sample], [video], template)
        ids, own, clip = trajectory_completion(processor, trajectory, env, stop)
        try:
            one = read_one(model, processor, prompt, ids, own, clip, shows, attention=k < attention)
        except UserError as err:
            raise UserError(f"{sample.origin}: {err}") from None
        for role, loss in zip(one["roles"], one["nats"], strict=True):
            nats[role].append(loss)
        right.append(one["start_right"])
        if "clip_weights" in one:
            r, s = flash_rank(one["clip_weights"], shows)
            ranks.append(r)
            shares.append(s)
            pairs.append(len(shows))
    return Readout(count=len(items), nats={r: sum(v) / len(v) for r, v in nats.items() if v},
                   start_right=sum(right) / max(1, len(right)), attention_count=len(ranks),
                   flash_rank=[sum(c) / len(c) for c in zip(*ranks)] if ranks else [],
                   flash_weight=[sum(c) / len(c) for c in zip(*shares)] if shares else [],
                   pairs=sum(pairs) / max(1, len(pairs)))


def run_config(checkpoint: Path):
    """The config of the run that wrote `checkpoint` (RUN/checkpoints/step_N -> RUN/config.yaml)."""
    from mmpg.config.load import load_config

    path = Path(checkpoint).resolve().parent.parent / "config.yaml"
    if not path.is_file():
        raise UserError(f"{checkpoint}: no config.yaml in its run folder ({path}); the readout reads the prompt, "
                        "frames and zoom tool the run trained with from it")
    return load_config(path)
