// Opening libfabric at run time and choosing the fi_info an engine of the libfabric transport
// opens (fabric_load.cc): provider and domain rules, the hints, what is missing when none fits.
#pragma once

#include <cstdint>
#include <string>

#include "fabric_abi.h"

namespace moe_ep {
namespace fi {

// The API version requested from fi_getinfo: FI_VERSION(1, 17), the headers this ABI is checked
// against, or the library's own version where that is older (1.10 at least: FI_MR_HMEM and
// fi_mr_attr.iface).
constexpr uint32_t kApiVersion = version(1, 17);
constexpr uint32_t kMinApiVersion = version(1, 10);

// The mr_mode bits requested, as EFA needs them; the provider returns those it needs.
constexpr int kMrModeAsked = MR_LOCAL | MR_VIRT_ADDR | MR_ALLOCATED | MR_PROV_KEY | MR_ENDPOINT | MR_HMEM;

// libfabric.so.1 (MOE_EP_LIBFABRIC_LIB overrides the name), or null with *why.
const Api* load_fabric(std::string* why);

// The API version to request of `api` (0 with *why when the library is too old).
uint32_t api_version(const Api& api, std::string* why);

// The provider name an engine asks for: `provider`, else MOE_EP_FI_PROVIDER, else FI_PROVIDER,
// else "" (libfabric's choice, efa preferred).
std::string provider_wanted(const std::string& provider);
// The domain (interface) name an engine asks for: `domain`, else MOE_EP_FI_DOMAIN, else "" (the
// provider's first).
std::string domain_wanted(const std::string& domain);

// The fi_info list fitting the transport's needs (FI_EP_RDM, FI_MSG | FI_RMA, remote CQ data of
// at least 4 bytes, FI_AV_TABLE) for `provider` ("": efa if it fits, else any) and `domain` ("":
// any): the first entry is the one to open (the caller frees the list with api.freeinfo). Null
// with *why naming what is missing (no provider of that name, none with RMA, ...).
info* choose_info(const Api& api, const std::string& provider, const std::string& domain, std::string* why);

// Every provider's fi_info entries as JSON: provider, domain, fabric, endpoint type, caps (RMA,
// MSG, HMEM, remote CQ data), mr_mode, cq_data_size, progress, max message size.
std::string providers_json(const std::string& provider);

// "FI_MR_LOCAL|FI_MR_VIRT_ADDR|..." for mr_mode bits ("none" for 0).
std::string mr_mode_names(int mode);

}  // namespace fi
}  // namespace moe_ep
