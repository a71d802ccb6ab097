# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False, nonecheck=False
"""Compiled core of the suffix proposer: a depth-truncated, path-compressed suffix tree over int32 token sequences.

Layout: a node is one 32-byte struct (a visit touches one cache line); a child is found as its parent's first child,
else through one open-addressing hash table keyed by (parent, first token) that stores only node indices and only
children with siblings (so extending a path or splitting an edge, the commonest edits, re-keys nothing); children are
enumerated through a doubly linked sibling list that starts with the TOP best-ranked children (highest count, then most
recent) in rank order, so a draft reads the likely children off the front and scans the rest only where all TOP of them
are likely enough (wide nodes have hundreds of children, each a cache miss): keeping the front ranked costs at most TOP
steps per count increment, and eviction, which lowers counts, only marks the list for a rescan by the next draft that
reaches it. A node also counts the occurrences of its string that end there, so the children's count total (the
denominator of their probabilities) needs no scan either. All tokens of a tree live back to back in one arena, oldest
sequence first. Every suffix of every sequence, truncated at `max_depth`, ends exactly at a node (as in
ArcticInference), so a node's count is the exact number of occurrences of its string.

The arena is a ring addressed by wrapping 32-bit positions (physical index = position & mask): eviction frees its front
without moving anything, so no call ever pays for a compaction. A node refers to the *most recent* occurrence of its
string: the position where that occurrence ends. Position order (compared as signed differences) is recency order. Sequences leave the tree oldest first, so a node whose ref points into the sequence being
evicted has no other occurrence and disappears with it: refs never need repair. The ref is also where a draft goes on
once it passes max_depth: the tree knows no more, but the most recent occurrence still has a continuation to copy.
"""
from cpython.list cimport PyList_New, PyList_SET_ITEM
from cpython.mem cimport PyMem_Free, PyMem_Malloc, PyMem_Realloc
from cpython.ref cimport Py_INCREF
from libc.stdint cimport int32_t, int64_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcmp, memcpy, memmove

import numpy as np

from hybridspec.proposal import Proposal

DEF ROOT = 0
DEF NONE = -1
DEF FREED = -2
DEF KIDS = 64              # children considered per node in tree mode (the top ones by count, then recency)
DEF TOP = 4                # a sibling list keeps its TOP best-ranked children first, in rank order
DEF ENDS_MAX = 0x7FFF      # Node.ends saturates here: the number is then unknown and recounted from the children
DEF STALE = 0x8000         # Node.ends flag: eviction lowered a count among the first TOP children: may be out of rank

# The core, in the order it builds up (textual includes: one compiled module, one namespace).
include "_tree_nodes.pxi"
include "_tree_insert.pxi"
include "_tree_draft.pxi"
include "_tree_speculate.pxi"

# ---------------------------------------------------------------- Python-facing objects

cdef int64_t INT32_MAX = 2147483647

def as_tokens(tokens, int64_t limit=INT32_MAX):
    """Validate token ids (integers in [0, limit]) and return them as a contiguous int32 array.

    Lists and tuples go through a typed loop and int32 arrays through a view: the per-step appends of a few tokens
    are where this matters. Anything else goes through numpy."""
    cdef Py_ssize_t n, k
    cdef int64_t v
    cdef int32_t[::1] out
    cdef const int32_t[::1] view
    if type(tokens) is list or type(tokens) is tuple:
        n = len(tokens)
        arr = np.empty(n, dtype=np.int32)
        out = arr
        for k in range(n):
            x = tokens[k]
            if type(x) is not int and (isinstance(x, bool) or not isinstance(x, (int, np.integer))):
                if isinstance(x, (list, tuple, np.ndarray)):
                    raise ValueError("token ids must be a flat sequence of integers")
                raise TypeError(f"token ids must be integers, got {type(x).__name__} values")
            if x < 0 or x > limit:
                raise ValueError(f"token id {x} is out of range [0, {limit}]")
            out[k] = <int32_t> x
        return arr
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be a flat sequence, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.int32)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got {arr.dtype} values")
    if arr.dtype == np.int32 and arr.flags.c_contiguous:
        view = arr
        for k in range(view.shape[0]):
            if view[k] < 0 or view[k] > limit:
                raise ValueError(f"token id {view[k]} is out of range [0, {limit}]")
        return arr
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi > limit:
        raise ValueError(f"token id {lo if lo < 0 else hi} is out of range [0, {limit}]")
    return np.ascontiguousarray(arr, dtype=np.int32)


