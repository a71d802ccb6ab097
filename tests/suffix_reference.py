"""Brute-force, pure-Python reference of SuffixCache's semantics (suffix/cache.py docstring), with no tree at all:
every count is recomputed by scanning the raw sequences. Slow by design; used by the property tests."""
from __future__ import annotations

import heapq

KIDS = 64


class RefCorpus:
    """Sequences in insertion order; `starts[i]`: suffixes of sequence i starting before it are evicted."""

    def __init__(self, max_depth: int):
        self.D = max_depth
        self.seqs: list[list[int]] = []
        self.starts: list[int] = []

    def occurrences(self, q: tuple) -> list[tuple[int, int, int]]:
        """(sequence index, start, end) of every live occurrence of q (|q| <= D)."""
        out = []
        n = len(q)
        for i, (s, st) in enumerate(zip(self.seqs, self.starts)):
            for a in range(st, len(s) - n + 1):
                if tuple(s[a:a + n]) == q:
                    out.append((i, a, a + n))
        return out

    def n_tokens(self) -> int:
        return sum(len(s) - st for s, st in zip(self.seqs, self.starts))

    def evict(self, k: int) -> int:
        done = 0
        while done < k and self.seqs:
            take = min(len(self.seqs[0]) - self.starts[0], k - done)
            self.starts[0] += take
            done += take
            if self.starts[0] == len(self.seqs[0]):
                self.seqs.pop(0)
                self.starts.pop(0)
        return done


def _node_end(corpus: RefCorpus, q: tuple) -> bool:
    """Where the compressed tree has a node: max depth, a branch, or an occurrence that ends here."""
    if len(q) >= corpus.D:
        return True
    occ = corpus.occurrences(q)
    nxt = [corpus.seqs[i][e] for i, _, e in occ if e < len(corpus.seqs[i])]
    return len(set(nxt)) != 1 or len(nxt) != len(occ)


def _ranked_children(corpus: RefCorpus, q: tuple) -> tuple[list[tuple[int, int]], int]:
    stats: dict[int, list] = {}
    for i, a, e in corpus.occurrences(q):
        if e < len(corpus.seqs[i]):
            t = corpus.seqs[i][e]
            c = stats.setdefault(t, [0, (-1, -1)])
            c[0] += 1
            c[1] = max(c[1], (i, a))
    total = sum(c[0] for c in stats.values())
    ranked = sorted(stats.items(), key=lambda kv: (-kv[1][0], (-kv[1][1][0], -kv[1][1][1])))
    return [(t, c[0]) for t, c in ranked], total


def _most_recent(corpus: RefCorpus, q: tuple, before_end: int | None = None) -> tuple[int, int] | None:
    occ = [(i, e) for i, _, e in corpus.occurrences(q) if before_end is None or e < before_end]
    return max(occ) if occ else None


def ref_draft(corpus: RefCorpus, q: tuple, start_copy, self_seq: int | None, max_tokens: int, max_nodes: int,
              min_prob: float, branch: bool):
    """Best-first draft from the matched string q. Items: (-prob, order, state, parent, ddepth) where state is
    ("tree", string, forced next token or None) or ("copy", seq index, position)."""
    toks, pars, probs = [], [], []
    score = 0.0
    heap = []
    order = 0
    state = ("copy", start_copy[0], start_copy[1]) if start_copy is not None else ("tree", q, None)
    heapq.heappush(heap, (-1.0, 0, state, -1, 0))

    def path_token(node: int, k: int, node_depth: int) -> int:
        while node_depth > k:
            node = pars[node]
            node_depth -= 1
        return toks[node]

    while heap and len(toks) < max_nodes:
        negp, o, state, parent, dd = heapq.heappop(heap)
        prob = -negp
        if prob < min_prob:
            continue
        if state[0] == "tree" and state[2] is None and _node_end(corpus, state[1]) and len(state[1]) < corpus.D:
            kids, total = _ranked_children(corpus, state[1])
            kids = kids[: (KIDS if branch else 1)]
            for t, c in kids:
                pr = prob * (c / total)
                if pr < min_prob:
                    break
                order += 1
                heapq.heappush(heap, (-pr, order, ("tree", state[1], t), parent, dd))
            continue
        if dd >= max_tokens:
            continue
        if state[0] == "copy":
            _, si, pos = state
            seq = corpus.seqs[si]
            if pos < len(seq):
                tok = seq[pos]
            elif si == self_seq and parent >= 0:
                tok = path_token(parent, pos - len(seq), dd - 1)
            else:
                continue
            nxt = ("copy", si, pos + 1)
        elif state[2] is None and _node_end(corpus, state[1]):
            # at max depth: continue from the most recent occurrence (same heap position)
            si, e = _most_recent(corpus, state[1])
            heapq.heappush(heap, (negp, o, ("copy", si, e), parent, dd))
            continue
        else:
            s = state[1]
            if state[2] is not None:
                tok = state[2]
            else:
                i, a, e = corpus.occurrences(s)[0]
                tok = corpus.seqs[i][e]
            nxt = ("tree", s + (tok,), None)
        k = len(toks)
        toks.append(tok)
        pars.append(parent)
        probs.append(prob)
        score += prob
        order += 1
        heapq.heappush(heap, (negp, order, nxt, k, dd + 1))
    return toks, pars, probs, score


def _cap(m: int, max_tokens: int, factor: float, offset: float) -> int:
    return max(0, min(max_tokens, int(m * factor + offset + 1e-6)))


