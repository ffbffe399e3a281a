/* A memcpy out of a mapping that another process may shrink under it.
 *
 * Touching a shared mapping past the end of its file raises SIGBUS, which kills a Python
 * process. copy() turns that into a False return for the one copy: while it copies, this
 * thread's SIGBUS handler jumps back out of memcpy (sigsetjmp/siglongjmp, the classic
 * guarded copy). A SIGBUS anywhere else is not ours: it goes to the handler we found
 * (faulthandler's, say) or to the default action, so a real fault still kills the process.
 * The handler is (re)installed by each copy if someone replaced it since (faulthandler
 * enabled later, say). The GIL is released while it copies. Used by transport/shm_pool.py.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <setjmp.h>
#include <signal.h>
#include <string.h>

static __thread sigjmp_buf *volatile landing;  /* set only while this thread copies */
static struct sigaction previous;             /* the handler ours replaced */
static volatile sig_atomic_t handed_on;

static void on_sigbus(int sig, siginfo_t *info, void *context)
{
    (void)sig, (void)info, (void)context;
    if (landing)
        siglongjmp(*landing, 1);
    if (!handed_on && previous.sa_handler != SIG_DFL && previous.sa_handler != SIG_IGN) {
        handed_on = 1;  /* the fault repeats under the handler we found, once */
        sigaction(SIGBUS, &previous, NULL);
        return;
    }
    signal(SIGBUS, SIG_DFL);  /* the fault repeats and kills the process, as without us */
}

static int is_ours(const struct sigaction *action)
{
    return (action->sa_flags & SA_SIGINFO) && action->sa_sigaction == on_sigbus;
}

static int ensure_handler(void)
{
    struct sigaction now, ours;
    if (sigaction(SIGBUS, NULL, &now))
        return -1;
    if (is_ours(&now))
        return 0;
    memset(&ours, 0, sizeof ours);
    ours.sa_sigaction = on_sigbus;
    ours.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&ours.sa_mask);
    if (sigaction(SIGBUS, &ours, &now))
        return -1;
    if (!is_ours(&now))  /* (another thread may have put ours in first) */
        previous = now;
    handed_on = 0;
    return 0;
}

static int copy_guarded(char *dst, const char *src, size_t n)
{
    sigjmp_buf here;
    if (sigsetjmp(here, 1)) {
        landing = NULL;
        return -1;
    }
    landing = &here;
    memcpy(dst, src, n);
    landing = NULL;
    return 0;
}

static PyObject *copy(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    Py_ssize_t offset;
    int faulted;
    (void)self;
    if (!PyArg_ParseTuple(args, "w*y*n", &dst, &src, &offset))
        return NULL;
    if (offset < 0 || offset > src.len || dst.len > src.len - offset) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        PyErr_SetString(PyExc_ValueError, "copy: the slice runs past the end of the source");
        return NULL;
    }
    if (ensure_handler()) {
        PyBuffer_Release(&dst);
        PyBuffer_Release(&src);
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    Py_BEGIN_ALLOW_THREADS
    faulted = copy_guarded((char *)dst.buf, (const char *)src.buf + offset, (size_t)dst.len);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return PyBool_FromLong(!faulted);
}

static PyMethodDef methods[] = {
    {"copy", copy, METH_VARARGS,
     "copy(dst, src, offset) -> bool: fill dst from src[offset:]; False where reading src faulted "
     "(SIGBUS: its file shrank), dst then partly written."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_guarded_copy", NULL, -1, methods};

PyMODINIT_FUNC PyInit__guarded_copy(void)
{
    return PyModule_Create(&module);
}
