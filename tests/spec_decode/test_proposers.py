"""The token-lookup proposers: prompt lookup (ngram) and suffix decoding, against hand-made cases and brute force."""
from __future__ import annotations

import random
import time
from array import array
from collections import Counter

import numpy as np
import pytest

from pagedllm.spec_decode.ngram import NgramProposer
from pagedllm.spec_decode.suffix import _SHIFT, MAX_NODES_PER_TOKEN, ROOT, SuffixProposer, _Trie

# ---- ngram ----------------------------------------------------------------------------------------------------


def test_ngram_proposes_the_continuation_of_a_repeated_passage() -> None:
    passage = [11, 12, 13, 14, 15, 16, 17, 18]
    tokens = [1, 2, *passage, 3, 4, *passage[:3]]
    assert NgramProposer(2, 3).propose("r", tokens, 4) == [14, 15, 16, 17]


def test_ngram_respects_min_and_max_n() -> None:
    #          the 2-gram (7, 8) first at 1..2; the 3-gram (6, 7, 8) only at 5..7
    tokens = [9, 7, 8, 1, 6, 7, 8, 2, 3, 6, 7, 8]
    assert NgramProposer(1, 3).propose("r", tokens, 2) == [2, 3]  # the longest n (3) wins
    assert NgramProposer(1, 2).propose("r", tokens, 2) == [1, 6]  # capped at 2: the earliest (7, 8)
    assert NgramProposer(4, 5).propose("r", tokens, 2) == []  # no 4-gram repeats
    assert NgramProposer(3, 3).propose("r", [5, 7, 8, 1, 7, 8], 2) == []  # only a 2-gram repeats


def test_ngram_takes_the_earliest_occurrence() -> None:
    tokens = [4, 5, 1, 4, 5, 2, 4, 5, 3, 4, 5]
    assert NgramProposer(2, 2).propose("r", tokens, 1) == [1]


def test_ngram_empty_without_a_match_and_never_more_than_asked() -> None:
    proposer = NgramProposer(1, 4)
    assert proposer.propose("a", [1, 2, 3, 4, 5], 3) == []
    assert proposer.propose("b", [7], 3) == []
    assert proposer.propose("c", [1, 2, 1, 2], 0) == []
    tokens = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    for k in range(1, 9):
        draft = proposer.propose(f"d{k}", tokens, k)
        assert draft == [3, 4, 5, 6, 7, 1, 2][:k]
    assert proposer.propose("e", [1, 2, 3, 1, 2], 5) == [3, 1, 2]  # the context ends first


def test_ngram_state_follows_growth_resets_on_another_sequence_and_goes_on_finish() -> None:
    rng = random.Random(5)
    proposer = NgramProposer(1, 3)
    tokens: list[int] = []
    for _ in range(300):
        tokens.append(rng.randrange(6))
        assert proposer.propose("r", tokens, 3) == NgramProposer(1, 3).propose("x", tokens, 3)
    other = [1, 2, 3, 9, 1, 2]
    assert proposer.propose("r", other, 2) == [3, 9]  # not a continuation: rebuilt, not appended to
    proposer.finish("r", other, 2)
    assert "r" not in proposer._tokens
    with pytest.raises(ValueError):
        NgramProposer(3, 2)


