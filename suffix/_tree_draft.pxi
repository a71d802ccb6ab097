# Part of _tree.pyx (textually included there, one compiled module): drafting: the best-first tree walk, the global match, one request's speculation.

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

