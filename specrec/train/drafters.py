"""Training the drafters: the retrieval model, the self-draft head and the
NEZHA head. Each keeps the best epoch by a validation metric and shows
progress; the GR model stays frozen for the two heads.

``DrafterTrainConfig.device`` trains on a GPU (:mod:`specrec.train.device`): the
model, the frozen GR and the data there, in float32 (the drafters are small,
and what they learn from is the float32 target's). Validation that walks the
item trie (the NEZHA head's beams) runs on CPU copies of the weights, and the
aligned heads (``align``) train on the CPU whatever the device: their target
passes go through the trie's decoding, which lives there. Trained models come
back on the CPU, and the frozen GR where it was."""

from __future__ import annotations

import copy
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel

from ..data.splits import PAD, Examples, Split
from ..decoding.searches.head import nezha_beam_search
from ..models.nezha_head import NezhaHead
from ..models.retrieval import RetrievalConfig, RetrievalModel
from ..models.self_draft import SelfDraftHead
from ..models.tiger import EncoderState, Tiger
from ..terminal import progress_bar
from .align import (
    AlignConfig,
    coverage,
    head_alignment_loss,
    sample_for_alignment,
    self_draft_alignment_loss,
    target_beams,
    target_logprobs,
)
from .batches import bucketed_batches, history_batch
from .device import on_device, resolve_device, to_device


class DrafterTrainConfig(BaseModel):
    epochs: int = 20
    batch_size: int = 256
    lr: float = 1e-3
    weight_decay: float = 0.0
    patience: int = 3
    valid_limit: int | None = 4000
    seed: int = 0
    device: str = "cpu"  # where it trains (specrec.train.device)


def _recall_at(scores: torch.Tensor, target: torch.Tensor, k: int) -> float:
    top = scores.topk(k, dim=1).indices
    return float((top == target.unsqueeze(1)).any(1).float().mean())


def train_loop(params, cfg: DrafterTrainConfig, n_train: int, lengths: np.ndarray, step_fn, valid_fn, desc: str,
               log: Callable[[str], None], progress: bool, state_fn):
    """The drafters' training loop: AdamW over ``params``, length-bucketed batches, ``step_fn(idx)`` -> the loss,
    ``valid_fn()`` -> a score each epoch, stopping after ``cfg.patience`` epochs without a better one. Returns
    (best score, ``state_fn()`` at it, one dict per epoch). ``valid_fn`` None (a refit, with no validation left):
    every epoch of ``cfg.epochs`` runs and the last one's state is returned (its score NaN)."""
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    best, best_state, bad, history = -1.0, None, 0, []
    for epoch in range(cfg.epochs):
        rng = np.random.default_rng(cfg.seed * 7919 + epoch)
        batches = bucketed_batches(lengths, cfg.batch_size, rng, 50)
        # the loss sum stays on the device (float64: the same sum as Python floats'), read once an epoch
        t0, acc = time.time(), torch.zeros((), dtype=torch.float64, device=params[0].device)
        for idx in progress_bar(batches, desc=f"{desc} {epoch + 1}/{cfg.epochs}", disable=not progress, leave=False):
            loss = step_fn(idx)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += loss.detach().double() * len(idx)
        tot = float(acc)
        if valid_fn is None:
            history.append({"epoch": epoch + 1, "loss": tot / n_train, "seconds": round(time.time() - t0, 1)})
            log(f"{desc} epoch {epoch + 1}: loss {tot / n_train:.4f}  (no validation: the last epoch is kept)")
            best, best_state = float("nan"), None
            continue
        val = valid_fn()
        history.append({"epoch": epoch + 1, "loss": tot / n_train, "valid": val, "seconds": round(time.time() - t0, 1)})
        log(f"{desc} epoch {epoch + 1}: loss {tot / n_train:.4f}  valid {val:.4f}")
        if val > best:
            best, best_state, bad = val, state_fn(), 0
        else:
            bad += 1
            if bad >= cfg.patience:
                break
    if valid_fn is None:
        best_state = state_fn()
    return best, best_state, history


