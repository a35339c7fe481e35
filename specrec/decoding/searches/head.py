"""``head``: the NEZHA draft head's constrained beam search, the one definition (:func:`head_search`), run
two ways: over a trie on the head's own weights (:func:`nezha_beam_search`, eager, the reference) and, its
decoder pass included, in one graph on the hot path's copy of its weights (:func:`run`, the registry's
``head``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from ...ids.tables import Level
from ...ids.trie import SidTrie
from ...models.hotpath import FusedHotPath
from ...models.nezha_head import NezhaHead
from ...models.tiger import Tiger
from ..beam import Beams, root_beams, select_topk
from .common import SearchState
from .registry import BEAMS, Search


class _Beams(Protocol):
    codes: torch.Tensor  # [R, B, l]


B = TypeVar("B", bound=_Beams)


def head_search(hidden: torch.Tensor, level_logprobs: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
                advance: Callable[[torch.Tensor, int, torch.Tensor], torch.Tensor],
                select: Callable[[B, torch.Tensor, int], tuple[B, torch.Tensor]], root: B) -> B:
    """The NEZHA head's constrained beam search (the one definition): hidden [R, L, d] the head's decoder
    states; ``level_logprobs(h [R, d], s [R, B, d], level)`` -> [R, B, V]; ``advance(s, level, codes [R, B])``
    -> the next states; ``select(beams, logq, level)`` -> (kept beams, their parent beam within the request
    [R, W]): one constrained top-k (:func:`~specrec.decoding.topk.constrained_topk`), over a trie or dense
    tables. Invalid prefixes are masked before each top-k, so the beams refill with valid ones; scores are
    the head's summed log-probabilities."""
    r, L, d = hidden.shape[0], int(hidden.shape[1]), int(hidden.shape[2])  # widths fixed, so graphs hold constants
    s = torch.zeros(r, 1, d, dtype=hidden.dtype, device=hidden.device)
    beams = root
    for level in range(L):
        beams, parent = select(beams, level_logprobs(hidden[:, level], s, level), level)
        if level < L - 1:
            s = s.gather(1, parent.unsqueeze(-1).expand(-1, -1, d))
            s = advance(s, level, beams.codes[:, :, -1].clamp(min=0))
    return beams


def nezha_beam_search(head: NezhaHead, gr: Tiger, h: torch.Tensor, trie: SidTrie, width: int) -> Beams:
    """:func:`head_search` with the head alone over ``trie`` (h [R, L, d] from :meth:`NezhaHead.hidden`)."""
    r = h.shape[0]

    def select(beams: Beams, logq: torch.Tensor, level: int) -> tuple[Beams, torch.Tensor]:
        kept, flat = select_topk(beams, logq, trie, width)
        return kept, flat.view(r, -1) - torch.arange(r).view(r, 1) * logq.shape[1]

    return head_search(h, head.level_logprobs, lambda s, level, codes: head.advance(gr, s, level, codes), select,
                       root_beams(r))


def run(fused: FusedHotPath, enc_mask, cross_k, cross_v, tables: list[Level], width: int):
    """-> codes [R, W, L], the head's scores [R, W] and token_logp [R, W, L], nodes [R, W] (-1 = dead)."""
    hd = fused.head
    assert hd is not None  # a hot path made with a NEZHA head
    hid = fused.head_hidden(enc_mask, cross_k, cross_v)  # [R, L, d]
    state = head_search(hid, hd.level_logprobs,
                        lambda s, level, codes: hd.advance(s, level, codes + fused.offsets[level], fused.tok),
                        lambda st, logq, level: st.advance(logq, tables[level], width),
                        SearchState.root(hid.shape[0], hid.device))
    return state.beams()


def reference(backend, enc, trie, width: int) -> Beams:
    """The eager backend's head search: the head's own (:func:`nezha_beam_search`), in eager torch."""
    return nezha_beam_search(backend.nezha_head, backend.model, backend.head_hidden(enc), trie, width)


SEARCH = Search("head", run, BEAMS, uses_head=True, eager=reference, warm=lambda k, drafts: [(n,) for n in drafts])
