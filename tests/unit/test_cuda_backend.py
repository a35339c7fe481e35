"""The CUDA backend (:mod:`specrec.backends.cuda`): on the CPU its stand-in (``capture=False``) runs the same
buckets, padding, static buffers, chunks and device tables with the graphs' functions run eagerly, and every
search equals the eager backend's; on a GPU (skipped here without one) the captured graphs equal eager CUDA."""

import threading

import numpy as np
import pytest
import torch

from specrec.backends import Backend, make_backend
from specrec.backends.cuda import DEFAULT_BATCH_SIZES, CudaBackend, candidate_bucket, rank_buckets
from specrec.backends.graphs import Feed, GraphRunner, bucket, chunks, pool_bytes
from specrec.decoding.beam import beam_search
from specrec.decoding.searches.head import nezha_beam_search
from specrec.ids import SidTrie
from specrec.models.sid_mlp import SidMlpConfig, SidMlpDrafter

from ..conftest import random_sids, tiny_tiger

TOL = 1e-5
SIZES = (1, 2, 4)  # small buckets: 3 rows pad to 4, 6 rows run as 4 + 2
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here: the graphs themselves "
                                "are measured by bench/device_check.sh on a GPU")


@pytest.fixture(scope="module")
def parts():
    m, head, sids = tiny_tiger()
    torch.manual_seed(0)
    drafter = SidMlpDrafter(m.cfg.level_sizes, m.cfg.d_model, SidMlpConfig(hidden=32, ff=64)).eval()
    return m, head, drafter, sids


@pytest.fixture()
def pair(parts):
    m, head, drafter, sids = parts
    return (Backend(m, head, drafter=drafter),
            make_backend("cuda", m, head, drafter=drafter, device="cpu", batch_sizes=SIZES), sids)


def _hist(sids, lengths, h=8):
    out = torch.full((len(lengths), h, sids.shape[1]), -1, dtype=torch.int64)
    for i, k in enumerate(lengths):
        out[i, h - k :] = torch.from_numpy(sids[i : i + k])
    return out


def _same_beams(a, b):
    assert torch.equal(a.codes, b.codes)
    assert torch.equal(a.alive, b.alive)
    assert (a.scores - b.scores).nan_to_num(0, 0, 0).abs().max() < TOL
    assert (a.token_logp - b.token_logp).nan_to_num(0, 0, 0).abs().max() < TOL


@torch.inference_mode()
def test_a_backend_never_moves_another_backends_modules(parts):
    """Two backends on two devices over the same bundle's drafter (as ``bench/gpu_check.py`` builds the CUDA backend,
    then the CPU reference): each computes with weights of its own, and the bundle's drafter stays where it was.
    CPU proxy of the GPU failure (issue 65, 1): the "meta" device stands in for CUDA. When the hot path kept the
    drafter itself, the CPU backend's first use moved the CUDA backend's drafter back to the CPU (``.to`` moves a
    module's parameters in place), and its captured graphs read freed device memory."""
    m, head, drafter, sids = parts
    before = {n: p.clone() for n, p in drafter.state_dict().items()}
    on_meta = Backend(m, head, device="meta", drafter=drafter)
    assert all(p.device.type == "meta" for p in on_meta.fused.parameters())
    on_cpu = Backend(m, head, drafter=drafter)
    trie = SidTrie(sids, m.cfg.level_sizes)
    drafted = on_cpu.search("draft", on_cpu.encode(_hist(sids, [5])), trie, (4,))  # the CPU backend in use
    assert drafted.codes.shape[0] == 1
    assert all(p.device.type == "meta" for p in on_meta.fused.parameters())
    assert all(p.device.type == "cpu" for p in drafter.parameters())
    assert all(torch.equal(p, before[n]) for n, p in drafter.state_dict().items())
    assert on_meta.fused.drafter is not drafter and on_cpu.fused.drafter is not drafter
    shared = {p.data_ptr() for p in on_cpu.fused.parameters()} & {p.data_ptr() for p in drafter.parameters()}
    assert not shared


