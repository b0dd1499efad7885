// The efa transport (efa_transport.cc), the device listing (rdma_probe.cc) and the verbs probe
// of one named device (verbs_transport.cc): what capi.cc needs beyond transport.h.
#pragma once

#include <cstdint>
#include <string>

#include "transport.h"

namespace moe_ep {

// efa transport: one SRD queue pair per engine (efadv), an address handle per peer, writes
// with immediates through the ibv_qp_ex send-ops API; libibverbs and libefa opened at run time.
// device: "" = MOE_EP_IB_DEVICE, else the first EFA device with an active port. Null with the
// thread's error set (naming the missing library, device or capability) on failure.
Transport* create_efa_transport(int rank, int world, const std::string& device, const JobIdentity& id = {});
// True when an efa engine could be created here (on `device`); *what names the device and its capabilities,
// or why not (library missing, no EFA device, a capability missing).
// device "" = the default choice, as create_efa_transport.
bool efa_probe(const std::string& device, std::string* what);

// What an EFA device needs from efadv_query_device's device_caps: RDMA write, and a way to
// receive a write with immediate that found no receive posted (unsolicited write receive, or
// else RNR retry). Returns "" when `caps` suffices, else the missing capabilities by name.
std::string efa_missing_caps(uint32_t caps);
// The capabilities in `caps` by name ("rdma read, rnr retry, ...").
std::string efa_caps_names(uint32_t caps);

// verbs_probe for one device and port ("" and 0 = the default choice, as verbs_probe).
bool verbs_probe_device(const std::string& device, int port, std::string* what);

// Every device libibverbs lists, as JSON: ports (state, link layer, MTU, LID, GIDs), device
// attributes (ibv_query_device) and, for EFA devices, efadv_query_device's. {"error": why} when
// libibverbs cannot be loaded.
std::string rdma_devices_json();

}  // namespace moe_ep
