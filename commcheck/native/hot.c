/* The per-call hot path in C: write an entry into the rank's ring (msgpack encoding, CRC,
 * publication of the write offset) and fingerprint a small tensor, each in one call.
 *
 * Why: in Python the two ring writes of a collective (msgspec encode, zlib.crc32, three
 * struct packs, slicing into the mmap) and the two ctypes fingerprint calls cost ~12 µs of
 * the ~25 µs commcheck added per call; here they cost ~1.5 µs. The same functions serve
 * C/C++ callers (the DDP comm hook) through the capsule API of ccapi.h.
 *
 * The ring's layout is commcheck/wire/ring.py's; the loader checks LAYOUT against it before
 * using this module. The state of the writer (write offset, entry number, records, drops)
 * lives in the ring's header words, so this path and the Python one read the same truth.
 * Every function runs with the GIL held and never releases it: the GIL is the writers' lock.
 * (The fingerprint calls are the exception: from 256 KiB they release it around the pure C
 * pass, touching no Python object while it is released.)
 *
 * Conventions. Ownership: every PyObject * a function creates is either returned (a new
 * reference), stolen by a container (PyTuple_SET_ITEM/PyList_SET_ITEM, never with NULL),
 * or released on every path out, errors included (one `fail:` label per function where
 * more than one path must clean up). Arguments are borrowed. Errors: a function returning
 * PyObject * returns NULL with an exception set; the capsule API (ccapi.h) returns CC_PUT_*
 * codes and clears any exception, because its C++ callers cannot handle one. Nothing is
 * written into the ring before every argument of the call has converted.
 *
 * Built like kernel.c (whose functions it includes), as a CPython extension (setup.py:
 * commcheck.native._hot, else hot.py on first use); no compiler or no Python headers: the
 * Python path is used.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include "ccapi.h"
#include "kernel.c"

/* commcheck/wire/ring.py */
#define ENTRY_HEAD 24
#define ENTRY_MAGIC 0xCCE1
#define K_RECORD 1
#define K_PAD 0xFF
#define W_WRITE 16
#define W_ENTRIES 17
#define W_RECORDS 18
#define W_LAST 19
#define W_DROPPED 20
#define W_SIGNAL 23
#define R_RELEASED_OFF 32
#define N_FIELDS 27

/* --- crc32 (zlib's polynomial, so entry_crc in ring.py agrees) ------------------------- */

static uint32_t crc_table[8][256];

static void crc_init(void)
{
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++)
            c = c & 1 ? 0xEDB88320u ^ (c >> 1) : c >> 1;
        crc_table[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; i++)
        for (int t = 1; t < 8; t++)
            crc_table[t][i] = crc_table[0][crc_table[t - 1][i] & 0xFF] ^ (crc_table[t - 1][i] >> 8);
}

static uint32_t crc32_update(uint32_t crc, const unsigned char *p, size_t n)
{
    crc = ~crc;
    while (n >= 8) {
        uint32_t lo, hi;
        memcpy(&lo, p, 4);
        memcpy(&hi, p + 4, 4);
        lo ^= crc;
        crc = crc_table[7][lo & 0xFF] ^ crc_table[6][(lo >> 8) & 0xFF] ^
              crc_table[5][(lo >> 16) & 0xFF] ^ crc_table[4][lo >> 24] ^
              crc_table[3][hi & 0xFF] ^ crc_table[2][(hi >> 8) & 0xFF] ^
              crc_table[1][(hi >> 16) & 0xFF] ^ crc_table[0][hi >> 24];
        p += 8;
        n -= 8;
    }
    while (n--)
        crc = crc_table[0][(crc ^ *p++) & 0xFF] ^ (crc >> 8);
    return ~crc;
}

/* crc32 of the packed head "<BIQ" (kind, payload length, number), then of the payload */
static uint32_t entry_crc(int kind, uint32_t n, uint64_t number, const void *payload,
                          size_t len)
{
    unsigned char head[13];
    head[0] = (unsigned char)kind;
    memcpy(head + 1, &n, 4);
    memcpy(head + 5, &number, 8);
    return crc32_update(crc32_update(0, head, 13), payload, len);
}

/* --- msgpack, the subset records use ---------------------------------------------------- */

typedef struct {
    unsigned char *p;
    size_t n, cap;
} buf_t;

static buf_t enc; /* reused; the GIL guards it */

static int grow(buf_t *b, size_t more)
{
    if (b->n + more <= b->cap)
        return 0;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->n + more)
        cap *= 2;
    unsigned char *p = realloc(b->p, cap);
    if (!p)
        return -1;
    b->p = p;
    b->cap = cap;
    return 0;
}

static inline void be16(unsigned char *p, uint16_t v) { p[0] = v >> 8; p[1] = (unsigned char)v; }
static inline void be32(unsigned char *p, uint32_t v)
{
    p[0] = v >> 24; p[1] = (unsigned char)(v >> 16); p[2] = (unsigned char)(v >> 8);
    p[3] = (unsigned char)v;
}
static inline void be64(unsigned char *p, uint64_t v) { be32(p, (uint32_t)(v >> 32)); be32(p + 4, (uint32_t)v); }

static int put_uint(buf_t *b, uint64_t v)
{
    if (grow(b, 9))
        return -1;
    unsigned char *p = b->p + b->n;
    if (v < 128) { p[0] = (unsigned char)v; b->n += 1; }
    else if (v < 256) { p[0] = 0xcc; p[1] = (unsigned char)v; b->n += 2; }
    else if (v < 65536) { p[0] = 0xcd; be16(p + 1, (uint16_t)v); b->n += 3; }
    else if (v < 4294967296ull) { p[0] = 0xce; be32(p + 1, (uint32_t)v); b->n += 5; }
    else { p[0] = 0xcf; be64(p + 1, v); b->n += 9; }
    return 0;
}

