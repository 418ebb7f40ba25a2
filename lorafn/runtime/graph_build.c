/*
 * Rebuild one archived decode graph (issue 11 item 2) from its NodeTable (lorafn/runtime/graph_archive.py)
 * in one call: cuGraphCreate, then every node in topological order (kernel, memset, memcpy, empty) with
 * its dependencies and launch attributes. graph_restore.py compiles this file at run time (as arena.py
 * does arena_alloc.c) against the cuda.h that Triton ships for its own launchers, so the driver's structs
 * are the header's, not re-declared here; libcuda.so.1 is dlopen'ed (the process's, already loaded by
 * torch). Why C: through cuda-bindings each node cost ~18 us of Python (struct fields, ctypes parameter
 * buffers, an attribute query per launch attribute): 75 ms for the 7B's 4300 nodes; here it is the
 * driver's own cost.
 *
 * The caller (graph_restore.py) has validated the table (graph_archive.NodeTable.validate: every index
 * in range, every dependency earlier) and resolved each function index to a CUfunction.
 */
#include <cuda.h>
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    int64_t n;                   /* nodes */
    const uint8_t *kind;         /* [n] 0 kernel, 1 memset, 2 memcpy, 3 empty */
    const int32_t *aux;          /* [n] kernel: function index; memset/memcpy: row of its table */
    const uint32_t *dims;        /* [n][7] grid x y z, block x y z, dynamic shared bytes */
    const int64_t *node_param;   /* [n + 1] */
    const int64_t *param_bound;  /* [P + 1] */
    const uint8_t *param_blob;
    const int64_t *node_attr;    /* [n + 1] */
    const int32_t *attr_id;      /* [A] */
    const uint8_t *attr_value;   /* [A][64] */
    const uint64_t *memset_rows; /* [M][6] dst, pitch, value, element size, width, height */
    const uint64_t *memcpy_rows; /* [C][19] graph_archive.MEMCPY_FIELDS order */
    const int64_t *node_dep;     /* [n + 1] */
    const int32_t *dep;          /* [D] */
    const uint64_t *funcs;       /* CUfunction per function index */
    int64_t nfuncs;
} lorafn_graph_spec;

/* graph_restore.py checks these against its ctypes mirror before the first call */
int64_t lorafn_graph_spec_size(void) { return (int64_t)sizeof(lorafn_graph_spec); }
int64_t lorafn_graph_attr_value_size(void) { return (int64_t)sizeof(CUlaunchAttributeValue); }

typedef CUresult (*fn_cuGraphCreate)(CUgraph *, unsigned int);
typedef CUresult (*fn_cuGraphDestroy)(CUgraph);
typedef CUresult (*fn_cuGraphAddKernelNode)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t,
                                            const CUDA_KERNEL_NODE_PARAMS_v2 *);
typedef CUresult (*fn_cuGraphAddMemsetNode)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t,
                                            const CUDA_MEMSET_NODE_PARAMS *, CUcontext);
typedef CUresult (*fn_cuGraphAddMemcpyNode)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t,
                                            const CUDA_MEMCPY3D *, CUcontext);
typedef CUresult (*fn_cuGraphAddEmptyNode)(CUgraphNode *, CUgraph, const CUgraphNode *, size_t);
typedef CUresult (*fn_cuGraphKernelNodeGetAttribute)(CUgraphNode, CUkernelNodeAttrID, CUkernelNodeAttrValue *);
typedef CUresult (*fn_cuGraphKernelNodeSetAttribute)(CUgraphNode, CUkernelNodeAttrID,
                                                     const CUkernelNodeAttrValue *);
typedef CUresult (*fn_cuCtxGetCurrent)(CUcontext *);
typedef CUresult (*fn_cuCtxSetCurrent)(CUcontext);
typedef CUresult (*fn_cuGraphInstantiateWithFlags)(CUgraphExec *, CUgraph, unsigned long long);
typedef CUresult (*fn_cuGetErrorName)(CUresult, const char **);

