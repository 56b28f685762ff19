// The fast CPU backend (not yet implemented: Backend::cpu reports that it is not compiled in).
#include "common/plan.h"

namespace nsa::detail {
const BackendOps* cpu_backend() { return nullptr; }
}  // namespace nsa::detail
