"""Shared-prefix ("cascade") decoding: each prompt's K/V is stored and read once for all of its G rows.

For the query of live row i (prompt b) at decode step t, the keys are prefix_b (P_b tokens) ∪ own_i (the t + 1
tokens row i generated). Attention over disjoint key sets merges exactly by log-sum-exp (`mmpg.grouping.merge`):

    o_x, lse_x = attention(q, part x);   lse = log(Σ_x e^lse_x),   o = Σ_x e^(lse_x - lse) · o_x

Prefix part: the live rows of prompt b ask the same keys, so they form one query block and the prefix is read once
per step for all of them (Hydragen, arXiv 2402.05099; FlashInfer and vLLM call it cascade attention), with the GQA
heads folded into the query length so the K/V is never copied or head-expanded:
queries [B', Hkv, G_max · rep, D] x prefix K/V [B', Hkv, L, D], left padding a key mask. Own part: [n, Hkv, rep, D]
x own K/V [n, Hkv, t + 1, D], no mask (every live row has generated the same number of tokens). Under video sharing
(`mmpg.rollout.shares`) the prefix splits into two levels, a share's shared part [S', Hkv, L_s, D] read once by all
rows of its queries and each query's tail [Q', Hkv, L_t, D] by its G_q rows: three parts merged. (A third level
rather than one per-row mask over [shared | every tail]: each level needs only a per-entry padding mask, which every
kernel here takes, flash-attn's `flash_attn_with_kvcache` included.)

Multi-turn rollouts (`keep_branches`, `mmpg.rollout.multiturn`): a row that ends its turn leaves the live rows but
its K/V is kept as its branch (`branches`: every key it wrote, in order). A later turn (`begin_turn`) takes the
branches that go on as a fourth part, history [n, Hkv, H, D] left-padded with a key mask (branches differ in length),
reads the prompts' levels as prefilled (held for the whole trajectory), and feeds the tool turn of every branch as one
left-padded chunk [n, Hkv, C, D] into the own buffer (causal within it, its padding masked), the turn's tokens after
it:

    keys of branch i in turn k:  prefix levels of its prompt | history_i (turns 1..k-1, tool turns) | own_i

Where this departs from Hydragen / FlashInfer: no paged KV and no inter-request sharing; the prefix is the whole
prompt (video included) or a shared part found from the inputs, and the rows' own K/V are dense per row.
"""

from __future__ import annotations

import dataclasses
import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class _Rows:
    """Which entry (prompt, share or tail) each live row reads, and where its query goes in the padded query block."""

    def __init__(self, row_prompt: torch.Tensor):
        # row_prompt [n] long, non-decreasing (rows of an entry contiguous, entries in order), values in 0..E-1
        self.prompts, counts = torch.unique_consecutive(row_prompt, return_counts=True)  # [E'] kept entries, [E']
        self.num_prompts = int(self.prompts.numel())
        self.group = torch.repeat_interleave(torch.arange(self.num_prompts, device=row_prompt.device), counts)  # [n]
        starts = torch.cumsum(counts, 0) - counts
        self.slot = torch.arange(row_prompt.numel(), device=row_prompt.device) - starts[self.group]  # [n]
        self.g_max = int(counts.max())
        self.equal = bool((counts == self.g_max).all())  # then the block is a plain view of the rows, no scatter
        self.row_prompt = row_prompt


@dataclasses.dataclass
class ShareSplit:
    """Where the shared parts and the query tails sit in the packed row of a shared prefill (`mmpg.rollout.shares`).
    Each layer's packed K/V [1, Hkv, T, D] is gathered once into the levels [S, Hkv, L_s, D] and [Q, Hkv, L_t, D]."""

    shared_index: torch.Tensor  # [S, L_s] long, packed position of each shared token, left-padded (pads: a real one)
    shared_mask: torch.Tensor  # [S, L_s] bool, True on real tokens
    tail_index: torch.Tensor  # [Q, L_t] long, the same for every query's tail
    tail_mask: torch.Tensor  # [Q, L_t] bool
    query_share: torch.Tensor  # [Q] long, non-decreasing: the share of each query


