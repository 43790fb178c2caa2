// checkpoint.cpp — the checkpoint file (format in checkpoint.h): an encoder and a decoder of the
// fields, an atomic writer, and a reader that verifies everything before it fills a buffer.
#include "train/core/checkpoint.h"

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <type_traits>

#include "core/message.h"
#include "train/core/atomic_file.h"
#include "train/core/crc32.h"

namespace flare::train {
namespace {

static_assert(std::endian::native == std::endian::little,
              "checkpoints are little-endian and written from memory as is");

constexpr char kMagic[8] = {'F', 'L', 'A', 'R', 'E', 'C', 'K', 'P'};
constexpr int64_t kMaxNameBytes = 4096;
// Offset of file_bytes: after the magic, the version and the reserved word.
constexpr long kFileBytesOffset = 16;

// ---- encoding the fields before the buffers ------------------------------------------------

class Encoder {
 public:
  template <typename T>
  void put(T value) {
    static_assert(std::is_arithmetic_v<T>);
    append(&value, sizeof value);
  }
  void append(const void* p, size_t n) {
    const auto* b = static_cast<const uint8_t*>(p);
    bytes_.insert(bytes_.end(), b, b + n);
  }
  std::vector<uint8_t>& bytes() { return bytes_; }

 private:
  std::vector<uint8_t> bytes_;
};

void encode_model(const ModelConfig& c, Encoder& e) {
  e.put(static_cast<uint32_t>(c.family));
  e.put(static_cast<uint32_t>(c.name.size()));
  e.append(c.name.data(), c.name.size());
  for (int64_t x : {c.vocab_size, c.padded_vocab, c.n_layer, c.d_model, c.n_head, c.n_kv_head,
                    c.head_dim, c.ffn_hidden, c.max_seq})
    e.put(x);
  e.put(c.norm_eps);
  e.put(c.rope_theta);
  e.put(static_cast<uint8_t>(c.rope_scaling.enabled));
  e.put(c.rope_scaling.factor);
  e.put(c.rope_scaling.low_freq_factor);
  e.put(c.rope_scaling.high_freq_factor);
  e.put(c.rope_scaling.original_max_position);
  e.put(static_cast<uint8_t>(c.tied_embeddings));
}

void encode_train(const TrainConfig& t, Encoder& e) {
  for (int64_t x : {t.batch, t.seq, t.grad_accum, t.steps}) e.put(x);
  e.put(t.lr);
  e.put(t.min_lr);
  e.put(t.warmup);
  for (double x : {t.weight_decay, t.beta1, t.beta2, t.eps, t.grad_clip}) e.put(x);
  e.put(t.seed);
  e.put(static_cast<uint8_t>(t.recompute));
  e.put(t.eval_every);
  e.put(t.ckpt_every);
}

// Everything before the buffers, with file_bytes filled in for `n` elements per buffer.
std::vector<uint8_t> encode_header(const CheckpointMeta& meta, int64_t n) {
  Encoder e;
  e.append(kMagic, sizeof kMagic);
  e.put(kCheckpointVersion);
  e.put(uint32_t{0});
  e.put(uint64_t{0});  // file_bytes, patched below
  encode_model(meta.model, e);
  encode_train(meta.train, e);
  e.put(meta.step);
  e.put(meta.rng_seed);
  e.put(meta.rng_offset);
  e.put(static_cast<uint64_t>(meta.loader_state.size()));
  e.append(meta.loader_state.data(), meta.loader_state.size());
  e.put(n);
  std::vector<uint8_t>& bytes = e.bytes();
  const uint64_t file_bytes = bytes.size() + 3 * sizeof(float) * static_cast<uint64_t>(n) + 4;
  std::memcpy(bytes.data() + kFileBytesOffset, &file_bytes, sizeof file_bytes);
  return bytes;
}

// ---- writing ---------------------------------------------------------------------------------

// The whole file: header, the three buffers, the CRC of everything before it.
bool write_checkpoint_body(FILE* f, const std::vector<uint8_t>& header, const float* const buffers[3],
                           int64_t n) {
  Crc32 crc;
  if (std::fwrite(header.data(), 1, header.size(), f) != header.size()) return false;
  crc.update(header.data(), header.size());
  for (int b = 0; b < 3; ++b) {
    const size_t bytes = sizeof(float) * static_cast<size_t>(n);
    if (std::fwrite(buffers[b], 1, bytes, f) != bytes) return false;
    crc.update(buffers[b], bytes);
  }
  const uint32_t checksum = crc.value();
  return std::fwrite(&checksum, sizeof checksum, 1, f) == 1;
}

std::string errno_text() { return std::strerror(errno); }

// ---- reading ---------------------------------------------------------------------------------

// Reads fields in order from an open file; the first short read marks the file truncated.
class Decoder {
 public:
  explicit Decoder(FILE* f) : f_(f) {}
  template <typename T>
  T get() {
    T value{};
    read(&value, sizeof value);
    return value;
  }
  void read(void* p, size_t n) {
    if (ok_ && n > 0) ok_ = std::fread(p, 1, n, f_) == n;
  }
  // A field whose value cannot be right marks the header malformed, as a short read does.
  void fail() { ok_ = false; }
  bool ok() const { return ok_; }