static struct {
    void *lib;
    fn_cuGraphCreate create;
    fn_cuGraphDestroy destroy;
    fn_cuGraphAddKernelNode kernel;
    fn_cuGraphAddMemsetNode memset;
    fn_cuGraphAddMemcpyNode memcpy;
    fn_cuGraphAddEmptyNode empty;
    fn_cuGraphKernelNodeGetAttribute get_attr;
    fn_cuGraphKernelNodeSetAttribute set_attr;
    fn_cuCtxGetCurrent ctx;
    fn_cuCtxSetCurrent set_ctx;
    fn_cuGraphInstantiateWithFlags instantiate;
    fn_cuGetErrorName error_name;
} D;

/* per thread: graph_restore.py may instantiate several graphs at once from a thread pool */
static __thread char error[512];
static __thread char warning[512]; /* the first launch attribute that could not be set (not fatal) */

const char *lorafn_graph_error(void) { return error; }
const char *lorafn_graph_warning(void) { return warning; }

static int cu_failed(CUresult r, const char *what, int64_t node) {
    const char *name = NULL;
    if (D.error_name) D.error_name(r, &name);
    if (node >= 0)
        snprintf(error, sizeof error, "node %lld: %s failed: %s (CUresult %d)", (long long)node, what,
                 name ? name : "CUDA_ERROR_?", (int)r);
    else
        snprintf(error, sizeof error, "%s failed: %s (CUresult %d)", what, name ? name : "CUDA_ERROR_?", (int)r);
    return -1;
}

#define LOAD(field, symbol)                                                                  \
    do {                                                                                     \
        *(void **)&D.field = dlsym(lib, symbol);                                           \
        if (!D.field) {                                                                      \
            snprintf(error, sizeof error, "libcuda.so.1 has no symbol %s", symbol);          \
            return -1;                                                                       \
        }                                                                                    \
    } while (0)

static pthread_mutex_t load_lock = PTHREAD_MUTEX_INITIALIZER;

static int load_driver_locked(void) {
    if (D.lib) return 0;
    void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        const char *e = dlerror();
        snprintf(error, sizeof error, "cannot load libcuda.so.1: %s", e ? e : "unknown error");
        return -1;
    }
    LOAD(create, "cuGraphCreate");
    LOAD(destroy, "cuGraphDestroy");
    LOAD(kernel, "cuGraphAddKernelNode_v2"); /* CUDA_KERNEL_NODE_PARAMS_v2: func, or kern + ctx */
    LOAD(memset, "cuGraphAddMemsetNode");
    LOAD(memcpy, "cuGraphAddMemcpyNode");
    LOAD(empty, "cuGraphAddEmptyNode");
    LOAD(get_attr, "cuGraphKernelNodeGetAttribute");
    LOAD(set_attr, "cuGraphKernelNodeSetAttribute");
    LOAD(ctx, "cuCtxGetCurrent");
    LOAD(set_ctx, "cuCtxSetCurrent");
    LOAD(instantiate, "cuGraphInstantiateWithFlags");
    LOAD(error_name, "cuGetErrorName");
    D.lib = lib; /* loaded: only once every symbol is there */
    return 0;
}

static int load_driver(void) {
    pthread_mutex_lock(&load_lock);
    int rc = load_driver_locked();
    pthread_mutex_unlock(&load_lock);
    return rc;
}

/* Builds the graph into *out (a CUgraph handle); *attr_failures counts launch attributes the driver
 * refused (the first one's message is lorafn_graph_warning()). 0, or -1 with lorafn_graph_error(). */