class _Level:
    """One level of shared K/V: E entries, each read once per step by its live rows through one query block."""

    def __init__(self, mask: torch.Tensor, entry_of_query: torch.Tensor | None = None):
        # mask [E, L] bool (True on real keys); entry_of_query [Q]: the entry of each query (None: entry = query)
        self.mask = None if bool(mask.all()) else mask.bool()
        self.entry_of_query = entry_of_query
        self.kept = torch.arange(mask.shape[0], device=mask.device)  # [E'] original ids of the entries held now
        self.rows: _Rows | None = None

    def place(self, row_query: torch.Tensor) -> torch.Tensor | None:
        """The live rows now answer queries `row_query` [n] (original ids, non-decreasing). Returns the positions
        [E''] of the entries to keep in this level's K/V batch, or None when every entry still has rows."""
        ids = row_query if self.entry_of_query is None else self.entry_of_query[row_query]  # [n] original entry ids
        needed = torch.unique_consecutive(ids)
        keep = None
        if needed.numel() != self.kept.numel():
            keep = torch.searchsorted(self.kept, needed)
            self.kept = needed
            if self.mask is not None:
                self.mask = self.mask[keep]
        self.rows = _Rows(torch.searchsorted(self.kept, ids))
        return keep


def _pad_keys(x: torch.Tensor, width: int) -> torch.Tensor:
    """[Hkv, H, D] -> [Hkv, width, D], zeros in front (masked keys: left padding, as every kernel takes it)."""
    return torch.nn.functional.pad(x, (0, 0, width - x.shape[1], 0))


