// The RDMA devices libibverbs sees (EFA devices too), as JSON for `python -m moe_ep.doctor`: per
// device its ibv_query_device attributes and its ports (ibv_query_port, the non-empty GIDs).
// Opens each device briefly; creates nothing on it.
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>

#include "rdma_probe.h"
#include "verbs_abi.h"

namespace moe_ep {

namespace {

std::string quoted(const std::string& s) {
  std::string o = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += char(c);
    } else if (c < 0x20) {
      char b[8];
      std::snprintf(b, sizeof(b), "\\u%04x", c);
      o += b;
    } else {
      o += char(c);
    }
  }
  return o + "\"";
}

std::string gid_text(const ibv::gid& g) {
  char s[40];
  std::snprintf(s, sizeof(s), "%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x:%02x%02x", g.raw[0],
                g.raw[1], g.raw[2], g.raw[3], g.raw[4], g.raw[5], g.raw[6], g.raw[7], g.raw[8], g.raw[9], g.raw[10],
                g.raw[11], g.raw[12], g.raw[13], g.raw[14], g.raw[15]);
  return s;
}

void port_json(std::ostringstream& o, const ibv::Api& v, ibv::context* ctx, int port) {
  ibv::port_attr pa{};
  o << "{\"port\":" << port;
  if (int rc = v.query_port(ctx, uint8_t(port), &pa); rc != 0) {
    o << ",\"error\":" << quoted("ibv_query_port failed (" + std::to_string(rc) + ")") << "}";
    return;
  }
  o << ",\"state\":" << pa.state << ",\"active\":" << (pa.state == ibv::PORT_ACTIVE ? "true" : "false")
    << ",\"link_layer\":" << int(pa.link_layer) << ",\"max_mtu\":" << pa.max_mtu << ",\"active_mtu\":" << pa.active_mtu
    << ",\"lid\":" << pa.lid << ",\"gid_tbl_len\":" << pa.gid_tbl_len << ",\"active_width\":" << int(pa.active_width)
    << ",\"active_speed\":" << int(pa.active_speed) << ",\"phys_state\":" << int(pa.phys_state) << ",\"gids\":[";
  bool first = true;
  for (int k = 0; k < pa.gid_tbl_len && k < 64; ++k) {
    ibv::gid g{};
    if (v.query_gid(ctx, uint8_t(port), k, &g) != 0) continue;
    bool zero = true;
    for (uint8_t b : g.raw) zero = zero && b == 0;
    if (zero) continue;
    o << (first ? "" : ",") << "{\"index\":" << k << ",\"gid\":" << quoted(gid_text(g)) << "}";
    first = false;
  }
  o << "]}";
}

}  // namespace

std::string rdma_devices_json() {
  std::string why;
  const ibv::Api* v = ibv::load_verbs(&why);
  if (!v) return "{\"error\":" + quoted(why) + "}";
  std::ostringstream o;
  o << "{\"devices\":[";
  int n = 0;
  ibv::device** list = v->get_device_list(&n);
  for (int i = 0; list && i < n; ++i) {
    const std::string name = v->get_device_name(list[i]);
    o << (i ? "," : "") << "{\"name\":" << quoted(name);
    ibv::context* ctx = v->open_device(list[i]);
    if (!ctx) {
      o << ",\"error\":" << quoted("ibv_open_device failed") << "}";
      continue;
    }
    ibv::device_attr da{};
    if (v->query_device && v->query_device(ctx, &da) == 0) {
      o << ",\"fw_ver\":" << quoted(std::string(da.fw_ver, strnlen(da.fw_ver, sizeof(da.fw_ver))))
        << ",\"vendor_id\":" << da.vendor_id << ",\"vendor_part_id\":" << da.vendor_part_id
        << ",\"max_qp\":" << da.max_qp << ",\"max_qp_wr\":" << da.max_qp_wr << ",\"max_sge\":" << da.max_sge
        << ",\"max_cq\":" << da.max_cq << ",\"max_cqe\":" << da.max_cqe << ",\"max_mr\":" << da.max_mr
        << ",\"max_mr_size\":" << da.max_mr_size << ",\"max_ah\":" << da.max_ah
        << ",\"device_cap_flags\":" << da.device_cap_flags << ",\"phys_port_cnt\":" << int(da.phys_port_cnt);
    } else {
      da.phys_port_cnt = 1;
      o << ",\"query_device_error\":true";
    }
    o << ",\"ports\":[";
    for (int p = 1; p <= int(da.phys_port_cnt); ++p) {
      if (p > 1) o << ",";
      port_json(o, *v, ctx, p);
    }
    o << "]}";
    v->close_device(ctx);
  }
  if (list) v->free_device_list(list);
  o << "]}";
  return o.str();
}

}  // namespace moe_ep