def _own_draft(ctx: list[int], D: int, max_tokens: int, max_nodes: int, factor: float, offset: float,
               min_prob: float, tree: bool):
    """The draft from the longest suffix of ctx that occurred earlier in it, and the corpus of ctx."""
    own = RefCorpus(D)
    own.seqs, own.starts = [list(ctx)], [0]
    L = len(ctx)
    for m in range(min(D, L), 0, -1):
        q = tuple(ctx[L - m:])
        if len(own.occurrences(q)) >= 2:
            cap = _cap(m, max_tokens, factor, offset)
            start = (0, _most_recent(own, q, before_end=L)[1]) if m == D else None
            t, p, pr, s = ref_draft(own, q, start, 0, cap, max_nodes if tree else cap, min_prob, tree)
            return (t, p, pr, s, m), own
    return None, own


def ref_speculate(ctx: list[int], glob: RefCorpus, D: int, max_tokens: int, max_nodes: int, factor: float,
                  offset: float, min_prob: float, tree: bool, prompt_len: int | None = None):
    """(tokens, parents, probs, score, match_len) as SuffixCache.speculate returns them; ctx[prompt_len:] is the
    request's output (none by default)."""
    L = len(ctx)
    def with_shorter_match(corpus, self_seq, m, draft):
        """Tree mode: the draft joined with the one from the longest shorter suffix that occurs more often."""
        count = len(corpus.occurrences(tuple(ctx[L - m:])))
        for m2 in range(m - 1, 0, -1):
            q = tuple(ctx[L - m2:])
            if len(corpus.occurrences(q)) > count:
                t, p, pr, s = ref_draft(corpus, q, None, self_seq, _cap(m2, max_tokens, factor, offset), max_nodes,
                                        min_prob, True)
                return _merge(draft, (t, p, pr, s, m2), max_nodes) if t else draft
        return draft

    best = ([], [], [], 0.0, 0)
    found, own = _own_draft(ctx, D, max_tokens, max_nodes, factor, offset, min_prob, tree)
    if found is not None:
        best = with_shorter_match(own, 0, found[4], found) if tree else found
    if glob.n_tokens() > 0:
        for m in range(min(D, L), 0, -1):
            q = tuple(ctx[L - m:])
            if glob.occurrences(q):
                cap = _cap(m, max_tokens, factor, offset)
                t, p, pr, s = ref_draft(glob, q, None, None, cap, max_nodes if tree else cap, min_prob, tree)
                other = (t, p, pr, s, m)
                if tree:
                    other = with_shorter_match(glob, None, m, other)
                first, second = (other, best) if other[3] > best[3] else (best, other)
                best = _merge(first, second, max_nodes) if tree and second[0] else first
                break
    if not tree and prompt_len is not None and prompt_len < L:  # chains: also the output alone
        found, _ = _own_draft(ctx[prompt_len:], D, max_tokens, max_nodes, factor, offset, min_prob, False)
        if found is not None and found[3] > best[3]:
            best = found
    t, p, pr, s, m = best
    return t, p, pr, s, (m if t else 0)


def _merge(first, second, max_nodes: int):
    """Union of two draft trees keyed by token path, each path at its higher probability, cut to the max_nodes most
    probable (ties: first's, then the earlier)."""
    def paths(draft):
        toks, pars = draft[0], draft[1]
        out = []
        for i in range(len(toks)):
            out.append((out[pars[i]] if pars[i] >= 0 else ()) + (toks[i],))
        return out

    prob: dict[tuple, float] = {}
    for draft in (first, second):
        for path, pr in zip(paths(draft), draft[2]):
            prob[path] = max(prob.get(path, pr), pr)
    order = sorted(prob, key=lambda path: -prob[path])[:max_nodes]  # stable: dicts keep insertion order
    index = {path: i for i, path in enumerate(order)}
    toks = [path[-1] for path in order]
    pars = [index[path[:-1]] if len(path) > 1 else -1 for path in order]
    probs = [prob[path] for path in order]
    score = 0.0
    for pr in probs:
        score += pr
    return toks, pars, probs, score, first[4]


class RefCache:
    """Mirror of SuffixCache's request life cycle and eviction, on raw token lists."""

    def __init__(self, max_depth, global_budget_tokens, evict_per_call, index_prompts_globally=False, prompt_tail=16):
        self.D = max_depth
        self.tail = prompt_tail
        self.glob = RefCorpus(max_depth)
        self.budget = global_budget_tokens
        self.evict_per_call = evict_per_call
        self.index_prompts = index_prompts_globally
        self.live: dict = {}
        self.retained: dict = {}

    def start_request(self, rid, prompt, extends=None):
        prompt = list(prompt)
        frm = 0
        prev = self.retained.pop(extends, None) if extends is not None else None
        if prev is not None and prompt[: len(prev["ctx"])] == prev["ctx"]:
            frm = len(prev["ctx"])
        self.live[rid] = dict(ctx=prompt, prompt_len=len(prompt), indexed_from=frm)

    def append(self, rid, toks):
        self.live[rid]["ctx"].extend(int(t) for t in toks)
        self._evict(self.evict_per_call // 8)

    def finish_request(self, rid):
        st = self.live.pop(rid)
        new = st["ctx"][st["indexed_from"] if self.index_prompts else max(0, st["prompt_len"] - self.tail):]
        if new:
            self.glob.seqs.append(list(new))
            self.glob.starts.append(0)
            self._evict(self.evict_per_call + len(new))
        self.retained[rid] = st

    def _evict(self, quota):
        over = self.glob.n_tokens() - self.budget
        if over > 0:
            self.glob.evict(min(over, quota))

    def speculate(self, rid, max_tokens, factor=1.0, offset=0.0, min_prob=0.1, tree=False, max_nodes=None):
        return ref_speculate(self.live[rid]["ctx"], self.glob, self.D, max_tokens,
                             max_tokens if max_nodes is None else max_nodes, factor, offset, min_prob, tree,
                             self.live[rid]["prompt_len"])
