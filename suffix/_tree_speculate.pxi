# Part of _tree.pyx (textually included there, one compiled module): a request's match in the global tree, and
# one request's speculation from its own tree, the global tree and its output (drafts walked by _tree_draft.pxi).

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