# -- retrieval drafter ---------------------------------------------------------
def user_sequences(split: Split) -> list[tuple[int, int]]:
    """(user, last training target position) per user with training data."""
    last: dict[int, int] = {}
    for u, p in zip(split.train.user.tolist(), split.train.position.tolist()):
        last[u] = max(last.get(u, -1), p)
    return sorted(last.items())


def train_retrieval(
    split: Split, sequences: list[np.ndarray], text_emb: np.ndarray, cfg: RetrievalConfig | None = None,
    tcfg: DrafterTrainConfig | None = None, log: Callable[[str], None] = print, progress: bool = True,
) -> tuple[RetrievalModel, dict]:
    """SASRec-style training: every position of a user's training sequence
    predicts the next item, softmax over the items seen in training."""
    cfg = cfg or RetrievalConfig()
    tcfg = tcfg or DrafterTrainConfig(epochs=30, batch_size=128, lr=1e-3)
    dev = resolve_device(tcfg.device)
    torch.manual_seed(tcfg.seed)
    model = RetrievalModel(cfg).to(dev)
    H = cfg.max_history
    seqs = []
    for u, p in user_sequences(split):
        s = sequences[u][: p + 1][-(H + 1) :]
        if len(s) >= 2:
            seqs.append(s)
    n = len(seqs)
    inp = np.full((n, H), PAD, dtype=np.int64)
    tgt = np.full((n, H), PAD, dtype=np.int64)
    for i, s in enumerate(seqs):
        inp[i, H - (len(s) - 1) :] = s[:-1]
        tgt[i, H - (len(s) - 1) :] = s[1:]
    text = to_device(np.ascontiguousarray(text_emb, dtype=np.float32), dev)
    seen_rows = to_device(np.nonzero(split.seen)[0], dev)
    remap = torch.full((len(text_emb),), -1, dtype=torch.int64, device=dev)
    remap[seen_rows] = torch.arange(len(seen_rows), device=dev)
    lengths = (inp != PAD).sum(1)
    inp_t, tgt_t = to_device(inp, dev), to_device(tgt, dev)  # once: a step sends only its rows' indices
    valid = split.valid.head(tcfg.valid_limit)
    log(f"retrieval drafter: {n} training sequences, {len(seen_rows)} items in the softmax, on {dev}")

    def step(idx):
        model.train()
        t = int(lengths[idx].max())
        rows = to_device(idx, dev)
        x = inp_t[rows][:, H - t :]
        y = tgt_t[rows][:, H - t :]
        keep = x >= 0
        items = model.item_vectors(text[seen_rows])
        hv = model.item_vectors(text[x.clamp(min=0)])
        states = model.sequence(hv, keep)
        m = keep & (y >= 0)
        logits = states[m] @ items.T / cfg.temperature
        return F.cross_entropy(logits, remap[y[m]])

    @torch.inference_mode()
    def validate():
        model.eval()
        items = model.item_vectors(text)
        hist = to_device(valid.history, dev)
        keep = hist >= 0
        u = model.user_vectors(text[hist.clamp(min=0)], keep)
        return _recall_at(u @ items.T, to_device(valid.target, dev), 50)

    best, state, hist = train_loop(list(model.parameters()), tcfg, n, lengths, step, validate, "retrieval", log,
                                   progress, lambda: {k: v.clone() for k, v in model.state_dict().items()})
    model.load_state_dict(state)
    return model.cpu().eval(), {"best_valid_recall@50": best, "epochs": hist, "device": str(dev)}


# -- self-draft head ---------------------------------------------------------------
def _frozen_with_head(gr: Tiger, sids: np.ndarray, tcfg: DrafterTrainConfig, make_head):
    """The GR model frozen (eval, no gradients), a draft head made after seeding, and the SIDs as a tensor."""
    torch.manual_seed(tcfg.seed)
    gr.eval()
    for p in gr.parameters():
        p.requires_grad_(False)
    return make_head(gr), torch.from_numpy(np.ascontiguousarray(sids, dtype=np.int64))


