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

cdef struct Node:
    int32_t count          # occurrences of the node's string
    int32_t parent
    int32_t token          # first token of the edge into this node
    uint32_t rend          # arena position just after the most recent occurrence of the node's string
    int32_t child          # best-ranked child, then the next TOP-1 in rank order (unless STALE); a doubly linked
                           # sibling list
    int32_t sib
    int32_t psib
    uint16_t depth         # string depth at the node's end
    uint16_t ends          # occurrences of the node's string that end here (count - sum of the children's counts,
                           # saturating at ENDS_MAX), | STALE

cdef struct Seq:
    uint32_t base          # arena position of the first token
    int32_t length
    int32_t start          # suffixes starting before base + start are evicted

cdef struct Tree:
    int32_t max_depth
    Node* nodes
    int32_t n_nodes, cap_nodes, free_head, n_live
    int32_t* slots         # hash: node index or NONE
    uint32_t hmask
    int32_t hcount
    int32_t* tok           # token ring: position p lives at tok[p & tok_mask]
    uint32_t tok_begin, tok_end, tok_mask   # live positions are [tok_begin, tok_end)
    Seq* seqs              # FIFO of live sequences: seqs[head:n_seqs]
    int32_t head, n_seqs, cap_seqs
    bint open              # the last sequence still grows
    int32_t* act_node      # its active suffix ends, a ring indexed by (start - base) % max_depth
    uint32_t* act_prev     # end of the most recent earlier occurrence of each active suffix
    int64_t version        # bumped by every change; match states compare it
    int64_t n_suffixes     # live suffix starts (indexed tokens)
    int32_t* stack
    int32_t stack_cap

# ---------------------------------------------------------------- memory

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
    T.max_depth = max_depth
    T.nodes = NULL; T.n_nodes = 0; T.cap_nodes = 0; T.free_head = NONE; T.n_live = 0
    T.slots = NULL; T.hcount = 0
    T.tok = NULL; T.tok_begin = 0; T.tok_end = 0; T.tok_mask = 0
    T.seqs = NULL; T.head = 0; T.n_seqs = 0; T.cap_seqs = 0
    T.open = False
    T.act_node = NULL; T.act_prev = NULL
    T.n_suffixes = 0
    T.stack = NULL; T.stack_cap = 0
    # versions are unique across trees, so a match state can never mistake a replaced tree for its own
    _version_base += 1 << 40
    T.version = _version_base
    T.slots = <int32_t*> PyMem_Malloc(64 * sizeof(int32_t))
    T.act_node = <int32_t*> PyMem_Malloc(max_depth * sizeof(int32_t))
    T.act_prev = <uint32_t*> PyMem_Malloc(max_depth * sizeof(uint32_t))
    T.tok = <int32_t*> PyMem_Malloc(64 * sizeof(int32_t))
    T.tok_mask = 63
    if T.slots == NULL or T.act_node == NULL or T.act_prev == NULL or T.tok == NULL:
        raise MemoryError()
    for i in range(64):
        T.slots[i] = NONE
    T.hmask = 63
    node_alloc(T)            # the root: index 0
    T.nodes[ROOT].parent = NONE
    T.nodes[ROOT].token = NONE
    T.nodes[ROOT].depth = 0
    return 0

cdef void tree_free(Tree* T) noexcept:
    PyMem_Free(T.nodes); PyMem_Free(T.slots); PyMem_Free(T.tok); PyMem_Free(T.seqs)
    PyMem_Free(T.act_node); PyMem_Free(T.act_prev); PyMem_Free(T.stack)
    T.nodes = NULL; T.slots = NULL; T.tok = NULL; T.seqs = NULL; T.act_node = NULL; T.act_prev = NULL; T.stack = NULL

cdef size_t tree_bytes(Tree* T) noexcept nogil:
    return (<size_t> T.cap_nodes * sizeof(Node) + (<size_t> T.hmask + 1) * sizeof(int32_t)
            + (<size_t> T.tok_mask + 1) * sizeof(int32_t) + <size_t> T.cap_seqs * sizeof(Seq)
            + 2 * <size_t> T.max_depth * sizeof(int32_t))

# ---------------------------------------------------------------- nodes and sibling lists