def _gather(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Packed [1, Hkv, T, D] at index [E, L] -> [E, Hkv, L, D]."""
    return x[0][:, index].transpose(0, 1).contiguous()


class CascadeLayer(CacheLayerMixin):
    """One decoder layer: the K/V of each shared level (`level_keys[0]`: prefixes [B', Hkv, L, D], the prompts with
    live rows, left-padded as prefilled, or the shared videos' parts; `level_keys[1]`: their queries' tails) and own K/V
    [n, Hkv, capacity, D] of which the first `own_len` positions are filled."""

    is_sliding = False
    is_croppable = False

    def __init__(self, owner: SharedPrefixCache):
        super().__init__()
        # a weak reference: layer -> cache -> layer would be a cycle, and the rollout's K/V would stay alive after
        # the rollout until Python's cyclic collector ran (through the reference logprobs and the update)
        self.owner = weakref.proxy(owner)
        self.level_keys: list[torch.Tensor] = []
        self.level_values: list[torch.Tensor] = []
        self.own_keys = self.own_values = None  # [n, Hkv, capacity, D]
        self.own_len = 0
        # multi-turn: each live branch's earlier turns [n, Hkv, H, D] (None in a first turn), and the levels as
        # prefilled, which a later turn reads again (`SharedPrefixCache.begin_turn`)
        self.history_keys = self.history_values = None
        self.prefilled: tuple[list[torch.Tensor], list[torch.Tensor]] | None = None

    @property
    def prefix_keys(self):
        return self.level_keys[0] if self.level_keys else None

    @property
    def prefix_values(self):
        return self.level_values[0] if self.level_values else None

    @property
    def tail_keys(self):
        return self.level_keys[1] if len(self.level_keys) > 1 else None

    @property
    def tail_values(self):
        return self.level_values[1] if len(self.level_values) > 1 else None

    def lazy_initialization(self, key_states, value_states) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        """Prefill: store [B, Hkv, L, D] as the prefix (or gather a shared prefill's packed [1, Hkv, T, D] into its two
        levels) and return it (the prefill's attention runs on it); a chunked prefill's later chunks [B, Hkv, C, D] are
        appended to the prefix, and the prefix so far is returned. Decode: write [n, Hkv, 1, D] at own position
        own_len and return the own K/V so far [n, Hkv, own_len + 1, D]."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        if not self.owner.decoding:
            split = self.owner.split
            if self.owner.tails:  # a chunked shared prefill's tails [Q, Hkv, L_t, D], behind the shared parts
                if len(self.level_keys) != 1:
                    raise RuntimeError("SharedPrefixCache.expect_tails needs the shared parts prefilled first")
                self.level_keys.append(key_states.contiguous())
                self.level_values.append(value_states.contiguous())
                return self.level_keys[1], self.level_values[1]
            if self.level_keys and (split is not None or len(self.level_keys) > 1):
                raise RuntimeError("SharedPrefixCache holds one prefill; call start_decode before decoding")
            if split is None and self.level_keys:  # a later chunk of a chunked prefill: its K/V behind the earlier
                self.level_keys = [torch.cat([self.level_keys[0], key_states], dim=2)]
                self.level_values = [torch.cat([self.level_values[0], value_states], dim=2)]
                return self.level_keys[0], self.level_values[0]
            if split is None:
                self.level_keys, self.level_values = [key_states.contiguous()], [value_states.contiguous()]
            else:
                self.level_keys = [_gather(key_states, split.shared_index), _gather(key_states, split.tail_index)]
                self.level_values = [_gather(value_states, split.shared_index),
                                     _gather(value_states, split.tail_index)]
            return key_states, value_states
        n, hkv, q_len, d = key_states.shape
        if q_len != 1 and not (self.own_len == 0 and self.owner.own_mask is not None):
            raise ValueError(f"cascade decoding feeds one token per row (or a turn's chunk first), got {q_len}")
        if self.own_keys is None:
            cap = self.owner.capacity
            self.own_keys = key_states.new_empty(n, hkv, cap, d)
            self.own_values = value_states.new_empty(n, hkv, cap, d)
        if self.own_len + q_len > self.own_keys.shape[2]:
            raise RuntimeError(f"SharedPrefixCache capacity {self.own_keys.shape[2]} exceeded; raise max_new_tokens")
        self.own_keys[:, :, self.own_len: self.own_len + q_len] = key_states
        self.own_values[:, :, self.own_len: self.own_len + q_len] = value_states
        self.own_len += q_len
        return self.own_keys[:, :, : self.own_len], self.own_values[:, :, : self.own_len]

    def get_seq_length(self) -> int:
        history = 0 if self.history_keys is None else self.history_keys.shape[2]
        return sum(k.shape[2] for k in self.level_keys) + history + self.own_len

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def select_rows(self, keep_rows: torch.Tensor) -> None:
        """Keep own rows `keep_rows` [n'] (and their history)."""
        if self.own_keys is not None:
            self.own_keys, self.own_values = self.own_keys[keep_rows], self.own_values[keep_rows]
        if self.history_keys is not None:
            self.history_keys, self.history_values = self.history_keys[keep_rows], self.history_values[keep_rows]

    def branch(self, r: int, history_mask, own_mask) -> tuple[torch.Tensor, torch.Tensor]:
        """Live row r's keys and values so far, history then own tokens, padding dropped: ([Hkv, H_r, D], same)."""
        ks, vs = [], []
        if self.history_keys is not None:
            keep = history_mask[r] if history_mask is not None else slice(None)
            ks.append(self.history_keys[r][:, keep])
            vs.append(self.history_values[r][:, keep])
        if self.own_keys is not None and self.own_len:
            keep = own_mask[r, : self.own_len] if own_mask is not None else slice(None)
            ks.append(self.own_keys[r, :, : self.own_len][:, keep])
            vs.append(self.own_values[r, :, : self.own_len][:, keep])
        if not ks:  # a row whose first token ended its turn: no key fed yet
            empty = self.level_keys[0].new_zeros(self.level_keys[0].shape[1], 0, self.level_keys[0].shape[3])
            return empty, empty
        return torch.cat(ks, dim=1), torch.cat(vs, dim=1)

    def select_level(self, level: int, keep: torch.Tensor) -> None:
        """Keep entries `keep` [E'] of shared level `level`."""
        self.level_keys[level], self.level_values[level] = self.level_keys[level][keep], self.level_values[level][keep]

    def nbytes(self) -> int:
        tensors = (*self.level_keys, *self.level_values, self.own_keys, self.own_values, self.history_keys,
                   self.history_values)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class SharedPrefixCache(Cache):
    """The prefill of B prompts held once, then N = sum(G_b) rows decoded behind it (see the module docstring): a
    transformers `Cache`, one `CascadeLayer` per decoder layer, owned by the engine. The prefill forward stores the
    prompts' K/V once (the model's own attention computes it; a packed shared prefill's K/V is gathered into the two
    levels, `expect_shares`; a chunked prefill appends chunk after chunk, a chunked shared prefill fills the shared
    level and then the tails, `expect_tails`); `start_decode(rows)` sets which prompt each row answers; each decode
    forward appends one own token per live row into a preallocated buffer, and `mmpg.rollout.cascade_attention`
    does the cascade. Finished rows leave with `reorder_cache(keep)`, and entries whose rows all finished leave
    their level.

    num_layers: decoder layers of the text model; capacity: most tokens a row generates (max_new_tokens)."""

    def __init__(self, num_layers: int, capacity: int):
        super().__init__(layers=[CascadeLayer(self) for _ in range(num_layers)])
        self.capacity = capacity
        self.decoding = False
        self.split: ShareSplit | None = None  # set by expect_shares before a packed shared prefill
        self.tails = False  # set by expect_tails: the next prefill forward is a chunked shared prefill's tails
        self.levels: list[_Level] = []  # [prefixes] or [shared parts, tails]
        self._level_masks: list[tuple] = []  # each level's (mask, entry_of_query) as prefilled
        self.row_query: torch.Tensor | None = None  # [n] the query (prompt) of each live row, original ids
        # multi-turn (`keep_branches`): row id -> each layer's (keys [Hkv, H, D], values) of a row that left, and
        # the live rows' ids, history key mask [n, H] and own key mask [n, capacity] (False: a chunk's padding)
        self.branches: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
        self.row_ids: torch.Tensor | None = None
        self.history_mask: torch.Tensor | None = None
        self.own_mask: torch.Tensor | None = None

    @classmethod
    def for_model(cls, model, capacity: int) -> SharedPrefixCache:
        text = model.config.get_text_config()
        types = getattr(text, "layer_types", None) or []
        if getattr(text, "use_sliding_window", False) or any(t != "full_attention" for t in types):
            raise ValueError("cascade decoding needs full attention in every layer (use_sliding_window=False); use "
                             "decode='copy' for this model")
        return cls(text.num_hidden_layers, capacity)

    @property
    def rows(self) -> _Rows | None:
        """The prefix (or shared-part) level's rows."""
        return self.levels[0].rows if self.levels else None

    @property
    def prefix_mask(self) -> torch.Tensor | None:
        """[B', L] bool key mask of the prefix (or shared-part) level; None: no padding."""
        return self.levels[0].mask if self.levels else None

    def expect_shares(self, split: ShareSplit) -> None:
        """Before the prefill: it is a packed shared prefill (`mmpg.rollout.shares`), to be gathered into two levels."""
        if any(layer.level_keys for layer in self.layers):
            raise RuntimeError("SharedPrefixCache.expect_shares must come before the prefill")
        self.split = split

    def expect_tails(self, split: ShareSplit) -> None:
        """A chunked shared prefill (`HFEngine._prefill_shared_chunked`): the shared parts were prefilled as a
        left-padded batch [S, L_s] (level 0, as `split.shared_mask` pads them); the next forward holds the tails
        [Q, L_t] (level 1, padded as `split.tail_mask`), attending through
        `mmpg.rollout.cascade_attention.tails_attention`."""
        if any(len(layer.level_keys) != 1 for layer in self.layers):
            raise RuntimeError("SharedPrefixCache.expect_tails comes after the shared parts' prefill")
        self.split, self.tails = split, True

    def start_decode(self, row_prompt: torch.Tensor, prompt_mask: torch.Tensor | None = None) -> None:
        """After the prefill. row_prompt [N]: the prompt of each row (non-decreasing); prompt_mask [B, L] bool: the
        prefill's attention mask (left padding False). Under video sharing the masks come from its `ShareSplit`."""
        if any(not layer.level_keys for layer in self.layers):
            raise RuntimeError("start_decode before the prefill filled every layer of the SharedPrefixCache")
        if self.split is None:
            if prompt_mask is None:
                raise ValueError("SharedPrefixCache.start_decode needs the prefill's prompt_mask [B, L]")
            self._level_masks = [(prompt_mask, None)]
        else:
            self._level_masks = [(self.split.shared_mask, self.split.query_share), (self.split.tail_mask, None)]
        self.levels = [_Level(*m) for m in self._level_masks]
        self.decoding, self.tails = True, False
        self._place(row_prompt)

    def keep_branches(self) -> None:
        """Right after `start_decode`: rows that leave are kept as branches for a later turn (module docstring), and
        the levels as prefilled are held for it."""
        if not self.decoding or any(layer.own_len for layer in self.layers):
            raise RuntimeError("SharedPrefixCache.keep_branches comes right after start_decode")
        self.branches = {}
        self.row_ids = torch.arange(self.row_query.numel(), device=self.row_query.device)
        for layer in self.layers:
            layer.prefilled = (list(layer.level_keys), list(layer.level_values))

    def retire_live(self) -> None:
        """The end of a turn: every live row leaves, kept as its branch."""
        if self.branches is None:
            raise RuntimeError("SharedPrefixCache.retire_live needs keep_branches")
        self._retire(range(self.row_ids.numel()))
        for layer in self.layers:
            layer.own_keys = layer.own_values = layer.history_keys = layer.history_values = None
            layer.own_len = 0
        self.row_ids = self.row_query = self.history_mask = self.own_mask = None

    def begin_turn(self, row_ids: torch.Tensor, row_query: torch.Tensor, chunk_mask: torch.Tensor,
                   capacity: int) -> None:
        """A later turn of the branches `row_ids` [n] (increasing; their prompts `row_query` [n], non-decreasing):
        their kept K/V becomes the history level, the others are dropped; the next forward feeds each branch's tool
        turn as a left-padded chunk (`chunk_mask` [n, C], False on padding), then one token per step, at most
        `capacity` own tokens in all (chunk included)."""
        if self.branches is None or self.row_ids is not None:
            raise RuntimeError("SharedPrefixCache.begin_turn follows retire_live")
        missing = [int(r) for r in row_ids if int(r) not in self.branches]
        if missing:
            raise ValueError(f"SharedPrefixCache.begin_turn: rows {missing} have no kept branch")
        kept, self.branches = [self.branches[int(r)] for r in row_ids], {}
        lengths = torch.tensor([k[0][0].shape[1] for k in kept], device=row_ids.device)
        width = int(lengths.max())
        mask = torch.arange(width, device=row_ids.device)[None] >= width - lengths[:, None]  # [n, H], left-padded
        self.history_mask = None if bool(mask.all()) else mask  # a row may hold none (its first token ended a turn)
        for i, layer in enumerate(self.layers):
            pieces = [k[i] for k in kept]
            if width:
                layer.history_keys = torch.stack([_pad_keys(k, width) for k, _ in pieces])
                layer.history_values = torch.stack([_pad_keys(v, width) for _, v in pieces])
            layer.level_keys, layer.level_values = list(layer.prefilled[0]), list(layer.prefilled[1])
            layer.own_keys = layer.own_values = None
            layer.own_len = 0
        self.capacity = capacity
        self.own_mask = torch.cat([chunk_mask.bool(), chunk_mask.new_ones(chunk_mask.shape[0],
                                                                         capacity - chunk_mask.shape[1]).bool()], 1)
        self.levels = [_Level(*m) for m in self._level_masks]
        self.row_ids = row_ids
        self._place(row_query)

    def _retire(self, rows) -> None:
        for r in rows:
            self.branches[int(self.row_ids[r])] = [layer.branch(r, self.history_mask, self.own_mask)
                                                   for layer in self.layers]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Keep only the live rows `beam_idx` [n'] (indices into the current live rows, increasing), as `DynamicCache.
        reorder_cache` does in the copy path; entries left without rows leave their level."""
        if not self.decoding:
            raise RuntimeError("SharedPrefixCache.reorder_cache selects live rows; the prefix itself is never copied")
        if self.branches is not None:  # the rows that leave are kept as branches
            leaving = torch.ones(self.row_ids.numel(), dtype=torch.bool, device=beam_idx.device)
            leaving[beam_idx] = False
            self._retire(leaving.nonzero()[:, 0].tolist())
            self.row_ids = self.row_ids[beam_idx]
            for name in ("history_mask", "own_mask"):
                if getattr(self, name) is not None:
                    setattr(self, name, getattr(self, name)[beam_idx])
        for layer in self.layers:
            layer.select_rows(beam_idx)
        self._place(self.row_query[beam_idx])

    def _place(self, row_query: torch.Tensor) -> None:
        self.row_query = row_query
        for i, level in enumerate(self.levels):
            keep = level.place(row_query)
            if keep is not None:
                for layer in self.layers:
                    layer.select_level(i, keep)

    def kv_bytes(self) -> int:
        """Bytes of K/V held now: the shared levels once plus every live row's own buffer."""
        return sum(layer.nbytes() for layer in self.layers)
