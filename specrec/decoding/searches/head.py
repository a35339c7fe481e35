"""``head``: the NEZHA draft head's constrained beam search, its decoder pass included, in one graph (the
head's one search, :func:`~specrec.models.nezha_head.head_search`, on the hot path's copy of its weights).
Its reference is :meth:`specrec.models.nezha_head.NezhaHead.beam_search` (eager)."""

from __future__ import annotations

import torch

from ...models.hotpath import FusedHotPath
from ...models.nezha_head import head_search
from .common import SearchState
from .registry import BEAMS, Search


def run(fused: FusedHotPath, enc_mask, cross_k, cross_v, tables: list[torch.Tensor], width: int):
    """-> codes [R, W, L], the head's scores [R, W] and token_logp [R, W, L], nodes [R, W] (-1 = dead)."""
    hd = fused.head
    assert hd is not None  # a hot path made with a NEZHA head
    hid = fused.head_hidden(enc_mask, cross_k, cross_v)  # [R, L, d]
    state = head_search(hid, hd.level_logprobs,
                        lambda s, level, codes: hd.advance(s, level, codes + fused.offsets[level], fused.tok),
                        lambda st, logq, level: st.advance(logq, tables[level], width),
                        SearchState.root(hid.shape[0], hid.device))
    return state.beams()


SEARCH = Search("head", run, BEAMS, rpc="HeadDrafts", uses_head=True)