static int put_int(buf_t *b, int64_t v)
{
    if (v >= 0)
        return put_uint(b, (uint64_t)v);
    if (grow(b, 9))
        return -1;
    unsigned char *p = b->p + b->n;
    if (v >= -32) { p[0] = (unsigned char)(int8_t)v; b->n += 1; }
    else if (v >= -128) { p[0] = 0xd0; p[1] = (unsigned char)(int8_t)v; b->n += 2; }
    else if (v >= -32768) { p[0] = 0xd1; be16(p + 1, (uint16_t)(int16_t)v); b->n += 3; }
    else if (v >= INT32_MIN) { p[0] = 0xd2; be32(p + 1, (uint32_t)(int32_t)v); b->n += 5; }
    else { p[0] = 0xd3; be64(p + 1, (uint64_t)v); b->n += 9; }
    return 0;
}

static int put_double(buf_t *b, double v)
{
    if (grow(b, 9))
        return -1;
    uint64_t bits;
    memcpy(&bits, &v, 8);
    b->p[b->n] = 0xcb;
    be64(b->p + b->n + 1, bits);
    b->n += 9;
    return 0;
}

static int put_str(buf_t *b, const char *s, size_t n)
{
    if (grow(b, n + 5))
        return -1;
    unsigned char *p = b->p + b->n;
    if (n < 32) { p[0] = 0xa0 | (unsigned char)n; b->n += 1; }
    else if (n < 256) { p[0] = 0xd9; p[1] = (unsigned char)n; b->n += 2; }
    else if (n < 65536) { p[0] = 0xda; be16(p + 1, (uint16_t)n); b->n += 3; }
    else { p[0] = 0xdb; be32(p + 1, (uint32_t)n); b->n += 5; }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    return 0;
}

static int put_array(buf_t *b, size_t n)
{
    if (grow(b, 5))
        return -1;
    unsigned char *p = b->p + b->n;
    if (n < 16) { p[0] = 0x90 | (unsigned char)n; b->n += 1; }
    else if (n < 65536) { p[0] = 0xdc; be16(p + 1, (uint16_t)n); b->n += 3; }
    else { p[0] = 0xdd; be32(p + 1, (uint32_t)n); b->n += 5; }
    return 0;
}

/* A Python value of a record's fields: int, float, str, bool, None, list/tuple of them. */
static int put_obj(buf_t *b, PyObject *o, int depth)
{
    if (PyLong_CheckExact(o)) {
        int overflow = 0;
        long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
        if (overflow > 0) {
            unsigned long long u = PyLong_AsUnsignedLongLong(o);
            if (u == (unsigned long long)-1 && PyErr_Occurred())
                return -1;
            return put_uint(b, u);
        }
        if (overflow < 0 || (v == -1 && PyErr_Occurred())) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_OverflowError, "int out of range for msgpack");
            return -1;
        }
        return put_int(b, v);
    }
    if (PyFloat_CheckExact(o))
        return put_double(b, PyFloat_AS_DOUBLE(o));
    if (PyUnicode_CheckExact(o)) {
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(o, &n);
        return s ? put_str(b, s, (size_t)n) : -1;
    }
    if (PyTuple_CheckExact(o) || PyList_CheckExact(o)) {
        if (depth > 4) {
            PyErr_SetString(PyExc_ValueError, "record nested too deep");
            return -1;
        }
        Py_ssize_t n = PySequence_Fast_GET_SIZE(o);
        PyObject **items = PySequence_Fast_ITEMS(o);
        if (put_array(b, (size_t)n))
            return -1;
        for (Py_ssize_t i = 0; i < n; i++)
            if (put_obj(b, items[i], depth + 1))
                return -1;
        return 0;
    }
    if (o == Py_True || o == Py_False || o == Py_None) {
        if (grow(b, 1))
            return -1;
        b->p[b->n++] = o == Py_True ? 0xc3 : o == Py_False ? 0xc2 : 0xc0;
        return 0;
    }
    if (PyLong_Check(o) || PyFloat_Check(o)) { /* int/float subclasses (IntEnum, numpy) */
        PyObject *plain = PyLong_Check(o) ? PyNumber_Index(o) : PyNumber_Float(o);
        if (!plain)
            return -1;
        int rc = put_obj(b, plain, depth);
        Py_DECREF(plain);
        return rc;
    }
    PyErr_Format(PyExc_TypeError, "cannot encode %.100s in a record", Py_TYPE(o)->tp_name);
    return -1;
}

static int put_ints(buf_t *b, cc_ints v)
{
    if (put_array(b, v.n))
        return -1;
    for (size_t i = 0; i < v.n; i++)
        if (put_int(b, v.v[i]))
            return -1;
    return 0;
}

static int put_summary(buf_t *b, const cc_summary *s)
{
    return put_array(b, 4) || put_double(b, s->sum) || put_double(b, s->absmax) ||
           put_int(b, s->nan) || put_int(b, s->inf);
}

/* the field order of commcheck.wire.Record */
static int put_record_struct(buf_t *b, const cc_record *r)
{
    if (put_array(b, N_FIELDS) || put_str(b, r->group_name.p, r->group_name.n) ||
        put_ints(b, r->group_ranks) || put_int(b, r->seq) || put_str(b, r->op.p, r->op.n) ||
        put_str(b, r->dtype.p, r->dtype.n) || put_str(b, r->redop.p, r->redop.n) ||
        put_int(b, r->root) || put_str(b, r->algo.p, r->algo.n) ||
        put_str(b, r->callsite.p, r->callsite.n) || put_int(b, r->flags) ||
        put_int(b, r->numel_in) || put_int(b, r->numel_out) || put_ints(b, r->in_shape) ||
        put_ints(b, r->out_shape) || put_int(b, r->step) || put_double(b, r->t_enter) ||
        put_double(b, r->t_exit) || put_double(b, r->t_done) || put_array(b, 2) ||
        put_uint(b, r->in_hash[0]) || put_uint(b, r->in_hash[1]) || put_array(b, 2) ||
        put_uint(b, r->out_hash[0]) || put_uint(b, r->out_hash[1]) ||
        put_summary(b, &r->in_summary) || put_summary(b, &r->out_summary) ||
        put_array(b, r->n_chunks))
        return -1;
    for (size_t i = 0; i < r->n_chunks; i++) {
        const cc_chunk *c = &r->chunks[i];
        if (put_array(b, 5) || put_int(b, c->side) || put_int(b, c->index) ||
            put_uint(b, c->h0) || put_uint(b, c->h1) || put_double(b, c->sum))
            return -1;
    }
    return put_int(b, r->phase) || put_int(b, r->peer) || put_ints(b, r->in_splits) ||
           put_ints(b, r->out_splits);
}

