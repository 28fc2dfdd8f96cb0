"""Suffix decoding (vLLM's ``method: "suffix"``, after Arctic Inference's SuffixDecoding): the context's
longest suffix matched in the request's own tokens and in earlier responses, continued by the most frequent
continuations seen, for as many tokens as the match length warrants.

Both places to match are depth-limited suffix tries (``_Trie``): every substring of at most
``max_tree_depth`` tokens is a path from the root, and each node counts its occurrences. A substring seen
once needs no nodes below it (its continuation is read from the tokens where it occurred), so nodes exist only
for substrings seen twice or more plus one node past each of them: 1-2 nodes per token on text, at worst
``max_tree_depth`` (a passage seen exactly twice).
"""
from __future__ import annotations

import math
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

ROOT = 0
"""The root node (the empty string) of every trie."""
_SHIFT = 32
"""A child's key is ``parent << _SHIFT | token``: one int, not a tuple (half the memory of a (node, token))."""
_ROOT_COUNT = 2**31 - 1
"""The root's count: above any node's, so the root always reads as seen twice or more."""
MAX_NODES_PER_TOKEN = 4
"""Nodes a trie may hold per token of its cap (``max_request_tokens``, ``max_cached_tokens``): text needs
1-2, but a passage repeated once needs up to ``max_tree_depth`` per token, so the oldest tokens leave first."""
MAX_REQUEST_STATES = 1024
"""Per-request tries kept at most (a guard against a caller that never calls ``finish``: the least recently
used goes first, and is rebuilt if its request proposes again)."""


