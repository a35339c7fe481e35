import numpy as np
import torch

from specrec.models.sasrec import SASRec, SASRecConfig
from specrec.train.soft_targets import SasrecTeacher, soft_level_loss


def _teacher(n_items=40, sizes=(3, 4, 5), seed=0):
    rng = np.random.default_rng(seed)
    sids = torch.from_numpy(np.stack([rng.integers(0, s, n_items) for s in sizes], 1))
    torch.manual_seed(seed)
    return SasrecTeacher(SASRec(SASRecConfig(n_items=n_items, d_model=16, n_heads=2, d_ff=32, max_history=6)),
                         sids, list(sizes), temperature=0.7)


def test_each_level_is_the_teachers_mass_under_the_true_prefix():
    t = _teacher()
    inp = torch.tensor([[-1, -1, 3, 7, 1, 9], [-1, 2, 5, 11, 0, 4]])
    valid = torch.tensor([[False, False, True, False, True, True], [False, True, True, True, False, True]])
    tgt_items = torch.tensor([5, 8, 30, 1, 17, 22, 6])
    soft = t.targets(inp, valid, t.sids[tgt_items])
    states = t.sasrec.sequence(inp)[valid]
    p = torch.softmax(t.sasrec.scores(states) / 0.7, -1)
    for row, item in enumerate(tgt_items.tolist()):
        for lvl, size in enumerate(t.level_sizes):
            same = (t.sids[:, :lvl] == t.sids[item, :lvl]).all(1)
            want = torch.zeros(size)
            want.index_add_(0, t.sids[same, lvl], p[row, same])
            want /= want.sum()
            assert torch.allclose(soft[lvl][row], want, atol=1e-5), (row, lvl)
            assert soft[lvl][row, t.sids[item, lvl]] > 0  # the true code is always among the teacher's


def test_soft_loss_is_smallest_at_the_teachers_distribution():
    q = [torch.softmax(torch.randn(4, 6), -1), torch.zeros(4, 3)]  # level 2: no soft target on any row
    at_teacher = soft_level_loss([q[0].log(), torch.randn(4, 3)], q)
    elsewhere = soft_level_loss([torch.randn(4, 6), torch.randn(4, 3)], q)
    assert at_teacher < elsewhere
