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

:class:`HotPath` writes them with the model's own modules: the reference
(eager backend). :class:`FusedHotPath` computes the same with fewer, larger
operations, for graph backends (ONNX Runtime): one matrix for q/k/v, the
attention scale folded into the q weights, keys kept transposed so no
attention needs a transpose, the cross-attention keys/values of all layers
in one matrix product, and only the stepped level's output layer. It also
has whole searches as single graphs: the constrained beam search
(:meth:`FusedHotPath.beam_search`) and the NEZHA head's
(:meth:`FusedHotPath.head_beam_search`), which read the item set as dense
child tables (``tables[j]`` [nodes_j + 1, Vmax] int32: the child node of
each code, -1 where invalid; the last row, read by a dead beam, is all -1).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .tiger import BOS_TOKEN, PAD_TOKEN, Tiger

NEG_INF = float("-inf")


def _stacked_heads(model: Tiger) -> tuple[torch.Tensor, torch.Tensor]:
    """Every level's output layer, padded to Vmax: weights [L, Vmax, d], bias [L, Vmax] (-inf padding)."""
    cfg = model.cfg
    vmax = max(cfg.level_sizes)
    ws, bs = [], []
    with torch.no_grad():
        for lvl, v in enumerate(cfg.level_sizes):
            if model.heads is not None:
                w, b = model.heads[lvl].weight, model.heads[lvl].bias
            else:
                off = cfg.offsets()[lvl]
                w, b = model.tok.weight[off : off + v], model.head_bias[lvl]
            ws.append(F.pad(w.detach(), (0, 0, 0, vmax - v)))
            bs.append(F.pad(b.detach(), (0, vmax - v), value=NEG_INF))
    return torch.stack(ws), torch.stack(bs)


