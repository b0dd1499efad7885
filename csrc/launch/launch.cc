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
#include <memory>
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

std::mutex g_mu;  // guards creation and destruction (launches read without it)

// Objects alive by id: an id is its slot and that slot's generation (id = generation << 16 |
// slot, generation 15 bits: ids stay positive ints), so an id kept past its object's destruction
// names nothing, never the next object in its slot. keep and remove take g_mu.
template <class T, int N>
struct Table {
  T* items[N] = {};
  uint16_t generation[N] = {};  // per slot: bumped each time the slot is freed
  std::vector<int> free;
  int next = 0;

  int id_of(int slot) const { return (generation[slot] & 0x7FFF) << 16 | slot; }
  T* of(long id) const {
    if (id < 0 || id > 0x7FFFFFFF || (id & 0xFFFF) >= N) return nullptr;
    const int slot = int(id & 0xFFFF);
    return id_of(slot) == id ? items[slot] : nullptr;
  }
  // Takes `t` and returns its id, or an error naming `what` when N are alive (`t` dropped).
  int keep(std::unique_ptr<T> t, const char* what) {
    std::lock_guard<std::mutex> lk(g_mu);
    int slot;
    if (!free.empty()) {
      slot = free.back();
      free.pop_back();
    } else if (next < N) {
      slot = next++;
    } else {
      return moe_ep::set_error(moe_ep::kErrInvalid, std::string(what) + ": " + std::to_string(N) + " alive");
    }
    items[slot] = t.release();
    return id_of(slot);
  }
  void remove(long id) {
    std::lock_guard<std::mutex> lk(g_mu);
    if (T* t = of(id)) {
      const int slot = int(id & 0xFFFF);
      items[slot] = nullptr;
      ++generation[slot];
      delete t;
      free.push_back(slot);
    }
  }
};

Table<Plan, kMaxPlans> g_plans;

Plan* plan_of(long id) { return g_plans.of(id); }

// A launch graph: plans launched as the kernel nodes of one CUDA graph, each node after the one
// before it, in one cuGraphLaunch. Each launch writes every plan's slot values into its node
// (cuGraphExecKernelNodeSetParams copies them) before it launches: a call's launches issue as one
// graph where the driver charges less for a graph launch than for one launch per kernel
// (Tuning.graph_launch; docs/ARCHITECTURE.md §4).
constexpr int kMaxGraphs = 1 << 12;
constexpr int kMaxGraphPlans = 8;

struct Graph {
  const moe_ep::CuGraphApi* api = nullptr;
  std::vector<int> plans;  // ids, in launch order (the caller keeps the plans alive)
  std::vector<void*> nodes;
  void* graph = nullptr;
  void* exec = nullptr;

  ~Graph() {
    if (exec) api->exec_destroy(exec);
    if (graph) api->destroy(graph);
  }
};

Table<Graph, kMaxGraphs> g_graphs;

Graph* graph_of(long id) { return g_graphs.of(id); }

moe_ep::CuKernelNodeParams node_params(Plan* p) {
  return moe_ep::CuKernelNodeParams{p->function, p->grid, 1, 1, p->block, 1, 1, p->shared, p->params.data(),
                                    nullptr, nullptr, nullptr};
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
  return g_plans.keep(std::move(plan), "launch plan: plans");
}

void moe_ep_launch_plan_destroy(int id) { g_plans.remove(id); }

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