cdef int32_t node_alloc(Tree* T) except -1 nogil:
    cdef int32_t n, cap
    if T.free_head != NONE:
        n = T.free_head
        T.free_head = T.nodes[n].sib
    else:
        if T.n_nodes == T.cap_nodes:
            cap = T.cap_nodes + T.cap_nodes // 4 + 64
            _grow(<void**> &T.nodes, cap * sizeof(Node))
            T.cap_nodes = cap
        n = T.n_nodes
        T.n_nodes += 1
    cdef Node* x = &T.nodes[n]
    x.count = 0
    x.ends = 0
    x.child = NONE
    x.sib = NONE
    x.psib = NONE
    x.rend = 0
    T.n_live += 1
    return n

cdef inline void node_free(Tree* T, int32_t n) noexcept nogil:
    T.nodes[n].parent = FREED
    T.nodes[n].count = 0
    T.nodes[n].sib = T.free_head
    T.free_head = n
    T.n_live -= 1

cdef inline void list_link(Node* N, int32_t v, int32_t c) noexcept nogil:
    N[c].psib = NONE
    N[c].sib = N[v].child
    if N[v].child != NONE:
        N[N[v].child].psib = c
    N[v].child = c

cdef inline void list_unlink(Node* N, int32_t c) noexcept nogil:
    if N[c].psib != NONE:
        N[N[c].psib].sib = N[c].sib
    else:
        N[N[c].parent].child = N[c].sib
    if N[c].sib != NONE:
        N[N[c].sib].psib = N[c].psib

cdef inline void link_after(Node* N, int32_t a, int32_t c) noexcept nogil:
    N[c].psib = a
    N[c].sib = N[a].sib
    if N[a].sib != NONE:
        N[N[a].sib].psib = c
    N[a].sib = c

cdef inline void link_ranked(Node* N, int32_t v, int32_t c, bint linked) noexcept nogil:
    """Keep v's first TOP children ranked as c (linked already, or not) gains an occurrence that is the most recent
    among its siblings: c ranks before every sibling whose count it ties, so it goes before the first of the front
    TOP with a count no higher than its own. The other counts did not change: where c stays out of the front, the
    front is still the TOP best."""
    cdef int32_t p = NONE, x = N[v].child, i = 0
    while x != NONE and x != c and i < TOP and N[x].count > N[c].count:
        p = x
        x = N[x].sib
        i += 1
    if linked:
        if x == c or i == TOP:
            return                  # in its place already, or still ranked below the front
        list_unlink(N, c)
    if p == NONE:
        list_link(N, v, c)
    else:
        link_after(N, p, c)

cdef inline bint in_front(Node* N, int32_t v, int32_t c) noexcept nogil:
    """Is c among the first TOP of v's sibling list?"""
    cdef int32_t x = N[v].child, i = 0
    while x != NONE and i < TOP:
        if x == c:
            return True
        x = N[x].sib
        i += 1
    return False

cdef inline void ends_add(Node* x, int d) noexcept nogil:
    if (x.ends & ENDS_MAX) != ENDS_MAX:
        x.ends += d

cdef inline void list_replace(Node* N, int32_t old, int32_t new) noexcept nogil:
    """`new` takes `old`'s place among its siblings (their parents must already agree)."""
    N[new].sib = N[old].sib
    N[new].psib = N[old].psib
    if N[old].psib != NONE:
        N[N[old].psib].sib = new
    else:
        N[N[old].parent].child = new
    if N[old].sib != NONE:
        N[N[old].sib].psib = new

# ---------------------------------------------------------------- hash (parent, first token) -> child

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
            return NONE
        if T.nodes[n].parent == p and T.nodes[n].token == t:
            return <int32_t> i
        i = (i + 1) & T.hmask

cdef inline bint hashed(Node* N, int32_t c) noexcept nogil:
    """Only a child with siblings is in the hash: an only child is found as its parent's first, so the commonest
    edits (a path extended, an edge split) re-key no hash entry."""
    return N[c].sib != NONE or N[c].psib != NONE

cdef inline int32_t lookup(Tree* T, int32_t p, int32_t t) noexcept nogil:
    cdef int32_t c = T.nodes[p].child
    if c == NONE:
        return NONE
    if T.nodes[c].token == t:
        return c              # the best-ranked child, the usual continuation: no probe
    if T.nodes[c].sib == NONE:
        return NONE           # an only child, and not t's
    cdef int32_t s = h_find_slot(T, p, t)
    return T.slots[s] if s != NONE else NONE

cdef inline void h_put_raw(Tree* T, int32_t n) noexcept nogil:
    cdef uint32_t i = hkey(T.nodes[n].parent, T.nodes[n].token) & T.hmask
    while T.slots[i] != NONE:
        i = (i + 1) & T.hmask
    T.slots[i] = n

