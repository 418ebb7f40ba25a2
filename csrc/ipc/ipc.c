/*
 * lorafn._ipc: the native part of the backbone-sharing layer (see README.md beside this file).
 *
 * What it does, and only this:
 *   - loads the CUDA driver (libcuda.so.1) at run time with dlopen: the extension builds with plain
 *     gcc on a machine without a GPU or a CUDA toolkit, and imports there (available() says False);
 *   - server side: cuMemCreate of exportable (POSIX fd) physical allocations, mapped read-write into
 *     one reserved virtual range, exported as file descriptors;
 *   - worker side: in one call, reserve W at a FIXED virtual address (verified), import every fd, map
 *     the allocations back to back, set READ-ONLY access, drop the import handles;
 *   - a Mapping object whose deallocation unmaps and frees the range: Python tensors built over the
 *     mapping hold a reference to it, so the mapping lives exactly as long as the last tensor.
 *
 * The few driver types and enums are declared here from the documented driver ABI (cuda.h,
 * CUDA >= 11.0; the VMM entry points have had no _v2 variants since they appeared in 10.2).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

/* ---- driver ABI (subset of cuda.h) ---------------------------------------------------------- */
typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;
typedef struct { char bytes[16]; } CUuuid;

#define CUDA_SUCCESS 0
#define CU_MEM_ALLOCATION_TYPE_PINNED 1
#define CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR 1
#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define CU_MEM_ACCESS_FLAGS_PROT_READ 1
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE 3
#define CU_MEM_ALLOC_GRANULARITY_MINIMUM 0
#define CU_MEM_ALLOC_GRANULARITY_RECOMMENDED 1

typedef struct {
    int type; /* CUmemLocationType */
    int id;
} CUmemLocation;

typedef struct {
    int type;                 /* CUmemAllocationType */
    int requestedHandleTypes; /* CUmemAllocationHandleType */
    CUmemLocation location;
    void *win32HandleMetaData;
    struct {
        unsigned char compressionType;
        unsigned char gpuDirectRDMACapable;
        unsigned short usage;
        unsigned char reserved[4];
    } allocFlags;
} CUmemAllocationProp;

typedef struct {
    CUmemLocation location;
    int flags; /* CUmemAccess_flags */
} CUmemAccessDesc;