/* --- the ring ---------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int open;
    unsigned char *base;
    uint64_t header, cap, max_entry;
    PyObject *on_drop;  /* callable(group_name, group_ranks, phase, seq): a record dropped */
    PyObject *say_drops; /* callable() -> bool: write the drop notes, if the ring has room */
    int drops_pending;
} RingObject;

/* time.time()'s clock (CLOCK_REALTIME, to the nanosecond), for every record C writes */
static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline uint64_t *words(RingObject *r) { return (uint64_t *)r->base; }

static int ring_put(RingObject *r, int kind, const void *payload, size_t n, uint64_t records,
                    int count_drop)
{
    if (!r->open)
        return CC_PUT_CLOSED;
    uint64_t *w = words(r);
    if (n > r->max_entry) {
        if (count_drop)
            w[W_DROPPED] += records;
        return CC_PUT_TOO_BIG;
    }
    uint64_t size = (ENTRY_HEAD + n + 7) & ~(uint64_t)7, cap = r->cap;
    uint64_t off = w[W_WRITE], pos = off % cap;
    uint64_t pad = pos + size > cap ? cap - pos : 0;
    uint64_t released = __atomic_load_n(&w[R_RELEASED_OFF], __ATOMIC_ACQUIRE);
    if (off + pad + size - released > cap) {
        if (count_drop)
            w[W_DROPPED] += records;
        return CC_PUT_FULL;
    }
    uint64_t number = w[W_ENTRIES];
    unsigned char *data = r->base + r->header;
    if (pad) {
        if (pad >= ENTRY_HEAD) {
            unsigned char *h = data + pos;
            uint16_t magic = ENTRY_MAGIC;
            uint32_t len = (uint32_t)(pad - ENTRY_HEAD), crc = entry_crc(K_PAD, 0, number, "", 0),
                     zero = 0;
            memcpy(h, &magic, 2);
            h[2] = K_PAD;
            h[3] = 0;
            memcpy(h + 4, &len, 4);
            memcpy(h + 8, &number, 8);
            memcpy(h + 16, &crc, 4);
            memcpy(h + 20, &zero, 4);
        }
        off += pad;
        pos = 0;
    }
    unsigned char *h = data + pos;
    uint16_t magic = ENTRY_MAGIC;
    uint32_t len = (uint32_t)n, crc = entry_crc(kind, len, number, payload, n), zero = 0;
    memcpy(h + ENTRY_HEAD, payload, n);
    memcpy(h, &magic, 2);
    h[2] = (unsigned char)kind;
    h[3] = 0;
    memcpy(h + 4, &len, 4);
    memcpy(h + 8, &number, 8);
    memcpy(h + 16, &crc, 4);
    memcpy(h + 20, &zero, 4);
    w[W_ENTRIES] = number + 1;
    w[W_RECORDS] += records;
    double t = now();
    memcpy(&w[W_LAST], &t, 8);
    __atomic_store_n(&w[W_WRITE], off + size, __ATOMIC_RELEASE); /* publishes the entry */
    return CC_PUT_OK;
}

/* Say earlier drops first (Python's DropBook), as RingWriter.write_record does. */
static void say_drops(RingObject *r)
{
    if (!r->drops_pending || !r->say_drops)
        return;
    PyObject *done = PyObject_CallNoArgs(r->say_drops);
    if (done) {
        if (PyObject_IsTrue(done) == 1)
            r->drops_pending = 0;
        Py_DECREF(done);
    }
    PyErr_Clear();
}

static void note_drop(RingObject *r, const cc_record *rec)
{
    if (!r->on_drop)
        return;
    PyObject *ranks = PyTuple_New((Py_ssize_t)rec->group_ranks.n);
    if (!ranks) {
        PyErr_Clear();
        return;
    }
    for (size_t i = 0; i < rec->group_ranks.n; i++) {
        PyObject *v = PyLong_FromLongLong(rec->group_ranks.v[i]);
        if (!v) {
            Py_DECREF(ranks);
            PyErr_Clear();
            r->drops_pending = 1;
            return;
        }
        PyTuple_SET_ITEM(ranks, (Py_ssize_t)i, v);
    }
    PyObject *res = PyObject_CallFunction(r->on_drop, "s#OLL", rec->group_name.p,
                                          (Py_ssize_t)rec->group_name.n, ranks,
                                          (long long)rec->phase, (long long)rec->seq);
    Py_DECREF(ranks);
    Py_XDECREF(res);
    PyErr_Clear();
    r->drops_pending = 1;
}

static int api_put_record(void *ring, const cc_record *rec)
{
    RingObject *r = (RingObject *)ring;
    if (!r->open)
        return CC_PUT_CLOSED;
    say_drops(r);
    enc.n = 0;
    if (put_record_struct(&enc, rec)) {
        PyErr_Clear();
        return CC_PUT_TOO_BIG;
    }
    int rc = ring_put(r, K_RECORD, enc.p, enc.n, 1, 1);
    if (rc == CC_PUT_FULL || rc == CC_PUT_TOO_BIG)
        note_drop(r, rec);
    return rc;
}