int lorafn_graph_build(const lorafn_graph_spec *s, uint64_t *out, int64_t *attr_failures) {
    error[0] = 0;
    warning[0] = 0;
    *out = 0;
    *attr_failures = 0;
    if (load_driver() != 0) return -1;
    CUcontext ctx = NULL;
    CUresult r = D.ctx(&ctx);
    if (r != CUDA_SUCCESS) return cu_failed(r, "cuCtxGetCurrent", -1);
    if (!ctx) {
        snprintf(error, sizeof error, "no current CUDA context");
        return -1;
    }
    int64_t nparams = s->node_param[s->n];
    int64_t ndeps = s->node_dep[s->n];
    CUgraphNode *made = calloc((size_t)(s->n ? s->n : 1), sizeof *made);
    void **ptrs = calloc((size_t)(nparams ? nparams : 1), sizeof *ptrs);
    CUgraphNode *deps = calloc((size_t)(ndeps ? ndeps : 1), sizeof *deps);
    CUgraph graph = NULL;
    int rc = -1;
    if (!made || !ptrs || !deps) {
        snprintf(error, sizeof error, "out of host memory for %lld nodes", (long long)s->n);
        goto done;
    }
    for (int64_t j = 0; j < nparams; j++) ptrs[j] = (void *)(s->param_blob + s->param_bound[j]);
    for (int64_t k = 0; k < ndeps; k++) deps[k] = NULL; /* filled as their nodes are made */
    r = D.create(&graph, 0);
    if (r != CUDA_SUCCESS) {
        cu_failed(r, "cuGraphCreate", -1);
        graph = NULL;
        goto done;
    }
    for (int64_t i = 0; i < s->n; i++) {
        int64_t d0 = s->node_dep[i], d1 = s->node_dep[i + 1];
        for (int64_t k = d0; k < d1; k++) deps[k] = made[s->dep[k]];
        const CUgraphNode *di = d1 > d0 ? deps + d0 : NULL;
        size_t nd = (size_t)(d1 - d0);
        int32_t x = s->aux[i];
        switch (s->kind[i]) {
        case 0: {
            if (x < 0 || x >= s->nfuncs || !s->funcs[x]) {
                snprintf(error, sizeof error, "node %lld: no function for index %d", (long long)i, x);
                goto done;
            }
            const uint32_t *d = s->dims + 7 * i;
            CUDA_KERNEL_NODE_PARAMS_v2 p;
            memset(&p, 0, sizeof p);
            p.func = (CUfunction)(uintptr_t)s->funcs[x];
            p.gridDimX = d[0];
            p.gridDimY = d[1];
            p.gridDimZ = d[2];
            p.blockDimX = d[3];
            p.blockDimY = d[4];
            p.blockDimZ = d[5];
            p.sharedMemBytes = d[6];
            p.kernelParams = s->node_param[i + 1] > s->node_param[i] ? ptrs + s->node_param[i] : NULL;
            p.extra = NULL;
            r = D.kernel(&made[i], graph, di, nd, &p);
            if (r != CUDA_SUCCESS) {
                cu_failed(r, "cuGraphAddKernelNode", i);
                goto done;
            }
            for (int64_t a = s->node_attr[i]; a < s->node_attr[i + 1]; a++) {
                CUkernelNodeAttrID id = (CUkernelNodeAttrID)s->attr_id[a];
                CUkernelNodeAttrValue want, cur;
                memcpy(&want, s->attr_value + 64 * a, sizeof want);
                memset(&cur, 0, sizeof cur);
                /* set only what differs: the driver refuses some attributes it reports (as the
                 * cuda-bindings path did, a refusal is a warning: the comparisons show its effect) */
                if (D.get_attr(made[i], id, &cur) == CUDA_SUCCESS && memcmp(&cur, &want, sizeof want) == 0)
                    continue;
                r = D.set_attr(made[i], id, &want);
                if (r != CUDA_SUCCESS) {
                    const char *name = NULL;
                    if (D.error_name) D.error_name(r, &name);
                    if (*attr_failures == 0)
                        snprintf(warning, sizeof warning,
                                 "node %lld: cuGraphKernelNodeSetAttribute(%d) failed: %s", (long long)i,
                                 (int)id, name ? name : "CUDA_ERROR_?");
                    (*attr_failures)++;
                }
            }
            break;
        }
        case 1: {
            const uint64_t *m = s->memset_rows + 6 * (int64_t)x;
            CUDA_MEMSET_NODE_PARAMS p;
            memset(&p, 0, sizeof p);
            p.dst = (CUdeviceptr)m[0];
            p.pitch = (size_t)m[1];
            p.value = (unsigned int)m[2];
            p.elementSize = (unsigned int)m[3];
            p.width = (size_t)m[4];
            p.height = (size_t)m[5];
            r = D.memset(&made[i], graph, di, nd, &p, ctx);
            if (r != CUDA_SUCCESS) {
                cu_failed(r, "cuGraphAddMemsetNode", i);
                goto done;
            }
            break;
        }
        case 2: {
            const uint64_t *c = s->memcpy_rows + 19 * (int64_t)x;
            CUDA_MEMCPY3D p;
            memset(&p, 0, sizeof p);
            p.srcXInBytes = (size_t)c[0];
            p.srcY = (size_t)c[1];
            p.srcZ = (size_t)c[2];
            p.srcLOD = (size_t)c[3];
            p.srcPitch = (size_t)c[4];
            p.srcHeight = (size_t)c[5];
            p.dstXInBytes = (size_t)c[6];
            p.dstY = (size_t)c[7];
            p.dstZ = (size_t)c[8];
            p.dstLOD = (size_t)c[9];
            p.dstPitch = (size_t)c[10];
            p.dstHeight = (size_t)c[11];
            p.WidthInBytes = (size_t)c[12];
            p.Height = (size_t)c[13];
            p.Depth = (size_t)c[14];
            p.srcMemoryType = (CUmemorytype)c[15];
            p.srcDevice = (CUdeviceptr)c[16];
            p.dstMemoryType = (CUmemorytype)c[17];
            p.dstDevice = (CUdeviceptr)c[18];
            r = D.memcpy(&made[i], graph, di, nd, &p, ctx);
            if (r != CUDA_SUCCESS) {
                cu_failed(r, "cuGraphAddMemcpyNode", i);
                goto done;
            }
            break;
        }
        case 3:
            r = D.empty(&made[i], graph, di, nd);
            if (r != CUDA_SUCCESS) {
                cu_failed(r, "cuGraphAddEmptyNode", i);
                goto done;
            }
            break;
        default:
            snprintf(error, sizeof error, "node %lld: kind %d is not 0..3", (long long)i, (int)s->kind[i]);
            goto done;
        }
    }
    *out = (uint64_t)(uintptr_t)graph;
    graph = NULL;
    rc = 0;
done:
    if (graph) D.destroy(graph);
    free(made);
    free(ptrs);
    free(deps);
    return rc;
}

/* cuGraphInstantiateWithFlags(flags 0) of `graph` in context `ctx` (made current in the calling thread: a
 * thread of graph_restore.py's pool has none), into *exec_out. 0, or -1 with lorafn_graph_error(). */
int lorafn_graph_instantiate(uint64_t ctx, uint64_t graph, uint64_t *exec_out) {
    error[0] = 0;
    *exec_out = 0;
    if (load_driver() != 0) return -1;
    CUresult r = D.set_ctx((CUcontext)(uintptr_t)ctx);
    if (r != CUDA_SUCCESS) return cu_failed(r, "cuCtxSetCurrent", -1);
    CUgraphExec exec = NULL;
    r = D.instantiate(&exec, (CUgraph)(uintptr_t)graph, 0);
    if (r != CUDA_SUCCESS) return cu_failed(r, "cuGraphInstantiateWithFlags", -1);
    *exec_out = (uint64_t)(uintptr_t)exec;
    return 0;
}
