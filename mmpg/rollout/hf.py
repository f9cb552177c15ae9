"""The HF engine: the training model samples its own rollouts, each prompt (and its video) prefilled once.

`model.generate(num_return_sequences=G)` repeats the inputs G times before the prefill, so a long video goes through
the vision tower and every decoder layer G times. Here:

    B prompts, left-padded ──prefill (one forward, vision tower once, use_cache)──> cache [B, L], logits [B, V]
      decode="cascade" (auto): each prefix stays once in a `SharedPrefixCache` and is read once per step for all
                               its rows (`mmpg.rollout.cascade`; the kernel checked by `mmpg.rollout.decode_choice`)
      decode="copy":           cache rows repeated G_b ways -> [N, L] (the reference path)
    token 0 of every row: sampled from its prompt's prefill logits; token t > 0: one forward of the running rows

Contract: both decode modes give the same tokens (greedy and seeded). The prompt gets exactly the positions
`grouped_logprobs` gives it (`mmpg.grouping.adapters.prefix_positions`) and completion token t sits at start + t on
every axis, start being where the model's own forward places the next text token; positions are passed to every
forward, so rollout and training logprobs agree, the model's `rope_deltas` is never used or changed, and unequal
group sizes work. Queries of one video are sampled side by side and prefilled as one packed row
(`mmpg.rollout.shares`); long prompts are prefilled in chunks (`mmpg.rollout.chunks`); `last_stats` says what the
last call prefilled. Sampling settings come only from `SamplingParams` (the checkpoint's generation_config gives its
eos and pad ids, nothing else). docs/rollouts.md, "The HF engine", has the details.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from mmpg.grouping.adapters import prefix_positions, row_positions
from mmpg.grouping.inputs import (
    check_whole_videos, merge_visuals, pad_token_id, placeholder_token_ids, prompt_attention_mask, select_prompts,
    split_visuals_per_prompt,
)
from mmpg.grouping.shares import share_order
from mmpg.grouping.patch import base_model, model_kind
from mmpg.rollout.cascade import SharedPrefixCache
from mmpg.rollout.cascade_attention import CASCADE_KWARG, CascadeCall, cascade_attention_enabled
from mmpg.rollout.decode_choice import DecodeChoice
from mmpg.rollout.engine import (
    FINISH_LENGTH, FINISH_STOP, Rollout, RolloutEngine, SamplingParams, group_sizes_for,
)
from mmpg.rollout.prefill import _VISUAL_KEYS, Prefill
from mmpg.rollout.sampling import next_tokens
from mmpg.rollout.shares import decode_shares, prefill_stats, shared_prefill

DECODE_MODES = ("auto", "copy", "cascade")

def resolve_decode(decode: str) -> str:
    """"auto" -> cascade (on CUDA its kernel is checked against copy decoding first: `mmpg.rollout.decode_choice`);
    others as given."""
    return "cascade" if decode == "auto" else decode


class HFEngine(Prefill, RolloutEngine):
    """Shared-prefix sampling with a transformers model of a family `mmpg.grouping` supports.

    model: the policy (any device and dtype; its train/eval mode is restored after each call).
    processor: the model's processor or tokenizer, used to decode the responses."""

    def __init__(self, model, processor, all_done: Callable[[bool], bool] | None = None, decode: str = "auto",
                 cascade_backend: str = "auto", share_videos: bool = True, prefill_chunk: int = 0,
                 decode_check: str = "auto", keep_turns: bool = True):
        model = base_model(model)  # a peft PeftModel: the transformers model inside it (LoRA wrappers included)
        model_kind(model)  # refuses unsupported model types with a clear message
        if decode not in DECODE_MODES:
            raise ValueError(f"HFEngine decode={decode!r}; choose one of {', '.join(DECODE_MODES)}")
        if prefill_chunk < 0:
            raise ValueError(f"HFEngine prefill_chunk={prefill_chunk}; give a token count >= 0 (0: no chunking)")
        self.model = model
        self.processor = processor
        # "cascade": each prompt's K/V held once (`mmpg.rollout.cascade`); "copy": the prefill's cache copied G ways
        # (DynamicCache), kept for A/B and as the reference. Same tokens either way (tested on the CPU). "auto"
        # (default): cascade, its kernel chosen and checked on the run's batches (`mmpg.rollout.decode_choice`)
        self.decode = decode
        self.cascade_backend = cascade_backend  # auto, sdpa, flash or math (`mmpg.rollout.cascade_kernels`)
        # decode_check: auto (on for CUDA), on, off: the chosen cascade kernel against copy decoding
        self._path: str | None = None
        # the decode check's forwards run inside `self.check_scope()` (`RolloutEngine.check_scope`)
        self.choice = DecodeChoice(resolve_decode(decode), cascade_backend, decode_check)
        self.last_kv_bytes: int | None = None  # K/V bytes the cache held after the last call's final decode step
        # the last call's prefill, for the trainer and eval (`mmpg.rollout.shares.prefill_stats`): prompts, prefixes
        # (prefills of a leading part: one per share, B without sharing), prefix_tokens, shared_prompts
        self.last_stats: dict | None = None
        # cascade decoding: adjacent prompts of one video share its prefill and K/V (`mmpg.rollout.shares`, found from
        # the inputs); False: every prompt prefilled on its own (A/B runs, `algorithm.share_videos=false`)
        self.share_videos = share_videos
        # prompts longer than this many tokens are prefilled in chunks of it, and their videos encoded in frame
        # chunks of at most this many merged tokens (`mmpg.rollout.chunks`); 0 or a shorter batch: one forward
        self.prefill_chunk = prefill_chunk
        # Synced decoding for sharded models (ZeRO-3 gathers weights inside every forward, so every rank must run
        # the same number of forwards): all_done(this_rank_done) -> whether every rank is done. A rank that is done
        # early runs one-token idle forwards until then. None: stop as soon as this process is done.
        self.all_done = all_done
        # multi-turn rollouts: each branch's K/V kept between turns (`generate_branches`); False: `generate_branches`
        # samples the first turn alone and the caller re-sends every later turn's conversation (the reference)
        self.keep_turns = keep_turns
        params = inspect.signature(model.forward).parameters
        # transformers renamed `past_key_values` to `cache` during 5.x; accept either
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def generate_groups(self, prompt_inputs, group_size: int | Sequence[int], sampling: SamplingParams | None = None,
                        *, prompt_seeds: Sequence[int] | None = None, videos: Sequence | None = None) -> Rollout:
        """Sample G_b responses for each of the B prompts. See `mmpg.rollout.engine.Rollout` for the layout and
        `mmpg.rollout.sampling` for which distribution `Rollout.logprobs` comes from.

        prompt_seeds: optional B ints. Then response j of prompt b is drawn from its own generator seeded by
        (prompt_seeds[b], j), so its tokens do not depend on the other prompts of the batch (a trainer that splits
        a global batch over ranks samples the same responses as one process; `sampling.seed` is then unused).
        videos: ignored; the policy reads each video from `prompt_inputs` (its pixel_values_videos)."""
        sampling = sampling or SamplingParams()
        if "input_ids" not in prompt_inputs:
            raise ValueError("prompt_inputs needs 'input_ids' (the processor output for the B prompts)")
        check_whole_videos(prompt_inputs, "sampling with the HF engine")
        attn = prompt_attention_mask(prompt_inputs)
        sizes = group_sizes_for(group_size, int(prompt_inputs["input_ids"].shape[0]))
        if prompt_seeds is not None and len(prompt_seeds) != len(sizes):
            raise ValueError(f"{len(prompt_seeds)} prompt seeds for {len(sizes)} prompts; give one per prompt")
        empty = (attn.sum(dim=1) == 0).nonzero()
        if empty.numel():
            raise ValueError(f"prompt {int(empty[0])} is empty (all-zero attention_mask); drop it from the batch")
        order = self._share_order(prompt_inputs)
        if order != sorted(order):  # a video's prompts apart in the batch: sampled side by side, answered in order
            part = select_prompts(self.model, prompt_inputs, order, pad_token_id(self.model))
            seeds = None if prompt_seeds is None else [prompt_seeds[b] for b in order]
            out = self.generate_groups(part, [sizes[b] for b in order], sampling, prompt_seeds=seeds)
            return _rows_back(out, order, sizes)
        with self._sampling_mode():
            return self._generate(prompt_inputs, sizes, sampling, prompt_seeds)

    # ---- multi-turn: the K/V kept between turns -----------------------------------------------------------------
    def generate_branches(self, prompt_inputs, group_size: int | Sequence[int], sampling: SamplingParams | None = None,
                          *, prompt_seeds: Sequence[int] | None = None) -> tuple[Rollout, Branches | None]:
        """The first turn of multi-turn rollouts (`mmpg.rollout.multiturn`): `generate_groups`, the cache kept.
        Returns the rollout and its `Branches` (every row's K/V, the prompts' as prefilled), which
        `continue_branches` extends turn by turn; None where the K/V cannot be kept (copy decoding, `keep_turns=False`):
        the caller then re-sends each branch's conversation. Synced decoding (several ranks): every rank runs the
        same forwards turn by turn (`continue_branches`, `idle_turn`)."""
        sampling = sampling or SamplingParams()
        if not self.keep_turns or resolve_decode(self.decode) != "cascade" or not self._is_vl:
            return self.generate_groups(prompt_inputs, group_size, sampling, prompt_seeds=prompt_seeds), None
        sizes = group_sizes_for(group_size, int(prompt_inputs["input_ids"].shape[0]))
        order = self._share_order(prompt_inputs)
        inputs, run_sizes, seeds = prompt_inputs, sizes, prompt_seeds
        if order != sorted(order):  # sampled in the share order (as `generate_groups`), answered in the caller's
            inputs = select_prompts(self.model, prompt_inputs, order, pad_token_id(self.model))
            run_sizes = [sizes[b] for b in order]
            seeds = None if prompt_seeds is None else [prompt_seeds[b] for b in order]
        with self._sampling_mode():
            out, branches = self._generate(inputs, run_sizes, sampling, seeds, keep=True)
        if order != sorted(order):
            out = _rows_back(out, order, sizes)
            if branches is not None:
                starts = [sum(sizes[:b]) for b in range(len(sizes))]
                engine_rows = [starts[b] + j for b in order for j in range(sizes[b])]  # engine row k = caller row
                branches.engine_row = torch.tensor(engine_rows).argsort()
        return out, branches

    def continue_branches(self, branches: Branches, rows: Sequence[int], completions: Sequence[torch.Tensor],
                          chunk_lengths: Sequence[int], clips: Sequence[Sequence[dict]],
                          sampling: SamplingParams | None = None, *,
                          row_seeds: Sequence[int] | None = None) -> Rollout:
        """A later turn of the branches `rows` (caller row ids, increasing), one response each, behind their kept K/V.
        completions[k]: row k's whole completion so far, its last chunk_lengths[k] tokens not yet fed (the previous
        turn's last token, then the tool's turn); clips[k]: the row's clips so far (the tool turn's is the last,
        where the chunk holds its placeholders). row_seeds: as `generate_groups`'s prompt_seeds, one per row. Every
        row of `branches` not named here has ended and its K/V is dropped."""
        sampling = sampling or SamplingParams()
        device = self.model.get_input_embeddings().weight.device
        cache = branches.cache
        engine = [int(branches.engine_row[r]) for r in rows]
        order = sorted(range(len(rows)), key=lambda k: engine[k])  # the cache's rows are in the engine's order
        chunks, positions, starts, visuals = [], [], [], []
        placeholders = torch.tensor(placeholder_token_ids(self.model))
        for k in order:
            tokens, c = completions[k].cpu(), int(chunk_lengths[k])
            row_clips = [x for x in clips[k] if x]
            pos = row_positions(self.model, tokens, merge_visuals(row_clips) if row_clips else {},
                                branches.starts[int(branches.prompt_of[engine[k]])])  # [3, L]: the tree's positions
            chunks.append(tokens[-c:])
            positions.append(pos[:, -c:])
            starts.append(int(pos[0, -1]) + 1)  # the chunk ends in text: the turn's first token comes next
            if bool(torch.isin(tokens[-c:], placeholders).any()):
                visuals.append(row_clips[-1])
        width = max(c.numel() for c in chunks)
        pad = pad_token_id(self.model)
        ids = torch.stack([F.pad(c, (width - c.numel(), 0), value=pad) for c in chunks]).to(device)  # left-padded
        chunk_mask = torch.stack([F.pad(torch.ones_like(c, dtype=torch.bool), (width - c.numel(), 0))
                                  for c in chunks]).to(device)
        pos = torch.stack([F.pad(p, (width - p.shape[1], 0), value=int(p[0, 0])) for p in positions], dim=1)
        forward_visuals = {key: v.to(device) for key, v in merge_visuals(visuals).items() if key in _VISUAL_KEYS} \
            if visuals else {}
        engine_rows = torch.tensor(sorted(engine), device=device)
        cache.begin_turn(engine_rows, branches.prompt_of.to(device)[engine_rows], chunk_mask,
                         width + sampling.max_new_tokens)
        tokens = sum(c.numel() for c in chunks)
        self.last_stats = {"prompts": len(chunks), "prefixes": len(chunks), "prefix_tokens": tokens,
                           "shared_prompts": 0}  # the tool turns' chunks (`mmpg.rollout.shares.prefill_stats`'s keys)
        seeds = None if row_seeds is None else [row_seeds[k] for k in order]
        if self.all_done is not None and not self.all_done(not visuals) and not visuals:
            # another rank's chunk holds a clip: ZeRO-3 gathers the vision tower's weights inside the forward, in
            # the forward's module order, so this one holds a stand-in clip too, at a padding position none reads
            token, forward_visuals = self._stand_in_clip(device)
            ids = torch.cat([torch.full_like(ids[:, :1], pad), ids], dim=1)
            ids[0, 0] = token
            chunk_mask = torch.cat([torch.zeros_like(chunk_mask[:, :1]), chunk_mask], dim=1)
            pos = torch.cat([pos[..., :1], pos], dim=-1)
            width += 1
        watched = (self._cache_kwarg, "logits_to_keep")
        call = CascadeCall(cache, branches.path, model_inputs=watched)
        marker = torch.ones(1, 1, 0, 0, dtype=torch.bool, device=device)  # the cascade attention masks itself
        n = len(order)
        with self._sampling_mode(), cascade_attention_enabled(self.model):
            logits = self.model(input_ids=ids, attention_mask=marker, position_ids=pos.to(device), use_cache=True,
                                logits_to_keep=1, **{self._cache_kwarg: cache, CASCADE_KWARG: call},
                                **forward_visuals).logits[:, -1]
            out = self._decode(call, logits, torch.ones(n, 1, device=device), torch.tensor(starts, device=device),
                               torch.arange(n, device=device), [1] * n, sampling, seeds)
        cache.retire_live()
        return _rows_back(out, order, [1] * n) if order != sorted(order) else out

    @property
    def keeps_branches(self) -> bool:
        """Whether multi-turn rollouts keep the K/V between turns here (`generate_branches`): the same answer on every
        rank (their decode kernel is chosen together)."""
        return self.keep_turns and self._is_vl and resolve_decode(self.decode) == "cascade" and self._path != "copy"

    def idle_turn(self) -> None:
        """Synced decoding: a rank none of whose branches goes on while another's do runs the forwards a
        `continue_branches` runs (the vote on clips; the chunk's forward, holding a stand-in clip where another rank's
        chunk holds one; one forward per decode step until every rank is done), results discarded."""
        device = self.model.get_input_embeddings().weight.device
        with self._sampling_mode():
            if self.all_done(True):
                self._idle_step(device)
            else:
                token, visuals = self._stand_in_clip(device)
                ids = torch.full((1, 1), token, dtype=torch.long, device=device)
                pos = torch.zeros(1, 1, dtype=torch.long, device=device)
                self.model(input_ids=ids, position_ids=pos[None].expand(3, 1, 1), use_cache=False, logits_to_keep=1,
                           **visuals)
            while not self.all_done(True):
                self._idle_step(device)

    def _stand_in_clip(self, device) -> tuple[int, dict]:
        """A clip of one merged token of zeros: (the video token, its visual inputs), for forwards that must run the
        vision tower as another rank's do (ZeRO-3 gathers its weights in every forward)."""
        vc = self.model.config.vision_config
        merge = int(getattr(vc, "spatial_merge_size", 2))
        dim = int(vc.in_channels) * int(getattr(vc, "temporal_patch_size", 2)) * int(vc.patch_size) ** 2
        pixels = torch.zeros(merge * merge, dim, dtype=self.model.dtype, device=device)
        grid = torch.tensor([[1, merge, merge]], device=device)
        return int(self.model.config.video_token_id), {"pixel_values_videos": pixels, "video_grid_thw": grid}

    @contextlib.contextmanager
    def _sampling_mode(self):
        """Eval mode and no autograd inside; each module's train/eval mode restored after."""
        modes = {m: m.training for m in self.model.modules()}
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            for module, training in modes.items():
                module.training = training

    # ---- the three stages -------------------------------------------------------------------------------------------
    def _generate(self, prompt_inputs, sizes: list[int], sampling: SamplingParams, prompt_seeds=None,
                  path: str | None = None, keep: bool = False):
        """`path`: "copy" or a cascade kernel name (the decode check's two runs); None: the engine's choice. `keep`:
        returns (rollout, `Branches` or None), the cache kept for a later turn (`generate_branches`)."""
        device = self.model.get_input_embeddings().weight.device
        path = path or self.choice.choose(self, prompt_inputs, sizes, device)
        self._path = path  # the chunked prefill's kernel (`_prefill_chunks`)
        rows = torch.repeat_interleave(torch.arange(len(sizes), device=device), torch.tensor(sizes, device=device))
        visuals = split_visuals_per_prompt(self.model, prompt_inputs) if self._is_vl else None
        prefixes = prefix_positions(self.model, prompt_inputs, visuals)  # per prompt: ids [P_b], positions [A, P_b]
        if path != "copy":
            # None: no two prompts share (the plain path)
            shares = decode_shares(self.model, prefixes, visuals) if self.share_videos else None
            self.last_stats = prefill_stats(prefixes, shares)
            cache = SharedPrefixCache.for_model(self.model, sampling.max_new_tokens)
            backend, watched = path, (self._cache_kwarg, "logits_to_keep")
            with cascade_attention_enabled(self.model):
                prefill = {CASCADE_KWARG: CascadeCall(cache, backend, model_inputs=watched, prefill=True)}
                if shares is None:
                    # logits [B, V]; attn [B, L]; start [B]
                    logits, attn, start = self._prefill(prefixes, prompt_inputs, device, cache, prefill)
                    cache.start_decode(rows, attn.bool())  # N rows behind the B prefixes, nothing copied
                else:  # shared parts once, each query's tail behind its share's (mmpg.rollout.shares)
                    shared = shared_prefill(self.model, prefixes, visuals, shares, device)
                    logits, attn, start = self._prefill(prefixes, prompt_inputs, device, cache, prefill, shared)
                    cache.start_decode(rows)
                call = CascadeCall(cache, backend, model_inputs=watched)
                if keep:
                    cache.keep_branches()
                out = self._decode(call, logits, attn, start, rows, sizes, sampling, prompt_seeds)
                if not keep:
                    return out
                cache.retire_live()
                return out, Branches(cache, backend, rows.cpu(), prefixes.starts, torch.arange(rows.numel()))
        self.last_stats = prefill_stats(prefixes, None)
        cache = DynamicCache(config=self.model.config)
        logits, attn, start = self._prefill(prefixes, prompt_inputs, device, cache)
        cache.reorder_cache(rows)  # [B, ...] -> [N, ...]: the G-way copy of each prompt's K/V
        out = self._decode(cache, logits, attn, start, rows, sizes, sampling, prompt_seeds)
        return (out, None) if keep else out

    def check_decode(self, prompt_inputs, picks: list[int], g_max: int, steps: int, kernel: str):
        """The decode check's two runs (`mmpg.rollout.decode_choice`): prompts `picks` of the batch, g_max rows each,
        `steps` greedy tokens without a stop token, by copy decoding and by `kernel` -> (reference, candidate)."""
        part = select_prompts(self.model, prompt_inputs, picks, pad_token_id(self.model))
        greedy = SamplingParams(max_new_tokens=steps, temperature=0, stop_token_ids=(), logprobs=True)
        sizes = [g_max] * len(picks)
        with self.check_scope():
            return self._generate(part, sizes, greedy, path="copy"), self._generate(part, sizes, greedy, path=kernel)

    def _decode(self, cache, logits, attn, start, rows, sizes, sampling: SamplingParams, prompt_seeds) -> Rollout:
        """Sample token 0 from the prefill logits, then decode the live rows; `cache` is the copied DynamicCache
        [N, ...] or a `CascadeCall`. Rows that finish leave the cache (`reorder_cache`)."""
        device = logits.device
        stop_ids = torch.tensor(self._stop_ids(sampling), dtype=torch.long, device=device)  # may be empty
        generator = torch.Generator(device=device).manual_seed(sampling.seed)
        banned = torch.tensor(placeholder_token_ids(self.model), dtype=torch.long, device=device)
        step_fn = self._cascade_step if isinstance(cache, CascadeCall) else self._decode_step
        kv = cache.cache if isinstance(cache, CascadeCall) else cache
        n, steps = rows.numel(), sampling.max_new_tokens
        # [N, max_new_tokens]; a finished row's rest is padding
        tokens = torch.full((n, steps), pad_token_id(self.model), dtype=torch.long, device=device)
        logps = torch.zeros(n, steps, dtype=torch.float32, device=device)
        lengths = torch.zeros(n, dtype=torch.long, device=device)
        stopped = torch.zeros(n, dtype=torch.bool, device=device)
        live = torch.arange(n, device=device)  # rows still decoding; the cache holds exactly these rows, in order
        step_logits = logits[rows]
        # [N, steps] float64 on the device: row i's uniform of step t, drawn up front from its own generator
        seeded = prompt_seeds is not None and not sampling.greedy
        row_uniforms = _row_uniforms(prompt_seeds, sizes, steps, device) if seeded else None
        local_done = False
        for t in range(steps):
            if not local_done:
                uniforms = None if row_uniforms is None else row_uniforms[live, t]
                tok, lp = next_tokens(step_logits, sampling.temperature, sampling.top_k, sampling.top_p, generator,
                                      banned, uniforms)
                tokens[live, t], logps[live, t], lengths[live] = tok, lp, t + 1
                done = torch.isin(tok, stop_ids)
                stopped[live] |= done
                # the step's one host sync: how many rows stopped (none on the last step)
                finished = 0 if t + 1 == steps else int(done.sum())
                local_done = t + 1 == steps or finished == tok.numel()
                if not local_done and finished:
                    keep = (~done).nonzero()[:, 0]  # which rows leave: a second sync, on such steps only
                    kv.reorder_cache(keep)
                    live, tok = live[keep], tok[keep]
            if (self.all_done(local_done) if self.all_done is not None else local_done) or t + 1 == steps:
                break
            if local_done:  # other ranks still decode: keep making the same collective calls (ZeRO-3)
                self._idle_step(device)
            else:
                step_logits = step_fn(cache, tok, attn[rows[live]], start[rows[live]], t)
        self.last_kv_bytes = _kv_bytes(kv)
        return self._rollout(tokens, logps, lengths, stopped, sizes, sampling)

    def _decode_step(self, cache, tok, prompt_attn, start, t: int) -> torch.Tensor:
        """Feed token t of the live rows: tok [n], prompt_attn [n, L], start [n] -> next logits [n, V]."""
        n = tok.numel()
        attn = torch.cat([prompt_attn, prompt_attn.new_ones(n, t + 1)], dim=1)  # [n, L + t + 1]
        pos = (start + t)[:, None]  # [n, 1]
        position_ids = pos[None].expand(3, n, 1) if self._is_vl else pos
        out = self.model(input_ids=tok[:, None], attention_mask=attn, position_ids=position_ids, use_cache=True,
                         logits_to_keep=1, **{self._cache_kwarg: cache})
        return out.logits[:, -1]

    def _cascade_step(self, call: CascadeCall, tok, prompt_attn, start, t: int) -> torch.Tensor:
        """Feed token t of the live rows through the cascade attention: tok [n], start [n] -> next logits [n, V]. The
        attention mask is a 4-D marker that mask creation passes through untouched; the prefix padding is the cache's
        key mask and own tokens need none."""
        n = tok.numel()
        pos = (start + t)[:, None]  # [n, 1]
        position_ids = pos[None].expand(3, n, 1) if self._is_vl else pos
        marker = torch.ones(1, 1, 0, 0, dtype=torch.bool, device=tok.device)
        out = self.model(input_ids=tok[:, None], attention_mask=marker, position_ids=position_ids, use_cache=True,
                         logits_to_keep=1, **{self._cache_kwarg: call.cache, CASCADE_KWARG: call})
        return out.logits[:, -1]

    def _idle_step(self, device) -> None:
        """One forward of a single pad token through every decoder layer, result discarded (synced decoding)."""
        ids = torch.full((1, 1), pad_token_id(self.model), dtype=torch.long, device=device)
        pos = torch.zeros(1, 1, dtype=torch.long, device=device)
        self.model(input_ids=ids, position_ids=pos[None].expand(3, 1, 1) if self._is_vl else pos, use_cache=False,
                   logits_to_keep=1)

    def _rollout(self, tokens, logps, lengths, stopped, sizes, sampling: SamplingParams) -> Rollout:
        width = int(lengths.max())
        mask = (torch.arange(width, device=tokens.device)[None, :] < lengths[:, None]).long()  # [N, S]
        ids = tokens[:, :width]
        return Rollout(
            completion_ids=ids.cpu(),
            completion_mask=mask.cpu(),
            group_sizes=list(sizes),
            texts=self.processor.batch_decode([row[:n] for row, n in zip(ids.tolist(), lengths.tolist())],
                                              skip_special_tokens=True),
            finish_reasons=[FINISH_STOP if s else FINISH_LENGTH for s in stopped.tolist()],
            logprobs=(logps[:, :width] * mask).cpu() if sampling.logprobs else None,
        )

    def _share_order(self, prompt_inputs) -> list[int]:
        """Cascade decoding with shared videos: the prompt order that puts each video's prompts side by side
        (`mmpg.grouping.shares.share_order`); the identity otherwise."""
        n = int(prompt_inputs["input_ids"].shape[0])
        if not (self.share_videos and self._is_vl and resolve_decode(self.decode) == "cascade"):
            return list(range(n))
        return share_order(split_visuals_per_prompt(self.model, prompt_inputs))

    # ---- model facts ------------------------------------------------------------------------------------------------
    @property
    def _is_vl(self) -> bool:
        return model_kind(self.model) == "vl"

    def _stop_ids(self, sampling: SamplingParams) -> list[int]:
        if sampling.stop_token_ids is not None:
            return list(sampling.stop_token_ids)
        eos = self.model.generation_config.eos_token_id
        if eos is None:
            raise ValueError("the model's generation_config has no eos_token_id; pass SamplingParams(stop_token_ids=)")
        return [eos] if isinstance(eos, int) else list(eos)


