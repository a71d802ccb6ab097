# Part of _tree.pyx (textually included there, one compiled module): insertion of a sequence's suffixes and eviction.

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

