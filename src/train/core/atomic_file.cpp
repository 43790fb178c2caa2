// atomic_file.cpp — temporary file, fsync, rename, directory fsync (see atomic_file.h).
#include "train/core/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "core/message.h"

namespace flare::train {
namespace {

std::string errno_text() { return std::strerror(errno); }

// Writes and syncs the temporary file.
Status write_and_sync(const std::string& tmp, const std::function<bool(FILE*)>& write_body) {
  FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return invalid("path: cannot create '", tmp, "': ", errno_text());
  bool ok = write_body(f);
  ok = ok && std::fflush(f) == 0 && ::fsync(fileno(f)) == 0;
  const std::string error = errno_text();
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) return invalid("path: writing '", tmp, "' failed: ", error);
  return Status::ok_status();
}

// Makes the rename durable: the directory entry is flushed like the file was.
void sync_directory(const std::string& path) {
  const size_t slash = path.find_last_of('/');
  const std::string dir =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY);
  if (fd < 0) return;  // the file is complete either way; only durability across power loss waits
  ::fsync(fd);
  ::close(fd);
}

}  // namespace

Status write_file_atomically(const std::string& path, const std::function<bool(FILE*)>& write_body) {
  if (path.empty()) return invalid("path: must not be empty");
  const std::string tmp = path + ".tmp";
  Status written = write_and_sync(tmp, write_body);
  if (!written.ok()) {
    std::remove(tmp.c_str());
    return written;
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string error = errno_text();
    std::remove(tmp.c_str());
    return invalid("path: renaming '", tmp, "' to '", path, "' failed: ", error);
  }
  sync_directory(path);
  return Status::ok_status();
}

}  // namespace flare::train
