// See cuda_mem.h. The CUDA driver API is declared here by its documented C signatures (cuda.h):
// CUresult is an int, CUdeviceptr a 64-bit integer, and the enum values below are cuda.h's.
#include "cuda_mem.h"

#include <dlfcn.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <mutex>

namespace moe_ep {

namespace {

using CUresult = int;
using CUdeviceptr = unsigned long long;
constexpr int kCuPointerAttributeMemoryType = 2;  // CU_POINTER_ATTRIBUTE_MEMORY_TYPE
constexpr unsigned kCuMemoryTypeDevice = 2;       // CU_MEMORYTYPE_DEVICE
constexpr int kCuMemRangeHandleTypeDmaBufFd = 1;  // CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD
constexpr int kCuPointerAttributeDeviceOrdinal = 9;  // CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
constexpr int kCuDevAttrGdrFlushOptions = 117;       // CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS
constexpr int kCuFlushOptionHost = 1;                // CU_FLUSH_GPU_DIRECT_RDMA_WRITES_OPTION_HOST
constexpr int kCuFlushTargetCurrentCtx = 0;          // CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TARGET_CURRENT_CTX
constexpr int kCuFlushToOwner = 100;                 // CU_FLUSH_GPU_DIRECT_RDMA_WRITES_TO_OWNER

struct Cuda {
  CUresult (*pointer_get_attribute)(void* data, int attribute, CUdeviceptr ptr) = nullptr;
  CUresult (*mem_get_handle_for_address_range)(void* handle, CUdeviceptr dptr, size_t size, int type,
                                               unsigned long long flags) = nullptr;  // CUDA 11.7+
  CUresult (*get_error_string)(CUresult, const char**) = nullptr;
  CuLaunchKernel launch_kernel = nullptr;
  CUresult (*device_get_attribute)(int* value, int attribute, int dev) = nullptr;
  CUresult (*primary_ctx_retain)(void** ctx, int dev) = nullptr;
  CUresult (*ctx_set_current)(void* ctx) = nullptr;
  CUresult (*flush_gdr_writes)(int target, int scope) = nullptr;  // CUDA 11.3+
  CuGraphApi graph;  // CUDA 12.0+ (the _v2 kernel-node entry points)
};

std::atomic<int> g_override{-1};

std::string lib_name() {
  const char* e = std::getenv("MOE_EP_CUDA_LIB");
  return e && *e ? e : "libcuda.so.1";
}

// The driver's entry points; `load`: dlopen it if this process has not (else only when it has).
// Null with *why when unavailable.
const Cuda* cuda(bool load, std::string* why) {
  static std::mutex mu;
  static Cuda api;
  static bool loaded = false;
  static std::string err, tried;
  std::lock_guard<std::mutex> lk(mu);
  const std::string name = lib_name();
  if (loaded && name != tried) loaded = false, api = Cuda{}, err.clear();  // MOE_EP_CUDA_LIB changed (tests)
  if (!loaded) {
    tried = name;
    void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
    if (!h && !load) {
      if (why) *why = name + " is not loaded in this process";
      return nullptr;
    }
    if (!h) h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) {
      const char* e = dlerror();
      err = "cannot load " + name + " (no CUDA driver?): " + (e ? e : "dlopen failed");
    } else {
      api.pointer_get_attribute = reinterpret_cast<decltype(api.pointer_get_attribute)>(dlsym(h, "cuPointerGetAttribute"));
      api.mem_get_handle_for_address_range = reinterpret_cast<decltype(api.mem_get_handle_for_address_range)>(
          dlsym(h, "cuMemGetHandleForAddressRange"));
      api.get_error_string = reinterpret_cast<decltype(api.get_error_string)>(dlsym(h, "cuGetErrorString"));
      api.launch_kernel = reinterpret_cast<CuLaunchKernel>(dlsym(h, "cuLaunchKernel"));
      api.device_get_attribute = reinterpret_cast<decltype(api.device_get_attribute)>(dlsym(h, "cuDeviceGetAttribute"));
      api.primary_ctx_retain = reinterpret_cast<decltype(api.primary_ctx_retain)>(dlsym(h, "cuDevicePrimaryCtxRetain"));
      api.ctx_set_current = reinterpret_cast<decltype(api.ctx_set_current)>(dlsym(h, "cuCtxSetCurrent"));
      api.flush_gdr_writes = reinterpret_cast<decltype(api.flush_gdr_writes)>(dlsym(h, "cuFlushGPUDirectRDMAWrites"));
      CuGraphApi& g = api.graph;
      g.create = reinterpret_cast<decltype(g.create)>(dlsym(h, "cuGraphCreate"));
      g.add_kernel_node = reinterpret_cast<decltype(g.add_kernel_node)>(dlsym(h, "cuGraphAddKernelNode_v2"));
      g.instantiate = reinterpret_cast<decltype(g.instantiate)>(dlsym(h, "cuGraphInstantiateWithFlags"));
      g.set_params = reinterpret_cast<decltype(g.set_params)>(dlsym(h, "cuGraphExecKernelNodeSetParams_v2"));
      g.launch = reinterpret_cast<decltype(g.launch)>(dlsym(h, "cuGraphLaunch"));
      g.exec_destroy = reinterpret_cast<decltype(g.exec_destroy)>(dlsym(h, "cuGraphExecDestroy"));
      g.destroy = reinterpret_cast<decltype(g.destroy)>(dlsym(h, "cuGraphDestroy"));
      g.is_capturing = reinterpret_cast<decltype(g.is_capturing)>(dlsym(h, "cuStreamIsCapturing"));
      if (!api.pointer_get_attribute) err = name + " has no symbol cuPointerGetAttribute";
    }
    loaded = true;  // one attempt per process (after the driver was seen or asked for)
  }
  if (!err.empty()) {
    if (why) *why = err;
    return nullptr;
  }
  return &api;
}

std::string cu_error(const Cuda& c, CUresult rc) {
  const char* s = nullptr;
  if (c.get_error_string && c.get_error_string(rc, &s) == 0 && s) return std::string(s) + " (CUresult " + std::to_string(rc) + ")";
  return "CUresult " + std::to_string(rc);
}

}  // namespace