cdef class _Scratch:
    """Draft buffers for one cache (not shared between caches, so two caches may speculate in two threads)."""
    cdef Draft a, b, extra, mix
    cdef int32_t* idx
    cdef Item* heap
    cdef int32_t cap

    def __cinit__(self, int cap):
        self.cap = cap
        self.mix.tok = <int32_t*> PyMem_Malloc(2 * cap * sizeof(int32_t))
        self.mix.par = <int32_t*> PyMem_Malloc(2 * cap * sizeof(int32_t))
        self.mix.prob = <double*> PyMem_Malloc(2 * cap * sizeof(double))
        self.idx = <int32_t*> PyMem_Malloc(4 * cap * sizeof(int32_t))
        if self.mix.tok == NULL or self.mix.par == NULL or self.mix.prob == NULL or self.idx == NULL:
            raise MemoryError()
        self.a.tok = <int32_t*> PyMem_Malloc(cap * sizeof(int32_t))
        self.a.par = <int32_t*> PyMem_Malloc(cap * sizeof(int32_t))
        self.a.prob = <double*> PyMem_Malloc(cap * sizeof(double))
        self.b.tok = <int32_t*> PyMem_Malloc(cap * sizeof(int32_t))
        self.b.par = <int32_t*> PyMem_Malloc(cap * sizeof(int32_t))
        self.b.prob = <double*> PyMem_Malloc(cap * sizeof(double))
        self.extra.tok = <int32_t*> PyMem_Malloc(cap * sizeof(int32_t))
        self.extra.par = <int32_t*> PyMem_Malloc(cap * sizeof(int32_t))
        self.extra.prob = <double*> PyMem_Malloc(cap * sizeof(double))
        # each pop emits at most one token and pushes one item, or branches and pushes up to KIDS
        self.heap = <Item*> PyMem_Malloc(((KIDS + 2) * cap + 4) * sizeof(Item))
        if (self.a.tok == NULL or self.a.par == NULL or self.a.prob == NULL or self.b.tok == NULL or
                self.b.par == NULL or self.b.prob == NULL or self.extra.tok == NULL or self.extra.par == NULL or
                self.extra.prob == NULL or self.heap == NULL):
            raise MemoryError()

    def __dealloc__(self):
        PyMem_Free(self.a.tok); PyMem_Free(self.a.par); PyMem_Free(self.a.prob)
        PyMem_Free(self.b.tok); PyMem_Free(self.b.par); PyMem_Free(self.b.prob)
        PyMem_Free(self.extra.tok); PyMem_Free(self.extra.par); PyMem_Free(self.extra.prob)
        PyMem_Free(self.heap)
        PyMem_Free(self.mix.tok); PyMem_Free(self.mix.par); PyMem_Free(self.mix.prob); PyMem_Free(self.idx)


