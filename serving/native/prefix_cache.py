"""A prefix cache over Inkling's three kinds of state: full-attention KV, sliding-window KV and ShortConv states.

A prompt's prefix is reusable only if everything a sequence carries past it is restored as it was: every full
layer's keys and values of every earlier position, each sliding layer's last window of keys and values, and each
ShortConv site's last kernel-1 inputs. The cache is a radix tree of token prefixes per adapter key (a new key per
adapter version; None: the base model, whose engine is one base), so a prefix computed under one adapter is
never found for another or for the base. Edges are whole blocks of `block` tokens; each node holds its edge's
full-layer keys and values, and a node where a sequence's state was read (its *boundary*) also holds the sliding
rings and ShortConv states as they were after its last token. Only boundary nodes are attach points: the rings
and conv states cannot be rebuilt from keys alone, and they are only known where a prefill chunk ended, so the
engine ends chunks at the points it wants in the cache (`Engine._plan`).

A cached prefix is attached by copying it into the sequence's own contiguous state slot, not by paging: the
pool keeps each sequence's KV contiguous (the eager attention, the decode kernels and the CUDA graphs all read
it in place), and the copy of a 2,048-token prefix of inkling-small is a few MB in a handful of device copies
(`StatePool.write_prefix` moves every full layer's keys and values of one node in one copy), microseconds
against that prefix's prefill. The price is that a sequence's state is not shared with the cache: a node is in
use only while it is copied, which the engine does between steps and never while it inserts, so the reference
that keeps a node alive is its place in the tree, and eviction removes least recently used leaves only (a
node's ancestors are never evicted before it). A node left a leaf without a boundary (after its children were
evicted) can never be attached, so it goes at once.

The tree (`PrefixCache`) holds no tensors: each node's copies live in a `PrefixStore` under the node's id. An engine
over several processes keeps the tree on rank 0 only, and every rank a store over its own slice of the state: rank
0's store records each call it gets (`native.plan`), and the other ranks make the same calls on theirs.
"""

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from inkwell.serving.contract import PrefixCacheStats
from inkwell.serving.native.state import StatePool


class PrefixStore:
    """The copies a prefix cache keeps of one `StatePool`'s sequences, by node id: each node's full-layer keys and
    values [2, full layers, tokens, kv heads, head dim], and at a boundary its rings and conv states."""

    def __init__(self, state: StatePool):
        self.state = state
        self.nbytes = 0
        self._kv: dict[int, torch.Tensor] = {}
        self._boundaries: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def save(self, node: int, slot: int, start: int, end: int) -> None:
        """Keep `slot`'s full-layer keys and values at positions start..end-1 as `node`'s."""
        kv = self._kv[node] = self.state.read_prefix(slot, start, end)
        self.nbytes += kv.nbytes

    def save_boundary(self, node: int, slot: int) -> None:
        """Keep what `slot` carries past its last computed position (`StatePool.read_boundary`) as `node`'s."""
        boundary = self._boundaries[node] = self.state.read_boundary(slot)
        self.nbytes += sum(t.nbytes for t in boundary)

    def split(self, node: int, upper: int, offset: int) -> None:
        """`node`'s first `offset` tokens become `upper`'s; each part in its own memory, so evicting either frees it."""
        kv = self._kv[node]
        self._kv[upper], self._kv[node] = kv[:, :, :offset].clone(), kv[:, :, offset:].clone()

    def restore(self, slot: int, parts: tuple[tuple[int, int], ...], boundary: int) -> None:
        """Copy each (node, start) of `parts` into `slot` at positions start.., then `boundary`'s rings and conv
        states: `slot` is then as if it had computed those tokens."""
        for node, start in parts:
            self.state.write_prefix(slot, start, self._kv[node])
        self.state.write_boundary(slot, *self._boundaries[boundary])

    def forget(self, nodes: Iterable[int]) -> None:
        for node in nodes:
            self.nbytes -= sum(t.nbytes for t in (self._kv.pop(node), *self._boundaries.pop(node, ())))


@dataclass(eq=False)
class _Node:
    """An edge of the tree: `tokens` at positions start.. (whole blocks), whose copies the store keeps under `id`
    (with rings and conv states where `boundary`)."""

    parent: "_Node | None"
    start: int
    tokens: tuple[int, ...]
    id: int
    boundary: bool = False
    children: dict[tuple[int, ...], "_Node"] = field(default_factory=dict)
    last_use: int = 0

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)


@dataclass(frozen=True)
class Match:
    """A lookup's answer: the nodes to copy (root side first; empty: nothing to attach), how many tokens they
    cover (`length`), and how far the prompt follows the tree (`shared`, whole blocks, >= length): a point
    worth a boundary when this prompt's prefill passes it."""

    nodes: tuple[_Node, ...]
    length: int
    shared: int


