"""The registry of whole searches: each one a module, declared once (:class:`~.registry.Search`), above the
model maths (:class:`~specrec.models.hotpath.FusedHotPath`; the searches import the models, never the
other way round).

================  =========================================================
name              what
================  =========================================================
``beam``          the target's constrained beam search (:mod:`.beam`)
``head``          the NEZHA head's search (:mod:`.head`)
``draft``         the distilled SID drafter's search (:mod:`.draft`)
``draft_scored``  ``draft`` + the target's scores of it (:mod:`.draft_scored`)
``strict``        drafts verified level by level (:mod:`.strict`)
``resume``        finishes a ``strict`` row its drafts missed (inside ``strict``)
``rank``          given candidates' scores, own-level heads (:mod:`.rank`)
================  =========================================================

One name per search in every layer, and one call: the ONNX export table (:func:`specrec.backends.onnx.export_search`,
graph files named by :func:`~.registry.search_name`), the SID drafter's kinds (:data:`DRAFTER_KINDS`), the
backends' one entry point (``backend.search(name, enc, trie, widths, args)``), the verifier's jobs
(:class:`specrec.verifier.jobs.SearchJob`, batched by name and widths) and its one ``Search`` RPC (the name, the
widths by name, the args and the answer as named tensors: :class:`~.registry.Search`'s ``reply``/``result``)
read :data:`SEARCHES`; warm-up reads each search's ``warm``. Adding a search is its module here and its tests.
Every search is tested against its eager reference (:mod:`specrec.decoding.beam`,
:class:`~specrec.models.tiger.Tiger`): ``tests/unit/test_hotpath.py``, ``tests/unit/test_distilled.py``,
``tests/unit/test_backends.py``.
"""

from __future__ import annotations

from . import beam, draft, draft_scored, head, rank, resume, strict
from .common import SearchState
from .registry import BEAMS, Search, search_name
from .values import Drafted, rows

SEARCHES: dict[str, Search] = {s.name: s for s in (beam.SEARCH, head.SEARCH, draft.SEARCH, draft_scored.SEARCH,
                                                   strict.SEARCH, resume.SEARCH, rank.SEARCH)}

#: the searches that run the distilled SID drafter (its weights may be 8-bit in their graphs)
DRAFTER_KINDS = tuple(name for name, s in SEARCHES.items() if s.uses_sid_drafter)

__all__ = ["BEAMS", "DRAFTER_KINDS", "SEARCHES", "Drafted", "Search", "SearchState", "rows", "search_name"]
