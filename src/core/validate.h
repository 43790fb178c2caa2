// validate.h — tensor checks of src/core/attention.cpp shared with other validating entry points
// (core/block_sparse.cpp), so that every argument is checked by one piece of code.
#pragma once

#include "flare/status.h"
#include "flare/tensor.h"

namespace flare {

// Rank already checked: non-negative shape and strides, element offsets within int64, a known
// dtype and device, and, when it has elements, a non-null pointer aligned to its element size.
Status check_tensor_view(const TensorView& t, const char* name);
// Whether two views share an element's bytes (exact for views of one lattice, else conservative).
bool tensors_share_memory(const TensorView& a, const TensorView& b);

}  // namespace flare
