"""The HF engine's prefill (`mmpg.rollout.hf.HFEngine` inherits it): one forward over the B left-padded prompts, a
packed row of shared parts and tails (`mmpg.rollout.shares`), or, for prompts longer than `prefill_chunk`, chunks
behind the cache (`mmpg.rollout.chunks`). Every form fills the cache the decode loop reads and returns the last
position's logits of each prompt.

Synced decoding (ZeRO-3, `all_done` set): the number of forwards depends on a rank's prompts, so the ranks vote on
chunking (`_chunked`) and idle until every rank has finished its prefill (`_prefill_sync`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
import torch.nn.functional as F

from mmpg.grouping.attention import LAYOUT_KWARG
from mmpg.grouping.inputs import VIDEO_DEEPSTACK, VIDEO_FEATURES, pad_token_id
from mmpg.rollout.cascade import SharedPrefixCache
from mmpg.rollout.cascade_attention import CASCADE_KWARG, CHUNK_KWARG, ChunkCall, cascade_attention_enabled
from mmpg.rollout.cascade_kernels import resolve_cascade_kernel
from mmpg.rollout.chunks import chunk_spans, encoder_outputs, span_inputs, supports_encoder_outputs
from mmpg.rollout.shares import SharedPrefill, shared_batches

log = logging.getLogger("mmpg.rollout")

# Processor outputs the prefill forward takes besides ids and mask; positions are passed explicitly, so
# mm_token_type_ids and second_per_grid_ts are only read by `prefix_positions`.
# the videos may come as their features (`mmpg.grouping.sequence.with_video_features`) instead of pixels
_VISUAL_KEYS = ("pixel_values", "pixel_values_videos", "image_grid_thw", "video_grid_thw", VIDEO_FEATURES,
                VIDEO_DEEPSTACK)


class Prefill:
    """Prefill methods of `HFEngine` (they use its model, prefill_chunk, all_done, _path, _is_vl, _cache_kwarg
    and _idle_step)."""

    def _prefill(self, prefixes, prompt_inputs, device, cache, extra: dict | None = None,
                 shared: SharedPrefill | None = None):
        """One forward over the B prompts, left-padded, filling `cache` [B, L]. Returns the last position's logits
        [B, V], the left-padded attention mask [B, L] and the first completion position of each prompt [B]. `extra`:
        more forward kwargs (the cascade engine's prefill call, which checks the tripwire). `shared`: instead, one
        packed forward of the shared parts and tails (`_prefill_shared`; the mask returned is then [B, 1] ones)."""
        ids_list, pos_list, starts = prefixes
        start = torch.tensor(starts, device=device)  # [B] where each prompt's completions continue, on every axis
        if shared is not None:
            chunked = self._chunked(shared.ids.numel(), VIDEO_FEATURES in shared.visuals)
            logits = (self._prefill_shared_chunked if chunked else self._prefill_shared)(shared, cache, extra)
            self._prefill_sync(device)
            return logits, torch.ones(len(starts), 1, device=device), start
        width = max(p.numel() for p in ids_list)
        pad = pad_token_id(self.model)
        ids = torch.stack([F.pad(p, (width - p.numel(), 0), value=pad) for p in ids_list]).to(device)
        attn = torch.stack([F.pad(torch.ones_like(p), (width - p.numel(), 0)) for p in ids_list]).to(device)
        pos = torch.stack([F.pad(p, (width - p.shape[1], 0)) for p in pos_list], dim=1).to(device)  # [A, B, L]
        position_ids = pos if self._is_vl else pos[0]  # [3, B, L] mRoPE or [B, L]
        visuals = {k: prompt_inputs[k].to(device) for k in _VISUAL_KEYS if prompt_inputs.get(k) is not None}
        if self._chunked(width, VIDEO_FEATURES in visuals):
            logits = self._prefill_chunks(ids, attn, position_ids, visuals, cache)
        else:
            logits = self.model(input_ids=ids, attention_mask=attn, position_ids=position_ids, use_cache=True,
                                logits_to_keep=1, **{self._cache_kwarg: cache}, **visuals, **(extra or {})).logits
            logits = logits[:, -1]
        self._prefill_sync(device)
        return logits, attn, start

    def _prefill_chunks(self, ids, attn, position_ids, visuals: dict, cache) -> torch.Tensor:
        """The prefill of ids [B, L] (attn [B, L], positions [3, B, L] or [B, L]) in column chunks of `prefill_chunk`
        tokens behind the cache (a DynamicCache or the SharedPrefixCache, which appends them): the visual features
        once (frame chunks; one call per modality under synced decoding, where every rank must run the same
        forwards), then chunk [a, b) forwarded with its own placeholders' features, its attention
        `cascade_attention.chunk_attention` with key mask attn[:, :b] (CPU) or the model's own with the mask
        attn[:, :b] (elsewhere: the cascade kernels' CUDA paths are untested). Returns the last logits [B, V]."""
        encoded = []
        if visuals:
            encoded = encoder_outputs(self.model, visuals, 0 if self.all_done is not None else self.prefill_chunk)
        spans = chunk_spans(ids.shape[1], self.prefill_chunk)
        backend = self._path if self._path not in (None, "copy") else \
            resolve_cascade_kernel(self.cascade_backend, ids.device)
        # chunk_attention on torch's CPU flash kernel; elsewhere (its CUDA path is UNTESTED on a GPU) the model's own
        # attention with its [B, 1, C, b] mask
        own = backend == "sdpa" and ids.device.type == "cpu"
        marker = torch.ones(1, 1, 0, 0, dtype=torch.bool, device=ids.device)  # chunk_attention masks itself
        with cascade_attention_enabled(self.model) if own else contextlib.nullcontext():
            for k, (a, b) in enumerate(spans):
                inputs = span_inputs(encoded, ids, a, b)
                watched = (self._cache_kwarg, "logits_to_keep", *inputs)
                chunk = ChunkCall(None if bool(attn[:, :b].all()) else attn[:, :b].bool(), backend, watched)
                out = self.model(input_ids=ids[:, a:b], attention_mask=marker if own else attn[:, :b],
                                 position_ids=position_ids[..., a:b], use_cache=True, logits_to_keep=1,
                                 **{self._cache_kwarg: cache}, **inputs, **({CHUNK_KWARG: chunk} if own else {}))
                if self.all_done is not None and k + 1 < len(spans):
                    self.all_done(False)  # one vote per forward: a rank with fewer chunks idles (`_prefill_sync`)
        return out.logits[:, -1]

    def _chunked(self, length: int, features: bool = False) -> bool:
        """Whether a prefill of `length` tokens per row goes in chunks. Under synced decoding every rank decides
        alike, chunks when some rank's batch is longer than one chunk: ZeRO-3 gathers weights module by module, so
        every rank must call the vision tower and the decoder in the same order (the chunked path encodes the
        videos before its first forward, the one forward inside it). A VL model whose forward cannot take
        precomputed features (transformers < 5.18: no `mm_encoder_outputs`) prefills in one forward, said once.
        `features`: the videos come as features (`VIDEO_FEATURES`, every rank of a run alike): only the chunked path
        takes them (one chunk when prefill_chunk is 0), with no vote."""
        if features:  # a forward that cannot take them is refused where they are handed over (`encoder_outputs`)
            return True
        if self.prefill_chunk <= 0:
            return False
        if self._is_vl and not supports_encoder_outputs(self.model):
            if not getattr(self, "_said_no_chunks", False):
                log.warning("rollout.prefill_chunk: this transformers release's %s forward takes no precomputed "
                            "vision features (mm_encoder_outputs, transformers >= 5.18); long prompts are "
                            "prefilled in one forward", type(self.model).__name__)
                self._said_no_chunks = True
            return False
        want = self.prefill_chunk < length
        return want if self.all_done is None else not self.all_done(not want)

    def _prefill_sync(self, device) -> None:
        """Synced decoding with chunking on: the prefill took a number of forwards that depends on this rank's
        prompts, so each rank votes done after its last one and idles until every rank has voted done."""
        if self.all_done is not None and self.prefill_chunk > 0:
            while not self.all_done(True):
                self._idle_step(device)

    def _prefill_shared(self, shared: SharedPrefill, cache: SharedPrefixCache, extra: dict) -> torch.Tensor:
        """The packed row [1, T] under the grouped attention (`shared.layout`); its K/V is gathered into the cache's
        two levels. Returns the logits [B, V] at each prompt's last token."""
        cache.expect_shares(shared.split)
        marker = torch.ones(1, 1, 0, 0, dtype=torch.bool, device=shared.ids.device)  # the layout is the real mask
        position_ids = shared.positions[:, None, :] if self._is_vl else shared.positions  # [3, 1, T] or [1, T]
        out = self.model(input_ids=shared.ids[None], attention_mask=marker, position_ids=position_ids, use_cache=True,
                         logits_to_keep=shared.last, **{self._cache_kwarg: cache}, **shared.visuals,
                         **{LAYOUT_KWARG: shared.layout}, **extra)
        return out.logits[0]

    def _prefill_shared_chunked(self, shared: SharedPrefill, cache: SharedPrefixCache, extra: dict) -> torch.Tensor:
        """A shared prefill longer than one chunk, in two stages (`mmpg.rollout.shares.shared_batches`): the shared
        parts [S, L_s] as a left-padded batch in chunks (`_prefill_chunks`: each video once, in frame chunks) into the
        cache's first level, then every query's tail [Q, L_t] in one forward behind its share's shared part
        (`cascade_attention.tails_attention`) into the second. Returns the logits [Q, V] at each tail's last token.
        The tails (a question and the chat header) are not chunked."""
        (ids, attn, pos), (tail_ids, tail_pos) = shared_batches(shared, pad_token_id(self.model))
        self._prefill_chunks(ids, attn, pos if self._is_vl else pos[0], shared.visuals, cache)
        if self.all_done is not None:
            self.all_done(False)  # the tails forward is one more (`_prefill_sync`)
        cache.expect_tails(shared.split)
        call = dataclasses.replace(extra[CASCADE_KWARG], tails=True)
        marker = torch.ones(1, 1, 0, 0, dtype=torch.bool, device=tail_ids.device)  # tails_attention masks itself
        out = self.model(input_ids=tail_ids, attention_mask=marker, position_ids=tail_pos if self._is_vl else
                         tail_pos[0], use_cache=True, logits_to_keep=1, **{self._cache_kwarg: cache},
                         **{CASCADE_KWARG: call})
        return out.logits[:, -1]
