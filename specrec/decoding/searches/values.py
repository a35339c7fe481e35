"""What the whole searches give their callers, and the same as named tensors (the verifier's ``Search`` reply):
beams (:class:`~specrec.decoding.beam.Beams`), ``strict``'s :class:`Drafted`, ``rank``'s token log-probabilities.
Each :class:`~.registry.Search` names its pair (``reply``, ``result``); a batch's value is cut per caller by
:func:`rows`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..beam import Beams


@dataclass
class Drafted:
    """``strict``'s value: the target's beams (equal to its beam search in every row: a row whose drafts missed
    is finished from the levels the tree verified, in the same call), ``covered`` [R] bool (the drafts held the
    target's whole frontier), per level 0..L-2 the target's kept prefixes and how many of them the tree held
    (``frontier`` [R, L-1, 2])."""

    beams: Beams
    covered: np.ndarray
    frontier: np.ndarray

    def select(self, idx: torch.Tensor) -> Drafted:
        i = idx.numpy()
        return Drafted(self.beams.select(idx), self.covered[i], self.frontier[i])


def beams_reply(b: Beams) -> dict[str, torch.Tensor]:
    return {"codes": b.codes, "scores": b.scores.float(), "token_logp": b.token_logp.float(), "alive": b.alive}


def beams_result(t: dict[str, torch.Tensor]) -> Beams:
    return Beams(t["codes"], t["scores"], t["token_logp"], t["alive"].bool())


def drafted_reply(d: Drafted) -> dict[str, torch.Tensor]:
    return {**beams_reply(d.beams), "covered": torch.from_numpy(np.asarray(d.covered, dtype=bool)),
            "frontier": torch.from_numpy(np.asarray(d.frontier, dtype=np.int32))}


def drafted_result(t: dict[str, torch.Tensor]) -> Drafted:
    return Drafted(beams_result(t), t["covered"].numpy().astype(bool), t["frontier"].numpy())


def token_reply(token_logp: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"token_logp": token_logp}


def token_result(t: dict[str, torch.Tensor]) -> torch.Tensor:
    return t["token_logp"]


def rows(value: Any, a: int, b: int, m: int | None = None) -> Any:
    """Rows ``a:b`` of a batch's value (one caller's); a tensor's candidate axis cut back to ``m`` (its caller's
    count, where the batch padded the candidates to the largest)."""
    if isinstance(value, torch.Tensor):
        return value[a:b] if m is None else value[a:b, :m]
    return value.select(torch.arange(a, b))
