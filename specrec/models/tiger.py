"""TIGER-style encoder-decoder over semantic-ID tokens (the verifier's model).

Encoder input: the last ``max_history`` items' SIDs, flattened into tokens
(left-padded, so the most recent item always sits at the same positions).
Decoder input: ``[BOS, c_0, ..., c_{L-1}]``; the output at position t is a
distribution over the codes of level t (one output head per level).

Tensor shapes used across the decoding code:

- ``R`` requests, each with ``M`` decoder sequences (beams or candidates) of
  ``T`` tokens. Self-attention runs per sequence (``[R*M, H, T, dk]``);
  cross-attention folds a request's sequences into the query axis
  (``[R, H, M*T, dk]``) so the encoder keys/values are computed once per
  request and never copied per beam or candidate.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, cast

import torch
import torch.nn.functional as F
from pydantic import BaseModel, Field
from torch import nn

PAD_TOKEN = 0
BOS_TOKEN = 1
N_SPECIAL = 2


class TigerConfig(BaseModel):
    """Model hyper-parameters. Defaults are TIGER's published size."""

    level_sizes: list[int] = Field(
        default_factory=lambda: [256, 256, 256, 256], description="codes per SID level (last = collision digit)"
    )
    d_model: int = 128
    n_heads: int = 6
    d_kv: int = 64
    d_ff: int = 1024
    n_enc_layers: int = 4
    n_dec_layers: int = 4
    dropout: float = 0.1
    max_history: int = 20
    activation: Literal["relu", "gelu"] = "relu"
    tie_output: bool = Field(False, description="output logits of level t are the dot product with the (shared) "
                             "input embeddings of level t's codes (tied, as in T5), plus a per-code bias")
    label_smoothing: float = Field(0.0, ge=0.0, lt=1.0, description="label smoothing of the training loss")
    causal_encoder: bool = Field(
        False,
        description="causal self-attention in the encoder (each history position sees itself and earlier "
        "ones). Lets training encode a user's sequence once for all its targets (SASRec-style), several "
        "times cheaper than one encoder pass per prefix; needs encoder_input='items'",
    )
    encoder_input: Literal["items", "tokens"] = Field(
        "items",
        description="'tokens': one encoder position per SID token (TIGER, H*L positions); "
        "'items': one position per item, the sum of its level-code embeddings (H positions, "
        "about L times cheaper to train and serve)",
    )

    @property
    def sid_len(self) -> int:
        return len(self.level_sizes)

    @property
    def vocab_size(self) -> int:
        return N_SPECIAL + sum(self.level_sizes)

    def offsets(self) -> list[int]:
        out, acc = [], N_SPECIAL
        for v in self.level_sizes:
            out.append(acc)
            acc += v
        return out


