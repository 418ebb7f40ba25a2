/*
 * The fixed-address device arena A of a worker (DESIGN §6, issue 11 item 2): the allocation functions
 * that torch.cuda.memory.CUDAPluggableAllocator calls, backed by one cuMemAddressReserve at a FIXED
 * virtual address and handing out addresses by a deterministic bump. Two processes that make the same
 * sequence of allocations get the same addresses, so a CUDA graph captured in one is valid, pointer for
 * pointer, in the other (lorafn/runtime/arena.py compiles this file at run time with the system C
 * compiler and loads it with ctypes; it needs no CUDA toolkit: libcuda.so.1 is dlopen'ed, and the few
 * driver types are declared here from the documented driver ABI, as csrc/ipc/ipc.c does).
 *
 * Each allocation is its own physical allocation (cuMemCreate of the size rounded up to the
 * granularity) mapped at the bump pointer; a free unmaps and releases it but never gives its virtual
 * range back (the bump only grows), so addresses stay a pure function of the allocation sequence.
 */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/types.h>

typedef int CUresult;
typedef int CUdevice;
typedef struct CUctx_st *CUcontext;
typedef unsigned long long CUdeviceptr;
typedef unsigned long long CUmemGenericAllocationHandle;

#define CUDA_SUCCESS 0
#define CU_MEM_ALLOCATION_TYPE_PINNED 1
#define CU_MEM_HANDLE_TYPE_NONE 0
#define CU_MEM_LOCATION_TYPE_DEVICE 1
#define CU_MEM_ACCESS_FLAGS_PROT_READWRITE 3
#define CU_MEM_ALLOC_GRANULARITY_RECOMMENDED 1

typedef struct {
    int type;
    int id;
} CUmemLocation;

typedef struct {
    int type;
    int requestedHandleTypes;
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
    int flags;
} CUmemAccessDesc;

typedef CUresult (*fn_cuInit)(unsigned int);
typedef CUresult (*fn_cuDeviceGet)(CUdevice *, int);
typedef CUresult (*fn_cuDevicePrimaryCtxRetain)(CUcontext *, CUdevice);
typedef CUresult (*fn_cuCtxGetCurrent)(CUcontext *);
typedef CUresult (*fn_cuCtxSetCurrent)(CUcontext);
typedef CUresult (*fn_cuCtxSynchronize)(void);
typedef CUresult (*fn_cuGetErrorName)(CUresult, const char **);
typedef CUresult (*fn_cuMemGetAllocationGranularity)(size_t *, const CUmemAllocationProp *, int);
typedef CUresult (*fn_cuMemCreate)(CUmemGenericAllocationHandle *, size_t, const CUmemAllocationProp *,
                                   unsigned long long);
typedef CUresult (*fn_cuMemRelease)(CUmemGenericAllocationHandle);
typedef CUresult (*fn_cuMemAddressReserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
typedef CUresult (*fn_cuMemAddressFree)(CUdeviceptr, size_t);
typedef CUresult (*fn_cuMemMap)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle, unsigned long long);
typedef CUresult (*fn_cuMemUnmap)(CUdeviceptr, size_t);
typedef CUresult (*fn_cuMemSetAccess)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);

#define RESERVE_UNIT (2ULL << 30) /* the driver honours a fixed address only for whole 2 GiB units */
#define MAX_LIVE 65536
#define MAX_LOG 65536

typedef struct {
    CUdeviceptr ptr;
    size_t size;
    CUmemGenericAllocationHandle handle;
} Live;