def _aligned_on_cpu(tcfg: DrafterTrainConfig, name: str, log: Callable[[str], None]) -> DrafterTrainConfig:
    """An aligned head trains on the CPU (module docstring): ``tcfg`` there, said where another device was asked."""
    if resolve_device(tcfg.device).type != "cpu":
        log(f"{name}, aligned: trains on the CPU (its target passes walk the item trie there), not {tcfg.device}")
    return tcfg.model_copy(update={"device": "cpu"})


def train_self_draft(
    gr: Tiger, split: Split, sids: np.ndarray, tcfg: DrafterTrainConfig | None = None,
    log: Callable[[str], None] = print, progress: bool = True, align: AlignConfig | None = None, cache=None,
) -> tuple[SelfDraftHead, dict]:
    """In-catalogue softmax on the true next item; aligned (``align.mode`` not
    'none'), also on the target's own top-K items (see :mod:`.align`)."""
    tcfg = tcfg or DrafterTrainConfig(epochs=10, batch_size=256, lr=2e-3)
    if align is not None and align.mode != "none":
        tcfg = _aligned_on_cpu(tcfg, "self-drafter", log)
        head, rep = _train_self_draft_aligned(gr, split, sids, tcfg, align, log, progress, cache)
        return head, {**rep, "device": "cpu"}
    head, sids_cpu = _frozen_with_head(gr, sids, tcfg, SelfDraftHead)
    dev = resolve_device(tcfg.device)
    with on_device(gr, dev):
        head, rep = _fit_self_draft(gr, head.to(dev), sids_cpu.to(dev), split, tcfg, log, progress)
    return head.cpu().eval(), {**rep, "device": str(dev)}


def _fit_self_draft(gr: Tiger, head: SelfDraftHead, sids_t: torch.Tensor, split: Split, tcfg: DrafterTrainConfig,
                    log: Callable[[str], None], progress: bool) -> tuple[SelfDraftHead, dict]:
    dev = sids_t.device
    seen_rows = to_device(np.nonzero(split.seen)[0], dev)
    remap = torch.full((len(sids_t),), -1, dtype=torch.int64, device=dev)
    remap[seen_rows] = torch.arange(len(seen_rows), device=dev)
    tr: Examples = split.train
    lengths = (tr.history != PAD).sum(1)
    valid = split.valid.head(tcfg.valid_limit)

    def step(idx):
        head.train()
        with torch.no_grad():
            enc = gr.encode(history_batch(sids_t, tr.history[idx]))
        u = head.user_vectors(enc)
        items = head.item_vectors(gr, sids_t[seen_rows])
        logits = u @ items.T / head.cfg.temperature
        return F.cross_entropy(logits, remap[to_device(tr.target[idx], dev)])

    @torch.inference_mode()
    def validate():
        head.eval()
        items = head.item_vectors(gr, sids_t)
        u = head.user_vectors(gr.encode(history_batch(sids_t, valid.history)))
        return _recall_at(u @ items.T, to_device(valid.target, dev), 50)

    best, state, hist = train_loop(list(head.parameters()), tcfg, len(tr), lengths, step, validate, "self-draft", log,
                                   progress, lambda: {k: v.clone() for k, v in head.state_dict().items()})
    head.load_state_dict(state)
    return head.eval(), {"best_valid_recall@50": best, "epochs": hist}


# -- NEZHA head -------------------------------------------------------------------
def train_nezha(
    gr: Tiger, split: Split, sids: np.ndarray, tcfg: DrafterTrainConfig | None = None,
    log: Callable[[str], None] = print, progress: bool = True, align: AlignConfig | None = None, cache=None,
) -> tuple[NezhaHead, dict]:
    """Cross-entropy on the true next SID plus KL to the GR's own per-level
    distributions along it; validation: recall@10 of the head's constrained
    beams. Aligned (``align.mode`` not 'none'): see :mod:`.align`."""
    tcfg = tcfg or DrafterTrainConfig(epochs=6, batch_size=256, lr=2e-3, patience=2)
    if align is not None and align.mode != "none":
        tcfg = _aligned_on_cpu(tcfg, "nezha head", log)
        head, rep = _train_nezha_aligned(gr, split, sids, tcfg, align, log, progress, cache)
        return head, {**rep, "device": "cpu"}
    head, sids_cpu = _frozen_with_head(gr, sids, tcfg, NezhaHead)
    dev = resolve_device(tcfg.device)
    gr_cpu = gr if dev.type == "cpu" else copy.deepcopy(gr)  # validation walks the trie on the CPU
    with on_device(gr, dev):
        head, rep = _fit_nezha(gr, gr_cpu, head.to(dev), sids_cpu, split, tcfg, log, progress)
    return head.cpu().eval(), {**rep, "device": str(dev)}


