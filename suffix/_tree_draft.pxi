# Part of _tree.pyx (textually included there, one compiled module): drafting: the best-first walk of one tree.

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

cdef void draft_tree(Tree* T, int32_t start_node, int32_t start_d, bint start_copy, uint32_t copy_from,
                     int32_t max_tokens, int32_t max_nodes, double min_prob, bint branch, Draft* out,
                     Item* heap) noexcept nogil:
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
