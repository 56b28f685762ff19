// Built when the CUDA backend is not compiled in: asking for it is an nsa::Error at the API.
#include "common/plan.h"

namespace nsa::detail {
const BackendOps* cuda_backend() { return nullptr; }
bool cuda_device_present() { return false; }
}  // namespace nsa::detail
