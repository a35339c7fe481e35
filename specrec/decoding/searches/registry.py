"""The declaration of a whole search (:class:`Search`) and the names of its graphs (:func:`search_name`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

#: every whole search returns the target's (or a drafter's) beams first, named so in its graph: codes [R, W, l],
#: scores [R, W], token_logp [R, W, l] and each beam's trie node [R, W] (int64, -1 = dead), which at the full depth
#: is its item's leaf, so the caller reads the items off the trie without walking it
BEAMS = ("codes", "scores", "token_logp", "nodes")


@dataclass(frozen=True)
class Search:
    """One whole constrained search, declared once: what every layer calls it and reads about it.

    ``name`` is the operation's one name: the key of :data:`~specrec.decoding.searches.SEARCHES`, the ``kind``
    of the ONNX export table and of its graph files (:func:`search_name`: ``beam_w10``,
    ``strict_w10_n20_q8``), of the backends' whole-search calls and of the verifier's job groups.

    ``fn(fused, enc_mask, cross_k, cross_v, tables, *widths, *inputs)`` is the search as tensor functions of a
    :class:`~specrec.models.hotpath.FusedHotPath` (the model maths) -> the tensors named ``outputs``; the eager
    backend calls it in torch, the graph backends trace it. ``enc_mask`` [R, S], ``cross_k``/``cross_v`` the
    hot path's encoder state, ``tables[j]`` the item set's level j (:class:`~specrec.ids.tables.Level`: a dense child
    table or CSR arrays, and a view's cut; every search reads it through :func:`~specrec.ids.tables.children`).
    ``widths`` names its static integers, baked into its graph (``width``; ``n``, drafts per level; none: one
    graph for every size); ``inputs`` the tensors it reads after the tables (another graph's outputs, or the
    caller's), with ``example(fused, (enc_mask, cross_k, cross_v), tables, width)`` making an example of them to
    trace with, and ``axes`` the dynamic axes of its inputs and outputs where more than the rows (axis 0: R).

    ``uses_sid_drafter``: it runs the distilled SID drafter (whose weights a graph may hold in 8 bits);
    ``uses_head``: the NEZHA draft head. The :class:`~specrec.backends.base.Backend` method that runs it has its
    name (``backend.beam(enc, trie, width)``); ``rpc`` is the verifier service's RPC that serves it,
    its name in CamelCase (``verifier.proto``; None: it runs inside another search's call)."""

    name: str
    fn: Callable[..., tuple[torch.Tensor, ...]]
    outputs: tuple[str, ...]
    rpc: str | None
    widths: tuple[str, ...] = ("width",)
    inputs: tuple[str, ...] = ()
    axes: dict[str, dict[int, str]] | None = None  # dynamic axes of its inputs / outputs (default: axis 0 is R)
    example: Callable[..., tuple[torch.Tensor, ...]] | None = None
    uses_sid_drafter: bool = False
    uses_head: bool = False
    tables: bool = True  # it reads the item set's tables (``rank`` reads none: it is handed its candidates)


def search_name(kind: str, width: int | None, n: int | None = None, drafter_bits: int | None = None,
                tables: str = "") -> str:
    """The graph file name of search ``kind`` (``beam_w10_tcccc``, ``strict_w10_n20_q8_tddcc``; ``rank``, which
    has no static width and reads no tables): exported graphs and caches are found by it, so it does not change.
    ``tables``: the forms of the tables it reads (:func:`~specrec.ids.tables.form_tag`), one graph per form."""
    return (kind + ("" if width is None else f"_w{width}") + (f"_n{n}" if n is not None else "")
            + (f"_q{drafter_bits}" if drafter_bits else "") + (f"_t{tables}" if tables else ""))
