/* The native kernels' CPython module: marshals a job's arguments into int64 slots and runs the
 * jobs of one op on a team of threads (kernels/abi.py has the calling convention).
 *
 * The entries themselves are numba code compiled ahead of time (kernels/aot.py emits their
 * object file and a generated entries.h listing them). This file is only the glue: argument
 * checks that cost nanoseconds (every kernel call passes ~30 arguments; a ctypes marshaller in
 * Python cost ~45 us per call), the GIL released around the work, and the thread team.
 *
 * The team is a few pthreads of our own rather than OpenMP: GNU OpenMP cannot survive fork()
 * (a child's first parallel region hangs, measured), and servers fork workers. Here the child
 * simply starts new threads. Workers spin briefly after each op, because the next op (the next
 * layer or chunk) usually follows within microseconds, then sleep on a condition variable.
 *
 * Except inside a framework that already keeps a GNU OpenMP team busy on the caller's thread
 * (torch's ops): its workers spin for milliseconds after each op (GOMP_SPINCOUNT), on the
 * very cores our team needs, so our threads and theirs took turns on the cores and the
 * second thread gained nothing (leanrnn.torch's LSTM step on 2 threads no faster than on 1).
 * There, a launch the caller marks `openmp` runs the same jobs on that OpenMP team instead
 * (GOMP_parallel, found in the process by the caller: set_openmp). A forked child forgets it.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "entries.h" /* LEANRNN_ENTRIES(X): X(symbol, kinds) for every entry */

typedef int32_t (*entry_fn)(int64_t *slots, int64_t me);

#define DECLARE(sym, kinds) extern int32_t sym(int64_t *slots, int64_t me);
LEANRNN_ENTRIES(DECLARE)

typedef struct {
    const char *name;
    entry_fn fn;
    const char *kinds;
} Entry;

#define ROW(sym, kinds) {#sym, sym, kinds},
static const Entry ENTRIES[] = {LEANRNN_ENTRIES(ROW)};
#define N_ENTRIES ((Py_ssize_t)(sizeof(ENTRIES) / sizeof(ENTRIES[0])))
#define MAX_SLOTS 256

#if defined(__x86_64__) || defined(__i386__)
#define cpu_relax() __builtin_ia32_pause() /* a spin-wait hint */
#else
#define cpu_relax() ((void)0)
#endif

/* numba links its reference-count helpers in with the kernels; they are never reached,
 * because every array a kernel sees wraps engine memory and has no meminfo. */
void NRT_MemInfo_call_dtor(void *mi) {
    (void)mi;
    abort();
}

/* ------------------------------------------------------------------------------ the team */
#define MAX_WORKERS 255 /* < 1 << TEAM_BITS */
#define WORKER_STACK ((size_t)8 << 20) /* bytes of stack per worker thread (start_workers) */
#define SPIN 20000 /* polls of the launch word (a fraction of a millisecond) before a worker sleeps */

/* The launch word: (launch number << TEAM_BITS) | team size, published in one atomic store, so a
 * worker decides whether it takes part from the very value it saw change. (Read as two fields,
 * a worker that sat out one op could read the next op's larger team, take part in it, and then
 * count itself again when it noticed that op's launch.) */
#define TEAM_BITS 16

static struct {
    pthread_mutex_t mu;
    pthread_cond_t wake;
    int started;                 /* workers running */
    uint64_t launch;             /* the launch word (atomic) */
    const Entry *entry;          /* the current op: written before its launch word ... */
    int64_t *slots;
    int64_t parts;               /* ... its jobs */
    int64_t next;                /* next job to take (atomic) */
    int64_t busy;                /* workers not done with this op (atomic) */
    int32_t status;              /* OR of the jobs' numba statuses (atomic) */
} T = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, NULL, NULL, 0, 0, 0, 0};

/* One op at a time uses the team: kernels/runner.py already serializes launches
 * (POOL_LAUNCH), this makes the module safe on its own. */
static pthread_mutex_t LAUNCH = PTHREAD_MUTEX_INITIALIZER;

