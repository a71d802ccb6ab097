# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True, initializedcheck=False, nonecheck=False
"""Compiled core of the suffix proposer: a depth-truncated, path-compressed suffix tree over int32 token sequences.

Layout: nodes are parallel C arrays (struct of arrays, 34 bytes a node); children are found through one open-addressing
hash table keyed by (parent, first token) that stores only node indices, and enumerated through a doubly linked
sibling list. Every suffix of every sequence, truncated at `max_depth`, ends exactly at a node (as in ArcticInference),
so node.count is the exact number of occurrences of the node's string.

Each node refers to the *most recent* occurrence of its string (sequence slot, end position). Sequences enter the
global tree in order and leave it oldest first, so a node whose ref points into the sequence being evicted has no other
occurrence and disappears with it: refs never need repair. The ref is also where a draft continues once it passes
max_depth: the tree stops knowing, the most recent occurrence still has a continuation to copy.
"""
from cpython.mem cimport PyMem_Malloc, PyMem_Realloc, PyMem_Free
from libc.stdint cimport int32_t, int64_t, uint16_t, uint32_t
from libc.string cimport memcpy, memcmp

import numpy as np

from hybridspec.proposal import Proposal

DEF ROOT = 0
DEF NONE = -1
DEF FREED = -2
DEF KIDS = 64              # children considered per node in tree mode (the top ones by count, then recency)

cdef struct Seq:
    int32_t* tok
    int32_t length
    int32_t cap
    int32_t start          # suffixes starting before `start` were evicted
    int64_t uid            # insertion order: recency between sequences
    int32_t* act_node      # active suffix ends, ring indexed by start % max_depth (NULL once closed)
    int32_t* act_pseq      # most recent earlier occurrence of each active suffix's string (slot, end), or -1
    int32_t* act_pend
    bint live

cdef struct Tree:
    int32_t max_depth
    int32_t n_nodes, cap_nodes, free_head, n_live
    int32_t* count
    int32_t* parent
    int32_t* token
    uint16_t* depth
    int32_t* rseq
    int32_t* rend
    int32_t* child
    int32_t* sib
    int32_t* psib
    int32_t* slots         # hash: node index or -1
    uint32_t hmask
    int32_t hcount
    Seq* seqs
    int32_t n_seqs, cap_seqs
    int64_t next_uid
    int64_t version        # bumped by every structural change; match states compare it
    int64_t n_suffixes     # live suffix starts (indexed tokens)
    int32_t* stack
    int32_t stack_cap

# ---------------------------------------------------------------- memory helpers

cdef int _grow(void** p, size_t new_bytes) except -1 nogil:
    cdef void* q
    with gil:
        q = PyMem_Realloc(p[0], new_bytes)
        if q == NULL:
            raise MemoryError()
    p[0] = q
    return 0

cdef int64_t _version_base = 0

cdef int tree_init(Tree* T, int32_t max_depth) except -1:
    global _version_base
    cdef int32_t cap = 64
    T.max_depth = max_depth
    T.n_nodes = 0
    T.cap_nodes = 0
    T.free_head = NONE
    T.n_live = 0
    T.count = NULL; T.parent = NULL; T.token = NULL; T.depth = NULL; T.rseq = NULL; T.rend = NULL
    T.child = NULL; T.sib = NULL; T.psib = NULL; T.slots = NULL; T.seqs = NULL; T.stack = NULL
    T.n_seqs = 0; T.cap_seqs = 0; T.next_uid = 0; T.n_suffixes = 0; T.stack_cap = 0
    # versions are unique across trees, so a match state can never mistake a replaced tree for its own
    _version_base += 1 << 40
    T.version = _version_base
    T.hcount = 0
    T.slots = <int32_t*> PyMem_Malloc(cap * sizeof(int32_t))
    if T.slots == NULL:
        raise MemoryError()
    for i in range(cap):
        T.slots[i] = NONE
    T.hmask = cap - 1
    node_alloc(T)            # the root: index 0
    T.depth[ROOT] = 0
    T.parent[ROOT] = NONE
    T.token[ROOT] = NONE
    return 0

cdef void tree_free(Tree* T) noexcept:
    cdef int32_t i
    for i in range(T.n_seqs):
        if T.seqs[i].live:
            seq_release(&T.seqs[i])
    PyMem_Free(T.count); PyMem_Free(T.parent); PyMem_Free(T.token); PyMem_Free(T.depth); PyMem_Free(T.rseq)
    PyMem_Free(T.rend); PyMem_Free(T.child); PyMem_Free(T.sib); PyMem_Free(T.psib); PyMem_Free(T.slots)
    PyMem_Free(T.seqs); PyMem_Free(T.stack)
    T.count = NULL; T.slots = NULL; T.seqs = NULL; T.stack = NULL; T.n_seqs = 0

cdef void seq_release(Seq* S) noexcept:
    PyMem_Free(S.tok); PyMem_Free(S.act_node); PyMem_Free(S.act_pseq); PyMem_Free(S.act_pend)
    S.tok = NULL; S.act_node = NULL; S.act_pseq = NULL; S.act_pend = NULL
    S.length = 0; S.cap = 0; S.start = 0; S.live = False