/* ---- dlopen'ed entry points ------------------------------------------------------------------ */
typedef CUresult (*fn_cuInit)(unsigned int);
typedef CUresult (*fn_cuDriverGetVersion)(int *);
typedef CUresult (*fn_cuDeviceGet)(CUdevice *, int);
typedef CUresult (*fn_cuDeviceGetCount)(int *);
typedef CUresult (*fn_cuDeviceGetUuid)(CUuuid *, CUdevice);
typedef CUresult (*fn_cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
typedef CUresult (*fn_cuCtxGetCurrent)(CUcontext *);
typedef CUresult (*fn_cuCtxSetCurrent)(CUcontext);
typedef CUresult (*fn_cuGetErrorName)(CUresult, const char **);
typedef CUresult (*fn_cuGetErrorString)(CUresult, const char **);
typedef CUresult (*fn_cuMemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, int);
typedef CUresult (*fn_cuMemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                                   unsigned long long);
typedef CUresult (*fn_cuMemRelease)(CUmemGenericAllocationHandle);
typedef CUresult (*fn_cuMemExportToShareableHandle)(void *, CUmemGenericAllocationHandle, int,
                                                    unsigned long long);
typedef CUresult (*fn_cuMemImportFromShareableHandle)(CUmemGenericAllocationHandle *, void *, int);
typedef CUresult (*fn_cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*fn_cuMemAddressFree)(CUdeviceptr, size_t);
typedef CUresult (*fn_cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
typedef CUresult (*fn_cuMemUnmap)(CUdeviceptr, size_t);
typedef CUresult (*fn_cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);

static struct {
    void *lib;
    int tried;
    int initialized;
    char error[512];
    fn_cuInit cuInit;
    fn_cuDriverGetVersion cuDriverGetVersion;
    fn_cuDeviceGet cuDeviceGet;
    fn_cuDeviceGetCount cuDeviceGetCount;
    fn_cuDeviceGetUuid cuDeviceGetUuid;
    fn_cuDevicePrimaryCtxRetain cuDevicePrimaryCtxRetain;
    fn_cuCtxGetCurrent cuCtxGetCurrent;
    fn_cuCtxSetCurrent cuCtxSetCurrent;
    fn_cuGetErrorName cuGetErrorName;
    fn_cuGetErrorString cuGetErrorString;
    fn_cuMemGetAllocationGranularity cuMemGetAllocationGranularity;
    fn_cuMemCreate cuMemCreate;
    fn_cuMemRelease cuMemRelease;
    fn_cuMemExportToShareableHandle cuMemExportToShareableHandle;
    fn_cuMemImportFromShareableHandle cuMemImportFromShareableHandle;
    fn_cuMemAddressReserve cuMemAddressReserve;
    fn_cuMemAddressFree cuMemAddressFree;
    fn_cuMemMap cuMemMap;
    fn_cuMemUnmap cuMemUnmap;
    fn_cuMemSetAccess cuMemSetAccess;
} drv;

static pthread_mutex_t drv_lock = PTHREAD_MUTEX_INITIALIZER;
static PyObject *CudaError; /* lorafn._ipc.CudaError (RuntimeError) */

#define LOAD(name)                                                                            \
    do {                                                                                      \
        drv.name = (fn_##name)dlsym(drv.lib, #name);                                          \
        if (!drv.name) {                                                                      \
            snprintf(drv.error, sizeof drv.error, "libcuda.so.1 has no symbol %s", #name);    \
            return -1;                                                                        \
        }                                                                                     \
    } while (0)

static int load_symbols(void) {
    LOAD(cuInit);
    LOAD(cuDriverGetVersion);
    LOAD(cuDeviceGet);
    LOAD(cuDeviceGetCount);
    LOAD(cuDevicePrimaryCtxRetain);
    LOAD(cuCtxGetCurrent);
    LOAD(cuCtxSetCurrent);
    LOAD(cuGetErrorName);
    LOAD(cuGetErrorString);
    LOAD(cuMemGetAllocationGranularity);
    LOAD(cuMemCreate);
    LOAD(cuMemRelease);
    LOAD(cuMemExportToShareableHandle);
    LOAD(cuMemImportFromShareableHandle);
    LOAD(cuMemAddressReserve);
    LOAD(cuMemAddressFree);
    LOAD(cuMemMap);
    LOAD(cuMemUnmap);
    LOAD(cuMemSetAccess);
    /* cuDeviceGetUuid_v2 reports MIG instance UUIDs (what NVIDIA_VISIBLE_DEVICES names); fall back. */
    drv.cuDeviceGetUuid = (fn_cuDeviceGetUuid)dlsym(drv.lib, "cuDeviceGetUuid_v2");
    if (!drv.cuDeviceGetUuid) LOAD(cuDeviceGetUuid);
    return 0;
}

/* Returns 0 when the driver is loaded and initialized; otherwise fills drv.error. Thread-safe. */
static int ensure_driver(void) {
    pthread_mutex_lock(&drv_lock);
    if (!drv.tried) {
        drv.tried = 1;
        drv.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
        if (!drv.lib) {
            const char *e = dlerror();
            snprintf(drv.error, sizeof drv.error, "cannot load the CUDA driver (libcuda.so.1): %s",
                     e ? e : "unknown error");
        } else if (load_symbols() == 0) {
            CUresult r = drv.cuInit(0);
            if (r != CUDA_SUCCESS) {
                const char *name = NULL;
                drv.cuGetErrorName(r, &name);
                snprintf(drv.error, sizeof drv.error, "cuInit(0) failed: %s (%d)", name ? name : "?", r);
            } else {
                drv.initialized = 1;
            }
        }
    }
    int ok = drv.initialized;
    pthread_mutex_unlock(&drv_lock);
    return ok ? 0 : -1;
}

static PyObject *raise_no_driver(void) {
    PyErr_SetString(CudaError, drv.error[0] ? drv.error : "CUDA driver not available");
    return NULL;
}

/* Sets CudaError "<what> failed: NAME: description (code)" and returns NULL. */
static PyObject *raise_cu(CUresult r, const char *what) {
    const char *name = NULL, *desc = NULL;
    if (drv.cuGetErrorName) drv.cuGetErrorName(r, &name);
    if (drv.cuGetErrorString) drv.cuGetErrorString(r, &desc);
    PyErr_Format(CudaError, "%s failed: %s: %s (CUresult %d)", what, name ? name : "CUDA_ERROR_?",
                 desc ? desc : "no description", r);
    return NULL;
}

/* Makes the device's primary context (the one PyTorch uses) current on this thread. */
static CUresult use_primary_ctx(int ordinal, CUdevice *dev_out) {
    CUdevice dev;
    CUresult r = drv.cuDeviceGet(&dev, ordinal);
    if (r != CUDA_SUCCESS) return r;
    CUcontext ctx = NULL;
    r = drv.cuDevicePrimaryCtxRetain(&ctx, dev); /* retained once per call site; never released:
                                                    the primary context lives as long as the process */
    if (r != CUDA_SUCCESS) return r;
    r = drv.cuCtxSetCurrent(ctx);
    if (dev_out) *dev_out = dev;
    return r;
}

static void fill_prop(CUmemAllocationProp *prop, CUdevice dev) {
    memset(prop, 0, sizeof *prop);
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = dev;
}

/* ---- Mapping ----------------------------------------------------------------------------------- */
#define MAX_SEGMENTS 240 /* below SCM_MAX_FD (253): all fds travel in one message */

typedef struct {
    PyObject_HEAD
    CUdeviceptr ptr;
    size_t size;     /* reserved and mapped bytes (sum of segment sizes) */
    int ordinal;
    int read_only;
    int owner;       /* 1: created here (server), handles kept for export; 0: imported */
    int nseg;
    size_t seg_size[MAX_SEGMENTS];
    CUmemGenericAllocationHandle handle[MAX_SEGMENTS]; /* owner only */
    int mapped;      /* segments mapped so far (for cleanup) */
    int reserved;
    size_t reserved_size; /* the VA reservation: size rounded up to RESERVE_UNIT */
} Mapping;

/* Measured on H100 (driver 580): cuMemAddressReserve honours a fixed address only for sizes that are
 * multiples of 2 GiB (a 154 MiB request at 0x1000_0000_0000 came back elsewhere, 2/4/16 GiB came back
 * exact). Virtual address space is cheap: reserve whole 2 GiB units and map what is needed. */
#define RESERVE_UNIT (2ULL << 30)

static void mapping_release(Mapping *m) {
    if (!drv.initialized) return;
    if (m->reserved || m->mapped) use_primary_ctx(m->ordinal, NULL);
    size_t off = 0;
    for (int i = 0; i < m->mapped; i++) {
        drv.cuMemUnmap(m->ptr + off, m->seg_size[i]);
        off += m->seg_size[i];
    }
    m->mapped = 0;
    if (m->owner) {
        for (int i = 0; i < m->nseg; i++) {
            if (m->handle[i]) drv.cuMemRelease(m->handle[i]);
            m->handle[i] = 0;
        }
    }
    if (m->reserved) drv.cuMemAddressFree(m->ptr, m->reserved_size);
    m->reserved = 0;
}

static void Mapping_dealloc(Mapping *m) {
    mapping_release(m);
    Py_TYPE(m)->tp_free((PyObject *)m);
}

static PyObject *Mapping_export_fds(Mapping *m, PyObject *Py_UNUSED(ignored)) {
    if (!m->owner) {
        PyErr_SetString(PyExc_ValueError, "export_fds: only the process that created a mapping exports it");
        return NULL;
    }
    if (!m->reserved) {
        PyErr_SetString(PyExc_ValueError, "export_fds: mapping already released");
        return NULL;
    }
    PyObject *out = PyList_New(0);
    if (!out) return NULL;
    for (int i = 0; i < m->nseg; i++) {
        int fd = -1;
        CUresult r = drv.cuMemExportToShareableHandle(&fd, m->handle[i], CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0);
        if (r != CUDA_SUCCESS) {
            Py_ssize_t n = PyList_GET_SIZE(out);
            for (Py_ssize_t j = 0; j < n; j++) close((int)PyLong_AsLong(PyList_GET_ITEM(out, j)));
            Py_DECREF(out);
            return raise_cu(r, "cuMemExportToShareableHandle(POSIX_FILE_DESCRIPTOR)");
        }
        PyObject *v = PyLong_FromLong(fd);
        if (!v || PyList_Append(out, v) < 0) {
            Py_XDECREF(v);
            close(fd);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(v);
    }
    return out;
}

static PyObject *Mapping_segment_sizes(Mapping *m, void *Py_UNUSED(c)) {
    PyObject *out = PyList_New(m->nseg);
    if (!out) return NULL;
    for (int i = 0; i < m->nseg; i++) PyList_SET_ITEM(out, i, PyLong_FromSize_t(m->seg_size[i]));
    return out;
}

static PyObject *Mapping_repr(Mapping *m) {
    char buf[200];
    snprintf(buf, sizeof buf, "<lorafn._ipc.Mapping ptr=0x%llx size=%zu segments=%d device=%d %s %s>",
             (unsigned long long)m->ptr, m->size, m->nseg, m->ordinal, m->read_only ? "read-only" : "read-write",
             m->owner ? "owned" : "imported");
    return PyUnicode_FromString(buf);
}

static PyMemberDef Mapping_members[] = {
    {"ptr", T_ULONGLONG, offsetof(Mapping, ptr), READONLY, "device virtual address of the mapping"},
    {"size", T_PYSSIZET, offsetof(Mapping, size), READONLY, "mapped bytes"},
    {"reserved_size", T_PYSSIZET, offsetof(Mapping, reserved_size), READONLY, "reserved virtual bytes (2 GiB units)"},
    {"device", T_INT, offsetof(Mapping, ordinal), READONLY, "device ordinal in this process"},
    {"read_only", T_BOOL, offsetof(Mapping, read_only), READONLY, "True when mapped PROT_READ"},
    {"owner", T_BOOL, offsetof(Mapping, owner), READONLY, "True in the process that created it"},
    {NULL}};

static PyGetSetDef Mapping_getset[] = {
    {"segment_sizes", (getter)Mapping_segment_sizes, NULL, "bytes of each physical allocation", NULL},
    {NULL}};

static PyMethodDef Mapping_methods[] = {
    {"export_fds", (PyCFunction)Mapping_export_fds, METH_NOARGS,
     "New POSIX file descriptors, one per allocation (the caller closes them after sending)."},
    {NULL}};

static PyTypeObject MappingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "lorafn._ipc.Mapping",
    .tp_basicsize = sizeof(Mapping),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A reserved device virtual range with VMM allocations mapped into it. Deallocation unmaps.",
    .tp_dealloc = (destructor)Mapping_dealloc,
    .tp_repr = (reprfunc)Mapping_repr,
    .tp_members = Mapping_members,
    .tp_getset = Mapping_getset,
    .tp_methods = Mapping_methods,
};

/* Reads a list of sizes (each a multiple of the granularity is the caller's business). */
static int parse_sizes(PyObject *seq, Mapping *m) {
    PyObject *fast = PySequence_Fast(seq, "segment_sizes must be a sequence of ints");
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    if (n < 1 || n > MAX_SEGMENTS) {
        Py_DECREF(fast);
        PyErr_Format(PyExc_ValueError, "segment_sizes: need 1..%d segments, got %zd", MAX_SEGMENTS, n);
        return -1;
    }
    m->nseg = (int)n;
    m->size = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long v = PyLong_AsUnsignedLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (PyErr_Occurred()) {
            Py_DECREF(fast);
            return -1;
        }
        if (v == 0) {
            Py_DECREF(fast);
            PyErr_SetString(PyExc_ValueError, "segment_sizes: a segment of 0 bytes");
            return -1;
        }
        m->seg_size[i] = (size_t)v;
        m->size += (size_t)v;
    }
    Py_DECREF(fast);
    return 0;
}

/* ---- module functions -------------------------------------------------------------------------- */
static PyObject *ipc_available(PyObject *self, PyObject *args) {
    if (ensure_driver() == 0) Py_RETURN_TRUE;
    Py_RETURN_FALSE;
}

static PyObject *ipc_unavailable_reason(PyObject *self, PyObject *args) {
    if (ensure_driver() == 0) Py_RETURN_NONE;
    return PyUnicode_FromString(drv.error);
}

static PyObject *ipc_driver_version(PyObject *self, PyObject *args) {
    if (ensure_driver() < 0) return raise_no_driver();
    int v = 0;
    CUresult r = drv.cuDriverGetVersion(&v);
    if (r != CUDA_SUCCESS) return raise_cu(r, "cuDriverGetVersion");
    return PyLong_FromLong(v);
}

static PyObject *ipc_device_count(PyObject *self, PyObject *args) {
    if (ensure_driver() < 0) return raise_no_driver();
    int n = 0;
    CUresult r = drv.cuDeviceGetCount(&n);
    if (r != CUDA_SUCCESS) return raise_cu(r, "cuDeviceGetCount");
    return PyLong_FromLong(n);
}

static PyObject *ipc_device_uuid(PyObject *self, PyObject *args) {
    int ordinal;
    if (!PyArg_ParseTuple(args, "i", &ordinal)) return NULL;
    if (ensure_driver() < 0) return raise_no_driver();
    CUdevice dev;
    CUresult r = drv.cuDeviceGet(&dev, ordinal);
    if (r != CUDA_SUCCESS) return raise_cu(r, "cuDeviceGet");
    CUuuid u;
    r = drv.cuDeviceGetUuid(&u, dev);
    if (r != CUDA_SUCCESS) return raise_cu(r, "cuDeviceGetUuid");
    const unsigned char *b = (const unsigned char *)u.bytes;
    char s[64];
    snprintf(s, sizeof s, "GPU-%02x%02x%02x%02x-%02x%02x-%02x%02x-%02x%02x-%02x%02x%02x%02x%02x%02x", b[0], b[1],
             b[2], b[3], b[4], b[5], b[6], b[7], b[8], b[9], b[10], b[11], b[12], b[13], b[14], b[15]);
    return PyUnicode_FromString(s);
}

static PyObject *ipc_granularity(PyObject *self, PyObject *args) {
    int ordinal, recommended = 1;
    if (!PyArg_ParseTuple(args, "i|p", &ordinal, &recommended)) return NULL;
    if (ensure_driver() < 0) return raise_no_driver();
    CUdevice dev;
    CUresult r = drv.cuDeviceGet(&dev, ordinal);
    if (r != CUDA_SUCCESS) return raise_cu(r, "cuDeviceGet");
    CUmemAllocationProp prop;
    fill_prop(&prop, dev);
    size_t g = 0;
    r = drv.cuMemGetAllocationGranularity(
        &g, &prop, recommended ? CU_MEM_ALLOC_GRANULARITY_RECOMMENDED : CU_MEM_ALLOC_GRANULARITY_MINIMUM);
    if (r != CUDA_SUCCESS) return raise_cu(r, "cuMemGetAllocationGranularity(POSIX_FILE_DESCRIPTOR)");
    return PyLong_FromSize_t(g);
}

/* Reserves whole RESERVE_UNITs covering m->size at addr (0: anywhere), requiring the exact address
 * when require_exact. Retries once with RESERVE_UNIT alignment before failing. */
static PyObject *reserve(Mapping *m, unsigned long long addr, int require_exact) {
    size_t rsize = (size_t)((m->size + RESERVE_UNIT - 1) / RESERVE_UNIT * RESERVE_UNIT);
    CUdeviceptr got = 0;
    CUresult r = drv.cuMemAddressReserve(&got, rsize, 0, (CUdeviceptr)addr, 0);
    if (r == CUDA_SUCCESS && require_exact && got != (CUdeviceptr)addr) {
        drv.cuMemAddressFree(got, rsize);
        got = 0;
        r = drv.cuMemAddressReserve(&got, rsize, RESERVE_UNIT, (CUdeviceptr)addr, 0);
    }
    if (r != CUDA_SUCCESS) {
        char what[160];
        snprintf(what, sizeof what, "cuMemAddressReserve(size=%zu, addr=0x%llx)", rsize, addr);
        return raise_cu(r, what);
    }
    if (require_exact && got != (CUdeviceptr)addr) {
        drv.cuMemAddressFree(got, rsize);
        PyErr_Format(CudaError,
                     "cuMemAddressReserve(size=%zu) returned 0x%llx, not the fixed address 0x%llx that W must "
                     "occupy in every worker (is the range taken in this process, e.g. by a second mapping "
                     "of the backbone?)",
                     rsize, (unsigned long long)got, addr);
        return NULL;
    }
    m->ptr = got;
    m->reserved_size = rsize;
    m->reserved = 1;
    return Py_None;
}

static PyObject *ipc_create_exportable(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"device", "segment_sizes", "addr", NULL};
    int ordinal;
    PyObject *sizes;
    unsigned long long addr = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iO|K", kwlist, &ordinal, &sizes, &addr)) return NULL;
    if (ensure_driver() < 0) return raise_no_driver();
    Mapping *m = PyObject_New(Mapping, &MappingType);
    if (!m) return NULL;
    m->ptr = 0; m->size = 0; m->ordinal = ordinal; m->read_only = 0; m->owner = 1; m->nseg = 0;
    m->mapped = 0; m->reserved = 0; m->reserved_size = 0;
    memset(m->handle, 0, sizeof m->handle);
    if (parse_sizes(sizes, m) < 0) goto fail;
    CUdevice dev;
    CUresult r = use_primary_ctx(ordinal, &dev);
    if (r != CUDA_SUCCESS) { raise_cu(r, "retaining the primary context"); goto fail; }
    CUmemAllocationProp prop;
    fill_prop(&prop, dev);
    for (int i = 0; i < m->nseg; i++) {
        r = drv.cuMemCreate(&m->handle[i], m->seg_size[i], &prop, 0);
        if (r != CUDA_SUCCESS) {
            char what[120];
            snprintf(what, sizeof what, "cuMemCreate(size=%zu, POSIX_FILE_DESCRIPTOR, device %d)", m->seg_size[i], ordinal);
            m->handle[i] = 0;
            raise_cu(r, what);
            goto fail;
        }
    }
    if (!reserve(m, addr, addr != 0)) goto fail;
    size_t off = 0;
    for (int i = 0; i < m->nseg; i++) {
        r = drv.cuMemMap(m->ptr + off, m->seg_size[i], 0, m->handle[i], 0);
        if (r != CUDA_SUCCESS) { raise_cu(r, "cuMemMap"); goto fail; }
        m->mapped = i + 1;
        off += m->seg_size[i];
    }
    CUmemAccessDesc acc = {{CU_MEM_LOCATION_TYPE_DEVICE, dev}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    r = drv.cuMemSetAccess(m->ptr, m->size, &acc, 1);
    if (r != CUDA_SUCCESS) { raise_cu(r, "cuMemSetAccess(PROT_READWRITE)"); goto fail; }
    return (PyObject *)m;
fail:
    Py_DECREF(m); /* dealloc unmaps, releases and frees what was done */
    return NULL;
}

static PyObject *ipc_import_map(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"device", "fds", "segment_sizes", "addr", "read_only", NULL};
    int ordinal, read_only = 1;
    PyObject *fds, *sizes;
    unsigned long long addr = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iOOK|p", kwlist, &ordinal, &fds, &sizes, &addr, &read_only))
        return NULL;
    if (ensure_driver() < 0) return raise_no_driver();
    Mapping *m = PyObject_New(Mapping, &MappingType);
    if (!m) return NULL;
    m->ptr = 0; m->size = 0; m->ordinal = ordinal; m->read_only = read_only; m->owner = 0; m->nseg = 0;
    m->mapped = 0; m->reserved = 0; m->reserved_size = 0;
    memset(m->handle, 0, sizeof m->handle);
    PyObject *fdfast = NULL;
    if (parse_sizes(sizes, m) < 0) goto fail;
    fdfast = PySequence_Fast(fds, "fds must be a sequence of ints");
    if (!fdfast) goto fail;
    if (PySequence_Fast_GET_SIZE(fdfast) != m->nseg) {
        PyErr_Format(PyExc_ValueError, "import_map: %zd fds for %d segments", PySequence_Fast_GET_SIZE(fdfast), m->nseg);
        goto fail;
    }
    CUdevice dev;
    CUresult r = use_primary_ctx(ordinal, &dev);
    if (r != CUDA_SUCCESS) { raise_cu(r, "retaining the primary context"); goto fail; }
    if (!reserve(m, addr, addr != 0)) goto fail;
    size_t off = 0;
    for (int i = 0; i < m->nseg; i++) {
        long fd = PyLong_AsLong(PySequence_Fast_GET_ITEM(fdfast, i));
        if (fd == -1 && PyErr_Occurred()) goto fail;
        CUmemGenericAllocationHandle h = 0;
        r = drv.cuMemImportFromShareableHandle(&h, (void *)(uintptr_t)fd, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
        if (r != CUDA_SUCCESS) { raise_cu(r, "cuMemImportFromShareableHandle(POSIX_FILE_DESCRIPTOR)"); goto fail; }
        r = drv.cuMemMap(m->ptr + off, m->seg_size[i], 0, h, 0);
        /* The mapping holds the physical memory from here on; the import handle is not needed. */
        drv.cuMemRelease(h);
        if (r != CUDA_SUCCESS) {
            char what[160];
            snprintf(what, sizeof what, "cuMemMap(segment %d, size=%zu) of an imported allocation", i, m->seg_size[i]);
            raise_cu(r, what);
            goto fail;
        }
        m->mapped = i + 1;
        off += m->seg_size[i];
    }
    CUmemAccessDesc acc = {{CU_MEM_LOCATION_TYPE_DEVICE, dev},
                           read_only ? CU_MEM_ACCESS_FLAGS_PROT_READ : CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    r = drv.cuMemSetAccess(m->ptr, m->size, &acc, 1);
    if (r != CUDA_SUCCESS) { raise_cu(r, read_only ? "cuMemSetAccess(PROT_READ)" : "cuMemSetAccess(PROT_READWRITE)"); goto fail; }
    Py_DECREF(fdfast);
    return (PyObject *)m;
fail:
    Py_XDECREF(fdfast);
    Py_DECREF(m);
    return NULL;
}

static PyMethodDef ipc_methods[] = {
    {"available", ipc_available, METH_NOARGS, "True when libcuda.so.1 loaded and cuInit succeeded."},
    {"unavailable_reason", ipc_unavailable_reason, METH_NOARGS, "Why the driver is unavailable, or None."},
    {"driver_version", ipc_driver_version, METH_NOARGS, "cuDriverGetVersion(), e.g. 13000."},
    {"device_count", ipc_device_count, METH_NOARGS, "cuDeviceGetCount()."},
    {"device_uuid", ipc_device_uuid, METH_VARARGS, "device_uuid(ordinal) -> 'GPU-xxxxxxxx-xxxx-...' (as nvidia-smi)."},
    {"granularity", ipc_granularity, METH_VARARGS,
     "granularity(ordinal, recommended=True) -> bytes; VMM sizes and addresses are multiples of it."},
    {"create_exportable", (PyCFunction)(void (*)(void))ipc_create_exportable, METH_VARARGS | METH_KEYWORDS,
     "create_exportable(device, segment_sizes, addr=0) -> Mapping (read-write, exportable as POSIX fds)."},
    {"import_map", (PyCFunction)(void (*)(void))ipc_import_map, METH_VARARGS | METH_KEYWORDS,
     "import_map(device, fds, segment_sizes, addr, read_only=True) -> Mapping at exactly addr (when addr != 0)."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef ipc_module = {PyModuleDef_HEAD_INIT, "lorafn._ipc",
                                        "Native VMM import/export for the shared backbone (see csrc/ipc/README.md).",
                                        -1, ipc_methods};

PyMODINIT_FUNC PyInit__ipc(void) {
    if (PyType_Ready(&MappingType) < 0) return NULL;
    PyObject *mod = PyModule_Create(&ipc_module);
    if (!mod) return NULL;
    CudaError = PyErr_NewException("lorafn._ipc.CudaError", PyExc_RuntimeError, NULL);
    if (!CudaError) return NULL;
    Py_INCREF(CudaError);
    PyModule_AddObject(mod, "CudaError", CudaError);
    Py_INCREF(&MappingType);
    PyModule_AddObject(mod, "Mapping", (PyObject *)&MappingType);
    PyModule_AddIntConstant(mod, "MAX_SEGMENTS", MAX_SEGMENTS);
    return mod;
}