class SidTokens:
    """Token-id arithmetic shared by every backend of the GR model (needs
    ``self.cfg`` and ``self.offsets``, a tensor of per-level offsets)."""

    cfg: TigerConfig
    offsets: torch.Tensor

    def history_tokens(self, hist_sids: torch.Tensor) -> torch.Tensor:
        """[R, H, L] per-level codes (rows of -1 = padding) -> [R, H*L] token ids."""
        r, h, levels = hist_sids.shape
        tok = hist_sids + self.offsets.view(1, 1, levels)
        tok = torch.where(hist_sids < 0, torch.full_like(tok, PAD_TOKEN), tok)
        return tok.reshape(r, h * levels)

    def decoder_tokens(self, codes: torch.Tensor, level0: int = 0) -> torch.Tensor:
        """Per-level codes ``[..., t]`` starting at ``level0`` -> token ids."""
        t = codes.shape[-1]
        return codes + self.offsets[level0 : level0 + t]

    def decoder_input(self, prefix: torch.Tensor) -> torch.Tensor:
        """Teacher-forcing input for prefix codes [..., l]: [BOS, tokens] [..., l+1]."""
        bos = torch.full((*prefix.shape[:-1], 1), BOS_TOKEN, dtype=torch.int64, device=prefix.device)
        return torch.cat([bos, self.decoder_tokens(prefix)], dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: TigerConfig):
        super().__init__()
        self.h, self.dk = cfg.n_heads, cfg.d_kv
        inner = cfg.n_heads * cfg.d_kv
        self.q = nn.Linear(cfg.d_model, inner, bias=False)
        self.k = nn.Linear(cfg.d_model, inner, bias=False)
        self.v = nn.Linear(cfg.d_model, inner, bias=False)
        self.o = nn.Linear(inner, cfg.d_model, bias=False)

    def split(self, x: torch.Tensor) -> torch.Tensor:  # [N, T, h*dk] -> [N, h, T, dk]
        n, t, _ = x.shape
        return x.view(n, t, self.h, self.dk).transpose(1, 2)

    def merge(self, x: torch.Tensor) -> torch.Tensor:  # [N, h, T, dk] -> [N, T, h*dk]
        n, _, t, _ = x.shape
        return x.transpose(1, 2).reshape(n, t, self.h * self.dk)

    def kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.split(self.k(x)), self.split(self.v(x))

    @staticmethod
    def attend(q, k, v, mask=None, causal=False) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)