 private:
  FILE* f_;
  bool ok_ = true;
};

void decode_model(Decoder& d, ModelConfig* c) {
  const uint32_t family = d.get<uint32_t>();
  if (family > static_cast<uint32_t>(Family::kLlama)) d.fail();
  c->family = static_cast<Family>(family);
  const uint32_t name_bytes = d.get<uint32_t>();
  if (name_bytes > kMaxNameBytes) {
    d.fail();
    return;
  }
  c->name.resize(name_bytes);
  d.read(c->name.data(), name_bytes);
  for (int64_t* x : {&c->vocab_size, &c->padded_vocab, &c->n_layer, &c->d_model, &c->n_head,
                     &c->n_kv_head, &c->head_dim, &c->ffn_hidden, &c->max_seq})
    *x = d.get<int64_t>();
  c->norm_eps = d.get<double>();
  c->rope_theta = d.get<double>();
  c->rope_scaling.enabled = d.get<uint8_t>() != 0;
  c->rope_scaling.factor = d.get<double>();
  c->rope_scaling.low_freq_factor = d.get<double>();
  c->rope_scaling.high_freq_factor = d.get<double>();
  c->rope_scaling.original_max_position = d.get<int64_t>();
  c->tied_embeddings = d.get<uint8_t>() != 0;
}

void decode_train(Decoder& d, TrainConfig* t) {
  for (int64_t* x : {&t->batch, &t->seq, &t->grad_accum, &t->steps}) *x = d.get<int64_t>();
  t->lr = d.get<double>();
  t->min_lr = d.get<double>();
  t->warmup = d.get<int64_t>();
  for (double* x : {&t->weight_decay, &t->beta1, &t->beta2, &t->eps, &t->grad_clip})
    *x = d.get<double>();
  t->seed = d.get<uint64_t>();
  t->recompute = d.get<uint8_t>() != 0;
  t->eval_every = d.get<int64_t>();
  t->ckpt_every = d.get<int64_t>();
}

// An open checkpoint whose magic, version, size and checksum have been verified, positioned at
// the start of its buffers once its metadata has been read.
class CheckpointReader {
 public:
  ~CheckpointReader() {
    if (f_ != nullptr) std::fclose(f_);
  }

  Status open_and_verify(const std::string& path, CheckpointMeta* meta, int64_t* n) {
    path_ = path;
    f_ = std::fopen(path.c_str(), "rb");
    if (f_ == nullptr) return invalid("path: cannot open '", path, "': ", errno_text());
    FLARE_RETURN_IF_ERROR(check_magic_version_size());
    FLARE_RETURN_IF_ERROR(check_checksum());
    return read_meta(meta, n);
  }

  Status read_buffers(float* const buffers[3], int64_t n) {
    const size_t bytes = sizeof(float) * static_cast<size_t>(n);
    for (int b = 0; b < 3; ++b) {
      if (std::fread(buffers[b], 1, bytes, f_) != bytes)
        return invalid("path: '", path_, "': reading the buffers failed: ", errno_text());
    }
    return Status::ok_status();
  }

