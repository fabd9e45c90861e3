/*
 * kvx._datapath._cuda: the copy kernel's launch and the wait for it, through
 * the CUDA driver, in C.
 *
 * A leased GPU copy of a few MiB takes ~13 us on an H200; CuPy's launch from
 * Python, its argument copy and a Python poll of the event took ~24 us around
 * it (benchmarks/RESULTS.md, "Round fifteen"). These calls do the same work
 * with the GIL released and no Python objects per step. The handles come
 * from CuPy, which owns them (a RawModule's CUfunction, a Stream's CUstream,
 * an Event's CUevent: the runtime's handles are the driver's); the calling
 * thread's current context is the device's primary context (CuPy's Device).
 * libcuda is opened with dlopen when load() is first called, so kvx builds
 * and imports where there is no CUDA at all.
 *
 *   load() -> None            (OSError: no libcuda.so.1, or a symbol missing)
 *   launch(function, stream, host, dev, nbytes, n, grid, threads, event) -> None
 *       nbytes > 0 (then exactly 24 n): first copy nbytes of pinned host
 *       memory at host to dev; then launch function<<<grid, threads, 0,
 *       stream>>>(dev, dev + 8n, dev + 16n, n) (kvx_copy's arguments: srcs,
 *       dsts, lens of n triples); event != 0: record it on the stream after
 *       the launch. When a step fails after an earlier one was queued, the
 *       stream is synchronised before the error is raised, so that nothing
 *       queued still reads the caller's buffers once the call has returned.
 *   wait(event, spin_us) -> None
 *       query the event for up to spin_us, then block on it (its flags say
 *       whether the thread sleeps); returns once the work before it ended.
 *
 * Errors raise RuntimeError naming the call and the CUDA error.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <stdint.h>
#include <time.h>

typedef int CUresult;
typedef void *CUfunction;
typedef void *CUstream;
typedef void *CUevent;
typedef unsigned long long CUdeviceptr;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_NOT_READY 600

static CUresult (*p_launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                            CUstream, void **, void **);
static CUresult (*p_htod)(CUdeviceptr, const void *, size_t, CUstream);
static CUresult (*p_record)(CUevent, CUstream);
static CUresult (*p_query)(CUevent);
static CUresult (*p_sync)(CUevent);
static CUresult (*p_stream_sync)(CUstream);
static CUresult (*p_error_name)(CUresult, const char **);
static int loaded;

static PyObject *kvx_load(PyObject *self, PyObject *noargs)
{
    (void)self;
    (void)noargs;
    if (loaded)
        Py_RETURN_NONE;
    /* CuPy has loaded the driver already where it is in use: this finds that copy. */
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) {
        const char *why = dlerror();
        PyErr_Format(PyExc_OSError, "cannot open libcuda.so.1: %s", why ? why : "unknown error");
        return NULL;
    }
    struct {
        const char *name;
        void **slot;
    } symbols[] = {
        {"cuLaunchKernel", (void **)&p_launch},       {"cuMemcpyHtoDAsync_v2", (void **)&p_htod},
        {"cuEventRecord", (void **)&p_record},        {"cuEventQuery", (void **)&p_query},
        {"cuEventSynchronize", (void **)&p_sync},     {"cuGetErrorName", (void **)&p_error_name},
        {"cuStreamSynchronize", (void **)&p_stream_sync},
    };
    for (size_t i = 0; i < sizeof symbols / sizeof symbols[0]; i++) {
        *symbols[i].slot = dlsym(lib, symbols[i].name);
        if (*symbols[i].slot == NULL) {
            PyErr_Format(PyExc_OSError, "libcuda.so.1 has no %s", symbols[i].name);
            return NULL;
        }
    }
    loaded = 1;
    Py_RETURN_NONE;
}

static PyObject *cuda_error(const char *call, CUresult rc)
{
    const char *name = NULL;
    if (p_error_name == NULL || p_error_name(rc, &name) != CUDA_SUCCESS || name == NULL)
        name = "unknown CUDA error";
    PyErr_Format(PyExc_RuntimeError, "%s: %s (%d)", call, name, rc);
    return NULL;
}

static int need_loaded(void)
{
    if (!loaded) {
        PyErr_SetString(PyExc_RuntimeError, "kvx._datapath._cuda: call load() first");
        return -1;
    }
    return 0;
}

/* "O&" converter: a Python int in 0 .. 2**64 - 1 (OverflowError otherwise, not a wrap). */
static int to_u64(PyObject *obj, void *out)
{
    unsigned long long value = PyLong_AsUnsignedLongLong(obj);
    if (value == (unsigned long long)-1 && PyErr_Occurred())
        return 0;
    *(unsigned long long *)out = value;
    return 1;
}