def _ngram_reference(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """Brute force: the longest n first, then the leftmost earlier occurrence (ending before the last token)."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_matches_brute_force_on_random_tokens() -> None:
    rng = random.Random(0)
    for _trial in range(400):
        min_n = rng.randint(1, 4)
        max_n = rng.randint(min_n, 6)
        k = rng.randint(1, 6)
        vocab = rng.randint(2, 5)
        proposer = NgramProposer(min_n, max_n)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
        for _ in range(rng.randint(1, 40)):
            assert proposer.propose("r", tokens, k) == _ngram_reference(tokens, min_n, max_n, k), (tokens, min_n,
                                                                                                      max_n, k)
            tokens.append(rng.randrange(vocab))


def test_ngram_timing() -> None:
    rng = np.random.default_rng(0)
    for context, vocab in ((4000, 32000), (4000, 50), (32000, 32000)):
        tokens = rng.integers(0, vocab, context).tolist()
        proposer = NgramProposer(2, 5)
        proposer.propose("r", tokens, 5)
        elapsed = 0.0
        for token in rng.integers(0, vocab, 1000).tolist():
            tokens.append(token)
            start = time.perf_counter()
            proposer.propose("r", tokens, 5)
            elapsed += time.perf_counter() - start
        print(f"ngram: {elapsed / 1000 * 1e6:.1f} us per call at {context} tokens, vocab {vocab}")


# ---- suffix: the trie against brute force ------------------------------------------------------------------


def _check_trie(trie: _Trie, alive: dict[int, tuple[int, int]], exact_best: bool = True) -> None:
    """The trie holds exactly the explicit strings of its docs' occurrences (``alive``: doc -> [first, end)),
    with their counts, links, continuation totals, newest occurrences (unique nodes) and best children."""
    counts: Counter[tuple[int, ...]] = Counter()
    newest: dict[tuple[int, ...], tuple[int, int]] = {}
    for doc, (first, end) in sorted(alive.items()):
        tokens = list(trie.docs[doc])
        for start in range(first, end):
            for length in range(1, min(trie.depth, end - start) + 1):
                string = tuple(tokens[start:start + length])
                counts[string] += 1
                newest[string] = max(newest.get(string, (-1, -1)), (doc, start))
    expected = {s for s, c in counts.items() if c >= 2 or (len(s) == 1 or counts[s[:-1]] >= 2)}
    kids: dict[int, list[int]] = {}
    for key, child in trie.children.items():
        kids.setdefault(key >> _SHIFT, []).append(child)
    strings, stack = {ROOT: ()}, [ROOT]
    while stack:
        node = stack.pop()
        for child in kids.get(node, []):
            assert child not in strings
            strings[child] = strings[node] + (trie.tok[child],)
            stack.append(child)
    assert len(strings) == len(trie.children) + 1
    assert set(strings.values()) - {()} == expected
    node_of = {s: node for node, s in strings.items()}
    for node, string in strings.items():
        children = kids.get(node, [])
        assert trie.total[node] == sum(trie.count[c] for c in children)
        if node == ROOT:
            continue
        assert trie.count[node] == counts[string] and trie.dep[node] == len(string)
        assert trie.link[node] == node_of[string[1:]]
        if trie.count[node] == 1:
            assert not children and (trie.occ_doc[node], trie.occ_start[node]) == newest[string]
        if children and exact_best:
            assert trie.count[trie.best[node]] == max(trie.count[c] for c in children)


def test_trie_matches_brute_force_through_growth_builds_and_removals() -> None:
    rng = random.Random(1)
    for _trial in range(600):
        depth, vocab = rng.randint(1, 6), rng.randint(1, 4)
        trie, alive, frontiers = _Trie(depth), {}, {}
        for doc in range(rng.randint(1, 4)):
            tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
            if rng.random() < 0.3:
                tokens = tokens[:len(tokens) // 3] * 3  # a repeated passage: many nodes
            trie.docs[doc] = array("i", tokens)
            if doc == 0 and rng.random() < 0.5:
                first = rng.randint(0, len(tokens) // 3)
                if first < len(tokens):  # over its node budget, build() leaves the trie as it was
                    assert trie.build(doc, first, len(tokens), 0) is None and not trie.children
                frontiers[doc] = trie.build(doc, first, len(tokens), 10**9)
            else:
                first, frontier = 0, [ROOT]
                trie.doc_len[doc] = 0
                for pos in range(len(tokens)):
                    frontier = trie.extend(doc, frontier, pos)
                frontiers[doc] = frontier
            alive[doc] = (first, len(tokens))
            assert frontiers[doc] == trie.frontier(doc, first, len(tokens))
            _check_trie(trie, alive)
        for doc in sorted(alive)[:rng.randint(0, len(alive))]:  # oldest first, one start at a time
            first, end = alive[doc]
            for start in range(first, end):
                trie.remove(doc, start)
                alive[doc] = (start + 1, end)
                if rng.random() < 0.2:
                    _check_trie(trie, alive, exact_best=False)
            del alive[doc]
        _check_trie(trie, alive, exact_best=False)


def test_trie_window_slides_within_one_growing_doc() -> None:
    rng = random.Random(2)
    for _trial in range(300):
        depth, vocab = rng.randint(1, 6), rng.randint(1, 4)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 60))]
        trie = _Trie(depth)
        trie.docs[0] = array("i", tokens)
        trie.doc_len[0] = 0
        frontier, first = [ROOT], 0
        for pos in range(len(tokens)):
            frontier = trie.extend(0, frontier, pos)
            if rng.random() < 0.15 and pos - depth > first:
                upto = rng.randint(first + 1, pos - depth)
                for start in range(first, upto):
                    trie.remove(0, start)
                first = upto
                frontier = trie.frontier(0, first, pos + 1)
            assert frontier == trie.frontier(0, first, pos + 1)
        _check_trie(trie, {0: (first, len(tokens))}, exact_best=False)


def test_trie_match_is_the_longest_suffix_seen() -> None:
    rng = random.Random(3)
    for _trial in range(300):
        depth, vocab = rng.randint(1, 6), rng.randint(1, 4)
        trie, seen = _Trie(depth), set()
        for doc in range(rng.randint(1, 3)):
            tokens = [rng.randrange(vocab) for _ in range(rng.randint(0, 20))]
            trie.docs[doc], trie.doc_len[doc], frontier = array("i", tokens), 0, [ROOT]
            for pos in range(len(tokens)):
                frontier = trie.extend(doc, frontier, pos)
            seen |= {tuple(tokens[i:j]) for i in range(len(tokens)) for j in range(i + 1, len(tokens) + 1)}
        match, context = (ROOT, 0, 0), []
        for _ in range(30):
            context.append(rng.randrange(vocab))
            match = trie.advance(*match, context[-1])
            want = max(n for n in range(min(depth, len(context)) + 1) if n == 0 or tuple(context[-n:]) in seen)
            node, extra, length = match
            assert length == want and trie.dep[node] + extra == length


# ---- suffix: the proposer ------------------------------------------------------------------------------------


def test_suffix_proposes_from_the_request_own_text() -> None:
    passage = list(range(100, 120))
    prompt = [1, 2, 3, *passage, 4, 5]
    proposer = SuffixProposer()
    assert proposer.propose("r", [*prompt, *passage[:6]], 4) == passage[6:10]
    assert proposer.propose("r", [*prompt, *passage[:7]], 4) == passage[7:11]  # grown by one token
    assert proposer.propose("s", [1, 2, 3, 4, 5, 6], 4) == []  # nothing repeats


def test_suffix_proposes_from_an_earlier_response() -> None:
    response = list(range(200, 230))
    proposer = SuffixProposer()
    proposer.finish("a", [1, 2, 3, *response], 3)
    assert proposer.propose("b", [7, 8, 9, *response[:10]], 5) == response[10:15]
    off = SuffixProposer(max_cached_requests=0)
    off.finish("a", [1, 2, 3, *response], 3)
    assert off.propose("b", [7, 8, 9, *response[:10]], 5) == []
    assert proposer.propose("c", [7, 8, 9, 1, 2, 3], 5) == []  # the prompt of "a" is not cached


def test_suffix_draft_length_grows_with_the_match() -> None:
    response = list(range(300, 360))
    proposer = SuffixProposer()
    proposer.finish("a", [1, *response], 1)
    for matched in (1, 2, 3, 5, 8, 12):
        draft = proposer.propose(f"m{matched}", [7, 8, *response[:matched]], 10)
        assert draft == response[matched:matched + min(10, matched)]
    half = SuffixProposer(max_spec_factor=0.5)
    half.finish("a", [1, *response], 1)
    assert half.propose("m", [7, 8, *response[:1]], 10) == []  # floor(0.5 * 1) = 0
    assert half.propose("n", [7, 8, *response[:6]], 10) == response[6:9]


def test_suffix_min_token_prob_cuts_an_ambiguous_continuation() -> None:
    def proposer_with(min_token_prob: float) -> SuffixProposer:
        proposer = SuffixProposer(min_token_prob=min_token_prob)
        for i in range(5):  # (40, 41) was followed by five different tokens
            proposer.finish(f"a{i}", [1, 40, 41, 50 + i, 60 + i, 70 + i], 1)
        return proposer

    assert proposer_with(0.1).propose("b", [9, 40, 41], 2) == [54, 64]  # p = 1/5 (ties: the newest)
    assert proposer_with(0.3).propose("b", [9, 40, 41], 2) == []
    # a two-step draft stops where the product of the steps' frequencies falls below the bar
    proposer = SuffixProposer(min_token_prob=0.3)
    for tail in ([50, 60], [50, 61], [51, 62], [51, 63]):
        proposer.finish(str(tail), [1, 40, 41, *tail], 1)
    assert proposer.propose("b", [9, 40, 41], 2) == [51]  # 1/2, then 1/2 * 1/2 < 0.3


def test_suffix_eviction_keeps_the_cache_within_its_caps() -> None:
    rng = random.Random(4)
    proposer = SuffixProposer(max_cached_requests=3, max_cached_tokens=100, max_tree_depth=8)
    responses = []
    for i in range(40):
        response = [rng.randrange(20) for _ in range(rng.randint(1, 60))]
        responses.append(response)
        proposer.finish(f"r{i}", [0, *response], 1)
        assert len(proposer.cache.docs) <= 3 and proposer.cached_tokens <= 100
        assert proposer.cached_tokens == sum(proposer.cache.doc_len.values())
        assert proposer.cache.num_nodes <= MAX_NODES_PER_TOKEN * 100
    kept = {doc: (0, proposer.cache.doc_len[doc]) for doc in proposer.cache.docs}
    _check_trie(proposer.cache, kept, exact_best=False)
    # nothing leaks: the same responses indexed from scratch make the same number of nodes
    fresh = SuffixProposer(max_tree_depth=8)
    for doc in proposer.cache.docs:
        fresh.finish("x", [0, *proposer.cache.docs[doc]], 1)
    assert fresh.cache.num_nodes == proposer.cache.num_nodes
    # an evicted response is no longer proposed
    proposer = SuffixProposer(max_cached_requests=1)
    proposer.finish("a", [0, 100, 101, 102, 103], 1)
    proposer.finish("b", [0, 200, 201, 202, 203], 1)
    assert proposer.propose("c", [5, 100, 101], 2) == []
    assert proposer.propose("d", [5, 200, 201], 2) == [202, 203]


def test_suffix_request_window_and_node_cap() -> None:
    rng = random.Random(6)
    proposer = SuffixProposer(max_tree_depth=8, max_request_tokens=64)
    tokens = [rng.randrange(6) for _ in range(200)]  # a long prompt: only its newest 64 tokens are indexed
    proposer.propose("r", tokens, 4)
    for _ in range(300):
        tokens.append(rng.randrange(6))
        proposer.propose("r", tokens, 4)
        request = proposer._requests["r"]
        assert len(tokens) - request.first <= 64
        assert request.trie.num_nodes <= MAX_NODES_PER_TOKEN * 64
    _check_trie(request.trie, {0: (request.first, len(tokens))}, exact_best=False)
    passage = list(range(100, 140))  # a repeat well inside the window is still found
    tokens += passage + [1, 2] + passage[:5]
    assert proposer.propose("r", tokens, 4) == passage[5:9]
    # a prompt repeating a passage (up to max_tree_depth nodes per token) indexes less of itself
    proposer = SuffixProposer(max_tree_depth=16, max_request_tokens=512)
    passage = [rng.randrange(1000) for _ in range(300)]
    proposer.propose("r", passage * 2, 4)
    request = proposer._requests["r"]
    assert 4 * 16 <= 600 - request.first < 512
    assert request.trie.num_nodes <= MAX_NODES_PER_TOKEN * 512
    _check_trie(request.trie, {0: (request.first, 600)}, exact_best=True)


def test_suffix_finish_drops_the_request_state() -> None:
    proposer = SuffixProposer()
    tokens = [1, 2, 3, 4, 1, 2]
    assert proposer.propose("r", tokens, 2) == [3, 4]
    assert "r" in proposer._requests
    proposer.finish("r", tokens, 4)
    assert "r" not in proposer._requests
    assert proposer.cached_tokens == 2
    with pytest.raises(ValueError):
        SuffixProposer(min_token_prob=2.0)


def test_suffix_first_token_is_a_most_frequent_continuation() -> None:
    """Brute force on the request's own tokens: the draft starts with a most frequent continuation of the
    context's longest suffix seen before (depth large enough never to cap, no probability bar)."""
    rng = random.Random(7)
    for _trial in range(200):
        vocab = rng.randint(2, 4)
        proposer = SuffixProposer(max_tree_depth=64, min_token_prob=0.0, max_cached_requests=0)
        tokens = [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
        for _ in range(40):
            draft = proposer.propose("r", tokens, 3)
            n = len(tokens)
            longest = max((m for m in range(1, n) if any(tokens[s:s + m] == tokens[n - m:]
                                                            for s in range(n - m))), default=0)
            if not longest:
                assert draft == []
            else:
                follow = Counter(tokens[s + longest] for s in range(n - longest)
                                 if tokens[s:s + longest] == tokens[n - longest:])
                assert draft and follow[draft[0]] == max(follow.values()), (tokens, draft, follow)
                assert len(draft) <= min(3, longest)
            tokens.append(rng.randrange(vocab))


def test_suffix_timing() -> None:
    rng = np.random.default_rng(0)

    def text(n: int) -> list[int]:  # Zipf-like tokens with recurring phrases
        phrases = [rng.zipf(1.2, rng.integers(3, 12)).clip(1, 31999).tolist() for _ in range(300)]
        tokens: list[int] = []
        while len(tokens) < n:
            tokens += phrases[rng.integers(0, 300)] if rng.random() < 0.3 else rng.zipf(1.2, 5).clip(1, 31999).tolist()
        return tokens[:n]

    proposer = SuffixProposer()
    for i in range(100):
        proposer.finish(f"old{i}", text(1000), 0)
    start = time.perf_counter()
    for i in range(20):
        proposer.finish(f"new{i}", text(1000), 0)
    finish_ms = (time.perf_counter() - start) / 20 * 1e3
    for name, tokens, grow in (("text", text(4000), text(1000)), ("repetitive", text(200) * 20, None)):
        start = time.perf_counter()
        proposer.propose(name, tokens, 5)
        first_ms = (time.perf_counter() - start) * 1e3
        times = []
        for i in range(1000):
            tokens.append(grow[i] if grow else tokens[-200])
            start = time.perf_counter()
            proposer.propose(name, tokens, 5)
            times.append(time.perf_counter() - start)
        us = np.array(times) * 1e6
        print(f"suffix {name}: first call {first_ms:.1f} ms, then per call median {np.median(us):.1f} us, "
              f"p99 {np.percentile(us, 99):.1f} us; finish of 1,000 tokens {finish_ms:.1f} ms; "
              f"{proposer.cache.num_nodes / proposer.cached_tokens:.2f} nodes per cached token")