static struct {
    void *lib;
    fn_cuInit cuInit;
    fn_cuDeviceGet cuDeviceGet;
    fn_cuDevicePrimaryCtxRetain cuDevicePrimaryCtxRetain;
    fn_cuCtxGetCurrent cuCtxGetCurrent;
    fn_cuCtxSetCurrent cuCtxSetCurrent;
    fn_cuCtxSynchronize cuCtxSynchronize;
    fn_cuGetErrorName cuGetErrorName;
    fn_cuMemGetAllocationGranularity cuMemGetAllocationGranularity;
    fn_cuMemCreate cuMemCreate;
    fn_cuMemRelease cuMemRelease;
    fn_cuMemAddressReserve cuMemAddressReserve;
    fn_cuMemAddressFree cuMemAddressFree;
    fn_cuMemMap cuMemMap;
    fn_cuMemUnmap cuMemUnmap;
    fn_cuMemSetAccess cuMemSetAccess;
    int ready;
    int device;
    CUdevice dev;
    CUcontext ctx;
    CUdeviceptr base;
    size_t reserved;
    size_t granularity;
    size_t bump;        /* offset of the next allocation from base */
    size_t mapped;      /* bytes currently backed by physical memory */
    size_t allocations; /* count since init */
    size_t frees;
    Live live[MAX_LIVE];
    int nlive;
    unsigned long long log_offset[MAX_LOG];
    unsigned long long log_size[MAX_LOG];
    char error[512];
} A;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;

static void set_error_cu(CUresult r, const char *what) {
    const char *name = NULL;
    if (A.cuGetErrorName) A.cuGetErrorName(r, &name);
    snprintf(A.error, sizeof A.error, "%s failed: %s (CUresult %d)", what, name ? name : "CUDA_ERROR_?", r);
}

