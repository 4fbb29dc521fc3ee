/* The probe's hot path in C: the hooks and wrappers that run inside every training step.
 *
 * On a real training loop the probe's code runs once per step, between milliseconds of framework
 * work that evict it from the caches; each Python operation then costs ~0.1-0.3 µs and the per-step
 * logic of the pure-Python probe added ~25 µs to a 250 µs step. Here each hook only reads the clock
 * (CLOCK_MONOTONIC, the clock of time.perf_counter_ns) and appends one fixed-size event to a
 * preallocated array; stepwatch.agents.probe replays the events in Python, warm, a few hundred at a
 * time (Probe._replay), so the step semantics exist once, in Python. The pure-Python fallback
 * (probe._PyLog and the closures beside it) appends the same events as tuples.
 *
 * Objects:
 *   Log(cap, on_drain, on_first_opt)  the event array. add(kind, slot, t0, t1, a, b) appends one event
 *       (calls on_drain() when the array is full); drain() returns the events as a list of 6-tuples and
 *       empties it; opt_pre / opt_post are the torch optimizer step hooks (one event per step:
 *       (K_OPT_POST, t0 = pre-hook time, t1 = post-hook time, a = id(optimizer)); opt_post calls on_drain() when
 *       `high` events wait, `drain_ns` passed since `last_drain`, or `eager` is set).
 *   DataWrap(log, fn, dq_fn)  a DataLoader iterator's __next__; records (t0, t1) and, at the first call
 *       after a step boundary, the prefetch queue depth from dq_fn(it) (-2: "0, and the same for every
 *       iterator of this type", cached).
 *   CollWrap(log, fn, p_idx, g_idx, a_idx, payload, resolve, nbytes_fn)  a torch.distributed collective:
 *       records (slot, t0, t1, payload bytes, 0.0 when async_op else -1.0). resolve(group) gives the
 *       accumulator slot of a process group (cached here per group object, -1 when none is left).
 *       With dev_begin/dev_end (optional): a synchronous call whose payload is a device tensor
 *       (tensor.is_cpu false) is bracketed by dev_begin(tensor) -> token (>= 0; device events
 *       recorded on the current stream) and dev_end(token), and logged as K_DCOLL with the token, so
 *       that the replay takes the device time (the collective's kernel, waiting for peers included)
 *       rather than the host's, which on CUDA/NPU is the launch only.
 * Nothing here raises into the training code: errors of the probe's own work are cleared, and an
 * exception of the wrapped call is kept across the recording.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

enum { K_OPT_POST = 2, K_DATA = 3, K_COLL = 4, K_DCOLL = 10 };      /* as in probe.py */

typedef struct {
    int32_t kind, slot;
    int64_t t0, t1, a;
    double b;
} Ev;

static inline int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* ------------------------------------------------------------------------------------------ Log */

typedef struct {
    PyObject_HEAD
    Ev *ev;
    Py_ssize_t n, cap, high;
    long long last_drain, drain_ns, primary, lost, comm_keys_dropped, pre_t, coll_t0;
    int eager, dq_need, in_coll, draining, dev_on;
    PyObject *on_drain, *on_first_opt;
} Log;

static void call_drain(Log *L)
{
    if (L->draining || L->on_drain == NULL)
        return;
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);                 /* the wrapped call's exception, if any, survives */
    L->draining = 1;
    PyObject *r = PyObject_CallNoArgs(L->on_drain);
    L->draining = 0;
    if (r == NULL)
        PyErr_Clear();
    Py_XDECREF(r);
    PyErr_Restore(et, ev, tb);
}

static inline void push(Log *L, int32_t kind, int32_t slot, int64_t t0, int64_t t1, int64_t a, double b)
{
    if (L->n >= L->cap) {
        call_drain(L);
        if (L->n >= L->cap) {                   /* a drain is running (re-entered): count, drop */
            L->lost++;
            return;
        }
    }
    Ev *e = &L->ev[L->n++];
    e->kind = kind; e->slot = slot; e->t0 = t0; e->t1 = t1; e->a = a; e->b = b;
}

