"""The arena's C allocator (lorafn/runtime/arena_alloc.c) on a machine without a GPU: compiled with the system
C compiler against a stand-in libcuda.so.1 (the few VMM entry points it dlopens, each recording or failing
on demand), it must hand out addresses as a pure function of the allocation sequence, never reuse freed
ranges, refuse a reservation that the driver puts elsewhere, and name every failure."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ARENA_C = Path(__file__).resolve().parents[3] / "lorafn" / "runtime" / "arena_alloc.c"

# Only what arena_alloc.c calls. cuMemAddressReserve honours the address unless told not to, as the
# H100 driver did for whole 2 GiB units (docs/backbone_server.md).
FAKE_DRIVER = r"""
#include <stddef.h>
typedef unsigned long long u64;
static int elsewhere = 0, fail_create = 0;
static void *cur = 0;
static u64 next_handle = 0;
int cuInit(unsigned f) { return 0; }
int cuDeviceGet(int *d, int o) { *d = o; return 0; }
int cuDevicePrimaryCtxRetain(void **c, int d) { *c = (void *)1; return 0; }
int cuCtxGetCurrent(void **c) { *c = cur; return 0; }
int cuCtxSetCurrent(void *c) { cur = c; return 0; }
int cuCtxSynchronize(void) { return 0; }
int cuGetErrorName(int r, const char **s) { *s = "CUDA_ERROR_OUT_OF_MEMORY"; return 0; }
int cuMemGetAllocationGranularity(size_t *g, const void *p, int o) { *g = 2u << 20; return 0; }
int cuMemCreate(u64 *h, size_t s, const void *p, u64 f) {
    if (fail_create) return 2;
    *h = ++next_handle;
    return 0;
}
int cuMemRelease(u64 h) { return 0; }
int cuMemAddressReserve(u64 *p, size_t s, size_t a, u64 addr, u64 f) {
    *p = elsewhere ? 0x7f0000000000ULL : addr;
    return 0;
}
int cuMemAddressFree(u64 p, size_t s) { return 0; }
int cuMemMap(u64 p, size_t s, size_t o, u64 h, u64 f) { return 0; }
int cuMemUnmap(u64 p, size_t s) { return 0; }
int cuMemSetAccess(u64 p, size_t s, const void *d, size_t n) { return 0; }
void fake_elsewhere(int v) { elsewhere = v; }
void fake_fail_create(int v) { fail_create = v; }
"""

DRIVE = r"""
import ctypes, json, sys
fake = ctypes.CDLL(sys.argv[1] + "/libcuda.so.1", mode=ctypes.RTLD_GLOBAL)
lib = ctypes.CDLL(sys.argv[1] + "/libarena.so")
lib.lorafn_arena_error.restype = ctypes.c_char_p
for n in ("base", "bump", "mapped", "reserved", "allocations", "frees"):
    getattr(lib, "lorafn_arena_" + n).restype = ctypes.c_ulonglong
lib.lorafn_arena_alloc.restype = ctypes.c_void_p
lib.lorafn_arena_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
lib.lorafn_arena_free.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
lib.lorafn_arena_init.argtypes = [ctypes.c_int, ctypes.c_ulonglong, ctypes.c_ulonglong]
lib.lorafn_arena_reserve_until.argtypes = [ctypes.c_ulonglong]
err = lambda: lib.lorafn_arena_error().decode()
out = {}
out["before_init"] = [lib.lorafn_arena_alloc(1, 0, None), err()]
fake.fake_elsewhere(1)
out["elsewhere"] = [lib.lorafn_arena_init(0, 0x200000000000, 1 << 30), err()]
fake.fake_elsewhere(0)
out["init"] = [lib.lorafn_arena_init(0, 0x200000000000, 3 << 30)]
out["init"] += [lib.lorafn_arena_base(), lib.lorafn_arena_reserved()]
a = lib.lorafn_arena_alloc(1, 0, None)
b = lib.lorafn_arena_alloc(20 << 20, 0, None)
c = lib.lorafn_arena_alloc(3 << 20, 0, None)
out["allocs"] = [a, b, c]
out["other_device"] = [lib.lorafn_arena_alloc(1, 1, None), err()]
lib.lorafn_arena_free(b, 20 << 20, 0, None)
out["after_free"] = [lib.lorafn_arena_mapped(), lib.lorafn_arena_bump(), lib.lorafn_arena_alloc(1, 0, None)]
out["below"] = [lib.lorafn_arena_reserve_until(1 << 20), err()]
out["unaligned"] = [lib.lorafn_arena_reserve_until((28 << 20) + 4096), err()]
out["reserve"] = [lib.lorafn_arena_reserve_until(100 << 20), lib.lorafn_arena_bump()]
out["full"] = [lib.lorafn_arena_alloc(4 << 30, 0, None), err()]
fake.fake_fail_create(1)
out["driver_error"] = [lib.lorafn_arena_alloc(1, 0, None), err(), lib.lorafn_arena_bump()]
off, size, log, i = ctypes.c_ulonglong(), ctypes.c_ulonglong(), [], 0
while lib.lorafn_arena_log(ctypes.c_ulonglong(i), ctypes.byref(off), ctypes.byref(size)) == 0:
    log.append([off.value, size.value])
    i += 1
