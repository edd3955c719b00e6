/* The steady state of a plain all_reduce, broadcast, all_gather (an even list),
 * all_gather_single or reduce_scatter_single in one C call (included by hot.c).
 *
 * Why: with the ring writes and fingerprints already in C, what the Python hot path
 * (commcheck/rank/hotpath.py) still spent per call was the interpreter between them —
 * binding, the group and tally look-ups, the entry list, the plan tuple, the finish closure,
 * the guard — about two thirds of what a 4 KiB call added. Express.call does the same steps
 * in the same order, reading the same Python state (the session's ring, the hot path's
 * caches, the coverage tally, the nesting guard), so both paths write the same records and
 * keep the same counts.
 *
 * Only the steady state is taken: every check runs before anything is written, and a call
 * it cannot take whole (the first calls of a group, an op name or a reduce op not cached
 * yet, a fault injector with faults, a coalescing block, a large or odd tensor, any error
 * while checking) is answered SLOW, and the Python hot path runs it — and fills the caches
 * this reads. After the entry record is written, what fails is the Python path's too: the
 * real call's exception goes through HotPath._raised and on to the caller; an error in the
 * completion record goes to Session.fail.
 */

/* the ops, hotpath.EXPRESS's numbers; X_GATHER_LIST: all_gather, one tensor per member */
enum { X_ALL_REDUCE = 0, X_BROADCAST = 1, X_GATHER = 2, X_SCATTER = 3, X_GATHER_LIST = 4 };
#define GATHERS(kind) ((kind) == X_GATHER || (kind) == X_GATHER_LIST)

/* commcheck.wire.Record's field order; RECORD_FIELDS spells it for test_record_layout */
enum {
    R_GROUP_NAME, R_GROUP_RANKS, R_SEQ, R_OP, R_DTYPE, R_REDOP, R_ROOT, R_ALGO, R_CALLSITE,
    R_FLAGS, R_NUMEL_IN, R_NUMEL_OUT, R_IN_SHAPE, R_OUT_SHAPE, R_STEP, R_T_ENTER, R_T_EXIT,
    R_T_DONE, R_IN_HASH, R_OUT_HASH, R_IN_SUMMARY, R_OUT_SUMMARY, R_CHUNKS, R_PHASE, R_PEER,
    R_IN_SPLITS, R_OUT_SPLITS
};
static const char *record_fields[N_FIELDS] = {
    "group_name", "group_ranks", "seq", "op", "dtype", "redop", "root", "algo", "callsite",
    "flags", "numel_in", "numel_out", "in_shape", "out_shape", "step", "t_enter", "t_exit",
    "t_done", "in_hash", "out_hash", "in_summary", "out_summary", "chunks", "phase", "peer",
    "in_splits", "out_splits"};

/* commcheck.wire's constants; WIRE spells them for the same test */
#define F_IN_HASH (1 << 2)
#define F_IN_SUMMARY (1 << 3)
#define F_OUT_HASH (1 << 4)
#define F_OUT_SUMMARY (1 << 5)
#define PHASE_COMPLETE 0
#define PHASE_ENTRY 1
#define NO_ROOT (-1)
#define SIDE_IN 0
#define SIDE_OUT 1

#define X_TAKE 1
#define X_SLOW 0

/* the attribute and key names read per call, interned once */
enum {
    S_INJECTOR, S_FAULTS, S_RING, S_BLOCKS, S_HOT, S_ASYNC_OP, S_GROUP, S_OP, S_IS_CPU,
    S_LAYOUT, S_IS_CONTIGUOUS, S_IS_NEG, S_DTYPE, S_SHAPE, S_NEXT_SEQ, S_NAME, S_RANKS,
    S_STEP, S_REF, S_QUERY, S_COVERED, S_BUSY, S_DEPTH, S_SRC, S_GROUP_SRC, S_RANK,
    S_MEMBERS, S_ERROR, S_NOTE_VALUES, S_EMPTY, S_XXH3, S_COUNT
};
static PyObject *x_str[S_COUNT];
static const char *x_names[S_COUNT] = {
    "injector", "faults", "ring", "blocks", "_hot", "async_op", "group", "op", "is_cpu",
    "layout", "is_contiguous", "is_neg", "dtype", "shape", "next_seq", "name", "ranks",
    "step", "ref", "query", "covered", "busy", "depth", "src", "group_src", "rank",
    "members", "_error", "_note_values", "", "xxh3-128"};
static PyObject *x_zero_hash, *x_zero_summary, *x_empty_tuple, *x_one;

typedef struct {
    PyObject_HEAD
    int kind, on, hash_in, hash_out, summary, site_on;
    long long small, calls;
    PyObject *op, *input, *output, *session, *params, *allowed, *dtypes, *tensor_type,
        *strided, *world, *default_pg, *coalescing, *groups, *works, *redops, *sum_name,
        *tally_local, *guard_local, *site_kinds, *site_cache, *site_slow, *slow, *raised,
        *fail;
} ExpressObject;