def test_buckets_and_chunks():
    assert [bucket(n, SIZES) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    with pytest.raises(ValueError, match="largest bucket"):
        bucket(5, SIZES)
    assert chunks(6, 4) == [(0, 4), (4, 6)] and chunks(4, 4) == [(0, 4)]
    assert [candidate_bucket(m) for m in (1, 8, 9, 40, 64, 65, 100)] == [8, 8, 16, 40, 64, 128, 128]
    assert rank_buckets([40]) == [8, 16, 24, 32, 40] and rank_buckets([]) == [8]
    assert rank_buckets([70])[-2:] == [64, 128]
    assert DEFAULT_BATCH_SIZES[0] == 1 and list(DEFAULT_BATCH_SIZES) == sorted(DEFAULT_BATCH_SIZES)


@pytest.mark.parametrize("lengths", [[7], [7, 3, 1], [5, 5, 2, 1, 8, 3]])
@torch.inference_mode()
def test_every_search_equals_eager(pair, lengths):
    """1 row, 3 rows padded to a bucket of 4, 6 rows in chunks of 4 + 2: beam, head, the distilled drafter's
    searches, strict (its resume included: n = 1 draft misses rows) and rank, as the eager backend gives them."""
    ref, be, sids = pair
    trie = SidTrie(sids, ref.cfg.level_sizes)
    h = _hist(sids, lengths)
    ea, eb = ref.encode(h), be.encode(h)
    for w in (1, 4, 9):
        _same_beams(beam_search(ref, ea, trie, w), be.search("beam", eb, trie, (w,)))
        want = nezha_beam_search(ref.nezha_head, ref.model, ref.head_hidden(ea), trie, w)
        got = be.search("head", eb, trie, (w,))
        assert torch.equal(got.codes[got.alive], want.codes[want.alive])
        _same_beams(ref.search("draft", ea, trie, (w,)), be.search("draft", eb, trie, (w,)))
        _same_beams(ref.search("draft_scored", ea, trie, (w,)), be.search("draft_scored", eb, trie, (w,)))
        for n in (1, 2 * w):
            da, db = ref.search("strict", ea, trie, (w, n)), be.search("strict", eb, trie, (w, n))
            _same_beams(da.beams, db.beams)
            assert torch.equal(torch.as_tensor(da.covered), torch.as_tensor(db.covered))
            assert torch.equal(torch.as_tensor(da.frontier), torch.as_tensor(db.frontier))
            _same_beams(db.beams, beam_search(ref, ea, trie, w))  # strict is beam, on this backend too
    for m in (1, 13, 41):
        cand = torch.from_numpy(sids[np.random.default_rng(m).integers(0, 50, len(lengths) * m)])
        cand = cand.view(len(lengths), m, -1)
        got = be.search("rank", eb, None, (), {"sids": cand})
        assert (ref.search("rank", ea, None, (), {"sids": cand}) - got).abs().max() < TOL


@torch.inference_mode()
def test_a_call_never_writes_into_its_inputs(pair):
    """Static buffers are the backend's own: a later call of the same graph leaves an earlier encoder state (a
    session's, held across rounds) as it was."""
    ref, be, sids = pair
    trie = SidTrie(sids, ref.cfg.level_sizes)
    first = be.encode(_hist(sids, [3, 5]))
    kept = [first.mask.clone(), first.cross_k.clone(), first.cross_v.clone()]
    be.search("beam", first, trie, (4,))
    second = be.encode(_hist(sids[10:], [6, 1]))
    be.search("beam", second, trie, (4,))
    assert torch.equal(first.mask, kept[0]) and torch.equal(first.cross_k, kept[1])
    assert torch.equal(first.cross_v, kept[2])
    _same_beams(be.search("beam", first, trie, (4,)), beam_search(ref, ref.encode(_hist(sids, [3, 5])), trie, 4))


@torch.inference_mode()
def test_a_graph_is_made_once_per_key_and_counted_after_the_warm_up(pair):
    ref, be, sids = pair
    trie = SidTrie(sids, ref.cfg.level_sizes)
    be.warmup(trie, ks=(3,), scored=(7,))
    made = len(be.runner)
    # every bucket x (encode, beam, 3 drafter searches, 6 head and 6 strict widths, resume, rank) at K = 3
    assert made >= len(SIZES) * 10
    for lengths in ([4], [2, 3], [1, 2, 3]):
        enc = be.encode(_hist(sids, lengths))
        be.search("beam", enc, trie, (3,))
        be.search("rank", enc, None, (), {"sids": torch.from_numpy(sids[:7]).expand(len(lengths), -1, -1)})
    assert len(be.runner) == made and be.runner.captured_after_start == 0
    be.search("beam", be.encode(_hist(sids, [4])), trie, (5,))  # a width the warm-up did not capture: made by the call
    assert len(be.runner) == made + 1 and be.runner.captured_after_start == 1
    d = be.describe()
    assert d["backend"] == "cuda" and d["graphs"] == made + 1 and d["batch_sizes"] == list(SIZES)
    assert d["eager"] == ["step", "tree", "head_hidden"]


class _CountingLock:
    """A re-entrant lock that counts how often it was taken from free (its outermost acquisitions)."""

    def __init__(self):
        self._lock, self.depth, self.taken = threading.RLock(), 0, 0

    def __enter__(self):
        self._lock.acquire()
        self.taken += self.depth == 0
        self.depth += 1
        return self

    def __exit__(self, *exc):
        self.depth -= 1
        self._lock.release()


@torch.inference_mode()
def test_a_whole_search_holds_the_runners_lock_from_start_to_end(pair):
    """CPU proxy of issue 65, 7: ``strict`` with one draft misses rows, so its value takes two graphs and device
    selects between them; the lock (which every capture holds) is taken once for all of it. When it was taken per
    graph, a capture in another thread could start between the two, and this search's selects failed with
    "operation not permitted when stream is capturing"."""
    ref, be, sids = pair
    trie = SidTrie(sids, ref.cfg.level_sizes)
    enc = be.encode(_hist(sids, [7, 3, 1]))
    be.runner.lock = lock = _CountingLock()  # type: ignore[assignment]
    drafted = be.search("strict", enc, trie, (4, 1))
    assert not np.asarray(drafted.covered).all()  # a row was finished by ``resume``: a second graph
    assert lock.taken == 1 and lock.depth == 0


@torch.inference_mode()
def test_tables_follow_the_catalogue_its_views_and_its_growth(parts):
    """A request's view without some items reads the catalogue's tables with its cut lists (the tables' buffers
    are not written for it); the next call on the catalogue reads them whole again; a catalogue that outgrows the
    tables' buffers, or a view that cuts more than the cut buffers hold, gets new ones and the graphs that read the
    old are made again."""
    m, head, drafter, sids = parts
    ref = Backend(m, head, drafter=drafter)
    be = CudaBackend(m, head, device="cpu", drafter=drafter, batch_sizes=SIZES)
    be.tables.round_to = 1  # buffers of the catalogue's size plus 25%, so that a bigger one outgrows them
    trie = SidTrie(sids, m.cfg.level_sizes)
    h = _hist(sids, [4, 2])
    ea, eb = ref.encode(h), be.encode(h)
    view = trie.excluding(sids[:6])
    for t in (trie, view, trie, view):
        _same_beams(beam_search(ref, ea, t, 6), be.search("beam", eb, t, (6,)))
        _same_beams(ref.search("draft", ea, t, (6,)), be.search("draft", eb, t, (6,)))
    tables = [x.clone() for lv in be.tables.slots for x in lv.tensors()[:-1]]
    be.search("beam", eb, trie.excluding(sids[10:14]), (6,))
    assert all(torch.equal(a, x) for a, x in zip(tables, [x for lv in be.tables.slots for x in lv.tensors()[:-1]]))
    gen = be.tables.generation
    bigger = SidTrie(np.concatenate([sids, random_sids(60, m.cfg.level_sizes, seed=5)]), m.cfg.level_sizes)
    assert any(t.shape[0] > s.shape[0] for lv, slot in zip(bigger.search_tables(6), be.tables.slots)
               for t, s in zip(lv.tensors()[:-1], slot.tensors()[:-1]))
    _same_beams(beam_search(ref, ea, bigger, 6), be.search("beam", eb, bigger, (6,)))
    assert be.tables.generation == gen + 1
    assert all(k[0] in ("encode", "rank") or k[-2] == gen + 1 for k in be.runner.graphs)
    _same_beams(beam_search(ref, ea, trie, 6), be.search("beam", eb, trie, (6,)))
    wide = trie.excluding(sids[: be.tables.cuts + 5])  # more cut pairs at its last level than the buffers hold
    _same_beams(beam_search(ref, ea, wide, 6), be.search("beam", eb, wide, (6,)))
    assert be.tables.generation == gen + 2 and be.tables.slots[-1].cut.shape[1] >= be.tables.cuts + 5


@pytest.mark.parametrize("dense_cells", [0, 50])
@torch.inference_mode()
def test_csr_tables_run_the_graphs_too(parts, monkeypatch, dense_cells):
    """Every level in CSR (as a catalogue of millions of items has them), or the small levels dense and the
    others CSR: every search still runs as a graph (nothing steps eagerly), equal to the eager backend's, views
    included."""
    import specrec.ids.tables as tables_mod

    m, head, drafter, sids = parts
    monkeypatch.setattr(tables_mod, "DENSE_CELLS", dense_cells)
    trie = SidTrie(sids, m.cfg.level_sizes)
    tag = tables_mod.form_tag(trie.search_tables(6))
    assert tag == ("cccc" if dense_cells == 0 else "ddcc")
    ref = Backend(m, head, drafter=drafter)
    be = CudaBackend(m, head, device="cpu", drafter=drafter, batch_sizes=SIZES)
    h = _hist(sids, [3, 6, 1])
    ea, eb = ref.encode(h), be.encode(h)
    for t in (trie, trie.excluding(sids[:5]), trie.excluding(sids[20:40])):
        for w in (1, 4):
            _same_beams(beam_search(ref, ea, t, w), be.search("beam", eb, t, (w,)))
            _same_beams(ref.search("draft", ea, t, (w,)), be.search("draft", eb, t, (w,)))
            _same_beams(ref.search("draft_scored", ea, t, (w,)), be.search("draft_scored", eb, t, (w,)))
            want = nezha_beam_search(ref.nezha_head, ref.model, ref.head_hidden(ea), t, w)
            got = be.search("head", eb, t, (w,))
            assert torch.equal(got.codes[got.alive], want.codes[want.alive])
            for n in (1, 2 * w):
                _same_beams(be.search("strict", eb, t, (w, n)).beams, beam_search(ref, ea, t, w))
    assert be.describe()["eager"] == ["step", "tree", "head_hidden"]


def test_a_key_whose_capture_fails_runs_eagerly_and_says_why():
    runner = GraphRunner(torch.device("cpu"), capture=False)
    runner.capture = True  # as on a GPU, with a capture that fails

    def no_capture(fn, inputs):
        raise RuntimeError("operation not permitted when stream is capturing")

    runner._capture = no_capture  # type: ignore[method-assign]
    x = torch.arange(6.0).view(3, 2)
    out = runner.run(("double", 4), lambda t: (t * 2,), [Feed(x)], 3, (0,), (True,))
    assert torch.equal(out[0], x * 2)
    assert "capture failed" in runner.eager[("double", 4)] and len(runner) == 0
    assert torch.equal(runner.run(("double", 4), lambda t: (t * 2,), [Feed(x)], 3, (0,), (True,))[0], x * 2)


class _CudaStandIn:
    """torch.cuda's streams, graphs and allocator snapshot as a CPU stand-in: a current stream per thread, graphs
    that run the captured work eagerly (``capture_end`` raising where ``fail`` says so), the segments of a snapshot.
    Installed over ``torch.cuda`` for one test (with the private ``_get_device_index`` and ``_host_emptyCache`` that
    ``torch.cuda.stream`` and ``torch.cuda.graph`` call, so that a runner built on those runs here as well)."""

    POOL = (7, 1)

    def __init__(self, monkeypatch, fail: bool = False, segments: list | None = None):
        local = threading.local()
        stand_in = self

        class Stream:
            def __init__(self, device=None, name: str = "made"):
                self.device, self.name = torch.device("cuda", 0), name

            def wait_stream(self, other):
                pass

        class Graph:
            def capture_begin(self, *pool, **kw):
                stand_in.modes.append(kw.get("capture_error_mode", "global"))

            def capture_end(self):
                if fail:
                    raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

            def replay(self):
                pass

        self.modes: list[str] = []
        self.default = Stream(name="default")
        self.current = lambda device=None: getattr(local, "stream", self.default)
        for name, fn in (("Stream", Stream), ("CUDAGraph", Graph), ("current_stream", self.current),
                         ("set_stream", lambda s: setattr(local, "stream", s)),
                         ("synchronize", lambda device=None: None), ("current_device", lambda: 0),
                         ("memory_snapshot", lambda *a, **k: list(segments or [])),
                         ("_get_device_index", lambda *a, **k: 0), ("empty_cache", lambda: None)):
            monkeypatch.setattr(torch.cuda, name, fn)
        monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: None, raising=False)
        monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", None, raising=False)

    def runner(self) -> GraphRunner:
        """A runner that takes the capture path on the CPU's tensors."""
        runner = GraphRunner(torch.device("cpu"), capture=False)
        runner.capture, runner.pool = True, self.POOL
        return runner


