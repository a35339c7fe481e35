import json

import numpy as np
import pytest
import torch

from specrec.bundle import Bundle, round_to_half
from specrec.data import leave_one_out
from specrec.decoding.beam import beam_search
from specrec.ids import SemanticIds
from specrec.train.trainer import TrainConfig, Trainer, evaluate_beam

from ..conftest import clustered_embeddings, tiny_config


@pytest.fixture(scope="module")
def setup(synth):
    split = leave_one_out(synth, max_history=6)
    emb = clustered_embeddings(synth.n_items, seed=2)
    cfg = tiny_config(level_sizes=[8, 8, 8, 64], d_model=48, d_ff=96)
    sem = SemanticIds.fit(emb, n_levels=3, codebook_size=8, collision_size=64, seed=0)
    return split, cfg, sem, sem.assign_all(emb)


def _trainer(setup, out, epochs, **kw):
    split, cfg, _, sids = setup
    base = dict(epochs=epochs, batch_size=64, lr=3e-3, warmup_steps=10, valid_limit=200, patience=50)
    tc = TrainConfig(**{**base, **kw})
    return Trainer(cfg, tc, sids, split.train, split.valid, out, log=lambda s: None)


def test_training_learns(setup, tmp_path):
    split, cfg, _, sids = setup
    tr = _trainer(setup, tmp_path, epochs=6)
    before = evaluate_beam(tr.model, tr.sids, tr.trie, split.valid.head(200), 10)
    summary = tr.fit(progress=False)
    after = evaluate_beam(tr.model, tr.sids, tr.trie, split.valid.head(200), 10)
    assert after["recall@10"] > before["recall@10"] + 0.05, (before, after)
    losses = [h["loss"] for h in tr.history]
    assert losses[-1] < losses[0]
    assert summary["best_epoch"] >= 1
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert len(log) == 6 and "valid.ndcg@10" in log[0]


def test_resume_equals_uninterrupted(setup, tmp_path):
    straight = _trainer(setup, tmp_path / "a", epochs=3)
    straight.fit(progress=False)
    first = _trainer(setup, tmp_path / "b", epochs=3)
    first.cfg.epochs = 2  # "interrupted" after two epochs; the schedule still spans three
    first.fit(progress=False)
    resumed = _trainer(setup, tmp_path / "b", epochs=3)
    assert resumed.resume() and resumed.epoch == 2
    resumed.fit(progress=False)
    assert resumed.epoch == 3 and resumed.step == straight.step
    for (n, a), (_, b) in zip(straight.model.state_dict().items(), resumed.model.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-6), n


@pytest.mark.filterwarnings("ignore:Seems like `optimizer.step")
def test_budget_plans_the_epochs_and_records_a_test_curve(setup, tmp_path, monkeypatch):
    """A time budget fixes the number of epochs after the first (whose cost is measured), shortens the
    plan when epochs get slower, and never runs past it; the test curve is recorded at each validation
    but does not choose the kept weights."""
    split, cfg, _, sids = setup
    clock = {"t": 0.0}
    cost = {"epoch": 60.0}  # seconds an epoch "takes" on the fake clock

    def fake_time():
        return clock["t"]

    import specrec.train.trainer as trainer_mod

    monkeypatch.setattr(trainer_mod.time, "time", fake_time)
    tc = TrainConfig(epochs=50, batch_size=64, lr=3e-3, warmup_steps=10, valid_limit=100, patience=50,
                     budget_minutes=6.0, valid_every=2, curve_limit=50)
    tr = Trainer(cfg, tc, sids, split.train, split.valid, tmp_path, log=lambda s: None, test=split.test)
    real_step = tr.opt.step
    steps_per_epoch = tr.steps_per_epoch

    def step(*a, **k):
        clock["t"] += cost["epoch"] / steps_per_epoch
        if tr.epoch == 2:
            cost["epoch"] = 90.0  # the machine got busier
        return real_step(*a, **k)

    tr.opt.step = step
    summary = tr.fit(progress=False)
    assert summary["stopped"] == "budget"
    # 6 min at 1 min per epoch -> 6 epochs planned; slower epochs from the third on shorten that
    assert 4 <= tr.epoch < 6 and summary["planned_epochs"] == tr.epoch
    assert tr.total_steps == tr.step  # the cosine ended where the run did
    assert tr.elapsed_s <= 6 * 60 + 1e-6
    validated = [h for h in tr.history if "valid.ndcg@10" in h]
    assert validated[0]["epoch"] == 1 and validated[-1]["epoch"] == tr.epoch
    assert all("test.recall@10" in h and "minutes" in h for h in validated)
    assert len(tr.curve) == 50 and set(tr.curve.user) <= set(split.test.user)


