"""The C graph builder (lorafn/runtime/graph_build.c) on a machine without a GPU: compiled against Triton's
cuda.h (as at run time) and driven against a stand-in libcuda.so.1 compiled against the same header, it
must add every node of a NodeTable with its own fields, parameters (the bytes the archive holds),
dependencies and launch attributes, set only attributes that differ, report a refused attribute as a
warning, and name the node and call when the driver fails (destroying the half-built graph)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lorafn.runtime import graph_archive as ga

ROOT = Path(__file__).resolve().parents[3]

# What graph_build.c calls. Each node handle is its 1-based creation index, so dependencies map back.
FAKE_DRIVER = r"""
#include <cuda.h>
#include <stdio.h>
#include <string.h>
#include <stdint.h>
static char log_[1 << 16];
static int nodes = 0, fail_at = -1, graphs = 0, destroyed = 0;
static int sizes[256], nsizes = 0, at_size = 0;
static void out(const char *s) { strncat(log_, s, sizeof log_ - strlen(log_) - 1); }
static void deps(const CUgraphNode *d, size_t n) {
    char b[64];
    out(" deps");
    for (size_t i = 0; i < n; i++) { snprintf(b, sizeof b, " %d", (int)(uintptr_t)d[i] - 1); out(b); }
}
static CUresult made(CUgraphNode *h) {
    if (nodes == fail_at) return CUDA_ERROR_INVALID_VALUE;
    *h = (CUgraphNode)(uintptr_t)(++nodes);
    return CUDA_SUCCESS;
}
CUresult cuGraphCreate(CUgraph *g, unsigned f) { *g = (CUgraph)(uintptr_t)0x6000; graphs++; return 0; }
CUresult cuGraphDestroy(CUgraph g) { destroyed++; return 0; }
CUresult cuCtxGetCurrent(CUcontext *c) { *c = (CUcontext)(uintptr_t)0x77; return 0; }
CUresult cuGetErrorName(CUresult r, const char **s) { *s = "CUDA_ERROR_INVALID_VALUE"; return 0; }
static __thread CUcontext current = NULL;
CUresult cuCtxSetCurrent(CUcontext c) { current = c; return 0; }
CUresult cuGraphInstantiateWithFlags(CUgraphExec *e, CUgraph g, unsigned long long f) {
    if (current != (CUcontext)(uintptr_t)0x77) return CUDA_ERROR_INVALID_VALUE; /* no context made current */
    *e = (CUgraphExec)((uintptr_t)g + 1 + f);
    return 0;
}
CUresult cuGraphAddKernelNode_v2(CUgraphNode *h, CUgraph g, const CUgraphNode *d, size_t n,
                                 const CUDA_KERNEL_NODE_PARAMS_v2 *p) {
    char b[256];
    snprintf(b, sizeof b, "K func=%llx grid=%u,%u,%u block=%u,%u,%u shared=%u kern=%p extra=%p params=",
             (unsigned long long)(uintptr_t)p->func, p->gridDimX, p->gridDimY, p->gridDimZ, p->blockDimX,
             p->blockDimY, p->blockDimZ, p->sharedMemBytes, (void *)p->kern, (void *)p->extra);
    out(b);
    if (!p->kernelParams) out("NULL");
    for (int j = 0; p->kernelParams && at_size < nsizes && sizes[at_size] >= 0; j++) {
        const unsigned char *q = p->kernelParams[j];
        for (int k = 0; k < sizes[at_size]; k++) { snprintf(b, sizeof b, "%02x", q[k]); out(b); }
        out("|");
        at_size++;
    }
    at_size++; /* the -1 that ends this node's sizes */
    deps(d, n);
    out("\n");
    return made(h);
}
CUresult cuGraphAddMemsetNode(CUgraphNode *h, CUgraph g, const CUgraphNode *d, size_t n,
                              const CUDA_MEMSET_NODE_PARAMS *p, CUcontext c) {
    char b[256];
    snprintf(b, sizeof b, "M dst=%llx pitch=%zu value=%u es=%u w=%zu h=%zu ctx=%p",
             (unsigned long long)p->dst, p->pitch, p->value, p->elementSize, p->width, p->height, (void *)c);
    out(b); deps(d, n); out("\n");
    return made(h);
}
CUresult cuGraphAddMemcpyNode(CUgraphNode *h, CUgraph g, const CUgraphNode *d, size_t n,
                              const CUDA_MEMCPY3D *p, CUcontext c) {
    char b[256];
    snprintf(b, sizeof b, "C src=%llx/%d dst=%llx/%d width=%zu height=%zu depth=%zu srcPitch=%zu ctx=%p",
             (unsigned long long)p->srcDevice, (int)p->srcMemoryType, (unsigned long long)p->dstDevice,
             (int)p->dstMemoryType, p->WidthInBytes, p->Height, p->Depth, p->srcPitch, (void *)c);
    out(b); deps(d, n); out("\n");
    return made(h);
}
CUresult cuGraphAddEmptyNode(CUgraphNode *h, CUgraph g, const CUgraphNode *d, size_t n) {
    out("E"); deps(d, n); out("\n");
    return made(h);
}
CUresult cuGraphKernelNodeGetAttribute(CUgraphNode h, CUkernelNodeAttrID id, CUkernelNodeAttrValue *v) {
    memset(v, 0, sizeof *v);
    if (id == 7) v->priority = 3; /* the driver already has attribute 7 at the archived value */
    return 0;
}
CUresult cuGraphKernelNodeSetAttribute(CUgraphNode h, CUkernelNodeAttrID id, const CUkernelNodeAttrValue *v) {
    char b[128];
    if (id == 99) return CUDA_ERROR_INVALID_VALUE;
    snprintf(b, sizeof b, "A node=%d id=%d first=%d\n", (int)(uintptr_t)h - 1, (int)id, ((const int *)v)[0]);
    out(b);
    return 0;
}
const char *fake_log(void) { return log_; }
void fake_fail_at(int n) { fail_at = n; }
void fake_sizes(const int *s, int n) { memcpy(sizes, s, n * sizeof(int)); nsizes = n; at_size = 0; }
void fake_reset(void) { log_[0] = 0; nodes = 0; }
int fake_destroyed(void) { return destroyed; }
"""

DRIVE = r"""
import ctypes, json, sys
from pathlib import Path
fake = ctypes.CDLL(sys.argv[1] + "/libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
fake.fake_log.restype = ctypes.c_char_p
from lorafn.runtime import graph_archive as ga
from lorafn.runtime.graph_build import GraphBuilder, GraphBuildError
sys.path.insert(0, sys.argv[2])
from test_graph_build import table_under_test
table = table_under_test()
sizes = []
for i in range(len(table)):
    if table.arrays["kind"][i] == 0:
        p0, p1 = table.arrays["node_param"][i], table.arrays["node_param"][i + 1]
        pb = table.arrays["param_bound"]
        sizes += [int(pb[j + 1] - pb[j]) for j in range(p0, p1)]
        sizes.append(-1)
fake.fake_sizes((ctypes.c_int * len(sizes))(*sizes), len(sizes))
builder = GraphBuilder.load(Path(sys.argv[1]) / "cache")
out = {}
out["build"] = list(builder.build(table, [0xF00D, 0xBEEF]))
out["log"] = fake.fake_log().decode()
try:
    builder.build(table, [0xF00D])
except GraphBuildError as exc:
    out["too_few"] = str(exc)
fake.fake_reset()
fake.fake_fail_at(3)
fake.fake_sizes((ctypes.c_int * len(sizes))(*sizes), len(sizes))
try:
    builder.build(table, [0xF00D, 0xBEEF])
except GraphBuildError as exc:
    out["failed"] = str(exc)
out["destroyed"] = fake.fake_destroyed()
from concurrent.futures import ThreadPoolExecutor
with ThreadPoolExecutor(3) as pool:  # each thread has no context until the builder makes ctx current
    out["instantiated"] = list(pool.map(lambda g: builder.instantiate(0x77, g), [0x6000, 0x7000, 0x8000]))
try:
    builder.instantiate(0x55, 0x6000)
except GraphBuildError as exc:
    out["instantiate_failed"] = str(exc)
print(json.dumps(out))
"""


def table_under_test() -> ga.NodeTable:
    rms = ga.KernelNode(
        func=("module", "rms-1"),
        name="_rms",
        grid=(4, 2, 1),
        block=(128, 1, 1),
        shared=512,
        params=[(0x2000_0000_0000).to_bytes(8, "little"), b"\x05\x00\x00\x00", b""],
        attrs={7: (3).to_bytes(4, "little") + bytes(60), 8: (1).to_bytes(4, "little") + bytes(60)},
    )
    gemm = ga.KernelNode(
        func=("name", "nvjet_sm90"),
        name="nvjet_sm90",
        grid=(1, 1, 1),
        block=(384, 1, 1),
        shared=0,
        params=[bytes(range(16))],
        attrs={99: (2).to_bytes(4, "little") + bytes(60)},
    )
    noargs = ga.KernelNode(("module", "rms-1"), "_rms", (1, 1, 1), (32, 1, 1), 0, [])
    nodes = [
        rms,
        ga.MemsetNode(0x2000_0000_1000, 0, 7, 4, 16, 1),
        gemm,
        ga.MemcpyNode(
            {
                "WidthInBytes": 64,
                "Height": 1,
                "Depth": 1,
                "srcDevice": 0x2000_0000_2000,
                "dstDevice": 0x2000_0000_3000,
                "srcMemoryType": 2,
                "dstMemoryType": 2,
            }
        ),
        ga.EmptyNode(),
        noargs,
    ]
    return ga.NodeTable.from_nodes(nodes, [[], [0], [0, 1], [2], [3, 1], [4]])


@pytest.fixture(scope="module")
def build_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    cc = shutil.which("cc") or shutil.which("gcc")
    triton = pytest.importorskip("triton", reason="the builder compiles against Triton's cuda.h")
    include = Path(triton.__file__).parent / "backends" / "nvidia" / "include"
    if cc is None or not (include / "cuda.h").exists():
        pytest.skip("no C compiler or no cuda.h in Triton")
    d = tmp_path_factory.mktemp("graph_build")
    (d / "fake.c").write_text(FAKE_DRIVER)
    subprocess.run(
        [
            cc,
            "-shared",
            "-fPIC",
            f"-I{include}",
            "-Wl,-soname,libcuda.so.1",
            "-o",
            str(d / "libcuda.so.1"),
            str(d / "fake.c"),
        ],
        check=True,
    )
    # the real source compiles without warnings against the header
    subprocess.run(
        [
            cc,
            "-O2",
            "-Wall",
            "-Werror",
            "-shared",
            "-fPIC",
            f"-I{include}",
            "-o",
            str(d / "strict.so"),
            str(ROOT / "lorafn" / "runtime" / "graph_build.c"),
            "-ldl",
        ],
        check=True,
    )
    env = dict(os.environ, LORAFN_CUDA_INCLUDE=str(include), PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, "-c", DRIVE, str(d), str(Path(__file__).parent)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_every_node_is_added_with_its_fields_params_and_dependencies(build_run: dict) -> None:
    graph, refused, warning = build_run["build"]
    assert graph == 0x6000
    lines = build_run["log"].splitlines()
    assert lines[0] == (
        "K func=f00d grid=4,2,1 block=128,1,1 shared=512 kern=(nil) extra=(nil) "
        "params=0000000000200000|05000000|| deps"
    )
    # attribute 7 already had the archived value (not set again); 8 differed and was set
    assert lines[1] == "A node=0 id=8 first=1"
    assert lines[2] == "M dst=200000001000 pitch=0 value=7 es=4 w=16 h=1 ctx=0x77 deps 0"
    assert lines[3] == (
        "K func=beef grid=1,1,1 block=384,1,1 shared=0 kern=(nil) extra=(nil) "
        "params=000102030405060708090a0b0c0d0e0f| deps 0 1"
    )
    assert lines[4] == (
        "C src=200000002000/2 dst=200000003000/2 width=64 height=1 depth=1 srcPitch=0 ctx=0x77 deps 2"
    )
    assert lines[5] == "E deps 1 3"
    assert (
        lines[6] == "K func=f00d grid=1,1,1 block=32,1,1 shared=0 kern=(nil) extra=(nil) params=NULL deps 4"
    )
    assert len(lines) == 7
    # attribute 99 was refused by the driver: a warning, not a failure
    assert refused == 1 and "node 2: cuGraphKernelNodeSetAttribute(99) failed" in warning


def test_a_driver_failure_names_the_node_and_drops_the_graph(build_run: dict) -> None:
    assert "1 functions for 2 indices" in build_run["too_few"]
    assert build_run["failed"] == (
        "node 3: cuGraphAddMemcpyNode failed: CUDA_ERROR_INVALID_VALUE (CUresult 1)"
    )
    assert build_run["destroyed"] == 1


def test_instantiation_makes_the_context_current_in_any_thread(build_run: dict) -> None:
    assert build_run["instantiated"] == [0x6001, 0x7001, 0x8001]
    assert build_run["instantiate_failed"] == (
        "cuGraphInstantiateWithFlags failed: CUDA_ERROR_INVALID_VALUE (CUresult 1)"
    )


def test_a_table_with_a_bad_index_is_refused_before_the_builder() -> None:
    table = table_under_test()
    table.arrays["dep"] = table.arrays["dep"].copy()
    table.arrays["dep"][-1] = 5  # node 5 depending on itself
    with pytest.raises(ValueError, match="not in topological order"):
        table.validate()
    table = table_under_test()
    table.arrays["aux"] = table.arrays["aux"].copy()
    table.arrays["aux"][2] = 2  # function index 2 of 2
    with pytest.raises(ValueError, match="a kernel node names function 2 of 2"):
        table.validate()
    with pytest.raises(ValueError, match=r"deps\[1\]: \[1\] are not earlier nodes"):
        ga.NodeTable.from_nodes([ga.EmptyNode(), ga.EmptyNode()], [[], [1]])


def test_a_table_round_trips_to_the_same_nodes() -> None:
    table = table_under_test()
    again = ga.NodeTable.from_nodes(table.nodes(), table.deps())
    assert again == table
    assert table.deps() == [[], [0], [0, 1], [2], [1, 3], [4]]
    assert table.library_names() == {"nvjet_sm90"}
    assert table.nodes()[3].fields["srcDevice"] == 0x2000_0000_2000
