"""ONNX export of the GR model, and an ONNX Runtime backend.

Two graphs:

``encoder.onnx``
    ``hist_sids`` [R, H, L] int64 (rows of -1 = padding) ->
    ``mask`` [R, 1, 1, S] bool, ``cross_k{i}``/``cross_v{i}`` [R, h, S, dk]
    for every decoder layer i.

``decoder.onnx``
    ``tokens`` [R, M, T] int64, ``start`` [] int64 (position of the first
    token), ``mask``, the cross K/V, and ``past_k{i}``/``past_v{i}``
    [R*M, h, t, dk] (t may be 0) -> ``logp`` [R, M, T, sum(V)] (per-level
    log-softmax, levels concatenated) and ``present_k{i}``/``present_v{i}``.

:class:`OrtTiger` implements the same two methods decoding uses
(``encode`` and ``next_logprobs``), so beam search and scoring run unchanged
on ONNX Runtime (CUDA provider when available, CPU otherwise).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..models.tiger import EncoderState, SidTokens, Tiger, TigerConfig

OPSET = 18


class _Encoder(nn.Module):
    def __init__(self, model: Tiger):
        super().__init__()
        self.model = model

    def forward(self, hist_sids):
        enc = self.model.encode(hist_sids)
        return (enc.mask, *[t for kv in enc.cross_kv for t in kv])


class _Decoder(nn.Module):
    def __init__(self, model: Tiger):
        super().__init__()
        self.model = model
        self.n = model.cfg.n_dec_layers

    def forward(self, tokens, start, mask, *kvs):
        n = self.n
        cross = [(kvs[2 * i], kvs[2 * i + 1]) for i in range(n)]
        past = [(kvs[2 * n + 2 * i], kvs[2 * n + 2 * i + 1]) for i in range(n)]
        hidden, new = self.model.decode(EncoderState(None, mask, cross), tokens, past, start)
        logp = torch.cat([self.model.level_logprobs(hidden, lvl) for lvl in range(self.model.cfg.sid_len)], dim=-1)
        return (logp, *[t for kv in new for t in kv])


def _names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}_{kv}{i}" for i in range(n) for kv in ("k", "v")]


def export_onnx(model: Tiger, out_dir: str | Path) -> Path:
    """Write encoder.onnx, decoder.onnx and config.json to ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = model.eval()
    cfg = model.cfg
    n, h, dk, L = cfg.n_dec_layers, cfg.n_heads, cfg.d_kv, cfg.sid_len
    hist = torch.randint(0, min(cfg.level_sizes), (2, cfg.max_history, L))
    hist[0, :3] = -1
    with torch.no_grad():
        enc_out = _Encoder(model).eval()(hist)
    torch.onnx.export(
        _Encoder(model).eval(), (hist,), str(out / "encoder.onnx"), dynamo=False, opset_version=OPSET,
        input_names=["hist_sids"], output_names=["mask", *_names("cross", n)],
        dynamic_axes={"hist_sids": {0: "R", 1: "H"}, "mask": {0: "R", 3: "S"},
                      **{k: {0: "R", 2: "S"} for k in _names("cross", n)}},
        external_data=False,
    )
    r, m, t, past_t = 2, 3, 2, 2  # T > 1 so the traced graph keeps the general causal-mask path
    tokens = torch.randint(2, cfg.vocab_size, (r, m, t))
    past = [torch.randn(r * m, h, past_t, dk) for _ in range(2 * n)]
    args = (tokens, torch.tensor(past_t, dtype=torch.int64), enc_out[0], *enc_out[1:], *past)
    torch.onnx.export(
        _Decoder(model).eval(), args, str(out / "decoder.onnx"), dynamo=False, opset_version=OPSET,
        input_names=["tokens", "start", "mask", *_names("cross", n), *_names("past", n)],
        output_names=["logp", *_names("present", n)],
        dynamic_axes={
            "tokens": {0: "R", 1: "M", 2: "T"}, "mask": {0: "R", 3: "S"}, "logp": {0: "R", 1: "M", 2: "T"},
            **{k: {0: "R", 2: "S"} for k in _names("cross", n)},
            **{k: {0: "RM", 2: "t"} for k in _names("past", n)},
            **{k: {0: "RM", 2: "t_all"} for k in _names("present", n)},
        },
        external_data=False,
    )
    (out / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2) + "\n")
    return out


def default_providers() -> list[str]:
    import onnxruntime as ort

    avail = ort.get_available_providers()
    return [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in avail]


class OrtTiger(SidTokens):
    """The GR model on ONNX Runtime, with the decoding interface of :class:`Tiger`."""

    def __init__(self, onnx_dir: str | Path, providers: list[str] | None = None, threads: int | None = None):
        import onnxruntime as ort

        d = Path(onnx_dir)
        self.cfg = TigerConfig(**json.loads((d / "config.json").read_text()))
        self.offsets = torch.tensor(self.cfg.offsets(), dtype=torch.int64)
        so = ort.SessionOptions()
        if threads:
            so.intra_op_num_threads = threads
        providers = providers or default_providers()
        self.enc_sess = ort.InferenceSession(str(d / "encoder.onnx"), so, providers=providers)
        self.dec_sess = ort.InferenceSession(str(d / "decoder.onnx"), so, providers=providers)
        self.providers = self.enc_sess.get_providers()
        sizes = self.cfg.level_sizes
        self._bounds = np.cumsum([0, *sizes])

    def eval(self):
        return self

    def encode(self, hist_sids: torch.Tensor) -> EncoderState:
        outs = self.enc_sess.run(None, {"hist_sids": np.ascontiguousarray(hist_sids.numpy(), dtype=np.int64)})
        mask = torch.from_numpy(outs[0])
        kv = [torch.from_numpy(o) for o in outs[1:]]
        return EncoderState(None, mask, [(kv[2 * i], kv[2 * i + 1]) for i in range(self.cfg.n_dec_layers)])

    def next_logprobs(self, enc: EncoderState, tokens: torch.Tensor, past=None, start: int = 0, last_only: bool = False):
        cfg = self.cfg
        r, m, t = tokens.shape
        feed = {"tokens": tokens.numpy().astype(np.int64, copy=False), "start": np.asarray(start, dtype=np.int64),
                "mask": enc.mask.numpy()}
        for i, (k, v) in enumerate(enc.cross_kv):
            feed[f"cross_k{i}"], feed[f"cross_v{i}"] = k.numpy(), v.numpy()
        for i in range(cfg.n_dec_layers):
            if past is None:
                empty = np.zeros((r * m, cfg.n_heads, 0, cfg.d_kv), dtype=np.float32)
                feed[f"past_k{i}"], feed[f"past_v{i}"] = empty, empty
            else:
                feed[f"past_k{i}"] = np.ascontiguousarray(past[i][0].numpy())
                feed[f"past_v{i}"] = np.ascontiguousarray(past[i][1].numpy())
        outs = self.dec_sess.run(None, feed)
        logp = torch.from_numpy(outs[0])
        kv = [torch.from_numpy(o) for o in outs[1:]]
        new = [(kv[2 * i], kv[2 * i + 1]) for i in range(cfg.n_dec_layers)]
        first = t - 1 if last_only else 0
        per = []
        for i in range(first, t):
            lvl = start + i
            per.append(logp[:, :, i, self._bounds[lvl] : self._bounds[lvl + 1]])
        return per, new
