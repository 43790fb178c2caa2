// atomic_file.h — writing a file all or nothing, for checkpoints and exported weights: the body
// goes to "<path>.tmp" in the same directory (so the rename cannot cross file systems), is
// flushed to disk with fsync, then renamed over <path>, and the directory is synced so the rename
// survives a power cut. Any failure removes the temporary file and leaves <path> as it was.
#pragma once

#include <cstdio>
#include <functional>
#include <string>

#include "flare/status.h"

namespace flare::train {

// `write_body` writes the whole file to the open stream and returns false on any failed write.
Status write_file_atomically(const std::string& path, const std::function<bool(FILE*)>& write_body);

}  // namespace flare::train
