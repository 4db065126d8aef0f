// Sampling distributions on the CPU: temperature, top-k and top-p for every row of a step in one call
// (fp32). The same maths as decoders/common.py logits_to_probs with top-k on:
//   v = logits / T;  the k largest v, descending;  p = softmax over those k;
//   top-p: keep p_i while the mass before it, sum_{j<i} p_j, is at most top_p;  renormalise;
//   out = zeros with the kept p at their token ids.
//
// Why: the torch path is ~10 ops per step (a top-k over the vocabulary, softmax, cumsum, masks, a
// scatter into a zeroed [rows, vocab]), ~0.3 ms per step at batch 8 on a 2-core CPU, a few percent of
// a speculative step. Here each row takes one vector pass over its logits for the values above a
// threshold drawn from a sample of it (which hold the k largest) and sorts only those; rows are split
// over threads.
//
// Ties at the k-th value keep the lowest token ids (torch.topk leaves them unspecified). A row's result
// does not depend on the other rows.
//
// Also here, being host work of a step too: one draw from a distribution (aspire_draw) and ASPIRE's
// page selection (aspire_select_pages).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <utility>
#include <vector>

namespace {

constexpr int VL = 16;
typedef float vf __attribute__((vector_size(64)));
typedef int32_t vi __attribute__((vector_size(64)));

struct Cand {
  float v;
  int64_t i;
};
// "a comes first in the output": larger value, then lower token id.
inline bool first(const Cand& a, const Cand& b) { return a.v > b.v || (a.v == b.v && a.i < b.i); }

inline bool any_lane(vi m) {
  bool any = false;
  for (int t = 0; t < VL; ++t) any |= m[t] != 0;
  return any;
}

// Every logit at or above a threshold, with its id (NaN never), such that the k largest are among
// them: the threshold is a value of rank ~2k/vocab in a strided sample of the row, so ~2k values pass
// and pass one vector compare; where fewer than k do, every value is taken (-inf included).
void candidates(const float* x, int64_t vocab, int64_t k, std::vector<Cand>& cand, std::vector<float>& sample) {
  const int64_t stride = vocab >= 4 * 256 ? vocab / 256 : 1;
  sample.clear();
  for (int64_t j = 0; j < vocab; j += stride)
    if (!std::isnan(x[j])) sample.push_back(x[j]);
  const int64_t ns = static_cast<int64_t>(sample.size());
  const int64_t rank = std::min<int64_t>(ns, (2 * k * ns + vocab - 1) / vocab + 2);  // 1-based, from the top
  float thr = -INFINITY;
  if (rank >= 1 && rank < ns) {
    std::nth_element(sample.begin(), sample.begin() + (rank - 1), sample.end(), std::greater<float>());
    thr = sample[rank - 1];
  }
  for (int pass = 0; pass < 2; ++pass, thr = -INFINITY) {
    cand.clear();
    const vf tv = vf{} + thr;
    int64_t j = 0;
    for (; j + VL <= vocab; j += VL) {
      vf v;
      std::memcpy(&v, x + j, sizeof v);
      if (any_lane(v >= tv))
        for (int t = 0; t < VL; ++t)
          if (v[t] >= thr) cand.push_back({v[t], j + t});
    }
    for (; j < vocab; ++j)
      if (x[j] >= thr) cand.push_back({x[j], j});
    if (static_cast<int64_t>(cand.size()) >= k || thr == -INFINITY) return;
  }
}

void row_probs(const float* x, int64_t vocab, float temperature, int64_t k, double top_p, float* out,
               std::vector<Cand>& cand, std::vector<float>& p) {
  candidates(x, vocab, k, cand, p);
  const int64_t n = std::min<int64_t>(k, static_cast<int64_t>(cand.size()));
  std::partial_sort(cand.begin(), cand.begin() + n, cand.end(), first);  // descending values
  std::memset(out, 0, vocab * sizeof(float));
  if (n == 0) return;
  p.resize(n);
  const float m = cand[0].v / temperature;
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) sum += p[t] = std::exp(cand[t].v / temperature - m);
  for (int64_t t = 0; t < n; ++t) p[t] /= sum;
  int64_t keep = n;
  if (top_p < 1.0) {
    double before = 0.0;  // the mass ahead of token t
    for (int64_t t = 0; t < n; ++t) {
      if (before > top_p) {
        keep = t;
        break;
      }
      before += p[t];
    }
  }
  float kept = 0.f;
  for (int64_t t = 0; t < keep; ++t) kept += p[t];
  for (int64_t t = 0; t < keep; ++t) out[cand[t].i] = p[t] / kept;
}

}  // namespace