static void take_jobs(void) {
    int64_t me;
    while ((me = __atomic_fetch_add(&T.next, 1, __ATOMIC_SEQ_CST)) < T.parts) {
        int32_t s = T.entry->fn(T.slots, me);
        if (s) __atomic_fetch_or(&T.status, s, __ATOMIC_SEQ_CST);
    }
}

typedef struct {
    int64_t w;     /* 1.. (the caller's thread is 0) */
    uint64_t seen; /* the launch word when it was started: it waits for the next one */
} WorkerArg;

static void *worker(void *arg) {
    int64_t w = ((WorkerArg *)arg)->w;
    uint64_t seen = ((WorkerArg *)arg)->seen;
    free(arg);
    for (;;) {
        uint64_t now;
        int spins = 0;
        while ((now = __atomic_load_n(&T.launch, __ATOMIC_ACQUIRE)) == seen && spins < SPIN) {
            cpu_relax();
            spins++;
        }
        if (now == seen) {
            pthread_mutex_lock(&T.mu);
            while ((now = __atomic_load_n(&T.launch, __ATOMIC_ACQUIRE)) == seen)
                pthread_cond_wait(&T.wake, &T.mu);
            pthread_mutex_unlock(&T.mu);
        }
        seen = now;
        if (w < (int64_t)(now & ((1u << TEAM_BITS) - 1))) { /* this op's team includes it */
            take_jobs();
            __atomic_fetch_sub(&T.busy, 1, __ATOMIC_RELEASE);
        }
    }
    return NULL;
}

/* GNU OpenMP's GOMP_parallel(fn, data, threads, flags) in this process, or NULL (set_openmp). */
typedef void (*gomp_parallel_fn)(void (*)(void *), void *, unsigned, unsigned);
static gomp_parallel_fn GOMP_PARALLEL = NULL;

static void omp_body(void *unused) {
    (void)unused;
    take_jobs();
}

/* A forked child has none of the parent's workers: start afresh. (Another Python thread may
 * fork while an op runs here without the GIL: the child then has no op in flight, and
 * kernels/runner.py renews its Python locks after a fork too.) */
static void after_fork_in_child(void) {
    GOMP_PARALLEL = NULL; /* the parent's OpenMP team does not exist here (nor survives fork) */
    pthread_mutex_init(&LAUNCH, NULL);
    pthread_mutex_init(&T.mu, NULL);
    pthread_cond_init(&T.wake, NULL);
    T.started = 0;
}

