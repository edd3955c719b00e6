/* One pass over a float32 buffer: min, max, sum, sum of squares, on request the direction
 * bytes (x > 0), the positive, zero and "x <= bound" counts, and an xxh3 stream.
 * Used by the gradient probe's statistics and by the collective fingerprints of CPU tensors.
 *
 * Why C: torch and numpy need one pass per statistic, and on a CPU every pass over a tensor
 * larger than the cache is a DRAM read. Here each 16 KiB piece is read from memory once and
 * the sign statistics and the hash read it again from L1.
 *
 * Sums are float64, one per piece, added in piece order at the end: the result does not
 * depend on how many threads split the work, so ranks with different thread counts agree
 * bit for bit on identical data.
 *
 * Built with the package (setup.py: the extension commcheck.native._kernel), else by loader.py
 * with the system C compiler on first use (no Python or torch headers); loaded with ctypes.
 *
 * NaN: min/max become NaN when any element is NaN (torch.aminmax's rule); NaN is neither
 * positive, nor zero, nor <= any bound.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define PIECE 4096 /* floats per piece: 16 KiB, stays in L1 between the passes over it */
#define MAX_PARTS 64

#ifdef CC_SOURCE_KEY
/* the key of the sources this library was built from (setup.py); loader.py compares it */
const char cc_source_key[] = CC_SOURCE_KEY;
#endif

typedef int (*cc_update_fn)(void *state, const void *data, size_t len);

struct acc {
    float lo, hi;
    double sum, sumsq;
};

static void stats_scalar(const float *x, size_t n, struct acc *a)
{
    for (size_t i = 0; i < n; i++) {
        float v = x[i];
        a->lo = v < a->lo ? v : a->lo;
        a->hi = v > a->hi ? v : a->hi;
        a->sum += v;
        a->sumsq += (double)v * v;
    }
}

