/* The probe's wrappers of DataLoader iterators (DataWrap) and torch.distributed collectives (CollWrap), in C:
 * each call reads the clock twice and appends one event to the Log (see _probefast.c). */
#include "_probefast.h"

/* ------------------------------------------------------------------ wrappers: common descriptor */

static PyObject *bind(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None) {
        Py_INCREF(self);
        return self;
    }
    return PyMethod_New(self, obj);
}

/* The head both wrappers begin with, so that one call and one dealloc serve them both. */
#define WRAP_HEAD PyObject_HEAD vectorcallfunc vc; Log *log; PyObject *fn;
typedef struct {
    WRAP_HEAD
} Wrap;

static PyObject *wrap_call(PyObject *o, PyObject *args, PyObject *kw)
{
    if (((Wrap *)o)->log == NULL) {
        const char *name = strrchr(Py_TYPE(o)->tp_name, '.');
        PyErr_Format(PyExc_TypeError, "%s was not initialised", name ? name + 1 : Py_TYPE(o)->tp_name);
        return NULL;
    }
    return PyVectorcall_Call(o, args, kw);
}

static void wrap_dealloc(PyObject *o)
{
    PyObject_GC_UnTrack(o);
    Py_TYPE(o)->tp_clear(o);
    Py_TYPE(o)->tp_free(o);
}

/* ------------------------------------------------------------------------------------- DataWrap */

typedef struct {
    WRAP_HEAD
    PyObject *dq_fn;
    PyTypeObject *single;               /* an iterator type whose queue depth is always 0 */
} DataWrap;

static PyObject *DataWrap_vc(PyObject *o, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    DataWrap *w = (DataWrap *)o;
    Log *L = w->log;
    int64_t t0 = now_ns();
    PyObject *r = PyObject_Vectorcall(w->fn, args, nargsf, kwnames);
    int64_t t1 = now_ns();
    int64_t dq = -1;
    if (L->dq_need && PyVectorcall_NARGS(nargsf) > 0) {
        PyObject *it = args[0];
        L->dq_need = 0;
        if (Py_TYPE(it) == w->single) {
            dq = 0;
        } else {
            PyObject *et, *ev, *tb;
            PyErr_Fetch(&et, &ev, &tb);
            PyObject *v = PyObject_CallOneArg(w->dq_fn, it);
            if (v == NULL) {
                PyErr_Clear();
            } else {
                long long x = PyLong_AsLongLong(v);
                if (x == -1 && PyErr_Occurred())
                    PyErr_Clear();
                else if (x == -2) {
                    w->single = Py_TYPE(it);
                    dq = 0;
                } else
                    dq = x;
                Py_DECREF(v);
            }
            PyErr_Restore(et, ev, tb);
        }
    }
    if (L->n >= L->cap && r == NULL) {          /* the drain must not see the call's exception */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        push(L, K_DATA, 0, t0, t1, dq, 0.0);
        PyErr_Restore(et, ev, tb);
    } else {
        push(L, K_DATA, 0, t0, t1, dq, 0.0);
    }
    return r;
}

static int DataWrap_init(DataWrap *w, PyObject *args, PyObject *kw)
{
    PyObject *log, *fn, *dq_fn;
    if (!PyArg_ParseTuple(args, "O!OO", &probefast_LogType, &log, &fn, &dq_fn))
        return -1;
    Py_INCREF(log);
    Py_XSETREF(w->log, (Log *)log);
    Py_INCREF(fn);
    Py_XSETREF(w->fn, fn);
    Py_INCREF(dq_fn);
    Py_XSETREF(w->dq_fn, dq_fn);
    w->single = NULL;
    w->vc = DataWrap_vc;
    return 0;
}

static int DataWrap_traverse(DataWrap *w, visitproc visit, void *arg)
{
    Py_VISIT(w->log);
    Py_VISIT(w->fn);
    Py_VISIT(w->dq_fn);
    return 0;
}

static int DataWrap_clear(DataWrap *w)
{
    Py_CLEAR(w->log);
    Py_CLEAR(w->fn);
    Py_CLEAR(w->dq_fn);
    return 0;
}

static PyMemberDef DataWrap_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(DataWrap, fn), READONLY, "the wrapped __next__"}, {NULL}};

PyTypeObject probefast_DataWrapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stepwatch.agents.probe._probefast.DataWrap",
    .tp_basicsize = sizeof(DataWrap),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "DataWrap(log, fn, dq_fn): a timed DataLoader iterator __next__",
    .tp_vectorcall_offset = offsetof(DataWrap, vc),
    .tp_call = wrap_call,
    .tp_descr_get = bind,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)DataWrap_init,
    .tp_dealloc = wrap_dealloc,
    .tp_traverse = (traverseproc)DataWrap_traverse,
    .tp_clear = (inquiry)DataWrap_clear,
    .tp_members = DataWrap_members,
};

/* ------------------------------------------------------------------------------------- CollWrap */