static int Log_init(Log *L, PyObject *args, PyObject *kw)
{
    static char *names[] = {"cap", "on_drain", "on_first_opt", NULL};
    Py_ssize_t cap;
    PyObject *on_drain, *on_first_opt;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "nOO", names, &cap, &on_drain, &on_first_opt))
        return -1;
    if (cap < 2 || cap > (1 << 24)) {
        PyErr_Format(PyExc_ValueError, "Log: cap must be in 2..16777216, got %zd", cap);
        return -1;
    }
    PyMem_Free(L->ev);
    L->ev = PyMem_Calloc((size_t)cap, sizeof(Ev));
    if (L->ev == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    L->cap = cap;
    L->high = cap / 2;
    L->n = 0;
    L->drain_ns = 500000000LL;
    L->dq_need = 1;
    Py_INCREF(on_drain);
    Py_XSETREF(L->on_drain, on_drain);
    Py_INCREF(on_first_opt);
    Py_XSETREF(L->on_first_opt, on_first_opt);
    return 0;
}

static int Log_traverse(Log *L, visitproc visit, void *arg)
{
    Py_VISIT(L->on_drain);
    Py_VISIT(L->on_first_opt);
    return 0;
}

static int Log_clear(Log *L)
{
    Py_CLEAR(L->on_drain);
    Py_CLEAR(L->on_first_opt);
    return 0;
}

static void Log_dealloc(Log *L)
{
    PyObject_GC_UnTrack(L);
    Log_clear(L);
    PyMem_Free(L->ev);
    Py_TYPE(L)->tp_free((PyObject *)L);
}

static PyObject *Log_add(Log *L, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 6) {
        PyErr_Format(PyExc_TypeError, "Log.add takes 6 arguments (kind, slot, t0, t1, a, b), got %zd", nargs);
        return NULL;
    }
    long kind = PyLong_AsLong(args[0]), slot = PyLong_AsLong(args[1]);
    long long t0 = PyLong_AsLongLong(args[2]), t1 = PyLong_AsLongLong(args[3]), a = PyLong_AsLongLong(args[4]);
    double b = PyFloat_AsDouble(args[5]);
    if (PyErr_Occurred())
        return NULL;
    push(L, (int32_t)kind, (int32_t)slot, t0, t1, a, b);
    Py_RETURN_NONE;
}

static PyObject *Log_drain(Log *L, PyObject *unused)
{
    Py_ssize_t n = L->n;
    if (n == 0)
        return PyList_New(0);
    Ev *copy = PyMem_Malloc((size_t)n * sizeof(Ev));
    if (copy == NULL)
        return PyErr_NoMemory();
    memcpy(copy, L->ev, (size_t)n * sizeof(Ev));
    L->n = 0;                           /* events appended while the tuples are built (GC) stay for later */
    PyObject *out = PyList_New(n);
    if (out == NULL) {
        PyMem_Free(copy);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        Ev *e = &copy[i];
        PyObject *t = Py_BuildValue("(iiLLLd)", e->kind, e->slot, (long long)e->t0, (long long)e->t1,
                                    (long long)e->a, e->b);
        if (t == NULL) {
            Py_DECREF(out);
            PyMem_Free(copy);
            return NULL;
        }
        PyList_SET_ITEM(out, i, t);
    }
    PyMem_Free(copy);
    return out;
}

/* the events waiting, as drain() gives them, without emptying the log (the watchdog thread's view) */
static PyObject *Log_peek(Log *L, PyObject *unused)
{
    Py_ssize_t n = L->n;
    PyObject *out = PyList_New(n);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Ev *e = &L->ev[i];
        PyObject *t = Py_BuildValue("(iiLLLd)", e->kind, e->slot, (long long)e->t0, (long long)e->t1,
                                    (long long)e->a, e->b);
        if (t == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, t);
    }
    return out;
}

static PyObject *Log_clear_events(Log *L, PyObject *unused)
{
    L->n = 0;
    Py_RETURN_NONE;
}