/* every object member, in the order Express_init parses them */
#define X_OBJECTS(x)                                                                      \
    &(x)->op, &(x)->input, &(x)->output, &(x)->session, &(x)->params, &(x)->allowed,     \
        &(x)->dtypes, &(x)->tensor_type, &(x)->strided, &(x)->world, &(x)->default_pg,   \
        &(x)->coalescing, &(x)->groups, &(x)->works, &(x)->redops, &(x)->sum_name,       \
        &(x)->tally_local, &(x)->guard_local, &(x)->site_kinds, &(x)->site_cache,        \
        &(x)->site_slow, &(x)->slow, &(x)->raised, &(x)->fail

static int Express_traverse(ExpressObject *x, visitproc visit, void *arg)
{
    PyObject **all[] = {X_OBJECTS(x)};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        Py_VISIT(*all[i]);
    return 0;
}

static int Express_clear(ExpressObject *x)
{
    PyObject **all[] = {X_OBJECTS(x)};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        Py_CLEAR(*all[i]);
    return 0;
}

static void Express_dealloc(ExpressObject *x)
{
    PyObject_GC_UnTrack(x);
    Express_clear(x);
    Py_TYPE(x)->tp_free((PyObject *)x);
}

/* Express(kind, (op, input, output), small, (hash_in, hash_out, summary, site_on), session,
 *         params, allowed, dtypes, tensor_type, strided, (world, default_pg, coalescing),
 *         groups, works, redops, sum_name, tally_local, guard_local,
 *         (site_kinds, site_cache, site_slow), slow, raised, fail):
 * hotpath.HotPath.express names each. The process group's world is read as
 * getattr(world, default_pg) and getattr(world, coalescing), two names of c10d._world. */
static int Express_init(ExpressObject *x, PyObject *args, PyObject *kwds)
{
    PyObject *o[24];
    if (!PyArg_ParseTuple(args, "i(UUU)L(pppp)OO!OO!OO(OUU)O!O!O!UOO(O!O!O)OOO", &x->kind,
                          &o[0], &o[1], &o[2], &x->small, &x->hash_in, &x->hash_out,
                          &x->summary, &x->site_on, &o[3], &PyTuple_Type, &o[4], &o[5],
                          &PyDict_Type, &o[6], &o[7], &o[8], &o[9], &o[10], &o[11],
                          &PyDict_Type, &o[12], &PyDict_Type, &o[13], &PyDict_Type, &o[14],
                          &o[15], &o[16], &o[17], &PyDict_Type, &o[18], &PyDict_Type, &o[19],
                          &o[20], &o[21], &o[22], &o[23]))
        return -1;
    if (x->kind < X_ALL_REDUCE || x->kind > X_GATHER_LIST) {
        PyErr_Format(PyExc_ValueError, "Express: no kind %d", x->kind);
        return -1;
    }
    if (!PyType_Check(o[7])) {
        PyErr_SetString(PyExc_TypeError, "Express: tensor_type is not a type");
        return -1;
    }
    PyObject **all[] = {X_OBJECTS(x)}; /* in the order they are parsed */
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        Py_XSETREF(*all[i], Py_NewRef(o[i]));
    x->on = 1;
    return 0;
}

/* --- small helpers: each returns -1 with an exception set on error ------------------------- */

/* bool(v) for a new reference v, which it releases: 1, 0, or -1 (v NULL: its error) */
static int truth(PyObject *v)
{
    if (!v)
        return -1;
    int t = PyObject_IsTrue(v);
    Py_DECREF(v);
    return t;
}

/* bool(getattr(o, name)) */
static int attr_true(PyObject *o, int name)
{
    return truth(PyObject_GetAttr(o, x_str[name]));
}

/* bool(o.name()), for the tensor's predicates */
static int method_true(PyObject *o, int name)
{
    return truth(PyObject_CallMethodNoArgs(o, x_str[name]));
}

/* bound[name] when present and not None (borrowed), else NULL (exception set on error) */
static PyObject *arg(PyObject *bound, int name)
{
    PyObject *v = PyDict_GetItemWithError(bound, x_str[name]);
    return v == Py_None ? NULL : v;
}

/* ref() is target, for a weakref (or any callable): 1, 0 or -1 */
static int refers(PyObject *ref, PyObject *target)
{
    PyObject *got = PyObject_CallNoArgs(ref);
    if (!got)
        return -1;
    int same = got == target;
    Py_DECREF(got);
    return same;
}

/* The current exception, normalised and taken out (a new reference; NULL if none). */
static PyObject *take_exception(void)
{
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (!type)
        return NULL;
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb && value)
        PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    return value;
}

/* fn(exception) for the current exception, which is cleared; fn's own errors too. */
static void report(PyObject *fn)
{
    PyObject *exc = take_exception();
    if (!exc)
        return;
    PyObject *r = PyObject_CallOneArg(fn, exc);
    Py_XDECREF(r);
    Py_DECREF(exc);
    PyErr_Clear();
}