def test_a_failed_capture_leaves_the_threads_stream_as_it_was(monkeypatch):
    """CPU proxy (torch.cuda stood in for, :class:`_CudaStandIn`) of issue 65, 5: a capture whose ``capture_end``
    raises (CUDA's answer to an invalidated capture) leaves this thread on the stream it was on, and the key runs
    eagerly and says why. ``torch.cuda.graph`` set the stream back only after ``capture_end`` returned, so every
    later call of the thread ran on the dead capture stream."""
    cuda = _CudaStandIn(monkeypatch, fail=True)
    runner = cuda.runner()
    x = torch.arange(6.0).view(3, 2)
    out = runner.run(("double", 4), lambda t: (t * 2,), [Feed(x)], 3, (0,), (True,))
    assert cuda.current() is cuda.default
    assert torch.equal(out[0], x * 2) and "capture failed" in runner.eager[("double", 4)] and len(runner) == 0


def test_captures_use_the_thread_local_mode_and_count_what_they_hold(monkeypatch):
    """CPU proxy (:class:`_CudaStandIn`) of issue 65, 6 and 7: a capture in thread-local mode (a global one refuses
    every other thread's device work while it runs: a serving replica's batches failed with "operation not
    permitted when stream is capturing"), the thread's stream set back, and the graphs' memory counted as what the
    allocator holds in their pool plus their static buffers (the reserved memory's difference around a capture
    missed what ``empty_cache`` gave back, and could go negative)."""
    mib = 2**20
    segments = [{"device": 0, "segment_pool_id": _CudaStandIn.POOL, "total_size": 4 * mib},
                {"device": 0, "segment_pool_id": (0, 0), "total_size": 64 * mib},  # the ordinary pool
                {"device": 1, "segment_pool_id": _CudaStandIn.POOL, "total_size": 8 * mib}]  # another device
    cuda = _CudaStandIn(monkeypatch, segments=segments)
    runner = cuda.runner()
    x = torch.zeros(3, 1024, 64)  # 768 KiB; its bucket of 4 rows: 1 MiB of static buffer
    out = runner.run(("double", 4), lambda t: (t * 2,), [Feed(x)], 3, (0,), (True,))
    assert cuda.modes == ["thread_local"] and cuda.current() is cuda.default
    assert out[0].shape == x.shape and len(runner) == 1 and not runner.eager
    assert runner.memory_mb() == pytest.approx(4 + 1)