static PyObject *Log_opt_pre(Log *L, PyObject *const *args, Py_ssize_t nargs)
{
    L->pre_t = now_ns();                /* sent with the post-hook's event: one event per optimizer step */
    Py_RETURN_NONE;
}

static PyObject *Log_opt_post(Log *L, PyObject *const *args, Py_ssize_t nargs)
{
    int64_t t = now_ns();
    PyObject *opt = nargs > 0 ? args[0] : Py_None;
    if (L->primary == 0 && L->on_first_opt != NULL) {     /* once: the Python side picks the primary */
        PyObject *r = PyObject_CallOneArg(L->on_first_opt, opt);
        if (r == NULL)
            PyErr_Clear();
        Py_XDECREF(r);
    }
    push(L, K_OPT_POST, 0, L->pre_t, t, (int64_t)(intptr_t)opt, 0.0);
    L->pre_t = 0;
    L->dq_need = 1;
    if (L->eager || L->n >= L->high || t - L->last_drain >= L->drain_ns)
        call_drain(L);
    Py_RETURN_NONE;
}

static PyObject *Log_len(Log *L, void *closure) { return PyLong_FromSsize_t(L->n); }

static PyMethodDef Log_methods[] = {
    {"add", (PyCFunction)(void (*)(void))Log_add, METH_FASTCALL, "add(kind, slot, t0, t1, a, b)"},
    {"drain", (PyCFunction)Log_drain, METH_NOARGS, "the events as 6-tuples; the log is emptied"},
    {"clear", (PyCFunction)Log_clear_events, METH_NOARGS, "forget the events"},
    {"peek", (PyCFunction)Log_peek, METH_NOARGS, "the events as 6-tuples; the log is kept"},
    {"opt_pre", (PyCFunction)(void (*)(void))Log_opt_pre, METH_FASTCALL, "optimizer step pre-hook"},
    {"opt_post", (PyCFunction)(void (*)(void))Log_opt_post, METH_FASTCALL, "optimizer step post-hook"},
    {NULL}};

static PyMemberDef Log_members[] = {
    {"cap", T_PYSSIZET, offsetof(Log, cap), READONLY, "events held at most"},
    {"high", T_PYSSIZET, offsetof(Log, high), 0, "a step end drains once this many wait"},
    {"last_drain", T_LONGLONG, offsetof(Log, last_drain), 0, "perf ns of the last drain"},
    {"drain_ns", T_LONGLONG, offsetof(Log, drain_ns), 0, "a step end drains when this much passed"},
    {"primary", T_LONGLONG, offsetof(Log, primary), 0, "id of the primary optimizer (0: none yet)"},
    {"pre_t", T_LONGLONG, offsetof(Log, pre_t), 0, "perf ns of the running optimizer step's pre-hook"},
    {"lost", T_LONGLONG, offsetof(Log, lost), 0, "events dropped (log full while draining)"},
    {"comm_keys_dropped", T_LONGLONG, offsetof(Log, comm_keys_dropped), 0, "collectives without a slot"},
    {"eager", T_INT, offsetof(Log, eager), 0, "drain at every step end"},
    {"dq_need", T_INT, offsetof(Log, dq_need), 0, "the next DataLoader call reads the queue depth"},
    {"in_coll", T_INT, offsetof(Log, in_coll), 0, "inside a wrapped collective"},
    {"coll_t0", T_LONGLONG, offsetof(Log, coll_t0), 0, "perf ns when the running collective started"},
    {"dev_on", T_INT, offsetof(Log, dev_on), 0, "an accelerator is in use: look at the payload's device"},
    {NULL}};

static PyGetSetDef Log_getset[] = {{"n", (getter)Log_len, NULL, "events waiting", NULL}, {NULL}};