static void stop_unmark(RingObject *r);

static void Ring_dealloc(RingObject *self)
{
    stop_unmark(self);
    if (self->open)
        PyBuffer_Release(&self->view);
    Py_XDECREF(self->on_drop);
    Py_XDECREF(self->say_drops);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* Ring(mm, header_bytes, capacity, max_entry, on_drop, say_drops) */
static int Ring_init(RingObject *self, PyObject *args, PyObject *kwds)
{
    PyObject *mm, *on_drop, *say;
    unsigned long long header, cap, max_entry;
    if (!PyArg_ParseTuple(args, "OKKKOO", &mm, &header, &cap, &max_entry, &on_drop, &say))
        return -1;
    if (self->open) {
        PyErr_SetString(PyExc_RuntimeError, "ring already open");
        return -1;
    }
    if (PyObject_GetBuffer(mm, &self->view, PyBUF_WRITABLE) < 0)
        return -1;
    if ((uint64_t)self->view.len < header + cap || cap == 0 || header % 8) {
        PyBuffer_Release(&self->view);
        PyErr_SetString(PyExc_ValueError, "buffer smaller than the ring");
        return -1;
    }
    self->open = 1;
    self->base = self->view.buf;
    self->header = header;
    self->cap = cap;
    self->max_entry = max_entry;
    Py_INCREF(on_drop);
    Py_INCREF(say);
    self->on_drop = on_drop;
    self->say_drops = say;
    return 0;
}

/* put(kind, payload, records, count_drop) -> status (CC_PUT_*) */
static PyObject *Ring_put(RingObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "put(kind, payload, records, count_drop)");
        return NULL;
    }
    /* every argument converted before anything is written: a failed conversion must not
     * leave a published entry behind */
    long kind = PyLong_AsLong(args[0]);
    unsigned long long records = PyLong_AsUnsignedLongLong(args[2]);
    int count_drop = PyObject_IsTrue(args[3]);
    if (PyErr_Occurred() || count_drop < 0)
        return NULL;
    Py_buffer p;
    if (PyObject_GetBuffer(args[1], &p, PyBUF_SIMPLE) < 0)
        return NULL;
    int rc = ring_put(self, (int)kind, p.buf, (size_t)p.len, records, count_drop);
    PyBuffer_Release(&p);
    return PyLong_FromLong(rc);
}

/* put_record(values) -> status: a record given as the list of its field values
 * (commcheck.wire.ring.encode_record's array), encoded and written in one call. */
static PyObject *Ring_put_record(RingObject *self, PyObject *values)
{
    if (!PyList_CheckExact(values) && !PyTuple_CheckExact(values)) {
        PyErr_SetString(PyExc_TypeError, "put_record takes a list of field values");
        return NULL;
    }
    if (PySequence_Fast_GET_SIZE(values) != N_FIELDS) {
        PyErr_SetString(PyExc_ValueError, "a record has 27 fields");
        return NULL;
    }
    if (!self->open)
        return PyLong_FromLong(CC_PUT_CLOSED);
    say_drops(self);
    enc.n = 0;
    if (put_obj(&enc, values, 0))
        return NULL;
    return PyLong_FromLong(ring_put(self, K_RECORD, enc.p, enc.n, 1, 1));
}

