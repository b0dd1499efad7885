// The device listing (rdma_probe.cc) and the verbs probe of one named device
// (verbs_transport.cc): what capi.cc needs beyond transport.h.
#pragma once

#include <cstdint>
#include <string>

#include "transport.h"

namespace moe_ep {

// verbs_probe for one device and port ("" and 0 = the default choice, as verbs_probe).
bool verbs_probe_device(const std::string& device, int port, std::string* what);

// Every device libibverbs lists (EFA devices included), as JSON: ports (state, link layer, MTU,
// LID, GIDs) and device attributes (ibv_query_device). {"error": why} when libibverbs cannot be
// loaded.
std::string rdma_devices_json();

}  // namespace moe_ep