class PrefixCache:
    """Cached prefixes of the sequences whose copies `store` keeps, within `budget` bytes, in blocks of `block`
    tokens."""

    def __init__(self, store: PrefixStore, budget: int, block: int):
        if block < 1:
            raise ValueError(f"prefix_cache_block must be at least 1, got {block}")
        self.store, self.budget, self.block = store, budget, block
        self.stats = PrefixCacheStats()
        self._roots: dict[str | None, _Node] = {}
        self._ids = itertools.count()
        self._clock = 0

    def usable(self, prompt_len: int) -> int:
        """The longest prefix of a prompt of `prompt_len` tokens that may come from the cache: whole blocks, and
        never the last token, whose forward gives the first generated token's logits."""
        return self.aligned(prompt_len - 1)

    def aligned(self, tokens: int) -> int:
        """`tokens` rounded down to whole blocks."""
        return tokens // self.block * self.block

    # ---- lookup and attach -------------------------------------------------------------------------

    def lookup(self, adapter: str | None, tokens: list[int]) -> Match:
        """The deepest boundary along `tokens` (whole blocks of them) cached under `adapter`."""
        root = self._roots.get(adapter)
        if root is None:
            return Match((), 0, 0)
        path, _, shared = self._walk(root, tokens)
        while path and not path[-1].boundary:
            path.pop()
        return Match(tuple(path), path[-1].end if path else 0, shared)

    def attach(self, match: Match, slot: int, prompt_len: int) -> None:
        """Copy `match`'s prefix into sequence `slot` (its state is then as if it had computed those tokens), and
        count the lookup of a prompt of `prompt_len` tokens."""
        if match.nodes:
            self.store.restore(slot, tuple((node.id, node.start) for node in match.nodes), match.nodes[-1].id)
            self._touch(match.nodes)
        stats = self.stats
        stats.lookups += 1
        stats.hits += bool(match.nodes)
        stats.prompt_tokens += prompt_len
        stats.cached_tokens += match.length

    # ---- insert and evict --------------------------------------------------------------------------

    def insert(self, adapter: str | None, tokens: list[int], slot: int) -> None:
        """Cache the state of sequence `slot`, which has computed exactly `tokens` (whole blocks) under `adapter`:
        the full-layer keys of the tokens the tree lacks, and its rings and conv states as a boundary there."""
        if len(tokens) % self.block:
            raise ValueError(f"a cached prefix is whole blocks of {self.block} tokens, got {len(tokens)}")
        root = self._roots.get(adapter)
        if root is None:
            root = self._roots[adapter] = _Node(None, 0, (), next(self._ids))
        path, partial, matched = self._walk(root, tokens)
        node = path[-1] if path else root
        if partial is not None:
            node = self._split(partial, matched - partial.start)
            path.append(node)
        if matched < len(tokens):
            edge = tuple(tokens[matched:])
            node = _Node(node, matched, edge, next(self._ids))
            self.store.save(node.id, slot, matched, len(tokens))
            node.parent.children[edge[: self.block]] = node
            path.append(node)
        if not node.boundary:
            self.store.save_boundary(node.id, slot)
            node.boundary = True
        self._touch(path)
        self._evict()

    def drop(self, adapter: str | None) -> None:
        """Forget every prefix cached under `adapter` (its key is being unloaded, and may later name another)."""
        root = self._roots.pop(adapter, None)
        stack, gone = [] if root is None else list(root.children.values()), []
        while stack:
            node = stack.pop()
            gone.append(node.id)
            stack += node.children.values()
        self.store.forget(gone)
        self.stats.bytes = self.store.nbytes

    def _evict(self) -> None:
        """Remove least recently used leaves until the cache fits its budget."""
        while self.store.nbytes > self.budget:
            node, gone = min(self._leaves(), key=lambda n: n.last_use), []
            while True:
                parent = node.parent
                del parent.children[node.tokens[: self.block]]
                gone.append(node.id)
                if parent.parent is None or parent.children or parent.boundary:
                    break
                node = parent  # a leaf without a boundary is never attached: it goes too
            self.store.forget(gone)
            self.stats.evictions += len(gone)
        self.stats.bytes = self.store.nbytes

    def _leaves(self) -> list[_Node]:
        leaves, stack = [], [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            if node.children:
                stack += node.children.values()
            else:
                leaves.append(node)
        return leaves

    # ---- the tree ----------------------------------------------------------------------------------

    def _walk(self, root: _Node, tokens: list[int]) -> tuple[list[_Node], _Node | None, int]:
        """(the nodes whose whole edges `tokens` follows, the node it follows only partway if any, how many tokens
        it follows in all); comparisons are by whole blocks."""
        block, path, node, pos = self.block, [], root, 0
        while pos + block <= len(tokens):
            child = node.children.get(tuple(tokens[pos : pos + block]))
            if child is None:
                break
            same = block
            while same < len(child.tokens) and pos + same + block <= len(tokens):
                if tuple(tokens[pos + same : pos + same + block]) != child.tokens[same : same + block]:
                    break
                same += block
            if same < len(child.tokens):
                return path, child, pos + same
            path.append(child)
            node, pos = child, pos + same
        return path, None, pos

    def _split(self, node: _Node, offset: int) -> _Node:
        """Cut `node`'s edge after `offset` tokens (whole blocks); returns the new upper node (no boundary)."""
        upper = _Node(node.parent, node.start, node.tokens[:offset], next(self._ids))
        self.store.split(node.id, upper.id, offset)
        upper.last_use = node.last_use
        node.parent.children[upper.tokens[: self.block]] = upper
        node.parent, node.start, node.tokens = upper, node.start + offset, node.tokens[offset:]
        upper.children[node.tokens[: self.block]] = node
        return upper

    def _touch(self, nodes) -> None:
        self._clock += 1
        for node in nodes:
            node.last_use = self._clock