/* RingWriter.write_values in C: a dropped record is noted, an error said, as there. */
static void x_write(PyObject *writer, PyObject *ring, PyObject *values)
{
    PyObject *st = Ring_put_record((RingObject *)ring, values);
    if (!st) {
        PyObject *err = PyObject_GetAttr(writer, x_str[S_ERROR]);
        if (err) {
            report(err);
            Py_DECREF(err);
        }
        PyErr_Clear();
        return;
    }
    long rc = PyLong_AsLong(st);
    Py_DECREF(st);
    if (rc != CC_PUT_OK && rc != CC_PUT_CLOSED) {
        PyObject *r = PyObject_CallMethodObjArgs(
            writer, x_str[S_NOTE_VALUES], PyList_GET_ITEM(values, R_GROUP_NAME),
            PyList_GET_ITEM(values, R_GROUP_RANKS), PyList_GET_ITEM(values, R_PHASE),
            PyList_GET_ITEM(values, R_SEQ), NULL);
        Py_XDECREF(r);
    }
    PyErr_Clear();
}

/* list[i] = v, v a new reference (stolen; NULL: -1, the exception set by its maker) */
static int put(PyObject *list, Py_ssize_t i, PyObject *v)
{
    if (!v)
        return -1;
    return PyList_SetItem(list, i, v);
}

/* --- the call ------------------------------------------------------------------------------- */

typedef struct { /* what the checks found: new references, released by plan_clear */
    PyObject *writer, *ring, *bound, *pg, *group, *entry, *works, *tensor, *code, *dtype,
        *redop, *shape, *callsite, *out, *out_shape, *members;
    long long numel, numel_out, root;
    unsigned long long ptr, out_ptr; /* the tensors' data, read once (the call writes in place) */
    int icode;                       /* code as a C int */
} plan_t;

static void plan_clear(plan_t *p)
{
    PyObject **all[] = {&p->writer, &p->ring, &p->bound, &p->pg, &p->group, &p->entry,
                        &p->works, &p->tensor, &p->code, &p->dtype, &p->redop, &p->shape,
                        &p->callsite, &p->out, &p->out_shape, &p->members};
    for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); i++)
        Py_CLEAR(*all[i]);
}

#define CHECK(expr)          \
    do {                     \
        int ok_ = (expr);    \
        if (ok_ <= 0)        \
            return ok_;      \
    } while (0)
#define NEED(ptr)                            \
    do {                                     \
        if (!(ptr))                          \
            return PyErr_Occurred() ? -1 : X_SLOW; \
    } while (0)

/* Where the rank writes: the session's native ring writer, outside any coalescing block,
 * with no injector counting calls. hotpath.HotPath.ready and .run's injector test. */
static int x_ring(ExpressObject *x, plan_t *p)
{
    PyObject *s = x->session;
    PyObject *inj = PyObject_GetAttr(s, x_str[S_INJECTOR]);
    NEED(inj);
    int faults = inj == Py_None ? 0 : attr_true(inj, S_FAULTS);
    Py_DECREF(inj);
    CHECK(faults < 0 ? -1 : !faults);
    p->writer = PyObject_GetAttr(s, x_str[S_RING]);
    NEED(p->writer);
    CHECK(p->writer != Py_None);
    int blocks = attr_true(s, S_BLOCKS);
    CHECK(blocks < 0 ? -1 : !blocks);
    p->ring = PyObject_GetAttr(p->writer, x_str[S_HOT]); /* RingWriter.native: not None */
    NEED(p->ring);
    return Py_IS_TYPE(p->ring, &RingType);
}

/* The process group and its Group from the hot path's cache (HotPath._group), and the
 * learned tally entry and works per call (HotPath.run's known path). */
static int x_group(ExpressObject *x, plan_t *p)
{
    PyObject *pg = arg(p->bound, S_GROUP);
    if (!pg && PyErr_Occurred())
        return -1;
    int given = pg ? PyObject_IsTrue(pg) : 0;
    CHECK(given < 0 ? -1 : 1);
    p->pg = given ? Py_NewRef(pg) : PyObject_GetAttr(x->world, x->default_pg);
    NEED(p->pg);
    int coalescing = truth(PyObject_GetAttr(x->world, x->coalescing));
    CHECK(coalescing < 0 ? -1 : !coalescing);
    PyObject *id = PyLong_FromVoidPtr(p->pg);
    NEED(id);
    PyObject *got = PyDict_GetItemWithError(x->groups, id);
    PyObject *key = got ? PyTuple_Pack(2, id, x->op) : NULL;
    Py_DECREF(id);
    NEED(got);
    NEED(key);
    PyObject *known = PyDict_GetItemWithError(x->works, key);
    Py_DECREF(key);
    NEED(known);
    CHECK(PyTuple_CheckExact(got) && PyTuple_GET_SIZE(got) == 2 &&
          PyTuple_CheckExact(known) && PyTuple_GET_SIZE(known) == 2);
    CHECK(refers(PyTuple_GET_ITEM(got, 0), p->pg));
    p->group = Py_NewRef(PyTuple_GET_ITEM(got, 1));
    p->entry = Py_NewRef(PyTuple_GET_ITEM(known, 0));
    p->works = Py_NewRef(PyTuple_GET_ITEM(known, 1));
    PyObject *ref = PyObject_GetAttr(p->entry, x_str[S_REF]);
    NEED(ref);
    int same = refers(ref, p->pg);
    Py_DECREF(ref);
    CHECK(same);
    int nested = attr_true(x->tally_local, S_DEPTH);
    return nested < 0 ? -1 : !nested;
}

