// CharCorpus: see char_corpus.h.
#include "spillway/cli/char_corpus.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iterator>

namespace spillway::cli {

uint8_t CharCorpus::Encode(unsigned char c) {
  if (c == '\n') return 95;
  if (c >= 32 && c < 127) return static_cast<uint8_t>(c - 32);
  return 0;  // space
}

char CharCorpus::Decode(int64_t id) {
  if (id == 95) return '\n';
  if (id >= 0 && id < 95) return static_cast<char>(id + 32);
  return '?';
}

Result<CharCorpus> CharCorpus::Load(const std::string& path, uint64_t min_tokens) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    return Status::InvalidArgument(StrCat("--data ", path, ": cannot open (", ErrnoText(errno),
                                          "); pass a readable text file"));
  }
  const std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  if (in.bad()) {
    return Status::InvalidArgument(
        StrCat("--data ", path, ": read failed (", ErrnoText(errno), ")"));
  }
  if (text.size() < min_tokens) {
    return Status::InvalidArgument(
        StrCat("--data ", path, " holds ", text.size(), " characters; the model needs at least ",
               min_tokens,
               " (one sequence plus its target): pass a longer text or a "
               "smaller seq_len"));
  }
  CharCorpus c;
  c.path_ = path;
  c.tokens_.reserve(text.size());
  for (unsigned char ch : text) c.tokens_.push_back(Encode(ch));
  return c;
}

}  // namespace spillway::cli