#define NCACHE 8

typedef struct {
    WRAP_HEAD
    PyObject *payload, *resolve, *nbytes_fn, *dev_begin, *dev_end, *dict;
    Py_ssize_t p_idx, g_idx, a_idx;
    PyObject *gkey[NCACHE];             /* borrowed: resolve() keeps every group it saw alive */
    int gslot[NCACHE];
    int ncache;
} CollWrap;

static PyObject *str_group, *str_async_op, *str_nbytes, *str_is_cpu;

/* the argument at position idx or keyword name (borrowed; NULL when absent) */
static inline PyObject *arg_of(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, Py_ssize_t idx,
                               PyObject *name)
{
    if (idx >= 0 && idx < nargs)
        return args[idx];
    if (kwnames != NULL && name != NULL) {
        Py_ssize_t nk = PyTuple_GET_SIZE(kwnames);
        for (Py_ssize_t i = 0; i < nk; i++) {
            PyObject *k = PyTuple_GET_ITEM(kwnames, i);
            if (k == name || PyUnicode_Compare(k, name) == 0)
                return args[nargs + i];
        }
    }
    return NULL;
}

static int coll_async(CollWrap *w, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames)
{
    PyObject *ao = arg_of(args, nargs, kwnames, w->a_idx, w->a_idx >= 0 ? str_async_op : NULL);
    int is_async = 0;
    if (ao != NULL) {
        is_async = PyObject_IsTrue(ao);
        if (is_async < 0) {
            PyErr_Clear();
            is_async = 0;
        }
    }
    return is_async;
}

/* a device token (>= 0) when the call's payload is a device tensor and it is synchronous, else -1 */
static long long coll_dev_begin(CollWrap *w, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    if (!w->log->dev_on || w->dev_begin == NULL || w->dev_begin == Py_None || w->payload == Py_None)
        return -1;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *x = arg_of(args, nargs, kwnames, w->p_idx, w->payload);
    if (x == NULL || x == Py_None || coll_async(w, args, nargs, kwnames))
        return -1;
    PyObject *cpu = PyObject_GetAttr(x, str_is_cpu);
    if (cpu == NULL) {
        PyErr_Clear();
        return -1;
    }
    int on_cpu = cpu == Py_True;
    Py_DECREF(cpu);
    if (on_cpu)
        return -1;
    PyObject *tok = PyObject_CallOneArg(w->dev_begin, x);
    if (tok == NULL) {
        PyErr_Clear();
        return -1;
    }
    long long t = PyLong_AsLongLong(tok);
    Py_DECREF(tok);
    if (t == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        return -1;
    }
    return t;
}

static void coll_record(CollWrap *w, PyObject *const *args, size_t nargsf, PyObject *kwnames, int64_t t0,
                        int64_t t1, long long token)
{
    Log *L = w->log;
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    PyObject *group = arg_of(args, nargs, kwnames, w->g_idx, str_group);
    if (group == NULL)
        group = Py_None;
    int slot = -2;
    for (int i = 0; i < w->ncache; i++)
        if (w->gkey[i] == group) {
            slot = w->gslot[i];
            break;
        }
    if (slot == -2) {
        PyObject *v = PyObject_CallOneArg(w->resolve, group);
        if (v == NULL) {
            PyErr_Clear();
            return;
        }
        slot = (int)PyLong_AsLong(v);
        Py_DECREF(v);
        if (PyErr_Occurred()) {
            PyErr_Clear();
            return;
        }
        if (w->ncache < NCACHE) {
            w->gkey[w->ncache] = group;
            w->gslot[w->ncache++] = slot;
        }
    }
    if (slot < 0) {
        L->comm_keys_dropped++;
        return;
    }
    long long nbytes = 0;
    PyObject *x = w->payload == Py_None ? NULL : arg_of(args, nargs, kwnames, w->p_idx, w->payload);
    if (x != NULL && x != Py_None) {
        PyObject *v = PyObject_GetAttr(x, str_nbytes);
        if (v == NULL) {                            /* a list of tensors: the Python helper sums them */
            PyErr_Clear();
            v = PyObject_CallOneArg(w->nbytes_fn, x);
        }
        if (v == NULL) {
            PyErr_Clear();
        } else {
            nbytes = PyLong_AsLongLong(v);
            if (nbytes == -1 && PyErr_Occurred()) {
                PyErr_Clear();
                nbytes = 0;
            }
            Py_DECREF(v);
        }
    }
    if (token >= 0)
        push(L, K_DCOLL, slot, t0, t1, nbytes, (double)token);
    else
        push(L, K_COLL, slot, t0, t1, nbytes, coll_async(w, args, nargs, kwnames) ? 0.0 : -1.0);
}

