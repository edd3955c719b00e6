/* Gate: a ProcessGroup method's wrapper whose nested calls go straight to torch's method.
 *
 * Why: dist.all_reduce and its kin call ProcessGroup methods (group.allreduce,
 * group._allgather_base...), which commcheck also wraps for callers that skip dist.*. Inside
 * a wrapped dist.* call those wrappers must step aside (guard.isolate set the thread's busy
 * flag), and in Python stepping aside was a frame, the argument repacking and the flag's
 * read: 0.3-0.8 µs of every collective, paid for nothing (docs/decisions.md, "Nested calls
 * in C"). A Gate reads the same flag and, when it is set, calls the method itself with the
 * caller's arguments as they came; otherwise it calls the Python wrapper, which decides
 * everything as before (compiling, torch's own callers, recorded or counted).
 *
 * It is a method descriptor (Py_TPFLAGS_METHOD_DESCRIPTOR): stored on the class, `pg.m(...)`
 * calls it with `pg` first, as a Python function would be; other attributes (__name__,
 * __commcheck_original__...) are the Python wrapper's.
 *
 * Included by hot.c (its conventions apply); needs nothing of Python 3.11.
 */

typedef struct {
    PyObject_HEAD
    PyObject *orig;  /* torch's method (unbound: self is the first argument) */
    PyObject *slow;  /* the Python wrapper, for every call not nested */
    PyObject *local; /* guard._local: the thread's busy flag */
    vectorcallfunc vectorcall;
} GateObject;

static PyObject *s_busy;

/* 1 when the calling thread is inside a wrapped call, else 0; never an exception (an
 * unreadable flag sends the call to the Python wrapper, which reads it again). */
static int gate_busy(GateObject *g)
{
    PyObject *b = PyObject_GetAttr(g->local, s_busy);
    if (!b) {
        PyErr_Clear();
        return 0;
    }
    int on = b == Py_True ? 1 : b == Py_False ? 0 : PyObject_IsTrue(b);
    Py_DECREF(b);
    if (on < 0) {
        PyErr_Clear();
        return 0;
    }
    return on;
}

static PyObject *Gate_vectorcall(PyObject *self, PyObject *const *args, size_t nargsf,
                                 PyObject *kwnames)
{
    GateObject *g = (GateObject *)self;
    return PyObject_Vectorcall(gate_busy(g) ? g->orig : g->slow, args, nargsf, kwnames);
}

static int Gate_init(GateObject *g, PyObject *args, PyObject *kwds)
{
    static char *kw[] = {"orig", "slow", "local", NULL};
    PyObject *orig, *slow, *local;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO:Gate", kw, &orig, &slow, &local))
        return -1;
    if (!PyCallable_Check(orig) || !PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_TypeError, "Gate(orig, slow, local): orig and slow are called");
        return -1;
    }
    Py_XSETREF(g->orig, Py_NewRef(orig));
    Py_XSETREF(g->slow, Py_NewRef(slow));
    Py_XSETREF(g->local, Py_NewRef(local));
    g->vectorcall = Gate_vectorcall;
    return 0;
}

static int Gate_traverse(GateObject *g, visitproc visit, void *arg)
{
    Py_VISIT(g->orig);
    Py_VISIT(g->slow);
    Py_VISIT(g->local);
    return 0;
}

static int Gate_clear(GateObject *g)
{
    Py_CLEAR(g->orig);
    Py_CLEAR(g->slow);
    Py_CLEAR(g->local);
    return 0;
}

static void Gate_dealloc(GateObject *g)
{
    PyObject_GC_UnTrack(g);
    Gate_clear(g);
    Py_TYPE(g)->tp_free((PyObject *)g);
}

/* As a Python function: bound to an instance, itself on the class. */
static PyObject *Gate_get(PyObject *self, PyObject *obj, PyObject *type)
{
    if (!obj || obj == Py_None)
        return Py_NewRef(self);
    return PyMethod_New(self, obj);
}

/* Its own members first, then the Python wrapper's attributes. */
static PyObject *Gate_getattro(PyObject *self, PyObject *name)
{
    GateObject *g = (GateObject *)self;
    PyObject *v = PyObject_GenericGetAttr(self, name);
    if (v || !g->slow || !PyErr_ExceptionMatches(PyExc_AttributeError))
        return v;
    PyErr_Clear();
    return PyObject_GetAttr(g->slow, name);
}

static PyMemberDef Gate_members[] = {
    {"orig", T_OBJECT, offsetof(GateObject, orig), READONLY, NULL},
    {"slow", T_OBJECT, offsetof(GateObject, slow), READONLY, NULL},
    {NULL},
};

static PyTypeObject GateType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "commcheck.native._hot.Gate",
    .tp_basicsize = sizeof(GateObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "Gate(orig, slow, local): nested calls to orig, the others to slow",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Gate_init,
    .tp_dealloc = (destructor)Gate_dealloc,
    .tp_traverse = (traverseproc)Gate_traverse,
    .tp_clear = (inquiry)Gate_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(GateObject, vectorcall),
    .tp_descr_get = Gate_get,
    .tp_getattro = Gate_getattro,
    .tp_members = Gate_members,
};

static int gate_init(PyObject *m)
{
    s_busy = PyUnicode_InternFromString("busy");
    if (!s_busy || PyType_Ready(&GateType) < 0)
        return -1;
    return PyModule_AddObjectRef(m, "Gate", (PyObject *)&GateType);
}
