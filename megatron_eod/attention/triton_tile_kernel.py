"""The fused forward's Triton kernel (attention/triton_forward.py launches it).

One job: the kernel itself. Imported only when the fused forward is first used, so that
Triton is imported then (it reads TRITON_INTERPRET when first imported: tests set it before).
One program per (tile, head), heads fastest in the 1-D grid: the GPU starts programs in this
order, so every head of the longest tile starts first (heads slowest, the last head's longest
tiles would start last and run on alone), and heads sharing key/value heads run side by
side. A program reads its tile's received keys (all before every row: no mask), then its
documents' local keys from the first row's document start to each row (a per-row document
start masks: a tile may hold several short documents; the key blocks wholly before a
one-document tile's first row need no mask), in one online softmax in base 2, and writes
the rows' out and lse (natural log) once. Offsets are 64-bit (rows x a fused qkv's
row stride can pass 2^31).
"""

import triton
import triton.language as tl

LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


@triton.jit
def _rows(base, at, row_stride, head_offset, dims, mask):
    """[len(at), BLOCK_D] of rows `at` of one head (masked rows read as 0)."""
    return tl.load(base + at[:, None] * row_stride + head_offset + dims[None, :], mask=mask,
                   other=0.0)


@triton.jit
def _key_block(K, V, start, stop, s_kt, k_head, s_vt, v_head, dims, dim_ok,
               BLOCK_N: tl.constexpr):
    """(key rows start.., which are below stop, their k, their v) of one key/value head."""
    cols = start + tl.arange(0, BLOCK_N)
    col_ok = cols < stop
    at, mask = cols.to(tl.int64), col_ok[:, None] & dim_ok[None, :]
    return cols, col_ok, _rows(K, at, s_kt, k_head, dims, mask), _rows(V, at, s_vt, v_head,
                                                                        dims, mask)


@triton.jit
def _head_dims(HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """(the head dim's offsets, which are real): no mask where the block is the head dim, so
    that its loads stay vectorised."""
    dims = tl.arange(0, BLOCK_D)
    if HEAD_DIM == BLOCK_D:
        dim_ok = tl.full([BLOCK_D], 1, tl.int1)
    else:
        dim_ok = dims < HEAD_DIM
    return dims, dim_ok


@triton.jit
def _query_tile(TILES, ROW_START, HEADS: tl.constexpr, GROUP: tl.constexpr,
                BLOCK_M: tl.constexpr):
    """This program's query tile and head (heads fastest): (head, kv_head, r_start, r_stop,
    l_start, q_stop, rows, row_ok, rows in 64 bits, each row's document start)."""
    tile = tl.program_id(0) // HEADS
    head = (tl.program_id(0) % HEADS).to(tl.int64)
    q_start = tl.load(TILES + tile * 5)
    q_stop = tl.load(TILES + tile * 5 + 1)
    rows = q_start + tl.arange(0, BLOCK_M)
    row_ok = rows < q_stop
    starts = tl.load(ROW_START + rows, mask=row_ok, other=0)
    return (head, head // GROUP, tl.load(TILES + tile * 5 + 2), tl.load(TILES + tile * 5 + 3),
            tl.load(TILES + tile * 5 + 4), q_stop, rows, row_ok, rows.to(tl.int64), starts)


@triton.jit
def _seen_whole(TILES, ROW_START, l_start, q_stop, HEADS: tl.constexpr, BLOCK_N: tl.constexpr):
    """Where this program's local key blocks stop being seen whole by every row of its tile:
    the blocks from l_start wholly before the tile's first row, if the tile is one
    document's (its last row's document starts at l_start, its first row's: row starts
    never decrease, plan/forward_tiles.py); else l_start (every block masked)."""
    q_start = tl.load(TILES + (tl.program_id(0) // HEADS) * 5)
    whole = tl.load(ROW_START + q_stop - 1) <= l_start
    return tl.where(whole, l_start + (q_start + 1 - l_start) // BLOCK_N * BLOCK_N, l_start)


@triton.jit
def _softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale, MASKED: tl.constexpr = True):
    """One key block into the running (max, sum, out) of the rows: a block no key of which
    a row sees leaves the row as it was (its max stays -inf, its weights 0). Not MASKED:
    every row sees every key of the block (`visible` unread), so no row's max is -inf."""
    s = tl.dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.exp2(s - m_use[:, None])
    alpha = tl.exp2(m_i - m_use)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])  # accumulates in place
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def attention_tile_kernel(Q, K, V, RK, RV, O, LSE, TILES, ROW_START,
                          s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_rkt, s_rkh, s_rvt, s_rvh,
                          s_ot, s_oh, s_lt, s_lh, qk_scale,
                          HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                          GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    head, kv_head, r_start, r_stop, l_start, q_stop, rows, row_ok, row_at, starts = \
        _query_tile(TILES, ROW_START, HEADS, GROUP, BLOCK_M)
    dims, dim_ok = _head_dims(HEAD_DIM, BLOCK_D)
    q = _rows(Q, row_at, s_qt, head * s_qh, dims, row_ok[:, None] & dim_ok[None, :])
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(r_start, r_stop, BLOCK_N):  # received rows: all visible
        cols, col_ok, k, v = _key_block(RK, RV, start, r_stop, s_rkt, kv_head * s_rkh, s_rvt,
                                        kv_head * s_rvh, dims, dim_ok, BLOCK_N)
        m_i, l_i, acc = _softmax_step(q, k, v, col_ok[None, :], m_i, l_i, acc, qk_scale)
    seen = _seen_whole(TILES, ROW_START, l_start, q_stop, HEADS, BLOCK_N)
    for start in range(l_start, seen, BLOCK_N):  # local rows, every key seen: no mask
        cols, col_ok, k, v = _key_block(K, V, start, q_stop, s_kt, kv_head * s_kh, s_vt,
                                        kv_head * s_vh, dims, dim_ok, BLOCK_N)
        m_i, l_i, acc = _softmax_step(q, k, v, col_ok[None, :], m_i, l_i, acc, qk_scale,
                                      False)
    for start in range(seen, q_stop, BLOCK_N):  # local rows: own document, causal
        cols, col_ok, k, v = _key_block(K, V, start, q_stop, s_kt, kv_head * s_kh, s_vt,
                                        kv_head * s_vh, dims, dim_ok, BLOCK_N)
        visible = (cols[None, :] >= starts[:, None]) & (cols[None, :] <= rows[:, None])
        m_i, l_i, acc = _softmax_step(q, k, v, visible, m_i, l_i, acc, qk_scale)
    # Every row sees at least itself: l_i > 0 and m_i finite on the rows written.
    out = acc / l_i[:, None]
    tl.store(O + row_at[:, None] * s_ot + head * s_oh + dims[None, :],
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & dim_ok[None, :])
    tl.store(LSE + row_at * s_lt + head * s_lh, (m_i + tl.log2(l_i)) * LN2, mask=row_ok)