/* counts: [positive, zeros, le(bound 0), le(bound 1), ...] */
static void signs_scalar(const float *x, size_t n, uint8_t *dir, const float *bounds,
                         size_t nb, int64_t *counts)
{
    for (size_t i = 0; i < n; i++) {
        float v = x[i];
        if (dir)
            dir[i] = v > 0.0f;
        if (counts) {
            counts[0] += v > 0.0f;
            counts[1] += v == 0.0f;
            for (size_t b = 0; b < nb; b++)
                counts[2 + b] += v <= bounds[b];
        }
    }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX2 1

__attribute__((target("avx2,fma"))) static void stats_avx2(const float *x, size_t n,
                                                           struct acc *a)
{
    size_t body = n / 16 * 16;
    __m256 lo = _mm256_set1_ps(a->lo), hi = _mm256_set1_ps(a->hi);
    __m256d s0 = _mm256_setzero_pd(), s1 = s0, s2 = s0, s3 = s0;
    __m256d q0 = s0, q1 = s0, q2 = s0, q3 = s0;
    for (size_t i = 0; i < body; i += 16) {
        __m256 u = _mm256_loadu_ps(x + i), w = _mm256_loadu_ps(x + i + 8);
        lo = _mm256_min_ps(lo, _mm256_min_ps(u, w));
        hi = _mm256_max_ps(hi, _mm256_max_ps(u, w));
        __m256d u0 = _mm256_cvtps_pd(_mm256_castps256_ps128(u));
        __m256d u1 = _mm256_cvtps_pd(_mm256_extractf128_ps(u, 1));
        __m256d w0 = _mm256_cvtps_pd(_mm256_castps256_ps128(w));
        __m256d w1 = _mm256_cvtps_pd(_mm256_extractf128_ps(w, 1));
        s0 = _mm256_add_pd(s0, u0);
        s1 = _mm256_add_pd(s1, u1);
        s2 = _mm256_add_pd(s2, w0);
        s3 = _mm256_add_pd(s3, w1);
        q0 = _mm256_fmadd_pd(u0, u0, q0);
        q1 = _mm256_fmadd_pd(u1, u1, q1);
        q2 = _mm256_fmadd_pd(w0, w0, q2);
        q3 = _mm256_fmadd_pd(w1, w1, q3);
    }
    float l[8], h[8];
    double s[4], q[4];
    _mm256_storeu_ps(l, lo);
    _mm256_storeu_ps(h, hi);
    _mm256_storeu_pd(s, _mm256_add_pd(_mm256_add_pd(s0, s1), _mm256_add_pd(s2, s3)));
    _mm256_storeu_pd(q, _mm256_add_pd(_mm256_add_pd(q0, q1), _mm256_add_pd(q2, q3)));
    for (int k = 0; k < 8; k++) {
        a->lo = l[k] < a->lo ? l[k] : a->lo;
        a->hi = h[k] > a->hi ? h[k] : a->hi;
    }
    a->sum += (s[0] + s[1]) + (s[2] + s[3]);
    a->sumsq += (q[0] + q[1]) + (q[2] + q[3]);
    stats_scalar(x + body, n - body, a);
}

/* stats_avx2's sums bit for bit with half the conversions, which bound the avx2 loop (1.6x
 * on Zen 5): z0 holds lanes 0..7 of each 16-float step (avx2's s0 and s1), z1 lanes 8..15
 * (s2 and s3), and they are combined in avx2's order. Without ``squares`` the body's sum of
 * squares is skipped (the fingerprints do not use it; only the tail's is added). */
__attribute__((target("avx512f"), always_inline)) static inline void
stats_avx512_body(const float *x, size_t n, struct acc *a, const int squares)
{
    size_t body = n / 16 * 16;
    __m512 lo = _mm512_set1_ps(a->lo), hi = _mm512_set1_ps(a->hi);
    __m512d z0 = _mm512_setzero_pd(), z1 = z0, q0 = z0, q1 = z0;
    for (size_t i = 0; i < body; i += 16) {
        __m512 u = _mm512_loadu_ps(x + i);
        lo = _mm512_min_ps(lo, u);
        hi = _mm512_max_ps(hi, u);
        __m512d u0 = _mm512_cvtps_pd(_mm256_loadu_ps(x + i));
        __m512d u1 = _mm512_cvtps_pd(_mm256_loadu_ps(x + i + 8));
        z0 = _mm512_add_pd(z0, u0);
        z1 = _mm512_add_pd(z1, u1);
        if (squares) {
            q0 = _mm512_fmadd_pd(u0, u0, q0);
            q1 = _mm512_fmadd_pd(u1, u1, q1);
        }
    }
    float l[16], h[16];
    double s0[8], s1[8], r0[8], r1[8], s[4], q[4];
    _mm512_storeu_ps(l, lo);
    _mm512_storeu_ps(h, hi);
    _mm512_storeu_pd(s0, z0);
    _mm512_storeu_pd(s1, z1);
    _mm512_storeu_pd(r0, q0);
    _mm512_storeu_pd(r1, q1);
    for (int k = 0; k < 4; k++) {
        s[k] = (s0[k] + s0[k + 4]) + (s1[k] + s1[k + 4]);
        q[k] = (r0[k] + r0[k + 4]) + (r1[k] + r1[k + 4]);
    }
    for (int k = 0; k < 16; k++) {
        a->lo = l[k] < a->lo ? l[k] : a->lo;
        a->hi = h[k] > a->hi ? h[k] : a->hi;
    }
    a->sum += (s[0] + s[1]) + (s[2] + s[3]);
    if (squares)
        a->sumsq += (q[0] + q[1]) + (q[2] + q[3]);
    stats_scalar(x + body, n - body, a); /* the tail's squares too: at most 15 */
}

__attribute__((target("avx512f"))) static void stats_avx512(const float *x, size_t n,
                                                           struct acc *a)
{
    stats_avx512_body(x, n, a, 1);
}

__attribute__((target("avx512f"))) static void sums_avx512(const float *x, size_t n,
                                                          struct acc *a)
{
    stats_avx512_body(x, n, a, 0);
}

static uint64_t spread[256]; /* bit k of the index -> byte k of the value */

static void fill_spread(void)
{
    for (int m = 0; m < 256; m++) {
        uint64_t v = 0;
        for (int k = 0; k < 8; k++)
            v |= (uint64_t)((m >> k) & 1) << (8 * k);
        spread[m] = v;
    }
}

__attribute__((target("avx2,fma"))) static int64_t lane_sum(__m256i v)
{
    int32_t lane[8];
    int64_t total = 0;
    _mm256_storeu_si256((__m256i *)lane, v);
    for (int k = 0; k < 8; k++)
        total += lane[k];
    return total;
}

/* A piece is at most PIECE floats, so per-lane int32 counters cannot overflow. Each bound gets
 * its own loop over the piece (in L1 by then), keeping every counter in a register. */
__attribute__((target("avx2,fma"))) static void signs_avx2(const float *x, size_t n,
                                                           uint8_t *dir, const float *bounds,
                                                           size_t nb, int64_t *counts)
{
    size_t body = n / 8 * 8;
    const __m256 zero = _mm256_setzero_ps();
    __m256i pos = _mm256_setzero_si256(), zer = pos;
    for (size_t i = 0; i < body; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        __m256 gt = _mm256_cmp_ps(v, zero, _CMP_GT_OQ);
        if (dir) {
            uint64_t bytes = spread[_mm256_movemask_ps(gt)];
            memcpy(dir + i, &bytes, 8);
        }
        if (counts) {
            pos = _mm256_sub_epi32(pos, _mm256_castps_si256(gt));
            zer = _mm256_sub_epi32(zer, _mm256_castps_si256(_mm256_cmp_ps(v, zero, _CMP_EQ_OQ)));
        }
    }
    if (counts) {
        counts[0] += lane_sum(pos);
        counts[1] += lane_sum(zer);
        for (size_t b = 0; b < nb; b++) {
            const __m256 bound = _mm256_set1_ps(bounds[b]);
            __m256i le = _mm256_setzero_si256();
            for (size_t i = 0; i < body; i += 8) {
                __m256 c = _mm256_cmp_ps(_mm256_loadu_ps(x + i), bound, _CMP_LE_OQ);
                le = _mm256_sub_epi32(le, _mm256_castps_si256(c));
            }
            counts[2 + b] += lane_sum(le);
        }
    }
    signs_scalar(x + body, n - body, dir ? dir + body : NULL, bounds, nb, counts);
}
#endif

/* Pieces [first, last) of x (n elements in all): min/max into *a, each piece's sum and sum
 * of squares into sums[2p], sums[2p+1]. update (may be NULL) hashes each piece right after
 * its statistics, from L1. */
static void range_stats(const float *x, size_t n, size_t first, size_t last, uint8_t *dir,
                        const float *bounds, size_t nb, struct acc *a, double *sums,
                        int64_t *counts, int vector, cc_update_fn update, void *state)
{
    for (size_t p = first; p < last; p++) {
        size_t i = p * PIECE, m = n - i < PIECE ? n - i : PIECE;
        uint8_t *d = dir ? dir + i : NULL;
        struct acc piece = {a->lo, a->hi, 0.0, 0.0};
#ifdef HAVE_AVX2
        if (vector) {
            if (vector >= 2)
                stats_avx512(x + i, m, &piece);
            else
                stats_avx2(x + i, m, &piece);
            if (d || counts)
                signs_avx2(x + i, m, d, bounds, nb, counts);
        } else
#endif
        {
            stats_scalar(x + i, m, &piece);
            if (d || counts)
                signs_scalar(x + i, m, d, bounds, nb, counts);
        }
        a->lo = piece.lo;
        a->hi = piece.hi;
        sums[2 * p] = piece.sum;
        sums[2 * p + 1] = piece.sumsq;
        if (update)
            update(state, x + i, m * sizeof(float));
    }
}

/* Returns 0, or -1 when out of memory. out = {min, max, sum of squares, sum}; dir may be
 * NULL; counts is NULL or holds 2 + nb zero-initialised entries. vector: 0 the scalar
 * loops, 1 AVX2, 2 AVX-512 where the CPU has them (cc_vector_support); all give the same sums.
 *
 * threads: how many OpenMP threads to use. The pieces are split into contiguous ranges, one
 * per thread. update/state (may be NULL): an xxh3 stream (64 or 128 bits, the caller's
 * choice) of the whole buffer, on a thread of its own beside the statistics, so both read
 * the same bytes at the same time and only one of them waits for DRAM; on one thread, each
 * piece is hashed right after its statistics instead. The OpenMP runtime is the one torch
 * loaded (same soname), so its threads are the ones torch's kernels just used. */
int cc_vector_support(void);

int cc_stats(const float *x, size_t n, uint8_t *dir, const float *bounds, size_t nb,
             double *out, int64_t *counts, int vector, cc_update_fn update, void *state,
             int threads)
{
    int hashing = update != NULL && threads > 1;
    int support = cc_vector_support();
    vector = vector < support ? vector : support;
    size_t pieces = (n + PIECE - 1) / PIECE;
    int parts = threads - hashing;
    parts = parts < 1 ? 1 : parts > MAX_PARTS ? MAX_PARTS : parts;
    if ((size_t)parts > pieces)
        parts = pieces ? (int)pieces : 1;
    size_t width = 2 + nb;
    struct acc acc[MAX_PARTS];
    double *sums = malloc((2 * pieces + 1) * sizeof(double));
    int64_t *cnt = counts ? calloc((size_t)parts * width, sizeof(int64_t)) : NULL;
    if (!sums || (counts && !cnt)) {
        free(sums);
        free(cnt);
        return -1;
    }
    int tasks = parts + hashing;
#ifdef _OPENMP
#pragma omp parallel for schedule(static, 1) num_threads(tasks) if (tasks > 1)
#endif
    for (int k = 0; k < tasks; k++) {
        if (k == parts) {
            update(state, x, n * sizeof(float));
            continue;
        }
        acc[k] = (struct acc){INFINITY, -INFINITY, 0.0, 0.0};
        range_stats(x, n, pieces * k / parts, pieces * (k + 1) / parts, dir, bounds, nb,
                    &acc[k], sums, cnt ? cnt + (size_t)k * width : NULL, vector,
                    hashing ? NULL : update, state);
    }
    struct acc a = acc[0];
    for (int k = 1; k < parts; k++) {
        a.lo = acc[k].lo < a.lo ? acc[k].lo : a.lo;
        a.hi = acc[k].hi > a.hi ? acc[k].hi : a.hi;
    }
    for (size_t p = 0; p < pieces; p++) {
        a.sum += sums[2 * p];
        a.sumsq += sums[2 * p + 1];
    }
    free(sums);
    if (cnt) {
        for (int k = 0; k < parts; k++)
            for (size_t j = 0; j < width; j++)
                counts[j] += cnt[(size_t)k * width + j];
        free(cnt);
    }
    if (isnan(a.sumsq))
        a.lo = a.hi = NAN;
    out[0] = a.lo;
    out[1] = a.hi;
    out[2] = a.sumsq;
    out[3] = a.sum;
    return 0;
}

static int vector_support = -1; /* 0 none, 1 AVX2 + FMA, 2 AVX-512F too */
static int vector_level;        /* what the fingerprints use: the support, unless limited */

/* The vector code this CPU runs (0, 1 or 2); the loaders call it before anything else. */
int cc_vector_support(void)
{
    if (vector_support < 0) {
        vector_support = 0;
#ifdef HAVE_AVX2
        __builtin_cpu_init();
        if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
            fill_spread();
            vector_support = __builtin_cpu_supports("avx512f") ? 2 : 1;
        }
#endif
        vector_level = vector_support;
    }
    return vector_support;
}