cdef int h_insert(Tree* T, int32_t n) except -1 nogil:
    cdef uint32_t cap, i
    cdef int32_t* old
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
            if old[i] != NONE:
                h_put_raw(T, old[i])
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
        k = hkey(T.nodes[n].parent, T.nodes[n].token) & T.hmask
        if (hole <= j and hole < k and k <= j) or (hole > j and (hole < k or k <= j)):
            continue
        T.slots[hole] = n
        hole = j
    T.slots[hole] = NONE
    T.hcount -= 1

cdef inline void h_delete(Tree* T, int32_t p, int32_t t) noexcept nogil:
    cdef int32_t s = h_find_slot(T, p, t)
    if s != NONE:
        h_delete_slot(T, s)

cdef inline void h_replace(Tree* T, int32_t old, int32_t new) noexcept nogil:
    """The hash entry of `old` now points at `new` (which has taken old's parent and first token)."""
    cdef uint32_t i = hkey(T.nodes[old].parent, T.nodes[old].token) & T.hmask
    while T.slots[i] != old:
        i = (i + 1) & T.hmask
    T.slots[i] = new

cdef inline int32_t edge_token(Tree* T, int32_t n, int32_t d) noexcept nogil:
    """Token at string depth d (0-based) of node n's string, read from its reference occurrence."""
    return T.tok[(T.nodes[n].rend - T.nodes[n].depth + <uint32_t> d) & T.tok_mask]

cdef int free_subtree(Tree* T, int32_t c) except -1 nogil:
    cdef Node* N = T.nodes
    cdef int32_t top = 0, x, y, p = N[c].parent
    if hashed(N, c):
        h_delete(T, p, N[c].token)
        list_unlink(N, c)
        if N[N[p].child].sib == NONE:
            h_delete(T, p, N[N[p].child].token)      # left an only child
    else:
        list_unlink(N, c)
    if T.stack_cap == 0:
        _grow(<void**> &T.stack, 64 * sizeof(int32_t))
        T.stack_cap = 64
    T.stack[top] = c
    top += 1
    while top > 0:
        top -= 1
        x = T.stack[top]
        y = N[x].child
        while y != NONE:
            if hashed(N, y):
                h_delete(T, x, N[y].token)
            if top == T.stack_cap:
                _grow(<void**> &T.stack, 2 * T.stack_cap * sizeof(int32_t))
                T.stack_cap *= 2
            T.stack[top] = y
            top += 1
            y = N[y].sib
        node_free(T, x)
    return 0

# ---------------------------------------------------------------- insertion

cdef int seq_begin(Tree* T) except -1 nogil:
    if T.n_seqs == T.cap_seqs:
        if T.head > 0:
            memmove(T.seqs, T.seqs + T.head, (T.n_seqs - T.head) * sizeof(Seq))
            T.n_seqs -= T.head
            T.head = 0
        else:
            _grow(<void**> &T.seqs, (T.cap_seqs * 2 + 4) * sizeof(Seq))
            T.cap_seqs = T.cap_seqs * 2 + 4
    T.seqs[T.n_seqs].base = T.tok_end
    T.seqs[T.n_seqs].length = 0
    T.seqs[T.n_seqs].start = 0
    T.n_seqs += 1
    T.open = True
    return 0

cdef int ring_reserve(Tree* T, uint32_t n) except -1 nogil:
    """Make room for n more live positions: a bigger ring takes the live window at the same positions."""
    cdef uint64_t need = <uint64_t> (T.tok_end - T.tok_begin) + n, cap = <uint64_t> T.tok_mask + 1
    cdef uint32_t p
    cdef int32_t* old
    if need <= cap:
        return 0
    while cap < need:
        cap *= 2
    old = T.tok
    with gil:
        T.tok = <int32_t*> PyMem_Malloc(cap * sizeof(int32_t))
        if T.tok == NULL:
            T.tok = old
            raise MemoryError()
    p = T.tok_begin
    while p != T.tok_end:
        T.tok[p & (cap - 1)] = old[p & T.tok_mask]
        p += 1
    T.tok_mask = <uint32_t> (cap - 1)
    with gil:
        PyMem_Free(old)
    return 0

cdef int seq_extend(Tree* T, const int32_t* toks, int32_t n) except -1 nogil:
    """Append tokens to the open (last) sequence."""
    cdef int32_t k
    ring_reserve(T, n)
    for k in range(n):
        append_token(T, toks[k])
    T.version += 1
    return 0