 private:
  Status check_magic_version_size() {
    if (std::fseek(f_, 0, SEEK_END) != 0) return invalid("path: '", path_, "' is not seekable");
    const long size = std::ftell(f_);
    std::rewind(f_);
    Decoder d(f_);
    char magic[sizeof kMagic];
    d.read(magic, sizeof magic);
    if (!d.ok() || std::memcmp(magic, kMagic, sizeof kMagic) != 0)
      return invalid("path: '", path_, "' is not a flare checkpoint (wrong magic)");
    const uint32_t version = d.get<uint32_t>();
    d.get<uint32_t>();
    const uint64_t file_bytes = d.get<uint64_t>();
    if (!d.ok()) return invalid("path: '", path_, "' is truncated: ", size, " bytes");
    if (version != kCheckpointVersion)
      return invalid("path: '", path_, "' has checkpoint version ", version,
                     "; this build reads version ", kCheckpointVersion);
    if (file_bytes != static_cast<uint64_t>(size))
      return invalid("path: '", path_, "' is ",
                     static_cast<uint64_t>(size) < file_bytes ? "truncated" : "longer than written",
                     ": ", size, " bytes, its header says ", file_bytes);
    size_ = size;
    return Status::ok_status();
  }

  Status check_checksum() {
    std::rewind(f_);
    Crc32 crc;
    std::vector<uint8_t> chunk(size_t{1} << 20);
    int64_t left = size_ - 4;
    while (left > 0) {
      const size_t want = static_cast<size_t>(std::min<int64_t>(left, static_cast<int64_t>(chunk.size())));
      if (std::fread(chunk.data(), 1, want, f_) != want)
        return invalid("path: '", path_, "': read failed: ", errno_text());
      crc.update(chunk.data(), want);
      left -= static_cast<int64_t>(want);
    }
    uint32_t stored = 0;
    if (std::fread(&stored, sizeof stored, 1, f_) != 1)
      return invalid("path: '", path_, "': read failed: ", errno_text());
    if (stored != crc.value())
      return invalid("path: '", path_, "' fails its checksum (stored CRC-32 ", stored,
                     ", computed ", crc.value(), "): the file is corrupt");
    return Status::ok_status();
  }

  Status read_meta(CheckpointMeta* meta, int64_t* n) {
    if (std::fseek(f_, kFileBytesOffset + 8, SEEK_SET) != 0)
      return invalid("path: '", path_, "' is not seekable");
    Decoder d(f_);
    decode_model(d, &meta->model);
    decode_train(d, &meta->train);
    meta->step = d.get<int64_t>();
    meta->rng_seed = d.get<uint64_t>();
    meta->rng_offset = d.get<uint64_t>();
    const uint64_t loader_bytes = d.get<uint64_t>();
    if (!d.ok() || loader_bytes > static_cast<uint64_t>(size_))
      return invalid("path: '", path_, "' has a malformed header");
    meta->loader_state.resize(loader_bytes);
    d.read(meta->loader_state.data(), loader_bytes);
    *n = d.get<int64_t>();
    const long buffers_at = std::ftell(f_);
    if (!d.ok() || *n < 0 || buffers_at < 0 ||
        static_cast<int64_t>(buffers_at) + 12 * *n + 4 != size_)
      return invalid("path: '", path_, "' has a malformed header");
    return Status::ok_status();
  }