static PyObject *Ring_close(RingObject *self, PyObject *unused)
{
    if (self->open) {
        stop_unmark(self);
        self->open = 0;
        PyBuffer_Release(&self->view);
        self->base = NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Ring_mark_drops(RingObject *self, PyObject *unused)
{
    self->drops_pending = 1;
    Py_RETURN_NONE;
}

static PyMethodDef Ring_methods[] = {
    {"put", (PyCFunction)(void (*)(void))Ring_put, METH_FASTCALL, "write one entry"},
    {"put_record", (PyCFunction)Ring_put_record, METH_O, "encode and write one record"},
    {"mark_drops", (PyCFunction)Ring_mark_drops, METH_NOARGS,
     "drops were noted: say them before the next record"},
    {"close", (PyCFunction)Ring_close, METH_NOARGS, "stop writing; release the mapping"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "commcheck.native._hot.Ring",
    .tp_basicsize = sizeof(RingObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Ring_init,
    .tp_dealloc = (destructor)Ring_dealloc,
    .tp_methods = Ring_methods,
    .tp_doc = "A rank's ring, written from C (the GIL is its lock).",
};

/* --- stop marks ---------------------------------------------------------------------------
 * A rank that a launcher stops (torchrun, srun and Kubernetes send SIGTERM once one rank
 * failed; a terminal sends SIGINT; a lost session SIGHUP) dies without a goodbye, exactly
 * like the rank that failed first. The relay cannot read the exit status of a process that
 * is not its child, so the signal is written into the ring's W_SIGNAL word here, in the
 * handler, before the previous disposition runs: the engine then tells the launcher's
 * teardown from the failure that caused it. The handler only stores a word and chains, so
 * the process ends (or Python's handler runs) exactly as it would have without it. */

static const int stop_signals[] = {SIGTERM, SIGINT, SIGHUP};
#define N_STOP (sizeof stop_signals / sizeof stop_signals[0])
static uint64_t *volatile stop_word;
static RingObject *stop_ring;
static pid_t stop_pid;
static struct sigaction stop_prev[N_STOP];

static void on_stop(int sig, siginfo_t *info, void *uctx)
{
    int saved_errno = errno; /* the interrupted code's, whatever the chain does to it */
    uint64_t *w = stop_word;
    if (w && getpid() == stop_pid)  /* not in a forked child (a DataLoader worker) */
        __atomic_store_n(w, (uint64_t)sig, __ATOMIC_RELEASE);
    for (size_t i = 0; i < N_STOP; i++) {
        if (stop_signals[i] != sig)
            continue;
        struct sigaction *prev = &stop_prev[i];
        if (prev->sa_flags & SA_SIGINFO) {
            prev->sa_sigaction(sig, info, uctx);
        } else if (prev->sa_handler == SIG_DFL) {
            /* end as the default would: restored, then delivered once this returns */
            sigaction(sig, prev, NULL);
            raise(sig);
        } else if (prev->sa_handler != SIG_IGN) {
            prev->sa_handler(sig);
        }
    }
    errno = saved_errno;
}

static void stop_unmark(RingObject *r)
{
    if (stop_ring == r) {
        stop_word = NULL;
        stop_ring = NULL;
    }
}

/* mark_stops(ring): the stop signals this process gets from now on are written into
 * ``ring``'s header. The handler goes in front of whatever disposition each signal has now
 * (not over SIG_IGN); a handler set later (signal.signal) replaces it until it is put back:
 * mark_stops(None) does that for the ring marked last (False if there is none). */
static PyObject *py_mark_stops(PyObject *mod, PyObject *ring)
{
    if (ring == Py_None) {
        if (!stop_ring || !stop_word)
            Py_RETURN_FALSE;
    } else if (!PyObject_TypeCheck(ring, &RingType)) {
        PyErr_SetString(PyExc_TypeError, "mark_stops takes a Ring or None");
        return NULL;
    } else {
        RingObject *r = (RingObject *)ring;
        if (!r->open)
            Py_RETURN_FALSE;
        stop_word = NULL;
        stop_ring = r;
        stop_pid = getpid();
        stop_word = &words(r)[W_SIGNAL];
    }
    for (size_t i = 0; i < N_STOP; i++) {
        struct sigaction prev, act;
        if (sigaction(stop_signals[i], NULL, &prev) < 0 ||
            ((prev.sa_flags & SA_SIGINFO) && prev.sa_sigaction == on_stop) ||
            (!(prev.sa_flags & SA_SIGINFO) && prev.sa_handler == SIG_IGN))
            continue;
        memset(&act, 0, sizeof act);
        act.sa_sigaction = on_stop;
        act.sa_mask = prev.sa_mask;
        act.sa_flags = (prev.sa_flags & ~SA_RESETHAND) | SA_SIGINFO;
        /* blocked while stop_prev changes, so on_stop never chains to half of it */
        sigset_t block, old;
        sigemptyset(&block);
        sigaddset(&block, stop_signals[i]);
        pthread_sigmask(SIG_BLOCK, &block, &old);
        stop_prev[i] = prev;
        sigaction(stop_signals[i], &act, NULL);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
    }
    Py_RETURN_TRUE;
}

/* --- fingerprints ------------------------------------------------------------------------ */

typedef void *(*cc_create_fn)(void);
static cc_create_fn xx_create;
static __thread void *xx_state;

static int api_fingerprint(const void *x, size_t n, size_t nbytes, int dtype, int want_hash,
                           int want_summary, uint64_t *out)
{
    if (want_hash && !xx_state) {
        if (!xx_create)
            return -2;
        xx_state = xx_create();
        if (!xx_state)
            return -3;
    }
    return cc_fingerprint(x, n, nbytes, dtype, want_hash, want_summary, xx_state, out);
}

/* api_fingerprint without the GIL for a read long enough to let other threads run meanwhile
 * (as ctypes calls of the kernel run); the caller holds the tensor. */
#define GIL_FREE_BYTES (256u << 10)

static int fingerprint_nogil(const void *x, size_t n, size_t nbytes, int dtype, int want_hash,
                             int want_summary, uint64_t *out)
{
    if (nbytes < GIL_FREE_BYTES)
        return api_fingerprint(x, n, nbytes, dtype, want_hash, want_summary, out);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = api_fingerprint(x, n, nbytes, dtype, want_hash, want_summary, out);
    Py_END_ALLOW_THREADS
    return rc;
}

static PyObject *s_data_ptr, *s_numel;

static int call_u64(PyObject *t, PyObject *name, unsigned long long *v)
{
    PyObject *r = PyObject_CallMethodNoArgs(t, name);
    if (!r)
        return -1;
    *v = PyLong_AsUnsignedLongLong(r);
    Py_DECREF(r);
    return PyErr_Occurred() ? -1 : 0;
}

/* The element size of a dtype code (loader.FP_CODES, kernel.c's enum); 0 for none. The code
 * is the tensor's own (callers take it from FP_CODES[t.dtype]), so this is its
 * element_size() without a third method call per tensor. */
static unsigned long long code_size(int code)
{
    static const unsigned char size[] = {4, 8, 2, 2, 1, 1, 2, 4, 8, 1};
    return code >= 0 && code < (int)sizeof(size) ? size[code] : 0;
}

/* A tensor's data pointer and element count (its own methods). */
static int tensor_bytes(PyObject *t, unsigned long long *ptr, unsigned long long *n)
{
    return call_u64(t, s_data_ptr, ptr) || call_u64(t, s_numel, n);
}

static PyObject *bad_code(int code)
{
    if (!PyErr_Occurred())
        PyErr_Format(PyExc_ValueError, "commcheck: no dtype has code %d", code);
    return NULL;
}

/* ((h0, h1), (sum, absmax, nan, inf)), with ``chunks`` (a reference it takes) as a third
 * item when not NULL: what fingerprint and fingerprint_pieces return. */
static PyObject *print_value(uint64_t h0, uint64_t h1, double sum, double absmax,
                             long long nan, long long inf, PyObject *chunks)
{
    PyObject *h = PyTuple_New(2), *sm = PyTuple_New(4), *res = PyTuple_New(chunks ? 3 : 2);
    if (!h || !sm || !res) {
        Py_XDECREF(h);
        Py_XDECREF(sm);
        Py_XDECREF(res);
        Py_XDECREF(chunks);
        return NULL;
    }
    PyTuple_SET_ITEM(h, 0, PyLong_FromUnsignedLongLong(h0));
    PyTuple_SET_ITEM(h, 1, PyLong_FromUnsignedLongLong(h1));
    PyTuple_SET_ITEM(sm, 0, PyFloat_FromDouble(sum));
    PyTuple_SET_ITEM(sm, 1, PyFloat_FromDouble(absmax));
    PyTuple_SET_ITEM(sm, 2, PyLong_FromLongLong(nan));
    PyTuple_SET_ITEM(sm, 3, PyLong_FromLongLong(inf));
    PyTuple_SET_ITEM(res, 0, h);
    PyTuple_SET_ITEM(res, 1, sm);
    if (chunks)
        PyTuple_SET_ITEM(res, 2, chunks);
    for (int i = 0; i < 4; i++)
        if (!PyTuple_GET_ITEM(sm, i) || (i < 2 && !PyTuple_GET_ITEM(h, i))) {
            Py_DECREF(res);
            return NULL;
        }
    return res;
}

static PyObject *print_raw(unsigned long long ptr, unsigned long long n, int code,
                           int want_hash, int want_summary);
static PyObject *pieces_raw(PyObject *list, unsigned long long ptr, unsigned long long n,
                            int code, PyObject *owners, long side, int want_hash,
                            int want_summary);

/* fingerprint(t, code, hash, summary) -> ((h0, h1), (sum, absmax, nan, inf)) for a
 * contiguous CPU tensor; the Fingerprinter's result, without ctypes. */
static PyObject *py_fingerprint(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "fingerprint(tensor, code, hash, summary)");
        return NULL;
    }
    int code = (int)PyLong_AsLong(args[1]);
    unsigned long long ptr, n;
    if (!code_size(code))
        return bad_code(code);
    if (tensor_bytes(args[0], &ptr, &n))
        return NULL;
    int want_hash = PyObject_IsTrue(args[2]), want_summary = PyObject_IsTrue(args[3]);
    if (PyErr_Occurred())
        return NULL;
    return print_raw(ptr, n, code, want_hash, want_summary);
}

/* fingerprint's result for ``n`` elements of dtype ``code`` at ``ptr`` (a tensor's data,
 * which the caller holds; code_size(code) not 0). */
static PyObject *print_raw(unsigned long long ptr, unsigned long long n, int code,
                           int want_hash, int want_summary)
{
    uint64_t out[6];
    int rc = fingerprint_nogil((const void *)(uintptr_t)ptr, n, n * code_size(code), code,
                               want_hash, want_summary, out);
    if (rc) {
        PyErr_Format(PyExc_RuntimeError, "commcheck: cc_fingerprint failed (%d)", rc);
        return NULL;
    }
    double sum, absmax;
    memcpy(&sum, &out[0], 8);
    memcpy(&absmax, &out[1], 8);
    return print_value(out[4], out[5], sum, absmax, (long long)out[2], (long long)out[3], NULL);
}

/* fingerprint_pieces(t, code, owners, side, hash, summary) ->
 *     ((h0, h1), (sum, absmax, nan, inf), [(side, owner, h0, h1, sum), ...])
 * A flat side cut as torch's t.reshape(-1).chunk(len(owners)) cuts it (pieces of
 * ceil(n / k) elements, fewer pieces when they run out), each fingerprinted, the side's
 * hash the xxh3-128 of the pieces' (h0, h1) in order (wire.combine_hashes, zeros for
 * pieces not hashed), its summary theirs combined (prints.combine_summaries). ``t`` may
 * also be a list of len(owners) tensors of one dtype (all_gather's list): one piece each. */
static PyObject *py_fingerprint_pieces(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6 || !PyList_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError,
                        "fingerprint_pieces(tensor, code, owners: list, side, hash, summary)");
        return NULL;
    }
    int listed = PyList_CheckExact(args[0]);
    int code = (int)PyLong_AsLong(args[1]);
    unsigned long long ptr = 0, n = 0;
    if (!code_size(code))
        return bad_code(code);
    if (!listed && tensor_bytes(args[0], &ptr, &n))
        return NULL;
    long side = PyLong_AsLong(args[3]);
    int want_hash = PyObject_IsTrue(args[4]), want_summary = PyObject_IsTrue(args[5]);
    if (PyErr_Occurred())
        return NULL;
    return pieces_raw(listed ? args[0] : NULL, ptr, n, code, args[2], side, want_hash,
                      want_summary);
}