/* Largest grid and block the launch takes (CUDA's limits for x: 2**31 - 1 blocks, 1024 threads). */
#define MAX_GRID 0x7fffffffull
#define MAX_THREADS 1024ull

static PyObject *kvx_launch(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long function, stream, host, dev, nbytes, count, grid, threads, event;
    if (!PyArg_ParseTuple(args, "O&O&O&O&O&O&O&O&O&:launch", to_u64, &function, to_u64, &stream, to_u64, &host,
                          to_u64, &dev, to_u64, &nbytes, to_u64, &count, to_u64, &grid, to_u64, &threads, to_u64,
                          &event))
        return NULL;
    if (need_loaded() < 0)
        return NULL;
    if (function == 0 || dev == 0 || count == 0 || count > 0xffffffffull || grid == 0 || grid > MAX_GRID ||
        threads == 0 || threads > MAX_THREADS || (nbytes && (host == 0 || nbytes != 24ull * count))) {
        PyErr_SetString(PyExc_ValueError,
                        "launch: a null function or buffer, no triples (or over 2**32), a grid or block out of "
                        "range, or argument bytes other than 24 per triple");
        return NULL;
    }
    unsigned int n = (unsigned int)count;
    CUdeviceptr srcs = dev, dsts = dev + 8ull * n, lens = dev + 16ull * n;
    void *params[] = {&srcs, &dsts, &lens, &n};
    CUstream s = (CUstream)(uintptr_t)stream;
    const char *failed = NULL;
    int queued = 0;
    CUresult rc = CUDA_SUCCESS;
    Py_BEGIN_ALLOW_THREADS
    if (nbytes) {
        rc = p_htod(dev, (const void *)(uintptr_t)host, (size_t)nbytes, s);
        if (rc != CUDA_SUCCESS)
            failed = "cuMemcpyHtoDAsync";
        else
            queued = 1;
    }
    if (failed == NULL) {
        rc = p_launch((CUfunction)(uintptr_t)function, (unsigned)grid, 1, 1, (unsigned)threads, 1, 1, 0, s, params,
                      NULL);
        if (rc != CUDA_SUCCESS)
            failed = "cuLaunchKernel";
        else
            queued = 1;
    }
    if (failed == NULL && event) {
        rc = p_record((CUevent)(uintptr_t)event, s);
        if (rc != CUDA_SUCCESS)
            failed = "cuEventRecord";
    }
    if (failed != NULL && queued)
        (void)p_stream_sync(s); /* its own error, if any, is the one already raised */
    Py_END_ALLOW_THREADS
    if (failed != NULL)
        return cuda_error(failed, rc);
    Py_RETURN_NONE;
}

static double now_us(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e6 + (double)ts.tv_nsec / 1e3;
}

static PyObject *kvx_wait(PyObject *self, PyObject *args)
{
    (void)self;
    unsigned long long event;
    double spin_us;
    if (!PyArg_ParseTuple(args, "Kd:wait", &event, &spin_us))
        return NULL;
    if (need_loaded() < 0)
        return NULL;
    if (event == 0) {
        PyErr_SetString(PyExc_ValueError, "wait: a null event");
        return NULL;
    }
    CUevent ev = (CUevent)(uintptr_t)event;
    CUresult rc;
    const char *call = "cuEventQuery";
    Py_BEGIN_ALLOW_THREADS
    rc = p_query(ev);
    if (rc == CUDA_ERROR_NOT_READY && spin_us > 0) {
        double deadline = now_us() + spin_us;
        do {
            rc = p_query(ev);
        } while (rc == CUDA_ERROR_NOT_READY && now_us() < deadline);
    }
    if (rc == CUDA_ERROR_NOT_READY) {
        call = "cuEventSynchronize";
        rc = p_sync(ev);
    }
    Py_END_ALLOW_THREADS
    if (rc != CUDA_SUCCESS)
        return cuda_error(call, rc);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"load", kvx_load, METH_NOARGS, "load() -> None: open libcuda.so.1 and find the calls below"},
    {"launch", kvx_launch, METH_VARARGS,
     "launch(function, stream, host, dev, nbytes, n, grid, threads, event) -> None: copy the arguments, launch "
     "kvx_copy, record the event"},
    {"wait", kvx_wait, METH_VARARGS, "wait(event, spin_us) -> None: poll the event for spin_us, then block on it"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "kvx._datapath._cuda", "The copy kernel's launch and wait through the CUDA driver.", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__cuda(void) { return PyModule_Create(&module); }
