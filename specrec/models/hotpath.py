"""The GR model's serving hot path as tensor-only functions.

Decoding needs these computations, and nothing else touches the model while
serving:

``encode(hist_sids)``
    [R, S, L] history codes (rows of -1 = padding) -> ``enc_mask`` [R, S] bool
    and the decoder's cross-attention keys/values, stacked over layers
    ``cross_k``/``cross_v`` [n_layers, R, ...] (the layout is the path's own).

``step(tokens, start, parent, enc_mask, cross_k, cross_v, cache_k, cache_v)``
    One KV-cached beam step. ``tokens`` [R, B] is the newest token of each
    beam at decoder position ``start`` ([] int64); ``parent`` [R*B] picks, for
    each beam, the cache row it continues (the beam reorder of the previous
    step, folded in). The cache is static: every position of every layer is
    there, position ``start`` is written and positions <= ``start`` are
    attended. Returns level ``start``'s log-probs [R*B, Vmax] and the cache.

``tree(tokens, positions, tree_mask, enc_mask, cross_k, cross_v)``
    Verification of a prefix tree in one pass: ``tokens`` [R, T] are the tree's
    nodes (BOS at the root, else the node's last code), ``positions`` [R, T]
    their depth, ``tree_mask`` [R, T, T] True where node i may attend node j
    (its ancestors and itself). Returns [R, T, L, Vmax]: at a node of depth j,
    level j is the distribution of the next code after that prefix (see
    :mod:`specrec.decoding.tree`).

``head_hidden(enc_mask, cross_k, cross_v, placeholders)``
    The decoder pass over ``[BOS, SP_1 .. SP_{L-1}]`` that the NEZHA draft head
    reads: [R, L, d].

Levels with fewer than Vmax codes are padded with -inf.

:class:`FusedHotPath` is their one definition: the eager backend runs it in
torch and the graph backends (ONNX Runtime) export it, so the decoder step, the
decoder layers and the searches exist once. It computes what the
:class:`~specrec.models.tiger.Tiger` model (the training module, and the
reference the tests hold it to) computes with fewer, larger operations: one
matrix for q/k/v, the attention scale folded into the q weights, keys kept
transposed so no attention needs a transpose, the cross-attention keys/values
of all layers in one matrix product, each layer's cross-attention query and
output weights folded into a request's keys and values once per graph
(:meth:`FusedHotPath.cross`), and only the stepped level's output layer.
Every decoder pass is :meth:`FusedHotPath.decoder` with its own kind of
self-attention (a mask, the static cache of a step, the root alone, a tree's
gathered ancestors). It also has whole searches as single graphs: the
constrained beam search (:meth:`FusedHotPath.beam_search`), the NEZHA head's
(:meth:`FusedHotPath.head_beam_search`, the head's one search of
:func:`~specrec.models.nezha_head.head_search`) and the distilled drafter's,
each step of them :func:`~specrec.decoding.topk.constrained_topk`; they read
the item set as dense child tables (``tables[j]`` [nodes_j + 1, Vmax] int32: the child node of
each code, -1 where invalid; the last row, read by a dead beam, is all -1).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from ..decoding.topk import constrained_topk
from .nezha_head import gru_cell, head_level_logprobs, head_search
from .tiger import BOS_TOKEN, PAD_TOKEN, DecoderLayer, EncoderLayer, Tiger

NEG_INF = float("-inf")

#: layer ``i``'s self-attention, as one decoder pass computes it: (i, layer, its normed input h [N, T, d]) ->
#: the attention output [N, T, h*dk] before the output projection
SelfAttention = Callable[[int, "_Layer", torch.Tensor], torch.Tensor]


def _stacked_heads(model: Tiger) -> tuple[torch.Tensor, torch.Tensor]:
    """Every level's output layer, padded to Vmax: weights [L, Vmax, d], bias [L, Vmax] (-inf padding)."""
    cfg = model.cfg
    vmax = max(cfg.level_sizes)
    ws, bs = [], []
    with torch.no_grad():
        for lvl, v in enumerate(cfg.level_sizes):
            if model.heads is not None:
                head = cast(nn.Linear, model.heads[lvl])
                w, b = head.weight, head.bias
            else:
                assert model.head_bias is not None  # tied output layers keep a bias per level
                off = cfg.offsets()[lvl]
                w, b = model.tok.weight[off : off + v], model.head_bias[lvl]
            ws.append(F.pad(w.detach(), (0, 0, 0, vmax - v)))
            bs.append(F.pad(b.detach(), (0, vmax - v), value=NEG_INF))
    return torch.stack(ws), torch.stack(bs)


class Cross(NamedTuple):
    """A request's encoder state as its decoder passes read it (:meth:`FusedHotPath.cross`): the padding bias
    [R, 1, 1, S] and per decoder layer ``a`` [R, d, h*S] (each head's scaled query weights times its keys,
    heads side by side) and ``b`` [R, h*S, d] (each head's values times its output weights, stacked)."""

    bias: torch.Tensor
    a: list[torch.Tensor]
    b: list[torch.Tensor]