#define LOAD(name)                                                                              \
    do {                                                                                        \
        A.name = (fn_##name)dlsym(A.lib, #name);                                                \
        if (!A.name) {                                                                          \
            snprintf(A.error, sizeof A.error, "libcuda.so.1 has no symbol %s", #name);          \
            return -1;                                                                          \
        }                                                                                       \
    } while (0)

static int load_driver(void) {
    if (A.lib) return 0;
    A.lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!A.lib) {
        const char *e = dlerror();
        snprintf(A.error, sizeof A.error, "cannot load libcuda.so.1: %s", e ? e : "unknown error");
        return -1;
    }
    LOAD(cuInit);
    LOAD(cuDeviceGet);
    LOAD(cuDevicePrimaryCtxRetain);
    LOAD(cuCtxGetCurrent);
    LOAD(cuCtxSetCurrent);
    LOAD(cuCtxSynchronize);
    LOAD(cuGetErrorName);
    LOAD(cuMemGetAllocationGranularity);
    LOAD(cuMemCreate);
    LOAD(cuMemRelease);
    LOAD(cuMemAddressReserve);
    LOAD(cuMemAddressFree);
    LOAD(cuMemMap);
    LOAD(cuMemUnmap);
    LOAD(cuMemSetAccess);
    return 0;
}

static void fill_prop(CUmemAllocationProp *prop) {
    memset(prop, 0, sizeof *prop);
    prop->type = CU_MEM_ALLOCATION_TYPE_PINNED;
    prop->requestedHandleTypes = CU_MEM_HANDLE_TYPE_NONE;
    prop->location.type = CU_MEM_LOCATION_TYPE_DEVICE;
    prop->location.id = A.dev;
}

/* The primary context (the one torch uses) current on this thread; torch's callers have it already. */
static int ensure_ctx(void) {
    CUcontext cur = NULL;
    if (A.cuCtxGetCurrent(&cur) == CUDA_SUCCESS && cur) return 0;
    CUresult r = A.cuCtxSetCurrent(A.ctx);
    if (r != CUDA_SUCCESS) {
        set_error_cu(r, "cuCtxSetCurrent(primary context)");
        return -1;
    }
    return 0;
}

/* Maps `size` bytes (a granularity multiple) of new physical memory at base + bump; returns the
 * address or 0 (A.error says why). Caller holds the lock. */
static CUdeviceptr map_next(size_t size) {
    if (A.bump + size > A.reserved) {
        snprintf(A.error, sizeof A.error,
                 "arena full: %zu bytes requested at offset %zu of a %zu-byte reservation at 0x%llx", size,
                 A.bump, A.reserved, (unsigned long long)A.base);
        return 0;
    }
    if (A.nlive >= MAX_LIVE) {
        snprintf(A.error, sizeof A.error, "arena: more than %d live allocations", MAX_LIVE);
        return 0;
    }
    if (ensure_ctx() < 0) return 0;
    CUmemAllocationProp prop;
    fill_prop(&prop);
    CUmemGenericAllocationHandle h = 0;
    CUresult r = A.cuMemCreate(&h, size, &prop, 0);
    if (r != CUDA_SUCCESS) {
        char what[96];
        snprintf(what, sizeof what, "cuMemCreate(%zu bytes)", size);
        set_error_cu(r, what);
        return 0;
    }
    CUdeviceptr ptr = A.base + A.bump;
    r = A.cuMemMap(ptr, size, 0, h, 0);
    if (r != CUDA_SUCCESS) {
        A.cuMemRelease(h);
        set_error_cu(r, "cuMemMap");
        return 0;
    }
    CUmemAccessDesc acc = {{CU_MEM_LOCATION_TYPE_DEVICE, A.dev}, CU_MEM_ACCESS_FLAGS_PROT_READWRITE};
    r = A.cuMemSetAccess(ptr, size, &acc, 1);
    if (r != CUDA_SUCCESS) {
        A.cuMemUnmap(ptr, size);
        A.cuMemRelease(h);
        set_error_cu(r, "cuMemSetAccess(PROT_READWRITE)");
        return 0;
    }
    A.live[A.nlive].ptr = ptr;
    A.live[A.nlive].size = size;
    A.live[A.nlive].handle = h;
    A.nlive++;
    if (A.allocations < MAX_LOG) {
        A.log_offset[A.allocations] = A.bump;
        A.log_size[A.allocations] = size;
    }
    A.allocations++;
    A.bump += size;
    A.mapped += size;
    return ptr;
}

/* ---- exported ------------------------------------------------------------------------------------ */

const char *lorafn_arena_error(void) { return A.error; }
unsigned long long lorafn_arena_base(void) { return A.base; }
unsigned long long lorafn_arena_reserved(void) { return A.reserved; }
unsigned long long lorafn_arena_bump(void) { return A.bump; }
unsigned long long lorafn_arena_mapped(void) { return A.mapped; }
unsigned long long lorafn_arena_granularity(void) { return A.granularity; }
unsigned long long lorafn_arena_allocations(void) { return A.allocations; }
unsigned long long lorafn_arena_frees(void) { return A.frees; }

/* Entry i of the allocation log: (offset from base, mapped size); -1 past the end. */
int lorafn_arena_log(unsigned long long i, unsigned long long *offset, unsigned long long *size) {
    if (i >= A.allocations || i >= MAX_LOG) return -1;
    *offset = A.log_offset[i];
    *size = A.log_size[i];
    return 0;
}

/* Reserves `reserve_bytes` (rounded up to whole 2 GiB units) at exactly `addr` on device `ordinal`.
 * Returns 0, or -1 with lorafn_arena_error() naming what failed (also when the driver put the range
 * elsewhere: the caller must not go on, every archived pointer would be wrong). */
int lorafn_arena_init(int ordinal, unsigned long long addr, unsigned long long reserve_bytes) {
    pthread_mutex_lock(&lock);
    int rc = -1;
    if (A.ready) {
        snprintf(A.error, sizeof A.error, "arena already initialized at 0x%llx (one arena per process)",
                 (unsigned long long)A.base);
        goto out;
    }
    if (load_driver() < 0) goto out;
    CUresult r = A.cuInit(0);
    if (r != CUDA_SUCCESS) { set_error_cu(r, "cuInit"); goto out; }
    r = A.cuDeviceGet(&A.dev, ordinal);
    if (r != CUDA_SUCCESS) { set_error_cu(r, "cuDeviceGet"); goto out; }
    r = A.cuDevicePrimaryCtxRetain(&A.ctx, A.dev);
    if (r != CUDA_SUCCESS) { set_error_cu(r, "cuDevicePrimaryCtxRetain"); goto out; }
    A.device = ordinal;
    if (ensure_ctx() < 0) goto out;
    CUmemAllocationProp prop;
    fill_prop(&prop);
    r = A.cuMemGetAllocationGranularity(&A.granularity, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED);
    if (r != CUDA_SUCCESS) { set_error_cu(r, "cuMemGetAllocationGranularity"); goto out; }
    size_t size = (size_t)((reserve_bytes + RESERVE_UNIT - 1) / RESERVE_UNIT * RESERVE_UNIT);
    if (size == 0) size = RESERVE_UNIT;
    CUdeviceptr got = 0;
    r = A.cuMemAddressReserve(&got, size, 0, (CUdeviceptr)addr, 0);
    if (r == CUDA_SUCCESS && got != (CUdeviceptr)addr) {
        A.cuMemAddressFree(got, size);
        got = 0;
        r = A.cuMemAddressReserve(&got, size, RESERVE_UNIT, (CUdeviceptr)addr, 0);
    }
    if (r != CUDA_SUCCESS) {
        char what[128];
        snprintf(what, sizeof what, "cuMemAddressReserve(size=%zu, addr=0x%llx)", size, addr);
        set_error_cu(r, what);
        goto out;
    }
    if (got != (CUdeviceptr)addr) {
        A.cuMemAddressFree(got, size);
        snprintf(A.error, sizeof A.error,
                 "cuMemAddressReserve(size=%zu) returned 0x%llx, not the fixed address 0x%llx the arena "
                 "must occupy (is that range taken in this process?)",
                 size, (unsigned long long)got, addr);
        goto out;
    }
    A.base = got;
    A.reserved = size;
    A.bump = 0;
    A.ready = 1;
    A.error[0] = 0;
    rc = 0;
out:
    pthread_mutex_unlock(&lock);
    return rc;
}

/* torch's CUDAPluggableAllocator alloc: void* alloc(ssize_t size, int device, cudaStream_t stream). */
void *lorafn_arena_alloc(ssize_t size, int device, void *stream) {
    (void)stream;
    pthread_mutex_lock(&lock);
    CUdeviceptr ptr = 0;
    if (!A.ready) {
        snprintf(A.error, sizeof A.error, "arena: alloc before lorafn_arena_init");
    } else if (device != A.device) {
        snprintf(A.error, sizeof A.error, "arena: alloc on device %d, the arena is on device %d", device,
                 A.device);
    } else if (size <= 0) {
        snprintf(A.error, sizeof A.error, "arena: alloc of %zd bytes", size);
    } else {
        size_t g = A.granularity;
        ptr = map_next(((size_t)size + g - 1) / g * g);
    }
    pthread_mutex_unlock(&lock);
    return (void *)(uintptr_t)ptr;
}

/* torch's free: void free(void* ptr, size_t size, int device, cudaStream_t stream). The physical memory
 * goes back to the driver; the virtual range is never handed out again. */
void lorafn_arena_free(void *ptr, size_t size, int device, void *stream) {
    (void)size;
    (void)device;
    (void)stream;
    pthread_mutex_lock(&lock);
    CUdeviceptr p = (CUdeviceptr)(uintptr_t)ptr;
    for (int i = 0; i < A.nlive; i++) {
        if (A.live[i].ptr != p) continue;
        ensure_ctx();
        A.cuCtxSynchronize(); /* nothing may still use the range when it is unmapped */
        A.cuMemUnmap(p, A.live[i].size);
        A.cuMemRelease(A.live[i].handle);
        A.mapped -= A.live[i].size;
        A.live[i] = A.live[--A.nlive];
        A.frees++;
        break;
    }
    pthread_mutex_unlock(&lock);
}

/* Backs [base + bump, base + top) with physical memory that torch never sees, and moves the bump to
 * `top`: a restoring process reserves what the capturing process's graphs used beyond the state it
 * rebuilds itself (their memory pool, cuBLAS workspaces), so no later allocation lands there. */
int lorafn_arena_reserve_until(unsigned long long top) {
    pthread_mutex_lock(&lock);
    int rc = -1;
    if (!A.ready) {
        snprintf(A.error, sizeof A.error, "arena: reserve_until before lorafn_arena_init");
    } else if (top < A.bump) {
        snprintf(A.error, sizeof A.error, "arena: reserve_until(%llu) below the bump offset %zu", top, A.bump);
    } else if (top == A.bump) {
        rc = 0;
    } else if ((top - A.bump) % A.granularity) {
        snprintf(A.error, sizeof A.error, "arena: reserve_until(%llu) leaves %llu bytes, not a multiple of %zu",
                 top, top - A.bump, A.granularity);
    } else {
        rc = map_next((size_t)(top - A.bump)) ? 0 : -1;
    }
    pthread_mutex_unlock(&lock);
    return rc;
}
