import numpy as np
import pytest

from specrec.data import PAD, leave_one_out, load_dataset, temporal
from specrec.data.dataset import Catalogue, DataFormatError, Dataset, Sequence

from ..conftest import beauty_dir


def _check_loo(ds, split):
    n_users_with_test = sum(len(s.items) >= 2 for s in ds.sequences)
    assert len(split.test) == n_users_with_test
    last = {u: len(ds.sequences[u].items) for u in range(len(ds.sequences))}
    for ex, kind in ((split.train, "train"), (split.valid, "valid"), (split.test, "test")):
        for h, t, u, p in zip(ex.history, ex.target, ex.user, ex.position):
            seq = ds.sequences[u].items
            n = last[u]
            if kind == "test":
                assert p == n - 1
            elif kind == "valid":
                assert p == n - 2
            else:
                assert p <= n - 3  # the test and validation positions never enter training
            assert t == seq[p]
            hist = h[h != PAD]
            assert np.array_equal(hist, seq[max(0, p - split.max_history) : p])


def test_leave_one_out_no_leak(synth):
    split = leave_one_out(synth, max_history=6)
    _check_loo(synth, split)
    # deterministic
    again = leave_one_out(synth, max_history=6)
    assert np.array_equal(split.train.history, again.train.history)


def test_leave_one_out_beauty():
    ds = load_dataset(beauty_dir())
    split = leave_one_out(ds)
    assert len(split.test) == 22363 and len(split.valid) == 22363
    assert len(split.train) == ds.n_interactions() - 3 * 22363  # positions 1..n-3 of every user
    # every user's test target position is absent from that user's training positions
    max_train_pos = np.full(len(ds.sequences), -1)
    np.maximum.at(max_train_pos, split.train.user, split.train.position)
    assert np.all(max_train_pos[split.test.user] < split.test.position - 1)


def test_temporal_unseen_never_in_training(synth):
    split = temporal(synth, max_history=6, quantile=0.8)
    cut = split.cutoff
    train_items = set(split.train.target.tolist()) | set(split.train.history[split.train.history != PAD].tolist())
    unseen = set(np.nonzero(~split.seen)[0].tolist())
    assert unseen and not (unseen & train_items)
    # items whose first interaction is at/after the cut-off are unseen
    first = {}
    for s in synth.sequences:
        for i, t in zip(s.items, s.timestamps):
            first[int(i)] = min(first.get(int(i), t), t)
    late = {i for i, t in first.items() if t >= cut}
    assert late and late <= unseen
    # training targets are before the cut-off, test targets at or after it
    for ex, before in ((split.train, True), (split.test, False)):
        ts = np.array([synth.sequences[u].timestamps[p] for u, p in zip(ex.user, ex.position)])
        assert np.all(ts < cut) if before else np.all(ts >= cut)
    assert (~split.seen[split.test.target]).sum() > 0, "synthetic data must give unseen test targets"
    again = temporal(synth, max_history=6, quantile=0.8)
    assert again.cutoff == cut and np.array_equal(again.test.target, split.test.target)


def test_temporal_needs_timestamps():
    cat = Catalogue(["a", "b"], ["A", "B"], ["A", "B"])
    ds = Dataset("x", cat, [Sequence("u", np.array([0, 1]))])
    with pytest.raises(ValueError, match="timestamps"):
        temporal(ds)


def test_loader_errors_name_the_line(tmp_path):
    (tmp_path / "items.jsonl").write_text('{"item_id": 1, "title": "x"}\n{"title": "no id"}\n')
    (tmp_path / "sequences.jsonl").write_text('{"user_id": 1, "items": [1]}\n')
    with pytest.raises(DataFormatError, match="items.jsonl:2"):
        load_dataset(tmp_path)
    (tmp_path / "items.jsonl").write_text('{"item_id": 1, "title": "x"}\n')
    (tmp_path / "sequences.jsonl").write_text('{"user_id": 1, "items": [1, 7]}\n')
    with pytest.raises(DataFormatError, match="unknown item id"):
        load_dataset(tmp_path)


def test_roundtrip_user_files(tmp_path, synth):
    synth.to_dir(tmp_path)
    ds = load_dataset(tmp_path)
    assert ds.catalogue.ids == synth.catalogue.ids
    assert all(np.array_equal(a.items, b.items) and np.array_equal(a.timestamps, b.timestamps)
               for a, b in zip(ds.sequences, synth.sequences))