class _Layer(nn.Module):
    """One transformer layer's weights, fused for the graph path."""

    def __init__(self, ln: list[nn.LayerNorm], qkv: torch.Tensor, o: torch.Tensor, ff, cross_q=None, cross_o=None):
        super().__init__()
        self.ln = nn.ModuleList(ln)
        self.qkv = nn.Parameter(qkv, requires_grad=False)  # [d, 3*inner] (q scaled)
        self.o = nn.Parameter(o, requires_grad=False)  # [inner, d]
        self.fc1_w = nn.Parameter(ff.fc1.weight.detach().t().contiguous(), requires_grad=False)
        self.fc1_b = nn.Parameter(ff.fc1.bias.detach().clone(), requires_grad=False)
        self.fc2_w = nn.Parameter(ff.fc2.weight.detach().t().contiguous(), requires_grad=False)
        self.fc2_b = nn.Parameter(ff.fc2.bias.detach().clone(), requires_grad=False)
        self.gelu = isinstance(ff.act, nn.GELU)
        if cross_q is not None:
            self.cross_q = nn.Parameter(cross_q, requires_grad=False)
            self.cross_o = nn.Parameter(cross_o, requires_grad=False)

    def ff(self, x: torch.Tensor) -> torch.Tensor:
        h = x @ self.fc1_w + self.fc1_b
        h = F.gelu(h) if self.gelu else torch.relu(h)
        return h @ self.fc2_w + self.fc2_b


