# Part of _tree.pyx (textually included there, one compiled module): node storage, sibling lists and the child hash.

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

