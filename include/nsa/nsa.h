// Native Sparse Attention (Yuan et al., arXiv 2502.11089): the whole public API.
#pragma once

#include "nsa/api.h"
#include "nsa/blocks.h"
#include "nsa/cache.h"
#include "nsa/config.h"
#include "nsa/error.h"
#include "nsa/tensor.h"
