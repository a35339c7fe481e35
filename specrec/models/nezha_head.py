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

The head's maths is written once, here: :func:`head_level_logprobs` and
:func:`gru_cell` (``torch.nn.GRUCell``'s, on the transitions' own weights).
:class:`NezhaHead` runs them on its parameters (training); the fused hot path
runs the same functions on copied weights. The head's constrained search is
the decoding layer's (``head`` of the registry of searches,
:mod:`specrec.decoding.searches.head`: :func:`~specrec.decoding.searches.head.head_search`,
and its eager reference over a trie, :func:`~specrec.decoding.searches.head.nezha_beam_search`).
"""

from __future__ import annotations

from typing import cast

import torch
from pydantic import BaseModel
from torch import nn

from .tiger import BOS_TOKEN, EncoderState, Tiger


def head_level_logprobs(h: torch.Tensor, s: torch.Tensor, ln: nn.Module, w: torch.Tensor,
                        b: torch.Tensor) -> torch.Tensor:
    """q_l(. | c_<l) = softmax(W_l LN(h_l + s_l)): h [R, d] the level's hidden state, s [R, B, d] the beams'
    states, w [d, V] (the output layer, transposed), b [V] -> log-probs [R, B, V]."""
    return torch.log_softmax(ln(h.unsqueeze(1) + s) @ w + b, dim=-1)


def gru_cell(x: torch.Tensor, s: torch.Tensor, w_ih: torch.Tensor, w_hh: torch.Tensor, b_ih: torch.Tensor,
             b_hh: torch.Tensor) -> torch.Tensor:
    """``torch.nn.GRUCell`` (input x, state s) over any leading axes, its weights transposed: w_ih [d_in, 3d],
    w_hh [d, 3d] (gates r, z, n, as GRUCell orders them). Written out, so graph exporters see plain ops."""
    gi = x @ w_ih + b_ih
    gh = s @ w_hh + b_hh
    i_r, i_z, i_n = gi.chunk(3, dim=-1)
    h_r, h_z, h_n = gh.chunk(3, dim=-1)
    rg = torch.sigmoid(i_r + h_r)
    z = torch.sigmoid(i_z + h_z)
    n = torch.tanh(i_n + rg * h_n)
    return (1 - z) * n + z * s


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
            for lvl, layer in enumerate(self.heads):
                mine = cast(nn.Linear, layer)
                eye = torch.eye(d)
                mine.weight.copy_(gr.level_logits(eye, lvl).T - gr.level_logits(torch.zeros(1, d), lvl).T)
                mine.bias.copy_(gr.level_logits(torch.zeros(1, d), lvl)[0])

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def hidden(self, gr: Tiger, enc: EncoderState) -> torch.Tensor:
        """One GR decoder pass with placeholders: [R, L, d]."""
        r = enc.n
        bos = gr.tok(torch.full((r, 1, 1), BOS_TOKEN, dtype=torch.int64, device=self.placeholders.device))
        ph = self.placeholders.view(1, 1, self.L - 1, -1).expand(r, 1, -1, -1)
        h, _ = gr.decode(enc, None, embeds=torch.cat([bos, ph], dim=2))
        return h[:, 0]

    def code_embedding(self, gr: Tiger, level: int, codes: torch.Tensor) -> torch.Tensor:
        return gr.tok(codes + gr.offsets[level])

    def level_logprobs(self, h: torch.Tensor, s: torch.Tensor, level: int) -> torch.Tensor:
        """h: [R, d] hidden at this level, s: [R, M, d] states -> [R, M, V]."""
        head = cast(nn.Linear, self.heads[level])
        return head_level_logprobs(h, s, self.ln, head.weight.t(), head.bias)

    def advance(self, gr: Tiger, s: torch.Tensor, level: int, codes: torch.Tensor) -> torch.Tensor:
        """s: [R, M, d], codes: [R, M] chosen at ``level`` -> next states [R, M, d]."""
        g = cast(nn.GRUCell, self.transitions[level])
        return gru_cell(
            self.code_embedding(gr, level, codes), s, g.weight_ih.t(), g.weight_hh.t(), g.bias_ih, g.bias_hh
        )

    def prefix_logprobs(self, gr: Tiger, h: torch.Tensor, prefixes: torch.Tensor) -> list[torch.Tensor]:
        """q at every level along given prefixes [R, M, l]: a list of l+1
        tensors [R, M, V_j] (level j's distribution after prefix[:j]); the last
        one is omitted when l == L."""
        r, m, depth = prefixes.shape
        s = h.new_zeros(r, m, h.shape[-1])
        out = []
        for j in range(min(depth + 1, self.L)):
            out.append(self.level_logprobs(h[:, j], s, j))
            if j < depth and j < self.L - 1:
                s = self.advance(gr, s, j, prefixes[:, :, j])
        return out

    def loss(
        self, gr: Tiger, enc: EncoderState, target: torch.Tensor, teacher: list[torch.Tensor] | None
    ) -> torch.Tensor:
        """target: [B, L] true next SIDs; teacher: the GR's per-level log-probs
        along the target (or None to train on cross-entropy alone)."""
        h = self.hidden(gr, enc)
        q = self.prefix_logprobs(gr, h, target[:, None, :])
        terms = []
        for j, lq in enumerate(q):
            lq = lq[:, 0]
            terms.append(nn.functional.nll_loss(lq, target[:, j]))
            if teacher is not None and self.cfg.distill_weight:
                p = teacher[j].exp()
                terms.append(self.cfg.distill_weight * (p * (teacher[j] - lq)).sum(-1).mean())
        return sum(terms[1:], terms[0]) / self.L  # summed in level order