/* The fingerprints use at most ``level``; returns the level now in force. For tests that
 * hold the AVX2 and AVX-512 loops to the same bits on one machine. */
int cc_limit_vector(int level)
{
    int support = cc_vector_support();
    vector_level = level < support ? level : support;
    return vector_level;
}

/* --- fingerprints of small tensors: one call, one read ------------------------------------
 * The xxh3-128 digest of the raw bytes (through the xxhash package's own functions, so it
 * equals xxhash.xxh3_128_intdigest) and the summary: float64 sum, abs-max (NaN ignored, Inf
 * counted in), NaN and Inf counts. For integers abs-max is max(-min, max) as a float64. */

typedef struct {
    uint64_t low64, high64;
} cc_h128;
typedef int (*cc_reset_fn)(void *state);
typedef cc_h128 (*cc_digest_fn)(const void *state);

static cc_reset_fn xx_reset;
static cc_update_fn xx_update;
static cc_digest_fn xx_digest;

void cc_set_xxh3(void *reset, void *update, void *digest)
{
    xx_reset = (cc_reset_fn)reset;
    xx_update = (cc_update_fn)update;
    xx_digest = (cc_digest_fn)digest;
}

enum { CC_F32, CC_F64, CC_F16, CC_BF16, CC_I8, CC_U8, CC_I16, CC_I32, CC_I64, CC_BOOL };