cdef int append_token(Tree* T, int32_t t) except -1 nogil:
    """Extend every active suffix of the open sequence by t: O(max_depth) steps, most without a hash probe."""
    cdef Seq* S = &T.seqs[T.n_seqs - 1]
    cdef Node* N
    cdef int32_t D = T.max_depth
    cdef int32_t L = S.length
    cdef int32_t first = L - D + 1 if L - D + 1 > 0 else 0
    cdef uint32_t e = S.base + <uint32_t> L + 1      # end of every extended suffix
    cdef int32_t st, i, v, c, n
    cdef uint32_t prev
    T.tok[T.tok_end & T.tok_mask] = t
    T.tok_end += 1
    S.length = L + 1
    T.act_node[L % D] = ROOT
    T.nodes[ROOT].count += 1
    ends_add(&T.nodes[ROOT], 1)    # the new empty suffix, extended below like the others
    T.n_suffixes += 1
    for st in range(first, L + 1):
        i = st % D
        v = T.act_node[i]
        c = lookup(T, v, t)
        N = T.nodes
        prev = 0
        if c == NONE:
            if v != ROOT and N[v].count == 1:
                # a leaf that only this suffix reaches: lengthen its edge in place
                N[v].depth += 1
                N[v].rend = e
            else:
                n = node_alloc(T)
                N = T.nodes
                N[n].parent = v
                N[n].token = t
                N[n].count = 1
                N[n].ends = 1
                N[n].depth = N[v].depth + 1
                N[n].rend = e
                ends_add(&N[v], -1)
                c = N[v].child
                if c != NONE:
                    if N[c].sib == NONE:
                        h_insert(T, c)        # an only child gets a sibling: both are hashed
                    h_insert(T, n)
                link_ranked(N, v, n, False)
                T.act_node[i] = n
        else:
            # the most recent earlier occurrence of str(v)+t ends where c's ref says, shortened to that length
            prev = N[c].rend - <uint32_t> (N[c].depth - N[v].depth - 1)
            if v != ROOT and N[v].count == N[c].count + 1:
                # only this suffix ends at v; everything else continues into c
                # (so c is v's only child, in no hash entry)
                if N[c].depth == N[v].depth + 1:
                    # c's edge is one token long: c takes v's place
                    N[c].parent = N[v].parent
                    N[c].token = N[v].token
                    if hashed(N, v):
                        h_replace(T, v, c)
                    list_replace(N, v, c)     # same count and most recent occurrence as v: same rank
                    N[c].count += 1
                    ends_add(&N[c], 1)
                    N[c].rend = e
                    node_free(T, v)
                    T.act_node[i] = c
                else:
                    # move v's end one token down c's edge
                    N[v].depth += 1
                    N[v].rend = e
                    N[c].token = edge_token(T, c, N[v].depth)
            elif N[c].depth == N[v].depth + 1:
                N[c].count += 1
                ends_add(&N[c], 1)
                ends_add(&N[v], -1)
                N[c].rend = e
                link_ranked(N, v, c, True)
                T.act_node[i] = c
            else:
                # split c's edge after its first token
                n = node_alloc(T)
                N = T.nodes
                N[n].parent = v
                N[n].token = t
                N[n].count = N[c].count + 1
                N[n].ends = 1
                N[n].depth = N[v].depth + 1
                N[n].rend = e
                ends_add(&N[v], -1)
                if hashed(N, c):
                    h_replace(T, c, n)
                list_replace(N, c, n)
                link_ranked(N, v, n, True)
                N[c].parent = n
                N[c].token = edge_token(T, c, N[n].depth)
                list_link(N, n, c)            # n's only child
                T.act_node[i] = n
        T.act_prev[i] = prev
    return 0

# ---------------------------------------------------------------- eviction

