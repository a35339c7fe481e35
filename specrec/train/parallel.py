"""Training the GR model in several processes on one machine (``TrainConfig.workers``, the CPU's path), and the
validation they share.

Each worker (``gloo``) takes its share of every global batch; gradients are averaged before each step
(:func:`average_gradients`) and validation's users are split between them, their ranks gathered
(:func:`evaluate_beam`), so every worker holds the same weights and figures. Rank 0 writes the log and the
checkpoints; the calling process resumes from them when the workers are done (:func:`fit_parallel`).
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any

import numpy as np
import torch

from ..backends import Backend
from ..data.splits import Examples
from ..decoding.beam import beam_search
from ..eval.metrics import ndcg_at_k, recall_at_k, target_ranks
from ..ids.trie import SidTrie
from ..models.tiger import Tiger
from . import checkpoint as ckpt
from .batches import history_batch


@torch.inference_mode()
def evaluate_beam(
    model: Tiger,
    sids: torch.Tensor,
    trie: SidTrie,
    ex: Examples,
    width: int,
    ks=(10,),
    batch_size: int = 256,
    shard: tuple[int, int] = (0, 1),
) -> dict:
    """Recall/NDCG@ks of beam search on ``ex``, its passes on the model's device; with ``shard`` (rank, world)
    under data-parallel training each worker ranks its share and the ranks
    are gathered, so every worker gets the same figures."""
    model.eval()
    device = next(model.parameters()).device
    backend = Backend(model, device=str(device))  # built per call: it copies the (changing) output layers
    rank, world = shard
    idx = np.arange(rank, len(ex), world)
    ranks = []
    for s in range(0, len(idx), batch_size):
        b = idx[s : s + batch_size]
        enc = backend.encode(history_batch(sids, ex.history[b]))
        items = beam_search(backend, enc, trie, width).items(trie)
        ranks.append(target_ranks(items.numpy(), ex.target[b]))
    r = np.concatenate(ranks) if ranks else np.zeros(0, dtype=np.int64)
    if world > 1:
        parts: list = [None] * world
        torch.distributed.all_gather_object(parts, r)
        r = np.concatenate(parts)
    out = {}
    for k in ks:
        out[f"recall@{k}"] = recall_at_k(r, k)
        out[f"ndcg@{k}"] = ndcg_at_k(r, k)
    return out


def average_gradients(model: torch.nn.Module, world: int) -> None:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch._utils._flatten_dense_tensors(grads)
    torch.distributed.all_reduce(flat)
    flat /= world
    for g, f in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads)):
        g.copy_(f)


def fit_parallel(trainer: Any, progress: bool) -> dict:
    """Train ``trainer``'s run (a :class:`~specrec.train.trainer.Trainer`) in ``cfg.workers`` processes, then
    take up where they left it: its epochs, history and best weights."""
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    t = trainer
    args = (t.mcfg, t.cfg, t.sids_np, t.train_ex, t.valid_all, str(t.out))
    mp.spawn(_worker, args=(type(t), t.cfg.workers, port, args, progress, t.test_all), nprocs=t.cfg.workers,
             join=True)
    summary = json.loads((t.out / "fit_summary.json").read_text())
    t.resume()  # epochs, history and the rest, as the workers left them
    t.model.load_state_dict(ckpt.load(t.best_path, weights_only=True))
    t.model.eval()
    return summary


def _worker(rank: int, trainer_cls: type, world: int, port: int, args: tuple, progress: bool,
            test: Examples | None = None) -> None:
    import torch.distributed as dist

    cfg = args[1]
    torch.set_num_threads(max(1, (cfg.threads or os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        tr = trainer_cls(*args, log=print if rank == 0 else (lambda m: None), rank=rank, world=world, test=test)
        tr.resume()
        summary = tr.fit(progress=progress and rank == 0)
        if rank == 0:
            (tr.out / "fit_summary.json").write_text(json.dumps(summary) + "\n")
    finally:
        dist.destroy_process_group()
