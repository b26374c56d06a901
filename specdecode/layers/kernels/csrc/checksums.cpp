// ---------------------------------------------------------------------------------------------
// words_sums(base, fd, items) -> [sum or None]: the packed-weight cache's checksums (models/packed_cache.py),
// all of an entry's tensors in one call that releases the GIL. Each item is (offset, nbytes, from_file): the
// sum modulo 2^64 of the ceil(nbytes / 8) little-endian 64-bit words at that offset, read from the mapping at
// ``base`` or, for tensors read sparsely, with pread from ``fd`` (their pages then stay out of the resident
// set). None: the file ended inside the item. One call lets a start-up's checksums overlap the work other
// threads do under the GIL (the tokenizer's parse, the web stack's imports), instead of waiting for the GIL
// once per tensor.
#include "common.h"

namespace specdecode {
namespace {

static uint64_t words_sum(const uint8_t* p, int64_t nwords) {
  uint64_t acc[4] = {0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 4 <= nwords; i += 4) {
    uint64_t w[4];
    std::memcpy(w, p + 8 * i, sizeof(w));
    acc[0] += w[0]; acc[1] += w[1]; acc[2] += w[2]; acc[3] += w[3];
  }
  for (; i < nwords; ++i) {
    uint64_t w;
    std::memcpy(&w, p + 8 * i, sizeof(w));
    acc[0] += w;
  }
  return acc[0] + acc[1] + acc[2] + acc[3];
}

}  // namespace

PyObject* py_words_sums(PyObject*, PyObject* args) {
  long long base;
  int fd;
  PyObject* items;
  if (!PyArg_ParseTuple(args, "LiO", &base, &fd, &items)) return nullptr;
  PyObject* seq = PySequence_Fast(items, "words_sums: items must be a sequence");
  if (seq == nullptr) return nullptr;
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
  std::vector<long long> off(n), len(n);
  std::vector<int> from_file(n);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* it = PySequence_Fast_GET_ITEM(seq, i);
    if (!PyArg_ParseTuple(it, "LLp", &off[i], &len[i], &from_file[i])) {
      Py_DECREF(seq);
      return nullptr;
    }
    if (off[i] < 0 || len[i] < 0 || (!from_file[i] && base == 0)) {
      Py_DECREF(seq);
      PyErr_SetString(PyExc_ValueError, "words_sums: bad item");
      return nullptr;
    }
  }
  Py_DECREF(seq);
  std::vector<uint64_t> sums(n, 0);
  std::vector<char> ok(n, 1);
  Py_BEGIN_ALLOW_THREADS
  at::parallel_for(0, n, 1, [&](int64_t i0, int64_t i1) {
    constexpr int64_t kChunk = 4 << 20;  // bytes per pread, a multiple of 8
    std::vector<uint8_t> buf;
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t padded = (len[i] + 7) / 8 * 8;
      if (!from_file[i]) {
        sums[i] = words_sum(ptr<const uint8_t>(base + off[i]), padded / 8);
        continue;
      }
      if (buf.empty()) buf.resize(kChunk);
      uint64_t total = 0;
      for (int64_t done = 0; done < padded;) {
        const int64_t want = std::min(kChunk, padded - done);
        int64_t got = 0;
        while (got < want) {
          const ssize_t r = pread(fd, buf.data() + got, want - got, off[i] + done + got);
          if (r <= 0) break;
          got += r;
        }
        if (got < want) {
          ok[i] = 0;
          break;
        }
        total += words_sum(buf.data(), want / 8);
        done += want;
      }
      sums[i] = total;
    }
  });
  Py_END_ALLOW_THREADS
  PyObject* out = PyList_New(n);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* v = ok[i] ? PyLong_FromUnsignedLongLong(sums[i]) : (Py_INCREF(Py_None), Py_None);
    if (v == nullptr) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, i, v);
  }
  return out;
}

}  // namespace specdecode