cdef int remove_suffixes(Tree* T, Seq* S, int32_t upto) except -1 nogil:
    """Evict the suffixes of sequence S that start in [S.start, upto)."""
    cdef Node* N = T.nodes
    cdef int32_t D = T.max_depth, st, d, lim, v, c, ch
    for st in range(S.start, upto):
        lim = S.length - st
        if lim > D:
            lim = D
        v = ROOT
        d = 0
        N[ROOT].count -= 1
        while d < lim:
            c = lookup(T, v, T.tok[(S.base + <uint32_t> (st + d)) & T.tok_mask])
            N[c].count -= 1
            if N[c].sib != NONE and in_front(N, v, c):
                # a later sibling may now rank before c: the front is found again by the next draft that needs it,
                # not here (at the root that would be a scan over the vocabulary per evicted suffix)
                N[v].ends |= STALE
            if N[c].count == 0:
                free_subtree(T, c)
                break
            v = c
            d = N[c].depth
        if d == lim:
            ends_add(&N[v], -1)       # the suffix ended at v
        # only the last node's children or endings changed: it may now be a chain link to merge away
        if v != ROOT:
            ch = N[v].child
            if ch != NONE and N[ch].sib == NONE and N[ch].count == N[v].count:
                N[ch].parent = N[v].parent
                N[ch].token = N[v].token
                if hashed(N, v):
                    h_replace(T, v, ch)
                list_replace(N, v, ch)
                node_free(T, v)
        T.n_suffixes -= 1
    S.start = upto
    T.version += 1
    return 0

# ---------------------------------------------------------------- drafting

cdef struct Draft:
    int32_t* tok
    int32_t* par
    double* prob
    int32_t n
    double score
    int32_t match_len

cdef struct Item:          # a position to expand, in best-first order
    double prob
    int64_t order
    int32_t node, d        # tree position: on node's edge at string depth d (d == node depth: at its end)
    bint copy              # copy mode: positions [cpos, cend) of the arena, then (cself) the draft itself
    bint cself
    uint32_t cpos, cend
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

cdef inline bint ranks_before(Node* N, int32_t a, int32_t b) noexcept nogil:
    """Sibling order for drafting: higher count first, then the more recent occurrence (siblings' strings
    continue the same parent string, so where their refs start orders their recency)."""
    if N[a].count != N[b].count:
        return N[a].count > N[b].count
    return <int32_t> ((N[a].rend - N[a].depth) - (N[b].rend - N[b].depth)) > 0

cdef inline void insert_ranked(Node* N, int32_t* kids, int32_t* m, int32_t cap, int32_t lo, int32_t c) noexcept nogil:
    """Insert child c into kids[lo:m], kept in rank order and at most cap long (c is dropped if it would be last)."""
    cdef int32_t j
    if m[0] == cap and not ranks_before(N, c, kids[cap - 1]):
        return
    j = m[0] if m[0] < cap else cap - 1
    while j > lo and ranks_before(N, c, kids[j - 1]):
        kids[j] = kids[j - 1]
        j -= 1
    kids[j] = c
    if m[0] < cap:
        m[0] += 1

cdef int32_t best_child(Node* N, int32_t u) noexcept nogil:
    """u's best-ranked child (NONE for a leaf): its first child, the next TOP-1 after it in rank order; found again
    and moved to the front if eviction made the list stale."""
    cdef int32_t top[TOP]
    cdef int32_t m = 0, j, c
    if N[u].ends & STALE:
        N[u].ends &= ENDS_MAX
        c = N[u].child
        while c != NONE:
            insert_ranked(N, top, &m, TOP, 0, c)
            c = N[c].sib
        for j in range(m - 1, -1, -1):
            list_unlink(N, top[j])
            list_link(N, u, top[j])
    return N[u].child

cdef int64_t child_total(Node* N, int32_t u) noexcept nogil:
    """Occurrences of u's string that continue into a child (the denominator of the children's probabilities)."""
    cdef int64_t total = 0
    cdef int32_t c
    if (N[u].ends & ENDS_MAX) != ENDS_MAX:
        return N[u].count - (N[u].ends & ENDS_MAX)
    c = N[u].child
    while c != NONE:
        total += N[c].count
        c = N[c].sib
    return total

cdef int32_t path_token(Draft* out, int32_t node, int32_t k, int32_t node_depth) noexcept nogil:
    """Token at draft depth k on the path ending at draft node `node` (at draft depth node_depth)."""
    while node_depth > k:
        node = out.par[node]
        node_depth -= 1
    return out.tok[node]

cdef uint32_t seq_end_of(Tree* T, uint32_t pos) noexcept nogil:
    """End of the live sequence holding position pos-1 (pos is an occurrence's end)."""
    cdef int32_t lo = T.head, hi = T.n_seqs - 1, mid
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if <int32_t> (T.seqs[mid].base - pos) < 0:
            lo = mid
        else:
            hi = mid - 1
    return T.seqs[lo].base + <uint32_t> T.seqs[lo].length

