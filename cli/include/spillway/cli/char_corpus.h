// A character-level corpus: a text file mapped to token ids 0..95 (printable ASCII 32..126 and
// newline; any other byte becomes a space), for the main job's language model.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "spillway/base/status.h"

namespace spillway::cli {

class CharCorpus {
 public:
  static constexpr int64_t kVocab = 96;
  // INVALID_ARGUMENT naming the path when it cannot be read or holds fewer than `min_tokens`.
  static Result<CharCorpus> Load(const std::string& path, uint64_t min_tokens);
  static uint8_t Encode(unsigned char c);
  static char Decode(int64_t id);

  const std::vector<uint8_t>& tokens() const { return tokens_; }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
  std::vector<uint8_t> tokens_;
};

}  // namespace spillway::cli