class FeedForward(nn.Module):
    def __init__(self, cfg: TigerConfig):
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.d_ff)
        self.fc2 = nn.Linear(cfg.d_ff, cfg.d_model)
        self.act = nn.GELU() if cfg.activation == "gelu" else nn.ReLU()

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: TigerConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ff = FeedForward(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, mask):
        h = self.ln1(x)
        a = self.attn
        q, (k, v) = a.split(a.q(h)), a.kv(h)
        x = x + self.drop(a.o(a.merge(a.attend(q, k, v, mask))))
        return x + self.drop(self.ff(self.ln2(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TigerConfig):
        super().__init__()
        self.ln1, self.ln2, self.ln3 = (nn.LayerNorm(cfg.d_model) for _ in range(3))
        self.self_attn = Attention(cfg)
        self.cross_attn = Attention(cfg)
        self.ff = FeedForward(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, r: int, cross_kv, cross_mask):
        """x: [R*M, T, d], causal over its T positions (teacher forcing). Returns (x, (k, v)): the layer's
        output and its self-attention keys/values [R*M, h, T, dk]. The serving path's decoder (KV-cached
        steps, prefix trees) is :meth:`specrec.models.hotpath.FusedHotPath.decoder`, held to this one by
        ``tests/unit/test_hotpath.py``."""
        a = self.self_attn
        h = self.ln1(x)
        q, (k, v) = a.split(a.q(h)), a.kv(h)
        x = x + self.drop(a.o(a.merge(a.attend(q, k, v, causal=True))))
        # cross-attention: fold the M sequences of a request into the query axis
        c = self.cross_attn
        n, t, d = x.shape
        h = self.ln2(x).reshape(r, (n // r) * t, d)
        q = c.split(c.q(h))
        out = c.merge(c.attend(q, cross_kv[0], cross_kv[1], cross_mask)).reshape(n, t, -1)
        x = x + self.drop(c.o(out))
        x = x + self.drop(self.ff(self.ln3(x)))
        return x, (k, v)


def _left_pad(x: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    """``x`` with zeros (False) before it along ``dim``, to size ``n``."""
    have = x.shape[dim]
    if have >= n:
        return x
    shape = list(x.shape)
    shape[dim] = n - have
    return torch.cat([x.new_zeros(shape), x], dim=dim)


@dataclass
class EncoderState:
    """Encoder output for R requests: the decoder's cross-attention mask and
    keys/values, stacked over decoder layers (one tensor each, so backends
    pass them as plain inputs)."""

    memory: torch.Tensor | None  # [R, S, d] (None where a backend does not expose it)
    mask: torch.Tensor  # [R, 1, 1, S] bool (True = attend); training may pass a wider mask
    cross_k: torch.Tensor  # [n_layers, R, h, S, dk]
    cross_v: torch.Tensor  # [n_layers, R, h, S, dk]

    @property
    def n(self) -> int:
        return self.cross_k.shape[1]

    @property
    def keep(self) -> torch.Tensor:
        """[R, S] bool: real (non-padding) history positions."""
        return self.mask[:, 0, 0, :]

    @property
    def cross_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(self.cross_k[i], self.cross_v[i]) for i in range(self.cross_k.shape[0])]

    @staticmethod
    def cat(states: list[EncoderState]) -> EncoderState:
        """Stack the requests of several states. Shorter histories are left-padded (as the encoder pads) to the
        longest, masked out with zero keys/values: cross-attention gives them weight 0, and every row keeps
        its own real positions, so no row is all padding. cross_k may be [.., dk, S] (the ONNX backend keeps
        the fused layout); where lengths differ, its axis 3 then differs from S in some state."""
        s = max(st.mask.shape[-1] for st in states)
        k_axis = 4 if any(st.cross_k.shape[3] != st.mask.shape[-1] for st in states) else 3
        mems = [st.memory for st in states if st.memory is not None]
        mem = torch.cat([_left_pad(m, s, 1) for m in mems]) if len(mems) == len(states) else None
        return EncoderState(mem, torch.cat([_left_pad(st.mask, s, -1) for st in states]),
                            torch.cat([_left_pad(st.cross_k, s, k_axis) for st in states], dim=1),
                            torch.cat([_left_pad(st.cross_v, s, 3) for st in states], dim=1))

    def select(self, idx: torch.Tensor) -> EncoderState:
        """A state for a subset (or repetition) of the requests."""
        mem = None if self.memory is None else self.memory[idx]
        return EncoderState(mem, self.mask[idx], self.cross_k[:, idx], self.cross_v[:, idx])


class Tiger(SidTokens, nn.Module):
    def __init__(self, cfg: TigerConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        self.tok = nn.Embedding(cfg.vocab_size, d, padding_idx=PAD_TOKEN)
        per_item = cfg.sid_len if cfg.encoder_input == "tokens" else 1
        self.enc_pos = nn.Embedding(cfg.max_history * per_item, d)
        self.dec_pos = nn.Embedding(cfg.sid_len, d)
        self.enc_layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.n_enc_layers))
        self.dec_layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_dec_layers))
        self.enc_ln, self.dec_ln = nn.LayerNorm(d), nn.LayerNorm(d)
        # untied: one output layer per level; tied: a per-level bias only, weights are the code embeddings
        self.heads = nn.ModuleList(nn.Linear(d, v, bias=True) for v in cfg.level_sizes) if not cfg.tie_output else None
        self.head_bias = (
            nn.ParameterList(nn.Parameter(torch.zeros(v)) for v in cfg.level_sizes) if cfg.tie_output else None
        )
        self.drop = nn.Dropout(cfg.dropout)
        self.register_buffer("offsets", torch.tensor(cfg.offsets(), dtype=torch.int64), persistent=False)
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def n_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # -- encoder -----------------------------------------------------------
    def _encoder_inputs(self, hist_sids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.history_tokens(hist_sids)
        if self.cfg.encoder_input == "tokens":
            return self.tok(tokens), tokens != PAD_TOKEN
        r, h, levels = hist_sids.shape
        return self.tok(tokens).view(r, h, levels, -1).sum(2), hist_sids[:, :, 0] >= 0  # PAD embeds to zero

    def _self_mask(self, keep: torch.Tensor) -> torch.Tensor:
        if not self.cfg.causal_encoder:
            return keep[:, None, None, :]
        s = keep.shape[1]
        idx = torch.arange(s, device=keep.device)
        allowed = (idx.view(1, s, 1) >= idx.view(1, 1, s)) & keep[:, None, :]
        return (allowed | (idx.view(1, s, 1) == idx.view(1, 1, s))).unsqueeze(1)  # a pad row sees itself

    def _memory(self, hist_sids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, keep = self._encoder_inputs(hist_sids)
        s = x.shape[1]
        if self.cfg.causal_encoder:  # positions count from the oldest item, so a prefix encodes as in its sequence
            pos = (keep.long().cumsum(1) - 1).clamp(min=0)
        else:  # right-aligned: the most recent item always has the last position
            pos = torch.arange(self.enc_pos.num_embeddings - s, self.enc_pos.num_embeddings, device=x.device)
        x = self.drop(x + self.enc_pos(pos))
        mask = self._self_mask(keep)
        for layer in self.enc_layers:
            x = layer(x, mask)
        return self.enc_ln(x), keep

    def encode(self, hist_sids: torch.Tensor) -> EncoderState:
        """hist_sids: [R, H, L] codes, left-padded with rows of -1."""
        mem, keep = self._memory(hist_sids)
        return EncoderState(mem, keep[:, None, None, :], *self._cross(mem))

    def _cross(self, mem: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ks, vs = zip(*(cast(DecoderLayer, layer).cross_attn.kv(mem) for layer in self.dec_layers))
        return torch.stack(ks), torch.stack(vs)

    # -- decoder -----------------------------------------------------------
    def decode(self, enc: EncoderState, tokens: torch.Tensor | None, start=0, embeds: torch.Tensor | None = None):
        """Teacher-forced decoder pass. tokens: [R, M, T] decoder input ids at positions start..start+T-1
        (or ``embeds`` [R, M, T, d] given directly, e.g. learned placeholders), causal over the T positions.
        Returns hidden [R, M, T, d] (after the final norm) and per layer (k, v) [R*M, h, T, dk]."""
        if embeds is None:
            embeds = self.tok(tokens)
        r, m, t, d = embeds.shape
        pos = torch.arange(t, device=embeds.device) + start
        x = self.drop(embeds.reshape(r * m, t, d) + self.dec_pos(pos))
        new = []
        for i, layer in enumerate(self.dec_layers):
            x, kv = layer(x, r, enc.cross_kv[i], enc.mask)
            new.append(kv)
        return self.dec_ln(x).reshape(r, m, t, -1), new

    def level_logits(self, hidden: torch.Tensor, level: int) -> torch.Tensor:
        if self.heads is not None:
            return self.heads[level](hidden)
        off = self.cfg.offsets()[level]
        w = self.tok.weight[off : off + self.cfg.level_sizes[level]]
        assert self.head_bias is not None  # tied output layers keep a bias per level
        return torch.nn.functional.linear(hidden, w, self.head_bias[level])

    def level_logprobs(self, hidden: torch.Tensor, level: int) -> torch.Tensor:
        return torch.log_softmax(self.level_logits(hidden, level).float(), dim=-1)

    def next_logprobs(self, enc: EncoderState, tokens: torch.Tensor, start: int = 0, last_only: bool = False):
        """Teacher-forced decoder pass returning, for each input position p (absolute ``start + i``), the
        log-probs of the codes of level p: a list of [R, M, V_p] (only the last position's when
        ``last_only``), and the pass's keys/values (:meth:`decode`). The reference the serving path
        (:mod:`specrec.models.hotpath`) is tested against."""
        hidden, new = self.decode(enc, tokens, start)
        t = tokens.shape[2]
        first = t - 1 if last_only else 0
        return [self.level_logprobs(hidden[:, :, i], start + i) for i in range(first, t)], new

    # -- training ----------------------------------------------------------
    def forward_sequences(self, inp_sids: torch.Tensor, tgt_sids: torch.Tensor) -> torch.Tensor:
        """Causal-encoder training on whole sequences: ``inp_sids`` [B, T, L]
        (left-padded with -1), ``tgt_sids`` [B, T, L] the next item after each
        position (rows of -1 where there is none). One encoder pass serves every
        target; the decoder for position t sees encoder positions <= t only.
        Returns the mean token cross-entropy over valid targets."""
        hidden, tgt = self.sequence_hidden(inp_sids, tgt_sids)
        return self.mean_level_loss(hidden, tgt, self.cfg.sid_len)

    def sequence_hidden(self, inp_sids: torch.Tensor, tgt_sids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The decoder states of :meth:`forward_sequences`: ([N, L, d], the N valid targets' codes [N, L]),
        targets in row-major (batch, position) order."""
        if not self.cfg.causal_encoder:
            raise ValueError("forward_sequences needs causal_encoder=True")
        mem, keep = self._memory(inp_sids)
        b, t, _ = mem.shape
        L = self.cfg.sid_len
        idx = torch.arange(t, device=mem.device)
        vis = (idx.view(1, t, 1) >= idx.view(1, 1, t)) & keep[:, None, :]  # [B, T(query pos), T(key pos)]
        vis = vis | ~vis.any(-1, keepdim=True)  # padded positions: anything, to avoid empty rows (no loss there)
        valid = tgt_sids[:, :, 0] >= 0
        tgt = tgt_sids[valid]  # [N, L]
        if int(valid.sum()) * 4 < b * t * 3:
            # overlapping chunks teach few of their positions: decode only those, each with its own row of
            # cross-attention keys (gathered, not recomputed)
            bi, ti = valid.nonzero(as_tuple=True)
            ck, cv = self._cross(mem)
            enc = EncoderState(None, vis[bi, ti][:, None, None, :], ck[:, bi], cv[:, bi])
            hidden = self.decode(enc, self.decoder_input(tgt[:, None, :-1]))[0][:, 0]  # [N, L, d]
        else:
            mask = vis.repeat_interleave(L, dim=1).unsqueeze(1)  # [B, 1, T*L, T]: decoder tokens of position t
            hidden, _ = self.decode(EncoderState(mem, mask, *self._cross(mem)),
                                    self.decoder_input(tgt_sids.clamp(min=0)[..., :-1]))
            hidden = hidden[valid]  # [N, L, d]
        return hidden, tgt

    def forward(self, hist_sids: torch.Tensor, target_sids: torch.Tensor) -> torch.Tensor:
        """Mean token cross-entropy of ``target_sids`` [B, L] given histories."""
        enc = self.encode(hist_sids)
        hidden, _ = self.decode(enc, self.decoder_input(target_sids[:, None, :-1]))
        hidden = hidden[:, 0]
        return self.mean_level_loss(hidden, target_sids, self.cfg.sid_len)

    def mean_level_loss(self, hidden: torch.Tensor, target: torch.Tensor, levels: int) -> torch.Tensor:
        """Token cross-entropy of ``target`` [N, L] from ``hidden`` [N, L, d], averaged over the first ``levels``."""
        return self.mean_level_ce(self.levels_logits(hidden, levels), target)

    def levels_logits(self, hidden: torch.Tensor, levels: int) -> list[torch.Tensor]:
        """``hidden`` [N, L, d] -> the logits of each of the first ``levels`` levels, [N, V_l] each."""
        return [self.level_logits(hidden[:, lvl], lvl) for lvl in range(levels)]

    def mean_level_ce(self, logits: list[torch.Tensor], target: torch.Tensor) -> torch.Tensor:
        """Token cross-entropy of ``target`` [N, L] from each level's ``logits``, averaged over the levels."""
        losses = [F.cross_entropy(lg, target[:, lvl], label_smoothing=self.cfg.label_smoothing)
                  for lvl, lg in enumerate(logits)]
        return sum(losses[1:], losses[0]) / len(logits)  # summed in level order