def test_the_pool_holds_what_its_segments_hold():
    mib = 2**20
    seg = [{"device": 0, "segment_pool_id": (3, 0), "total_size": 2 * mib},
           {"device": 0, "segment_pool_id": (3, 0), "total_size": 20 * mib},
           {"device": 0, "segment_pool_id": (0, 0), "total_size": 100 * mib},
           {"device": 1, "segment_pool_id": (3, 0), "total_size": 50 * mib}]
    assert pool_bytes(seg, (3, 0), 0) == 22 * mib and pool_bytes(seg, (3, 0), 1) == 50 * mib
    assert pool_bytes([], (3, 0), 0) == 0 and pool_bytes(seg, (9, 9), 0) == 0


def test_the_stand_in_counts_its_static_buffers():
    runner = GraphRunner(torch.device("cpu"), capture=False)
    runner.run(("double", 8), lambda t: (t * 2,), [Feed(torch.zeros(5, 32768))], 5, (0,), (True,))
    runner.run(("triple", 4), lambda t: (t * 3,), [Feed(torch.zeros(3, 32768))], 3, (0,), (True,))
    assert runner.memory_mb() == pytest.approx(1.5)  # 8 + 4 rows x 32768 float32
    assert runner.drop(lambda key: key[0] == "triple") == 1 and runner.memory_mb() == pytest.approx(1.0)