def _fit_nezha(gr: Tiger, gr_cpu: Tiger, head: NezhaHead, sids_cpu: torch.Tensor, split: Split,
               tcfg: DrafterTrainConfig, log: Callable[[str], None], progress: bool) -> tuple[NezhaHead, dict]:
    from ..ids.trie import SidTrie

    dev = next(head.parameters()).device
    sids_t = sids_cpu.to(dev)
    trie = SidTrie(sids_cpu.numpy(), gr.cfg.level_sizes)
    tr: Examples = split.train
    lengths = (tr.history != PAD).sum(1)
    valid = split.valid.head(min(tcfg.valid_limit or 2000, 2000))

    def step(idx):
        head.train()
        tgt = sids_t[to_device(tr.target[idx], dev)]
        with torch.no_grad():
            enc = gr.encode(history_batch(sids_t, tr.history[idx]))
            teacher, _ = gr.next_logprobs(enc, gr.decoder_input(tgt[:, None, :-1]))
            teacher = [t[:, 0] for t in teacher]
        return head.loss(gr, enc, tgt, teacher)

    @torch.inference_mode()
    def validate():
        head.eval()
        hd = head if dev.type == "cpu" else copy.deepcopy(head).cpu()
        hits = 0
        for s in range(0, len(valid), 500):
            enc = gr_cpu.encode(history_batch(sids_cpu, valid.history[s : s + 500]))
            beams = nezha_beam_search(hd, gr_cpu, hd.hidden(gr_cpu, enc), trie, 10)
            items = beams.items(trie)
            hits += int((items == torch.from_numpy(valid.target[s : s + 500]).unsqueeze(1)).any(1).sum())
        return hits / len(valid)

    best, state, hist = train_loop(list(head.parameters()), tcfg, len(tr), lengths, step, validate, "nezha", log,
                                   progress, lambda: {k: v.clone() for k, v in head.state_dict().items()})
    head.load_state_dict(state)
    return head.eval(), {"best_valid_recall@10": best, "epochs": hist}


# -- aligned training (AtSpeed) ----------------------------------------------------------
def _aligned_beams(gr: Tiger, split: Split, sids_t: torch.Tensor, trie, align: AlignConfig, seed: int, cache, progress):
    train = target_beams(gr, sample_for_alignment(split.train, align.examples, seed), sids_t, trie, align.top_k,
                         cache, progress=progress)
    valid = target_beams(gr, sample_for_alignment(split.valid, align.valid_examples, seed + 1), sids_t, trie,
                         align.top_k, cache, progress=progress)
    return train, valid


def _aligned_setup(gr, split, sids, tcfg, align: AlignConfig, cache, progress, make_head):
    """The GR model frozen, the draft head made (after seeding), and the target's beams on training and
    validation histories: (head, sids as a tensor, trie, train beams, valid beams)."""
    from ..ids.trie import SidTrie

    head, sids_t = _frozen_with_head(gr, sids, tcfg, make_head)
    trie = SidTrie(sids, gr.cfg.level_sizes)
    tb, vb = _aligned_beams(gr, split, sids_t, trie, align, tcfg.seed, cache, progress)
    return head, sids_t, trie, tb, vb


def _fit_aligned(head, name: str, label: str, tcfg, lengths, step, validate, align: AlignConfig, log, progress):
    """Train ``head`` with ``step``, keep its best epoch by coverage (``validate``), and report."""
    before = validate()
    best, state, hist = train_loop(list(head.parameters()), tcfg, len(lengths), lengths, step, validate, name, log,
                                   progress, lambda: {k: v.clone() for k, v in head.state_dict().items()})
    head.load_state_dict(state)
    log(f"{label}: coverage of the target's top-{align.top_k} by its top-{2 * align.top_k}: {before:.3f} -> {best:.3f}")
    return head.eval(), {"align": align.model_dump(), "coverage_before": before, "best_valid_coverage": best,
                         "epochs": hist}


