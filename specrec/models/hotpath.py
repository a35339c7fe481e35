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
decoder layers and every pass exist once. It computes what the
:class:`~specrec.models.tiger.Tiger` model (the training module, and the
reference the tests hold it to) computes with fewer, larger operations: one
matrix for q/k/v, the attention scale folded into the q weights, keys kept
transposed so no attention needs a transpose, the cross-attention keys/values
of all layers in one matrix product, each layer's cross-attention query and
output weights folded into a request's keys and values once per graph
(:meth:`FusedHotPath.cross`), and only the stepped level's output layer.
Every decoder pass is :meth:`FusedHotPath.decoder` with its own kind of
self-attention (a mask, the static cache of a step, the root alone, a tree's
gathered ancestors: :meth:`FusedHotPath.ancestor_pass`).

This file is the model maths only: the whole searches (the constrained beam
search, the NEZHA head's, the distilled drafter's, ``strict``'s draft and
verification) are a registry above it, :mod:`specrec.decoding.searches`, each a
function of this hot path; they import the model, never the other way round.
They read the item set level by level (:mod:`specrec.ids.tables`: each
level's children as a dense table or CSR arrays, read by one function).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import nn

from .nezha_head import gru_cell, head_level_logprobs
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
        # a copy, as every weight above is: a backend moves its hot path to its device (``.to``), which moves a
        # module's parameters in place, and the caller's drafter is shared (the bundle hands one to every backend)
        self.drafter = copy.deepcopy(drafter).eval().requires_grad_(False) if drafter is not None else None

    # -- pieces -----------------------------------------------------------------------------
    def _attend(self, q, k_t, v, bias):
        """q [.., Tq, dk] (pre-scaled), k_t [.., dk, Tk], v [.., Tk, dk], bias broadcastable to [.., Tq, Tk]."""
        return torch.softmax(q @ k_t + bias, dim=-1) @ v

    @staticmethod
    def mask_bias(mask: torch.Tensor) -> torch.Tensor:
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
        return Cross(self.mask_bias(enc_mask)[:, None, None, :], a, b)

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

    def level_logprobs(self, hidden, level):
        """[.., d] -> [.., Vmax] for one level: a level known when tracing (an int) reads its own output layer
        only; a [] tensor (the step graph's, hidden [N, d]) gets every level's logits in one product (no gather
        of weights by a data-dependent index), then the level's row."""
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
        bias = self.mask_bias(allowed).unsqueeze(1)
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
        return self.level_logprobs(hidden, start), new_k, new_v

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
        sbias = self.mask_bias(slots <= start).view(1, 1, 1, self.L)
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
        sbias = self.mask_bias(tree_mask).unsqueeze(1)
        h = self.decoder(x, self.cross(enc_mask, cross_k, cross_v),
                         lambda i, layer, h: self._attention(layer, h, sbias))
        logits = (h @ self.head_flat).view(r, t, self.L, self.vmax) + self.head_b
        return torch.log_softmax(logits, dim=-1)

    def head_hidden(self, enc_mask, cross_k, cross_v, placeholders=None):
        r = enc_mask.shape[0]
        ph = self.head.placeholders if placeholders is None else placeholders
        x = torch.cat([self.tok[BOS_TOKEN].view(1, 1, -1).expand(r, 1, -1), ph.unsqueeze(0).expand(r, -1, -1)], 1)
        x = x + self.dec_pos[: self.L].unsqueeze(0)
        idx = torch.arange(self.L, device=x.device)
        sbias = self.mask_bias(idx.view(self.L, 1) >= idx.view(1, self.L)).view(1, 1, self.L, self.L)
        return self.decoder(x, self.cross(enc_mask, cross_k, cross_v),
                            lambda i, layer, h: self._attention(layer, h, sbias))

    # -- the root alone, the distilled drafter's levels, a pass over ancestors (the searches' pieces) -------
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

    def drafter_logprobs(self, h0, codes):
        """The drafter's next level after prefixes codes [R, B, j] -> [R, B, Vmax] (-inf padding)."""
        lq = self.drafter.level_logprobs(h0, codes.clamp(min=0))
        v = lq.shape[-1]
        return lq if v == self.vmax else F.pad(lq, (0, self.vmax - v), value=NEG_INF)

    def ancestor_pass(self, x, cols, kept, cross: Cross, bias=None):
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