/* hotpath._plain(t), with its dtype's (code, name) when asked: 1, 0 or -1. */
static int plain(ExpressObject *x, PyObject *t, PyObject **code, PyObject **dtype_name)
{
    CHECK(Py_IS_TYPE(t, (PyTypeObject *)x->tensor_type));
    CHECK(attr_true(t, S_IS_CPU));
    PyObject *layout = PyObject_GetAttr(t, x_str[S_LAYOUT]);
    NEED(layout);
    int strided = layout == x->strided;
    Py_DECREF(layout);
    CHECK(strided);
    CHECK(method_true(t, S_IS_CONTIGUOUS));
    int neg = method_true(t, S_IS_NEG);
    CHECK(neg < 0 ? -1 : !neg);
    PyObject *dtype = PyObject_GetAttr(t, x_str[S_DTYPE]);
    NEED(dtype);
    PyObject *known = PyDict_GetItemWithError(x->dtypes, dtype);
    Py_DECREF(dtype);
    NEED(known);
    CHECK(PyTuple_CheckExact(known) && PyTuple_GET_SIZE(known) == 2);
    if (code) {
        *code = Py_NewRef(PyTuple_GET_ITEM(known, 0));
        *dtype_name = Py_NewRef(PyTuple_GET_ITEM(known, 1));
    }
    return X_TAKE;
}

/* tuple(t.shape), its product (t.numel()) and t.data_ptr(): 1, X_SLOW or -1 */
static int measure(PyObject *t, long long *numel, PyObject **shape, unsigned long long *ptr)
{
    if (call_u64(t, s_data_ptr, ptr))
        return -1;
    PyObject *size = PyObject_GetAttr(t, x_str[S_SHAPE]);
    if (!size)
        return -1;
    *shape = PySequence_Tuple(size);
    Py_DECREF(size);
    if (!*shape)
        return -1;
    long long n = 1;
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(*shape); i++) {
        long long d = PyLong_AsLongLong(PyTuple_GET_ITEM(*shape, i));
        if (d == -1 && PyErr_Occurred())
            return -1;
        if (d < 0 || (d && n > LLONG_MAX / d))
            return X_SLOW;
        n *= d;
    }
    *numel = n;
    return X_TAKE;
}

/* hotpath._even_list: all_gather's output list, one plain tensor per member, each of the
 * input's dtype and shape; its numel and shape as the record has them (k, *shape). */
static int x_even_list(ExpressObject *x, plan_t *p)
{
    Py_ssize_t k = PyList_GET_SIZE(p->members);
    CHECK(PyList_CheckExact(p->out) && PyList_GET_SIZE(p->out) == k && p->numel > 0);
    PyObject *dtype = PyObject_GetAttr(p->tensor, x_str[S_DTYPE]);
    NEED(dtype);
    int ok = X_TAKE;
    for (Py_ssize_t i = 0; ok == X_TAKE && i < k; i++) {
        PyObject *o = PyList_GET_ITEM(p->out, i), *odtype = NULL, *size = NULL;
        ok = plain(x, o, NULL, NULL);
        if (ok == X_TAKE)
            ok = (odtype = PyObject_GetAttr(o, x_str[S_DTYPE])) ? odtype == dtype : -1;
        if (ok == X_TAKE)
            ok = (size = PyObject_GetAttr(o, x_str[S_SHAPE]))
                     ? PyObject_RichCompareBool(size, p->shape, Py_EQ)
                     : -1;
        Py_XDECREF(odtype);
        Py_XDECREF(size);
    }
    Py_DECREF(dtype);
    if (ok != X_TAKE)
        return ok;
    p->numel_out = p->numel * (long long)k;
    PyObject *head = Py_BuildValue("(n)", k);
    if (!head)
        return -1;
    p->out_shape = PySequence_Concat(head, p->shape);
    Py_DECREF(head);
    return p->out_shape ? X_TAKE : -1;
}

/* The input (the one tensor of all_reduce and broadcast) and a gathered op's output, plain
 * tensors, the input of at most ``small`` elements (what one native fingerprint call takes:
 * fingerprint._SMALL; a gather's output pieces and a scatter's output are no larger). */