class _Trie:
    """A depth-limited suffix trie over token sequences ("docs"), counting occurrences.

    A node stands for a string s of at most ``depth`` tokens (token ids in [0, 2**31)); ``count`` is how many
    (doc, start) occurrences of s the trie holds. A node exists (is explicit) iff count(s) >= 2, or
    count(s) == 1 and s's parent has count >= 2 (the root counts as >= 2). Below a node with count 1
    ("unique"), strings are implicit: the node's ``occ_doc``/``occ_start`` give its one occurrence, whose
    tokens spell the rest. Every explicit node's suffix link (s without its first token) is explicit too,
    since count(s[1:]) >= count(s) and the same holds for their parents.

    Per-node fields are ``array("i")`` columns indexed by node id: 4 bytes a value, where a list would hold an
    8-byte pointer to a 28-byte int; about 130 bytes a node with its dict entry.

    Docs grow at their end (``extend``: O(nodes on the frontier) <= depth per token) and lose occurrences
    oldest first (``remove``: O(depth) each). ``occ_*`` keeps a node's newest occurrence, which is the one left
    when a count falls to 1 because removals go oldest first.
    """

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.children: dict[int, int] = {}
        """``parent << _SHIFT | token`` -> child node."""
        self.count = array("i", [_ROOT_COUNT])
        self.dep = array("i", [0])
        """The node's string length."""
        self.tok = array("i", [-1])
        """The node's last token."""
        self.link = array("i", [ROOT])
        """The node of the string without its first token."""
        self.total = array("i", [0])
        """The sum of the explicit children's counts: the continuations seen."""
        self.best = array("i", [-1])
        """The child with the highest count (kept on increments; a removal may leave it stale, or -1)."""
        self.occ_doc = array("i", [-1])
        self.occ_start = array("i", [-1])
        """The node's newest occurrence: its doc and start (with count 1, its only one)."""
        self.docs: dict[int, array] = {}
        """doc id -> its tokens."""
        self.doc_len: dict[int, int] = {}
        """doc id -> tokens indexed so far (a prefix of ``docs[doc]``)."""
        self._free: list[int] = []

    @property
    def num_nodes(self) -> int:
        """Explicit nodes, the root excluded."""
        return len(self.children)

    # ---- building -----------------------------------------------------------------------------------------

    def extend(self, doc: int, frontier: list[int], pos: int) -> list[int]:
        """Index ``docs[doc][pos]`` as the doc's next token.

        ``frontier[d]`` is the node of the doc's last d tokens before ``pos`` (``[ROOT]`` for an empty doc),
        for the d where that node is explicit; returns the frontier after ``pos``."""
        x = self.docs[doc][pos]
        self.doc_len[doc] = pos + 1
        children, count, total, best = self.children, self.count, self.total, self.best
        occ_doc, occ_start = self.occ_doc, self.occ_start
        depth = self.depth
        new = [ROOT]
        for d, v in enumerate(frontier):
            if d == depth or count[v] < 2:
                break  # at full depth, or below a unique node (implicit from here on, and so are longer ones)
            start = pos - d
            c = children.get(v << _SHIFT | x)
            if c is None:
                c = self._new(v, x, d + 1, new[d], doc, start)
            elif not (count[c] == 1 and occ_start[c] == start and occ_doc[c] == doc):
                if count[c] == 1:
                    self._materialise(c)  # its second occurrence: the first one's next node must exist now
                count[c] += 1
                occ_doc[c], occ_start[c] = doc, start
                total[v] += 1
                b = best[v]
                if b < 0 or count[c] >= count[b]:
                    best[v] = c
            # else: c was materialised for this very occurrence a moment ago (counted already)
            new.append(c)
        return new

    def _new(self, parent: int, token: int, depth: int, link: int, doc: int, start: int) -> int:
        count, total, best = self.count, self.total, self.best
        if self._free:
            node = self._free.pop()
            count[node], self.dep[node], self.tok[node], self.link[node] = 1, depth, token, link
            total[node], best[node] = 0, -1
            self.occ_doc[node], self.occ_start[node] = doc, start
        else:
            node = len(count)
            count.append(1)
            self.dep.append(depth)
            self.tok.append(token)
            self.link.append(link)
            total.append(0)
            best.append(-1)
            self.occ_doc.append(doc)
            self.occ_start.append(start)
        self.children[parent << _SHIFT | token] = node
        total[parent] += 1
        b = best[parent]
        if b < 0 or count[b] <= 1:
            best[parent] = node  # ties go to the newest
        return node

    def _materialise(self, node: int) -> None:
        """Make explicit the child of unique ``node`` on its one occurrence's path (if it has one)."""
        length = self.dep[node]
        doc, start = self.occ_doc[node], self.occ_start[node]
        if length >= self.depth or start + length >= self.doc_len[doc]:
            return
        y = self.docs[doc][start + length]
        link = self.children[self.link[node] << _SHIFT | y]
        self._new(node, y, length + 1, link, doc, start)

    def build(self, doc: int, first: int, end: int, max_nodes: int) -> list[int] | None:
        """Index the doc's tokens ``[first, end)`` into this empty trie at once and return the frontier: the
        nodes ``extend`` would make token by token, found level by level with numpy (a long prompt indexes
        about 10x faster); None, the trie left empty, if that takes more than ``max_nodes`` nodes."""
        assert not self.children, "build() fills an empty trie"
        tokens = np.frombuffer(self.docs[doc], dtype=np.int32)[first:end].astype(np.int64)
        n = tokens.shape[0]
        active = np.arange(n)  # starts whose string so far is explicit with count >= 2 (the root's, at first)
        parent = np.zeros(n, dtype=np.int64)  # that string's node, per active start
        node_at = np.zeros(n, dtype=np.int64)  # start -> node of its string of the previous level
        levels = []
        next_id = 1
        for length in range(1, self.depth + 1):
            keep = active + length <= n
            active, parent = active[keep], parent[keep]
            if not active.shape[0]:
                break
            keys = parent << _SHIFT | tokens[active + length - 1]
            uniq, first_of, inverse, counts = np.unique(keys, return_index=True, return_inverse=True,
                                                        return_counts=True)
            inverse = inverse.reshape(-1)
            ids = next_id + np.arange(uniq.shape[0])
            newest = np.zeros(uniq.shape[0], dtype=np.int64)
            np.maximum.at(newest, inverse, active)
            link = node_at[active[first_of] + 1] if length > 1 else np.zeros(uniq.shape[0], dtype=np.int64)
            levels.append((uniq, ids, counts, newest, link, length))
            next_id += uniq.shape[0]
            if next_id - 1 > max_nodes:
                return None
            node_at = np.full(n + 1, -1, dtype=np.int64)
            node_at[active] = ids[inverse]
            internal = counts[inverse] >= 2
            active, parent = active[internal], ids[inverse][internal]
        self.doc_len[doc] = end
        if not levels:
            return [ROOT]
        self._fill(levels, doc, first, next_id)
        return self.frontier(doc, first, end)

    def _fill(self, levels: list[tuple], doc: int, first: int, size: int) -> None:
        """The trie's columns from build()'s levels (per level: keys, node ids, counts, newest start, suffix link,
        depth), ``size`` nodes with the root."""
        keys = np.concatenate([level[0] for level in levels])
        ids = np.concatenate([level[1] for level in levels])
        counts = np.concatenate([level[2] for level in levels])
        newest = np.concatenate([level[3] for level in levels])
        parents = keys >> _SHIFT
        total = np.bincount(parents, weights=counts, minlength=size).astype(np.int64)
        best = np.full(size, -1, dtype=np.int64)
        order = np.lexsort((newest, counts, parents))  # per parent, its best child (ties: newest) sorts last
        last = np.r_[parents[order][1:] != parents[order][:-1], True]
        best[parents[order][last]] = ids[order][last]

        def column(root: int, values: np.ndarray) -> array:
            return array("i", np.concatenate(([root], values)).astype(np.int32).tobytes())

        self.count = column(_ROOT_COUNT, counts)
        self.dep = column(0, np.concatenate([np.full(level[0].shape[0], level[5]) for level in levels]))
        self.tok = column(-1, keys & ((1 << _SHIFT) - 1))
        self.link = column(ROOT, np.concatenate([level[4] for level in levels]))
        self.total = array("i", total.astype(np.int32).tobytes())
        self.best = array("i", best.astype(np.int32).tobytes())
        self.occ_doc = column(-1, np.full(ids.shape[0], doc))
        self.occ_start = column(-1, newest + first)
        self.children = dict(zip(keys.tolist(), ids.tolist()))

    # ---- removal ------------------------------------------------------------------------------------------

    def remove(self, doc: int, start: int) -> None:
        """Forget the occurrences starting at ``docs[doc][start]`` (callers go oldest first)."""
        tokens, children, count, total = self.docs[doc], self.children, self.count, self.total
        v = ROOT
        for p in range(start, min(start + self.depth, self.doc_len[doc])):
            key = v << _SHIFT | tokens[p]
            c = children.get(key)
            if c is None:
                return
            total[v] -= 1
            if count[c] == 1:  # this occurrence was its only one
                self._drop(v, key, c)
                return
            count[c] -= 1
            if count[c] == 1:  # unique now: nothing below it may stay explicit
                self._prune_below(c, ((doc, start), (self.occ_doc[c], self.occ_start[c])))
                return
            v = c

    def _drop(self, parent: int, key: int, node: int) -> None:
        del self.children[key]
        self.count[node] = 0
        self._free.append(node)
        if self.best[parent] == node:
            self.best[parent] = -1

    def _prune_below(self, node: int, occurrences: tuple[tuple[int, int], ...]) -> None:
        """Drop every explicit node below ``node``: they lie on the paths of ``occurrences`` (its last two)."""
        doomed = []
        for doc, start in occurrences:
            tokens, end = self.docs[doc], min(start + self.depth, self.doc_len[doc])
            v, p = node, start + self.dep[node]
            while p < end:
                key = v << _SHIFT | tokens[p]
                c = self.children.get(key)
                if c is None:
                    break
                doomed.append((v, key, c))
                v, p = c, p + 1
        for parent, key, c in doomed:
            if key in self.children:  # the two paths may share nodes
                self._drop(parent, key, c)
        self.total[node], self.best[node] = 0, -1

    # ---- matching -----------------------------------------------------------------------------------------

    def frontier(self, doc: int, first: int, end: int) -> list[int]:
        """The frontier of the doc's tokens ``[first, end)`` built from scratch (after removals)."""
        tokens, children, count = self.docs[doc], self.children, self.count
        result = [ROOT]
        for d in range(1, min(self.depth, end - first) + 1):
            v = ROOT
            for p in range(end - d, end):
                if count[v] < 2:
                    return result  # the suffix passes a unique node: implicit, and so are longer ones
                v = children[v << _SHIFT | tokens[p]]
            result.append(v)
        return result

    def advance(self, node: int, extra: int, length: int, x: int) -> tuple[int, int, int]:
        """The longest match after the context grows by ``x``, given the match before it.

        A match is (node, extra, length): the string of ``node`` followed by ``extra`` implicit tokens of its
        one occurrence (``extra`` > 0 only below a unique node), ``length`` tokens in all (<= depth). Amortised
        O(1) per token: the match only shortens through suffix links."""
        count, children = self.count, self.children
        while True:
            if length < self.depth:
                if count[node] == 1:
                    doc = self.occ_doc[node]
                    p = self.occ_start[node] + length
                    if p < self.doc_len[doc] and self.docs[doc][p] == x:
                        return node, extra + 1, length + 1
                else:
                    c = children.get(node << _SHIFT | x)
                    if c is not None:
                        return c, 0, length + 1
            if node == ROOT:
                return ROOT, 0, 0
            node, extra, length = self.shorten(node, extra, length)

    def shorten(self, node: int, extra: int, length: int) -> tuple[int, int, int]:
        """The match without its first token."""
        if not extra:
            return self.link[node], 0, length - 1
        tokens = self.docs[self.occ_doc[node]]
        p = self.occ_start[node] + self.dep[node]  # the first implicit token
        v = self.link[node]
        while extra and self.count[v] >= 2:  # walk the implicit tokens down to a unique node or their end
            v = self.children[v << _SHIFT | tokens[p]]
            p += 1
            extra -= 1
        return v, extra, length - 1

    def draft(self, node: int, extra: int, length: int, budget: int, min_prob: float) -> tuple[list[int], float]:
        """Up to ``budget`` tokens continuing the match, and their score (the sum of their probabilities).

        Each step takes the most frequent continuation while the product of the steps' frequencies (the
        estimated probability that the whole draft so far is right) stays >= ``min_prob``; below a unique
        node the one occurrence's own tokens follow (probability unchanged); at full depth the match drops
        its first token to go on."""
        count, total, best, tok = self.count, self.total, self.best, self.tok
        out: list[int] = []
        prob, score = 1.0, 0.0
        while len(out) < budget:
            if count[node] == 1:
                doc = self.occ_doc[node]
                p = self.occ_start[node] + length
                if p >= self.doc_len[doc]:
                    break
                out.append(self.docs[doc][p])
                length += 1
            elif length >= self.depth:
                node, length = self.link[node], length - 1
                continue
            else:
                b = best[node]
                if b < 0 or not total[node]:
                    break
                prob *= count[b] / total[node]
                if prob < min_prob:
                    break
                out.append(tok[b])
                node, length = b, length + 1
            score += prob
        return out, score


