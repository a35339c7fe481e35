"""The item set as the whole searches read it, and the one read of it (:func:`children`).

A constrained search step asks, for each of N beams' trie nodes at depth j, which node each code leads to:
``child`` [N, Vmax] int64, -1 where the code has no item below it. Per level j the catalogue keeps the
children of its nodes of depth j in one of two forms (:class:`Level`):

- **CSR** (``ptr`` [nodes_j + 1] int32, ``codes`` [edges_j] int32, the trie's own arrays: :class:`~.trie.SidTrie`):
  node n's children are the edges ``ptr[n] .. ptr[n+1] - 1``, edge e leads by code ``codes[e]`` to child node
  e (the trie numbers the nodes of depth j + 1 in edge order). Memory O(edges): ten million items take about
  100 MB. A read gathers each beam's range, the codes of its first F edges (``offs`` = 0 .. F-1, F the level's
  largest fan-out rounded up to a power of two: a 1-dimensional input whose length is F, so one graph serves
  every catalogue) and scatters the edge ids into the codes' columns: O(N x (F + Vmax)), with Gather and
  ScatterElements only (no searchsorted: every ONNX Runtime and CUDA graph has them). A dead beam's node -1 reads
  ``ptr[-1] .. ptr[0]``, an empty range;
- **dense** (``table`` [nodes_j + 1, Vmax] int32, the child of every code; its last row, read by node -1, all
  -1): one gather per read, memory O(nodes x Vmax) (10 GB per level at ten million items). Measured faster than
  CSR on the CPU (one level's read in ONNX Runtime: about 20 us against 35-60 us), so a level keeps one where it
  is small (:func:`dense_level`, the one rule: at most :data:`DENSE_CELLS` cells; all of Beauty's 12,101 items'
  levels, 17 MB).

A request's view without some items (:meth:`~.trie.SidTrie.excluding`) shares its catalogue's levels and
adds, per level, the (parent, code) pairs it cuts: ``cut`` [2, C] int64, C >= 1 (the pair (-2, 0), which no
node matches, stands for an empty list). :func:`children` sets those cells to -1 after the read, so no table
is copied per request and a device's tables never change with the request (:mod:`specrec.backends.cuda`).

A search's graph reads each level's tensors as inputs named by :func:`input_names` (``table{j}`` for a dense
level; ``ptr{j}``, ``edge_codes{j}`` and ``offs{j}`` for a CSR one; then ``cut{j}``), in the order
:meth:`Level.tensors` gives them; :func:`form_tag` names the forms in a graph's file name.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

#: a dense child table is kept for a level of at most this many cells (nodes x Vmax, int32: 4 bytes each, 16 MiB)
DENSE_CELLS = 1 << 22
#: the cut list of a view that cuts nothing: one pair no node matches (beams' nodes are >= -1)
NO_CUT = (-2, 0)


class Level(NamedTuple):
    """One level of the item set's children as a search reads them: ``table`` (dense), or ``ptr``, ``codes`` and
    ``offs`` (CSR), and the view's ``cut`` [2, C] (see the module's docstring)."""

    table: torch.Tensor | None
    ptr: torch.Tensor | None
    codes: torch.Tensor | None
    offs: torch.Tensor | None
    cut: torch.Tensor

    @property
    def dense(self) -> bool:
        return self.table is not None

    def tensors(self) -> list[torch.Tensor]:
        """What a graph reads of this level, in :func:`input_names`' order."""
        if self.table is not None:
            return [self.table, self.cut]
        assert self.ptr is not None and self.codes is not None and self.offs is not None
        return [self.ptr, self.codes, self.offs, self.cut]

    def with_cut(self, cut: torch.Tensor) -> Level:
        return self._replace(cut=cut)

    def to(self, device: torch.device | str) -> Level:
        table, ptr, codes, offs = (None if t is None else t.to(device) for t in self[:-1])
        return Level(table, ptr, codes, offs, self.cut.to(device))

    @property
    def nbytes(self) -> int:
        """Bytes of the catalogue's arrays (the cut list is the request's)."""
        return sum(t.numel() * t.element_size() for t in self[:-1] if t is not None)


def empty_cut(device: torch.device | str | None = None) -> torch.Tensor:
    """[2, 1]: a cut list that cuts nothing."""
    return torch.tensor([[NO_CUT[0]], [NO_CUT[1]]], dtype=torch.int64, device=device)


def dense_level(nodes: int, vmax: int) -> bool:
    """Whether a level of ``nodes`` parents is kept as a dense child table (the one rule: by its size)."""
    return (nodes + 1) * vmax <= DENSE_CELLS