/* fingerprint_pieces's result for ``list`` (all_gather's list of tensors, one per owner)
 * or, ``list`` NULL, the ``n`` elements at ``ptr`` (code_size(code) not 0). */
static PyObject *pieces_raw(PyObject *list, unsigned long long ptr, unsigned long long n,
                            int code, PyObject *owners, long side, int want_hash,
                            int want_summary)
{
    int listed = list != NULL;
    unsigned long long esize = code_size(code);
    Py_ssize_t k = PyList_GET_SIZE(owners);
    if (k < 1 || (listed ? PyList_GET_SIZE(list) != k : n == 0)) {
        PyErr_SetString(PyExc_ValueError,
                        "fingerprint_pieces: no owners, no elements or not one tensor each");
        return NULL;
    }
    uint64_t per = listed ? 0 : (n + (uint64_t)k - 1) / (uint64_t)k;
    Py_ssize_t pieces = listed ? k : (Py_ssize_t)((n + per - 1) / per);
    uint64_t *hashes = PyMem_Malloc(sizeof(uint64_t) * 2 * (size_t)pieces);
    PyObject *chunks = PyList_New(pieces);
    if (!hashes || !chunks) {
        PyMem_Free(hashes);
        Py_XDECREF(chunks);
        return PyErr_NoMemory();
    }
    double total = 0.0, absmax = 0.0;
    long long nan = 0, inf = 0;
    for (Py_ssize_t i = 0; i < pieces; i++) {
        const char *at;
        uint64_t len, out[6];
        if (listed) {
            if (tensor_bytes(PyList_GET_ITEM(list, i), &ptr, &n))
                goto fail;
            at = (const char *)(uintptr_t)ptr;
            len = n;
        } else {
            uint64_t first = (uint64_t)i * per;
            at = (const char *)(uintptr_t)ptr + first * esize;
            len = n - first < per ? n - first : per;
        }
        int rc = fingerprint_nogil(at, len, len * esize, code, want_hash, want_summary, out);
        if (rc) {
            PyErr_Format(PyExc_RuntimeError, "commcheck: cc_fingerprint failed (%d)", rc);
            goto fail;
        }
        double s, m;
        memcpy(&s, &out[0], 8);
        memcpy(&m, &out[1], 8);
        total += s;
        if (i == 0 || m > absmax)
            absmax = m;
        nan += (long long)out[2];
        inf += (long long)out[3];
        hashes[2 * i] = out[4];
        hashes[2 * i + 1] = out[5];
        PyObject *c = Py_BuildValue("(lOKKd)", side, PyList_GET_ITEM(owners, i),
                                    (unsigned long long)out[4], (unsigned long long)out[5],
                                    want_summary ? s : 0.0);
        if (!c)
            goto fail;
        PyList_SET_ITEM(chunks, i, c);
    }
    if (!xx_state && xx_create)
        xx_state = xx_create();
    if (!xx_state || !xx_reset) {
        PyErr_SetString(PyExc_RuntimeError, "commcheck: no xxh3 state");
        goto fail;
    }
    xx_reset(xx_state);
    xx_update(xx_state, hashes, sizeof(uint64_t) * 2 * (size_t)pieces);
    cc_h128 h = xx_digest(xx_state);
    PyMem_Free(hashes);
    if (!want_summary)
        total = absmax = 0.0, nan = inf = 0;
    return print_value(h.low64, h.high64, total, absmax, nan, inf, chunks);
fail:
    PyMem_Free(hashes);
    Py_DECREF(chunks);
    return NULL;
}

