"""The declaration of a whole search (:class:`Search`) and the names of its graphs (:func:`search_name`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ..beam import Beams
from .values import beams_reply, beams_result

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
    ``uses_head``: the NEZHA draft head.

    How every layer calls it, read from here and never written per search: a backend's one entry point
    (``backend.search(name, enc, trie, widths, args)``) runs ``call(run, enc, trie, widths, args)``, where
    ``run(name, enc, trie, widths, inputs)`` runs one graph of the backend (default: the search's graph, its
    outputs as :class:`~specrec.decoding.beam.Beams`); ``args`` are the named tensors the caller hands it
    (``rank``: ``sids``). The verifier's one ``Search`` RPC carries the name, the widths by name and the args,
    and answers ``reply(value)`` (named tensors), which the caller reads back with ``result``.

    ``inside``: the search whose call runs it (``resume``: ``strict``'s); callers ask only for the others.
    ``steps``: it is the target's own beam search, which a session can also take level by level: the verifier
    steps it where the session verified prefixes, the rule is relaxed or the backend has no whole call (its
    whole call counts every level computed). ``eager``: what the eager backend runs instead of ``fn``
    (``head``: the head's own search; ``beam``: nothing, the verifier steps). ``final``: its value is a
    request's answer, read by nothing after it (``beam``, ``rank``): a remote caller's session ends with the
    call. ``pad``: pads the graph inputs' candidate axis (1) to a bucket (a backend of captured graphs).
    ``warm(k, drafts)``: the widths a serving list length ``k`` uses (``drafts``: the draft counts the policies
    use for it), warmed before serving."""

    name: str
    fn: Callable[..., tuple[torch.Tensor, ...]]
    outputs: tuple[str, ...]
    widths: tuple[str, ...] = ("width",)
    inputs: tuple[str, ...] = ()
    axes: dict[str, dict[int, str]] | None = None  # dynamic axes of its inputs / outputs (default: axis 0 is R)
    example: Callable[..., tuple[torch.Tensor, ...]] | None = None
    uses_sid_drafter: bool = False
    uses_head: bool = False
    tables: bool = True  # it reads the item set's tables (``rank`` reads none: it is handed its candidates)
    args: tuple[str, ...] = ()  # the caller's named tensors, candidate SIDs int64 [R, M, L] each (rank: sids)
    call: Callable[..., Any] | None = None
    reply: Callable[[Any], dict[str, torch.Tensor]] = beams_reply
    result: Callable[[dict[str, torch.Tensor]], Any] = beams_result
    inside: str | None = None
    steps: bool = False
    final: bool = False
    lossy: str = ""  # its graph may leave float32 (chosen per machine on validation users): what the record calls it
    eager: Callable[..., Any] | None = None
    pad: Callable[..., Any] | None = None
    warm: Callable[[int, list[int]], list[tuple[int, ...]]] = lambda k, drafts: []
    left: tuple[str, ...] = ()  # outputs kept on the device for the search run inside its call
    min_levels: int = 1  # SID levels it needs (``strict`` and ``resume``: 3)

    def run(self, run_graph: Callable[..., list[torch.Tensor] | None], enc, trie, widths: tuple[int, ...],
            args: dict[str, torch.Tensor]) -> Any:
        """The search's value on a backend whose graph runner is ``run_graph`` (the class's docstring's ``run``);
        None where the backend cannot run it."""
        if self.call is not None:
            return self.call(run_graph, enc, trie, widths, args)
        out = run_graph(self.name, enc, trie, widths, [])
        return None if out is None else Beams.of_search(*out)


def search_name(kind: str, width: int | None, n: int | None = None, drafter_bits: int | None = None,
                tables: str = "") -> str:
    """The graph file name of search ``kind`` (``beam_w10_tcccc``, ``strict_w10_n20_q8_tddcc``; ``rank``, which
    has no static width and reads no tables): exported graphs and caches are found by it, so it does not change.
    ``tables``: the forms of the tables it reads (:func:`~specrec.ids.tables.form_tag`), one graph per form."""
    return (kind + ("" if width is None else f"_w{width}") + (f"_n{n}" if n is not None else "")
            + (f"_q{drafter_bits}" if drafter_bits else "") + (f"_t{tables}" if tables else ""))