def edge_parents(ptr: torch.Tensor) -> torch.Tensor:
    """The parent node of each edge of a level, by its CSR pointer ``ptr`` [nodes + 1] -> [edges] int64."""
    ptr = ptr.long()
    return torch.repeat_interleave(torch.arange(len(ptr) - 1), ptr[1:] - ptr[:-1])


def fanout_offsets(ptr: torch.Tensor) -> torch.Tensor:
    """``offs`` of a CSR level: 0 .. F-1 (int32), F its largest fan-out rounded up to a power of two (at least 1)."""
    most = int((ptr[1:] - ptr[:-1]).max()) if len(ptr) > 1 else 0
    return torch.arange(1 << max(0, most - 1).bit_length(), dtype=torch.int32)


def level_of(ptr: torch.Tensor, codes: torch.Tensor, vmax: int, dense: bool | None = None) -> Level:
    """A level of a trie (its CSR arrays, int32) as a search reads it, in the form :func:`dense_level` chooses
    (``dense``: forced), cutting nothing."""
    n = len(ptr) - 1
    if dense if dense is not None else dense_level(n, vmax):
        table = torch.full((n + 1, vmax), -1, dtype=torch.int32)
        table[edge_parents(ptr), codes.long()] = torch.arange(len(codes), dtype=torch.int32)
        return Level(table, None, None, None, empty_cut())
    # an empty level still has one code to gather (never read: every range is empty)
    return Level(None, ptr.int(), codes.int() if len(codes) else torch.zeros(1, dtype=torch.int32),
                 fanout_offsets(ptr), empty_cut())


def form_tag(levels: list[Level]) -> str:
    """The levels' forms, one letter each (``d`` dense, ``c`` CSR): ``ddcc``."""
    return "".join("d" if lv.dense else "c" for lv in levels)


def input_names(tag: str) -> list[str]:
    """A graph's input names for levels of forms ``tag`` (:func:`form_tag`)."""
    out: list[str] = []
    for j, f in enumerate(tag):  # (``edge_codes``, not ``codes``: strict's graph has an output ``codes1``)
        out += [f"table{j}"] if f == "d" else [f"ptr{j}", f"edge_codes{j}", f"offs{j}"]
        out.append(f"cut{j}")
    return out


def graph_inputs(levels: list[Level]) -> tuple[str, dict[str, np.ndarray]]:
    """Levels (on the CPU) as a graph's inputs: their forms (:func:`form_tag`: which graph reads them) and input
    name -> array (no copy)."""
    tag = form_tag(levels)
    return tag, dict(zip(input_names(tag), (t.numpy() for lv in levels for t in lv.tensors())))


def levels_of(tag: str, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> list[Level]:
    """:meth:`Level.tensors` of each level, flat (a graph's inputs, :func:`input_names`), -> the levels."""
    out, i = [], 0
    for f in tag:
        if f == "d":
            out.append(Level(tensors[i], None, None, None, tensors[i + 1]))
            i += 2
        else:
            out.append(Level(None, *tensors[i : i + 4]))
            i += 4
    if i != len(tensors):
        raise ValueError(f"{len(tensors)} tensors for levels of forms {tag!r} (which read {i})")
    return out


def children(level: Level, nodes: torch.Tensor, v: int) -> torch.Tensor:
    """The child node of every code after each node: ``nodes`` [N] (int64; -1 = a dead beam) -> [N, v] int64,
    -1 where the code leads to no item (of the view: its cut pairs are -1 too). ``v``: the codes read (Vmax)."""
    nodes = nodes.reshape(-1)
    if level.table is not None:
        child = torch.nn.functional.pad(level.table[nodes], (0, 1), value=-1)  # [N, v + 1] int32
    else:
        assert level.ptr is not None and level.codes is not None and level.offs is not None
        edge = level.ptr[nodes].unsqueeze(1) + level.offs  # [N, F]: the node's first F edges (node -1: ptr[-1] ...
        valid = edge < level.ptr[nodes + 1].unsqueeze(1)  # ... to ptr[0]: none)
        edge = torch.where(valid, edge, 0)
        col = torch.where(valid, level.codes[edge], v).long()  # column v: nothing (dropped below)
        child = torch.full((1, v + 1), -1, dtype=edge.dtype, device=edge.device).expand(nodes.shape[0], -1)
        child = child.scatter(1, col, edge)
    cut = level.cut
    hit = nodes.unsqueeze(1) == cut[0].unsqueeze(0)  # [N, C]
    child = child.scatter(1, torch.where(hit, cut[1].unsqueeze(0), v), -1)
    return child[:, :v].long()
