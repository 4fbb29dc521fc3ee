/* pack_step: one step's frame into the datagram buffer, in C (see _probefast.c and fold.py). */
#include "_probefast.h"

/* ---------------------------------------------------------------------------------- pack_step */

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the datagram layout is little-endian; pack_step writes native byte order"
#endif

#define MAX_SLOTS 16                    /* probe.MAX_COMM */
#define HDR_STEP_SIZE 152
#define PHASE_SIZE 16
#define COMM_SIZE 40

static inline void put(char *p, const void *v, size_t n) { memcpy(p, v, n); }

/* pack_step(buf, off, inst, rank, step, t0w, wall, step_ns, data_ns, compute_ns, gc_ns, gc_count, dq,
 *           samples, tokens, dropped, touched, ph, ids, calls, traffic, nspb, keys, gcrows, cpu_ns,
 *           cpu_wait_ns[, hidden_ns]) -> new off
 * One step's frame, byte for byte what StepFold.replay packs in Python (HDR_STEP, PHASE per touched
 * slot, COMM per accumulator slot in order of first call, the GC rows): the calls are summed per slot,
 * a call without a known wait split with the bandwidth model, compute_ns < 0 derived. The step's exposed
 * communication is comm + wait (what the calls held the step), its total that plus hidden_ns (DDP buckets'
 * time behind backward, StepFold._bucket_calls; 0 when not given). */
PyObject *probefast_pack_step(PyObject *self, PyObject *const *a, Py_ssize_t nargs)
{
    if (nargs != 26 && nargs != 27) {
        PyErr_Format(PyExc_TypeError, "pack_step takes 26 or 27 arguments, got %zd", nargs);
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
    double hidden_ns = nargs > 26 ? PyFloat_AsDouble(a[26]) : 0.0;
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
    b = 3; put(p + 2, &b, 1);                                 /* version */
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
    double exposed_ns = comm_ns + wait_ns, total_ns = exposed_ns + hidden_ns;
    put(p + 136, &total_ns, 8);
    put(p + 144, &exposed_ns, 8);
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