// Creates a launch graph of the `n` plans `ids` (launchable, a non-empty grid each), in the current
// CUDA context. Returns its id (>= 0), or a negative code or CUresult (message in moe_ep_last_error).
int moe_ep_launch_graph_create(int n, const int* ids) {
  if (n < 1 || n > kMaxGraphPlans)
    return moe_ep::set_error(moe_ep::kErrInvalid, "launch graph: " + std::to_string(n) + " plans (1 to " +
                                                      std::to_string(kMaxGraphPlans) + ")");
  auto g = std::make_unique<Graph>();
  std::string why;
  g->api = moe_ep::cuda_graph_api(&why);
  if (!g->api) return moe_ep::set_error(moe_ep::kErrSystem, "launch graph: " + why);
  for (int i = 0; i < n; ++i) {
    Plan* p = plan_of(ids[i]);
    if (!p || !p->launch || p->grid == 0)
      return moe_ep::set_error(moe_ep::kErrInvalid, "launch graph: plan " + std::to_string(ids[i]) +
                                                        " is not a launchable plan with a non-empty grid");
    g->plans.push_back(ids[i]);
  }
  int rc = g->api->create(&g->graph, 0);
  for (int i = 0; rc == 0 && i < n; ++i) {
    // (the parameters as they stand: every launch writes its own into the node first)
    const moe_ep::CuKernelNodeParams np = node_params(plan_of(ids[i]));
    void* node = nullptr;
    rc = g->api->add_kernel_node(&node, g->graph, i ? &g->nodes.back() : nullptr, i ? 1 : 0, &np);
    g->nodes.push_back(node);
  }
  if (rc == 0) rc = g->api->instantiate(&g->exec, g->graph, 0);
  if (rc != 0) return moe_ep::set_error(rc, "launch graph: building the graph failed: " + moe_ep::cuda_error_string(rc));
  return g_graphs.keep(std::move(g), "launch graph: graphs");
}

void moe_ep_launch_graph_destroy(int id) { g_graphs.remove(id); }

// Launches graph `id`: each plan's stage applied and written into its node, then one cuGraphLaunch
// on the stream in the first plan's stage. Into a stream that is being captured (a caller's CUDA
// graph) the plans launch one by one instead: the captured graph then holds the kernels with this
// call's values, where a graph launch would hold a node of an executable graph the next call
// rewrites (and the driver invalidates the capture). 0, or the CUresult (> 0), or a negative code.
int moe_ep_launch_graph(int id) {
  Graph* g = graph_of(id);
  if (!g) return moe_ep::set_error(moe_ep::kErrInvalid, "launch graph: no graph " + std::to_string(id));
  Plan* first = nullptr;
  for (size_t i = 0; i < g->plans.size(); ++i) {
    Plan* p = plan_of(g->plans[i]);
    if (!p) return moe_ep::set_error(moe_ep::kErrInvalid, "launch graph: its plan " + std::to_string(g->plans[i]) + " is gone");
    if (!first) {
      first = p;
      int capture = 0;
      const int rc = g->api->is_capturing(reinterpret_cast<void*>(p->stage[0]), &capture);
      if (rc != 0) return moe_ep::set_error(rc, "cuStreamIsCapturing failed: " + moe_ep::cuda_error_string(rc));
      if (capture != 0) {
        for (const int plan : g->plans) {
          const int lrc = moe_ep_launch(plan);
          if (lrc != 0) return lrc;
        }
        return 0;
      }
    }
    p->apply();
    const moe_ep::CuKernelNodeParams np = node_params(p);
    const int rc = g->api->set_params(g->exec, g->nodes[i], &np);
    if (rc != 0)
      return moe_ep::set_error(rc, "cuGraphExecKernelNodeSetParams failed: " + moe_ep::cuda_error_string(rc));
  }
  const int rc = g->api->launch(g->exec, reinterpret_cast<void*>(first->stage[0]));
  if (rc != 0) return moe_ep::set_error(rc, "cuGraphLaunch failed: " + moe_ep::cuda_error_string(rc));
  return 0;
}

}  // extern "C"
#pragma GCC visibility pop