static float half_to_float(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    if (exp == 0x1f) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp) {
        bits = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man) { /* subnormal: exact in float32 */
        float v = (float)man * (1.0f / 16777216.0f);
        return sign ? -v : v;
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float bf16_to_float(uint16_t h)
{
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

struct fp {
    double sum, absmax;
    int64_t nan, inf;
};

#define FP_FLOAT_LOOP(TYPE, CONV)                                                            \
    do {                                                                                     \
        const TYPE *p = (const TYPE *)x;                                                     \
        double s0 = 0, s1 = 0, s2 = 0, s3 = 0, m = 0;                                        \
        int64_t nan = 0, inf = 0;                                                            \
        size_t i = 0;                                                                        \
        for (; i + 4 <= n; i += 4) {                                                         \
            double a = CONV(p[i]), b = CONV(p[i + 1]), c = CONV(p[i + 2]), d = CONV(p[i + 3]); \
            s0 += a;                                                                         \
            s1 += b;                                                                         \
            s2 += c;                                                                         \
            s3 += d;                                                                         \
        }                                                                                    \
        for (; i < n; i++)                                                                   \
            s0 += CONV(p[i]);                                                                \
        double s = (s0 + s1) + (s2 + s3);                                                    \
        for (i = 0; i < n; i++) {                                                            \
            double v = fabs((double)CONV(p[i]));                                             \
            m = v > m ? v : m;                                                               \
        }                                                                                    \
        if (!isfinite(s) || isinf(m)) {                                                      \
            m = 0;                                                                           \
            for (i = 0; i < n; i++) {                                                        \
                double v = CONV(p[i]);                                                       \
                if (isnan(v)) {                                                              \
                    nan++;                                                                   \
                    continue;                                                                \
                }                                                                            \
                inf += isinf(v) ? 1 : 0;                                                     \
                v = fabs(v);                                                                 \
                m = v > m ? v : m;                                                           \
            }                                                                                \
        }                                                                                    \
        r->sum = s;                                                                          \
        r->absmax = m;                                                                       \
        r->nan = nan;                                                                        \
        r->inf = inf;                                                                        \
    } while (0)

#define FP_INT_LOOP(TYPE)                                                                    \
    do {                                                                                     \
        const TYPE *p = (const TYPE *)x;                                                     \
        double s0 = 0, s1 = 0;                                                               \
        TYPE lo = p[0], hi = p[0];                                                           \
        size_t i = 0;                                                                        \
        for (; i + 2 <= n; i += 2) {                                                         \
            s0 += (double)p[i];                                                              \
            s1 += (double)p[i + 1];                                                          \
        }                                                                                    \
        for (; i < n; i++)                                                                   \
            s0 += (double)p[i];                                                              \
        for (i = 0; i < n; i++) {                                                            \
            lo = p[i] < lo ? p[i] : lo;                                                      \
            hi = p[i] > hi ? p[i] : hi;                                                      \
        }                                                                                    \
        double a = -(double)lo, b = (double)hi;                                              \
        r->sum = s0 + s1;                                                                    \
        r->absmax = a > b ? a : b;                                                           \
        r->nan = r->inf = 0;                                                                 \
    } while (0)

#define CC_ID(v) (v)

/* out: 6 eight-byte slots {sum (double), abs-max (double), NaN count, Inf count, hash low,
 * hash high}. Returns 0, -1 for an unknown dtype, -2 when hashing without cc_set_xxh3. */
int cc_fingerprint(const void *x, size_t n, size_t nbytes, int dtype, int want_hash,
                   int want_summary, void *state, uint64_t *out)
{
    struct fp res = {0, 0, 0, 0}, *r = &res;
    int hashed = 0;
    if (want_hash) {
        if (!xx_reset || !xx_update || !xx_digest || !state)
            return -2;
    }
    if (want_summary && n) {
        switch (dtype) {
        case CC_F32:
#ifdef HAVE_AVX2
            if (vector_level) { /* one vector pass, summed by piece as cc_stats does */
                struct acc a = {INFINITY, -INFINITY, 0.0, 0.0};
                double total = 0.0;
                if (want_hash && nbytes == n * sizeof(float)) {
                    xx_reset(state);
                    hashed = 1;
                }
                for (size_t i = 0; i < n; i += PIECE) {
                    struct acc piece = {a.lo, a.hi, 0.0, 0.0};
                    size_t m = n - i < PIECE ? n - i : PIECE;
                    if (vector_level >= 2)
                        sums_avx512((const float *)x + i, m, &piece);
                    else
                        stats_avx2((const float *)x + i, m, &piece);
                    a.lo = piece.lo;
                    a.hi = piece.hi;
                    total += piece.sum;
                    if (hashed)
                        xx_update(state, (const float *)x + i, m * sizeof(float));
                }
                double lo = -(double)a.lo, hi = (double)a.hi;
                res.sum = total;
                res.absmax = lo > hi ? lo : hi;
                if (isfinite(total) && isfinite(res.absmax))
                    break;
            }
#endif
            FP_FLOAT_LOOP(float, CC_ID);
            break;
        case CC_F64: FP_FLOAT_LOOP(double, CC_ID); break;
        case CC_F16: FP_FLOAT_LOOP(uint16_t, half_to_float); break;
        case CC_BF16: FP_FLOAT_LOOP(uint16_t, bf16_to_float); break;
        case CC_I8: FP_INT_LOOP(int8_t); break;
        case CC_U8: FP_INT_LOOP(uint8_t); break;
        case CC_BOOL: FP_INT_LOOP(uint8_t); break;
        case CC_I16: FP_INT_LOOP(int16_t); break;
        case CC_I32: FP_INT_LOOP(int32_t); break;
        case CC_I64: FP_INT_LOOP(int64_t); break;
        default: return -1;
        }
    }
    memcpy(&out[0], &res.sum, 8);
    memcpy(&out[1], &res.absmax, 8);
    out[2] = (uint64_t)res.nan;
    out[3] = (uint64_t)res.inf;
    if (want_hash) {
        if (!hashed) {
            xx_reset(state);
            if (nbytes)
                xx_update(state, x, nbytes);
        }
        cc_h128 h = xx_digest(state);
        out[4] = h.low64;
        out[5] = h.high64;
    } else {
        out[4] = out[5] = 0;
    }
    return 0;
}
