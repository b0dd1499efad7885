// Native kernel launches for moe_ep/kernels/launch.py (docs/ARCHITECTURE.md §4, "Native plans").
//
// A plan is one compiled kernel ready to launch: its CUfunction, grid, block and shared memory,
// and every kernel parameter already packed the way cuLaunchKernel takes them (one value per
// parameter, kernelParams[i] pointing at it). The values that change between launches (a few
// pointers) are slots: a launch writes the stream and the slot values into the plan's stage, and
// moe_ep_launch copies them into their parameters and calls cuLaunchKernel. libcuda is opened at
// run time (cuda_mem.cc): nothing here needs CUDA to build.
//
// Python launches through `launch(plan_id, stream, values)`, a Python function this file defines
// (moe_ep_launch_function): the values come as Python ints, in one call with no ctypes
// conversion and no packing in Python (0.56 -> 0.16 us a launch on a CPU against struct packing
// and a ctypes call; scripts/host_path.py). It uses only Python's stable ABI, so one library
// serves every Python from 3.10 on; it is the one source of the library that includes Python.h (the rest is
// plain C++ behind a C API loaded by ctypes).
#define PY_SSIZE_T_CLEAN
#define Py_LIMITED_API 0x030A0000
#include <Python.h>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "../proxy/cuda_mem.h"
#include "../proxy/imm_counter.h"
#include "../proxy/transport.h"

namespace {

constexpr int kMaxSlots = 15;      // values patched per launch (the stage holds the stream first)
constexpr int kMaxPlans = 1 << 16;  // plans alive at once in a process

struct Plan {
  void* function = nullptr;
  unsigned grid = 0, block = 0, shared = 0;
  moe_ep::CuLaunchKernel launch = nullptr;  // null: a plan that only packs (no driver needed)
  std::vector<uint8_t> storage;             // the parameters, each at an offset aligned to its size
  std::vector<size_t> offset, size;         // per parameter
  std::vector<void*> params;                // kernelParams: &storage[offset[i]]
  int nslots = 0;
  int slot_param[kMaxSlots] = {};
  uint64_t stage[1 + kMaxSlots] = {};  // [0] the CUstream, [1 + k] the value of slot k

  void apply() {
    // Little-endian: the low `size` bytes of a slot's 64-bit value are the value of a narrower parameter.
    for (int k = 0; k < nslots; ++k) {
      const int p = slot_param[k];
      std::memcpy(&storage[offset[p]], &stage[1 + k], size[p]);
    }
  }
};

std::mutex g_mu;                    // guards creation and destruction (launches read without it)
Plan* g_plans[kMaxPlans] = {};
uint16_t g_generation[kMaxPlans] = {};  // per slot of g_plans: bumped each time the slot is freed
std::vector<int> g_free;
int g_next = 0;

// A plan's id is its slot in g_plans and that slot's generation (id = generation << 16 | slot,
// generation 15 bits: ids stay positive ints), so an id kept past its plan's destruction names
// no plan, never the next plan in its slot.
int id_of(int slot) { return (g_generation[slot] & 0x7FFF) << 16 | slot; }

Plan* plan_of(long id) {
  if (id < 0 || id > 0x7FFFFFFF) return nullptr;
  const int slot = int(id & 0xFFFF);
  return id_of(slot) == id ? g_plans[slot] : nullptr;
}

}  // namespace

