"""The registry of whole searches: each one a module, declared once (:class:`~.registry.Search`), above the
model maths (:class:`~specrec.models.hotpath.FusedHotPath`; the searches import the models, never the
other way round).

================  =========================================================  ============
name              what                                                       verifier RPC
================  =========================================================  ============
``beam``          the target's constrained beam search (:mod:`.beam`)        Beam
``head``          the NEZHA head's search (:mod:`.head`)                     Head
``draft``         the distilled SID drafter's search (:mod:`.draft`)         Draft
``draft_scored``  ``draft`` + the target's scores of it (:mod:`.draft_scored`) DraftScored
``strict``        drafts verified level by level (:mod:`.strict`)            Strict
``resume``        finishes a ``strict`` row its drafts missed                (in Strict)
``rank``          given candidates' scores, own-level heads (:mod:`.rank`)   Rank
================  =========================================================  ============

One name per search in every layer: the ONNX export table (:func:`specrec.backends.onnx.export_search`, graph
files named by :func:`~.registry.search_name`), the SID drafter's kinds (:data:`DRAFTER_KINDS`), the backends'
whole-search methods (``Backend.beam``, ``Backend.strict``, ...), the verifier's job groups and its RPCs (the
name in CamelCase: ``draft_scored`` is ``DraftScored``; the older RPCs BeamSearch, HeadDrafts, DraftVerify and
Score with ``scores_only`` still answer) read :data:`SEARCHES`. Every search is tested against its eager
reference (:mod:`specrec.decoding.beam`, :class:`~specrec.models.tiger.Tiger`): ``tests/unit/test_hotpath.py``,
``tests/unit/test_distilled.py``, ``tests/unit/test_backends.py``.
"""

from __future__ import annotations

from . import beam, draft, draft_scored, head, rank, resume, strict
from .common import SearchState
from .registry import BEAMS, Search, search_name

SEARCHES: dict[str, Search] = {s.name: s for s in (beam.SEARCH, head.SEARCH, draft.SEARCH, draft_scored.SEARCH,
                                                   strict.SEARCH, resume.SEARCH, rank.SEARCH)}

#: the searches that run the distilled SID drafter (its weights may be 8-bit in their graphs)
DRAFTER_KINDS = tuple(name for name, s in SEARCHES.items() if s.uses_sid_drafter)

__all__ = ["BEAMS", "DRAFTER_KINDS", "SEARCHES", "Search", "SearchState", "search_name"]