def test_early_stopping(setup, tmp_path):
    # with a zero learning rate nothing can improve after the first epoch
    tr = _trainer(setup, tmp_path, epochs=30, patience=1, lr=0.0)
    tr.fit(progress=False)
    assert tr.epoch == 2 and tr.best_epoch == 1


def test_bundle_roundtrip(setup, tmp_path, synth):
    split, cfg, sem, sids = setup
    tr = _trainer(setup, tmp_path / "run", epochs=1)
    tr.fit(progress=False)
    b = Bundle("synthetic", synth.catalogue, sem, sids, split.seen, round_to_half(tr.model), {"protocol": "loo"})
    b.save(tmp_path / "bundle")
    c = Bundle.load(tmp_path / "bundle")
    assert c.catalogue.ids == b.catalogue.ids and np.array_equal(c.sids, b.sids)
    assert np.array_equal(c.seen, b.seen) and np.array_equal(c.semantic_ids.codebooks, sem.codebooks)
    hist = b.history_sids(split.test.histories()[:5])
    with torch.inference_mode():
        bx, by = b.backend("eager"), c.backend("eager")
        x = beam_search(bx, bx.encode(hist), b.trie, 5)
        y = beam_search(by, by.encode(hist), c.trie, 5)
    assert torch.equal(x.codes, y.codes) and torch.allclose(x.scores, y.scores)


def test_causal_chunks_cover_every_target_once_with_its_context(synth):
    from specrec.data import leave_one_out as loo
    from specrec.train.batches import causal_chunks

    split = loo(synth, max_history=6)
    inp, tgt = causal_chunks(split.train)
    want = {(tuple(h[h >= 0].tolist()), int(t)) for h, t in zip(split.train.history, split.train.target)}
    got = []
    for x, y in zip(inp, tgt):
        for i in range(len(x)):
            if y[i] >= 0:
                ctx = x[: i + 1]
                got.append((tuple(ctx[ctx >= 0].tolist()), int(y[i])))
    assert len(got) == len(split.train)
    # each (context, target) of a chunk is a training example whose history ends with that context
    hist_of = {}
    for h, t in zip(split.train.history, split.train.target):
        hist_of.setdefault(int(t), []).append(tuple(h[h >= 0].tolist()))
    for ctx, t in got:
        assert any(full[-len(ctx):] == ctx for full in hist_of[t])
    assert len(want) <= len(got)


@pytest.mark.parametrize("stride", [1, 2, 4, 6])
def test_overlapping_chunks_teach_each_target_once_with_enough_context(synth, stride):
    """With a stride below H the chunks overlap; each target is still taught once, in the chunk where it
    has the most context: at least H - stride + 1 items of its own history (all of it when shorter), and
    with stride 1 exactly the history it is served with."""
    from specrec.data import leave_one_out as loo
    from specrec.train.batches import causal_chunks

    H = 6
    split = loo(synth, max_history=H)
    inp, tgt = causal_chunks(split.train, stride=stride)
    by_key = {}
    for h, t, u, p in zip(split.train.history, split.train.target, split.train.user, split.train.position):
        by_key[(int(u), int(p))] = (tuple(h[h >= 0].tolist()), int(t))
    taught = []
    for x, y in zip(inp, tgt):
        for i in range(H):
            if y[i] >= 0:
                ctx = x[: i + 1]
                taught.append((tuple(ctx[ctx >= 0].tolist()), int(y[i])))
    assert len(taught) == len(split.train)
    examples = sorted(by_key.values())
    for ctx, t in taught:
        full = [h for h, tt in examples if tt == t and h[-len(ctx):] == ctx]
        assert full, (ctx, t)
        assert any(len(ctx) >= min(len(h), H - stride + 1) for h in full)
    if stride == 1:
        assert sorted(taught) == examples
    if stride < H:
        assert len(inp) > len(causal_chunks(split.train)[0])


def test_causal_sequence_loss_equals_per_example_loss():
    """One encoder pass over a sequence gives each target exactly the loss of
    encoding its own prefix: training and inference see the same thing."""
    from specrec.models.tiger import Tiger

    torch.manual_seed(0)
    cfg = tiny_config(causal_encoder=True, max_history=6)
    model = Tiger(cfg).eval()
    rng = np.random.default_rng(0)
    seq = torch.from_numpy(rng.integers(0, 3, (6, 4)))
    inp = torch.full((1, 6, 4), -1, dtype=torch.int64)
    tgt = torch.full((1, 6, 4), -1, dtype=torch.int64)
    inp[0, 2:] = seq[:4]  # 4 history items, left-padded
    tgt[0, 2:] = seq[1:5]  # the next item after each
    tgt[0, 2] = -1  # ... except the first position, not a training target
    with torch.no_grad():
        together = model.forward_sequences(inp, tgt)
        singles = []
        for i in range(1, 4):
            h = torch.full((1, 6, 4), -1, dtype=torch.int64)
            h[0, 6 - (i + 1):] = seq[: i + 1]
            singles.append(model(h, seq[i + 1][None]))
    assert torch.allclose(together, torch.stack(singles).mean(), atol=1e-5)


