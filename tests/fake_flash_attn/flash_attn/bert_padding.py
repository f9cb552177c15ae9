"""Stand-in for flash_attn.bert_padding (2.8.3 signatures): remove and restore padding tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def unpad_input(hidden_states, attention_mask, unused_mask=None):
    """hidden [B, S, ...], mask [B, S] -> (hidden [nnz, ...], indices [nnz], cu_seqlens int32 [B + 1], max_seqlen,
    seqused int32 [B])."""
    all_masks = attention_mask + unused_mask if unused_mask is not None else attention_mask
    seqlens = all_masks.sum(dim=-1, dtype=torch.int32)
    used = attention_mask.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(all_masks.flatten(), as_tuple=False).flatten()
    cu_seqlens = F.pad(torch.cumsum(seqlens, dim=0, dtype=torch.int32), (1, 0))
    return hidden_states.flatten(0, 1)[indices], indices, cu_seqlens, int(seqlens.max()), used


def pad_input(hidden_states, indices, batch, seqlen):
    """hidden [nnz, ...] -> [batch, seqlen, ...] with zeros at the padding."""
    out = hidden_states.new_zeros(batch * seqlen, *hidden_states.shape[1:])
    out[indices] = hidden_states
    return out.unflatten(0, (batch, seqlen))