static int x_tensor(ExpressObject *x, plan_t *p)
{
    PyObject *t = PyDict_GetItemWithError(p->bound, x->input);
    NEED(t);
    p->tensor = Py_NewRef(t);
    CHECK(plain(x, t, &p->code, &p->dtype));
    p->icode = (int)PyLong_AsLong(p->code);
    if (p->icode == -1 && PyErr_Occurred())
        return -1;
    CHECK(code_size(p->icode) > 0);
    CHECK(measure(t, &p->numel, &p->shape, &p->ptr));
    CHECK(p->numel <= x->small);
    if (x->kind == X_ALL_REDUCE || x->kind == X_BROADCAST) {
        p->out_shape = Py_NewRef(p->shape);
        p->numel_out = p->numel;
        return X_TAKE;
    }
    p->members = PyObject_GetAttr(p->group, x_str[S_MEMBERS]);
    NEED(p->members);
    CHECK(PyList_CheckExact(p->members));
    PyObject *out = PyDict_GetItemWithError(p->bound, x->output);
    NEED(out);
    p->out = Py_NewRef(out);
    if (x->kind == X_GATHER_LIST)
        return x_even_list(x, p);
    CHECK(plain(x, out, NULL, NULL));
    CHECK(measure(out, &p->numel_out, &p->out_shape, &p->out_ptr));
    return p->numel > 0 && p->numel_out > 0;
}

/* all_reduce, reduce_scatter_single: the reduce op's name, cached by HotPath._redop.
 * broadcast: its root, from src or group_src (none: torch raises, which the general path
 * says). The gathered ops: the group's members, who own the pieces. */
static int x_kind(ExpressObject *x, plan_t *p)
{
    p->root = NO_ROOT;
    if (GATHERS(x->kind)) {
        p->redop = Py_NewRef(x_str[S_EMPTY]);
        return X_TAKE;
    }
    if (x->kind == X_ALL_REDUCE || x->kind == X_SCATTER) {
        PyObject *op = arg(p->bound, S_OP);
        if (!op && PyErr_Occurred())
            return -1;
        int given = op ? PyObject_IsTrue(op) : 0;
        CHECK(given < 0 ? -1 : 1);
        /* no op: SUM, whose name is given (a pybind object's hash costs more than the rest) */
        PyObject *name = given ? PyDict_GetItemWithError(x->redops, op) : x->sum_name;
        NEED(name);
        p->redop = Py_NewRef(name);
        return X_TAKE;
    }
    CHECK(p->numel > 0);
    p->redop = Py_NewRef(x_str[S_EMPTY]);
    PyObject *src = arg(p->bound, S_SRC), *gsrc = src ? NULL : arg(p->bound, S_GROUP_SRC);
    if (!src && !gsrc)
        return PyErr_Occurred() ? -1 : X_SLOW;
    if (src) {
        p->root = PyLong_AsLongLong(src); /* int(src) for an int; others: the Python path */
        return p->root == -1 && PyErr_Occurred() ? -1 : X_TAKE;
    }
    PyObject *members = PyObject_GetAttr(p->group, x_str[S_MEMBERS]);
    NEED(members);
    Py_ssize_t i = PyNumber_AsSsize_t(gsrc, PyExc_IndexError);
    PyObject *m = PyErr_Occurred() ? NULL : PySequence_GetItem(members, i);
    Py_DECREF(members);
    NEED(m);
    p->root = PyLong_AsLongLong(m);
    Py_DECREF(m);
    return p->root == -1 && PyErr_Occurred() ? -1 : X_TAKE;
}

/* Everything read before anything is written: X_TAKE, X_SLOW, or -1 (an error). */
static int x_check(ExpressObject *x, PyObject *pos, PyObject *kw, plan_t *p)
{
    CHECK(x_ring(x, p));
    PyObject *bargs[4] = {x->params, x->allowed, pos, kw};
    p->bound = py_bind(NULL, bargs, 4);
    NEED(p->bound);
    CHECK(p->bound != Py_None);
    PyObject *async_op = arg(p->bound, S_ASYNC_OP);
    int async = async_op ? PyObject_IsTrue(async_op) : 0;
    CHECK(async < 0 ? -1 : !async);
    if (PyErr_Occurred())
        return -1;
    CHECK(x_group(x, p));
    CHECK(x_tensor(x, p));
    CHECK(x_kind(x, p));
    if (x->site_on) {
        PyObject *depth = PyLong_FromLong(2); /* callsite ← the wrapper ← the user's frame */
        NEED(depth);
        PyObject *sargs[4] = {depth, x->site_kinds, x->site_cache, x->site_slow};
        p->callsite = py_callsite(NULL, sargs, 4);
        Py_DECREF(depth);
        NEED(p->callsite);
    } else {
        p->callsite = Py_NewRef(x_str[S_EMPTY]);
    }
    return X_TAKE;
}

/* The entry record's field values (hotpath._entry), taking the group's next sequence
 * number; NULL with an exception on error. */