#ifdef MOE_EP_TEST_HOOKS
void set_memory_type_override(int kind) { g_override = kind; }
#endif

MemType memory_type(const void* ptr) {
  const int o = g_override.load();
  if (o >= 0) return o == 1 ? MemType::Device : MemType::Host;
  const Cuda* c = cuda(false, nullptr);
  if (!c) return MemType::Host;
  unsigned type = 0;
  // Host memory CUDA does not know answers CUDA_ERROR_INVALID_VALUE; a driver not initialized
  // (no CUDA context yet, so no device memory either) CUDA_ERROR_NOT_INITIALIZED: both host.
  if (c->pointer_get_attribute(&type, kCuPointerAttributeMemoryType, CUdeviceptr(reinterpret_cast<uintptr_t>(ptr))) != 0)
    return MemType::Host;
  return type == kCuMemoryTypeDevice ? MemType::Device : MemType::Host;
}

void dmabuf_range(uint64_t ptr, uint64_t len, uint64_t page, uint64_t* base, uint64_t* size) {
  *base = ptr & ~(page - 1);
  *size = ((ptr + len + page - 1) & ~(page - 1)) - *base;
}

bool cuda_dmabuf_fd(const void* ptr, uint64_t len, int* fd, uint64_t* offset, std::string* why) {
  const Cuda* c = cuda(true, why);
  if (!c) return false;
  if (!c->mem_get_handle_for_address_range) {
    *why = lib_name() + " has no cuMemGetHandleForAddressRange (a driver older than CUDA 11.7)";
    return false;
  }
  const long pg = sysconf(_SC_PAGESIZE);
  uint64_t base = 0, size = 0;
  dmabuf_range(reinterpret_cast<uintptr_t>(ptr), len, uint64_t(pg > 0 ? pg : 4096), &base, &size);
  int h = -1;
  if (CUresult rc = c->mem_get_handle_for_address_range(&h, CUdeviceptr(base), size_t(size), kCuMemRangeHandleTypeDmaBufFd, 0);
      rc != 0 || h < 0) {
    *why = "cuMemGetHandleForAddressRange(DMA_BUF_FD) failed: " + cu_error(*c, rc) +
           " (dma-buf export needs CUDA 11.7+, Linux 5.12+ and NVIDIA's open GPU kernel modules)";
    return false;
  }
  *fd = h;
  *offset = reinterpret_cast<uintptr_t>(ptr) - base;
  return true;
}

