"""The fused backward's Triton kernels (attention/triton_backward.py launches them).

One job: the kernels of the backward, from the rows' final out and lse (as a flash
backward): `row_delta_kernel`, delta_i = dout_i . out_i in float32 for every row and head;
`attention_dq_kernel`, one program per (query tile, head) over the forward's tiles, each
row's received then local keys (dq = scale * sum_j ds_ij k_j); and `attention_dkdv_kernel`,
one program per (key tile, key/value head) over a launch's key tiles, the query rows that see
its keys, every query head of its group (dk = scale * sum_i ds_ij q_i,
dv = sum_i p_ij dout_i), written once; with ATOMIC_DQ it also adds the rows' dq from its
keys to a float32 buffer by atomic adds (FlashAttention-2's backward: five products a block
where the two kernels take seven, and no dq kernel). ds_ij = p_ij (dout_i . v_j - delta_i),
delta_i = dout_i . out_i, p_ij = exp(scale q_i . k_j - lse_i), in base 2 here. The dk/dv
kernel computes p and ds transposed (keys as the matrix rows), so that all its products take
tiles as they come (on sm_90, four warpgroup MMAs a block, none transposing registers). The
dq and dk/dv kernels mask only the blocks a document or causal edge crosses: key blocks before a
one-document tile's first row, and row blocks past a key tile's last key whose document holds
the whole tile, are seen whole.
Imported on first use, as the forward's kernel (Triton reads TRITON_INTERPRET when imported).
"""

import triton
import triton.language as tl

from megatron_eod.attention.triton_tile_kernel import (_head_dims, _key_block, _query_tile, _rows,
                                                       _seen_whole)

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _ds(q, k, v, do, lse2, delta, visible, qk_scale):
    """(p, ds) of a block of rows against a block of keys, 0 where a row does not see a key."""
    p = tl.where(visible, tl.exp2(tl.dot(q, tl.trans(k)) * qk_scale - lse2[:, None]), 0.0)
    dp = tl.dot(do, tl.trans(v))
    return p, p * (dp - delta[:, None])