/* bind(params, allowed, args, kwargs) -> {param: value} or None: a call's arguments by
 * the op's parameter names (tuple ``params``, frozenset ``allowed`` of the same names), None
 * when there are more positional arguments than parameters or a keyword is not one. What
 * hotpath's binder did with dict(zip(...)), without the zip. */
static PyObject *py_bind(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyTuple_CheckExact(args[0]) || !PyTuple_CheckExact(args[2]) ||
        !PyDict_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError,
                        "bind(params: tuple, allowed, args: tuple, kwargs: dict)");
        return NULL;
    }
    PyObject *params = args[0], *allowed = args[1], *pos = args[2], *kw = args[3];
    Py_ssize_t n = PyTuple_GET_SIZE(pos);
    if (n > PyTuple_GET_SIZE(params))
        Py_RETURN_NONE;
    Py_ssize_t i = 0;
    PyObject *key, *value;
    while (PyDict_Next(kw, &i, &key, &value)) {
        int in = PySet_Contains(allowed, key);
        if (in < 0)
            return NULL;
        if (!in)
            Py_RETURN_NONE;
    }
    PyObject *bound = PyDict_New();
    if (!bound)
        return NULL;
    for (i = 0; i < n; i++)
        if (PyDict_SetItem(bound, PyTuple_GET_ITEM(params, i), PyTuple_GET_ITEM(pos, i)) < 0) {
            Py_DECREF(bound);
            return NULL;
        }
    if (PyDict_GET_SIZE(kw) && PyDict_Update(bound, kw) < 0) {
        Py_DECREF(bound);
        return NULL;
    }
    return bound;
}

#if PY_VERSION_HEX >= 0x030B0000 /* PyFrame_GetLasti */
#define SITE_USER 2 /* callsite._USER */

/* The kind callsite._kind holds for ``code`` (keyed by its id): 1 and *kind set, 0 when it
 * was not classified yet, -1 on error. */
static int code_kind(PyObject *kinds, PyCodeObject *code, long *kind)
{
    PyObject *key = PyLong_FromVoidPtr(code);
    if (!key)
        return -1;
    PyObject *v = PyDict_GetItemWithError(kinds, key);
    Py_DECREF(key);
    if (!v)
        return PyErr_Occurred() ? -1 : 0;
    *kind = PyLong_AsLong(v);
    return *kind == -1 && PyErr_Occurred() ? -1 : 1;
}

static PyObject *site_key(PyCodeObject *code, PyFrameObject *f, PyCodeObject *ucode,
                          PyFrameObject *user)
{
    if (!user)
        return Py_BuildValue("(Ni)", PyLong_FromVoidPtr(code), PyFrame_GetLasti(f));
    return Py_BuildValue("(NiNi)", PyLong_FromVoidPtr(code), PyFrame_GetLasti(f),
                         PyLong_FromVoidPtr(ucode), PyFrame_GetLasti(user));
}

/* callsite(depth, kinds, cache, slow) -> str: commcheck.rank.callsite.callsite(depth) for
 * the Python function that calls this one, read from that module's dicts (``kinds``: id of
 * a code object -> its kind, ``cache``: the key below -> the text). Anything it has not
 * seen yet (a code object not classified, a site not formatted, no frame) is ``slow(depth)``,
 * which learns it: called from here it sees the same frames at the same depth. The walk is
 * the Python one's, in C: a dict look-up per frame and one for the site. */