  std::string path_;
  FILE* f_ = nullptr;
  int64_t size_ = 0;
};

}  // namespace

Status check_same_model(const ModelConfig& found, const ModelConfig& expected) {
  auto differ = [](const char* field, auto a, auto b) {
    return invalid(field, ": checkpoint has ", a, ", expected ", b);
  };
  const ModelConfig& f = found;
  const ModelConfig& e = expected;
  if (f.family != e.family) return differ("family", family_name(f.family), family_name(e.family));
  if (f.vocab_size != e.vocab_size) return differ("vocab_size", f.vocab_size, e.vocab_size);
  if (f.padded_vocab != e.padded_vocab) return differ("padded_vocab", f.padded_vocab, e.padded_vocab);
  if (f.n_layer != e.n_layer) return differ("n_layer", f.n_layer, e.n_layer);
  if (f.d_model != e.d_model) return differ("d_model", f.d_model, e.d_model);
  if (f.n_head != e.n_head) return differ("n_head", f.n_head, e.n_head);
  if (f.n_kv_head != e.n_kv_head) return differ("n_kv_head", f.n_kv_head, e.n_kv_head);
  if (f.head_dim != e.head_dim) return differ("head_dim", f.head_dim, e.head_dim);
  if (f.ffn_hidden != e.ffn_hidden) return differ("ffn_hidden", f.ffn_hidden, e.ffn_hidden);
  if (f.max_seq != e.max_seq) return differ("max_seq", f.max_seq, e.max_seq);
  if (f.norm_eps != e.norm_eps) return differ("norm_eps", f.norm_eps, e.norm_eps);
  if (f.rope_theta != e.rope_theta) return differ("rope_theta", f.rope_theta, e.rope_theta);
  const RopeScaling& fs = f.rope_scaling;
  const RopeScaling& es = e.rope_scaling;
  if (fs.enabled != es.enabled) return differ("rope_scaling.enabled", fs.enabled, es.enabled);
  if (fs.enabled) {
    if (fs.factor != es.factor) return differ("rope_scaling.factor", fs.factor, es.factor);
    if (fs.low_freq_factor != es.low_freq_factor)
      return differ("rope_scaling.low_freq_factor", fs.low_freq_factor, es.low_freq_factor);
    if (fs.high_freq_factor != es.high_freq_factor)
      return differ("rope_scaling.high_freq_factor", fs.high_freq_factor, es.high_freq_factor);
    if (fs.original_max_position != es.original_max_position)
      return differ("rope_scaling.original_max_position", fs.original_max_position,
                    es.original_max_position);
  }
  if (f.tied_embeddings != e.tied_embeddings)
    return differ("tied_embeddings", f.tied_embeddings, e.tied_embeddings);
  return Status::ok_status();
}

Status save_checkpoint(const std::string& path, const CheckpointMeta& meta, const float* master,
                       const float* m, const float* v, int64_t n) {
  if (path.empty()) return invalid("path: must not be empty");
  if (master == nullptr || m == nullptr || v == nullptr)
    return invalid("save_checkpoint: master, m and v must not be null");
  FLARE_RETURN_IF_ERROR(validate_model_config(meta.model));
  if (meta.model.name.size() > kMaxNameBytes)
    return invalid("model.name: ", meta.model.name.size(), " bytes, at most ", kMaxNameBytes);
  const int64_t expected_n = parameter_layout(meta.model).total;
  if (n != expected_n)
    return invalid("n: ", n, " must equal the layout's total = ", expected_n, " of model '",
                   meta.model.name, "'");

  const float* const buffers[3] = {master, m, v};
  const std::vector<uint8_t> header = encode_header(meta, n);
  return write_file_atomically(
      path, [&](FILE* f) { return write_checkpoint_body(f, header, buffers, n); });
}

Status read_checkpoint_meta(const std::string& path, CheckpointMeta* meta) {
  if (meta == nullptr) return invalid("read_checkpoint_meta: meta must not be null");
  CheckpointReader reader;
  CheckpointMeta read;
  int64_t n = 0;
  FLARE_RETURN_IF_ERROR(reader.open_and_verify(path, &read, &n));
  *meta = std::move(read);
  return Status::ok_status();
}

Status load_checkpoint(const std::string& path, const ModelConfig& expected, CheckpointMeta* meta,
                       float* master, float* m, float* v, int64_t n) {
  if (meta == nullptr || master == nullptr || m == nullptr || v == nullptr)
    return invalid("load_checkpoint: meta, master, m and v must not be null");
  FLARE_RETURN_IF_ERROR(validate_model_config(expected));
  const int64_t expected_n = parameter_layout(expected).total;
  if (n != expected_n)
    return invalid("n: ", n, " must equal the layout's total = ", expected_n, " of model '",
                   expected.name, "'");
  CheckpointReader reader;
  CheckpointMeta read;
  int64_t file_n = 0;
  FLARE_RETURN_IF_ERROR(reader.open_and_verify(path, &read, &file_n));
  Status same = check_same_model(read.model, expected);
  if (!same.ok()) return invalid("path: '", path, "' holds another model: ", same.message());
  if (file_n != n)
    return invalid("path: '", path, "' holds buffers of ", file_n, " elements, expected ", n);
  float* const buffers[3] = {master, m, v};
  FLARE_RETURN_IF_ERROR(reader.read_buffers(buffers, n));
  *meta = std::move(read);
  return Status::ok_status();
}

}  // namespace flare::train