@triton.jit
def attention_dq_kernel(Q, K, V, RK, RV, DO, LSE, DELTA, DQ, TILES, ROW_START,
                        s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_rkt, s_rkh, s_rvt, s_rvh,
                        s_dot, s_doh, s_lt, s_lh, s_et, s_eh, s_dqt, s_dqh, qk_scale, sm_scale,
                        HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                        GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    head, kv_head, r_start, r_stop, l_start, q_stop, rows, row_ok, row_at, starts = \
        _query_tile(TILES, ROW_START, HEADS, GROUP, BLOCK_M)
    dims, dim_ok = _head_dims(HEAD_DIM, BLOCK_D)
    row_mask = row_ok[:, None] & dim_ok[None, :]
    q = _rows(Q, row_at, s_qt, head * s_qh, dims, row_mask)
    do = _rows(DO, row_at, s_dot, head * s_doh, dims, row_mask)
    lse2 = tl.load(LSE + row_at * s_lt + head * s_lh, mask=row_ok, other=0.0) * LOG2E
    delta = tl.load(DELTA + row_at * s_et + head * s_eh, mask=row_ok, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(r_start, r_stop, BLOCK_N):  # received rows: all visible
        cols, col_ok, k, v = _key_block(RK, RV, start, r_stop, s_rkt, kv_head * s_rkh, s_rvt,
                                        kv_head * s_rvh, dims, dim_ok, BLOCK_N)
        p, ds = _ds(q, k, v, do, lse2, delta, row_ok[:, None] & col_ok[None, :], qk_scale)
        dq = tl.dot(ds.to(k.dtype), k, dq)
    seen = _seen_whole(TILES, ROW_START, l_start, q_stop, HEADS, BLOCK_N)
    for start in range(l_start, seen, BLOCK_N):  # local rows, every key seen
        cols, col_ok, k, v = _key_block(K, V, start, q_stop, s_kt, kv_head * s_kh, s_vt,
                                        kv_head * s_vh, dims, dim_ok, BLOCK_N)
        p, ds = _ds(q, k, v, do, lse2, delta, row_ok[:, None], qk_scale)
        dq = tl.dot(ds.to(k.dtype), k, dq)
    for start in range(seen, q_stop, BLOCK_N):  # local rows: own document, causal
        cols, col_ok, k, v = _key_block(K, V, start, q_stop, s_kt, kv_head * s_kh, s_vt,
                                        kv_head * s_vh, dims, dim_ok, BLOCK_N)
        visible = (cols[None, :] >= starts[:, None]) & (cols[None, :] <= rows[:, None]) & \
            row_ok[:, None]
        p, ds = _ds(q, k, v, do, lse2, delta, visible, qk_scale)
        dq = tl.dot(ds.to(k.dtype), k, dq)
    tl.store(DQ + row_at[:, None] * s_dqt + head * s_dqh + dims[None, :],
             (dq * sm_scale).to(DQ.dtype.element_ty), mask=row_mask)


@triton.jit
def _dkdv_step(k, v, q, do, lse2, delta, visible, dk, dv, qk_scale):
    """A block of rows into the running dk, dv of a key block, keys as the matrix rows: p and
    ds transposed ([keys, rows]) are what the two products take, so no register tile is
    transposed (on sm_90 each product is one warpgroup MMA with k/v as its left operand).
    Also returns ds transposed in q's dtype (for `_add_dq`)."""
    p_t = tl.where(visible, tl.exp2(tl.dot(k, tl.trans(q)) * qk_scale - lse2[None, :]), 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv)
    ds_t = (p_t * (tl.dot(v, tl.trans(do)) - delta[None, :])).to(q.dtype)
    return tl.dot(ds_t, q, dk), dv, ds_t


@triton.jit
def _add_dq(DQ, ds_t, k, rows, row_ok, head, s_dqt, s_dqh, dims, dim_ok, sm_scale):
    """A block of rows' dq from a key block (scale * ds k), added to the float32 DQ by
    atomic adds (relaxed: only the sum matters), as FlashAttention-2's backward does."""
    dq_t = tl.dot(tl.trans(k), ds_t) * sm_scale
    tl.atomic_add(DQ + rows.to(tl.int64)[None, :] * s_dqt + head * s_dqh + dims[:, None], dq_t,
                  mask=row_ok[None, :] & dim_ok[:, None], sem="relaxed")


@triton.jit
def _row_block(Q, DO, LSE, DELTA, start, stop, head, s_qt, s_qh, s_dot, s_doh, s_lt, s_lh,
               s_et, s_eh, dims, dim_ok, BLOCK_M: tl.constexpr):
    """(rows start.., which are below stop, their q, dout, lse in base 2, delta) of one head;
    rows past stop read as 0 (they add nothing to dk or dv)."""
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < stop
    row_at = rows.to(tl.int64)
    row_mask = row_ok[:, None] & dim_ok[None, :]
    q = _rows(Q, row_at, s_qt, head * s_qh, dims, row_mask)
    do = _rows(DO, row_at, s_dot, head * s_doh, dims, row_mask)
    lse2 = tl.load(LSE + row_at * s_lt + head * s_lh, mask=row_ok, other=0.0) * LOG2E
    delta = tl.load(DELTA + row_at * s_et + head * s_eh, mask=row_ok, other=0.0)
    return rows, row_ok, q, do, lse2, delta


@triton.jit
def attention_dkdv_kernel(Q, K, V, DO, LSE, DELTA, DK, DV, DQ, KEY_TILES, ROW_START,
                          s_qt, s_qh, s_kt, s_kh, s_vt, s_vh, s_dot, s_doh, s_lt, s_lh,
                          s_et, s_eh, s_dkt, s_dkh, s_dvt, s_dvh, s_dqt, s_dqh, qk_scale,
                          sm_scale, KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_D: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                          ATOMIC_DQ: tl.constexpr):
    """Key tiles (k_start, k_stop, q_start, q_stop): keys k_start:k_stop of K/V (local rows
    with CAUSAL: each seen by the rows of its document from itself on; else received rows,
    seen by every row q_start:q_stop); dk/dv like K/V. With CAUSAL, the row blocks before
    the tile's last key are masked, and after it too where the tile holds the start of a
    document (packed short documents); the others see every key of the tile: no mask.
    With ATOMIC_DQ the rows' dq from these keys is added to DQ (float32, zeroed before) too,
    and no dq kernel is needed (DQ unread otherwise)."""
    tile = tl.program_id(0) // KV_HEADS
    kv_head = (tl.program_id(0) % KV_HEADS).to(tl.int64)
    k_start = tl.load(KEY_TILES + tile * 4)
    k_stop = tl.load(KEY_TILES + tile * 4 + 1)
    q_start = tl.load(KEY_TILES + tile * 4 + 2)
    q_stop = tl.load(KEY_TILES + tile * 4 + 3)
    cols = k_start + tl.arange(0, BLOCK_N)
    col_ok = cols < k_stop
    col_at = cols.to(tl.int64)
    dims, dim_ok = _head_dims(HEAD_DIM, BLOCK_D)
    col_mask = col_ok[:, None] & dim_ok[None, :]
    k = _rows(K, col_at, s_kt, kv_head * s_kh, dims, col_mask)
    v = _rows(V, col_at, s_vt, kv_head * s_vh, dims, col_mask)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    if CAUSAL:
        # Row blocks from the first at or past the last key see all the tile's keys when the
        # last key's document (every row from it to q_stop) starts at or before the first.
        # Relies on local key tiles' readers starting at the first key and ending with the
        # last key's document (plan/key_tiles.py; tests/plan/test_forward_tiles.py).
        past = q_start + tl.cdiv(k_stop - 1 - q_start, BLOCK_M) * BLOCK_M
        whole = tl.load(ROW_START + k_stop - 1) <= k_start
        unmasked = tl.where(whole, tl.minimum(past, q_stop), q_stop)
    else:
        unmasked = q_start
    for member in range(GROUP):  # the query heads reading this key/value head
        head = kv_head * GROUP + member
        if CAUSAL:  # (received keys: every block is seen whole)
            for start in range(q_start, unmasked, BLOCK_M):  # by the rows' document starts
                rows, row_ok, q, do, lse2, delta = _row_block(
                    Q, DO, LSE, DELTA, start, q_stop, head, s_qt, s_qh, s_dot, s_doh, s_lt,
                    s_lh, s_et, s_eh, dims, dim_ok, BLOCK_M)
                starts = tl.load(ROW_START + rows, mask=row_ok, other=0)
                visible = row_ok[None, :] & col_ok[:, None] & \
                    (cols[:, None] >= starts[None, :]) & (cols[:, None] <= rows[None, :])
                dk, dv, ds_t = _dkdv_step(k, v, q, do, lse2, delta, visible, dk, dv,
                                          qk_scale)
                if ATOMIC_DQ:
                    _add_dq(DQ, ds_t, k, rows, row_ok, head, s_dqt, s_dqh, dims, dim_ok,
                            sm_scale)
        for start in range(unmasked, q_stop, BLOCK_M):  # every key seen
            rows, row_ok, q, do, lse2, delta = _row_block(
                Q, DO, LSE, DELTA, start, q_stop, head, s_qt, s_qh, s_dot, s_doh, s_lt, s_lh,
                s_et, s_eh, dims, dim_ok, BLOCK_M)
            visible = row_ok[None, :] & col_ok[:, None]
            dk, dv, ds_t = _dkdv_step(k, v, q, do, lse2, delta, visible, dk, dv, qk_scale)
            if ATOMIC_DQ:
                _add_dq(DQ, ds_t, k, rows, row_ok, head, s_dqt, s_dqh, dims, dim_ok, sm_scale)
    tl.store(DK + col_at[:, None] * s_dkt + kv_head * s_dkh + dims[None, :],
             (dk * sm_scale).to(DK.dtype.element_ty), mask=col_mask)
    tl.store(DV + col_at[:, None] * s_dvt + kv_head * s_dvh + dims[None, :],
             dv.to(DV.dtype.element_ty), mask=col_mask)


@triton.jit
def row_delta_kernel(DO, O, DELTA, rows, s_dot, s_doh, s_ot, s_oh, s_et, s_eh,
                     HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr):
    """delta = rowsum(dout * out) in float32, one program per (block of BLOCK_T rows, head)."""
    head = tl.program_id(1).to(tl.int64)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < rows
    t_at = t.to(tl.int64)
    dims, dim_ok = _head_dims(HEAD_DIM, BLOCK_D)
    mask = t_ok[:, None] & dim_ok[None, :]
    do = _rows(DO, t_at, s_dot, head * s_doh, dims, mask).to(tl.float32)
    o = _rows(O, t_at, s_ot, head * s_oh, dims, mask).to(tl.float32)
    tl.store(DELTA + t_at * s_et + head * s_eh, tl.sum(do * o, 1), mask=t_ok)