def _train_nezha_aligned(gr, split, sids, tcfg, align: AlignConfig, log, progress, cache):
    from ..backends import Backend

    head, sids_t, trie, tb, vb = _aligned_setup(gr, split, sids, tcfg, align, cache, progress, NezhaHead)
    be = Backend(gr)
    ex = tb.examples
    lengths = (ex.history != PAD).sum(1)
    v_target = vb.items(trie)
    log(f"nezha head, aligned ({align.mode}, alpha {align.alpha}): {len(ex)} histories, target top-{align.top_k}")

    def step(idx):
        head.train()
        tgt = sids_t[torch.from_numpy(ex.target[idx])]
        codes, alive = torch.from_numpy(tb.codes[idx]), torch.from_numpy(tb.alive[idx])
        with torch.no_grad():
            e = be.encode(history_batch(sids_t, ex.history[idx]))  # inference tensors: copied for use beside autograd
            enc = EncoderState(None, e.mask.clone(), e.cross_k.clone(), e.cross_v.clone())
            teacher, _ = gr.next_logprobs(enc, gr.decoder_input(tgt[:, None, :-1]))
            teacher = [t[:, 0] for t in teacher]
            p = target_logprobs(be, enc, codes, alive)
        rec = head.loss(gr, enc, tgt, teacher)
        q = head.prefix_logprobs(gr, head.hidden(gr, enc), codes.clamp(min=0))
        return align.alpha * rec + (1 - align.alpha) * head_alignment_loss(align.mode, q, p, codes, alive)

    @torch.inference_mode()
    def validate():
        head.eval()
        drafts = []
        for s in range(0, len(vb.examples), 500):
            enc = be.encode(history_batch(sids_t, vb.examples.history[s : s + 500]))
            beams = nezha_beam_search(head, gr, head.hidden(gr, enc), trie, 2 * align.top_k)
            drafts.append(beams.items(trie).numpy())
        return coverage(np.concatenate(drafts), v_target)

    return _fit_aligned(head, "nezha (aligned)", "nezha head", tcfg, lengths, step, validate, align, log, progress)


def _train_self_draft_aligned(gr, split, sids, tcfg, align: AlignConfig, log, progress, cache):
    head, sids_t, trie, tb, vb = _aligned_setup(gr, split, sids, tcfg, align, cache, progress, SelfDraftHead)
    seen_rows = torch.from_numpy(np.nonzero(split.seen)[0])
    remap = torch.full((len(sids),), -1, dtype=torch.int64)
    remap[seen_rows] = torch.arange(len(seen_rows))
    ex = tb.examples
    positives = torch.from_numpy(tb.items(trie))
    positives = torch.where(positives >= 0, remap[positives.clamp(min=0)], -1)
    lengths = (ex.history != PAD).sum(1)
    v_target = vb.items(trie)

    def step(idx):
        head.train()
        with torch.no_grad():
            enc = gr.encode(history_batch(sids_t, ex.history[idx]))
        logits = head.user_vectors(enc) @ head.item_vectors(gr, sids_t[seen_rows]).T / head.cfg.temperature
        rec = F.cross_entropy(logits, remap[torch.from_numpy(ex.target[idx])])
        return align.alpha * rec + (1 - align.alpha) * self_draft_alignment_loss(logits, positives[idx])

    @torch.inference_mode()
    def validate():
        head.eval()
        items = head.item_vectors(gr, sids_t)
        u = head.user_vectors(gr.encode(history_batch(sids_t, vb.examples.history)))
        return coverage((u @ items.T).topk(2 * align.top_k, dim=1).indices.numpy(), v_target)

    return _fit_aligned(head, "self-draft (aligned)", "self-drafter", tcfg, lengths, step, validate, align, log,
                        progress)