static PyObject *CollWrap_vc(PyObject *o, PyObject *const *args, size_t nargsf, PyObject *kwnames)
{
    CollWrap *w = (CollWrap *)o;
    Log *L = w->log;
    if (L->in_coll)                             /* a collective made of collectives: the outer one counts */
        return PyObject_Vectorcall(w->fn, args, nargsf, kwnames);
    L->in_coll = 1;
    long long token = coll_dev_begin(w, args, nargsf, kwnames);
    int64_t t0 = now_ns();
    L->coll_t0 = t0;
    PyObject *r = PyObject_Vectorcall(w->fn, args, nargsf, kwnames);
    int64_t t1 = now_ns();
    L->in_coll = 0;
    PyObject *et = NULL, *ev = NULL, *tb = NULL;
    if (r == NULL)
        PyErr_Fetch(&et, &ev, &tb);
    if (token >= 0) {
        PyObject *tok = PyLong_FromLongLong(token);
        PyObject *x = tok ? PyObject_CallOneArg(w->dev_end, tok) : NULL;
        Py_XDECREF(tok);
        Py_XDECREF(x);
        if (PyErr_Occurred())
            PyErr_Clear();
    }
    coll_record(w, args, nargsf, kwnames, t0, t1, token);
    if (PyErr_Occurred())
        PyErr_Clear();
    if (r == NULL)
        PyErr_Restore(et, ev, tb);
    return r;
}

static int CollWrap_init(CollWrap *w, PyObject *args, PyObject *kw)
{
    PyObject *log, *fn, *payload, *resolve, *nbytes_fn, *dev_begin = Py_None, *dev_end = Py_None;
    Py_ssize_t p_idx, g_idx, a_idx;
    if (!PyArg_ParseTuple(args, "O!OnnnOOO|OO", &probefast_LogType, &log, &fn, &p_idx, &g_idx, &a_idx, &payload, &resolve,
                          &nbytes_fn, &dev_begin, &dev_end))
        return -1;
    if (payload != Py_None && !PyUnicode_Check(payload)) {
        PyErr_Format(PyExc_TypeError, "CollWrap: payload must be a parameter name or None, got %R", payload);
        return -1;
    }
    Py_INCREF(log);
    Py_XSETREF(w->log, (Log *)log);
    Py_INCREF(fn);
    Py_XSETREF(w->fn, fn);
    Py_INCREF(payload);
    Py_XSETREF(w->payload, payload);
    Py_INCREF(resolve);
    Py_XSETREF(w->resolve, resolve);
    Py_INCREF(nbytes_fn);
    Py_XSETREF(w->nbytes_fn, nbytes_fn);
    Py_INCREF(dev_begin);
    Py_XSETREF(w->dev_begin, dev_begin);
    Py_INCREF(dev_end);
    Py_XSETREF(w->dev_end, dev_end);
    w->p_idx = p_idx;
    w->g_idx = g_idx;
    w->a_idx = a_idx;
    w->ncache = 0;
    w->vc = CollWrap_vc;
    return 0;
}

static int CollWrap_traverse(CollWrap *w, visitproc visit, void *arg)
{
    Py_VISIT(w->log);
    Py_VISIT(w->fn);
    Py_VISIT(w->payload);
    Py_VISIT(w->resolve);
    Py_VISIT(w->nbytes_fn);
    Py_VISIT(w->dev_begin);
    Py_VISIT(w->dev_end);
    Py_VISIT(w->dict);
    return 0;
}

static int CollWrap_clear(CollWrap *w)
{
    Py_CLEAR(w->log);
    Py_CLEAR(w->fn);
    Py_CLEAR(w->payload);
    Py_CLEAR(w->resolve);
    Py_CLEAR(w->nbytes_fn);
    Py_CLEAR(w->dev_begin);
    Py_CLEAR(w->dev_end);
    Py_CLEAR(w->dict);
    w->ncache = 0;
    return 0;
}

static PyMemberDef CollWrap_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(CollWrap, fn), READONLY, "the wrapped collective"},
    {NULL}};

PyTypeObject probefast_CollWrapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stepwatch.agents.probe._probefast.CollWrap",
    .tp_basicsize = sizeof(CollWrap),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "CollWrap(log, fn, p_idx, g_idx, a_idx, payload, resolve, nbytes_fn[, dev_begin, dev_end]): "
              "a timed collective",
    .tp_vectorcall_offset = offsetof(CollWrap, vc),
    .tp_call = wrap_call,
    .tp_dictoffset = offsetof(CollWrap, dict),
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)CollWrap_init,
    .tp_dealloc = wrap_dealloc,
    .tp_traverse = (traverseproc)CollWrap_traverse,
    .tp_clear = (inquiry)CollWrap_clear,
    .tp_members = CollWrap_members,
};

int probefast_wrap_init(void)
{
    str_group = PyUnicode_InternFromString("group");
    str_async_op = PyUnicode_InternFromString("async_op");
    str_nbytes = PyUnicode_InternFromString("nbytes");
    str_is_cpu = PyUnicode_InternFromString("is_cpu");
    return (!str_group || !str_async_op || !str_nbytes || !str_is_cpu) ? -1 : 0;
}