cdef void draft_tree(Tree* T, int32_t start_node, int32_t start_d, bint start_copy, uint32_t copy_from, int32_t max_tokens,
                     int32_t max_nodes, double min_prob, bint branch, Draft* out, Item* heap) noexcept nogil:
    """Best-first draft from a matched position. Path mode (branch=0) follows only the best child: the heap holds one
    item at a time and the result is the greedy path. With start_copy it starts by copying from position copy_from.
    An open tree is a request's own context: copies from it may run on into the draft itself (LZ77-style overlap)."""
    cdef Node* N = T.nodes
    cdef int32_t nh = 0, D = T.max_depth, u, c, k, m, nk
    cdef int64_t order = 0, total
    cdef double pr
    cdef Item it, nx
    cdef int32_t kids[KIDS]
    it.prob = 1.0; it.order = 0; it.node = start_node; it.d = start_d; it.parent = -1; it.ddepth = 0
    it.copy = start_copy
    it.cpos = copy_from
    it.cself = T.open
    it.cend = T.tok_end if T.open or not start_copy else seq_end_of(T, copy_from)
    out.n = 0
    out.score = 0.0
    heap_push(heap, &nh, it)
    while nh > 0 and out.n < max_nodes:
        it = heap_pop(heap, &nh)
        if it.prob < min_prob:
            continue
        if not it.copy and it.d == N[it.node].depth and it.d < D:
            # at a node's end below max depth: branch on its best children
            u = it.node
            c = best_child(N, u)
            if c == NONE:
                continue
            total = child_total(N, u)
            if it.prob * (<double> N[c].count / <double> total) < min_prob:
                continue                  # not even the best child is likely enough
            kids[0] = c
            m = 1
            if branch:
                # the runners-up (tree mode): the front of the list is ranked, so they are read off it while likely
                # enough; only where all TOP are can the unranked rest hold more, and it is scanned
                c = N[c].sib
                while c != NONE and m < TOP and it.prob * (<double> N[c].count / <double> total) >= min_prob:
                    kids[m] = c
                    m += 1
                    c = N[c].sib
                while m >= TOP and c != NONE:
                    # a child below min_prob is never drafted: skip it here rather than rank it (wide nodes)
                    if it.prob * (<double> N[c].count / <double> total) >= min_prob:
                        insert_ranked(N, kids, &m, KIDS, TOP, c)
                    c = N[c].sib
            for k in range(m):
                pr = it.prob * (<double> N[kids[k]].count / <double> total)
                nx = it
                nx.prob = pr
                order += 1
                nx.order = order
                nx.node = kids[k]
                heap_push(heap, &nh, nx)
            continue
        if it.ddepth >= max_tokens:
            continue
        if it.copy:
            if <int32_t> (it.cend - it.cpos) > 0:
                nk = T.tok[it.cpos & T.tok_mask]
            elif it.cself and it.parent >= 0:
                nk = path_token(out, it.parent, <int32_t> (it.cpos - it.cend), it.ddepth - 1)
            else:
                continue
        elif it.d == N[it.node].depth:
            # at max depth: continue from the most recent occurrence, at the same place in the heap
            it.copy = True
            it.cpos = N[it.node].rend
            it.cend = T.tok_end if T.open else seq_end_of(T, it.cpos)
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
        if it.copy:
            nx.cpos = it.cpos + 1
        else:
            nx.d = it.d + 1
        order += 1
        nx.order = order
        heap_push(heap, &nh, nx)

# ---------------------------------------------------------------- a request's match in the global tree

cdef struct GMatch:          # the longest match in the global tree, advanced lazily
    int64_t version
    int32_t upto             # context length this state describes
    int32_t start            # the match is context[start:upto]
    int32_t node, d

cdef inline bint step(Tree* G, int32_t* u, int32_t* d, int32_t t) noexcept nogil:
    """Advance a tree position by one token; False (position unchanged) if the path does not continue."""
    cdef int32_t c
    if d[0] == G.nodes[u[0]].depth:
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

cdef int32_t longest_match(Tree* G, const int32_t* ctx, int32_t end, int32_t n, bint long_first,
                           int32_t* u, int32_t* d) noexcept nogil:
    """Length of the longest suffix of ctx[:end], at most n tokens, that occurs in G; (u, d) is where it ends.

    A suffix of an occurring string occurs too, so occurrence is monotone in the length: doubling from below (short
    matches are the common case), then bisection, costs O(n log n) steps where trying every start costs O(n^2) on
    long partial matches. With long_first the longest candidate is tried first (a match at max depth that goes on)."""
    cdef int32_t lo = 0, hi = n, m = 1, bu = ROOT, bd = 0
    if long_first and n > 0:
        if walk(G, ctx + end - n, n, u, d):
            return n
        hi = n - 1
    while m <= hi:
        if not walk(G, ctx + end - m, m, u, d):
            hi = m - 1
            break
        lo = m
        bu = u[0]; bd = d[0]
        m = 2 * m if 2 * m < hi else (hi if m < hi else hi + 1)
    while lo < hi:
        m = (lo + hi + 1) // 2
        if walk(G, ctx + end - m, m, u, d):
            lo = m
            bu = u[0]; bd = d[0]
        else:
            hi = m - 1
    u[0] = bu
    d[0] = bd
    return lo