static PyTypeObject LogType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stepwatch.agents._probefast.Log",
    .tp_basicsize = sizeof(Log),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "Log(cap, on_drain, on_first_opt): the probe's preallocated event array",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Log_init,
    .tp_dealloc = (destructor)Log_dealloc,
    .tp_traverse = (traverseproc)Log_traverse,
    .tp_clear = (inquiry)Log_clear,
    .tp_methods = Log_methods,
    .tp_members = Log_members,
    .tp_getset = Log_getset,
};

/* ------------------------------------------------------------------ wrappers: common descriptor */

static PyObject *bind(PyObject *self, PyObject *obj, PyObject *type)
{
    if (obj == NULL || obj == Py_None) {
        Py_INCREF(self);
        return self;
    }
    return PyMethod_New(self, obj);
}

/* ------------------------------------------------------------------------------------- DataWrap */

typedef struct {
    PyObject_HEAD
    vectorcallfunc vc;
    Log *log;
    PyObject *fn, *dq_fn;
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
    if (!PyArg_ParseTuple(args, "O!OO", &LogType, &log, &fn, &dq_fn))
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

static void DataWrap_dealloc(DataWrap *w)
{
    PyObject_GC_UnTrack(w);
    DataWrap_clear(w);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyObject *DataWrap_call(PyObject *o, PyObject *args, PyObject *kw)
{
    if (((DataWrap *)o)->log == NULL) {
        PyErr_SetString(PyExc_TypeError, "DataWrap was not initialised");
        return NULL;
    }
    return PyVectorcall_Call(o, args, kw);
}

static PyMemberDef DataWrap_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(DataWrap, fn), READONLY, "the wrapped __next__"}, {NULL}};

static PyTypeObject DataWrapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stepwatch.agents._probefast.DataWrap",
    .tp_basicsize = sizeof(DataWrap),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL | Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_doc = "DataWrap(log, fn, dq_fn): a timed DataLoader iterator __next__",
    .tp_vectorcall_offset = offsetof(DataWrap, vc),
    .tp_call = DataWrap_call,
    .tp_descr_get = bind,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)DataWrap_init,
    .tp_dealloc = (destructor)DataWrap_dealloc,
    .tp_traverse = (traverseproc)DataWrap_traverse,
    .tp_clear = (inquiry)DataWrap_clear,
    .tp_members = DataWrap_members,
};

/* ------------------------------------------------------------------------------------- CollWrap */

#define NCACHE 8

