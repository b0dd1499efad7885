// libfabric opened at run time (dlopen + dlvsym of the versions fabric_abi.h declares) and the
// choice of the fi_info an engine of the libfabric transport opens. docs/ARCHITECTURE.md §9,
// "libfabric transport".
#include "fabric_load.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <sstream>

#include "shared_lib.h"

namespace moe_ep {
namespace fi {

const Api* load_fabric(std::string* why) {
  auto bind = [](void* h, const std::string& name, Api* api) {
    std::string err;
    auto sym = [&](auto& fn, const char* s, const char* ver) {
      set_symbol(fn, dlvsym(h, s, ver), name + " has no symbol " + s + "@" + ver + " (a libfabric older than 1.9?)", &err);
    };
    sym(api->getinfo, "fi_getinfo", "FABRIC_1.3");
    sym(api->freeinfo, "fi_freeinfo", "FABRIC_1.3");
    sym(api->dupinfo, "fi_dupinfo", "FABRIC_1.3");
    sym(api->fabric, "fi_fabric", "FABRIC_1.1");
    sym(api->strerror, "fi_strerror", "FABRIC_1.0");
    sym(api->version, "fi_version", "FABRIC_1.0");
    return err;
  };
  return load_table<Api>("MOE_EP_LIBFABRIC_LIB", "libfabric.so.1", "libfabric is not installed? apt-get install libfabric1",
                         why, bind);
}

uint32_t api_version(const Api& api, std::string* why) {
  const uint32_t lib = api.version();
  if (lib < kMinApiVersion) {
    *why = "libfabric " + std::to_string(lib >> 16) + "." + std::to_string(lib & 0xFFFF) + " is older than 1.10";
    return 0;
  }
  return lib < kApiVersion ? lib : kApiVersion;
}

static std::string env_or(const std::string& value, const char* a, const char* b = nullptr) {
  if (!value.empty()) return value;
  for (const char* n : {a, b}) {
    if (!n) continue;
    const char* v = std::getenv(n);
    if (v && *v) return v;
  }
  return "";
}

std::string provider_wanted(const std::string& provider) {
  return env_or(provider, "MOE_EP_FI_PROVIDER", "FI_PROVIDER");
}

std::string domain_wanted(const std::string& domain) { return env_or(domain, "MOE_EP_FI_DOMAIN"); }

std::string mr_mode_names(int mode) {
  static const std::pair<int, const char*> names[] = {
      {MR_BASIC, "FI_MR_BASIC"},       {MR_SCALABLE, "FI_MR_SCALABLE"},   {MR_LOCAL, "FI_MR_LOCAL"},
      {MR_VIRT_ADDR, "FI_MR_VIRT_ADDR"}, {MR_ALLOCATED, "FI_MR_ALLOCATED"}, {MR_PROV_KEY, "FI_MR_PROV_KEY"},
      {MR_ENDPOINT, "FI_MR_ENDPOINT"}, {MR_HMEM, "FI_MR_HMEM"},
  };
  std::string out;
  for (const auto& [bit, n] : names)
    if (mode & bit) out += (out.empty() ? "" : "|") + std::string(n);
  return out.empty() ? "none" : out;
}

// Hints for fi_getinfo (freed by the caller with freeinfo): `strict` adds what the transport
// needs; without it only the provider and domain names are set (to list what there is).
static info* make_hints(const Api& api, const std::string& provider, const std::string& domain, bool strict, bool hmem) {
  info* h = api.dupinfo(nullptr);
  if (!h) return nullptr;
  if (!provider.empty()) h->fabric->prov_name = strdup(provider.c_str());
  (void)domain;  // matched by name afterwards (rxm does not filter on the hint's domain name)
  if (strict) {
    h->caps = MSG | RMA | (hmem ? HMEM : 0);
    h->mode = CONTEXT | CONTEXT2;
    h->ep->type = EP_RDM;
    h->domain->mr_mode = kMrModeAsked;
    h->domain->av_type_ = AV_TABLE;
    h->domain->threading_ = THREAD_SAFE;
  }
  return h;
}

static bool fits(const info* i) {
  return i->ep->type == EP_RDM && (i->caps & RMA) && (i->caps & MSG) && i->domain->cq_data_size >= 4;
}

// Providers that reach only this host (shared memory): never the default of a transport between
// nodes, which would connect nowhere; a caller may still name one (tests on one host do).
static bool host_only(const info* i) {
  const std::string p = i->fabric->prov_name ? i->fabric->prov_name : "";
  return p.rfind("shm", 0) == 0 || p.rfind("sm2", 0) == 0;
}

static bool on_domain(const info* i, const std::string& domain) {
  return domain.empty() || (i->domain->name && domain == i->domain->name);
}

// One line per entry of a relaxed listing: what each entry of that provider/domain lacks.
static std::string describe_misfits(const Api& api, uint32_t ver, const std::string& provider, const std::string& domain) {
  info* h = make_hints(api, provider, domain, false, false);
  info* list = nullptr;
  const int rc = h ? api.getinfo(ver, nullptr, nullptr, 0, h, &list) : -1;
  if (h) api.freeinfo(h);
  if (rc != 0 || !list) {
    std::string what = provider.empty() ? "libfabric lists no provider" : "libfabric has no provider '" + provider + "'";
    if (!domain.empty()) what += " with domain '" + domain + "'";
    return what + (rc != 0 ? std::string(" (fi_getinfo: ") + api.strerror(-rc) + ")" : "");
  }
  std::ostringstream s;
  int n = 0;
  std::string domains;
  for (info* i = list; i; i = i->next)
    if (i->domain->name && domains.find(std::string(" ") + i->domain->name + ",") == std::string::npos)
      domains += std::string(" ") + i->domain->name + ",";
  for (info* i = list; i && n < 6; i = i->next) {
    if (!on_domain(i, domain)) continue;
    ++n;
    std::string lacks;
    auto need = [&](bool ok, const char* w) {
      if (!ok) lacks += (lacks.empty() ? "" : ", ") + std::string(w);
    };
    need(i->ep->type == EP_RDM, "FI_EP_RDM");
    need(i->caps & RMA, "FI_RMA");
    need(i->caps & MSG, "FI_MSG");
    need(i->domain->cq_data_size >= 4, "remote CQ data of 4 bytes");
    s << (n ? "; " : "") << i->fabric->prov_name << " domain " << i->domain->name << " ep type " << i->ep->type
      << (lacks.empty() ? " (refused the transport's hints: mode or mr_mode)" : " lacks " + lacks);
  }
  api.freeinfo(list);
  if (n == 0) return "no entry on domain '" + domain + "' (domains:" + domains.substr(0, domains.size() - 1) + ")";
  return s.str();
}

info* choose_info(const Api& api, const std::string& provider, const std::string& domain, std::string* why) {
  const uint32_t ver = api_version(api, why);
  if (!ver) return nullptr;
  // "": efa first (the fabric this transport is for), then whatever libfabric ranks first that
  // reaches other hosts (with HMEM before without).
  const std::string tries[2] = {provider.empty() ? "efa" : provider, ""};
  for (int t = 0; t < (provider.empty() ? 2 : 1); ++t) {
    for (bool hmem : {true, false}) {
      info* h = make_hints(api, tries[t], domain, true, hmem);
      if (!h) {
        *why = "fi_dupinfo failed";
        return nullptr;
      }
      info* list = nullptr;
      const int rc = api.getinfo(ver, nullptr, nullptr, 0, h, &list);
      api.freeinfo(h);
      if (rc != 0 || !list) continue;
      // Move the first fitting entry to the front (the rest stay for the caller to free).
      for (info* i = list; i; i = i->next)
        if (fits(i) && on_domain(i, domain) && !(provider.empty() && host_only(i))) {
          if (i != list) {
            info* dup = api.dupinfo(i);
            api.freeinfo(list);
            if (dup && dup->next) {
              api.freeinfo(dup->next);
              dup->next = nullptr;
            }
            return dup;
          }
          return list;
        }
      api.freeinfo(list);
    }
  }
  *why = "no libfabric provider" + (provider.empty() ? std::string() : " '" + provider + "'") +
         (domain.empty() ? "" : " on domain '" + domain + "'") +
         " offers FI_EP_RDM with FI_MSG|FI_RMA and remote CQ data of at least 4 bytes: " +
         describe_misfits(api, ver, provider, domain);
  return nullptr;
}

static std::string json_str(const char* s) {
  std::string out = "\"";
  for (const char* p = s ? s : ""; *p; ++p) {
    if (*p == '"' || *p == '\\') out += '\\';
    if (static_cast<unsigned char>(*p) >= 0x20) out += *p;
  }
  return out + "\"";
}

std::string providers_json(const std::string& provider) {
  std::string why;
  const Api* api = load_fabric(&why);
  if (!api) return "{\"error\": " + json_str(why.c_str()) + "}";
  const uint32_t ver = api_version(*api, &why);
  if (!ver) return "{\"error\": " + json_str(why.c_str()) + "}";
  info* h = make_hints(*api, provider, "", false, false);
  info* list = nullptr;
  const int rc = h ? api->getinfo(ver, nullptr, nullptr, 0, h, &list) : -1;
  if (h) api->freeinfo(h);
  const uint32_t lib = api->version();
  std::ostringstream s;
  s << "{\"library_version\": \"" << (lib >> 16) << "." << (lib & 0xFFFF) << "\", \"api_version\": \"" << (ver >> 16)
    << "." << (ver & 0xFFFF) << "\", \"entries\": [";
  int n = 0;
  for (info* i = rc == 0 ? list : nullptr; i; i = i->next, ++n) {
    s << (n ? ", " : "") << "{\"provider\": " << json_str(i->fabric->prov_name)
      << ", \"fabric\": " << json_str(i->fabric->name) << ", \"domain\": " << json_str(i->domain->name)
      << ", \"ep_type\": " << json_str(i->ep->type == EP_RDM ? "FI_EP_RDM" : i->ep->type == EP_MSG ? "FI_EP_MSG"
                                        : i->ep->type == EP_DGRAM ? "FI_EP_DGRAM" : "other")
      << ", \"rma\": " << ((i->caps & RMA) ? "true" : "false") << ", \"msg\": " << ((i->caps & MSG) ? "true" : "false")
      << ", \"hmem\": " << ((i->caps & HMEM) ? "true" : "false")
      << ", \"mr_mode\": " << json_str(mr_mode_names(i->domain->mr_mode).c_str())
      << ", \"cq_data_size\": " << i->domain->cq_data_size
      << ", \"data_progress\": " << json_str(i->domain->data_progress == PROGRESS_AUTO ? "auto" : "manual")
      << ", \"max_msg_size\": " << i->ep->max_msg_size << ", \"usable\": " << (fits(i) ? "true" : "false") << "}";
  }
  if (list) api->freeinfo(list);
  s << "]" << (rc != 0 ? ", \"getinfo_error\": " + json_str(api->strerror(-rc)) : std::string()) << "}";
  return s.str();
}

}  // namespace fi
}  // namespace moe_ep
