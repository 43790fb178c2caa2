// validate.h — tensor checks of src/core/attention.cpp shared with other validating entry points
// (core/block_sparse.cpp, core/kvcache.cpp), so that every argument is checked by one piece of
// code.
#pragma once

#include "flare/status.h"
#include "flare/tensor.h"

namespace flare {

// Presence and rank: `t` is given and has `ndim` dimensions (`layout` names them in the message).
// Every later check indexes shape[0 .. ndim), so this comes first.
Status check_tensor_rank(const TensorView& t, const char* name, int ndim, const char* layout);
// Rank already checked: non-negative shape and strides, element offsets within int64, a known
// dtype and device, and, when it has elements, a non-null pointer aligned to its element size.
Status check_tensor_view(const TensorView& t, const char* name);
// Whether two views share an element's bytes (exact for views of one lattice, else conservative).
bool tensors_share_memory(const TensorView& a, const TensorView& b);
// `t` is on q's device (type and, for CUDA, index); all tensors of a call share one device.
Status check_same_device_as_q(const TensorView& t, const char* name, const TensorView& q);

}  // namespace flare
