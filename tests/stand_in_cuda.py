"""A stand-in CUDA driver for CPU tests: a small shared library with the entry points moe_ep's
native library opens from libcuda (csrc/proxy/cuda_mem.cc), by cuda.h's signatures. Point
``MOE_EP_CUDA_LIB`` at what ``fake_cuda_lib`` builds.

- Memory: the range ``FAKE_CUDA_DEVICE="ADDR:LEN"`` is "device memory"; cuMemGetHandleForAddressRange
  logs its arguments to ``FAKE_CUDA_LOG`` and returns a memfd (not a dma-buf, so a NIC refuses
  it), or fails with CUDA_ERROR_NOT_SUPPORTED (801) under ``FAKE_CUDA_DMABUF_FAIL``.
- Launches: cuLaunchKernel counts its calls (``fake_cuda_launches``), keeps its arguments and the
  bytes of the first ``fake_cuda_expect_params(n)`` parameters (``fake_cuda_last_launch`` fills a
  ``FakeLaunch``) and returns the code ``fake_cuda_set_launch_result`` set (0 at first).
- Graphs: chained kernel nodes; a graph launch runs its nodes through that cuLaunchKernel with the
  parameter bytes its last cuGraphExecKernelNodeSetParams copied (``fake_cuda_graph_launches``,
  ``fake_cuda_graph_node``); cuStreamIsCapturing answers what ``fake_cuda_set_capturing`` set
  (0, no capture, at first) for every stream.
"""
from __future__ import annotations

import ctypes
import os
import subprocess