namespace {

// The first two of a launch function's three arguments, an id and a stream (ints); false with a
// Python exception set (TypeError naming `call` for a wrong count).
bool id_and_stream(const char* call, PyObject* const* args, Py_ssize_t nargs, long* id, uint64_t* stream) {
  if (nargs != 3) {
    PyErr_Format(PyExc_TypeError, "%s: takes 3 arguments, got %zd", call, nargs);
    return false;
  }
  *id = PyLong_AsLong(args[0]);
  if (*id == -1 && PyErr_Occurred()) return false;
  *stream = PyLong_AsUnsignedLongLongMask(args[1]);
  return !(*stream == ~uint64_t(0) && PyErr_Occurred());
}

// The stage of plan `p` from `values` (a tuple or list of ints, one per slot), the stream first;
// false with a Python exception set on a wrong argument (the stage untouched).
bool stage_from(Plan* p, long id, uint64_t stream, PyObject* values) {
  uint64_t stage[1 + kMaxSlots];
  stage[0] = stream;
  const bool tuple = PyTuple_Check(values);
  if (!tuple && !PyList_Check(values)) {
    PyErr_SetString(PyExc_TypeError, "launch: values must be a tuple or a list of ints");
    return false;
  }
  const Py_ssize_t n = tuple ? PyTuple_Size(values) : PyList_Size(values);
  if (n != p->nslots) {
    PyErr_Format(PyExc_ValueError, "launch: plan %ld has %d slots, got %zd values", id, p->nslots, n);
    return false;
  }
  for (Py_ssize_t k = 0; k < n; ++k) {  // borrowed references
    PyObject* v = tuple ? PyTuple_GetItem(values, k) : PyList_GetItem(values, k);
    stage[1 + k] = PyLong_AsUnsignedLongLongMask(v);
    if (stage[1 + k] == ~uint64_t(0) && PyErr_Occurred()) return false;
  }
  std::memcpy(p->stage, stage, sizeof(uint64_t) * (1 + n));
  return true;
}

// launch(plan_id, stream, values): plan `plan_id` launched on `stream` (an int, the CUstream) with
// `values` (a tuple or list of ints, one per slot; their low 64 bits). All arguments are read
// before the plan's stage is touched. Raises TypeError / ValueError for wrong arguments and
// RuntimeError("moe_ep native launch: ...") when the launch fails.
PyObject* py_launch(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long id;
  uint64_t stream;
  if (!id_and_stream("launch(plan_id, stream, values)", args, nargs, &id, &stream)) return nullptr;
  Plan* p = plan_of(id);
  if (!p) {
    PyErr_Format(PyExc_ValueError, "launch: plan_id %ld names no plan", id);
    return nullptr;
  }
  if (!stage_from(p, id, stream, args[2])) return nullptr;
  if (moe_ep_launch(int(id)) != 0) {
    PyErr_Format(PyExc_RuntimeError, "moe_ep native launch: %s", moe_ep::thread_error().c_str());
    return nullptr;
  }
  Py_RETURN_NONE;
}

// launch_graph(graph_id, stream, values): graph `graph_id` launched on `stream` with `values` (a
// tuple or list holding, per plan in launch order, its slot values as `launch` takes them). Every
// argument is checked before the graph's nodes are written. Errors as `launch`'s.
PyObject* py_launch_graph(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  long id;
  uint64_t stream;
  if (!id_and_stream("launch_graph(graph_id, stream, values)", args, nargs, &id, &stream)) return nullptr;
  Graph* g = graph_of(id);
  if (!g) {
    PyErr_Format(PyExc_ValueError, "launch_graph: graph_id %ld names no graph", id);
    return nullptr;
  }
  PyObject* per = args[2];
  const bool tuple = PyTuple_Check(per);
  if ((!tuple && !PyList_Check(per)) || (tuple ? PyTuple_Size(per) : PyList_Size(per)) != Py_ssize_t(g->plans.size())) {
    PyErr_Format(PyExc_ValueError, "launch_graph: values must hold one sequence per plan (%zd)", g->plans.size());
    return nullptr;
  }
  for (size_t i = 0; i < g->plans.size(); ++i) {
    Plan* p = plan_of(g->plans[i]);
    if (!p) {
      PyErr_Format(PyExc_ValueError, "launch_graph: plan %d of graph %ld is gone", g->plans[i], id);
      return nullptr;
    }
    if (!stage_from(p, g->plans[i], stream, tuple ? PyTuple_GetItem(per, i) : PyList_GetItem(per, i))) return nullptr;
  }
  if (moe_ep_launch_graph(int(id)) != 0) {
    PyErr_Format(PyExc_RuntimeError, "moe_ep native launch: %s", moe_ep::thread_error().c_str());
    return nullptr;
  }
  Py_RETURN_NONE;
}

PyMethodDef g_launch_graph_def = {
    "launch_graph", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(py_launch_graph)), METH_FASTCALL,
    "launch_graph(graph_id, stream, values): a launch graph launched with each plan's slot values"};

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

// The Python function `launch_graph` above, as moe_ep_launch_function.
PyObject* moe_ep_launch_graph_function() {
  static PyObject* fn = PyCFunction_New(&g_launch_graph_def, nullptr);
  return fn;
}

}  // extern "C"
#pragma GCC visibility pop