@dataclass
class _Request:
    """A request's own trie (one doc, id 0: its tokens) and its match in the global trie."""

    trie: _Trie
    tokens: array = field(default_factory=lambda: array("i"))
    frontier: list[int] = field(default_factory=lambda: [ROOT])
    first: int = 0
    """The oldest start still indexed (a long request keeps a window of its tokens)."""
    match: tuple[int, int, int] = (ROOT, 0, 0)
    """(node, extra, length) in the global trie after ``matched`` tokens, as of ``epoch``."""
    matched: int = 0
    epoch: int = -1


class SuffixProposer:
    """Suffix decoding: drafts continue the context's longest suffix found in the request or earlier responses.

    Each call matches the end of the request's tokens (at most ``max_tree_depth`` of them) in (a) the
    request's own trie (its prompt and output) and (b) the global trie of earlier responses, drafts from
    each, and keeps the draft with the higher score (the sum of the draft tokens' estimated probabilities: the
    expected number accepted; a tie goes to the request's own). A match of m tokens drafts at most
    ``floor(max_spec_factor * m)`` tokens (and at most ``num_tokens``), each the most frequent continuation
    seen, while the draft's estimated probability (the product of each step's frequency among the
    continuations seen) stays >= ``min_token_prob``. When the longest match drafts nothing, shorter ones are
    tried.

    Bounds (memory, about 130 bytes a node): a request indexes its newest ``max_request_tokens`` tokens in at
    most ``MAX_NODES_PER_TOKEN * max_request_tokens`` nodes; the global trie keeps the newest
    ``max_cached_requests`` responses, at most ``max_cached_tokens`` tokens and
    ``MAX_NODES_PER_TOKEN * max_cached_tokens`` nodes in all. The oldest tokens (responses) leave first.

    Cost: O(nodes on the frontier) <= O(max_tree_depth) per token added since the last call, O(1) amortised
    per token for the global match (O(max_tree_depth) once after each change of the global trie), and
    O(max_tree_depth + num_tokens) to draft; a new request's tokens are indexed at once with numpy.
    ``finish`` indexes the response and removes evicted ones, O(max_tree_depth) a token at worst. Measured on
    this machine's (shared, 2-core) CPU; tests/spec_decode prints them: a decode step 4-6 us median (p99
    ~15 us) on 4,000 tokens of text, 13-15 us on repetitive text, ~7 us matching against 200,000 cached tokens;
    the first call 3-7 ms on a 4,000-token prompt, ~25 ms on a full 16,384-token window; ``finish`` 5-8 us per
    response token, eviction included.
    """

    def __init__(self, *, max_tree_depth: int = 24, max_cached_requests: int = 10000,
                 max_spec_factor: float = 1.0, min_token_prob: float = 0.1, max_cached_tokens: int = 200_000,
                 max_request_tokens: int = 16_384) -> None:
        if max_tree_depth < 1 or max_cached_requests < 0 or max_cached_tokens < 0 or max_spec_factor < 0:
            raise ValueError("need max_tree_depth >= 1 and max_cached_requests, max_cached_tokens, "
                             "max_spec_factor >= 0")
        if not 0.0 <= min_token_prob <= 1.0:
            raise ValueError(f"min_token_prob must be in [0, 1], got {min_token_prob}")
        self.max_tree_depth = max_tree_depth
        """The longest suffix matched, and the depth of the tries (vLLM's suffix_decoding_max_tree_depth)."""
        self.max_cached_requests = max_cached_requests
        """Responses kept in the global trie; 0: none (only the request's own tokens are matched)."""
        self.max_spec_factor = max_spec_factor
        """At most this many draft tokens per matched token."""
        self.min_token_prob = min_token_prob
        """A draft goes on only while its estimated probability is at least this."""
        self.max_cached_tokens = max_cached_tokens
        """Response tokens kept in the global trie (a longer response keeps its end)."""
        self.max_request_tokens = max(max_request_tokens, 4 * max_tree_depth)
        """A request's newest tokens indexed in its own trie (at least 4 * max_tree_depth)."""
        self.cache = _Trie(max_tree_depth)
        """The global trie: one doc per cached response, ids in arrival order."""
        self.cached_tokens = 0
        self._next_doc = 0
        self._epoch = 0
        """Bumped on every change of the global trie (a request's match there is then found again)."""
        self._requests: dict[str, _Request] = {}

    # ---- the interface ------------------------------------------------------------------------------------

    def propose(self, req_id: str, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to ``num_tokens`` draft tokens to follow ``token_ids`` (the request's prompt and output so far;
        it only grows between calls for one ``req_id``); [] when nothing matches well enough."""
        if num_tokens <= 0 or len(token_ids) == 0:
            return []
        request = self._sync(req_id, token_ids)
        local = self._draft_local(request, num_tokens)
        cached = self._draft_cached(request, num_tokens)
        return (cached if cached[1] > local[1] else local)[0]

    def finish(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """The request ended: its own trie goes, and its response joins the global cache (oldest ones leave)."""
        self._requests.pop(req_id, None)
        response = token_ids[num_prompt_tokens:]
        if len(response) == 0 or not self.max_cached_requests or not self.max_cached_tokens:
            return
        if len(response) > self.max_cached_tokens:
            response = response[-self.max_cached_tokens:]
        self._cache_response(response)
        node_cap = MAX_NODES_PER_TOKEN * self.max_cached_tokens
        while self.cache.docs and (len(self.cache.docs) > self.max_cached_requests
                                   or self.cached_tokens > self.max_cached_tokens or self.cache.num_nodes > node_cap):
            self._evict_oldest()
        self._epoch += 1

    # ---- internals ----------------------------------------------------------------------------------------

    def _sync(self, req_id: str, token_ids: Sequence[int]) -> _Request:
        """The request's state with ``token_ids`` indexed (only the new tokens are added)."""
        request = self._requests.pop(req_id, None)  # re-inserted below: the dict is in least-recent-use order
        n = len(token_ids)
        if request is not None:
            size = len(request.tokens)
            if n < size or (size and token_ids[size - 1] != request.tokens[size - 1]):
                request = None  # not a continuation of what we hold (a cheap check of the last token)
        if request is None:
            if len(self._requests) >= MAX_REQUEST_STATES:
                del self._requests[next(iter(self._requests))]
            request = _Request(_Trie(self.max_tree_depth))
            request.trie.docs[0] = request.tokens
            request.first = max(0, n - self.max_request_tokens)  # a long prompt: only its window
            request.tokens.extend(array("i", [0]) * request.first)  # positions stay absolute; never read
            request.tokens.extend(token_ids[request.first:])
            node_cap = MAX_NODES_PER_TOKEN * self.max_request_tokens
            frontier = request.trie.build(0, request.first, n, node_cap)
            while frontier is None:  # a passage repeated in the prompt: index less of it (halving is cheap)
                shortest = 4 * self.max_tree_depth
                request.first = n - max((n - request.first) // 2, shortest)
                frontier = request.trie.build(0, request.first, n,
                                              node_cap if n - request.first > shortest else _ROOT_COUNT)
            request.frontier = frontier
        else:
            start = len(request.tokens)
            request.tokens.extend(token_ids[start:])
            frontier = request.frontier
            for pos in range(start, n):
                frontier = request.trie.extend(0, frontier, pos)
            request.frontier = frontier
        self._requests[req_id] = request
        if n - request.first > self.max_request_tokens or \
                request.trie.num_nodes > MAX_NODES_PER_TOKEN * self.max_request_tokens:
            self._slide(request, n)
        return request

    def _slide(self, request: _Request, n: int) -> None:
        """Drop the request's oldest starts to 1/64 below its caps (in steps: each rebuilds the frontier)."""
        trie, start = request.trie, request.first
        keep = self.max_request_tokens - max(1, self.max_request_tokens // 64)
        node_cap = MAX_NODES_PER_TOKEN * keep
        stop = n - self.max_tree_depth - 1  # the frontier's starts stay
        while start < stop and (n - start > keep or trie.num_nodes > node_cap):
            trie.remove(0, start)
            start += 1
        request.first = start
        request.frontier = trie.frontier(0, start, n)

    def _cache_response(self, response: Sequence[int]) -> None:
        """Add a finished response to the global trie as its newest document."""
        doc = self._next_doc
        self._next_doc = (doc + 1) % _ROOT_COUNT  # ids fit the int32 columns; live ones are far fewer
        self.cache.docs[doc] = array("i", response)
        self.cache.doc_len[doc] = 0
        frontier = [ROOT]
        for pos in range(len(response)):
            frontier = self.cache.extend(doc, frontier, pos)
        self.cached_tokens += len(response)

    def _evict_oldest(self) -> None:
        doc = next(iter(self.cache.docs))
        size = self.cache.doc_len[doc]
        for start in range(size):
            self.cache.remove(doc, start)
        del self.cache.docs[doc], self.cache.doc_len[doc]
        self.cached_tokens -= size

    def _budget(self, match_length: int, num_tokens: int) -> int:
        return min(num_tokens, math.floor(self.max_spec_factor * match_length + 1e-9))

    def _draft_local(self, request: _Request, num_tokens: int) -> tuple[list[int], float]:
        """The draft from the request's own tokens: the longest suffix seen before (count >= 2: then and now)."""
        trie, frontier = request.trie, request.frontier
        for length in range(len(frontier) - 1, 0, -1):
            node = frontier[length]
            if trie.count[node] < 2:
                continue
            budget = self._budget(length, num_tokens)
            if budget <= 0:
                break
            draft = trie.draft(node, 0, length, budget, self.min_token_prob)
            if draft[0]:
                return draft
        return [], 0.0

    def _draft_cached(self, request: _Request, num_tokens: int) -> tuple[list[int], float]:
        """The draft from earlier responses: the context's longest suffix in the global trie."""
        if not self.cache.docs:
            return [], 0.0
        tokens, n = request.tokens, len(request.tokens)
        if request.epoch != self._epoch or n - request.matched > self.max_tree_depth:
            request.match, request.matched = (ROOT, 0, 0), max(request.first, n - self.max_tree_depth)
            request.epoch = self._epoch
        node, extra, length = request.match
        for pos in range(request.matched, n):
            node, extra, length = self.cache.advance(node, extra, length, tokens[pos])
        request.match, request.matched = (node, extra, length), n
        while length > 0:
            budget = self._budget(length, num_tokens)
            if budget <= 0:
                break
            draft = self.cache.draft(node, extra, length, budget, self.min_token_prob)
            if draft[0]:
                return draft
            node, extra, length = self.cache.shorten(node, extra, length)
        return [], 0.0