cdef size_t tree_bytes(Tree* T) noexcept nogil:
    cdef size_t b = <size_t> T.cap_nodes * (8 * sizeof(int32_t) + sizeof(uint16_t))
    b += (<size_t> T.hmask + 1) * sizeof(int32_t) + <size_t> T.cap_seqs * sizeof(Seq)
    cdef int32_t i
    for i in range(T.n_seqs):
        if not T.seqs[i].live:
            continue
        b += <size_t> T.seqs[i].cap * sizeof(int32_t)
        if T.seqs[i].act_node != NULL:
            b += 3 * <size_t> T.max_depth * sizeof(int32_t)
    return b

# ---------------------------------------------------------------- nodes

cdef int32_t node_alloc(Tree* T) except -1 nogil:
    cdef int32_t n, cap
    if T.free_head != NONE:
        n = T.free_head
        T.free_head = T.sib[n]
    else:
        if T.n_nodes == T.cap_nodes:
            cap = T.cap_nodes * 3 // 2 + 64
            _grow(<void**> &T.count, cap * sizeof(int32_t))
            _grow(<void**> &T.parent, cap * sizeof(int32_t))
            _grow(<void**> &T.token, cap * sizeof(int32_t))
            _grow(<void**> &T.depth, cap * sizeof(uint16_t))
            _grow(<void**> &T.rseq, cap * sizeof(int32_t))
            _grow(<void**> &T.rend, cap * sizeof(int32_t))
            _grow(<void**> &T.child, cap * sizeof(int32_t))
            _grow(<void**> &T.sib, cap * sizeof(int32_t))
            _grow(<void**> &T.psib, cap * sizeof(int32_t))
            T.cap_nodes = cap
        n = T.n_nodes
        T.n_nodes += 1
    T.count[n] = 0
    T.child[n] = NONE
    T.sib[n] = NONE
    T.psib[n] = NONE
    T.rseq[n] = NONE
    T.rend[n] = 0
    T.n_live += 1
    return n

cdef inline void node_free(Tree* T, int32_t n) noexcept nogil:
    T.parent[n] = FREED
    T.count[n] = 0
    T.sib[n] = T.free_head
    T.free_head = n
    T.n_live -= 1

cdef inline void list_link(Tree* T, int32_t v, int32_t c) noexcept nogil:
    T.psib[c] = NONE
    T.sib[c] = T.child[v]
    if T.child[v] != NONE:
        T.psib[T.child[v]] = c
    T.child[v] = c

cdef inline void list_unlink(Tree* T, int32_t c) noexcept nogil:
    if T.psib[c] != NONE:
        T.sib[T.psib[c]] = T.sib[c]
    else:
        T.child[T.parent[c]] = T.sib[c]
    if T.sib[c] != NONE:
        T.psib[T.sib[c]] = T.psib[c]

cdef inline void list_replace(Tree* T, int32_t old, int32_t new) noexcept nogil:
    """`new` takes `old`'s place among its siblings (parents must already agree)."""
    T.sib[new] = T.sib[old]
    T.psib[new] = T.psib[old]
    if T.psib[old] != NONE:
        T.sib[T.psib[old]] = new
    else:
        T.child[T.parent[old]] = new
    if T.sib[old] != NONE:
        T.psib[T.sib[old]] = new

# ---------------------------------------------------------------- hash (parent, token) -> child

cdef inline uint32_t hkey(int32_t p, int32_t t) noexcept nogil:
    cdef uint32_t h = (<uint32_t> p) * 0x9E3779B1u ^ ((<uint32_t> t) * 0x85EBCA77u)
    h ^= h >> 15
    h *= 0x2C1B3C6Du
    h ^= h >> 12
    return h

cdef inline int32_t h_find_slot(Tree* T, int32_t p, int32_t t) noexcept nogil:
    cdef uint32_t i = hkey(p, t) & T.hmask
    cdef int32_t n
    while True:
        n = T.slots[i]
        if n == NONE:
            return -1
        if T.parent[n] == p and T.token[n] == t:
            return <int32_t> i
        i = (i + 1) & T.hmask

cdef inline int32_t lookup(Tree* T, int32_t p, int32_t t) noexcept nogil:
    cdef int32_t s = h_find_slot(T, p, t)
    return T.slots[s] if s >= 0 else NONE

cdef inline void h_put_raw(Tree* T, int32_t n) noexcept nogil:
    cdef uint32_t i = hkey(T.parent[n], T.token[n]) & T.hmask
    while T.slots[i] != NONE:
        i = (i + 1) & T.hmask
    T.slots[i] = n