out["log"] = log
out["counts"] = [lib.lorafn_arena_allocations(), lib.lorafn_arena_frees()]
out["again"] = [lib.lorafn_arena_init(0, 0x200000000000, 1 << 30), err()]
print(json.dumps(out))
"""

MIB = 1 << 20
BASE = 0x2000_0000_0000


@pytest.fixture(scope="module")
def arena_run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    d = tmp_path_factory.mktemp("arena")
    (d / "fake.c").write_text(FAKE_DRIVER)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "libcuda.so.1"), str(d / "fake.c")], check=True)
    subprocess.run(
        [
            cc,
            "-O2",
            "-Wall",
            "-Werror",
            "-shared",
            "-fPIC",
            "-o",
            str(d / "libarena.so"),
            str(ARENA_C),
            "-ldl",
            "-lpthread",
        ],
        check=True,
    )
    # dlopen("libcuda.so.1") must find the stand-in: LD_LIBRARY_PATH is read at process start
    proc = subprocess.run(
        [sys.executable, "-c", DRIVE, str(d)],
        env={"LD_LIBRARY_PATH": str(d), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
    )
    import json

    return json.loads(proc.stdout)


def test_addresses_are_a_bump_from_the_fixed_base(arena_run: dict) -> None:
    assert arena_run["init"] == [0, BASE, 4 << 30]  # 3 GiB asked: whole 2 GiB units reserved
    assert arena_run["allocs"] == [BASE, BASE + 2 * MIB, BASE + 22 * MIB]  # rounded to the granularity
    mapped, bump, next_ptr = arena_run["after_free"]
    assert (mapped, bump) == (6 * MIB, 26 * MIB)  # the free gave its memory back, not its range
    assert next_ptr == BASE + 26 * MIB
    assert arena_run["reserve"] == [0, 100 * MIB]
    assert arena_run["log"] == [
        [0, 2 * MIB],
        [2 * MIB, 20 * MIB],
        [22 * MIB, 4 * MIB],
        [26 * MIB, 2 * MIB],
        [28 * MIB, 72 * MIB],
    ]
    assert arena_run["counts"] == [5, 1]


def test_every_failure_is_refused_and_named(arena_run: dict) -> None:
    assert arena_run["before_init"] == [None, "arena: alloc before lorafn_arena_init"]
    assert arena_run["elsewhere"][0] == -1
    assert "returned 0x7f0000000000, not the fixed address 0x200000000000" in arena_run["elsewhere"][1]
    assert arena_run["other_device"] == [None, "arena: alloc on device 1, the arena is on device 0"]
    assert arena_run["below"][0] == -1 and "below the bump offset" in arena_run["below"][1]
    assert arena_run["unaligned"][0] == -1 and "not a multiple of 2097152" in arena_run["unaligned"][1]
    assert arena_run["full"][0] is None and arena_run["full"][1].startswith("arena full: 4294967296 bytes")
    ptr, message, bump = arena_run["driver_error"]
    assert (
        ptr is None and message == "cuMemCreate(2097152 bytes) failed: CUDA_ERROR_OUT_OF_MEMORY (CUresult 2)"
    )
    assert bump == 100 * MIB  # a failed allocation moves nothing
    assert arena_run["again"] == [-1, "arena already initialized at 0x200000000000 (one arena per process)"]
