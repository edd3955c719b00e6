/* The native record path: what C/C++ code in the training process uses to write records
 * into the rank's ring without Python (commcheck/native/hot.c implements it).
 *
 * A record is the wire's Record (commcheck/wire/__init__.py) field for field; hot.c encodes
 * it as the msgpack array the Python side writes (commcheck/wire/ring.py: encode_record),
 * so the relay and `commcheck analyze` read both alike.
 *
 * Get the API from the capsule `commcheck.native._hot._C_API` (PyCapsule_Import), and the
 * ring to write to from `commcheck.native.hot.ring_handle(writer)` (a capsule named
 * "commcheck.ring"; valid while the Python RingWriter is open: put_record returns
 * CC_PUT_CLOSED after it closed). put_record must hold the GIL: the GIL is the ring's lock.
 * fingerprint and now keep no Python state (one hash state per thread) and may be called
 * without it, so a bucket's memory passes need not hold up the training thread.
 */
#ifndef COMMCHECK_CCAPI_H
#define COMMCHECK_CCAPI_H

#include <stddef.h>
#include <stdint.h>

#define CC_API_VERSION 1
#define CC_API_CAPSULE "commcheck.native._hot._C_API"
#define CC_RING_CAPSULE "commcheck.ring"

/* phases and flags: commcheck/wire/__init__.py */
#define CC_PHASE_COMPLETE 0
#define CC_PHASE_ENTRY 1
#define CC_F_ASYNC (1 << 0)
#define CC_F_INJECTED (1 << 1)
#define CC_F_IN_HASH (1 << 2)
#define CC_F_IN_SUMMARY (1 << 3)
#define CC_F_OUT_HASH (1 << 4)
#define CC_F_OUT_SUMMARY (1 << 5)
#define CC_F_REJECTED (1 << 6)
#define CC_NO_ROOT (-1)

typedef struct {
    const char *p;
    size_t n;
} cc_str;

typedef struct {
    const int64_t *v;
    size_t n;
} cc_ints;

typedef struct {
    int64_t side, index;
    uint64_t h0, h1;
    double sum;
} cc_chunk;

typedef struct {
    double sum, absmax;
    int64_t nan, inf;
} cc_summary;

typedef struct {
    cc_str group_name;
    cc_ints group_ranks;
    int64_t seq;
    cc_str op, dtype, redop, algo, callsite;
    int64_t root, flags, numel_in, numel_out;
    cc_ints in_shape, out_shape;
    int64_t step;
    double t_enter, t_exit, t_done;
    uint64_t in_hash[2], out_hash[2];
    cc_summary in_summary, out_summary;
    const cc_chunk *chunks;
    size_t n_chunks;
    int64_t phase, peer;
    cc_ints in_splits, out_splits;
} cc_record;

enum { CC_PUT_OK = 0, CC_PUT_FULL = 1, CC_PUT_TOO_BIG = 2, CC_PUT_CLOSED = 3 };

typedef struct {
    int version;
    /* Encode `r` and write it as one record entry; CC_PUT_FULL / TOO_BIG: dropped and
     * counted (the ring says which seqs, as for the Python path). */
    int (*put_record)(void *ring, const cc_record *r);
    /* xxh3-128 digest and summary of `n` elements (`nbytes` bytes) of dtype code `dtype`
     * (commcheck/native/loader.py: FP_CODES) at `x`, the bits the Python path computes.
     * out: sum, absmax, nan, inf, h0 (low64), h1 (high64) as 6 u64 words. 0 = ok. */
    int (*fingerprint)(const void *x, size_t n, size_t nbytes, int dtype, int want_hash,
                       int want_summary, uint64_t *out);
    /* time.time() */
    double (*now)(void);
} cc_api;

#endif
