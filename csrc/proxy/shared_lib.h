// A library opened at run time (dlopen) and its table of entry points, filled once per process:
// what the libfabric and libibverbs loaders (load_fabric, load_verbs) share.
#pragma once

#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>

namespace moe_ep {

// `fn` = the entry point `p`; a null one sets *err to `missing` (the first one missing only).
template <class Fn>
void set_symbol(Fn& fn, void* p, const std::string& missing, std::string* err) {
  fn = reinterpret_cast<Fn>(p);
  if (!p && err->empty()) *err = missing;
}

// The table of a library, loaded once per process: the file environment variable `env` names (when
// set and not empty), else `dflt`, opened and handed to `bind(handle, file name, &table)`, which
// fills the table and returns what is missing ("" when nothing). Returns the table, or null with
// *why: "cannot load <file> (<hint>): <dlerror>" or what bind returned (every call the same answer).
template <class Table, class Bind>
const Table* load_table(const char* env, const char* dflt, const char* hint, std::string* why, Bind bind) {
  static std::mutex mu;
  static Table table{};
  static int state = 0;  // 0 not tried, 1 loaded, -1 failed
  static std::string err;
  std::lock_guard<std::mutex> lk(mu);
  if (state == 0) {
    const char* e = std::getenv(env);
    const std::string name = e && *e ? e : dflt;
    if (void* h = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL)) {
      err = bind(h, name, &table);
    } else {
      const char* d = dlerror();
      err = "cannot load " + name + " (" + hint + "): " + (d ? d : "dlopen failed");
    }
    state = err.empty() ? 1 : -1;
  }
  if (state != 1) {
    if (why) *why = err;
    return nullptr;
  }
  return &table;
}

}  // namespace moe_ep