class FusedHotPath(nn.Module):
    """The same functions with fused weights, for graph backends."""

    offsets: torch.Tensor  # [L] each level's first token id (a buffer)

    def __init__(self, model: Tiger, head=None, drafter=None):
        super().__init__()
        model = model.eval()
        cfg = self.cfg = model.cfg
        self.h, self.dk, self.d = cfg.n_heads, cfg.d_kv, cfg.d_model
        self.inner = self.h * self.dk
        self.L, self.sizes, self.vmax = cfg.sid_len, list(cfg.level_sizes), max(cfg.level_sizes)
        self.items_input = cfg.encoder_input == "items"
        self.causal = cfg.causal_encoder
        scale = 1.0 / math.sqrt(self.dk)

        def t(w):
            return w.detach().t().contiguous()

        def qkv(a):
            return torch.cat([t(a.q.weight) * scale, t(a.k.weight), t(a.v.weight)], dim=1)

        enc_layers = [cast(EncoderLayer, m) for m in model.enc_layers]
        dec_layers = [cast(DecoderLayer, m) for m in model.dec_layers]
        self.enc_layers = nn.ModuleList(
            _Layer([copy_ln(layer.ln1), copy_ln(layer.ln2)], qkv(layer.attn), t(layer.attn.o.weight), layer.ff)
            for layer in enc_layers
        )
        self.dec_layers = nn.ModuleList(
            _Layer(
                [copy_ln(layer.ln1), copy_ln(layer.ln2), copy_ln(layer.ln3)],
                qkv(layer.self_attn),
                t(layer.self_attn.o.weight),
                layer.ff,
                # per head: [h, d, dk] (scaled) and [h, dk, d], as :meth:`cross` folds them into keys/values
                (t(layer.cross_attn.q.weight) * scale).view(self.d, self.h, self.dk).transpose(0, 1).contiguous(),
                t(layer.cross_attn.o.weight).view(self.h, self.dk, self.d).contiguous(),
            )
            for layer in dec_layers
        )
        # cross-attention keys/values of every decoder layer in one product: [d, n_layers * 2 * inner]
        self.cross_kv = nn.Parameter(
            torch.cat(
                [
                    torch.cat([t(layer.cross_attn.k.weight), t(layer.cross_attn.v.weight)], 1)
                    for layer in dec_layers
                ],
                1,
            ),
            requires_grad=False,
        )
        self.enc_ln, self.dec_ln = copy_ln(model.enc_ln), copy_ln(model.dec_ln)
        self.tok = nn.Parameter(model.tok.weight.detach().clone(), requires_grad=False)
        self.enc_pos = nn.Parameter(model.enc_pos.weight.detach().clone(), requires_grad=False)
        self.dec_pos = nn.Parameter(model.dec_pos.weight.detach().clone(), requires_grad=False)
        w, b = _stacked_heads(model)
        self.head_w = nn.Parameter(w.transpose(1, 2).contiguous(), requires_grad=False)  # [L, d, Vmax]
        # [d, L*Vmax]
        self.head_flat = nn.Parameter(w.permute(2, 0, 1).reshape(self.d, -1).contiguous(), requires_grad=False)
        self.head_b = nn.Parameter(b, requires_grad=False)
        self.register_buffer("offsets", torch.tensor(cfg.offsets(), dtype=torch.int64), persistent=False)
        self.head = _FusedHead(head, model) if head is not None else None
        self.drafter = drafter.eval().requires_grad_(False) if drafter is not None else None

    # -- pieces -----------------------------------------------------------------------------
    def _attend(self, q, k_t, v, bias):
        """q [.., Tq, dk] (pre-scaled), k_t [.., dk, Tk], v [.., Tk, dk], bias broadcastable to [.., Tq, Tk]."""
        return torch.softmax(q @ k_t + bias, dim=-1) @ v

    @staticmethod
    def _bias(mask: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, 0.0, NEG_INF)

    def _attention(self, layer: _Layer, h, bias):
        """Full self-attention over the normed input h [N, T, d] with an additive mask bias [N or 1, 1, T, T]
        -> [N, T, inner]."""
        n, tq, _ = h.shape
        qkv = (h @ layer.qkv).view(n, tq, 3, self.h, self.dk)
        q = qkv[:, :, 0].transpose(1, 2)
        k_t = qkv[:, :, 1].permute(0, 2, 3, 1)
        v = qkv[:, :, 2].transpose(1, 2)
        return self._attend(q, k_t, v, bias).transpose(1, 2).reshape(n, tq, self.inner)

    def cross(self, enc_mask, cross_k, cross_v) -> Cross:
        """What every decoder pass of a request reads from its encoder state, computed once per graph: each layer's
        cross-attention query and output weights folded into the request's keys and values (see :class:`Cross`)."""
        r, s = enc_mask.shape
        a, b = [], []
        for i, m in enumerate(self.dec_layers):
            layer = cast(_Layer, m)
            a.append((layer.cross_q @ cross_k[i]).transpose(1, 2).reshape(r, self.d, self.h * s))
            b.append((cross_v[i] @ layer.cross_o).reshape(r, self.h * s, self.d))
        return Cross(self._bias(enc_mask)[:, None, None, :], a, b)

    def _cross_block(self, layer: _Layer, x, a, b, cbias, heads: tuple):
        """x [R, T, d]; ``a`` [R, d, h*S] and ``b`` [R, h*S, d] (:meth:`cross`): the logits of all heads in one
        product, their outputs summed over heads in another (what a per-head query, attention and output
        projection compute; in ONNX Runtime 31 instead of 47 us a layer at 10 beams, 88 instead of 184 at 50).
        ``heads`` is (R, T, h, S), read once per pass: a size read per layer is a chain of shape nodes per layer
        in a graph."""
        p = torch.softmax((layer.ln[1](x) @ a).view(heads) + cbias, dim=-1)
        return x + p.view(heads[0], heads[1], -1) @ b

    def decoder(self, x, cross: Cross, self_attention: SelfAttention):
        """The decoder layers over x [R, T, d] (a request's T embedded positions: beams, tree nodes, or
        sequences side by side) -> the final norm's states [R, T, d]: every decoder pass, each with its own
        ``self_attention``; ``cross`` is :meth:`cross`'s, made once for all passes of a graph."""
        heads = (x.shape[0], x.shape[1], self.h, cross.bias.shape[-1])
        for i, module in enumerate(self.dec_layers):
            layer = cast(_Layer, module)
            x = x + self_attention(i, layer, layer.ln[0](x)) @ layer.o
            x = self._cross_block(layer, x, cross.a[i], cross.b[i], cross.bias, heads)
            x = x + layer.ff(layer.ln[2](x))
        return self.dec_ln(x)

    def _level_logprobs(self, hidden, level):
        """[N, d] -> [N, Vmax] for one level: a level known when tracing (an int) reads its own output layer
        only; a [] tensor (the step graph's) gets every level's logits in one product (no gather of weights by a
        data-dependent index), then the level's row."""
        if isinstance(level, int):
            return torch.log_softmax(hidden @ self.head_w[level] + self.head_b[level], dim=-1)
        n = hidden.shape[0]
        logits = (hidden @ self.head_flat).view(n, self.L, self.vmax) + self.head_b
        return torch.log_softmax(logits.index_select(1, level.view(1)).squeeze(1), dim=-1)

    # -- encoder ---------------------------------------------------------------------------------
    def encode(self, hist_sids):
        r, s, levels = hist_sids.shape
        tokens = torch.where(hist_sids < 0, PAD_TOKEN, hist_sids + self.offsets)
        emb = self.tok[tokens]  # [R, S, L, d]; PAD embeds to zero
        if self.items_input:
            x, keep = emb.sum(2), hist_sids[:, :, 0] >= 0
        else:
            x, keep = emb.reshape(r, s * levels, self.d), (tokens != PAD_TOKEN).reshape(r, s * levels)
        n = x.shape[1]
        idx = torch.arange(n, device=x.device)
        if self.causal:
            pos = (keep.long().cumsum(1) - 1).clamp(min=0)
            allowed = ((idx.view(1, n, 1) >= idx.view(1, 1, n)) & keep[:, None, :]) | (
                idx.view(1, n, 1) == idx.view(1, 1, n)
            )
        else:
            pos = idx + (self.enc_pos.shape[0] - n)
            allowed = keep[:, None, :].expand(r, n, n)
        x = x + self.enc_pos[pos]
        bias = self._bias(allowed).unsqueeze(1)
        for layer in self.enc_layers:
            x = x + self._attention(layer, layer.ln[0](x), bias) @ layer.o
            x = x + layer.ff(layer.ln[1](x))
        mem = self.enc_ln(x)
        kv = (mem @ self.cross_kv).view(r, n, len(self.dec_layers), 2, self.h, self.dk)
        cross_k = kv[:, :, :, 0].permute(2, 0, 3, 4, 1)  # [n_layers, R, h, dk, S]
        cross_v = kv[:, :, :, 1].permute(2, 0, 3, 1, 4)  # [n_layers, R, h, S, dk]
        return keep, cross_k, cross_v

    # -- a KV-cached step --------------------------------------------------------------------------
    def step(self, tokens, start, parent, enc_mask, cross_k, cross_v, cache_k, cache_v):
        """Caches here: keys [n_layers, N, h, dk, L] (transposed), values [n_layers, N, h, L, dk]."""
        hidden, new_k, new_v = self.step_hidden(tokens, start, parent, enc_mask, cross_k, cross_v, cache_k, cache_v)
        return self._level_logprobs(hidden, start), new_k, new_v

    def step_hidden(self, tokens, start, parent, enc_mask, cross_k, cross_v, cache_k, cache_v):
        """:meth:`step` up to the final norm: the decoder states [N, d] and the new cache."""
        r, b = tokens.shape
        n = r * b
        x = self.tok[tokens] + self.dec_pos[start]  # [R, B, d]: a request's beams side by side
        cache_k = cache_k.index_select(1, parent)
        cache_v = cache_v.index_select(1, parent)
        slots = torch.arange(self.L, device=x.device)
        write_k = (slots == start).view(1, 1, 1, self.L)
        write_v = (slots == start).view(1, 1, self.L, 1)
        sbias = self._bias(slots <= start).view(1, 1, 1, self.L)
        new_k, new_v = [], []

        def cached(i, layer, h):  # position ``start`` written into the static cache, positions <= ``start`` attended
            qkv = (h @ layer.qkv).view(n, 3, self.h, self.dk)
            k = torch.where(write_k, qkv[:, 1].unsqueeze(-1), cache_k[i])
            v = torch.where(write_v, qkv[:, 2].unsqueeze(2), cache_v[i])
            new_k.append(k)
            new_v.append(v)
            return self._attend(qkv[:, 0].unsqueeze(2), k, v, sbias).reshape(r, b, self.inner)

        hidden = self.decoder(x, self.cross(enc_mask, cross_k, cross_v), cached)
        return hidden.reshape(n, self.d), torch.stack(new_k), torch.stack(new_v)

    def empty_cache(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        n, dev = len(self.dec_layers), self.tok.device
        return (torch.zeros(n, rows, self.h, self.dk, self.L, device=dev),
                torch.zeros(n, rows, self.h, self.L, self.dk, device=dev))

    # -- a prefix tree --------------------------------------------------------------------------------
    def tree(self, tokens, positions, tree_mask, enc_mask, cross_k, cross_v):
        r, t = tokens.shape
        x = self.tok[tokens] + self.dec_pos[positions]
        sbias = self._bias(tree_mask).unsqueeze(1)
        h = self.decoder(x, self.cross(enc_mask, cross_k, cross_v),
                         lambda i, layer, h: self._attention(layer, h, sbias))
        logits = (h @ self.head_flat).view(r, t, self.L, self.vmax) + self.head_b
        return torch.log_softmax(logits, dim=-1)

    # -- whole searches ------------------------------------------------------------------------------
    def beam_search(self, enc_mask, cross_k, cross_v, tables: list[torch.Tensor], width: int):
        """Constrained beam search of the target in one graph -> codes [R, W, L], scores [R, W],
        token_logp [R, W, L], alive [R, W]. One decoder pass per level over the kept beams, each attending
        to its ancestors' keys/values kept from the earlier passes (at most L): unlike :meth:`step`'s static
        cache, nothing is reordered or rewritten per step, which made beam 1.20x (K=10) to 1.57x (K=50)
        faster end to end on the CPU (``bench/results/HISTORY.md``, "Policies side by side")."""
        r, dev = enc_mask.shape[0], enc_mask.device
        cross = self.cross(enc_mask, cross_k, cross_v)
        h0, kept = self.root(cross)
        state, _ = SearchState.root(r, dev).advance(self._level_logprobs(h0, 0).view(-1, 1, self.vmax), tables[0],
                                                     width)
        anc = torch.zeros(r, state.codes.shape[1], 1, dtype=torch.int64, device=dev)  # columns into ``kept``
        state = self._descend(state, anc, kept, cross, tables, width)
        return state.codes, state.scores, state.token_logp, state.nodes >= 0

    def _descend(self, state: SearchState, anc, kept, cross: Cross, tables: list[torch.Tensor],
                 width: int) -> SearchState:
        """The beam search's remaining levels from ``state`` (prefixes of length l): one decoder pass per level
        over the kept beams, each beam attending to its ancestors ``anc`` [R, W, l] (columns into the earlier
        passes' keys/values ``kept``, the root first) and itself."""
        r, dev = state.codes.shape[0], state.codes.device
        for level in range(state.codes.shape[2], self.L):
            w = state.codes.shape[1]
            own = torch.arange(w, device=dev).view(1, w, 1).expand(r, -1, -1) + kept[0].shape[1]
            cols = torch.cat([anc, own], -1)  # [R, W, level + 1]: the root, the beam's ancestors, itself
            x = self.tok[state.codes[:, :, -1].clamp(min=0) + self.offsets[level - 1]] + self.dec_pos[level]
            hid, kept = self._pass_over(x, cols, kept, cross)
            state, par = state.advance(torch.log_softmax(hid @ self.head_w[level] + self.head_b[level], dim=-1),
                                       tables[level], width)
            anc = cols.gather(1, par.unsqueeze(-1).expand(-1, -1, cols.shape[-1]))
        return state

    def resume(self, enc_mask, cross_k, cross_v, tables: list[torch.Tensor], width: int, codes, scores, token_logp,
               nodes, parent, kept_kv):
        """The target's beam search from level 2 on, for rows whose drafts missed part of the target's frontier:
        :meth:`draft_verify` already verified levels 0 and 1 exactly (the root and the target's own top-``width``
        prefixes of length 1 are nodes of its tree), so this starts from its beams of length 2 (``codes``
        [R, W, 2], ``scores``, ``token_logp``, ``nodes``), each one's parent among those nodes ``parent`` [R, W]
        and their keys|values ``kept_kv`` [n_layers, R, 1 + W, 2 * inner] (the root first): L-2 passes
        over ``width`` beams instead of a whole search's L. -> codes, scores, token_logp, alive (exactly
        :meth:`beam_search`'s)."""
        anc = torch.stack([torch.zeros_like(parent), parent + 1], -1)  # the root, the beam's node of depth 1
        kept = list(kept_kv.unbind(0))
        state = self._descend(SearchState(codes, scores, token_logp, nodes), anc, kept,
                              self.cross(enc_mask, cross_k, cross_v), tables, width)
        return state.codes, state.scores, state.token_logp, state.nodes >= 0

    def head_hidden(self, enc_mask, cross_k, cross_v, placeholders=None):
        r = enc_mask.shape[0]
        ph = self.head.placeholders if placeholders is None else placeholders
        x = torch.cat([self.tok[BOS_TOKEN].view(1, 1, -1).expand(r, 1, -1), ph.unsqueeze(0).expand(r, -1, -1)], 1)
        x = x + self.dec_pos[: self.L].unsqueeze(0)
        idx = torch.arange(self.L, device=x.device)
        sbias = self._bias(idx.view(self.L, 1) >= idx.view(1, self.L)).view(1, 1, self.L, self.L)
        return self.decoder(x, self.cross(enc_mask, cross_k, cross_v),
                            lambda i, layer, h: self._attention(layer, h, sbias))

    def head_beam_search(self, enc_mask, cross_k, cross_v, tables: list[torch.Tensor], width: int):
        """The NEZHA head's constrained beam search (its decoder pass included) in one graph."""
        hd = self.head
        assert hd is not None  # a hot path made with a NEZHA head
        hid = self.head_hidden(enc_mask, cross_k, cross_v)  # [R, L, d]
        state = head_search(hid, hd.level_logprobs,
                            lambda s, level, codes: hd.advance(s, level, codes + self.offsets[level], self.tok),
                            lambda st, logq, level: st.advance(logq, tables[level], width),
                            SearchState.root(hid.shape[0], hid.device))
        return state.codes, state.scores, state.token_logp, state.nodes >= 0

    # -- the distilled drafter and one tree pass over its beams (``strict`` and ``nezha``) ----------------
    def root(self, cross: Cross, keys: bool = True):
        """The decoder at BOS alone: h0 [R, d] and each layer's key|value there ([R, 1, 2 * inner]: what later
        passes over its descendants attend to). One position attends only to itself, so its self-attention is
        its own value. Without ``keys`` (a search that makes no later pass; the list is then empty) only the
        value's third of the fused [q | k | v] projection is read and multiplied (1.6 MB fewer weights per
        request). With them the whole projection is, the same weights the later passes read (a slice would be
        a second copy of them in the graph)."""
        r = cross.bias.shape[0]
        x = (self.tok[BOS_TOKEN] + self.dec_pos[0]).view(1, 1, self.d).expand(r, 1, self.d)
        kv: list = []

        def own(i, layer, h):  # h [R, 1, d]
            if not keys:
                return h @ layer.qkv[:, 2 * self.inner:]
            kv.append((h @ layer.qkv)[:, :, self.inner:])  # [R, 1, 2 * inner]: its key | value
            return kv[-1][:, :, self.inner:]

        return self.decoder(x, cross, own)[:, 0], kv

    def _drafter_logprobs(self, h0, codes):
        """The drafter's next level after prefixes codes [R, B, j] -> [R, B, Vmax] (-inf padding)."""
        lq = self.drafter.level_logprobs(h0, codes.clamp(min=0))
        v = lq.shape[-1]
        return lq if v == self.vmax else F.pad(lq, (0, self.vmax - v), value=NEG_INF)

    def _draft(self, cross: Cross, tables, widths: list[int], keys: bool = True):
        """Root pass, level 0 exact (the target's), then the drafter's levels; ``widths[j]`` beams kept after
        level j. Returns (h0, the root's key|value per layer (none without ``keys``: no tree pass follows), the
        kept states per level, their parent beams per level)."""
        r = cross.bias.shape[0]
        h0, kv = self.root(cross, keys=keys)
        logp = self._level_logprobs(h0, 0).view(-1, 1, self.vmax)
        states, parents = [], []
        state = SearchState.root(r, h0.device)
        for level, w in enumerate(widths):
            if level > 0:
                logp = self._drafter_logprobs(h0, state.codes)
            state, par = state.advance(logp, tables[level], w)
            states.append(state)
            parents.append(par)
        return h0, kv, states, parents

    def draft_search(self, enc_mask, cross_k, cross_v, tables: list[torch.Tensor], width: int):
        """The distilled drafter's constrained beam search (level 0 exact) in one graph -> codes [R, W, L],
        scores [R, W] (level 0's target log-prob plus the drafter's), token_logp [R, W, L], alive [R, W]."""
        _, _, states, _ = self._draft(self.cross(enc_mask, cross_k, cross_v), tables, [width] * self.L, keys=False)
        s = states[-1]
        return s.codes, s.scores, s.token_logp, s.nodes >= 0

    def draft_score(self, enc_mask, cross_k, cross_v, tables: list[torch.Tensor], width: int):
        """``specgr``'s first round in one graph: the distilled drafter's ``width`` beams (level 0 exact) and
        the target's log-probability of every code of each, from one tree pass over the beams' kept prefixes
        -> codes [R, W, L], the drafter's scores [R, W], the target's token_logp [R, W, L], alive [R, W]."""
        L = self.L
        cross = self.cross(enc_mask, cross_k, cross_v)
        _, root_kv, states, parents = self._draft(cross, tables, [width] * L)
        node_logp, _ = self._ancestor_tree(states, parents, root_kv, cross)
        final = states[-1]
        codes = final.codes.clamp(min=0)
        target = [final.token_logp[:, :, 0]]  # level 0 is the target's own
        levels = []
        at = parents[L - 1]  # [R, W]: each final beam's prefix of length L-1 among states[L-2]
        for j in range(L - 1, 0, -1):  # level j's code, read at the node of the beam's prefix of length j
            lp = node_logp[j - 1].gather(1, at.unsqueeze(-1).expand(-1, -1, self.vmax))
            levels.append(lp.gather(2, codes[:, :, j : j + 1]).squeeze(-1))
            if j > 1:
                at = parents[j - 1].gather(1, at)
        target += levels[::-1]
        return final.codes, final.scores, torch.stack(target, -1), final.nodes >= 0

    def _ancestor_tree(self, states, parents, root_kv, cross: Cross,
                       chains: list | None = None) -> tuple[list[torch.Tensor], list]:
        """One decoder pass over kept prefixes: ``states[j]`` the prefixes of length j+1 (j = 0..D-1, D <= L-1),
        each beam's parent in ``parents[j]``. Each node attends to its ancestors only (the root, whose
        keys/values come from the root pass, and at most D more), and only its own level's output layer is
        computed. Returns per depth j+1 the next level's log-probs [R, B_j, Vmax] after each kept prefix, and
        each layer's keys|values [R, 1 + T, 2 * inner] (the root first: for a later pass that attends to these
        nodes); with ``chains`` (a list), each depth's ancestor columns into them [R, B_j, j+1] are appended."""
        r, dev = cross.bias.shape[0], cross.bias.device
        states = states[: self.L - 1]
        D = len(states)
        # nodes: depth j+1 = states[j], laid out depth after depth
        sizes = [s.codes.shape[1] for s in states]
        starts = [sum(sizes[:j]) for j in range(D)]
        t = sum(sizes)
        anc_parts: list[torch.Tensor] = []
        tok: list[torch.Tensor] = []
        chain = None  # per depth: each node's ancestor columns (1-based: column 0 is the root)
        for j, s in enumerate(states):
            own = torch.arange(sizes[j], device=dev).view(1, -1).expand(r, -1) + (1 + starts[j])
            if chain is None:
                chain = own.unsqueeze(-1)
            else:
                chain = torch.cat([chain.gather(1, parents[j].unsqueeze(-1).expand(-1, -1, chain.shape[-1])),
                                   own.unsqueeze(-1)], -1)
            if chains is not None:
                chains.append(chain)
            anc_parts.append(F.pad(torch.cat([torch.zeros_like(own).unsqueeze(-1), chain], -1), (0, D - 1 - j)))
            tok.append(self.tok[s.codes[:, :, -1].clamp(min=0) + self.offsets[j]] + self.dec_pos[j + 1])
        anc = torch.cat(anc_parts, 1)  # [R, T, D+1]: ancestor columns (root, depth 1.., self), then padding
        depth = torch.cat([torch.full((sizes[j],), j + 1, dtype=torch.int64, device=dev) for j in range(D)])
        slot_ok = torch.arange(D + 1, device=dev).view(1, D + 1) <= depth.view(-1, 1)  # [T, D+1]
        abias = self._bias(slot_ok).view(1, t, D + 1, 1)
        x = torch.cat(tok, 1)  # [R, T, d]
        hid, kept = self._pass_over(x, anc, root_kv, cross, abias)
        return [
            torch.log_softmax(
                hid[:, starts[j] : starts[j] + sizes[j]] @ self.head_w[j + 1] + self.head_b[j + 1], dim=-1
            )
            for j in range(D)
        ], kept

    def _pass_over(self, x, cols, kept, cross: Cross, bias=None):
        """A decoder pass over new nodes x [R, w, d] whose self-attention reads only the columns ``cols``
        [R, w, m] of [earlier nodes' keys|values ``kept`` (per layer, [R, t, 2 * inner] each); their own]: each
        node's ancestors and itself (``bias`` [1, w, m, 1], -inf on padding columns, where nodes have fewer).
        -> (final states [R, w, d], ``kept`` with the new nodes appended).

        Keys and values travel together ([key | value] rows, as the fused projection makes them), so a layer
        appends, gathers and reshapes once for both (beam W=10: 988 -> 897 graph nodes after ONNX Runtime's
        optimisations, 4.11 -> 4.04 ms)."""
        r, w, _ = x.shape
        m, inner = cols.shape[-1], self.inner
        flat = (cols + torch.arange(r, device=x.device).view(r, 1, 1) * (kept[0].shape[1] + w)).reshape(-1)
        out: list = []

        def ancestors(i, layer, h):
            qkv = h @ layer.qkv  # [R, w, 3 * inner]
            kv = torch.cat([kept[i], qkv[:, :, inner:]], 1)  # [R, t + w, 2 * inner]
            out.append(kv)
            g = kv.reshape(-1, 2 * inner).index_select(0, flat).view(-1, w, m, 2, self.h, self.dk)
            gk, gv = g.split(1, dim=3)  # [R, w, m, 1, h, dk] each: one node for both
            q = qkv[:, :, :inner].reshape(-1, w, 1, 1, self.h, self.dk)
            logits = (q * gk).sum(-1)  # [R, w, m, 1, h]
            a = torch.softmax(logits if bias is None else logits + bias.unsqueeze(-1), dim=2)
            return (a.unsqueeze(-1) * gv).sum(2).reshape(-1, w, inner)

        return self.decoder(x, cross, ancestors), out

    def _leaf_pass(self, codes, anc, kept, cross: Cross):
        """A second pass over the target's own beams of length L-1 (``codes`` [R, W, L-1]), whose ancestors are
        nodes of an earlier :meth:`_ancestor_tree` pass: ``anc`` [R, W, L-1] their columns in its keys/values
        ``kept`` (root, depth 1 .. L-2). -> level L-1's log-probs [R, W, Vmax]."""
        r, w, _ = codes.shape
        L = self.L
        x = self.tok[codes[:, :, -1].clamp(min=0) + self.offsets[L - 2]] + self.dec_pos[L - 1]
        own = torch.arange(w, device=codes.device).view(1, w, 1).expand(r, -1, -1) + kept[0].shape[1]
        hid, _ = self._pass_over(x, torch.cat([anc, own], -1), kept, cross)
        return torch.log_softmax(hid @ self.head_w[L - 1] + self.head_b[L - 1], dim=-1)

    def draft_verify(self, enc_mask, cross_k, cross_v, tables: list[torch.Tensor], width: int, n: int):
        """``strict`` in one graph: the drafter's beams (the target's exact top-``width`` at level 0, then ``n``
        drafted prefixes per level up to L-2), one tree pass over them, the target's own beam search of
        ``width`` read from it up to level L-2, then one small pass over the target's own ``width`` beams of
        length L-1 (their ancestors are nodes of the first pass) for the last level.

        Tree nodes attend to their ancestors only (the root, whose keys/values come from the root pass, and
        at most L-1 more), and only their own level's output layer is computed. The last level needs no
        drafts: drafting it (N more nodes) cost more than the small pass (measured: ``bench/results/HISTORY.md``).
        Returns the target's beams (codes, scores, token_logp, alive: exactly ``beam``'s where ``covered``),
        ``covered`` [R] (every beam the target kept at levels 1..L-2 was drafted) and ``frontier``
        [R, L-1, 2]: per level, the target's kept prefixes and how many of them the tree held (at level 0 and
        the last level, all: they are the target's own), then what :meth:`resume` needs to finish a row that is
        not covered: the target's beams after level 1 (codes, scores, token_logp, nodes), their parents among
        the nodes of depth 1, and the keys|values of the root and those nodes [n_layers, R, 1 + W, 2 * inner]."""
        r, dev = enc_mask.shape[0], enc_mask.device
        L = self.L
        if L < 3:
            raise ValueError(f"draft_verify needs SIDs of 3 levels or more (these have {L})")
        cross = self.cross(enc_mask, cross_k, cross_v)
        _, root_kv, states, parents = self._draft(cross, tables, [width] + [n] * (L - 3))
        chains: list = []
        node_logp, kept = self._ancestor_tree(states, parents, root_kv, cross, chains)
        target = states[0]
        covered = torch.ones(r, dtype=torch.bool, device=dev)
        held0 = target.nodes.ge(0).sum(1)
        frontier = [torch.stack([held0, held0], -1)]
        col = torch.arange(width, device=dev).view(1, -1).expand(r, -1)[:, : target.codes.shape[1]]
        logp = node_logp[0]
        for j in range(1, L - 1):
            if j > 1:
                d = states[j - 1]
                match = (self._keys(target.codes).unsqueeze(2) == self._keys(d.codes).unsqueeze(1))  # [R, W, n]
                found = match.any(-1)
                alive = target.nodes >= 0
                covered = covered & (found | ~alive).all(1)
                frontier.append(torch.stack([alive.sum(1), (found & alive).sum(1)], -1))
                col = match.float().argmax(-1)
                logp = node_logp[j - 1].gather(1, col.unsqueeze(-1).expand(-1, -1, self.vmax))
            target, par = target.advance(logp, tables[j], width)
            col = col.gather(1, par)  # each new beam's parent node at depth j
            if j == 1:  # where :meth:`resume` starts a row whose drafts miss
                at1 = (target.codes, target.scores, target.token_logp, target.nodes, col)
        ch = chains[L - 3]  # the ancestor columns of the first pass's deepest nodes
        anc = torch.cat([torch.zeros_like(col).unsqueeze(-1),
                         ch.gather(1, col.unsqueeze(-1).expand(-1, -1, ch.shape[-1]))], -1)
        last = self._leaf_pass(target.codes, anc, kept, cross)
        alive = target.nodes >= 0
        frontier.append(torch.stack([alive.sum(1), alive.sum(1)], -1))
        target, _ = target.advance(last, tables[L - 1], width)
        w1 = 1 + states[0].codes.shape[1]  # the root and the nodes of depth 1
        kept_kv = torch.stack([kv[:, :w1] for kv in kept])
        return (target.codes, target.scores, target.token_logp, target.nodes >= 0, covered, torch.stack(frontier, 1),
                *at1, kept_kv)

    def _keys(self, codes):
        """Mixed-radix key of each prefix codes [R, B, j] (codes of dead beams may be anything)."""
        key = torch.zeros(codes.shape[:-1], dtype=torch.int64, device=codes.device)
        for j in range(codes.shape[-1]):
            key = key * self.sizes[j] + codes[..., j].clamp(min=0)
        return key


class SearchState:
    """Beams inside a graph: codes [R, B, l], scores, token log-probs, trie nodes."""

    def __init__(self, codes, scores, token_logp, nodes):
        self.codes, self.scores, self.token_logp, self.nodes = codes, scores, token_logp, nodes

    @staticmethod
    def root(r: int, device: torch.device | None = None) -> SearchState:
        return SearchState(torch.zeros(r, 1, 0, dtype=torch.int64, device=device), torch.zeros(r, 1, device=device),
                           torch.zeros(r, 1, 0, device=device), torch.zeros(r, 1, dtype=torch.int64, device=device))

    def advance(self, logp, table, width: int):
        """One constrained top-k (:func:`~specrec.decoding.topk.constrained_topk`) over logp [R, B, V], the
        level's dense child ``table`` telling the valid codes -> (next state, parent beam [R, W])."""
        _, b, v = logp.shape
        child = table[self.nodes.reshape(-1)].view(-1, b, v).long()  # node -1 reads the last row: all -1
        out = constrained_topk(self.codes, self.scores, self.token_logp, logp, child >= 0, width,
                               lambda parent, code, idx: child.view(-1, b * v).gather(1, idx))
        return SearchState(out.codes, out.scores, out.token_logp, out.nodes), out.parent


class _FusedHead(nn.Module):
    """The NEZHA head's level transitions and output layers (weights copied: output layers padded to Vmax
    and stacked, GRU weights transposed), run by the head's own functions (:mod:`.nezha_head`)."""

    def __init__(self, head, model: Tiger):
        super().__init__()
        self.placeholders = nn.Parameter(head.placeholders.detach().clone(), requires_grad=False)
        self.ln = copy_ln(head.ln)
        vmax = max(model.cfg.level_sizes)
        ws = [F.pad(h.weight.detach(), (0, 0, 0, vmax - h.weight.shape[0])).t().contiguous() for h in head.heads]
        bs = [F.pad(h.bias.detach(), (0, vmax - h.bias.shape[0]), value=NEG_INF) for h in head.heads]
        self.w = nn.Parameter(torch.stack(ws), requires_grad=False)  # [L, d, Vmax]
        self.b = nn.Parameter(torch.stack(bs), requires_grad=False)
        self.gru_ih = nn.ParameterList(nn.Parameter(g.weight_ih.detach().t().contiguous(), requires_grad=False)
                                       for g in head.transitions)
        self.gru_hh = nn.ParameterList(nn.Parameter(g.weight_hh.detach().t().contiguous(), requires_grad=False)
                                       for g in head.transitions)
        self.gru_bih = nn.ParameterList(
            nn.Parameter(g.bias_ih.detach().clone(), requires_grad=False) for g in head.transitions
        )
        self.gru_bhh = nn.ParameterList(
            nn.Parameter(g.bias_hh.detach().clone(), requires_grad=False) for g in head.transitions
        )

    def level_logprobs(self, h, s, level: int):
        """h [R, d], s [R, B, d] -> [R, B, Vmax]."""
        return head_level_logprobs(h, s, self.ln, self.w[level], self.b[level])

    def advance(self, s, level: int, tokens, tok_emb):
        """s [R, B, d], tokens [R, B] -> [R, B, d]: the level's GRU cell on the tokens' embeddings."""
        return gru_cell(tok_emb[tokens], s, self.gru_ih[level], self.gru_hh[level], self.gru_bih[level],
                        self.gru_bhh[level])


def copy_ln(ln: nn.LayerNorm) -> nn.LayerNorm:
    new = nn.LayerNorm(ln.normalized_shape, eps=ln.eps)
    with torch.no_grad():
        new.weight.copy_(ln.weight)
        new.bias.copy_(ln.bias)
    return new.requires_grad_(False)


def child_tables(trie, vmax: int) -> list[torch.Tensor] | None:
    """Dense child tables of a :class:`~specrec.ids.trie.SidTrie` (None when a level is too big for one);
    see :meth:`~specrec.ids.trie.SidTrie.child_tables`."""
    return trie.child_tables(vmax)