def test_an_error_in_the_call_itself_is_raised_and_nothing_is_kept():
    runner = GraphRunner(torch.device("cpu"), capture=False)

    def bad(t):
        raise IndexError("index 9 is out of bounds")

    with pytest.raises(IndexError):
        runner.run(("bad", 1), bad, [Feed(torch.zeros(1, 2))], 1, (0,), (True,))
    assert len(runner) == 0 and not runner.eager


def test_graphs_need_a_cuda_device():
    with pytest.raises(ValueError, match="CUDA device"):
        GraphRunner(torch.device("cpu"), capture=True)


@needs_cuda
@pytest.mark.parametrize("dense_cells", [None, 0])
@torch.inference_mode()
def test_captured_graphs_equal_eager_cuda(parts, monkeypatch, dense_cells):
    """Captured, over the rule's tables (all dense here) and over CSR at every level, a request's view included."""
    import specrec.ids.tables as tables_mod

    m, head, drafter, sids = parts
    if dense_cells is not None:
        monkeypatch.setattr(tables_mod, "DENSE_CELLS", dense_cells)
    ref = Backend(m, head, device="cuda", drafter=drafter)
    be = CudaBackend(m, head, device="cuda", drafter=drafter, batch_sizes=SIZES)
    assert be.runner.capture
    trie = SidTrie(sids, m.cfg.level_sizes)
    for t in (trie, trie.excluding(sids[:7])):
        for lengths in ([7], [7, 3, 1], [5, 5, 2, 1, 8, 3]):
            h = _hist(sids, lengths)
            ea, eb = ref.encode(h), be.encode(h)
            for w in (1, 4, 9):
                _same_beams(beam_search(ref, ea, t, w), be.search("beam", eb, t, (w,)))
                _same_beams(ref.search("draft", ea, t, (w,)), be.search("draft", eb, t, (w,)))
                _same_beams(be.search("strict", eb, t, (w, 1)).beams, be.search("beam", eb, t, (w,)))
    assert not be.runner.eager, be.runner.eager
