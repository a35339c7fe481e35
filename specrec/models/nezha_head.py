"""NEZHA draft head: a tiny autoregressive head on the GR model's hidden states.

One decoder pass over ``[BOS, SP_1, ..., SP_{L-1}]`` (learned placeholder
embeddings) gives hidden states ``h_0 .. h_{L-1}`` for every SID position at
once. The head then decodes level by level without calling the GR model again:

    s_0 = 0
    q_l(. | c_<l) = softmax(W_l LN(h_l + s_l))
    s_{l+1} = GRUCell_l(e(c_l), s_l)      (e = the GR's frozen code embedding)

The GR model stays frozen; only placeholders, transitions and heads train
(cross-entropy on the true next item plus KL to the GR's own distributions,
so q tracks p).
"""

from __future__ import annotations

import torch
from pydantic import BaseModel
from torch import nn

from .tiger import BOS_TOKEN, EncoderState, Tiger


class NezhaConfig(BaseModel):
    distill_weight: float = 1.0


class NezhaHead(nn.Module):
    def __init__(self, gr: Tiger, cfg: NezhaConfig | None = None):
        super().__init__()
        self.cfg = cfg or NezhaConfig()
        g = gr.cfg
        d = g.d_model
        self.level_sizes = list(g.level_sizes)
        self.L = g.sid_len
        self.placeholders = nn.Parameter(torch.randn(self.L - 1, d) * 0.02)
        self.transitions = nn.ModuleList(nn.GRUCell(d, d) for _ in range(self.L - 1))
        self.ln = nn.LayerNorm(d)
        self.heads = nn.ModuleList(nn.Linear(d, v) for v in g.level_sizes)
        with torch.no_grad():  # start from the GR's own output layers
            for lvl, mine in enumerate(self.heads):
                eye = torch.eye(d)
                mine.weight.copy_(gr.level_logits(eye, lvl).T - gr.level_logits(torch.zeros(1, d), lvl).T)
                mine.bias.copy_(gr.level_logits(torch.zeros(1, d), lvl)[0])

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def hidden(self, gr: Tiger, enc: EncoderState) -> torch.Tensor:
        """One GR decoder pass with placeholders: [R, L, d]."""
        r = enc.n
        bos = gr.tok(torch.full((r, 1, 1), BOS_TOKEN, dtype=torch.int64))
        ph = self.placeholders.view(1, 1, self.L - 1, -1).expand(r, 1, -1, -1)
        h, _ = gr.decode(enc, None, embeds=torch.cat([bos, ph], dim=2))
        return h[:, 0]

    def code_embedding(self, gr: Tiger, level: int, codes: torch.Tensor) -> torch.Tensor:
        return gr.tok(codes + gr.offsets[level])

    def level_logprobs(self, h: torch.Tensor, s: torch.Tensor, level: int) -> torch.Tensor:
        """h: [R, d] hidden at this level, s: [R, M, d] states -> [R, M, V]."""
        return torch.log_softmax(self.heads[level](self.ln(h.unsqueeze(1) + s)).float(), dim=-1)

    def advance(self, gr: Tiger, s: torch.Tensor, level: int, codes: torch.Tensor) -> torch.Tensor:
        """s: [R, M, d], codes: [R, M] chosen at ``level`` -> next states [R, M, d]."""
        r, m, d = s.shape
        e = self.code_embedding(gr, level, codes).reshape(r * m, d)
        return self.transitions[level](e, s.reshape(r * m, d)).view(r, m, d)

    def prefix_logprobs(self, gr: Tiger, h: torch.Tensor, prefixes: torch.Tensor) -> list[torch.Tensor]:
        """q at every level along given prefixes [R, M, l]: a list of l+1
        tensors [R, M, V_j] (level j's distribution after prefix[:j]); the last
        one is omitted when l == L."""
        r, m, l = prefixes.shape
        s = h.new_zeros(r, m, h.shape[-1])
        out = []
        for j in range(min(l + 1, self.L)):
            out.append(self.level_logprobs(h[:, j], s, j))
            if j < l and j < self.L - 1:
                s = self.advance(gr, s, j, prefixes[:, :, j])
        return out

    def beam_search(self, gr: Tiger, h: torch.Tensor, trie, width: int):
        """Constrained beam search with the head alone: invalid prefixes are
        masked (exact set membership) before each top-k, so the beams refill
        with valid ones. Scores are the head's summed log-probabilities."""
        from ..decoding.beam import root_beams, select_topk

        r = h.shape[0]
        beams = root_beams(r)
        s = h.new_zeros(r, 1, h.shape[-1])
        for level in range(self.L):
            logq = self.level_logprobs(h[:, level], s, level)
            beams, parent = select_topk(beams, logq, trie, width)
            if level < self.L - 1:
                s = s.reshape(-1, s.shape[-1])[parent].view(r, -1, s.shape[-1])
                s = self.advance(gr, s, level, beams.codes[:, :, -1].clamp(min=0))
        return beams

    def loss(self, gr: Tiger, enc: EncoderState, target: torch.Tensor, teacher: list[torch.Tensor] | None) -> torch.Tensor:
        """target: [B, L] true next SIDs; teacher: the GR's per-level log-probs
        along the target (or None to train on cross-entropy alone)."""
        h = self.hidden(gr, enc)
        q = self.prefix_logprobs(gr, h, target[:, None, :])
        loss = 0.0
        for j, lq in enumerate(q):
            lq = lq[:, 0]
            loss = loss + nn.functional.nll_loss(lq, target[:, j])
            if teacher is not None and self.cfg.distill_weight:
                p = teacher[j].exp()
                loss = loss + self.cfg.distill_weight * (p * (teacher[j] - lq)).sum(-1).mean()
        return loss / self.L