static PyObject *py_callsite(PyObject *mod, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4 || !PyDict_CheckExact(args[1]) || !PyDict_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "callsite(depth, kinds: dict, cache: dict, slow)");
        return NULL;
    }
    long depth = PyLong_AsLong(args[0]);
    if (depth == -1 && PyErr_Occurred())
        return NULL;
    PyFrameObject *f = PyEval_GetFrame(), *user = NULL; /* the caller's: slow's depth 1 */
    PyCodeObject *code = NULL, *ucode = NULL;
    PyObject *key = NULL, *res = NULL;
    long kind = 0, ukind = 0;
    int got = 1;
    Py_XINCREF(f);
    for (long i = 1; i < depth && f; i++) {
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    while (f) {
        code = PyFrame_GetCode(f);
        if ((got = code_kind(args[1], code, &kind)) <= 0)
            goto done;
        if (kind)
            break;
        Py_CLEAR(code);
        PyFrameObject *back = PyFrame_GetBack(f);
        Py_DECREF(f);
        f = back;
    }
    if (!f)
        goto done;
    if (kind != SITE_USER) {
        user = PyFrame_GetBack(f);
        while (user) {
            ucode = PyFrame_GetCode(user);
            if ((got = code_kind(args[1], ucode, &ukind)) <= 0)
                goto done;
            if (ukind == SITE_USER)
                break;
            Py_CLEAR(ucode);
            PyFrameObject *back = PyFrame_GetBack(user);
            Py_DECREF(user);
            user = back;
        }
    }
    key = site_key(code, f, ucode, user);
    if (!key) {
        got = -1;
        goto done;
    }
    res = PyDict_GetItemWithError(args[2], key);
    if (res)
        Py_INCREF(res);
    else if (PyErr_Occurred())
        got = -1;
done:
    Py_XDECREF(key);
    Py_XDECREF(code);
    Py_XDECREF(ucode);
    Py_XDECREF(f);
    Py_XDECREF(user);
    if (res || got < 0)
        return res;
    return PyObject_CallOneArg(args[3], args[0]);
}

#include "express.c"
#endif

#include "gate.c"

/* set_xxh3(reset, update, digest, create): the xxhash package's own XXH3 functions */
static PyObject *py_set_xxh3(PyObject *mod, PyObject *args)
{
    unsigned long long reset, update, digest, create;
    if (!PyArg_ParseTuple(args, "KKKK", &reset, &update, &digest, &create))
        return NULL;
    cc_set_xxh3((void *)(uintptr_t)reset, (void *)(uintptr_t)update,
                (void *)(uintptr_t)digest);
    xx_create = (cc_create_fn)(uintptr_t)create;
    Py_RETURN_NONE;
}

static void handle_free(PyObject *cap)
{
    Py_XDECREF((PyObject *)PyCapsule_GetContext(cap));
}

/* ring_handle(ring) -> capsule "commcheck.ring" for ccapi.h's put_record (holds the ring) */
static PyObject *py_ring_handle(PyObject *mod, PyObject *ring)
{
    if (!PyObject_TypeCheck(ring, &RingType)) {
        PyErr_SetString(PyExc_TypeError, "ring_handle takes a Ring");
        return NULL;
    }
    PyObject *cap = PyCapsule_New(ring, CC_RING_CAPSULE, handle_free);
    if (!cap)
        return NULL;
    Py_INCREF(ring);
    PyCapsule_SetContext(cap, ring);
    return cap;
}

static PyMethodDef methods[] = {
    {"fingerprint", (PyCFunction)(void (*)(void))py_fingerprint, METH_FASTCALL,
     "hash and summary of a small contiguous CPU tensor"},
    {"fingerprint_pieces", (PyCFunction)(void (*)(void))py_fingerprint_pieces, METH_FASTCALL,
     "fingerprints of a flat side cut into per-rank pieces"},
    {"bind", (PyCFunction)(void (*)(void))py_bind, METH_FASTCALL,
     "a call's arguments by parameter name"},
#if PY_VERSION_HEX >= 0x030B0000
    {"callsite", (PyCFunction)(void (*)(void))py_callsite, METH_FASTCALL,
     "the caller's call site from callsite's caches"},
#endif
    {"set_xxh3", py_set_xxh3, METH_VARARGS, "the XXH3 functions to hash with"},
    {"ring_handle", py_ring_handle, METH_O, "a capsule of the ring for C callers"},
    {"mark_stops", py_mark_stops, METH_O, "write the stop signals into this ring's header"},
    {NULL, NULL, 0, NULL},
};

static cc_api api = {CC_API_VERSION, api_put_record, api_fingerprint, now};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hot", NULL, -1, methods};

PyMODINIT_FUNC PyInit__hot(void)
{
    crc_init();
    cc_vector_support();
    if (PyType_Ready(&RingType) < 0)
        return NULL;
    s_data_ptr = PyUnicode_InternFromString("data_ptr");
    s_numel = PyUnicode_InternFromString("numel");
    if (!s_data_ptr || !s_numel)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    if (gate_init(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#if PY_VERSION_HEX >= 0x030B0000
    if (express_init(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
#endif
    /* AddObjectRef never steals: every object made here is released below either way */
    PyObject *cap = PyCapsule_New(&api, CC_API_CAPSULE, NULL);
    PyObject *layout = Py_BuildValue(
        "(iiiiiiiiiiiii)", ENTRY_HEAD, ENTRY_MAGIC, K_RECORD, K_PAD, W_WRITE, W_ENTRIES,
        W_RECORDS, W_LAST, W_DROPPED, W_SIGNAL, R_RELEASED_OFF, N_FIELDS, CC_API_VERSION);
    int bad = !cap || !layout ||
              PyModule_AddObjectRef(m, "Ring", (PyObject *)&RingType) < 0 ||
              PyModule_AddObjectRef(m, "_C_API", cap) < 0 ||
              PyModule_AddObjectRef(m, "LAYOUT", layout) < 0
#ifdef CC_SOURCE_KEY
              || PyModule_AddStringConstant(m, "SOURCE_KEY", CC_SOURCE_KEY) < 0
#endif
        ;
    Py_XDECREF(cap);
    Py_XDECREF(layout);
    if (bad) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