#pragma GCC visibility push(default)
extern "C" {

// Creates a plan: `function` a CUfunction (0: a plan that packs but cannot launch, for tests),
// launched on `grid` programs of `block` threads with `shared` bytes of dynamic shared memory;
// `nparams` parameters of `sizes[i]` bytes (1, 2, 4 or 8) holding `values[i]` (low bytes); slot k
// patches parameter `slots[k]`. Returns the plan's id (>= 0), or a negative code (message in
// moe_ep_last_error).
int moe_ep_launch_plan_create(uint64_t function, uint32_t grid, uint32_t block, uint32_t shared, int nparams,
                              const uint32_t* sizes, const uint64_t* values, int nslots, const int* slots) {
  if (nparams < 0 || nslots < 0 || nslots > kMaxSlots)
    return moe_ep::set_error(moe_ep::kErrInvalid, "launch plan: " + std::to_string(nslots) + " slots (at most " +
                                                      std::to_string(kMaxSlots) + ") or a negative count");
  auto plan = std::make_unique<Plan>();
  if (function != 0) {
    std::string why;
    plan->launch = moe_ep::cuda_launch_kernel(&why);
    if (!plan->launch) return moe_ep::set_error(moe_ep::kErrSystem, "launch plan: " + why);
  }
  plan->function = reinterpret_cast<void*>(function);
  plan->grid = grid, plan->block = block, plan->shared = shared;
  size_t end = 0;
  for (int i = 0; i < nparams; ++i) {
    const size_t s = sizes[i];
    if (s != 1 && s != 2 && s != 4 && s != 8)
      return moe_ep::set_error(moe_ep::kErrInvalid, "launch plan: parameter " + std::to_string(i) + " has " +
                                                        std::to_string(s) + " bytes (expected 1, 2, 4 or 8)");
    end = (end + s - 1) / s * s;
    plan->offset.push_back(end);
    plan->size.push_back(s);
    end += s;
  }
  plan->storage.assign(end + 8, 0);  // + 8: a plan without parameters still has valid storage
  for (int i = 0; i < nparams; ++i) {
    std::memcpy(&plan->storage[plan->offset[i]], &values[i], plan->size[i]);
    plan->params.push_back(&plan->storage[plan->offset[i]]);
  }
  for (int k = 0; k < nslots; ++k) {
    if (slots[k] < 0 || slots[k] >= nparams)
      return moe_ep::set_error(moe_ep::kErrInvalid, "launch plan: slot " + std::to_string(k) + " names parameter " +
                                                        std::to_string(slots[k]) + " of " + std::to_string(nparams));
    plan->slot_param[k] = slots[k];
  }
  plan->nslots = nslots;
  std::lock_guard<std::mutex> lk(g_mu);
  int slot;
  if (!g_free.empty()) {
    slot = g_free.back();
    g_free.pop_back();
  } else if (g_next < kMaxPlans) {
    slot = g_next++;
  } else {
    return moe_ep::set_error(moe_ep::kErrInvalid, "launch plan: " + std::to_string(kMaxPlans) + " plans alive");
  }
  g_plans[slot] = plan.release();
  return id_of(slot);
}

void moe_ep_launch_plan_destroy(int id) {
  std::lock_guard<std::mutex> lk(g_mu);
  if (Plan* p = plan_of(id)) {
    const int slot = id & 0xFFFF;
    g_plans[slot] = nullptr;
    ++g_generation[slot];
    delete p;
    g_free.push_back(slot);
  }
}

// The address of plan `id`'s stage (uint64 [1 + slots]: the stream, then the slot values), or 0.
uint64_t moe_ep_launch_plan_stage(int id) {
  Plan* p = plan_of(id);
  return p ? reinterpret_cast<uint64_t>(p->stage) : 0;
}

// What the next launch of plan `id` passes: the stage applied, the parameter storage copied to
// `out` (up to `len` bytes); returns the storage's size, or -1 for an unknown id.
int64_t moe_ep_launch_plan_params(int id, uint8_t* out, size_t len) {
  Plan* p = plan_of(id);
  if (!p) return -1;
  p->apply();
  const size_t n = p->storage.size() - 8;
  std::memcpy(out, p->storage.data(), n < len ? n : len);
  return int64_t(n);
}

// Launches plan `id` with the values in its stage. 0, or the CUresult (> 0), or a negative code;
// the message in moe_ep_last_error.
int moe_ep_launch(int id) {
  Plan* p = plan_of(id);
  if (!p || !p->launch) return moe_ep::set_error(moe_ep::kErrInvalid, "launch: no launchable plan " + std::to_string(id));
  p->apply();
  if (p->grid == 0) return 0;  // as Triton's launcher: an empty grid launches nothing
  const int rc = p->launch(p->function, p->grid, 1, 1, p->block, 1, 1, p->shared,
                           reinterpret_cast<void*>(p->stage[0]), p->params.data(), nullptr);
  if (rc != 0) return moe_ep::set_error(rc, "cuLaunchKernel failed: " + moe_ep::cuda_error_string(rc));
  return 0;
}

}  // extern "C"
#pragma GCC visibility pop

namespace {

// launch(plan_id, stream, values): plan `plan_id` launched on `stream` (an int, the CUstream) with
// `values` (a tuple or list of ints, one per slot; their low 64 bits). All arguments are read
// before the plan's stage is touched. Raises TypeError / ValueError for wrong arguments and
// RuntimeError("moe_ep native launch: ...") when the launch fails.
PyObject* py_launch(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_Format(PyExc_TypeError, "launch(plan_id, stream, values): takes 3 arguments, got %zd", nargs);
    return nullptr;
  }
  const long id = PyLong_AsLong(args[0]);
  if (id == -1 && PyErr_Occurred()) return nullptr;
  Plan* p = plan_of(id);
  if (!p) {
    PyErr_Format(PyExc_ValueError, "launch: plan_id %ld names no plan", id);
    return nullptr;
  }
  uint64_t stage[1 + kMaxSlots];
  stage[0] = PyLong_AsUnsignedLongLongMask(args[1]);
  if (stage[0] == ~uint64_t(0) && PyErr_Occurred()) return nullptr;
  PyObject* values = args[2];
  const bool tuple = PyTuple_Check(values);
  if (!tuple && !PyList_Check(values)) {
    PyErr_SetString(PyExc_TypeError, "launch: values must be a tuple or a list of ints");
    return nullptr;
  }
  const Py_ssize_t n = tuple ? PyTuple_Size(values) : PyList_Size(values);
  if (n != p->nslots) {
    PyErr_Format(PyExc_ValueError, "launch: plan %ld has %d slots, got %zd values", id, p->nslots, n);
    return nullptr;
  }
  for (Py_ssize_t k = 0; k < n; ++k) {  // borrowed references
    PyObject* v = tuple ? PyTuple_GetItem(values, k) : PyList_GetItem(values, k);
    stage[1 + k] = PyLong_AsUnsignedLongLongMask(v);
    if (stage[1 + k] == ~uint64_t(0) && PyErr_Occurred()) return nullptr;
  }
  std::memcpy(p->stage, stage, sizeof(uint64_t) * (1 + n));
  if (moe_ep_launch(int(id)) != 0) {
    PyErr_Format(PyExc_RuntimeError, "moe_ep native launch: %s", moe_ep::thread_error().c_str());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef g_launch_def = {"launch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_launch)),
                            METH_FASTCALL,
                            "launch(plan_id, stream, values): a native plan launched with its slot values"};

}  // namespace

#pragma GCC visibility push(default)
extern "C" {

// The Python function `launch` above: a borrowed reference to an object kept for the life of the
// process (ctypes' py_object result takes its own reference). Call with the GIL held (ctypes.PyDLL).
PyObject* moe_ep_launch_function() {
  static PyObject* fn = PyCFunction_New(&g_launch_def, nullptr);
  return fn;
}

}  // extern "C"
#pragma GCC visibility pop