cdef class SuffixTree:
    """One suffix tree: a request's context (one growing sequence), or the global history (sequences added whole and
    evicted oldest first). At most one sequence, the last, is open for appending."""
    cdef Tree T
    cdef readonly int max_depth
    cdef _Scratch scratch

    def __cinit__(self, int max_depth=64):
        if max_depth < 1 or max_depth > 65535:
            raise ValueError(f"max_depth must be in [1, 65535], got {max_depth}")
        self.max_depth = max_depth
        tree_init(&self.T, max_depth)

    def __dealloc__(self):
        tree_free(&self.T)

    def add_sequence(self, const int32_t[::1] tokens, bint keep_open=False):
        """Index a new sequence; with keep_open it grows later through extend()."""
        if self.T.open:
            raise ValueError("the last sequence is still open")
        seq_begin(&self.T)
        self.extend(tokens)
        self.T.open = keep_open

    def extend(self, const int32_t[::1] tokens):
        """Append tokens to the open sequence."""
        if not self.T.open:
            raise ValueError("no sequence is open for appending")
        cdef int32_t n = tokens.shape[0]
        if n == 0:
            return
        if <int64_t> (self.T.tok_end - self.T.tok_begin) + n >= (1 << 30):
            raise OverflowError("a suffix tree holds at most 2**30 live tokens")
        with nogil:
            seq_extend(&self.T, &tokens[0], n)

    def evict(self, long max_suffixes) -> int:
        """Evict up to max_suffixes suffixes, oldest sequence first (never the open one); returns how many."""
        cdef long done = 0
        cdef int32_t take
        cdef Seq* S
        while done < max_suffixes and self.T.head < self.T.n_seqs - (1 if self.T.open else 0):
            S = &self.T.seqs[self.T.head]
            take = <int32_t> min(<long> (S.length - S.start), max_suffixes - done)
            with nogil:
                remove_suffixes(&self.T, S, S.start + take)
            done += take
            if S.start == S.length:
                self.T.head += 1
                self.T.tok_begin = self.T.seqs[self.T.head].base if self.T.head < self.T.n_seqs else self.T.tok_end
        return done

    @property
    def n_sequences(self) -> int:
        return self.T.n_seqs - self.T.head

    @property
    def n_tokens(self) -> int:
        """Live (not evicted) suffix starts, i.e. indexed tokens."""
        return self.T.n_suffixes

    @property
    def n_nodes(self) -> int:
        return self.T.n_live

    @property
    def length(self) -> int:
        """Live tokens in the arena (for a request's tree: its context length)."""
        return self.T.tok_end - self.T.tok_begin

    def memory_bytes(self) -> int:
        return tree_bytes(&self.T)

    def sequences(self) -> list:
        """[(tokens, first live suffix start)] of the live sequences, oldest first (copies)."""
        cdef Seq* S
        out = []
        for k in range(self.T.head, self.T.n_seqs):
            S = &self.T.seqs[k]
            out.append((self._copy(S.base, S.length), S.start))
        return out

    cdef object _copy(self, uint32_t pos, int32_t n):
        arr = np.empty(n, dtype=np.int32)
        cdef int32_t[::1] view = arr
        cdef int32_t k
        for k in range(n):
            view[k] = self.T.tok[(pos + <uint32_t> k) & self.T.tok_mask]
        return arr

    def tokens(self, int start=0):
        """A copy of this (request) tree's context from `start` on."""
        cdef int32_t n = <int32_t> (self.T.tok_end - self.T.tok_begin)
        return self._copy(self.T.tok_begin + <uint32_t> min(start, n), max(0, n - start))

    def starts_with_context(self, const int32_t[::1] tokens) -> bool:
        """Do `tokens` begin with everything this (request) tree holds? (A request tree never wraps its ring.)"""
        cdef int32_t n = <int32_t> (self.T.tok_end - self.T.tok_begin)
        if tokens.shape[0] < n:
            return False
        return n == 0 or memcmp(&tokens[0], self.T.tok + self.T.tok_begin, n * sizeof(int32_t)) == 0

    def check(self):
        """Verify every invariant against a recount from the sequences (tests and debugging; O(n * depth))."""
        cdef Tree* T = &self.T
        cdef Node* N = T.nodes
        cdef dict counts = {}, ends = {}, recent = {}
        cdef int32_t k, st, d, lim, v, c, n, prev, kids, pos, last = NONE, live = 0, live_hashed = 0, hl = 0
        cdef uint32_t base = T.seqs[T.head].base if T.head < T.n_seqs else T.tok_end
        cdef Seq* S
        for k in range(T.head, T.n_seqs):
            S = &T.seqs[k]
            for st in range(S.start, S.length):
                lim = min(T.max_depth, S.length - st)
                v = ROOT
                d = 0
                while d < lim:
                    c = lookup(T, v, T.tok[(S.base + <uint32_t> (st + d)) & T.tok_mask])
                    assert c != NONE, f"missing child for suffix {st} of sequence {k} at depth {d}"
                    assert N[c].depth <= lim, f"suffix {st} of sequence {k} ends inside an edge"
                    for j in range(d, N[c].depth):
                        assert edge_token(T, c, j) == T.tok[(S.base + <uint32_t> (st + j)) & T.tok_mask], "edge label"
                    counts[c] = counts.get(c, 0) + 1
                    recent[c] = max(recent.get(c, -1), <int32_t> (S.base + <uint32_t> (st + N[c].depth) - base))
                    v = c
                    d = N[c].depth
                ends[v] = ends.get(v, 0) + 1
        assert N[ROOT].count == T.n_suffixes, "root count"
        for n in range(T.n_nodes):
            if N[n].parent == FREED:
                continue
            if n != ROOT:
                live += 1
                assert counts.get(n, 0) == N[n].count, \
                    f"node {n}: count {N[n].count} != {counts.get(n, 0)} occurrences"
                assert lookup(T, N[n].parent, N[n].token) == n, f"node {n} unreachable from its parent"
                assert (h_find_slot(T, N[n].parent, N[n].token) != NONE) == hashed(N, n), \
                    f"node {n}: {'has siblings but is not' if hashed(N, n) else 'is an only child but is'} in the hash"
                if hashed(N, n):
                    live_hashed += 1
                assert N[n].depth > N[N[n].parent].depth
                # the ref is the most recent occurrence: sibling ranks (and so drafts) rely on it
                assert <int32_t> (N[n].rend - base) == recent.get(n), \
                    f"node {n}: ref is not the most recent occurrence"
            assert N[n].ends & ENDS_MAX in (ENDS_MAX, ends.get(n, 0)), \
                f"node {n}: {N[n].ends & ENDS_MAX} occurrences end here, not {ends.get(n, 0)}"
            c = N[n].child
            if n != ROOT and c != NONE and N[c].sib == NONE:
                assert N[c].count < N[n].count, f"node {n} should have been merged into its only child"
            prev = NONE
            kids = 0
            pos = 0
            while c != NONE:
                assert N[c].parent == n and N[c].psib == prev, f"node {n}: broken sibling list"
                if not N[n].ends & STALE and prev != NONE:
                    # the front is ranked, and nothing after it ranks before its last
                    assert not ranks_before(N, c, prev if pos <= TOP else last), \
                        f"node {n}: child {c} (position {pos}) ranks before a child at the front"
                if pos == TOP - 1:
                    last = c
                kids += N[c].count
                prev = c
                pos += 1
                c = N[c].sib
            assert N[n].count == ends.get(n, 0) + kids, f"node {n}: count is not endings + children's counts"
        for k in range(<int32_t> (T.hmask + 1)):
            if T.slots[k] != NONE:
                hl += 1
        assert live + 1 == T.n_live, f"{live + 1} reachable nodes, {T.n_live} allocated"
        assert hl == live_hashed == T.hcount, f"hash holds {hl}, {live_hashed} live nodes with siblings"
        return True

    cdef _Scratch scratch_for(self, int32_t need):
        if self.scratch is None or self.scratch.cap < need:
            self.scratch = _Scratch(need)
        return self.scratch


