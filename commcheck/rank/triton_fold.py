"""The Triton kernels of :mod:`device_fold` (imported only where Triton is: a module of
their own because Triton resolves a kernel's helpers among its module's globals)."""

import triton
import triton.language as tl


@triton.jit
def _mix(w, pos, k_pos, k_mul, k_out):
    y = (w ^ (pos * k_pos)) * k_mul
    return (y ^ (y >> 31)) * k_out


# The sizes are not specialised on (Triton would compile a variant per divisibility by 16).
@triton.jit(do_not_specialize=["n_words", "n_elems", "len_key"])
def fold(x_ptr, w_ptr, out_ptr, n_words, n_elems, len_key,
         ELEMS: tl.constexpr, WORDS: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    h0 = tl.zeros([WORDS], dtype=tl.uint64)
    h1 = tl.zeros([WORDS], dtype=tl.uint64)
    for start in range(pid * WORDS, n_words, step * WORDS):
        offs = start + tl.arange(0, WORDS)
        m = offs < n_words
        w = tl.load(w_ptr + offs, mask=m, other=0).to(tl.uint64, bitcast=True)
        pos = offs.to(tl.uint64)
        h0 += tl.where(m, _mix(w, pos, 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9,
                               0x94D049BB133111EB), 0)
        h1 += tl.where(m, _mix(w, pos, 0xC2B2AE3D27D4EB4F, 0x94D049BB133111EB,
                               0xBF58476D1CE4E5B9), 0)
    s = tl.zeros([ELEMS], dtype=tl.float64)
    amax = tl.zeros([ELEMS], dtype=tl.float64)
    nan = tl.zeros([ELEMS], dtype=tl.int64)
    inf = tl.zeros([ELEMS], dtype=tl.int64)
    for start in range(pid * ELEMS, n_elems, step * ELEMS):
        offs = start + tl.arange(0, ELEMS)
        m = offs < n_elems
        x = tl.load(x_ptr + offs, mask=m, other=0).to(tl.float64)
        bad = x != x
        s += x
        amax = tl.maximum(amax, tl.where(bad, 0.0, tl.abs(x)))
        nan += bad.to(tl.int64)
        inf += (tl.abs(x) == float("inf")).to(tl.int64)
    row = out_ptr + pid * 6
    tl.store(row, tl.sum(h0, 0).to(tl.int64, bitcast=True) ^ len_key)
    tl.store(row + 1, tl.sum(h1, 0).to(tl.int64, bitcast=True) ^ len_key)
    tl.store(row + 2, tl.sum(s, 0).to(tl.int64, bitcast=True))
    tl.store(row + 3, tl.max(amax, 0).to(tl.int64, bitcast=True))
    tl.store(row + 4, tl.sum(nan, 0).to(tl.float64).to(tl.int64, bitcast=True))
    tl.store(row + 5, tl.sum(inf, 0).to(tl.float64).to(tl.int64, bitcast=True))


@triton.jit(do_not_specialize=["n_parts", "len_key"])
def combine(part_ptr, out_ptr, n_parts, len_key, PARTS: tl.constexpr):
    i = tl.arange(0, PARTS)
    m = i < n_parts
    row = part_ptr + i * 6
    h0 = tl.sum(tl.load(row, mask=m, other=0).to(tl.uint64, bitcast=True), 0)
    h1 = tl.sum(tl.load(row + 1, mask=m, other=0).to(tl.uint64, bitcast=True), 0)
    s = tl.sum(tl.load(row + 2, mask=m, other=0).to(tl.float64, bitcast=True), 0)
    amax = tl.max(tl.load(row + 3, mask=m, other=0).to(tl.float64, bitcast=True), 0)
    tl.store(out_ptr, h0.to(tl.int64, bitcast=True) ^ len_key)
    tl.store(out_ptr + 1, h1.to(tl.int64, bitcast=True) ^ len_key)
    tl.store(out_ptr + 2, s.to(tl.int64, bitcast=True))
    tl.store(out_ptr + 3, amax.to(tl.int64, bitcast=True))
    for k in tl.static_range(4, 6):  # the counts, float64 like the summary's other words
        c = tl.sum(tl.load(row + k, mask=m, other=0).to(tl.float64, bitcast=True), 0)
        tl.store(out_ptr + k, c.to(tl.int64, bitcast=True))
