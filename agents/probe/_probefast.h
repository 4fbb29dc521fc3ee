/* Shared by the probe's C hot path (_probefast.c: the event log and the module; _probefast_wrap.c: the
 * DataLoader and collective wrappers; _probefast_pack.c: pack_step). See _probefast.c for what it does. */
#ifndef STEPWATCH_PROBEFAST_H
#define STEPWATCH_PROBEFAST_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

enum { K_OPT_POST = 2, K_DATA = 3, K_COLL = 4, K_DCOLL = 10 };      /* as in eventlog.py */

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

/* The event log (_probefast.c). */
typedef struct {
    PyObject_HEAD
    Ev *ev;
    Py_ssize_t n, cap, high;
    long long last_drain, drain_ns, primary, lost, comm_keys_dropped, pre_t, coll_t0;
    int eager, dq_need, in_coll, draining, dev_on;
    PyObject *on_drain, *on_first_opt, *on_step;   /* on_step: optional, see Log_opt_post */
} Log;

void probefast_call_drain(Log *L);             /* on_drain(), keeping the running call's exception */

static inline void push(Log *L, int32_t kind, int32_t slot, int64_t t0, int64_t t1, int64_t a, double b)
{
    if (L->n >= L->cap) {
        probefast_call_drain(L);
        if (L->n >= L->cap) {                   /* a drain is running (re-entered): count, drop */
            L->lost++;
            return;
        }
    }
    Ev *e = &L->ev[L->n++];
    e->kind = kind; e->slot = slot; e->t0 = t0; e->t1 = t1; e->a = a; e->b = b;
}

extern PyTypeObject probefast_LogType, probefast_DataWrapType, probefast_CollWrapType;
int probefast_wrap_init(void);                 /* the wrappers' interned names (_probefast_wrap.c) */
PyObject *probefast_pack_step(PyObject *self, PyObject *const *a, Py_ssize_t nargs);   /* _probefast_pack.c */
PyObject *probefast_arm_exit(PyObject *self, PyObject *args);                         /* _probefast_exit.c */
PyObject *probefast_disarm_exit(PyObject *self, PyObject *unused);

#endif