cdef void gmatch_update(Tree* G, GMatch* gm, const int32_t* ctx, int32_t L) noexcept nogil:
    """Longest suffix of ctx[:L] (at most max_depth tokens) that occurs in G. Per new token the match grows by one
    step, or, where it cannot, loses tokens at its start only (the start never moves back). Any change to G
    invalidates the state (version) and it is found afresh."""
    cdef int32_t D = G.max_depth, i, m, u = ROOT, d = 0
    if gm.version != G.version or L - gm.upto > D or L < gm.upto:
        m = longest_match(G, ctx, L, D if L > D else L, False, &u, &d)
        gm.start = L - m; gm.node = u; gm.d = d
    else:
        for i in range(gm.upto, L):
            u = gm.node
            d = gm.d
            if d < D and step(G, &u, &d, ctx[i]):
                gm.node = u; gm.d = d
                continue
            m = longest_match(G, ctx, i + 1, i - gm.start, d == D, &u, &d)
            gm.start = i + 1 - m; gm.node = u; gm.d = d
    gm.version = G.version
    gm.upto = L

# ---------------------------------------------------------------- one request's speculation

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

cdef void merge_trees(Draft* first, Draft* second, int32_t max_nodes, Draft* mix, int32_t* idx,
                      Draft* out) noexcept nogil:
    """Union of two draft trees into `out` (which may be either of them): a token path both drafted is one node with
    the higher of its two path probabilities; then the max_nodes most probable nodes (ties: first's, then the earlier).
    A child is never more probable than its parent in either draft, hence in the union, and comes after it, so the
    kept nodes form a tree. out takes first's match length; mix and idx hold first.n + second.n entries."""
    cdef int32_t i, j, pm, n, keep
    draft_copy(mix, first)
    for j in range(second.n):
        pm = idx[second.par[j]] if second.par[j] >= 0 else -1
        i = 0
        while i < mix.n and not (mix.par[i] == pm and mix.tok[i] == second.tok[j]):
            i += 1
        if i == mix.n:
            mix.tok[i] = second.tok[j]
            mix.par[i] = pm
            mix.prob[i] = second.prob[j]
            mix.n += 1
        elif second.prob[j] > mix.prob[i]:
            mix.prob[i] = second.prob[j]
        idx[j] = i
    # stable insertion sort of the node indices by probability, most probable first
    n = mix.n
    for i in range(n):
        j = i
        while j > 0 and mix.prob[idx[n + j - 1]] < mix.prob[i]:
            idx[n + j] = idx[n + j - 1]
            j -= 1
        idx[n + j] = i
    keep = n if n < max_nodes else max_nodes
    for i in range(keep):          # idx[k] (k < n) becomes node k's new index
        idx[idx[n + i]] = i
    out.match_len = first.match_len
    out.n = keep
    out.score = 0.0
    for i in range(keep):
        j = idx[n + i]
        out.tok[i] = mix.tok[j]
        out.par[i] = idx[mix.par[j]] if mix.par[j] >= 0 else -1
        out.prob[i] = mix.prob[j]
        out.score += mix.prob[j]

cdef inline double backoff_floor(Draft* d, SpecArgs* a) noexcept nogil:
    """min_prob for a backoff draft joined with the tree d. Where d is full, a node must be more probable than d's
    least (its nodes come best first) to displace one: drafting from there gives the same union with less work, and
    where d's least is 1 nothing can (2: no backoff)."""
    if d.n < a.max_nodes or d.prob[d.n - 1] <= a.min_prob:
        return a.min_prob
    return d.prob[d.n - 1] if d.prob[d.n - 1] < 1.0 else 2.0

