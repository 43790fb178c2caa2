// checkpoint.h — everything a run needs to resume bit for bit, in one binary file: the model and
// training configs, the step, the data loader's position, the RNG position, and the fp32 master
// weights with AdamW's m and v.
//
// Format (version 1; all integers and floats little-endian, no padding):
//   "FLARECKP"                 8-byte magic
//   u32 version, u32 0         the 0 is reserved
//   u64 file_bytes             size of the whole file: truncation is caught before anything else
//   model config               u32 family, u32 name length, name bytes, i64 vocab_size,
//                              padded_vocab, n_layer, d_model, n_head, n_kv_head, head_dim,
//                              ffn_hidden, max_seq, f64 norm_eps, rope_theta, u8 rope scaling
//                              enabled, f64 factor, low_freq_factor, high_freq_factor,
//                              i64 original_max_position, u8 tied_embeddings
//   train config               i64 batch, seq, grad_accum, steps, f64 lr, min_lr, i64 warmup,
//                              f64 weight_decay, beta1, beta2, eps, grad_clip, u64 seed,
//                              u8 recompute, i64 eval_every, ckpt_every (paths are not stored:
//                              a resumed run may read its data from elsewhere)
//   i64 step, u64 rng_seed, u64 rng_offset
//   u64 loader bytes, the loader's opaque bytes
//   i64 n                      elements of each buffer: parameter_layout(model).total
//   f32[n] master, f32[n] m, f32[n] v
//   u32 CRC-32 (crc32.h) of every byte before it
//
// Writing is atomic (atomic_file.h): "<path>.tmp", fsync, rename, so a crash or a failed write
// leaves the previous checkpoint whole. Reading checks, in order, magic, version, size, checksum (a full
// pass over the file) and the model against the caller's, and only then fills the caller's
// buffers: a rejected file writes nothing.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "flare/status.h"
#include "train/core/model_config.h"
#include "train/core/train_config.h"

namespace flare::train {

inline constexpr uint32_t kCheckpointVersion = 1;

struct CheckpointMeta {
  ModelConfig model;
  TrainConfig train;                  // paths come back empty
  int64_t step = 0;                   // optimizer steps completed
  uint64_t rng_seed = 0;              // the trainer's counter-based generator: key …
  uint64_t rng_offset = 0;            // … and how far it has advanced
  std::vector<uint8_t> loader_state;  // the data loader's position, opaque here
};

// Writes a checkpoint of buffers of n = parameter_layout(meta.model).total elements each.
Status save_checkpoint(const std::string& path, const CheckpointMeta& meta, const float* master,
                       const float* m, const float* v, int64_t n);

// Reads and verifies a checkpoint's metadata (the whole file is checksummed), no buffers.
Status read_checkpoint_meta(const std::string& path, CheckpointMeta* meta);

// Reads a checkpoint whose model must equal `expected` (every field but the name) into buffers of
// n = parameter_layout(expected).total elements each, and its metadata into *meta.
Status load_checkpoint(const std::string& path, const ModelConfig& expected, CheckpointMeta* meta,
                       float* master, float* m, float* v, int64_t n);

// OK when two configs describe the same model (every field but the name); otherwise names the
// first field that differs: "n_layer: checkpoint has 12, expected 24".
Status check_same_model(const ModelConfig& found, const ModelConfig& expected);

}  // namespace flare::train