class HotPath(nn.Module):
    """The reference: the functions above with the (frozen, eval-mode) :class:`Tiger`'s own modules."""

    def __init__(self, model: Tiger):
        super().__init__()
        self.model = model.eval()
        cfg = model.cfg
        self.sizes = list(cfg.level_sizes)
        self.L = cfg.sid_len
        w, b = _stacked_heads(model)
        self.register_buffer("head_w", w, persistent=False)
        self.register_buffer("head_b", b, persistent=False)

    def all_logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., d] -> [..., L, Vmax]: every level's log-softmax."""
        logits = torch.einsum("...d,lvd->...lv", hidden, self.head_w) + self.head_b
        return torch.log_softmax(logits.float(), dim=-1)

    def encode(self, hist_sids: torch.Tensor):
        mem, keep = self.model._memory(hist_sids)
        return (keep, *self.model._cross(mem))

    def step(self, tokens, start, parent, enc_mask, cross_k, cross_v, cache_k, cache_v):
        m = self.model
        r, b = tokens.shape
        n = r * b
        d = m.cfg.d_model
        x = m.tok(tokens).reshape(n, 1, d) + m.dec_pos(start).view(1, 1, d)
        cache_k = cache_k.index_select(1, parent)
        cache_v = cache_v.index_select(1, parent)
        slots = torch.arange(cache_k.shape[3], device=tokens.device)
        write = (slots == start).view(1, 1, -1, 1)
        seen = (slots <= start).view(1, 1, 1, -1)
        cmask = enc_mask[:, None, None, :]
        new_k, new_v = [], []
        for i, layer in enumerate(m.dec_layers):
            a = layer.self_attn
            h = layer.ln1(x)
            q, (k1, v1) = a.split(a.q(h)), a.kv(h)
            k = torch.where(write, k1, cache_k[i])
            v = torch.where(write, v1, cache_v[i])
            x = x + a.o(a.merge(a.attend(q, k, v, seen)))
            c = layer.cross_attn
            q = c.split(c.q(layer.ln2(x).reshape(r, b, d)))
            x = x + c.o(c.merge(c.attend(q, cross_k[i], cross_v[i], cmask)).reshape(n, 1, -1))
            x = x + layer.ff(layer.ln3(x))
            new_k.append(k)
            new_v.append(v)
        return self.all_logprobs(m.dec_ln(x)[:, 0])[:, int(start)], torch.stack(new_k), torch.stack(new_v)

    def tree(self, tokens, positions, tree_mask, enc_mask, cross_k, cross_v):
        m = self.model
        r = tokens.shape[0]
        x = m.tok(tokens) + m.dec_pos(positions)
        smask, cmask = tree_mask[:, None], enc_mask[:, None, None, :]
        for i, layer in enumerate(m.dec_layers):
            x, _ = layer(x, r, (cross_k[i], cross_v[i]), cmask, self_mask=smask)
        return self.all_logprobs(m.dec_ln(x))

    def head_hidden(self, enc_mask, cross_k, cross_v, placeholders):
        m = self.model
        r = enc_mask.shape[0]
        bos = m.tok.weight[BOS_TOKEN].view(1, 1, -1).expand(r, 1, -1)
        x = torch.cat([bos, placeholders.unsqueeze(0).expand(r, -1, -1)], dim=1)
        x = x + m.dec_pos.weight[: self.L].unsqueeze(0)
        cmask = enc_mask[:, None, None, :]
        for i, layer in enumerate(m.dec_layers):
            x, _ = layer(x, r, (cross_k[i], cross_v[i]), cmask)
        return m.dec_ln(x)


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

    def __init__(self, model: Tiger, head=None):
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

        self.enc_layers = nn.ModuleList(
            _Layer([copy_ln(l.ln1), copy_ln(l.ln2)], qkv(l.attn), t(l.attn.o.weight), l.ff) for l in model.enc_layers)
        self.dec_layers = nn.ModuleList(
            _Layer([copy_ln(l.ln1), copy_ln(l.ln2), copy_ln(l.ln3)], qkv(l.self_attn), t(l.self_attn.o.weight), l.ff,
                   t(l.cross_attn.q.weight) * scale, t(l.cross_attn.o.weight)) for l in model.dec_layers)
        # cross-attention keys/values of every decoder layer in one product: [d, n_layers * 2 * inner]
        self.cross_kv = nn.Parameter(torch.cat([torch.cat([t(l.cross_attn.k.weight), t(l.cross_attn.v.weight)], 1)
                                                for l in model.dec_layers], 1), requires_grad=False)
        self.enc_ln, self.dec_ln = copy_ln(model.enc_ln), copy_ln(model.dec_ln)
        self.tok = nn.Parameter(model.tok.weight.detach().clone(), requires_grad=False)
        self.enc_pos = nn.Parameter(model.enc_pos.weight.detach().clone(), requires_grad=False)
        self.dec_pos = nn.Parameter(model.dec_pos.weight.detach().clone(), requires_grad=False)
        w, b = _stacked_heads(model)
        self.head_w = nn.Parameter(w.transpose(1, 2).contiguous(), requires_grad=False)  # [L, d, Vmax]
        self.head_flat = nn.Parameter(w.permute(2, 0, 1).reshape(self.d, -1).contiguous(), requires_grad=False)  # [d, L*Vmax]
        self.head_b = nn.Parameter(b, requires_grad=False)
        self.register_buffer("offsets", torch.tensor(cfg.offsets(), dtype=torch.int64), persistent=False)
        self.head = _FusedHead(head, model) if head is not None else None

    # -- pieces -----------------------------------------------------------------------------
    def _attend(self, q, k_t, v, bias):
        """q [.., Tq, dk] (pre-scaled), k_t [.., dk, Tk], v [.., Tk, dk], bias broadcastable to [.., Tq, Tk]."""
        return torch.softmax(q @ k_t + bias, dim=-1) @ v

    @staticmethod
    def _bias(mask: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, 0.0, NEG_INF)

    def _self_block(self, layer: _Layer, x, bias):
        """Full self-attention over x [N, T, d] with an additive mask bias [N or 1, 1, T, T]."""
        n, tq, _ = x.shape
        qkv = (layer.ln[0](x) @ layer.qkv).view(n, tq, 3, self.h, self.dk)
        q = qkv[:, :, 0].transpose(1, 2)
        k_t = qkv[:, :, 1].permute(0, 2, 3, 1)
        v = qkv[:, :, 2].transpose(1, 2)
        a = self._attend(q, k_t, v, bias).transpose(1, 2).reshape(n, tq, self.inner)
        return x + a @ layer.o

    def _cross_block(self, layer: _Layer, x, ck_t, cv, cbias, r: int):
        """x [N, T, d] with N = r * M: a request's M sequences fold into the query axis."""
        n, tq, _ = x.shape
        q = (layer.ln[1](x).reshape(r, (n // r) * tq, self.d) @ layer.cross_q).view(r, -1, self.h, self.dk).transpose(1, 2)
        a = self._attend(q, ck_t, cv, cbias).transpose(1, 2).reshape(n, tq, self.inner)
        return x + a @ layer.cross_o

    def _level_logprobs(self, hidden, level):
        """[N, d] -> [N, Vmax] for one level (``level`` an int or a [] tensor): every level's logits
        in one product (no gather of weights by a data-dependent index), then the level's row."""
        n = hidden.shape[0]
        logits = (hidden @ self.head_flat).view(n, self.L, self.vmax) + self.head_b
        if isinstance(level, int):
            return torch.log_softmax(logits[:, level], dim=-1)
        return torch.log_softmax(logits.index_select(1, level.view(1)).squeeze(1), dim=-1)

    # -- encoder ---------------------------------------------------------------------------------
    def encode(self, hist_sids):
        r, s, l = hist_sids.shape
        tokens = torch.where(hist_sids < 0, PAD_TOKEN, hist_sids + self.offsets)
        emb = self.tok[tokens]  # [R, S, L, d]; PAD embeds to zero
        if self.items_input:
            x, keep = emb.sum(2), hist_sids[:, :, 0] >= 0
        else:
            x, keep = emb.reshape(r, s * l, self.d), (tokens != PAD_TOKEN).reshape(r, s * l)
        n = x.shape[1]
        idx = torch.arange(n)
        if self.causal:
            pos = (keep.long().cumsum(1) - 1).clamp(min=0)
            allowed = ((idx.view(1, n, 1) >= idx.view(1, 1, n)) & keep[:, None, :]) | (idx.view(1, n, 1) == idx.view(1, 1, n))
        else:
            pos = idx + (self.enc_pos.shape[0] - n)
            allowed = keep[:, None, :].expand(r, n, n)
        x = x + self.enc_pos[pos]
        bias = self._bias(allowed).unsqueeze(1)
        for layer in self.enc_layers:
            x = self._self_block(layer, x, bias)
            x = x + layer.ff(layer.ln[1](x))
        mem = self.enc_ln(x)
        kv = (mem @ self.cross_kv).view(r, n, len(self.dec_layers), 2, self.h, self.dk)
        cross_k = kv[:, :, :, 0].permute(2, 0, 3, 4, 1)  # [n_layers, R, h, dk, S]
        cross_v = kv[:, :, :, 1].permute(2, 0, 3, 1, 4)  # [n_layers, R, h, S, dk]
        return keep, cross_k, cross_v

    # -- a KV-cached step --------------------------------------------------------------------------
    def step(self, tokens, start, parent, enc_mask, cross_k, cross_v, cache_k, cache_v):
        """Caches here: keys [n_layers, N, h, dk, L] (transposed), values [n_layers, N, h, L, dk]."""
        r, b = tokens.shape
        n = r * b
        x = (self.tok[tokens] + self.dec_pos[start]).view(n, 1, self.d)
        cache_k = cache_k.index_select(1, parent)
        cache_v = cache_v.index_select(1, parent)
        slots = torch.arange(self.L)
        write_k = (slots == start).view(1, 1, 1, self.L)
        write_v = (slots == start).view(1, 1, self.L, 1)
        sbias = self._bias(slots <= start).view(1, 1, 1, self.L)
        cbias = self._bias(enc_mask)[:, None, None, :]
        new_k, new_v = [], []
        for i, layer in enumerate(self.dec_layers):
            qkv = (layer.ln[0](x) @ layer.qkv).view(n, 3, self.h, self.dk)
            k = torch.where(write_k, qkv[:, 1].unsqueeze(-1), cache_k[i])
            v = torch.where(write_v, qkv[:, 2].unsqueeze(2), cache_v[i])
            a = self._attend(qkv[:, 0].unsqueeze(2), k, v, sbias).reshape(n, 1, self.inner)
            x = x + a @ layer.o
            x = self._cross_block(layer, x, cross_k[i], cross_v[i], cbias, r)
            x = x + layer.ff(layer.ln[2](x))
            new_k.append(k)
            new_v.append(v)
        return self._level_logprobs(self.dec_ln(x)[:, 0], start), torch.stack(new_k), torch.stack(new_v)

    def empty_cache(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        n = len(self.dec_layers)
        return torch.zeros(n, rows, self.h, self.dk, self.L), torch.zeros(n, rows, self.h, self.L, self.dk)

    # -- a prefix tree --------------------------------------------------------------------------------
    def tree(self, tokens, positions, tree_mask, enc_mask, cross_k, cross_v):
        r, t = tokens.shape
        x = self.tok[tokens] + self.dec_pos[positions]
        sbias = self._bias(tree_mask).unsqueeze(1)
        cbias = self._bias(enc_mask)[:, None, None, :]
        for i, layer in enumerate(self.dec_layers):
            x = self._self_block(layer, x, sbias)
            x = self._cross_block(layer, x, cross_k[i], cross_v[i], cbias, r)
            x = x + layer.ff(layer.ln[2](x))
        h = self.dec_ln(x)
        logits = (h @ self.head_flat).view(r, t, self.L, self.vmax) + self.head_b
        return torch.log_softmax(logits, dim=-1)

    # -- whole searches ------------------------------------------------------------------------------
    def beam_search(self, enc_mask, cross_k, cross_v, tables: list[torch.Tensor], width: int):
        """Constrained beam search of the target in one graph -> codes [R, W, L],
        scores [R, W], token_logp [R, W, L], alive [R, W]."""
        r = enc_mask.shape[0]
        tokens = torch.full((r, 1), BOS_TOKEN, dtype=torch.int64)
        cache_k, cache_v = self.empty_cache(r)
        parent = torch.arange(r)
        state = _SearchState.root(r)
        for level in range(self.L):
            b = tokens.shape[1]
            logp, cache_k, cache_v = self.step(tokens, torch.tensor(level), parent, enc_mask, cross_k, cross_v,
                                               cache_k, cache_v)
            state, par = state.advance(logp.view(r, b, self.vmax), tables[level], width)
            parent = (par + torch.arange(r).view(r, 1) * b).reshape(-1)
            tokens = state.codes[:, :, -1].clamp(min=0) + self.offsets[level]
        return state.codes, state.scores, state.token_logp, state.nodes >= 0

    def head_hidden(self, enc_mask, cross_k, cross_v, placeholders=None):
        r = enc_mask.shape[0]
        ph = self.head.placeholders if placeholders is None else placeholders
        x = torch.cat([self.tok[BOS_TOKEN].view(1, 1, -1).expand(r, 1, -1), ph.unsqueeze(0).expand(r, -1, -1)], 1)
        x = x + self.dec_pos[: self.L].unsqueeze(0)
        idx = torch.arange(self.L)
        sbias = self._bias(idx.view(self.L, 1) >= idx.view(1, self.L)).view(1, 1, self.L, self.L)
        cbias = self._bias(enc_mask)[:, None, None, :]
        for i, layer in enumerate(self.dec_layers):
            x = self._self_block(layer, x, sbias)
            x = self._cross_block(layer, x, cross_k[i], cross_v[i], cbias, r)
            x = x + layer.ff(layer.ln[2](x))
        return self.dec_ln(x)

    def head_beam_search(self, enc_mask, cross_k, cross_v, tables: list[torch.Tensor], width: int):
        """The NEZHA head's constrained beam search (its decoder pass included) in one graph."""
        hd = self.head
        hid = self.head_hidden(enc_mask, cross_k, cross_v)  # [R, L, d]
        r = hid.shape[0]
        s = torch.zeros(r, 1, self.d)
        state = _SearchState.root(r)
        for level in range(self.L):
            logq = hd.level_logprobs(hid[:, level], s, level)  # [R, B, Vmax]
            state, par = state.advance(logq, tables[level], width)
            if level < self.L - 1:
                s = s.gather(1, par.unsqueeze(-1).expand(-1, -1, self.d))
                s = hd.advance(s, level, state.codes[:, :, -1].clamp(min=0) + self.offsets[level], self.tok)
        return state.codes, state.scores, state.token_logp, state.nodes >= 0


class _SearchState:
    """Beams inside a graph: codes [R, B, l], scores, token log-probs, trie nodes."""

    def __init__(self, codes, scores, token_logp, nodes):
        self.codes, self.scores, self.token_logp, self.nodes = codes, scores, token_logp, nodes

    @staticmethod
    def root(r: int) -> "_SearchState":
        return _SearchState(torch.zeros(r, 1, 0, dtype=torch.int64), torch.zeros(r, 1), torch.zeros(r, 1, 0),
                            torch.zeros(r, 1, dtype=torch.int64))

    def advance(self, logp, table, width: int):
        """One constrained top-k over logp [R, B, V] -> (next state, parent beam [R, W])."""
        r, b, v = logp.shape
        child = table[self.nodes.reshape(-1)].view(r, b, v).long()  # node -1 reads the last row: all -1
        cand = torch.where(child >= 0, self.scores.unsqueeze(-1) + logp, NEG_INF).view(r, b * v)
        top, idx = cand.topk(min(width, b * v), dim=1)
        par = torch.div(idx, v, rounding_mode="floor")
        code = idx - par * v
        nodes = child.view(r, b * v).gather(1, idx)
        dead = torch.isinf(top) | (nodes < 0)
        nodes = torch.where(dead, -1, nodes)
        top = torch.where(dead, NEG_INF, top)
        l = self.codes.shape[2]
        g = par.unsqueeze(-1).expand(-1, -1, l)
        codes = torch.cat([self.codes.gather(1, g), code.unsqueeze(-1)], dim=2)
        tlp = torch.cat([self.token_logp.gather(1, g), logp.reshape(r, b * v).gather(1, idx).unsqueeze(-1)], dim=2)
        return _SearchState(codes, top, tlp, nodes), par


class _FusedHead(nn.Module):
    """The NEZHA head's level transitions and output layers (weights copied)."""

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
        self.gru_bih = nn.ParameterList(nn.Parameter(g.bias_ih.detach().clone(), requires_grad=False) for g in head.transitions)
        self.gru_bhh = nn.ParameterList(nn.Parameter(g.bias_hh.detach().clone(), requires_grad=False) for g in head.transitions)

    def level_logprobs(self, h, s, level: int):
        """h [R, d], s [R, B, d] -> [R, B, Vmax]."""
        return torch.log_softmax(self.ln(h.unsqueeze(1) + s) @ self.w[level] + self.b[level], dim=-1)

    def advance(self, s, level: int, tokens, tok_emb):
        """GRUCell(e(code), s), written out: s [R, B, d], tokens [R, B] -> [R, B, d]."""
        e = tok_emb[tokens]
        gi = e @ self.gru_ih[level] + self.gru_bih[level]
        gh = s @ self.gru_hh[level] + self.gru_bhh[level]
        i_r, i_z, i_n = gi.chunk(3, dim=-1)
        h_r, h_z, h_n = gh.chunk(3, dim=-1)
        rg = torch.sigmoid(i_r + h_r)
        z = torch.sigmoid(i_z + h_z)
        n = torch.tanh(i_n + rg * h_n)
        return (1 - z) * n + z * s


def copy_ln(ln: nn.LayerNorm) -> nn.LayerNorm:
    new = nn.LayerNorm(ln.normalized_shape, eps=ln.eps)
    with torch.no_grad():
        new.weight.copy_(ln.weight)
        new.bias.copy_(ln.bias)
    return new.requires_grad_(False)


def child_tables(trie, vmax: int) -> list[torch.Tensor] | None:
    """Dense child tables of a :class:`~specrec.ids.trie.SidTrie` (None when a level is too big for one)."""
    out = []
    for level in range(trie.depth):
        dense = trie.dense[level]
        if dense is None:
            return None
        n, v = dense.shape
        table = torch.full((n, vmax), -1, dtype=torch.int32)
        ptr = trie.ptr[level]
        parent = torch.repeat_interleave(torch.arange(n - 1), ptr[1:] - ptr[:-1])
        table[parent, trie.codes[level]] = torch.arange(len(trie.codes[level]), dtype=torch.int32)
        out.append(table)
    return out