cdef int32_t longest_repeat(Tree* R) noexcept nogil:
    """Length of the longest suffix of an open tree's sequence that occurred earlier in it. The active suffix of
    length m ends at a node; count >= 2 means an earlier occurrence exists, and then one exists for every shorter
    suffix too, so bisection finds it."""
    cdef int32_t D = R.max_depth, L = <int32_t> R.tok_end, m, lo = 0, hi
    hi = D if L >= D else L
    while lo < hi:
        m = (lo + hi + 1) // 2
        if R.nodes[R.act_node[(L - m) % D]].count >= 2:
            lo = m
        else:
            hi = m - 1
    return lo

cdef void speculate_one(Tree* R, Tree* O, GMatch* gm, Tree* G, SpecArgs* a, Draft* best, Draft* tmp, Draft* mix,
                        int32_t* idx, Item* heap, Draft* extra) noexcept nogil:
    """Draft from the request's own tree (R: prompt and output), from the global tree, and for chains from the
    request's output alone (O). Chains: keep the highest score (ties: the earlier of own, global, output). Trees:
    the union of own and global, each tree's draft joined with the one from its longest shorter match that occurs
    more often, cut to max_nodes by path probability. `extra` is scratch for those."""
    cdef int32_t D = R.max_depth, L = <int32_t> R.tok_end, m, m2, lo, hi, i, v, cap, u, d, bu = ROOT
    cdef int64_t c
    cdef double floor
    best.n = 0
    best.score = 0.0
    best.match_len = 0
    m = longest_repeat(R)
    if m >= 1:
        i = (L - m) % D
        v = R.act_node[i]
        cap = draft_cap(a, m)
        # at max depth the node's ref is this very occurrence: copy from the one before it instead
        draft_tree(R, v, m, m == D, R.act_prev[i], cap, a.max_nodes if a.tree else cap, a.min_prob,
                   a.tree, best, heap)
        best.match_len = m
        floor = backoff_floor(best, a)
        if a.tree and m >= 2 and floor <= 1.0:
            # joined with the draft of the longest shorter suffix that occurs more often: the continuations of the
            # occurrences the long match does not reach (a backoff, as n-gram models blend shorter contexts)
            c = R.nodes[v].count
            lo = 0
            hi = m - 1
            while lo < hi:
                m2 = (lo + hi + 1) // 2
                if R.nodes[R.act_node[(L - m2) % D]].count > c:
                    lo = m2
                else:
                    hi = m2 - 1
            if lo >= 1:
                draft_tree(R, R.act_node[(L - lo) % D], lo, False, 0, draft_cap(a, lo), a.max_nodes, floor, True,
                           extra, heap)
                if extra.n > 0:
                    merge_trees(best, extra, a.max_nodes, mix, idx, best)
    if G.n_suffixes > 0:
        gmatch_update(G, gm, R.tok, L)
        m = gm.d
        if m >= 1:
            cap = draft_cap(a, m)
            draft_tree(G, gm.node, m, False, 0, cap, a.max_nodes if a.tree else cap, a.min_prob, a.tree, tmp, heap)
            tmp.match_len = m
            floor = backoff_floor(tmp, a)
            if a.tree and m >= 2 and floor <= 1.0:  # the same backoff
                c = G.nodes[gm.node].count
                lo = 0
                hi = m - 1
                while lo < hi:
                    m2 = (lo + hi + 1) // 2
                    if walk(G, R.tok + L - m2, m2, &u, &d) and G.nodes[u].count > c:
                        lo = m2
                        bu = u                # where the longest passing suffix ends: no walk again after
                    else:
                        hi = m2 - 1
                if lo >= 1:
                    draft_tree(G, bu, lo, False, 0, draft_cap(a, lo), a.max_nodes, floor, True, extra, heap)
                    if extra.n > 0:
                        merge_trees(tmp, extra, a.max_nodes, mix, idx, tmp)
            if a.tree and tmp.n > 0 and best.n > 0:
                if tmp.score > best.score:
                    merge_trees(tmp, best, a.max_nodes, mix, idx, best)
                else:
                    merge_trees(best, tmp, a.max_nodes, mix, idx, best)
            elif tmp.score > best.score:
                draft_copy(best, tmp)
    # The output alone: where a response repeats itself (a loop, a list), its own continuation is drafted even when
    # the prompt's occurrences of the same string outvote it in R.
    m = longest_repeat(O) if not a.tree else 0
    if m >= 1:
        L = <int32_t> O.tok_end
        i = (L - m) % D
        cap = draft_cap(a, m)
        draft_tree(O, O.act_node[i], m, m == D, O.act_prev[i], cap, cap, a.min_prob, False, tmp, heap)
        tmp.match_len = m
        if tmp.score > best.score:
            draft_copy(best, tmp)

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