/* Start workers until `want` run (at most MAX_WORKERS); the caller uses as many as started. */
static void start_workers(int64_t want) {
    sigset_t all, old;
    sigfillset(&all); /* signals stay with Python's main thread */
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = 0;
    while (T.started < want && T.started < MAX_WORKERS) {
        pthread_t t;
        pthread_attr_t attr;
        WorkerArg *arg = malloc(sizeof(WorkerArg));
        if (!arg) {
            rc = -1;
            break;
        }
        arg->w = T.started + 1;
        arg->seen = __atomic_load_n(&T.launch, __ATOMIC_ACQUIRE);
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        /* The AMX blocks keep their buffers on the stack (_bf16amx: ~40 KiB per inlined
           panel GEMM, several per kernel): not a C library's smallest default (musl's
           128 KiB). */
        pthread_attr_setstacksize(&attr, WORKER_STACK);
        rc = pthread_create(&t, &attr, worker, arg);
        pthread_attr_destroy(&attr);
        if (rc) {
            free(arg);
            break;
        }
        T.started++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

/* Jobs 0..parts-1 of one op on `threads` threads, this one included. Jobs beyond the team run
 * after others: correct, see kernels/_sync.py. Called without the GIL, holding LAUNCH. */
static int32_t launch_locked(const Entry *e, int64_t *slots, int64_t parts, int64_t threads) {
    if (threads > parts) threads = parts;
    if (threads > 1) {
        start_workers(threads - 1);
        if (threads > 1 + T.started) threads = 1 + T.started; /* as many as could start */
    }
    T.entry = e;
    T.slots = slots;
    T.parts = parts;
    T.next = 0;
    T.status = 0;
    T.busy = threads - 1;
    if (threads > 1) {
        uint64_t number = (__atomic_load_n(&T.launch, __ATOMIC_RELAXED) >> TEAM_BITS) + 1;
        pthread_mutex_lock(&T.mu);
        __atomic_store_n(&T.launch, (number << TEAM_BITS) | (uint64_t)threads, __ATOMIC_RELEASE);
        pthread_cond_broadcast(&T.wake);
        pthread_mutex_unlock(&T.mu);
    }
    take_jobs();
    for (int spins = 0; __atomic_load_n(&T.busy, __ATOMIC_ACQUIRE) > 0; spins++) {
        if (spins > SPIN) sched_yield(); /* a worker was descheduled: let it run */
        else cpu_relax();
    }
    return T.status;
}

/* The same jobs on the caller's OpenMP team: every job index still runs exactly once (take_jobs
 * claims them), and GOMP_parallel returns when its team is done. */
static int32_t launch_openmp_locked(const Entry *e, int64_t *slots, int64_t parts,
                                    int64_t threads) {
    if (threads > parts) threads = parts;
    T.entry = e;
    T.slots = slots;
    T.parts = parts;
    T.next = 0;
    T.status = 0;
    GOMP_PARALLEL(omp_body, NULL, (unsigned)threads, 0);
    return T.status;
}

static int32_t launch(const Entry *e, int64_t *slots, int64_t parts, int64_t threads,
                      int openmp) {
    pthread_mutex_lock(&LAUNCH);
    int32_t status = openmp && GOMP_PARALLEL ? launch_openmp_locked(e, slots, parts, threads)
                                             : launch_locked(e, slots, parts, threads);
    pthread_mutex_unlock(&LAUNCH);
    return status;
}

static int type_of(char t) {
    return t == 'f' ? NPY_FLOAT32 : t == 'd' ? NPY_FLOAT64 : t == 'c' ? NPY_INT8
         : t == 'h' ? NPY_UINT16 : t == 'u' ? NPY_UINT8 : NPY_INT64;
}

/* slots <- args as the entry's kinds say; the number of slots filled, or -1 with a Python error
 * set. */
static Py_ssize_t marshal(const Entry *e, PyObject *args, int64_t *slots) {
    Py_ssize_t nargs = PyTuple_GET_SIZE(args), want = (Py_ssize_t)strlen(e->kinds) / 2, s = 0;
    if (nargs != want) {
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", e->name, want, nargs);
        return -1;
    }
    for (Py_ssize_t k = 0; k < nargs; k++) {
        char t = e->kinds[2 * k];
        int nd = e->kinds[2 * k + 1] - '0';
        PyObject *o = PyTuple_GET_ITEM(args, k);
        if (s + 1 + nd > MAX_SLOTS) {
            PyErr_Format(PyExc_TypeError, "%s: more than %d slots", e->name, MAX_SLOTS);
            return -1;
        }
        if (nd == 0) {
            long long v = t == 'b' ? PyObject_IsTrue(o) : PyLong_AsLongLong(o);
            if (v == -1 && PyErr_Occurred()) return -1;
            slots[s++] = (int64_t)v;
            continue;
        }
        PyArrayObject *a = (PyArrayObject *)o;
        if (!PyArray_Check(o) || PyArray_NDIM(a) != nd || PyArray_TYPE(a) != type_of(t) ||
            !PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISALIGNED(a) || !PyArray_ISNOTSWAPPED(a)) {
            PyErr_Format(PyExc_TypeError,
                         "%s argument %zd: expected a C-contiguous, aligned, native-byte-order "
                         "%d-d array of type '%c', got %R",
                         e->name, k, nd, t, PyArray_Check(o) ? (PyObject *)PyArray_DESCR(a) : o);
            return -1;
        }
        slots[s++] = (int64_t)(intptr_t)PyArray_DATA(a);
        for (int d = 0; d < nd; d++) slots[s++] = (int64_t)PyArray_DIM(a, d);
    }
    return s;
}

/* The entry `argv[0]` names; NULL with a Python error set if there is no such entry. */
static const Entry *entry_at(PyObject *o) {
    Py_ssize_t index = PyLong_AsSsize_t(o);
    if (index == -1 && PyErr_Occurred()) return NULL;
    if (index < 0 || index >= N_ENTRIES) {
        PyErr_Format(PyExc_ValueError, "entry %zd of %zd", index, N_ENTRIES);
        return NULL;
    }
    return &ENTRIES[index];
}

/* run(entry, args, parts, threads[, openmp]): jobs me = 0..parts-1 of one op, on `threads`
 * threads (with openmp true: on the caller's OpenMP team, if set_openmp gave one). */
static PyObject *run(PyObject *self, PyObject *const *argv, Py_ssize_t argc) {
    (void)self;
    if ((argc != 4 && argc != 5) || !PyTuple_Check(argv[1])) {
        PyErr_SetString(PyExc_TypeError,
                        "run(entry: int, args: tuple, parts: int, threads: int, openmp: bool)");
        return NULL;
    }
    int openmp = argc == 5 ? PyObject_IsTrue(argv[4]) : 0;
    if (openmp < 0) return NULL;
    const Entry *e = entry_at(argv[0]);
    if (!e) return NULL;
    long long parts = PyLong_AsLongLong(argv[2]);
    if (parts == -1 && PyErr_Occurred()) return NULL;
    long long threads = PyLong_AsLongLong(argv[3]);
    if (threads == -1 && PyErr_Occurred()) return NULL;
    if (parts < 1 || threads < 1) {
        PyErr_Format(PyExc_ValueError, "run: parts %lld, threads %lld", parts, threads);
        return NULL;
    }
    int64_t slots[MAX_SLOTS];
    if (marshal(e, argv[1], slots) < 0) return NULL;
    int32_t status = 0;
    Py_BEGIN_ALLOW_THREADS
    if (threads == 1) {
        for (int64_t me = 0; me < parts; me++) status |= e->fn(slots, me);
    } else {
        status = launch(e, slots, parts, threads, openmp);
    }
    Py_END_ALLOW_THREADS
    if (status) {
        PyErr_Format(PyExc_RuntimeError, "native kernel %s stopped with numba status %d", e->name,
                     (int)status);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* bind(entry, args) -> int64 array: args marshalled once, as run does at every call, for a
 * program (below). The slots hold the arrays' addresses: the caller keeps them alive. */
static PyObject *bind(PyObject *self, PyObject *const *argv, Py_ssize_t argc) {
    (void)self;
    if (argc != 2 || !PyTuple_Check(argv[1])) {
        PyErr_SetString(PyExc_TypeError, "bind(entry: int, args: tuple)");
        return NULL;
    }
    const Entry *e = entry_at(argv[0]);
    if (!e) return NULL;
    int64_t slots[MAX_SLOTS];
    Py_ssize_t n = marshal(e, argv[1], slots);
    if (n < 0) return NULL;
    npy_intp dims[1] = {(npy_intp)n};
    PyObject *out = PyArray_SimpleNew(1, dims, NPY_INT64);
    if (out) memcpy(PyArray_DATA((PyArrayObject *)out), slots, (size_t)n * sizeof(int64_t));
    return out;
}

/* ---------------------------------------------------------------------------- programs */
/* A program is the ops of one engine call bound once (kernels/runner.py Program), so that a
 * streaming step, a few microseconds of kernel work, pays for no marshalling of ~30 arguments
 * per op nor for numpy's per-copy overhead. One int64 array:
 *
 *   header   n_ops, x_at, x_nd, x_type, y_at, y_nd, y_type
 *   per op   entry, parts, n_slots, slots[n_slots],
 *            n_pre, (dst, src, bytes)[n_pre], n_post, (dst, src, bytes)[n_post]
 *
 * x_at / y_at: the index (in the program) of the address slot of the input / output array that
 * each run passes anew, its dims in the slots after it; -1: none. pre / post: copies made right
 * before / after the op (state in, state out); src 0 zero-fills dst. */
#define HEADER 7

/* The index just past a well-formed op at p[i] of n, or -1: checked at every run, so that a
 * malformed program fails with an error instead of reading past its end. */
static Py_ssize_t op_end(const int64_t *p, Py_ssize_t i, Py_ssize_t n) {
    if (i + 3 > n || p[i] < 0 || p[i] >= N_ENTRIES || p[i + 1] < 1 || p[i + 2] < 0 ||
        p[i + 2] > MAX_SLOTS)
        return -1;
    i += 3 + p[i + 2];
    for (int side = 0; side < 2; side++) {
        if (i + 1 > n || p[i] < 0 || p[i] > (n - i - 1) / 3) return -1;
        i += 1 + 3 * p[i];
    }
    return i;
}

static void copies(const int64_t *c, int64_t count) {
    for (int64_t j = 0; j < count; j++, c += 3) {
        void *dst = (void *)(intptr_t)c[0];
        if (c[1]) memcpy(dst, (const void *)(intptr_t)c[1], (size_t)c[2]);
        else memset(dst, 0, (size_t)c[2]);
    }
}

/* Whether `o` can stand in for the array bound at slot `at` (its dims follow it): an ndarray
 * itself (no subclass), of `type` and `nd` dims equal to the bound ones, C-contiguous, aligned,
 * native byte order and, for an output, writable. */
static int fits(PyObject *o, const int64_t *at, int64_t nd, int64_t type, int output) {
    if (!PyArray_CheckExact(o)) return 0;
    PyArrayObject *a = (PyArrayObject *)o;
    if (PyArray_NDIM(a) != nd || PyArray_TYPE(a) != type || !PyArray_IS_C_CONTIGUOUS(a) ||
        !PyArray_ISALIGNED(a) || !PyArray_ISNOTSWAPPED(a) || (output && !PyArray_ISWRITEABLE(a)))
        return 0;
    for (int64_t d = 0; d < nd; d++)
        if (PyArray_DIM(a, (int)d) != at[1 + d]) return 0;
    return 1;
}

/* run_program(program, x, y, threads) -> bool: the program's ops in turn with x and y in place
 * of the bound ones. False, with nothing run, when x or y does not fit (see fits) or they
 * overlap: the caller then takes its general path, whose checks say what is wrong. */
static PyObject *run_program(PyObject *self, PyObject *const *argv, Py_ssize_t argc) {
    (void)self;
    PyArrayObject *prog = (PyArrayObject *)(argc == 4 ? argv[0] : NULL);
    if (!prog || !PyArray_Check((PyObject *)prog) || PyArray_NDIM(prog) != 1 ||
        PyArray_TYPE(prog) != NPY_INT64 || !PyArray_IS_C_CONTIGUOUS(prog) ||
        !PyArray_ISALIGNED(prog) || !PyArray_ISWRITEABLE(prog)) {
        PyErr_SetString(PyExc_TypeError,
                        "run_program(program: writable int64 array, x, y, threads: int)");
        return NULL;
    }
    long long threads = PyLong_AsLongLong(argv[3]);
    if (threads == -1 && PyErr_Occurred()) return NULL;
    int64_t *p = (int64_t *)PyArray_DATA(prog);
    Py_ssize_t n = (Py_ssize_t)PyArray_DIM(prog, 0), i = HEADER;
    int ok = n >= HEADER && p[0] >= 0 && threads >= 1;
    for (int64_t op = 0; ok && op < p[0]; op++) ok = (i = op_end(p, i, n)) >= 0;
    ok = ok && i == n;
    for (int side = 0; ok && side < 2; side++) { /* x_at, y_at: inside the program, or -1 */
        int64_t at = p[1 + 3 * side], nd = p[2 + 3 * side];
        ok = at == -1 || (at >= HEADER && nd >= 1 && nd <= 8 && at + nd < n);
    }
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "run_program: a malformed program");
        return NULL;
    }
    PyObject *io[2] = {argv[1], argv[2]};
    for (int side = 0; side < 2; side++) {
        int64_t at = p[1 + 3 * side];
        if (at >= 0 && !fits(io[side], p + at, p[2 + 3 * side], p[3 + 3 * side], side)) Py_RETURN_FALSE;
    }
    if (p[1] >= 0 && p[4] >= 0) { /* x and y: apart (the kernels read x after writing y) */
        char *x = PyArray_BYTES((PyArrayObject *)io[0]), *y = PyArray_BYTES((PyArrayObject *)io[1]);
        if (x < y + PyArray_NBYTES((PyArrayObject *)io[1]) &&
            y < x + PyArray_NBYTES((PyArrayObject *)io[0]))
            Py_RETURN_FALSE;
    }
    for (int side = 0; side < 2; side++)
        if (p[1 + 3 * side] >= 0)
            p[p[1 + 3 * side]] = (int64_t)(intptr_t)PyArray_DATA((PyArrayObject *)io[side]);
    int32_t status = 0;
    const Entry *failed = NULL;
    Py_BEGIN_ALLOW_THREADS
    const int64_t *q = p + HEADER;
    for (int64_t op = 0; op < p[0] && !status; op++) {
        const Entry *e = &ENTRIES[q[0]];
        int64_t parts = q[1], *slots = (int64_t *)q + 3;
        const int64_t *c = q + 3 + q[2];
        copies(c + 1, c[0]);
        c += 1 + 3 * c[0];
        if (threads == 1) {
            for (int64_t me = 0; me < parts; me++) status |= e->fn(slots, me);
        } else {
            status = launch(e, slots, parts, threads, 0);
        }
        if (status) failed = e;
        else copies(c + 1, c[0]);
        q = c + 1 + 3 * c[0];
    }
    Py_END_ALLOW_THREADS
    if (status) {
        PyErr_Format(PyExc_RuntimeError, "native kernel %s stopped with numba status %d",
                     failed->name, (int)status);
        return NULL;
    }
    Py_RETURN_TRUE;
}

static PyObject *entries(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    PyObject *out = PyTuple_New(N_ENTRIES);
    if (!out) return NULL;
    for (Py_ssize_t i = 0; i < N_ENTRIES; i++) {
        PyObject *row = Py_BuildValue("(ss)", ENTRIES[i].name, ENTRIES[i].kinds);
        if (!row) {
            Py_DECREF(out);
            return NULL;
        }
        PyTuple_SET_ITEM(out, i, row);
    }
    return out;
}

/* set_openmp(address): GOMP_parallel's address in this process (0: none), for launches marked
 * openmp. The caller vouches that the address is GNU OpenMP's GOMP_parallel. */
static PyObject *set_openmp(PyObject *self, PyObject *arg) {
    (void)self;
    unsigned long long address = PyLong_AsUnsignedLongLong(arg);
    if (address == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    pthread_mutex_lock(&LAUNCH);
    GOMP_PARALLEL = (gomp_parallel_fn)(uintptr_t)address;
    pthread_mutex_unlock(&LAUNCH);
    Py_RETURN_NONE;
}

static PyMethodDef METHODS[] = {
    {"run", (PyCFunction)(void (*)(void))run, METH_FASTCALL,
     "run(entry, args, parts, threads[, openmp]): one op's jobs on `threads` threads (on the "
     "caller's OpenMP team if openmp and set_openmp gave one)"},
    {"bind", (PyCFunction)(void (*)(void))bind, METH_FASTCALL,
     "bind(entry, args): the args' slots, as an int64 array"},
    {"run_program", (PyCFunction)(void (*)(void))run_program, METH_FASTCALL,
     "run_program(program, x, y, threads): a bound program's ops with x and y; False if they "
     "do not fit"},
    {"entries", entries, METH_NOARGS, "((symbol, kinds), ...) in entry order"},
    {"set_openmp", set_openmp, METH_O, "set_openmp(address): GOMP_parallel for openmp launches"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef MODULE = {
    PyModuleDef_HEAD_INIT, .m_name = "_leanrnn_native", .m_size = -1, .m_methods = METHODS};

PyMODINIT_FUNC PyInit__leanrnn_native(void) {
    import_array();
    /* at import, not when the first worker starts: a process whose launches all went to an
     * OpenMP team has none, and its child must still forget that team */
    if (pthread_atfork(NULL, NULL, after_fork_in_child)) {
        PyErr_SetString(PyExc_OSError, "pthread_atfork failed");
        return NULL;
    }
    PyObject *m = PyModule_Create(&MODULE);
    if (m && PyModule_AddStringConstant(m, "fingerprint", LEANRNN_FINGERPRINT) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
