// GPU memory for RDMA registration: which memory a pointer is (the CUDA driver's answer), and a
// dma-buf fd for a range of device memory. libcuda.so.1 is opened at run time (MOE_EP_CUDA_LIB
// overrides the name), so nothing here needs CUDA to build or run. docs/ARCHITECTURE.md §9,
// "GPU memory (dma-buf)".
#pragma once

#include <cstdint>
#include <string>

namespace moe_ep {

enum class MemType { Host, Device };

// Device when the CUDA driver says CU_MEMORYTYPE_DEVICE for ptr (cuPointerGetAttribute,
// CU_POINTER_ATTRIBUTE_MEMORY_TYPE), else Host (also pinned host memory, and any pointer of a
// process that has not loaded the CUDA driver: without it there is no device memory, so it is
// not loaded just to ask). The tests' build can override the answer (below).
MemType memory_type(const void* ptr);

#ifdef MOE_EP_TEST_HOOKS
// Test hook (csrc/testing/hooks.cc): -1 asks the driver (the default), 0 says host, 1 device.
void set_memory_type_override(int kind);
#endif

// A dma-buf fd (cuMemGetHandleForAddressRange, CU_MEM_RANGE_HANDLE_TYPE_DMA_BUF_FD) for the
// host-page-aligned range around [ptr, ptr + len): *fd (the caller closes it), *offset = ptr
// minus the range's start (the offset of ptr inside the dma-buf). Loads the driver if needed.
// False with *why (the library, a symbol, or the driver's error) on failure.
bool cuda_dmabuf_fd(const void* ptr, uint64_t len, int* fd, uint64_t* offset, std::string* why);

// The page-aligned range cuda_dmabuf_fd asks the driver for: [*base, *base + *size) around
// [ptr, ptr + len), page a power of two.
void dmabuf_range(uint64_t ptr, uint64_t len, uint64_t page, uint64_t* base, uint64_t* size);

// cuLaunchKernel as cuda.h declares it (CUfunction, grid x/y/z, block x/y/z, shared bytes, CUstream,
// kernelParams, extra), and a message for its CUresult.
using CuLaunchKernel = int (*)(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                               unsigned bz, unsigned shared, void* stream, void** params, void** extra);

// The driver's cuLaunchKernel (loads the driver if needed); null with *why when unavailable.
CuLaunchKernel cuda_launch_kernel(std::string* why);

// A kernel node of a CUDA graph as cuda.h's CUDA_KERNEL_NODE_PARAMS_v2 lays it out (the v2 entry
// points take it; kern and ctx left null: the function, in the current context).
struct CuKernelNodeParams {
  void* func;
  unsigned gx, gy, gz, bx, by, bz, shared;
  void** params;
  void** extra;
  void* kern;
  void* ctx;
};

// The driver's CUDA-graph entry points a launch graph needs (cuGraphCreate, cuGraphAddKernelNode_v2,
// cuGraphInstantiateWithFlags, cuGraphExecKernelNodeSetParams_v2, cuGraphLaunch, cuGraphExecDestroy,
// cuGraphDestroy, cuStreamIsCapturing), by cuda.h's signatures with handles as void*.
struct CuGraphApi {
  int (*create)(void** graph, unsigned flags) = nullptr;
  int (*add_kernel_node)(void** node, void* graph, void* const* deps, size_t ndeps, const CuKernelNodeParams* p) = nullptr;
  int (*instantiate)(void** exec, void* graph, unsigned long long flags) = nullptr;
  int (*set_params)(void* exec, void* node, const CuKernelNodeParams* p) = nullptr;
  int (*launch)(void* exec, void* stream) = nullptr;
  int (*exec_destroy)(void* exec) = nullptr;
  int (*destroy)(void* graph) = nullptr;
  int (*is_capturing)(void* stream, int* status) = nullptr;  // status 0: CU_STREAM_CAPTURE_STATUS_NONE
};

// The driver's graph entry points (loads the driver if needed); null with *why when one is missing.
const CuGraphApi* cuda_graph_api(std::string* why);

// The driver's name and text for a CUresult, e.g. "invalid argument (CUresult 1)".
std::string cuda_error_string(int rc);

// GPUDirect RDMA consistency: a NIC's writes into GPU memory whose completion the CPU has seen
// are visible to the GPU's kernels only after a flush. GdrFlush binds the calling thread to the
// primary context of the device that holds `dev_ptr` (cuDevicePrimaryCtxRetain, cuCtxSetCurrent),
// then flush() calls cuFlushGPUDirectRDMAWrites(current context, to owner) where the device
// supports it (CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_FLUSH_WRITES_OPTIONS has the HOST bit), and
// does nothing where the device orders remote writes itself. False with *why on failure.
class GdrFlush {
 public:
  bool bind(const void* dev_ptr, std::string* why);
  bool flush(std::string* why);
  bool needed() const { return needed_; }

 private:
  bool bound_ = false, needed_ = false;
};

}  // namespace moe_ep