CuLaunchKernel cuda_launch_kernel(std::string* why) {
  const Cuda* c = cuda(true, why);
  if (!c) return nullptr;
  if (!c->launch_kernel) *why = lib_name() + " has no symbol cuLaunchKernel";
  return c->launch_kernel;
}

const CuGraphApi* cuda_graph_api(std::string* why) {
  const Cuda* c = cuda(true, why);
  if (!c) return nullptr;
  const CuGraphApi& g = c->graph;
  if (!g.create || !g.add_kernel_node || !g.instantiate || !g.set_params || !g.launch || !g.exec_destroy ||
      !g.destroy || !g.is_capturing) {
    *why = lib_name() + " lacks a CUDA-graph entry point (cuGraphCreate, cuGraphAddKernelNode_v2, "
                        "cuGraphInstantiateWithFlags, cuGraphExecKernelNodeSetParams_v2, cuGraphLaunch, cuStreamIsCapturing, ...)";
    return nullptr;
  }
  return &g;
}

bool GdrFlush::bind(const void* dev_ptr, std::string* why) {
  const Cuda* c = cuda(true, why);
  if (!c) return false;
  if (!c->device_get_attribute || !c->primary_ctx_retain || !c->ctx_set_current) {
    *why = lib_name() + " lacks cuDeviceGetAttribute, cuDevicePrimaryCtxRetain or cuCtxSetCurrent";
    return false;
  }
  int dev = -1, opts = 0;
  void* ctx = nullptr;
  if (CUresult rc = c->pointer_get_attribute(&dev, kCuPointerAttributeDeviceOrdinal,
                                             CUdeviceptr(reinterpret_cast<uintptr_t>(dev_ptr)));
      rc != 0) {
    *why = "cuPointerGetAttribute(DEVICE_ORDINAL) failed: " + cu_error(*c, rc);
    return false;
  }
  if (CUresult rc = c->primary_ctx_retain(&ctx, dev); rc != 0) {
    *why = "cuDevicePrimaryCtxRetain(" + std::to_string(dev) + ") failed: " + cu_error(*c, rc);
    return false;
  }
  if (CUresult rc = c->ctx_set_current(ctx); rc != 0) {
    *why = "cuCtxSetCurrent failed: " + cu_error(*c, rc);
    return false;
  }
  if (c->device_get_attribute(&opts, kCuDevAttrGdrFlushOptions, dev) != 0) opts = 0;
  needed_ = (opts & kCuFlushOptionHost) && c->flush_gdr_writes;
  bound_ = true;
  return true;
}

bool GdrFlush::flush(std::string* why) {
  if (!bound_ || !needed_) return true;
  const Cuda* c = cuda(false, why);
  if (!c) return false;
  if (CUresult rc = c->flush_gdr_writes(kCuFlushTargetCurrentCtx, kCuFlushToOwner); rc != 0) {
    *why = "cuFlushGPUDirectRDMAWrites failed: " + cu_error(*c, rc);
    return false;
  }
  return true;
}

std::string cuda_error_string(int rc) {
  const Cuda* c = cuda(false, nullptr);
  return c ? cu_error(*c, rc) : "CUresult " + std::to_string(rc);
}

}  // namespace moe_ep