static PyObject *x_entry(ExpressObject *x, plan_t *p)
{
    PyObject *s = x->session, *values = PyList_New(N_FIELDS);
    if (!values)
        return NULL;
    PyObject *seq = PyObject_GetAttr(p->group, x_str[S_NEXT_SEQ]);
    PyObject *next = seq ? PyNumber_Add(seq, x_one) : NULL;
    int bad = !next || PyObject_SetAttr(p->group, x_str[S_NEXT_SEQ], next) < 0;
    Py_XDECREF(next);
    if (bad || put(values, R_SEQ, seq) ||
        put(values, R_GROUP_NAME, PyObject_GetAttr(p->group, x_str[S_NAME])) ||
        put(values, R_GROUP_RANKS, PyObject_GetAttr(p->group, x_str[S_RANKS])) ||
        put(values, R_OP, Py_NewRef(x->op)) || put(values, R_DTYPE, Py_NewRef(p->dtype)) ||
        put(values, R_REDOP, Py_NewRef(p->redop)) ||
        put(values, R_ROOT, PyLong_FromLongLong(p->root)) ||
        put(values, R_ALGO, Py_NewRef(x_str[S_EMPTY])) ||
        put(values, R_CALLSITE, Py_NewRef(p->callsite)) ||
        put(values, R_FLAGS, PyLong_FromLong(0)) ||
        put(values, R_NUMEL_IN, PyLong_FromLongLong(p->numel)) ||
        put(values, R_NUMEL_OUT, PyLong_FromLongLong(p->numel_out)) ||
        put(values, R_IN_SHAPE, Py_NewRef(p->shape)) ||
        put(values, R_OUT_SHAPE, Py_NewRef(p->out_shape)) ||
        put(values, R_STEP, PyObject_GetAttr(s, x_str[S_STEP])) ||
        put(values, R_T_ENTER, PyFloat_FromDouble(now())) ||
        put(values, R_T_EXIT, PyFloat_FromDouble(0.0)) ||
        put(values, R_T_DONE, PyFloat_FromDouble(0.0)) ||
        put(values, R_IN_HASH, Py_NewRef(x_zero_hash)) ||
        put(values, R_OUT_HASH, Py_NewRef(x_zero_hash)) ||
        put(values, R_IN_SUMMARY, Py_NewRef(x_zero_summary)) ||
        put(values, R_OUT_SUMMARY, Py_NewRef(x_zero_summary)) ||
        put(values, R_CHUNKS, PyList_New(0)) ||
        put(values, R_PHASE, PyLong_FromLong(PHASE_ENTRY)) ||
        put(values, R_PEER, PyLong_FromLong(-1)) ||
        put(values, R_IN_SPLITS, Py_NewRef(x_empty_tuple)) ||
        put(values, R_OUT_SPLITS, Py_NewRef(x_empty_tuple))) {
        if (bad)
            Py_XDECREF(seq);
        Py_DECREF(values);
        return NULL;
    }
    return values;
}

/* fingerprint(t, code, hash, summary) -> ((h0, h1), summary) of the input (``out`` 0) or
 * a reduce_scatter's output (1), from what x_tensor read */
static PyObject *x_print(plan_t *p, int out, int hash, int summary)
{
    return out ? print_raw(p->out_ptr, (unsigned long long)p->numel_out, p->icode, hash, summary)
               : print_raw(p->ptr, (unsigned long long)p->numel, p->icode, hash, summary);
}

/* fingerprint_pieces(t, code, owners, side, hash, summary) -> (hash, summary, chunks) of
 * the input (``out`` 0) or a gather's output (1: all_gather's list, or the tensor) */
static PyObject *x_pieces(plan_t *p, int out, PyObject *owners, int side, int hash,
                          int summary)
{
    if (out && PyList_CheckExact(p->out))
        return pieces_raw(p->out, 0, 0, p->icode, owners, side, hash, summary);
    return out ? pieces_raw(NULL, p->out_ptr, (unsigned long long)p->numel_out, p->icode, owners,
                            side, hash, summary)
               : pieces_raw(NULL, p->ptr, (unsigned long long)p->numel, p->icode, owners, side,
                            hash, summary);
}

/* The input side, read before the call (all_reduce and broadcast write it): all_reduce's
 * and the gathered ops' when hashed or summarised, a broadcast root's; a reduce_scatter's
 * cut per destination (its chunks a third item). 1 and *inp set, 0 (none), or -1. */
static int x_input(ExpressObject *x, plan_t *p, PyObject **inp)
{
    int hash_in = x->hash_in, summ = x->summary;
    *inp = NULL;
    if (!hash_in && !summ)
        return 0;
    if (x->kind == X_BROADCAST) {
        PyObject *rank = PyObject_GetAttr(x->session, x_str[S_RANK]);
        if (!rank)
            return -1;
        long long r = PyLong_AsLongLong(rank);
        Py_DECREF(rank);
        if (r == -1 && PyErr_Occurred())
            return -1;
        if (r != p->root)
            return 0;
    }
    *inp = x->kind == X_SCATTER ? x_pieces(p, 0, p->members, SIDE_IN, hash_in, summ)
                                : x_print(p, 0, hash_in, summ);
    return *inp ? 1 : -1;
}

/* v[i], v[j] (, v[k]) = the first items of a fingerprint's tuple; -1 on error */
static int put_print(PyObject *v, PyObject *print, Py_ssize_t i, Py_ssize_t j, Py_ssize_t k)
{
    return PyList_SetItem(v, i, Py_NewRef(PyTuple_GET_ITEM(print, 0))) ||
           PyList_SetItem(v, j, Py_NewRef(PyTuple_GET_ITEM(print, 1))) ||
           (k >= 0 && PyList_SetItem(v, k, Py_NewRef(PyTuple_GET_ITEM(print, 2))));
}