cdef int h_insert(Tree* T, int32_t n) except -1 nogil:
    cdef uint32_t cap, i
    cdef int32_t* old
    cdef int32_t m
    if (<int64_t> T.hcount + 1) * 10 > (<int64_t> T.hmask + 1) * 7:
        cap = (T.hmask + 1) * 2
        old = T.slots
        with gil:
            T.slots = <int32_t*> PyMem_Malloc(cap * sizeof(int32_t))
            if T.slots == NULL:
                T.slots = old
                raise MemoryError()
        for i in range(cap):
            T.slots[i] = NONE
        T.hmask = cap - 1
        for i in range(cap // 2):
            m = old[i]
            if m != NONE:
                h_put_raw(T, m)
        with gil:
            PyMem_Free(old)
    h_put_raw(T, n)
    T.hcount += 1
    return 0

cdef void h_delete_slot(Tree* T, int32_t i) noexcept nogil:
    """Backward-shift deletion: keeps probe chains intact without tombstones."""
    cdef uint32_t j = <uint32_t> i, k, hole = <uint32_t> i
    cdef int32_t n
    while True:
        j = (j + 1) & T.hmask
        n = T.slots[j]
        if n == NONE:
            break
        k = hkey(T.parent[n], T.token[n]) & T.hmask
        if (hole <= j and hole < k and k <= j) or (hole > j and (hole < k or k <= j)):
            continue
        T.slots[hole] = n
        hole = j
    T.slots[hole] = NONE
    T.hcount -= 1

cdef inline void h_delete(Tree* T, int32_t p, int32_t t) noexcept nogil:
    cdef int32_t s = h_find_slot(T, p, t)
    if s >= 0:
        h_delete_slot(T, s)

cdef inline int32_t edge_token(Tree* T, int32_t n, int32_t d) noexcept nogil:
    """Token at string depth d (0-based) of node n's string, read from its reference occurrence."""
    return T.seqs[T.rseq[n]].tok[T.rend[n] - T.depth[n] + d]

cdef int rekey_first(Tree* T, int32_t c, int32_t new_parent, int32_t new_parent_depth) except -1 nogil:
    """c's edge now starts below new_parent: re-key it in the hash."""
    h_delete(T, T.parent[c], T.token[c])
    T.parent[c] = new_parent
    T.token[c] = edge_token(T, c, new_parent_depth)
    return h_insert(T, c)

cdef int free_subtree(Tree* T, int32_t c) except -1 nogil:
    cdef int32_t top = 0, x, y, cap
    h_delete(T, T.parent[c], T.token[c])
    list_unlink(T, c)
    if T.stack_cap < 16:
        _grow(<void**> &T.stack, 64 * sizeof(int32_t))
        T.stack_cap = 64
    T.stack[top] = c
    top += 1
    while top > 0:
        top -= 1
        x = T.stack[top]
        y = T.child[x]
        while y != NONE:
            h_delete(T, x, T.token[y])
            if top == T.stack_cap:
                cap = T.stack_cap * 2
                _grow(<void**> &T.stack, cap * sizeof(int32_t))
                T.stack_cap = cap
            T.stack[top] = y
            top += 1
            y = T.sib[y]
        node_free(T, x)
    return 0

# ---------------------------------------------------------------- sequences and insertion

cdef int32_t seq_new(Tree* T) except -1:
    """A new empty sequence in a free slot. Slots are stable for a sequence's life, so refs never move."""
    cdef int32_t s = 0
    while s < T.n_seqs and T.seqs[s].live:
        s += 1
    if s == T.n_seqs:
        if T.n_seqs == T.cap_seqs:
            _grow(<void**> &T.seqs, (T.cap_seqs * 2 + 4) * sizeof(Seq))
            T.cap_seqs = T.cap_seqs * 2 + 4
        T.n_seqs += 1
    cdef Seq* S = &T.seqs[s]
    S.tok = NULL; S.length = 0; S.cap = 0; S.start = 0; S.live = True
    S.uid = T.next_uid
    T.next_uid += 1
    S.act_node = <int32_t*> PyMem_Malloc(T.max_depth * sizeof(int32_t))
    S.act_pseq = <int32_t*> PyMem_Malloc(T.max_depth * sizeof(int32_t))
    S.act_pend = <int32_t*> PyMem_Malloc(T.max_depth * sizeof(int32_t))
    if S.act_node == NULL or S.act_pseq == NULL or S.act_pend == NULL:
        raise MemoryError()
    return s

cdef void seq_close(Tree* T, int32_t s) noexcept:
    """No more tokens will come: drop the active-suffix state."""
    cdef Seq* S = &T.seqs[s]
    PyMem_Free(S.act_node); PyMem_Free(S.act_pseq); PyMem_Free(S.act_pend)
    S.act_node = NULL; S.act_pseq = NULL; S.act_pend = NULL

cdef int seq_extend(Tree* T, int32_t s, const int32_t* toks, int32_t n) except -1 nogil:
    cdef Seq* S = &T.seqs[s]
    cdef int32_t need = S.length + n, cap, k
    if need > S.cap:
        cap = S.cap * 3 // 2 + 16
        if cap < need:
            cap = need
        _grow(<void**> &S.tok, cap * sizeof(int32_t))
        S = &T.seqs[s]
        S.cap = cap
    for k in range(n):
        append_token(T, s, toks[k])
    T.version += 1
    return 0

cdef int append_token(Tree* T, int32_t s, int32_t t) except -1 nogil:
    """Extend every active suffix of sequence s by t: O(max_depth) hash steps."""
    cdef Seq* S = &T.seqs[s]
    cdef int32_t D = T.max_depth
    cdef int32_t L = S.length
    cdef int32_t e = L + 1          # end position of every extended suffix
    cdef int32_t first = L - D + 1 if L - D + 1 > 0 else 0
    cdef int32_t st, i, v, c, n, p, pseq, pend
    S.tok[L] = t
    S.length = e
    S.act_node[L % D] = ROOT
    T.count[ROOT] += 1
    T.n_suffixes += 1
    for st in range(first, L + 1):
        i = st % D
        v = S.act_node[i]
        c = lookup(T, v, t)
        pseq = NONE
        pend = 0
        if c == NONE:
            if v != ROOT and T.count[v] == 1:
                # v is a leaf that only this suffix reaches: lengthen its edge in place
                T.depth[v] += 1
                T.rseq[v] = s
                T.rend[v] = e
            else:
                n = node_alloc(T)
                T.parent[n] = v
                T.token[n] = t
                T.count[n] = 1
                T.depth[n] = T.depth[v] + 1
                T.rseq[n] = s
                T.rend[n] = e
                list_link(T, v, n)
                h_insert(T, n)
                S = &T.seqs[s]
                S.act_node[i] = n
        else:
            # the most recent earlier occurrence of str(v)+t, read from c's ref
            pseq = T.rseq[c]
            pend = T.rend[c] - (T.depth[c] - T.depth[v] - 1)
            if v != ROOT and T.count[v] == T.count[c] + 1:
                # only this suffix ends at v; everything else continues into c
                if T.depth[c] == T.depth[v] + 1:
                    # c's edge is one token: c takes v's place
                    p = T.parent[v]
                    h_delete(T, v, t)
                    T.token[c] = T.token[v]
                    T.parent[c] = p
                    T.slots[h_find_slot(T, p, T.token[v])] = c
                    list_replace(T, v, c)
                    T.count[c] += 1
                    T.rseq[c] = s
                    T.rend[c] = e
                    node_free(T, v)
                    S.act_node[i] = c
                else:
                    # move v's end one token down c's edge
                    T.depth[v] += 1
                    T.rseq[v] = s
                    T.rend[v] = e
                    rekey_first(T, c, v, T.depth[v])
                    S = &T.seqs[s]
            elif T.depth[c] == T.depth[v] + 1:
                T.count[c] += 1
                T.rseq[c] = s
                T.rend[c] = e
                S.act_node[i] = c
            else:
                # split c's edge after its first token
                n = node_alloc(T)
                T.parent[n] = v
                T.token[n] = t
                T.count[n] = T.count[c] + 1
                T.depth[n] = T.depth[v] + 1
                T.rseq[n] = s
                T.rend[n] = e
                T.slots[h_find_slot(T, v, t)] = n
                list_replace(T, c, n)
                T.child[n] = NONE
                T.parent[c] = n
                T.token[c] = edge_token(T, c, T.depth[n])
                list_link(T, n, c)
                h_insert(T, c)
                S = &T.seqs[s]
                S.act_node[i] = n
        S.act_pseq[i] = pseq
        S.act_pend[i] = pend
    return 0

cdef int remove_suffixes(Tree* T, int32_t s, int32_t upto) except -1 nogil:
    """Evict the suffixes of sequence s that start in [S.start, upto)."""
    cdef Seq* S = &T.seqs[s]
    cdef int32_t D = T.max_depth, st, d, lim, v, c, ch
    for st in range(S.start, upto):
        lim = S.length - st
        if lim > D:
            lim = D
        v = ROOT
        d = 0
        T.count[ROOT] -= 1
        while d < lim:
            c = lookup(T, v, S.tok[st + d])
            T.count[c] -= 1
            if T.count[c] == 0:
                free_subtree(T, c)
                break
            v = c
            d = T.depth[c]
        # only the last node's children or endings changed: it may now be a chain link to merge away
        if v != ROOT:
            ch = T.child[v]
            if ch != NONE and T.sib[ch] == NONE and T.count[ch] == T.count[v]:
                h_delete(T, v, T.token[ch])
                T.token[ch] = T.token[v]
                T.parent[ch] = T.parent[v]
                T.slots[h_find_slot(T, T.parent[v], T.token[v])] = ch
                list_replace(T, v, ch)
                node_free(T, v)
        T.n_suffixes -= 1
    S.start = upto
    T.version += 1
    return 0

# ---------------------------------------------------------------- speculation

cdef struct Draft:
    int32_t* tok
    int32_t* par
    double* prob
    int32_t n
    int32_t cap
    double score
    int32_t match_len

cdef struct Item:          # a position to expand in best-first order
    double prob
    int64_t order
    int32_t node, d        # tree position: on node's edge at string depth d (d == depth: at the node's end)
    int32_t cseq, cpos     # copy mode when cseq >= 0: continue from position cpos of sequence cseq
    int32_t parent, ddepth # draft parent index and draft depth of the token this item emits

cdef inline bint item_before(Item* a, Item* b) noexcept nogil:
    return a.prob > b.prob or (a.prob == b.prob and a.order < b.order)

cdef void heap_push(Item* h, int32_t* n, Item it) noexcept nogil:
    cdef int32_t i = n[0], p
    n[0] += 1
    while i > 0:
        p = (i - 1) // 2
        if not item_before(&it, &h[p]):
            break
        h[i] = h[p]
        i = p
    h[i] = it

cdef Item heap_pop(Item* h, int32_t* n) noexcept nogil:
    cdef Item top = h[0], last
    cdef int32_t i = 0, c
    n[0] -= 1
    last = h[n[0]]
    while True:
        c = 2 * i + 1
        if c >= n[0]:
            break
        if c + 1 < n[0] and item_before(&h[c + 1], &h[c]):
            c += 1
        if not item_before(&h[c], &last):
            break
        h[i] = h[c]
        i = c
    h[i] = last
    return top

cdef inline bint ranks_before(Tree* T, int32_t a, int32_t b) noexcept nogil:
    """Sibling order for drafting: higher count first, then the more recent occurrence (siblings' strings have equal
    length, so comparing where they start compares where their first tokens end)."""
    if T.count[a] != T.count[b]:
        return T.count[a] > T.count[b]
    cdef int64_t ua = T.seqs[T.rseq[a]].uid, ub = T.seqs[T.rseq[b]].uid
    if ua != ub:
        return ua > ub
    return T.rend[a] - T.depth[a] > T.rend[b] - T.depth[b]

cdef int32_t path_token(Draft* out, int32_t node, int32_t k, int32_t node_depth) noexcept nogil:
    """Token at draft depth k on the path that ends at draft node `node` (at draft depth node_depth)."""
    while node_depth > k:
        node = out.par[node]
        node_depth -= 1
    return out.tok[node]

cdef int draft_tree(Tree* T, int32_t start_node, int32_t start_d, int32_t start_cseq, int32_t start_cpos,
                    int32_t self_seq, int32_t max_tokens, int32_t max_nodes, double min_prob, bint branch,
                    Draft* out, Item* heap) noexcept nogil:
    """Best-first draft from a matched position. Path mode (branch=0) follows only the best child: the heap holds
    one item at a time and the result is the greedy path. `self_seq` is the sequence whose end is the context
    (request tree), or -1: copies from it may run past its end into the draft itself (LZ77-style overlap)."""
    cdef int32_t nh = 0, D = T.max_depth, u, c, k, j, m, nk, width
    cdef int64_t order = 0, total
    cdef double pr
    cdef Item it, nx
    cdef int32_t kids[KIDS]
    cdef Seq* S
    it.prob = 1.0; it.order = 0; it.node = start_node; it.d = start_d
    it.cseq = start_cseq; it.cpos = start_cpos; it.parent = -1; it.ddepth = 0
    out.n = 0
    out.score = 0.0
    heap_push(heap, &nh, it)
    while nh > 0 and out.n < max_nodes:
        it = heap_pop(heap, &nh)
        if it.prob < min_prob:
            continue
        if it.cseq < 0 and it.d == T.depth[it.node] and it.d < D:
            # at a node's end below max depth: branch on its children
            u = it.node
            total = 0
            m = 0
            width = KIDS if branch else 1
            c = T.child[u]
            while c != NONE:
                total += T.count[c]
                # keep the best `width` children in rank order
                if m < width or ranks_before(T, c, kids[m - 1]):
                    j = m - 1 if m == width else m
                    while j > 0 and ranks_before(T, c, kids[j - 1]):
                        kids[j] = kids[j - 1]
                        j -= 1
                    kids[j] = c
                    if m < width:
                        m += 1
                c = T.sib[c]
            if m == 0:
                continue
            for k in range(m):
                pr = it.prob * (<double> T.count[kids[k]] / <double> total)
                if pr < min_prob:
                    break
                nx = it
                nx.prob = pr
                order += 1
                nx.order = order
                nx.node = kids[k]
                heap_push(heap, &nh, nx)
            continue
        if it.ddepth >= max_tokens:
            continue
        # emit one token at this position
        if it.cseq >= 0:
            S = &T.seqs[it.cseq]
            if it.cpos < S.length:
                nk = S.tok[it.cpos]
            elif it.cseq == self_seq and it.parent >= 0:
                nk = path_token(out, it.parent, it.cpos - S.length, it.ddepth - 1)
            else:
                continue
        elif it.d == T.depth[it.node]:
            # at max depth: the tree knows no more, continue from the most recent occurrence
            it.cseq = T.rseq[it.node]
            it.cpos = T.rend[it.node]
            heap_push(heap, &nh, it)
            continue
        else:
            nk = edge_token(T, it.node, it.d)
        k = out.n
        out.tok[k] = nk
        out.par[k] = it.parent
        out.prob[k] = it.prob
        out.score += it.prob
        out.n += 1
        nx = it
        nx.parent = k
        nx.ddepth = it.ddepth + 1
        if it.cseq >= 0:
            nx.cpos = it.cpos + 1
        else:
            nx.d = it.d + 1
        order += 1
        nx.order = order
        heap_push(heap, &nh, nx)
    return 0

# ---------------------------------------------------------------- request match state and one request's speculation

cdef struct GMatch:          # a request's longest match in the global tree, advanced lazily
    int64_t version
    int32_t upto             # context length this state describes
    int32_t start            # the match is context[start:upto]
    int32_t node, d

cdef inline bint step(Tree* G, int32_t* u, int32_t* d, int32_t t) noexcept nogil:
    """Advance a tree position by one token; False (position unchanged) if the path does not continue."""
    cdef int32_t c
    if d[0] == G.depth[u[0]]:
        c = lookup(G, u[0], t)
        if c == NONE:
            return False
        u[0] = c
    elif edge_token(G, u[0], d[0]) != t:
        return False
    d[0] += 1
    return True

cdef bint walk(Tree* G, const int32_t* toks, int32_t n, int32_t* u, int32_t* d) noexcept nogil:
    cdef int32_t k
    u[0] = ROOT
    d[0] = 0
    for k in range(n):
        if not step(G, u, d, toks[k]):
            return False
    return True

cdef void gmatch_update(Tree* G, GMatch* gm, const int32_t* ctx, int32_t L) noexcept nogil:
    """Longest suffix of ctx[:L] (at most max_depth tokens) that occurs in G: amortised O(max_depth) per new token,
    since the match start only moves forward. Any change to G invalidates the state (version) and it is rebuilt."""
    cdef int32_t D = G.max_depth, i, s, u = ROOT, d = 0
    if gm.version != G.version or L - gm.upto > D or L < gm.upto:
        s = L - D if L > D else 0
        while s < L and not walk(G, ctx + s, L - s, &u, &d):
            s += 1
        if s == L:
            u = ROOT
            d = 0
        gm.start = s; gm.node = u; gm.d = d
    else:
        for i in range(gm.upto, L):
            u = gm.node
            d = gm.d
            if d < D and step(G, &u, &d, ctx[i]):
                gm.node = u; gm.d = d
                continue
            s = gm.start + 1
            while s <= i and not walk(G, ctx + s, i + 1 - s, &u, &d):
                s += 1
            if s > i:
                u = ROOT
                d = 0
            gm.start = s; gm.node = u; gm.d = d
    gm.version = G.version
    gm.upto = L

cdef struct SpecArgs:
    int32_t max_tokens, max_nodes
    double factor, offset, min_prob
    bint tree

cdef inline int32_t draft_cap(SpecArgs* a, int32_t m) noexcept nogil:
    cdef int32_t k = <int32_t> (m * a.factor + a.offset + 1e-6)
    if k > a.max_tokens:
        k = a.max_tokens
    return k if k > 0 else 0

cdef void draft_copy(Draft* dst, Draft* src) noexcept nogil:
    memcpy(dst.tok, src.tok, src.n * sizeof(int32_t))
    memcpy(dst.par, src.par, src.n * sizeof(int32_t))
    memcpy(dst.prob, src.prob, src.n * sizeof(double))
    dst.n = src.n
    dst.score = src.score
    dst.match_len = src.match_len

cdef void speculate_one(Tree* R, GMatch* gm, Tree* G, SpecArgs* a, Draft* best, Draft* tmp, Item* heap) noexcept nogil:
    """Draft from the request's own tree and from the global tree; keep the higher score (ties: the request's)."""
    cdef Seq* S = &R.seqs[0]
    cdef int32_t D = R.max_depth, L = S.length, m, i = 0, v = ROOT, cap, nodes
    best.n = 0
    best.score = 0.0
    best.match_len = 0
    # own context: the active suffix of length m ends at a node; count >= 2 means an earlier occurrence exists
    m = D if L >= D else L
    while m >= 1:
        i = (L - m) % D
        v = S.act_node[i]
        if R.count[v] >= 2:
            break
        m -= 1
    if m >= 1:
        cap = draft_cap(a, m)
        nodes = a.max_nodes if a.tree else cap
        # at max depth the node's ref is this very occurrence: copy from the one before it instead
        draft_tree(R, v, m, S.act_pseq[i] if m == D else -1, S.act_pend[i], 0, cap, nodes, a.min_prob, a.tree,
                   best, heap)
        best.match_len = m
    if G.n_suffixes > 0:
        gmatch_update(G, gm, S.tok, L)
        m = gm.d
        if m >= 1:
            cap = draft_cap(a, m)
            nodes = a.max_nodes if a.tree else cap
            draft_tree(G, gm.node, m, -1, 0, -1, cap, nodes, a.min_prob, a.tree, tmp, heap)
            tmp.match_len = m
            if tmp.score > best.score:
                draft_copy(best, tmp)

# ---------------------------------------------------------------- Python-facing objects

cdef class _Scratch:
    """Draft buffers for one cache (not shared between caches, so two caches may speculate in two threads)."""
    cdef Draft a, b
    cdef Item* heap
    cdef int32_t cap

    def __cinit__(self, int cap):
        self.cap = cap
        self.a.tok = <int32_t*> PyMem_Malloc(cap * sizeof(int32_t))
        self.a.par = <int32_t*> PyMem_Malloc(cap * sizeof(int32_t))
        self.a.prob = <double*> PyMem_Malloc(cap * sizeof(double))
        self.b.tok = <int32_t*> PyMem_Malloc(cap * sizeof(int32_t))
        self.b.par = <int32_t*> PyMem_Malloc(cap * sizeof(int32_t))
        self.b.prob = <double*> PyMem_Malloc(cap * sizeof(double))
        # each pop emits at most one token and pushes one item, or branches and pushes up to KIDS
        self.heap = <Item*> PyMem_Malloc(((KIDS + 2) * cap + 4) * sizeof(Item))
        if (self.a.tok == NULL or self.a.par == NULL or self.a.prob == NULL or self.b.tok == NULL or
                self.b.par == NULL or self.b.prob == NULL or self.heap == NULL):
            raise MemoryError()

    def __dealloc__(self):
        PyMem_Free(self.a.tok); PyMem_Free(self.a.par); PyMem_Free(self.a.prob)
        PyMem_Free(self.b.tok); PyMem_Free(self.b.par); PyMem_Free(self.b.prob)
        PyMem_Free(self.heap)


cdef class SuffixTree:
    """One suffix tree: a request's context (one growing sequence), or the global history (many, evicted oldest first)."""
    cdef Tree T
    cdef readonly int max_depth
    cdef object fifo            # live sequence slots, oldest first
    cdef _Scratch scratch

    def __cinit__(self, int max_depth=64):
        if max_depth < 1 or max_depth > 65535:
            raise ValueError(f"max_depth must be in [1, 65535], got {max_depth}")
        self.max_depth = max_depth
        tree_init(&self.T, max_depth)
        from collections import deque
        self.fifo = deque()

    def __dealloc__(self):
        tree_free(&self.T)

    def add_sequence(self, const int32_t[::1] tokens, bint keep_open=False) -> int:
        """Index a new sequence; with keep_open it can grow later through extend()."""
        cdef int32_t s = seq_new(&self.T)
        self.fifo.append(s)
        self.extend(s, tokens)
        if not keep_open:
            seq_close(&self.T, s)
        return s

    def extend(self, int seq, const int32_t[::1] tokens):
        if seq < 0 or seq >= self.T.n_seqs or not self.T.seqs[seq].live or self.T.seqs[seq].act_node == NULL:
            raise ValueError(f"sequence {seq} is not open for appending")
        cdef int32_t n = tokens.shape[0]
        if n == 0:
            return
        with nogil:
            seq_extend(&self.T, seq, &tokens[0], n)

    def evict(self, long max_suffixes) -> int:
        """Evict up to max_suffixes suffixes, oldest sequence first; returns how many were evicted."""
        cdef long done = 0
        cdef int32_t s, take
        while done < max_suffixes and self.fifo:
            s = self.fifo[0]
            take = <int32_t> min(<long> (self.T.seqs[s].length - self.T.seqs[s].start), max_suffixes - done)
            with nogil:
                remove_suffixes(&self.T, s, self.T.seqs[s].start + take)
            done += take
            if self.T.seqs[s].start == self.T.seqs[s].length:
                seq_release(&self.T.seqs[s])
                self.fifo.popleft()
        return done

    @property
    def n_sequences(self) -> int:
        return len(self.fifo)

    @property
    def n_tokens(self) -> int:
        """Live (not evicted) suffix starts, i.e. indexed tokens."""
        return self.T.n_suffixes

    @property
    def n_nodes(self) -> int:
        return self.T.n_live

    @property
    def version(self) -> int:
        return self.T.version

    def memory_bytes(self) -> int:
        return tree_bytes(&self.T)

    def sequences(self):
        """[(tokens, first live suffix start)] oldest first: copies."""
        cdef Seq* S
        out = []
        for s in self.fifo:
            S = &self.T.seqs[<int32_t> s]
            arr = np.empty(S.length, dtype=np.int32)
            for k in range(S.length):
                arr[k] = S.tok[k]
            out.append((arr, S.start))
        return out

    def starts_with_sequence(self, int seq, const int32_t[::1] tokens) -> bool:
        """Do `tokens` begin with the whole of sequence `seq`?"""
        cdef Seq* S = &self.T.seqs[seq]
        if tokens.shape[0] < S.length:
            return False
        if S.length == 0:
            return True
        return memcmp(&tokens[0], S.tok, S.length * sizeof(int32_t)) == 0

    def check(self):
        """Verify every invariant against a recount from the sequences (tests and debugging; O(n * depth))."""
        cdef Tree* T = &self.T
        cdef dict counts = {}
        cdef int32_t s, st, d, lim, v, c, n, k, live = 0, hl = 0
        for s in self.fifo:
            for st in range(T.seqs[s].start, T.seqs[s].length):
                lim = min(T.max_depth, T.seqs[s].length - st)
                v = ROOT
                d = 0
                while d < lim:
                    c = lookup(T, v, T.seqs[s].tok[st + d])
                    assert c != NONE, f"missing child for suffix {st} of sequence {s} at depth {d}"
                    assert T.depth[c] <= lim, f"suffix {st} of sequence {s} ends inside an edge"
                    for k in range(d, T.depth[c]):
                        assert edge_token(T, c, k) == T.seqs[s].tok[st + k], "edge label mismatch"
                    counts[c] = counts.get(c, 0) + 1
                    v = c
                    d = T.depth[c]
        for n in range(1, T.n_nodes):
            if T.parent[n] == FREED:
                continue
            live += 1
            assert counts.get(n, 0) == T.count[n], f"node {n}: count {T.count[n]} != {counts.get(n, 0)} occurrences"
            assert lookup(T, T.parent[n], T.token[n]) == n, f"node {n} unreachable through the hash"
            assert T.depth[n] > T.depth[T.parent[n]]
            assert T.seqs[T.rseq[n]].live and T.rend[n] <= T.seqs[T.rseq[n]].length, f"node {n}: dangling ref"
            c = T.child[n]
            if c != NONE and T.sib[c] == NONE:
                assert T.count[c] < T.count[n], f"node {n} should have been merged into its only child"
            while c != NONE:
                assert T.parent[c] == n
                c = T.sib[c]
        for k in range(<int32_t> (T.hmask + 1)):
            if T.slots[k] != NONE:
                hl += 1
        assert live + 1 == T.n_live, f"{live + 1} reachable nodes, {T.n_live} allocated"
        assert hl == live == T.hcount, f"hash holds {hl}, {live} live nodes"
        return True

    cdef _Scratch scratch_for(self, int32_t need):
        if self.scratch is None or self.scratch.cap < need:
            self.scratch = _Scratch(need)
        return self.scratch


cdef class RequestState:
    """A request's own suffix tree (one growing sequence: its prompt and output so far) and its match state in the
    global tree."""
    cdef readonly SuffixTree tree
    cdef GMatch gm
    cdef public int prompt_len      # where this request's response starts
    cdef public int indexed_from    # tokens before this came with the tree from an earlier request (a session)
    cdef public bint finished

    def __cinit__(self, SuffixTree tree, int prompt_len, int indexed_from=0):
        self.tree = tree
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
        return self.tree.T.seqs[0].length

    def tokens(self, int start=0):
        cdef Seq* S = &self.tree.T.seqs[0]
        arr = np.empty(max(0, S.length - start), dtype=np.int32)
        cdef int32_t[::1] view = arr
        if S.length > start:
            memcpy(&view[0], S.tok + start, (S.length - start) * sizeof(int32_t))
        return arr


cdef object to_proposal(Draft* d):
    cdef int32_t k
    return Proposal([d.tok[k] for k in range(d.n)], [d.par[k] for k in range(d.n)],
                    [d.prob[k] for k in range(d.n)], d.score, "suffix", d.match_len if d.n else 0, None)


def speculate(list requests, SuffixTree glob, int max_tokens, int max_nodes, double factor, double offset,
              double min_prob, bint tree):
    """Proposals for one or more requests, drafted with the GIL released.

    Callers serialise access to the trees (SuffixCache holds a lock); releasing the GIL lets other Python threads
    (a model runner, say) progress meanwhile.
    """
    cdef SpecArgs a
    a.max_tokens = max_tokens
    a.max_nodes = max_nodes
    a.factor = factor
    a.offset = offset
    a.min_prob = min_prob
    a.tree = tree
    cdef int32_t need = (max_nodes if tree else max_tokens) + 1
    cdef _Scratch sc = glob.scratch_for(need)
    cdef Tree* G = &glob.T
    cdef RequestState r
    cdef int32_t nreq = len(requests), k
    if nreq == 1:
        r = requests[0]
        with nogil:
            speculate_one(&r.tree.T, &r.gm, G, &a, &sc.a, &sc.b, sc.heap)
        return [to_proposal(&sc.a)]
    cdef Draft* drafts = <Draft*> PyMem_Malloc(nreq * sizeof(Draft))
    cdef Tree** trees = <Tree**> PyMem_Malloc(nreq * sizeof(Tree*))
    cdef GMatch** gms = <GMatch**> PyMem_Malloc(nreq * sizeof(GMatch*))
    cdef int32_t* buf_t = <int32_t*> PyMem_Malloc(nreq * need * sizeof(int32_t))
    cdef int32_t* buf_p = <int32_t*> PyMem_Malloc(nreq * need * sizeof(int32_t))
    cdef double* buf_q = <double*> PyMem_Malloc(nreq * need * sizeof(double))
    cdef list out = []
    try:
        if drafts == NULL or trees == NULL or gms == NULL or buf_t == NULL or buf_p == NULL or buf_q == NULL:
            raise MemoryError()
        for k in range(nreq):
            r = requests[k]
            trees[k] = &r.tree.T
            gms[k] = &r.gm
            drafts[k].tok = buf_t + k * need
            drafts[k].par = buf_p + k * need
            drafts[k].prob = buf_q + k * need
        with nogil:
            for k in range(nreq):
                speculate_one(trees[k], gms[k], G, &a, &drafts[k], &sc.b, sc.heap)
        for k in range(nreq):
            out.append(to_proposal(&drafts[k]))
    finally:
        PyMem_Free(drafts); PyMem_Free(trees); PyMem_Free(gms)
        PyMem_Free(buf_t); PyMem_Free(buf_p); PyMem_Free(buf_q)
    return out
