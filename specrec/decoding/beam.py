"""Trie-constrained beam search over SIDs, batched over requests and beams.

Scores are sums of the model's (unconstrained) per-level log-probabilities;
codes the trie does not allow are masked to -inf before each top-k, so every
surviving beam is a prefix of a valid SID. When a request has fewer valid
continuations than the beam width, the extra beams are dead (score -inf, node
-1) and are dropped from the final list.

With ``use_cache=True`` each step feeds one token per beam and reuses the
self-attention keys/values (reordered by beam parent); without it every step
re-runs the decoder over the whole prefix. Both give the same beams.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..ids.trie import SidTrie
from ..models.tiger import EncoderState, Tiger

NEG_INF = float("-inf")


@dataclass
class Beams:
    codes: torch.Tensor  # [R, B, l] prefix codes (levels 0..l-1)
    scores: torch.Tensor  # [R, B] cumulative log-probability (-inf = dead)
    nodes: torch.Tensor  # [R, B] trie node at depth l (-1 = dead)
    token_logp: torch.Tensor  # [R, B, l] the log-probability of each code

    @property
    def level(self) -> int:
        return self.codes.shape[2]

    def alive(self) -> torch.Tensor:
        return self.nodes >= 0

    def items(self, trie: SidTrie) -> torch.Tensor:
        """Item index of each complete beam [R, B]; -1 for dead beams."""
        r, b, l = self.codes.shape
        items = trie.lookup(self.codes.reshape(r * b, l)).view(r, b)
        return torch.where(self.alive(), items, torch.full_like(items, -1))

    def select(self, idx: torch.Tensor) -> "Beams":
        return Beams(self.codes[idx], self.scores[idx], self.nodes[idx], self.token_logp[idx])


def root_beams(n_requests: int) -> Beams:
    return Beams(
        torch.zeros(n_requests, 1, 0, dtype=torch.int64),
        torch.zeros(n_requests, 1),
        torch.zeros(n_requests, 1, dtype=torch.int64),
        torch.zeros(n_requests, 1, 0),
    )


def select_topk(beams: Beams, logp: torch.Tensor, trie: SidTrie, width: int) -> tuple[Beams, torch.Tensor]:
    """One constrained beam step. ``logp`` [R, Bc, V] are next-level
    log-probs for each current beam. Returns the new beams and, per new beam,
    the flat index ``r * Bc + parent`` of the beam it extends."""
    r, bc, v = logp.shape
    level = beams.level
    allowed = trie.allowed_mask(level, beams.nodes.reshape(-1)).view(r, bc, v)
    cand = torch.where(allowed, beams.scores.unsqueeze(-1) + logp, torch.full_like(logp, NEG_INF))
    k = min(width, bc * v)
    top, idx = cand.view(r, bc * v).topk(k, dim=1)
    parent = torch.div(idx, v, rounding_mode="floor")
    code = idx % v
    par = parent.unsqueeze(-1).expand(-1, -1, level)
    codes = torch.cat([beams.codes.gather(1, par), code.unsqueeze(-1)], dim=2)
    tok = logp.reshape(r, bc * v).gather(1, idx)
    token_logp = torch.cat([beams.token_logp.gather(1, par), tok.unsqueeze(-1)], dim=2)
    nodes = trie.advance(level, beams.nodes.gather(1, parent), code)
    dead = torch.isinf(top) | (nodes < 0)
    nodes = torch.where(dead, torch.full_like(nodes, -1), nodes)
    top = torch.where(dead, torch.full_like(top, NEG_INF), top)
    flat_parent = parent + torch.arange(r).unsqueeze(1) * bc
    return Beams(codes, top, nodes, token_logp), flat_parent.reshape(-1)


def prefix_logprobs(model: Tiger, enc: EncoderState, codes: torch.Tensor) -> torch.Tensor:
    """Next-level log-probs after each prefix, by a full (uncached) decoder
    pass: codes [R, M, l] -> [R, M, V_l]."""
    return model.next_logprobs(enc, model.decoder_input(codes), last_only=True)[0][0]


def expand_prefixes(model: Tiger, enc: EncoderState, beams: Beams, trie: SidTrie, width: int) -> Beams:
    """One beam step from given prefixes (any level), without a cache."""
    logp = prefix_logprobs(model, enc, beams.codes)
    new, _ = select_topk(beams, logp, trie, width)
    return new


class BeamSearch:
    """Stepwise constrained beam search; ``run()`` decodes full SIDs.

    Callers that need intermediate prefixes (guided re-drafting, level-wise
    verification) call :meth:`step` themselves and read :attr:`beams`.
    """

    def __init__(self, model: Tiger, enc: EncoderState, trie: SidTrie, width: int, use_cache: bool = True):
        self.model, self.enc, self.trie, self.width = model, enc, trie, width
        self.use_cache = use_cache
        self.beams = root_beams(enc.n)
        self.past = None
        self.depth = model.cfg.sid_len
        self.logp: torch.Tensor | None = None  # last step's next-level log-probs [R, Bc, V]

    @property
    def done(self) -> bool:
        return self.beams.level >= self.depth

    def next_logprobs(self) -> torch.Tensor:
        """Log-probs of the next level for the current beams [R, B, V]."""
        b = self.beams
        if not self.use_cache:
            return prefix_logprobs(self.model, self.enc, b.codes)
        level = b.level
        tok = self.model.decoder_input(b.codes)[..., -1:]  # BOS at level 0, else the newest code
        logp, self.past = self.model.next_logprobs(self.enc, tok, self.past, start=level)
        return logp[0]

    def step(self) -> Beams:
        if self.done:
            raise RuntimeError("beam search already complete")
        self.logp = self.next_logprobs()
        self.beams, parent = select_topk(self.beams, self.logp, self.trie, self.width)
        if self.past is not None:
            self.past = [(k.index_select(0, parent), v.index_select(0, parent)) for k, v in self.past]
        return self.beams

    def run(self) -> Beams:
        while not self.done:
            self.step()
        return self.beams

    def select(self, idx: torch.Tensor, enc: EncoderState) -> "BeamSearch":
        """The same search restricted to requests ``idx`` (``enc`` already selected)."""
        new = BeamSearch(self.model, enc, self.trie, self.width, self.use_cache)
        new.beams = self.beams.select(idx)
        if self.past is not None:
            b = self.beams.codes.shape[1]
            rows = (idx.view(-1, 1) * b + torch.arange(b).view(1, -1)).reshape(-1)
            new.past = [(k.index_select(0, rows), v.index_select(0, rows)) for k, v in self.past]
        return new


@torch.inference_mode()
def beam_search(model: Tiger, enc: EncoderState, trie: SidTrie, width: int, use_cache: bool = True) -> Beams:
    return BeamSearch(model, enc, trie, width, use_cache).run()
