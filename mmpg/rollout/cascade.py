"""Shared-prefix ("cascade") decoding: each prompt's K/V is stored and read once for all of its G rows.

For the query q of live row i (prompt b) at decode step t, the keys are prefix_b (P_b tokens) ∪ own_i (the t + 1
tokens row i generated, the current one included). Attention over a union of disjoint key sets is the weighted sum of
the attentions over each part (the log-sum-exp merge the grouped forward uses, `mmpg.grouping`):

    o_x, lse_x = attention(q, part x)            (lse_x: log-sum-exp of the scaled scores over part x)
    lse = log(e^lse_a + e^lse_b),   o = e^(lse_a - lse) · o_a + e^(lse_b - lse) · o_b

Prefix part (a): the live rows of prompt b ask the same keys, so they form one query block and the prefix is read once
per step for all of them (Hydragen, arXiv 2402.05099; FlashInfer and vLLM call it cascade attention). With GQA the
rep = Hq / Hkv query heads sharing a kv head are folded into the query length as well, so the K/V is never copied or
head-expanded:   queries [B', Hkv, G_max · rep, D]  x  prefix K/V [B', Hkv, L, D]   (one batched kernel call, B' = the
prompts that still have live rows; left padding of the prompt batch is a key mask). Own part (b): queries
[n, Hkv, rep, D] x own K/V [n, Hkv, t + 1, D], no mask: every live row has generated the same number of tokens.

`SharedPrefixCache` is a transformers `Cache` (one `CascadeLayer` per decoder layer) the engine owns: the prefill
forward stores the B prompts' K/V in it once (the model's own attention computes the prefill); `start_decode(rows)`
sets which prompt each of the N rows answers; each decode forward appends one own token per live row into a
preallocated buffer and the attention function of `mmpg.rollout.cascade_attention` does the two-part attention.
Rows that finish leave with `reorder_cache(keep)`, prompts whose rows all finished leave the prefix batch.

Where this departs from Hydragen / FlashInfer: no paged KV and no inter-request sharing; the prefix is the whole
prompt (video included) and the rows' own K/V are dense per row; the CPU kernel is torch's own flash kernel.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _Rows:
    """Which prompt each live row answers, and where its query goes in the padded prefix query block."""

    def __init__(self, row_prompt: torch.Tensor):
        # row_prompt [n] long, non-decreasing (rows of a prompt contiguous, prompts in order), values in 0..B-1
        self.prompts, counts = torch.unique_consecutive(row_prompt, return_counts=True)  # [B'] kept prompts, [B']
        self.num_prompts = int(self.prompts.numel())
        self.group = torch.repeat_interleave(torch.arange(self.num_prompts, device=row_prompt.device), counts)  # [n]
        starts = torch.cumsum(counts, 0) - counts
        self.slot = torch.arange(row_prompt.numel(), device=row_prompt.device) - starts[self.group]  # [n]
        self.g_max = int(counts.max())
        self.equal = bool((counts == self.g_max).all())  # then the block is a plain view of the rows, no scatter
        self.row_prompt = row_prompt


class CascadeLayer(CacheLayerMixin):
    """One decoder layer: prefix K/V [B', Hkv, L, D] (the prompts with live rows, left-padded as prefilled) and own
    K/V [n, Hkv, capacity, D] of which the first `own_len` positions are filled."""

    is_sliding = False
    is_croppable = False

    def __init__(self, owner: SharedPrefixCache):
        super().__init__()
        self.owner = owner
        self.prefix_keys = self.prefix_values = None  # [B', Hkv, L, D]
        self.own_keys = self.own_values = None  # [n, Hkv, capacity, D]
        self.own_len = 0

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Prefill: store [B, Hkv, L, D] as the prefix and return it (the model's own attention runs the prefill).
        Decode: write [n, Hkv, 1, D] at own position own_len and return the own K/V so far [n, Hkv, own_len + 1, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self.owner.decoding:
            if self.prefix_keys is not None:
                raise RuntimeError("SharedPrefixCache holds one prefill; call start_decode before decoding")
            self.prefix_keys, self.prefix_values = key_states.contiguous(), value_states.contiguous()
            return key_states, value_states
        n, hkv, q_len, d = key_states.shape
        if q_len != 1:
            raise ValueError(f"cascade decoding feeds one token per row, got {q_len}")
        if self.own_keys is None:
            cap = self.owner.capacity
            self.own_keys = key_states.new_empty(n, hkv, cap, d)
            self.own_values = value_states.new_empty(n, hkv, cap, d)
        if self.own_len >= self.own_keys.shape[2]:
            raise RuntimeError(f"SharedPrefixCache capacity {self.own_keys.shape[2]} exceeded; raise max_new_tokens")
        self.own_keys[:, :, self.own_len] = key_states[:, :, 0]
        self.own_values[:, :, self.own_len] = value_states[:, :, 0]
        self.own_len += 1
        return self.own_keys[:, :, : self.own_len], self.own_values[:, :, : self.own_len]

    def get_seq_length(self) -> int:
        return (0 if self.prefix_keys is None else self.prefix_keys.shape[2]) + self.own_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def select(self, keep_rows: torch.Tensor | None, keep_prompts: torch.Tensor | None) -> None:
        """Keep own rows `keep_rows` [n'] and prefixes `keep_prompts` [B'] (None: keep all)."""
        if keep_rows is not None and self.own_keys is not None:
            self.own_keys, self.own_values = self.own_keys[keep_rows], self.own_values[keep_rows]
        if keep_prompts is not None and self.prefix_keys is not None:
            self.prefix_keys, self.prefix_values = self.prefix_keys[keep_prompts], self.prefix_values[keep_prompts]

    def nbytes(self) -> int:
        tensors = (self.prefix_keys, self.prefix_values, self.own_keys, self.own_values)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class SharedPrefixCache(Cache):
    """The prefill of B prompts held once, then N = sum(G_b) rows decoded behind it (see the module docstring).

    num_layers: decoder layers of the text model; capacity: most tokens a row generates (max_new_tokens)."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__(layers=[CascadeLayer(self) for _ in range(num_layers)])
        self.capacity = capacity
        self.decoding = False
        self.rows: _Rows | None = None
        self.prefix_mask: torch.Tensor | None = None  # [B', L] bool, True on real tokens; None: no padding

    @classmethod
    def for_model(cls, model, capacity: int) -> SharedPrefixCache:
        text = model.config.get_text_config()
        types = getattr(text, "layer_types", None) or []
        if getattr(text, "use_sliding_window", False) or any(t != "full_attention" for t in types):
            raise ValueError("cascade decoding needs full attention in every layer (use_sliding_window=False); use "
                             "decode='copy' for this model")
        return cls(text.num_hidden_layers, capacity)

    def start_decode(self, row_prompt: torch.Tensor, prompt_mask: torch.Tensor) -> None:
        """After the prefill. row_prompt [N]: the prompt of each row (non-decreasing); prompt_mask [B, L] bool: the
        prefill's attention mask (left padding False)."""
        if any(layer.prefix_keys is None for layer in self.layers):
            raise RuntimeError("start_decode before the prefill filled every layer of the SharedPrefixCache")
        self.decoding = True
        self.prefix_mask = None if bool(prompt_mask.all()) else prompt_mask.bool()
        self.rows = _Rows(row_prompt)
        self._keep_prompts(self.rows.prompts)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep only the live rows `beam_idx` [n'] (indices into the current live rows, increasing), as `DynamicCache.
        reorder_cache` does in the copy path; prompts left without rows leave the prefix batch."""
        if not self.decoding:
            raise RuntimeError("SharedPrefixCache.reorder_cache selects live rows; the prefix itself is never copied")
        rows = self.rows.row_prompt[beam_idx]
        for layer in self.layers:
            layer.select(beam_idx, None)
        self.rows = _Rows(rows)
        self._keep_prompts(self.rows.prompts)

    def _keep_prompts(self, prompts: torch.Tensor) -> None:
        """Drop prefixes of prompts not in `prompts` [B'] (indices into the current prefix batch) and renumber."""
        current = self.layers[0].prefix_keys.shape[0]
        if prompts.numel() == current:
            return
        for layer in self.layers:
            layer.select(None, prompts)
        if self.prefix_mask is not None:
            self.prefix_mask = self.prefix_mask[prompts]
        remap = torch.full((current,), -1, dtype=torch.long, device=prompts.device)
        remap[prompts] = torch.arange(prompts.numel(), device=prompts.device)
        self.rows = _Rows(remap[self.rows.row_prompt])

    def kv_bytes(self) -> int:
        """Bytes of K/V held now: the prefixes once plus every live row's own buffer."""
        return sum(layer.nbytes() for layer in self.layers)