def test_data_parallel_workers_learn_and_resume(setup, tmp_path):
    """Two gloo workers split every batch; the run is resumable like a single process's."""
    split, cfg, _, sids = setup
    ccfg = cfg.model_copy(update={"causal_encoder": True})
    base = dict(batch_size=64, lr=3e-3, warmup_steps=10, valid_limit=200, patience=50, workers=2, threads=2, ema=0.9)
    first = Trainer(ccfg, TrainConfig(epochs=2, **base), sids, split.train, split.valid, tmp_path, log=lambda s: None)
    before = evaluate_beam(first.model, first.sids, first.trie, split.valid.head(200), 10)
    summary = first.fit(progress=False)
    assert summary["workers"] == 2 and first.epoch == 2
    again = Trainer(ccfg, TrainConfig(epochs=4, **base), sids, split.train, split.valid, tmp_path, log=lambda s: None)
    assert again.resume() and again.epoch == 2 and again.step == first.step
    again.fit(progress=False)
    after = evaluate_beam(again.model, again.sids, again.trie, split.valid.head(200), 10)
    log = [json.loads(line) for line in (tmp_path / "train_log.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in log] == [1, 2, 3, 4]
    assert log[-1]["loss"] < log[0]["loss"] and "valid_ema.ndcg@10" in log[-1]
    assert after["recall@10"] > before["recall@10"]


def test_sasrec_baseline_learns_and_ranks_by_the_eval_code_path(synth, setup):
    from specrec.drafters.sasrec import SasrecDrafter
    from specrec.eval.evaluate import drafter_ranker, run_ranker, summarise
    from specrec.itemset import LocalItemSet
    from specrec.models.sasrec import SASRec, SASRecConfig
    from specrec.train.baseline import train_sasrec
    from specrec.train.drafters import DrafterTrainConfig

    split = leave_one_out(synth, max_history=6)
    cfg = SASRecConfig(n_items=synth.n_items, d_model=32, d_ff=64, max_history=6, dropout=0.1)
    untrained = SASRec(cfg)
    model, rep = train_sasrec(split, [s.items for s in synth.sequences], synth.n_items, cfg,
                              DrafterTrainConfig(epochs=6, batch_size=64, lr=3e-3, patience=6, valid_limit=300),
                              log=lambda s: None, progress=False)
    losses = [e["loss"] for e in rep["epochs"]]
    assert losses[-1] < losses[0]

    sids = setup[3]
    itemset = LocalItemSet(sids, np.ones(len(sids), bool), setup[1].level_sizes)
    trained_drafter = SasrecDrafter(model, itemset, backend="eager")  # what sasrec_ranker ranks with
    untrained_drafter = SasrecDrafter(untrained, itemset, backend="eager")
    ex = split.test.head(300)
    def scored(drafter):
        return summarise("sasrec", *run_ranker(drafter_ranker(drafter), ex, 10, batch_size=64, progress=False), ex,
                         split, (10,))

    after, before = scored(trained_drafter), scored(untrained_drafter)
    assert after.overall["ndcg@10"] > before.overall["ndcg@10"] + 0.02, (before.overall, after.overall)


@pytest.mark.parametrize("mode", ["strict", "relaxed"])
def test_alignment_makes_the_head_cover_the_targets_top_k(setup, mode, tmp_path):
    """Aligned to a (random, decisive) target, the NEZHA head's top-2K covers more of the
    target's top-K than before; and the target beams are computed once (cached)."""
    from specrec.models.tiger import Tiger
    from specrec.train.align import AlignConfig
    from specrec.train.drafters import DrafterTrainConfig, train_nezha

    from ..conftest import sharpen

    split, cfg, _, sids = setup
    torch.manual_seed(3)
    gr = Tiger(cfg).eval()
    sharpen(gr, 8)
    align = AlignConfig(mode=mode, alpha=0.1, top_k=5, examples=600, valid_examples=200)
    head, rep = train_nezha(gr, split, sids, DrafterTrainConfig(epochs=4, batch_size=64, lr=5e-3, patience=4),
                            log=lambda s: None, progress=False, align=align, cache=tmp_path)
    assert rep["best_valid_coverage"] > rep["coverage_before"] + 0.05, rep
    assert len(list(tmp_path.glob("target_beams_*.npz"))) == 2  # training and validation beams, cached


def test_distillation_mixes_the_true_items_loss_with_the_teachers_and_trains(setup, tmp_path):
    """The distilled loss of a causal chunk is (1 - w) x the plain loss (forward_sequences, unchanged) + w x the
    soft targets' loss, from one output pass; an epoch of it lowers the loss."""
    from specrec.models.sasrec import SASRec, SASRecConfig
    from specrec.train.batches import causal_chunks
    from specrec.train.soft_targets import SasrecTeacher, soft_level_loss

    split, cfg, _, sids = setup
    causal = cfg.model_copy(update={"causal_encoder": True})
    tc = TrainConfig(epochs=2, batch_size=64, lr=3e-3, warmup_steps=10, valid_limit=100, patience=50)
    tr = Trainer(causal, tc, sids, split.train, split.valid, tmp_path, log=lambda s: None)
    torch.manual_seed(3)
    sasrec = SASRec(SASRecConfig(n_items=len(sids), d_model=16, n_heads=2, d_ff=32, max_history=6))
    tr.teacher = SasrecTeacher(sasrec, tr.sids, causal.level_sizes)
    tr.cfg.distill_weight = 0.25
    inp, tgt = causal_chunks(split.train, None)
    x, y = torch.from_numpy(inp[:32]), torch.from_numpy(tgt[:32])
    tr.model.eval()  # no dropout: the same pass twice
    with torch.no_grad():
        got = tr._sequence_loss(x, y)
        plain = tr.model.forward_sequences(tr._codes(x), tr._codes(y))
        hidden, codes = tr.model.sequence_hidden(tr._codes(x), tr._codes(y))
        soft = soft_level_loss(tr.model.levels_logits(hidden, causal.sid_len), tr.teacher.targets(x, y >= 0, codes))
    assert torch.allclose(got, 0.75 * plain + 0.25 * soft, atol=1e-6)
    assert soft > 0 and not torch.allclose(got, plain)
    tr.fit(progress=False)
    assert tr.history[-1]["loss"] < tr.history[0]["loss"]


def test_a_run_starts_from_a_bundles_weights_with_other_dropout_but_not_another_shape(setup, tmp_path, synth):
    split, cfg, sem, sids = setup
    tr = _trainer(setup, tmp_path / "run", epochs=1)
    tr.fit(progress=False)
    Bundle("synthetic", synth.catalogue, sem, sids, split.seen, tr.model, {"protocol": "loo"}).save(tmp_path / "b")
    more_dropout = cfg.model_copy(update={"dropout": 0.3})
    base = dict(epochs=1, batch_size=64, valid_limit=200, init_from=str(tmp_path / "b"))
    again = Trainer(more_dropout, TrainConfig(**base), sids, split.train, split.valid, tmp_path / "r2",
                    log=lambda s: None)
    saved = Bundle.load(tmp_path / "b").model.state_dict()
    for (name, p), q in zip(again.model.state_dict().items(), saved.values()):
        assert torch.equal(p, q), name
    wider = cfg.model_copy(update={"d_ff": cfg.d_ff * 2})
    with pytest.raises(ValueError, match="d_ff"):
        Trainer(wider, TrainConfig(**base), sids, split.train, split.valid, tmp_path / "r3", log=lambda s: None)


def test_history_dropout_masks_input_items_and_keeps_every_target(setup, tmp_path):
    """A causal chunk with ``history_dropout``: about that share of its input items are masked as padding while
    training (never in eval mode), and the targets the loss reads are all there."""
    split, cfg, _, sids = setup
    ccfg = cfg.model_copy(update={"causal_encoder": True})
    tc = TrainConfig(epochs=1, batch_size=64, lr=3e-3, warmup_steps=10, valid_limit=50, history_dropout=0.5)
    tr = Trainer(ccfg, tc, sids, split.train, split.valid, tmp_path, log=lambda s: None)
    seen = []
    tr.model.forward_sequences = lambda x, y: seen.append((x, y)) or torch.zeros((), requires_grad=True)
    from specrec.train.batches import causal_chunks

    inp, tgt = causal_chunks(split.train, 3)
    x, y = torch.from_numpy(inp[:64]), torch.from_numpy(tgt[:64])
    torch.manual_seed(0)
    tr.model.train()
    tr._sequence_loss(x, y)
    kept_x, kept_y = seen[-1]
    real = x >= 0
    masked = real & (kept_x[:, :, 0] < 0)
    assert 0.4 < masked.sum() / real.sum() < 0.6
    assert torch.equal(kept_y, tr._codes(y))  # every target kept
    tr.model.eval()
    tr._sequence_loss(x, y)
    assert torch.equal(seen[-1][0], tr._codes(x))  # nothing dropped outside training