_SOURCE = r"""
#include "cuda_mem.h"
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
extern "C" {
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
static int in_range(CUdeviceptr p) {
  const char* r = getenv("FAKE_CUDA_DEVICE");
  unsigned long long lo, n;
  return r && sscanf(r, "%llu:%llu", &lo, &n) == 2 && p >= lo && p < lo + n;
}
CUresult cuPointerGetAttribute(void* data, int attribute, CUdeviceptr ptr) {
  if (attribute != 2 || !in_range(ptr)) return 1;  /* CUDA_ERROR_INVALID_VALUE */
  *(unsigned*)data = 2;                            /* CU_MEMORYTYPE_DEVICE */
  return 0;
}
CUresult cuMemGetHandleForAddressRange(void* handle, CUdeviceptr dptr, size_t size, int type, unsigned long long flags) {
  const char* log = getenv("FAKE_CUDA_LOG");
  if (log) { FILE* f = fopen(log, "a"); fprintf(f, "%llu %zu %d %llu\n", dptr, size, type, flags); fclose(f); }
  if (getenv("FAKE_CUDA_DMABUF_FAIL")) return 801;
  int fd = memfd_create("fake-dmabuf", 0);
  if (fd < 0) return 999;
  *(int*)handle = fd;
  return 0;
}
CUresult cuGetErrorString(CUresult e, const char** s) {
  *s = e == 801 ? "operation not supported" : e == 700 ? "an illegal memory access was encountered" : "unknown error";
  return 0;
}
struct FakeLaunch {
  unsigned long long function, stream;
  unsigned grid[3], block[3], shared, pad;
  unsigned char params[512];  /* from kernelParams[0] to 8 bytes past kernelParams[nparams - 1] */
};
static FakeLaunch g_last;
static long g_calls = 0;
static CUresult g_result = 0;
/* nparams is not an argument of cuLaunchKernel, so the test says it: the kernelParams of a moe_ep
   plan point into one block of storage, in order, with 8 bytes to spare at its end, so the bytes
   from the first to 8 past the last hold every parameter. */
static unsigned long long g_nparams = 0;
void fake_cuda_expect_params(unsigned long long n) { g_nparams = n; }
void fake_cuda_set_launch_result(CUresult rc) { g_result = rc; }
long fake_cuda_launches(void) { return g_calls; }
void fake_cuda_last_launch(FakeLaunch* out) { *out = g_last; }
CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned shared, void* stream, void** params, void** extra) {
  ++g_calls;
  memset(&g_last, 0, sizeof g_last);
  g_last.function = (unsigned long long)f, g_last.stream = (unsigned long long)stream;
  g_last.grid[0] = gx, g_last.grid[1] = gy, g_last.grid[2] = gz;
  g_last.block[0] = bx, g_last.block[1] = by, g_last.block[2] = bz, g_last.shared = shared;
  if (g_nparams && params) {
    size_t n = (size_t)((unsigned char*)params[g_nparams - 1] - (unsigned char*)params[0]) + 8;
    memcpy(g_last.params, params[0], n < sizeof g_last.params ? n : sizeof g_last.params);
  }
  (void)extra;
  return g_result;
}
/* CUDA graphs of kernel nodes (cuda.h's CUDA_KERNEL_NODE_PARAMS_v2), chained one after another:
   cuGraphExecKernelNodeSetParams_v2 copies the parameter bytes then, as the driver does;
   cuGraphLaunch counts a graph launch and "launches" each node through cuLaunchKernel above, so
   fake_cuda_launches counts its kernels and fake_cuda_last_launch shows its last node;
   fake_cuda_graph_node(i) what node i launched with last. */
typedef moe_ep::CuKernelNodeParams FakeNode;  /* the layout the library hands the driver */
struct FakeGraph {
  int n;
  FakeNode nodes[8];
  unsigned char bytes[8][512];
  void* ptrs[8][64];
};
static long g_graph_launches = 0;
static FakeLaunch g_nodes_launched[8];
long fake_cuda_graph_launches(void) { return g_graph_launches; }
void fake_cuda_graph_node(int i, FakeLaunch* out) { *out = g_nodes_launched[i]; }
CUresult cuGraphCreate(void** graph, unsigned flags) {
  (void)flags;
  *graph = calloc(1, sizeof(FakeGraph));
  return 0;
}
CUresult cuGraphAddKernelNode_v2(void** node, void* graph, void* const* deps, size_t ndeps, const FakeNode* p) {
  FakeGraph* g = (FakeGraph*)graph;
  if (g->n >= 8 || ndeps != (size_t)(g->n ? 1 : 0) || (g->n && deps[0] != (void*)(long)g->n)) return 1;
  g->nodes[g->n++] = *p;
  *node = (void*)(long)g->n;  /* node i + 1 */
  return 0;
}
CUresult cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long flags) {
  (void)flags;
  FakeGraph* e = (FakeGraph*)malloc(sizeof(FakeGraph));
  *e = *(FakeGraph*)graph;
  *exec = e;
  return 0;
}
CUresult cuGraphExecKernelNodeSetParams_v2(void* exec, void* node, const FakeNode* p) {
  FakeGraph* e = (FakeGraph*)exec;
  long i = (long)node - 1;
  if (i < 0 || i >= e->n || p->func != e->nodes[i].func) return 1;
  e->nodes[i] = *p;
  if (g_nparams && p->params && g_nparams <= 64) {  /* the values now, pointed at from the copy */
    size_t n = (size_t)((unsigned char*)p->params[g_nparams - 1] - (unsigned char*)p->params[0]) + 8;
    memcpy(e->bytes[i], p->params[0], n < 512 ? n : 512);
    for (unsigned long long k = 0; k < g_nparams; ++k)
      e->ptrs[i][k] = e->bytes[i] + ((unsigned char*)p->params[k] - (unsigned char*)p->params[0]);
    e->nodes[i].params = e->ptrs[i];
  }
  return 0;
}
CUresult cuGraphLaunch(void* exec, void* stream) {
  FakeGraph* e = (FakeGraph*)exec;
  ++g_graph_launches;
  for (int i = 0; i < e->n; ++i) {
    FakeNode* d = &e->nodes[i];
    CUresult rc = cuLaunchKernel(d->func, d->gx, d->gy, d->gz, d->bx, d->by, d->bz, d->shared, stream, d->params, d->extra);
    g_nodes_launched[i] = g_last;
    if (rc) return rc;
  }
  return 0;
}
/* Stream capture as fake_cuda_set_capturing set it (0: none; 1: active), for every stream. */
static int g_capturing = 0;
void fake_cuda_set_capturing(int status) { g_capturing = status; }
CUresult cuStreamIsCapturing(void* stream, int* status) {
  (void)stream;
  *status = g_capturing;
  return 0;
}
CUresult cuGraphExecDestroy(void* exec) { free(exec); return 0; }
CUresult cuGraphDestroy(void* graph) { free(graph); return 0; }
}
"""


class FakeLaunch(ctypes.Structure):
    """What the stand-in's cuLaunchKernel got last."""
    _fields_ = [("function", ctypes.c_uint64), ("stream", ctypes.c_uint64), ("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                ("pad", ctypes.c_uint), ("params", ctypes.c_ubyte * 512)]


def fake_cuda_lib(tmp_dir) -> str:
    """Builds the stand-in CUDA driver into tmp_dir; returns its path."""
    src, out = os.path.join(str(tmp_dir), "fake_cuda.cc"), os.path.join(str(tmp_dir), "libfakecuda.so.1")
    with open(src, "w") as f:
        f.write(_SOURCE)
    include = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "proxy")
    r = subprocess.run([os.environ.get("CXX", "c++"), "-shared", "-fPIC", "-O1", "-I", include, src, "-o", out],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return out