/* The completion record's output fingerprint and its flags (the finish closures of
 * HotPath._all_reduce, _broadcast and _gathered), *algo set when it hashed. */
static int x_output(ExpressObject *x, plan_t *p, PyObject *v, long *flags, int *algo)
{
    int hash = x->hash_out, summ = x->summary;
    PyObject *out = NULL;
    Py_ssize_t chunks = -1;
    if ((x->kind == X_ALL_REDUCE || x->kind == X_SCATTER) && (hash || summ)) {
        out = x_print(p, x->kind == X_SCATTER, hash, summ);
        *flags |= (hash ? F_OUT_HASH : 0) | (summ ? F_OUT_SUMMARY : 0);
    } else if (x->kind == X_BROADCAST && hash) { /* the root's output: one chunk, its own */
        PyObject *owners = Py_BuildValue("[L]", p->root);
        out = owners ? x_pieces(p, 0, owners, SIDE_OUT, 1, 0) : NULL;
        Py_XDECREF(owners);
        *flags |= F_OUT_HASH;
        chunks = R_CHUNKS;
    } else if (GATHERS(x->kind) && hash) { /* a piece per member, owned by it */
        out = x_pieces(p, 1, p->members, SIDE_OUT, 1, 0);
        *flags |= F_OUT_HASH;
        chunks = R_CHUNKS;
    } else {
        return 0;
    }
    if (!out)
        return -1;
    int bad = put_print(v, out, R_OUT_HASH, R_OUT_SUMMARY, chunks);
    Py_DECREF(out);
    *algo = *algo || hash || (x->kind == X_ALL_REDUCE && x->hash_in);
    return bad ? -1 : 0;
}

/* The completion record's fingerprints and flags. -1 with an exception on error. */
static int x_finish(ExpressObject *x, plan_t *p, PyObject *v, PyObject *inp)
{
    int hash_in = x->hash_in, summ = x->summary, algo = 0;
    long flags = 0;
    if (inp) { /* a reduce_scatter's input chunks: the record's (a gather has none) */
        if (put_print(v, inp, R_IN_HASH, R_IN_SUMMARY, x->kind == X_SCATTER ? R_CHUNKS : -1))
            return -1;
        flags = (hash_in ? F_IN_HASH : 0) | (summ ? F_IN_SUMMARY : 0);
        algo = hash_in;
    }
    if (x_output(x, p, v, &flags, &algo))
        return -1;
    if (algo && PyList_SetItem(v, R_ALGO, Py_NewRef(x_str[S_XXH3])))
        return -1;
    return put(v, R_FLAGS, PyLong_FromLong(flags));
}

/* The guard's busy flag (guard.isolate / guard.restore): the previous value, a new
 * reference, or NULL on error. */
static PyObject *isolate(ExpressObject *x)
{
    PyObject *prev = PyObject_GetAttr(x->guard_local, x_str[S_BUSY]);
    if (!prev) {
        if (!PyErr_ExceptionMatches(PyExc_AttributeError))
            return NULL;
        PyErr_Clear();
        prev = Py_NewRef(Py_False);
    }
    if (PyObject_SetAttr(x->guard_local, x_str[S_BUSY], Py_True) < 0) {
        Py_DECREF(prev);
        return NULL;
    }
    return prev;
}

/* The real call between the two records, as HotPath.run's known path makes it. */
static PyObject *x_run(ExpressObject *x, plan_t *p, PyObject *orig, PyObject *pos,
                       PyObject *kw, PyObject *values, PyObject *inp)
{
    x_write(p->writer, p->ring, values);
    if (PyList_SetItem(values, R_PHASE, PyLong_FromLong(PHASE_COMPLETE)) < 0)
        report(x->fail); /* a small int: cannot fail */
    x->calls++;
    PyObject *query = PyObject_GetAttr(p->entry, x_str[S_QUERY]);
    PyObject *before = query ? PyObject_CallNoArgs(query) : NULL;
    Py_XDECREF(query);
    if (!before)
        PyErr_Clear(); /* read again only if the call raises; unreadable: None */
    PyObject *busy = isolate(x);
    if (!busy)
        report(x->fail); /* the entry is written: the call runs, unisolated */
    PyObject *result = PyObject_Call(orig, pos, PyDict_GET_SIZE(kw) ? kw : NULL);
    PyObject *exc = result ? NULL : take_exception();
    if (busy && PyObject_SetAttr(x->guard_local, x_str[S_BUSY], busy) < 0)
        PyErr_Clear();
    Py_XDECREF(busy);
    if (!result) {
        PyObject *r = PyObject_CallFunctionObjArgs(x->raised, values, p->group, p->entry,
                                                   before ? before : Py_None, exc, NULL);
        Py_XDECREF(r);
        Py_XDECREF(before);
        PyErr_Clear();
        if (exc) /* the caller's exception, as orig raised it */
            PyErr_Restore(Py_NewRef((PyObject *)Py_TYPE(exc)), exc,
                          PyException_GetTraceback(exc));
        else
            PyErr_SetString(PyExc_SystemError, "commcheck: a call failed without an exception");
        return NULL;
    }
    Py_XDECREF(before);
    PyObject *covered = PyObject_GetAttr(p->entry, x_str[S_COVERED]);
    PyObject *sum = covered ? PyNumber_Add(covered, p->works) : NULL;
    Py_XDECREF(covered);
    if (!sum || PyObject_SetAttr(p->entry, x_str[S_COVERED], sum) < 0)
        report(x->fail);
    Py_XDECREF(sum);
    if (put(values, R_T_EXIT, PyFloat_FromDouble(now())) || x_finish(x, p, values, inp) ||
        put(values, R_T_DONE, PyFloat_FromDouble(now())))
        report(x->fail);
    else
        x_write(p->writer, p->ring, values);
    return result;
}

