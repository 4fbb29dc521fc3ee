/* The rank's last word when a signal ends it: a goodbye datagram sent from a signal handler.
 *
 * arm_exit(fd, {signo: bytes}) installs, for each signal whose disposition is still the default
 * (a handler the program or a library set is left alone), a handler that
 *   1. sends that signal's pre-built datagram on ``fd`` (a connected, non-blocking AF_UNIX datagram
 *      socket to the node agent; send(2) is async-signal-safe and never blocks here), once;
 *   2. with SA_RESETHAND the default action is back, so it raises the signal again: the process ends
 *      exactly as it would have (same signal, same core dump, same exit status for its parent).
 * A forked child (a DataLoader worker) inherits the handler but not the identity: the pid recorded at
 * arming time is compared first, and a child only re-raises. disarm_exit() restores the defaults.
 * Nothing here allocates, locks or calls into Python while a signal is handled. */
#include "_probefast.h"

#include <errno.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#define EXIT_MAX_SIG 32
#define EXIT_MAX_BYTES 512

static volatile sig_atomic_t exit_fd = -1;
static volatile pid_t exit_pid = 0;
static volatile sig_atomic_t exit_sent = 0;
static char exit_buf[EXIT_MAX_SIG][EXIT_MAX_BYTES];
static size_t exit_len[EXIT_MAX_SIG];
static int exit_armed[EXIT_MAX_SIG];

static void exit_handler(int sig)
{
    int saved = errno;
    if (sig > 0 && sig < EXIT_MAX_SIG && exit_fd >= 0 && getpid() == exit_pid && !exit_sent && exit_len[sig]) {
        exit_sent = 1;
        (void)send(exit_fd, exit_buf[sig], exit_len[sig], MSG_DONTWAIT | MSG_NOSIGNAL);
    }
    errno = saved;
    raise(sig);                   /* SA_RESETHAND: the default action, once this handler returns */
}

PyObject *probefast_arm_exit(PyObject *self, PyObject *args)
{
    int fd;
    PyObject *msgs;
    if (!PyArg_ParseTuple(args, "iO!", &fd, &PyDict_Type, &msgs))
        return NULL;
    PyObject *key, *val;
    Py_ssize_t pos = 0;
    /* validate everything first: nothing is armed by a call that fails */
    while (PyDict_Next(msgs, &pos, &key, &val)) {
        long s = PyLong_AsLong(key);
        if (s == -1 && PyErr_Occurred())
            return NULL;
        if (s <= 0 || s >= EXIT_MAX_SIG || s == SIGKILL || s == SIGSTOP) {
            PyErr_Format(PyExc_ValueError, "arm_exit: signal %ld cannot be handled", s);
            return NULL;
        }
        if (!PyBytes_Check(val) || PyBytes_GET_SIZE(val) == 0 || PyBytes_GET_SIZE(val) > EXIT_MAX_BYTES) {
            PyErr_Format(PyExc_ValueError, "arm_exit: the datagram for signal %ld must be 1..%d bytes", s,
                         EXIT_MAX_BYTES);
            return NULL;
        }
    }
    exit_fd = -1;                                 /* no send while the buffers change */
    PyObject *armed = PyList_New(0);
    if (armed == NULL)
        return NULL;
    pos = 0;
    while (PyDict_Next(msgs, &pos, &key, &val)) {
        int s = (int)PyLong_AsLong(key);
        memcpy(exit_buf[s], PyBytes_AS_STRING(val), (size_t)PyBytes_GET_SIZE(val));
        exit_len[s] = (size_t)PyBytes_GET_SIZE(val);
        struct sigaction old, sa;
        if (sigaction(s, NULL, &old) != 0)
            continue;
        if (!exit_armed[s] && old.sa_handler != SIG_DFL)
            continue;                             /* the program's own handler: leave it */
        memset(&sa, 0, sizeof sa);
        sa.sa_handler = exit_handler;
        sigemptyset(&sa.sa_mask);
        sa.sa_flags = SA_RESETHAND | SA_RESTART;
        if (sigaction(s, &sa, NULL) != 0)
            continue;
        exit_armed[s] = 1;
        PyObject *o = PyLong_FromLong(s);
        if (o == NULL || PyList_Append(armed, o) < 0) {
            Py_XDECREF(o);
            Py_DECREF(armed);
            return NULL;
        }
        Py_DECREF(o);
    }
    exit_pid = getpid();
    exit_sent = 0;
    exit_fd = fd;
    return armed;
}

PyObject *probefast_disarm_exit(PyObject *self, PyObject *unused)
{
    exit_fd = -1;
    for (int s = 1; s < EXIT_MAX_SIG; s++) {
        if (!exit_armed[s])
            continue;
        struct sigaction cur;
        if (sigaction(s, NULL, &cur) == 0 && cur.sa_handler == exit_handler) {
            struct sigaction sa;
            memset(&sa, 0, sizeof sa);
            sa.sa_handler = SIG_DFL;
            sigemptyset(&sa.sa_mask);
            sigaction(s, &sa, NULL);
        }
        exit_armed[s] = 0;
        exit_len[s] = 0;
    }
    Py_RETURN_NONE;
}