cdef class RequestState:
    """A request's own suffix tree (one open sequence: its prompt and output so far) and its match state in the
    global tree."""
    cdef readonly SuffixTree tree
    cdef readonly SuffixTree output  # the request's output alone (an open sequence)
    cdef GMatch gm
    cdef public int prompt_len      # where this request's response starts
    cdef public int indexed_from    # tokens before this came with the tree from an earlier request (a session)
    cdef public bint finished

    def __cinit__(self, SuffixTree tree, int prompt_len, int indexed_from=0):
        self.tree = tree
        self.output = SuffixTree(tree.max_depth)
        self.output.add_sequence(np.empty(0, dtype=np.int32), keep_open=True)
        self.prompt_len = prompt_len
        self.indexed_from = indexed_from
        self.finished = False
        self.gm.version = -1
        self.gm.upto = 0
        self.gm.start = 0
        self.gm.node = ROOT
        self.gm.d = 0

    @property
    def length(self) -> int:
        return self.tree.length

    def tokens(self, int start=0):
        return self.tree.tokens(start)

    def extend(self, const int32_t[::1] tokens):
        """Append output tokens (to the request's tree and to its output's)."""
        self.tree.extend(tokens)
        self.output.extend(tokens)

    def memory_bytes(self) -> int:
        return self.tree.memory_bytes() + self.output.memory_bytes()