/* call(orig, args, kwargs) -> what orig returned, or SLOW: the hot path's plan and run for
 * this call, taken whole or not at all. */
static PyObject *Express_call(ExpressObject *x, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyTuple_CheckExact(args[1]) || !PyDict_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "call(orig, args: tuple, kwargs: dict)");
        return NULL;
    }
    if (!x->on)
        return Py_NewRef(x->slow);
    plan_t p = {0};
    PyObject *values = NULL, *inp = NULL, *result = NULL;
    if (x_check(x, args[1], args[2], &p) == X_TAKE && x_input(x, &p, &inp) >= 0)
        values = x_entry(x, &p);
    if (values) {
        result = x_run(x, &p, args[0], args[1], args[2], values, inp);
    } else if (!PyErr_Occurred() || PyErr_ExceptionMatches(PyExc_Exception)) {
        /* nothing written: the Python path takes the call, and says what went wrong */
        PyErr_Clear();
        result = Py_NewRef(x->slow);
    }
    Py_XDECREF(values);
    Py_XDECREF(inp);
    plan_clear(&p);
    return result;
}

static PyMethodDef Express_methods[] = {
    {"call", (PyCFunction)(void (*)(void))Express_call, METH_FASTCALL,
     "call(orig, args, kwargs): the call taken whole, or SLOW"},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef Express_members[] = {
    {"on", T_INT, offsetof(ExpressObject, on), 0, "False: every call is SLOW"},
    {"calls", T_LONGLONG, offsetof(ExpressObject, calls), READONLY, "calls taken"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject ExpressType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "commcheck.native._hot.Express",
    .tp_basicsize = sizeof(ExpressObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Express_init,
    .tp_dealloc = (destructor)Express_dealloc,
    .tp_traverse = (traverseproc)Express_traverse,
    .tp_clear = (inquiry)Express_clear,
    .tp_methods = Express_methods,
    .tp_members = Express_members,
    .tp_doc = "One op's steady-state call in C (express.c).",
};

/* The type, RECORD_FIELDS and WIRE into the module; -1 on error. */
static int express_init(PyObject *m)
{
    for (int i = 0; i < S_COUNT; i++)
        if (!(x_str[i] = PyUnicode_InternFromString(x_names[i])))
            return -1;
    x_zero_hash = Py_BuildValue("(ii)", 0, 0);
    x_zero_summary = Py_BuildValue("(ddii)", 0.0, 0.0, 0, 0);
    x_empty_tuple = PyTuple_New(0);
    x_one = PyLong_FromLong(1);
    PyObject *fields = PyTuple_New(N_FIELDS);
    if (!x_zero_hash || !x_zero_summary || !x_empty_tuple || !x_one || !fields) {
        Py_XDECREF(fields);
        return -1;
    }
    for (int i = 0; i < N_FIELDS; i++) {
        PyObject *s = PyUnicode_FromString(record_fields[i]);
        if (!s) {
            Py_DECREF(fields);
            return -1;
        }
        PyTuple_SET_ITEM(fields, i, s);
    }
    PyObject *wire = Py_BuildValue(
        "{sisisisisisisisisi}", "F_IN_HASH", F_IN_HASH, "F_IN_SUMMARY", F_IN_SUMMARY,
        "F_OUT_HASH", F_OUT_HASH, "F_OUT_SUMMARY", F_OUT_SUMMARY, "PHASE_COMPLETE",
        PHASE_COMPLETE, "PHASE_ENTRY", PHASE_ENTRY, "NO_ROOT", NO_ROOT, "SIDE_IN", SIDE_IN,
        "SIDE_OUT", SIDE_OUT);
    int bad = !wire || PyType_Ready(&ExpressType) < 0 ||
              PyModule_AddObjectRef(m, "Express", (PyObject *)&ExpressType) < 0 ||
              PyModule_AddObjectRef(m, "RECORD_FIELDS", fields) < 0 ||
              PyModule_AddObjectRef(m, "WIRE", wire) < 0;
    Py_DECREF(fields);
    Py_XDECREF(wire);
    return bad ? -1 : 0;
}