// logits, out: [rows, vocab] fp32, contiguous. k >= 1. Returns 0, or 1 on bad arguments.
extern "C" int aspire_top_k_probs(const float* logits, int64_t rows, int64_t vocab, float temperature, int64_t k,
                                  double top_p, float* out, int num_threads) {
  if (rows < 0 || vocab < 1 || k < 1 || !(temperature > 0.f) || num_threads < 1) return 1;
  k = k < vocab ? k : vocab;
#pragma omp parallel num_threads(rows > 1 ? num_threads : 1)
  {
    std::vector<Cand> cand;
    std::vector<float> p;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      row_probs(logits + r * vocab, vocab, temperature, k, top_p, out + r * vocab, cand, p);
  }
  return 0;
}

// One draw by inverting the CDF of p (q null) or of max(0, p - q) (rejection sampling's residual,
// unnormalised), as decoders/common.py sample_from does with torch ops: running sums in double, each
// rounded to float (torch.cumsum's fp32 result); u in [0, 1) times the total in float; the first i
// whose sum exceeds it, else the last entry with mass (u rounded up to the total). The same index as
// the torch ops, in two passes over n floats instead of ~6 ops of per-call cost. Returns -1 when
// nothing has mass.
extern "C" int64_t aspire_draw(const float* p, const float* q, int64_t n, float u) {
  auto mass = [&](int64_t i) {
    const float r = q ? p[i] - q[i] : p[i];
    return r > 0.f ? r : 0.f;
  };
  // Adding a zero leaves a double sum unchanged, so only entries with mass are added: after top-k
  // that is a few dozen of the vocabulary, and the chain of dependent double adds stays short.
  double acc = 0.0;
  int64_t last = -1;
  for (int64_t i = 0; i < n; ++i) {
    const float m = mass(i);
    if (m > 0.f) {
      acc += m;
      last = i;
    }
  }
  const float target = u * static_cast<float>(acc);
  acc = 0.0;
  for (int64_t i = 0; i <= last; ++i) {
    const float m = mass(i);
    if (m > 0.f) {
      acc += m;
      if (static_cast<float>(acc) > target) return i;
    }
  }
  return last;
}

// ASPIRE's draft page set, as decoders/selection.py select_pages defines it: the n_recent last pages,
// and for the rest of the budget the highest-scoring older pages (a page past the n_scored scored ones
// scores -1, a NaN score counts as -inf, ties keep the lower page), ascending. out: budget entries.
// scores may be null (nothing scored yet). Here because the numpy ops cost a decoding step ~0.3-0.6 ms
// at 16k: run right after a forward that streamed the KV through the caches, each op's code comes back
// from memory. Returns 0, or 1 on bad arguments.
extern "C" int aspire_select_pages(const float* scores, int64_t n_scored, int64_t num_pages, int64_t budget,
                                   int64_t n_recent, int64_t* out) {
  if (budget < 1 || budget >= num_pages || n_recent < 0 || n_scored < 0) return 1;
  n_recent = std::min(n_recent, budget);
  const int64_t older = num_pages - n_recent, k = budget - n_recent;
  std::vector<std::pair<float, int64_t>> cand(older);
  for (int64_t i = 0; i < older; ++i) {
    const float s = i < n_scored ? scores[i] : -1.f;
    cand[i] = {std::isnan(s) ? -INFINITY : s, i};
  }
  auto better = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  if (k < older) std::nth_element(cand.begin(), cand.begin() + k, cand.end(), better);
  for (int64_t t = 0; t < k; ++t) out[t] = cand[t].second;
  std::sort(out, out + k);
  for (int64_t r = 0; r < n_recent; ++r) out[k + r] = older + r;
  return 0;
}