@dataclasses.dataclass
class Branches:
    """What a multi-turn rollout keeps between turns (`HFEngine.generate_branches`): the cascade cache with every
    row's K/V as a branch, the kernel, each engine row's prompt [N], each prompt's first completion position [B],
    and the engine row of each caller row [N] (they differ where a video's prompts were sampled side by side)."""

    cache: SharedPrefixCache
    path: str
    prompt_of: torch.Tensor
    starts: list[int]
    engine_row: torch.Tensor


def _rows_back(out: Rollout, order: list[int], sizes: list[int]) -> Rollout:
    """A rollout of the prompts in `order` -> the same rollout in the caller's prompt order (`sizes`: the caller's
    group sizes)."""
    starts = [sum(sizes[:b]) for b in range(len(sizes))]
    rows = [starts[b] + j for b in order for j in range(sizes[b])]  # row k of `out` answers caller row rows[k]
    back = torch.tensor(rows).argsort()
    pick = back.tolist()
    return Rollout(completion_ids=out.completion_ids[back], completion_mask=out.completion_mask[back],
                   group_sizes=list(sizes), texts=[out.texts[k] for k in pick],
                   finish_reasons=[out.finish_reasons[k] for k in pick],
                   logprobs=None if out.logprobs is None else out.logprobs[back])


def _kv_bytes(cache) -> int:
    """Bytes of K/V a cache holds now (the copy path's DynamicCache or a SharedPrefixCache)."""
    if isinstance(cache, SharedPrefixCache):
        return cache.kv_bytes()
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


def _row_uniforms(prompt_seeds: Sequence[int], sizes: list[int], steps: int, device) -> torch.Tensor:
    """[N, steps] float64 on `device`: row j of prompt b's uniforms, `steps` draws at once from its CPU generator
    (`_row_generators`) — the same numbers as one draw per step (tested), moved to the device once per call."""
    return torch.stack([torch.rand(steps, generator=g, dtype=torch.float64)
                        for g in _row_generators(prompt_seeds, sizes)]).to(device)


def _row_generators(prompt_seeds: Sequence[int], sizes: list[int]) -> list[torch.Generator]:
    """[N] CPU generators: row j of prompt b seeded from (prompt_seeds[b], j)."""
    gens = []
    for seed, g in zip(prompt_seeds, sizes):
        for j in range(g):
            gens.append(torch.Generator().manual_seed((int(seed) * 1_000_003 + j) % (2 ** 63)))
    return gens