typedef struct {
    PyObject_HEAD
    vectorcallfunc vc;
    Log *log;
    PyObject *fn, *payload, *resolve, *nbytes_fn, *dev_begin, *dev_end, *dict;
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
    if (!PyArg_ParseTuple(args, "O!OnnnOOO|OO", &LogType, &log, &fn, &p_idx, &g_idx, &a_idx, &payload, &resolve,
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

static void CollWrap_dealloc(CollWrap *w)
{
    PyObject_GC_UnTrack(w);
    CollWrap_clear(w);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyObject *CollWrap_call(PyObject *o, PyObject *args, PyObject *kw)
{
    if (((CollWrap *)o)->log == NULL) {
        PyErr_SetString(PyExc_TypeError, "CollWrap was not initialised");
        return NULL;
    }
    return PyVectorcall_Call(o, args, kw);
}

static PyMemberDef CollWrap_members[] = {
    {"__wrapped__", T_OBJECT, offsetof(CollWrap, fn), READONLY, "the wrapped collective"},
    {NULL}};

static PyTypeObject CollWrapType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stepwatch.agents._probefast.CollWrap",
    .tp_basicsize = sizeof(CollWrap),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "CollWrap(log, fn, p_idx, g_idx, a_idx, payload, resolve, nbytes_fn[, dev_begin, dev_end]): "
              "a timed collective",
    .tp_vectorcall_offset = offsetof(CollWrap, vc),
    .tp_call = CollWrap_call,
    .tp_dictoffset = offsetof(CollWrap, dict),
    .tp_getattro = PyObject_GenericGetAttr,
    .tp_setattro = PyObject_GenericSetAttr,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)CollWrap_init,
    .tp_dealloc = (destructor)CollWrap_dealloc,
    .tp_traverse = (traverseproc)CollWrap_traverse,
    .tp_clear = (inquiry)CollWrap_clear,
    .tp_members = CollWrap_members,
};

/* ---------------------------------------------------------------------------------- pack_step */

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the datagram layout is little-endian; pack_step writes native byte order"
#endif

#define MAX_SLOTS 16                    /* probe.MAX_COMM */
#define HDR_STEP_SIZE 136
#define PHASE_SIZE 16
#define COMM_SIZE 40

static inline void put(char *p, const void *v, size_t n) { memcpy(p, v, n); }

/* pack_step(buf, off, inst, rank, step, t0w, wall, step_ns, data_ns, compute_ns, gc_ns, gc_count, dq,
 *           samples, tokens, dropped, touched, ph, ids, calls, traffic, nspb, keys, gcrows, cpu_ns,
 *           cpu_wait_ns) -> new off
 * One step's frame, byte for byte what Probe._replay packs in Python (HDR_STEP, PHASE per touched
 * slot, COMM per accumulator slot in order of first call, the GC rows): the calls are summed per slot,
 * a call without a known wait split with the bandwidth model, compute_ns < 0 derived. */
static PyObject *pack_step(PyObject *self, PyObject *const *a, Py_ssize_t nargs)
{
    if (nargs != 26) {
        PyErr_Format(PyExc_TypeError, "pack_step takes 26 arguments, got %zd", nargs);
        return NULL;
    }
    long long off = PyLong_AsLongLong(a[1]);
    long inst = PyLong_AsLong(a[2]), rank = PyLong_AsLong(a[3]);
    long long step = PyLong_AsLongLong(a[4]), t0w = PyLong_AsLongLong(a[5]), wall = PyLong_AsLongLong(a[6]);
    long long step_ns = PyLong_AsLongLong(a[7]), data_ns = PyLong_AsLongLong(a[8]);
    double compute_given = PyFloat_AsDouble(a[9]);
    long long gc_ns = PyLong_AsLongLong(a[10]);
    long gc_count = PyLong_AsLong(a[11]), dq = PyLong_AsLong(a[12]);
    long long samples = PyLong_AsLongLong(a[13]), tokens = PyLong_AsLongLong(a[14]);
    unsigned long dropped = PyLong_AsUnsignedLongMask(a[15]);
    PyObject *touched = a[16], *ph = a[17], *ids = a[18], *calls = a[19], *traffic = a[20], *keys = a[22];
    double nspb = PyFloat_AsDouble(a[21]);
    PyObject *gcrows = a[23];
    double cpu_ns = PyFloat_AsDouble(a[24]), cpu_wait_ns = PyFloat_AsDouble(a[25]);
    if (PyErr_Occurred())
        return NULL;
    if (!PyList_Check(touched) || !PyList_Check(ph) || !PyList_Check(ids) || !PyList_Check(calls) ||
        !PyList_Check(traffic) || !PyList_Check(keys)) {
        PyErr_SetString(PyExc_TypeError, "pack_step: touched, ph, ids, calls, traffic and keys must be lists");
        return NULL;
    }
    /* the calls, summed per slot in order of first appearance (as the dict of _sum_calls) */
    int order[MAX_SLOTS], nslots = 0, seen[MAX_SLOTS];
    long long cnt[MAX_SLOTS], nb[MAX_SLOTS];
    double tt[MAX_SLOTS], ww[MAX_SLOTS];
    memset(seen, 0, sizeof(seen));
    double comm_ns = 0.0, wait_ns = 0.0;
    Py_ssize_t ncalls = PyList_GET_SIZE(calls);
    for (Py_ssize_t i = 0; i < ncalls; i++) {
        PyObject *c = PyList_GET_ITEM(calls, i);
        if (!PyTuple_Check(c) || PyTuple_GET_SIZE(c) != 5) {
            PyErr_SetString(PyExc_TypeError, "pack_step: a call is (slot, count, bytes, ns, wait ns | None)");
            return NULL;
        }
        long s = PyLong_AsLong(PyTuple_GET_ITEM(c, 0));
        long long count = PyLong_AsLongLong(PyTuple_GET_ITEM(c, 1));
        long long bytes = PyLong_AsLongLong(PyTuple_GET_ITEM(c, 2));
        double dt = PyFloat_AsDouble(PyTuple_GET_ITEM(c, 3));
        PyObject *wo = PyTuple_GET_ITEM(c, 4);
        double wait;
        if (PyErr_Occurred())
            return NULL;
        if (s < 0 || s >= MAX_SLOTS || s >= PyList_GET_SIZE(traffic)) {
            PyErr_Format(PyExc_ValueError, "pack_step: call slot %ld out of range", s);
            return NULL;
        }
        if (wo == Py_None) {
            double tr = (double)bytes * PyFloat_AsDouble(PyList_GET_ITEM(traffic, s)) * nspb;
            wait = dt > tr ? dt - tr : 0.0;
        } else {
            wait = PyFloat_AsDouble(wo);
        }
        if (PyErr_Occurred())
            return NULL;
        if (!seen[s]) {
            seen[s] = 1;
            order[nslots++] = (int)s;
            cnt[s] = count; nb[s] = bytes; tt[s] = dt; ww[s] = wait;
        } else {
            cnt[s] += count; nb[s] += bytes; tt[s] += dt; ww[s] += wait;
        }
        comm_ns += dt - wait;
        wait_ns += wait;
    }
    double compute_ns = compute_given;
    if (compute_given < 0) {
        compute_ns = (double)(step_ns - data_ns) - comm_ns - wait_ns - (double)gc_ns -
                     (cpu_wait_ns > 0 ? cpu_wait_ns : 0.0);
        if (compute_ns < 0)
            compute_ns = 0.0;
    }
    Py_ssize_t nphase = PyList_GET_SIZE(touched);
    Py_buffer gb = {0};
    int have_gc = gcrows != Py_None;
    if (have_gc && PyObject_GetBuffer(gcrows, &gb, PyBUF_SIMPLE) < 0)
        return NULL;
    Py_ssize_t need = HDR_STEP_SIZE + nphase * PHASE_SIZE + nslots * COMM_SIZE + (have_gc ? gb.len : 0);
    Py_buffer bb;
    if (PyObject_GetBuffer(a[0], &bb, PyBUF_WRITABLE) < 0) {
        if (have_gc)
            PyBuffer_Release(&gb);
        return NULL;
    }
    if (off < 0 || off + need > bb.len || nphase > 255 || (have_gc && gb.len / 40 > 255)) {
        PyBuffer_Release(&bb);
        if (have_gc)
            PyBuffer_Release(&gb);
        PyErr_SetString(PyExc_ValueError, "pack_step: the frame does not fit the buffer");
        return NULL;
    }
    char *p = (char *)bb.buf + off;
    memset(p, 0, (size_t)need);
    uint16_t magic = 0x5357;
    uint8_t b;
    int32_t i32;
    put(p, &magic, 2);
    b = 2; put(p + 2, &b, 1);                                 /* version */
    b = 1; put(p + 3, &b, 1);                                 /* T_BATCH */
    i32 = (int32_t)inst; put(p + 4, &i32, 4);
    i32 = (int32_t)rank; put(p + 8, &i32, 4);
    b = 1; put(p + 12, &b, 1);                                /* n_step */
    b = (uint8_t)nslots; put(p + 13, &b, 1);
    b = (uint8_t)(have_gc ? gb.len / 40 : 0); put(p + 14, &b, 1);
    b = (uint8_t)nphase; put(p + 15, &b, 1);
    int64_t q;
    double d;
    q = step; put(p + 16, &q, 8);
    q = t0w; put(p + 24, &q, 8);
    q = wall; put(p + 32, &q, 8);
    d = (double)step_ns; put(p + 40, &d, 8);
    d = (double)data_ns; put(p + 48, &d, 8);
    put(p + 56, &compute_ns, 8);
    put(p + 64, &comm_ns, 8);
    put(p + 72, &wait_ns, 8);
    d = (double)gc_ns; put(p + 80, &d, 8);
    i32 = (int32_t)gc_count; put(p + 88, &i32, 4);
    i32 = (int32_t)dq; put(p + 92, &i32, 4);
    q = samples; put(p + 96, &q, 8);
    q = tokens; put(p + 104, &q, 8);
    uint32_t u32 = (uint32_t)dropped; put(p + 112, &u32, 4);
    put(p + 120, &cpu_ns, 8);
    put(p + 128, &cpu_wait_ns, 8);
    p += HDR_STEP_SIZE;
    for (Py_ssize_t i = 0; i < nphase; i++) {
        Py_ssize_t slot = PyLong_AsSsize_t(PyList_GET_ITEM(touched, i));
        if (slot < 0 || slot >= PyList_GET_SIZE(ph) || slot >= PyList_GET_SIZE(ids))
            break;
        uint16_t id = (uint16_t)PyLong_AsLong(PyList_GET_ITEM(ids, slot));
        d = PyFloat_AsDouble(PyList_GET_ITEM(ph, slot));
        put(p, &id, 2);
        put(p + 8, &d, 8);
        p += PHASE_SIZE;
    }
    for (int k = 0; k < nslots && !PyErr_Occurred(); k++) {
        int s = order[k];
        PyObject *key = s < PyList_GET_SIZE(keys) ? PyList_GET_ITEM(keys, s) : NULL;
        if (key == NULL || !PyTuple_Check(key) || PyTuple_GET_SIZE(key) != 2) {
            PyErr_SetString(PyExc_ValueError, "pack_step: keys[slot] must be (op id, group id)");
            break;
        }
        uint16_t op = (uint16_t)PyLong_AsLong(PyTuple_GET_ITEM(key, 0));
        uint16_t grp = (uint16_t)PyLong_AsLong(PyTuple_GET_ITEM(key, 1));
        put(p, &op, 2);
        put(p + 2, &grp, 2);
        q = cnt[s]; put(p + 8, &q, 8);
        q = nb[s]; put(p + 16, &q, 8);
        put(p + 24, &tt[s], 8);
        put(p + 32, &ww[s], 8);
        p += COMM_SIZE;
    }
    if (have_gc) {
        memcpy(p, gb.buf, (size_t)gb.len);
        PyBuffer_Release(&gb);
    }
    PyBuffer_Release(&bb);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromLongLong(off + need);
}

/* --------------------------------------------------------------------------------------- module */

static PyMethodDef module_methods[] = {
    {"pack_step", (PyCFunction)(void (*)(void))pack_step, METH_FASTCALL, "one step's frame (see probe._replay)"},
    {NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_probefast",
                                    "The probe's hot path in C (see stepwatch.agents.probe).", -1, module_methods};

PyMODINIT_FUNC PyInit__probefast(void)
{
    if (PyType_Ready(&LogType) < 0 || PyType_Ready(&DataWrapType) < 0 || PyType_Ready(&CollWrapType) < 0)
        return NULL;
    str_group = PyUnicode_InternFromString("group");
    str_async_op = PyUnicode_InternFromString("async_op");
    str_nbytes = PyUnicode_InternFromString("nbytes");
    str_is_cpu = PyUnicode_InternFromString("is_cpu");
    if (!str_group || !str_async_op || !str_nbytes || !str_is_cpu)
        return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (m == NULL)
        return NULL;
    Py_INCREF(&LogType);
    Py_INCREF(&DataWrapType);
    Py_INCREF(&CollWrapType);
    if (PyModule_AddObject(m, "Log", (PyObject *)&LogType) < 0 ||
        PyModule_AddObject(m, "DataWrap", (PyObject *)&DataWrapType) < 0 ||
        PyModule_AddObject(m, "CollWrap", (PyObject *)&CollWrapType) < 0 ||
        PyModule_AddIntConstant(m, "EVENT_SIZE", (long)sizeof(Ev)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
