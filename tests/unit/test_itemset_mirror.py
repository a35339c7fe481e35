"""The item set's mirror (itemset_svc/mirror.py) answers reads as Redis would for its version."""

from __future__ import annotations

from itemset_svc.keys import Record
from itemset_svc.mirror import Mirror
from itemset_svc.publish import WriteResult
from specrec_rpc.fingerprint import fingerprint


def records_fingerprint(records) -> str:
    return fingerprint((r.item_id, r.sid, r.unseen) for r in records)


def _mirror() -> Mirror:
    recs = [Record("a", 0, (1, 2, 0)), Record("b", 1, (1, 3, 0)), Record("c", 2, (4, 0, 1), unseen=True)]
    return Mirror("e1.5", records_fingerprint(recs), [8, 8, 4], {r.item_id: r for r in recs}, "bundle-fp")


def test_reads_of_the_mirror():
    m = _mirror()
    info = m.info()
    assert (info.version, info.n_items, info.stored_versions, info.bundle) == ("e1.5", 3, ["e1.5"], "bundle-fp")
    assert [r.item_id if r else None for r in m.resolve(["b", "zz", "a"])] == ["b", None, "a"]
    assert m.lookup(["1.3.0", "1.3.1", "4.0.1"]) == ["b", None, "c"]
    assert m.allowed(["", "1", "1.2", "4.0", "9"]) == [[1, 4], [2, 3], [0], [1], []]
    v, ls, records, fp = m.snapshot()
    assert v == "e1.5" and ls == [8, 8, 4] and [r.row for r in records] == [0, 1, 2] and fp == m.fingerprint


def test_a_write_updates_the_mirror_and_its_indexes():
    m = _mirror()
    assert m.lookup(["1.2.0"]) == ["a"] and m.allowed(["1"]) == [[2, 3]]  # indexes built
    new = Record("d", 3, (1, 5, 0))
    m.apply(WriteResult("e1.6", items=[new], removed=[m.records["a"]]))
    assert m.version == "e1.6" and set(m.records) == {"b", "c", "d"}
    assert m.fingerprint == records_fingerprint(m.records.values())
    assert m.lookup(["1.2.0", "1.5.0"]) == [None, "d"] and m.allowed(["1"]) == [[3, 5]]
    m.apply(WriteResult("e1.6", published=False))  # nothing changed: no new version
    assert m.version == "e1.6"


def test_delta_from_an_earlier_version_is_the_net_change():
    """Three writes (add, replace, delete; one item added then deleted): the delta from the first version is
    the current content of what is still there and the rows left empty; versions the mirror does not know
    give no delta."""
    m = _mirror()
    a, b = m.records["a"], m.records["b"]
    m.apply(WriteResult("e1.6", items=[Record("d", 3, (1, 5, 0))]))
    m.apply(WriteResult("e1.7", items=[Record("a", 0, (2, 2, 0), text="new text")], removed=[a]))
    m.apply(WriteResult("e1.8", items=[], removed=[b, m.records["d"]]))
    assert m.fingerprint == records_fingerprint(m.records.values())  # kept from the changes alone
    items, rows_out = m.delta("e1.5")
    assert [(r.item_id, r.row, r.sid, r.text) for r in items] == [("a", 0, (2, 2, 0), "new text")]
    assert rows_out == [1, 3]
    items, rows_out = m.delta("e1.7")
    assert items == [] and rows_out == [1, 3]
    assert m.delta("e1.8") == ([], [])  # the version held: nothing to send
    assert m.delta("e1.4") is None and m.delta("e9.1") is None and m.delta("") is None
    m.renamed("e2.1", m.fingerprint)  # published again as is (a restore): the old names still chain
    assert m.delta("e1.7") == ([], [1, 3]) and m.version == "e2.1"
    m.max_changes = 2
    m.apply(WriteResult("e2.2", items=[Record("e", 4, (3, 3, 0))]))
    assert m.delta("e1.7") is None and m.delta("e2.1") is not None  # forgotten: a full snapshot instead


def test_a_write_from_another_base_leaves_the_mirror_inexact():
    """Another replica wrote between: the write's base is not the mirror's version, so no delta (nor
    snapshot) is served from the mirror until it is read again."""
    m = _mirror()
    m.apply(WriteResult("e1.6", items=[Record("d", 3, (1, 5, 0))], base="e1.5"))
    assert m.exact and m.delta("e1.5") is not None
    assert not m.apply(WriteResult("e1.8", items=[Record("e", 5, (1, 6, 0))], base="e1.7"))
    assert not m.exact and m.delta("e1.6") is None and m.delta("e1.5") is None


def test_a_repeated_version_name_cuts_the_log():
    """Redis went back and its counter repeats a name: the log is cut, never followed round a cycle."""
    m = _mirror()
    m.apply(WriteResult("e1.6", items=[Record("d", 3, (1, 5, 0))]))
    m.apply(WriteResult("e1.7", items=[Record("e", 4, (1, 6, 0))]))
    m.apply(WriteResult("e1.6", items=[Record("f", 5, (1, 7, 0))]))  # the name e1.6 again
    assert m.delta("e1.5") is None and m.delta("e1.7") is None and m.delta("e1.6") == ([], [])


def test_the_log_holds_no_more_records_than_the_catalogue():
    """1,200 replacements of one item (two records each) in a 3-item catalogue: the log keeps the last
    1,000 records' worth; a follower further behind gets a full snapshot."""
    m = _mirror()
    m.max_changes = 10_000
    for i in range(1200):
        m.apply(WriteResult(f"e1.{6 + i}", items=[Record("a", 0, (2, i % 8, i // 8 % 4))], removed=[m.records["a"]]))
    assert sum(len(w) + len(o) for _, w, o in m.changes.values()) <= 1000
    assert m.delta("e1.5") is None and m.delta(f"e1.{6 + 1200 - 10}") is not None
