/* The probe's hot path in C: the hooks and wrappers that run inside every training step.
 *
 * On a real training loop the probe's code runs once per step, between milliseconds of framework
 * work that evict it from the caches; each Python operation then costs ~0.1-0.3 µs and the per-step
 * logic of the pure-Python probe added ~25 µs to a 250 µs step. Here each hook only reads the clock
 * (CLOCK_MONOTONIC, the clock of time.perf_counter_ns) and appends one fixed-size event to a
 * preallocated array; stepwatch.agents.probe folds the events into steps in Python, warm, a few hundred at a
 * time (StepFold.replay), so the step semantics exist once, in Python. The pure-Python fallback
 * (eventlog._PyLog and the closures beside it) appends the same events as tuples. The wrappers are in
 * _probefast_wrap.c, pack_step in _probefast_pack.c, what they share in _probefast.h.
 *
 * Objects:
 *   Log(cap, on_drain, on_first_opt)  the event array. add(kind, slot, t0, t1, a, b) appends one event
 *       (calls on_drain() when the array is full); drain() returns the events as a list of 6-tuples and
 *       empties it; opt_pre / opt_post are the torch optimizer step hooks (one event per step:
 *       (K_OPT_POST, t0 = pre-hook time, t1 = post-hook time, a = id(optimizer), b = 1 + the token of a device
 *       event recorded by on_step() at the primary's step end when an accelerator is in use, else 0); opt_post calls on_drain() when
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
#include "_probefast.h"

/* ------------------------------------------------------------------------------------------ Log */

void probefast_call_drain(Log *L)
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
    Py_VISIT(L->on_step);
    return 0;
}

static int Log_clear(Log *L)
{
    Py_CLEAR(L->on_drain);
    Py_CLEAR(L->on_first_opt);
    Py_CLEAR(L->on_step);
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
    double mark = 0.0;
    if (L->dev_on && L->on_step != NULL && L->on_step != Py_None && (int64_t)(intptr_t)opt == L->primary) {
        /* the primary optimizer's step ends a step: on_step() records a device event there and returns
         * its token (>= 0), sent as b = token + 1 (see DeviceTiming.step_mark); errors are the probe's */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyObject *r = PyObject_CallNoArgs(L->on_step);
        if (r != NULL) {
            long long tok = PyLong_AsLongLong(r);
            if (tok >= 0 && !PyErr_Occurred())
                mark = (double)tok + 1.0;
            Py_DECREF(r);
        }
        PyErr_Clear();
        PyErr_Restore(et, ev, tb);
    }
    push(L, K_OPT_POST, 0, L->pre_t, t, (int64_t)(intptr_t)opt, mark);
    L->pre_t = 0;
    L->dq_need = 1;
    if (L->eager || L->n >= L->high || t - L->last_drain >= L->drain_ns)
        probefast_call_drain(L);
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
    {"on_step", T_OBJECT, offsetof(Log, on_step), 0,
     "with dev_on: called at the primary optimizer's step end, returns a device event's token (b = token + 1)"},
    {NULL}};

static PyGetSetDef Log_getset[] = {{"n", (getter)Log_len, NULL, "events waiting", NULL}, {NULL}};

PyTypeObject probefast_LogType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "stepwatch.agents.probe._probefast.Log",
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

/* --------------------------------------------------------------------------------------- module */

static PyMethodDef module_methods[] = {
    {"pack_step", (PyCFunction)(void (*)(void))probefast_pack_step, METH_FASTCALL, "one step's frame (see StepFold.replay)"},
    {"arm_exit", probefast_arm_exit, METH_VARARGS, "arm_exit(fd, {signo: datagram}): a goodbye sent when the signal ends "
     "the process (signals still at their default only; returns those armed); see _probefast_exit.c"},
    {"disarm_exit", probefast_disarm_exit, METH_NOARGS, "restore the default action of the signals arm_exit armed"},
    {NULL}};

static struct PyModuleDef moddef = {PyModuleDef_HEAD_INIT, "_probefast",
                                    "The probe's hot path in C (see stepwatch.agents.probe).", -1, module_methods};

PyMODINIT_FUNC PyInit__probefast(void)
{
    if (PyType_Ready(&probefast_LogType) < 0 || PyType_Ready(&probefast_DataWrapType) < 0 || PyType_Ready(&probefast_CollWrapType) < 0)
        return NULL;
    if (probefast_wrap_init() < 0)
        return NULL;
    PyObject *m = PyModule_Create(&moddef);
    if (m == NULL)
        return NULL;
    Py_INCREF(&probefast_LogType);
    Py_INCREF(&probefast_DataWrapType);
    Py_INCREF(&probefast_CollWrapType);
    if (PyModule_AddObject(m, "Log", (PyObject *)&probefast_LogType) < 0 ||
        PyModule_AddObject(m, "DataWrap", (PyObject *)&probefast_DataWrapType) < 0 ||
        PyModule_AddObject(m, "CollWrap", (PyObject *)&probefast_CollWrapType) < 0 ||
        PyModule_AddIntConstant(m, "EVENT_SIZE", (long)sizeof(Ev)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