cdef object to_proposal(Draft* d):
    """The draft as Python lists, sized up front; a run of equal probabilities (a path through one occurrence) shares
    one float object, so a 32-node tree allocates a few floats, not 32."""
    cdef int32_t k
    cdef list toks = PyList_New(d.n), pars = PyList_New(d.n), probs = PyList_New(d.n)
    cdef object x, p = None
    cdef double last = -1.0
    for k in range(d.n):
        x = d.tok[k]
        Py_INCREF(x)                  # SET_ITEM steals a reference
        PyList_SET_ITEM(toks, k, x)
        x = d.par[k]
        Py_INCREF(x)
        PyList_SET_ITEM(pars, k, x)
        if d.prob[k] != last:
            last = d.prob[k]
            p = last
        Py_INCREF(p)
        PyList_SET_ITEM(probs, k, p)
    return Proposal(toks, pars, probs, d.score, "suffix", d.match_len if d.n else 0, None)


cdef SpecArgs spec_args(int max_tokens, int max_nodes, double factor, double offset, double min_prob, bint tree):
    cdef SpecArgs a
    a.max_tokens = max_tokens
    a.max_nodes = max_nodes
    a.factor = factor
    a.offset = offset
    a.min_prob = min_prob
    a.tree = tree
    return a


def speculate_request(RequestState r, SuffixTree glob, int max_tokens, int max_nodes, double factor, double offset,
                      double min_prob, bint tree):
    """One request's proposal, drafted with the GIL released (see speculate)."""
    if not r.tree.T.open:
        raise ValueError("a request's tree must be open")
    cdef SpecArgs a = spec_args(max_tokens, max_nodes, factor, offset, min_prob, tree)
    cdef _Scratch sc = glob.scratch_for((max_nodes if tree else max_tokens) + 1)
    with nogil:
        speculate_one(&r.tree.T, &r.output.T, &r.gm, &glob.T, &a, &sc.a, &sc.b, &sc.mix, sc.idx, sc.heap,
                      &sc.extra)
    return to_proposal(&sc.a)


def speculate(list requests, SuffixTree glob, int max_tokens, int max_nodes, double factor, double offset,
              double min_prob, bint tree):
    """Proposals for one or more requests, drafted with the GIL released.

    Callers serialise access to the trees (SuffixCache holds a lock); releasing the GIL lets other Python threads
    (a model runner, say) progress meanwhile.
    """
    cdef SpecArgs a = spec_args(max_tokens, max_nodes, factor, offset, min_prob, tree)
    cdef int32_t need = (max_nodes if tree else max_tokens) + 1
    cdef _Scratch sc = glob.scratch_for(need)
    cdef Tree* G = &glob.T
    cdef RequestState r
    cdef int32_t nreq = len(requests), k
    for k in range(nreq):
        if not (<RequestState> requests[k]).tree.T.open:
            raise ValueError("a request's tree must be open")
    cdef Draft* drafts = <Draft*> PyMem_Malloc(nreq * sizeof(Draft))
    cdef Tree** trees = <Tree**> PyMem_Malloc(nreq * sizeof(Tree*))
    cdef Tree** outputs = <Tree**> PyMem_Malloc(nreq * sizeof(Tree*))
    cdef GMatch** gms = <GMatch**> PyMem_Malloc(nreq * sizeof(GMatch*))
    cdef int32_t* buf_t = <int32_t*> PyMem_Malloc(nreq * need * sizeof(int32_t))
    cdef int32_t* buf_p = <int32_t*> PyMem_Malloc(nreq * need * sizeof(int32_t))
    cdef double* buf_q = <double*> PyMem_Malloc(nreq * need * sizeof(double))
    cdef list out = []
    try:
        if (drafts == NULL or trees == NULL or outputs == NULL or gms == NULL or buf_t == NULL or buf_p == NULL
                or buf_q == NULL):
            raise MemoryError()
        for k in range(nreq):
            r = requests[k]
            trees[k] = &r.tree.T
            outputs[k] = &r.output.T
            gms[k] = &r.gm
            drafts[k].tok = buf_t + k * need
            drafts[k].par = buf_p + k * need
            drafts[k].prob = buf_q + k * need
        with nogil:
            for k in range(nreq):
                speculate_one(trees[k], outputs[k], gms[k], G, &a, &drafts[k], &sc.b, &sc.mix, sc.idx, sc.heap,
                              &sc.extra)
        for k in range(nreq):
            out.append(to_proposal(&drafts[k]))
    finally:
        PyMem_Free(drafts); PyMem_Free(trees); PyMem_Free(outputs); PyMem_Free(gms)
        PyMem_Free(buf_t); PyMem_Free(buf_p); PyMem_Free(buf_q)
    return out

