// Sampling distributions on the CPU: temperature, top-k and top-p for every row of a step in one call
// (fp32). The same maths as decoders/sampler.py logits_to_probs with top-k on:
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
// Also here, being host work of a step too: a whole step's sampling (aspire_sample_step: these
// distributions, then each row's draw or rejection sampling), one draw from a distribution
// (aspire_draw) and ASPIRE's page selection (aspire_select_pages).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <utility>
#include <vector>
#if defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// A candidate as one integer whose order is the output's: larger value, then lower token id, so
// selecting and sorting compare integers (no two-part comparison, no branch on ties). The value's bits
// made order-preserving (-0 counted as +0, which it equals) above the id's complement (vocab < 2^32).
typedef uint64_t Cand;
inline Cand cand_of(float v, int64_t i) {
  uint32_t u;
  v += 0.f;  // -0 -> +0
  std::memcpy(&u, &v, 4);
  u ^= (u >> 31) ? 0xffffffffu : 0x80000000u;
  return static_cast<uint64_t>(u) << 32 | (0xffffffffu - static_cast<uint32_t>(i));
}
inline float value_of(Cand c) {
  uint32_t u = static_cast<uint32_t>(c >> 32);
  u ^= (u >> 31) ? 0x80000000u : 0xffffffffu;
  float v;
  std::memcpy(&v, &u, 4);
  return v;
}
inline int64_t id_of(Cand c) { return 0xffffffffu - static_cast<uint32_t>(c); }
constexpr auto first = std::greater<Cand>();

// Bit t set where x[t] >= thr, for 16 floats (NaN never): one or two vector compares and a movemask
// where the instruction set has them.
inline uint32_t ge_mask(const float* x, float thr) {
#if defined(__AVX512F__)
  return _mm512_cmp_ps_mask(_mm512_loadu_ps(x), _mm512_set1_ps(thr), _CMP_GE_OQ);
#elif defined(__AVX__)
  const __m256 t = _mm256_set1_ps(thr);
  const uint32_t lo = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x), t, _CMP_GE_OQ));
  const uint32_t hi = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + 8), t, _CMP_GE_OQ));
  return lo | hi << 8;
#else
  uint32_t m = 0;
  for (int t = 0; t < 16; ++t) m |= static_cast<uint32_t>(x[t] >= thr) << t;
  return m;
#endif
}

// The rank-th largest of x[0], x[stride], ... (NaN never; -inf where fewer than rank values are
// numbers). A small rank keeps a sorted buffer that a sample value rarely enters (a predictable
// compare per value); a large one selects in place.
float sample_rank(const float* x, int64_t vocab, int64_t stride, int64_t rank, std::vector<float>& sample) {
  constexpr int64_t SMALL = 16;
  if (rank <= SMALL) {
    float top[SMALL];
    std::fill(top, top + rank, -INFINITY);
    for (int64_t j = 0; j < vocab; j += stride) {
      const float v = x[j];
      if (!(v > top[rank - 1])) continue;  // NaN too
      int64_t t = rank - 1;
      for (; t > 0 && top[t - 1] < v; --t) top[t] = top[t - 1];
      top[t] = v;
    }
    return top[rank - 1];
  }
  sample.clear();
  for (int64_t j = 0; j < vocab; j += stride)
    if (!std::isnan(x[j])) sample.push_back(x[j]);
  if (static_cast<int64_t>(sample.size()) < rank) return -INFINITY;
  std::nth_element(sample.begin(), sample.begin() + (rank - 1), sample.end(), std::greater<float>());
  return sample[rank - 1];
}

// The logits at or above thr, with their ids (NaN never), into cand; returns how many.
int64_t at_least(const float* x, int64_t vocab, float thr, Cand* cand) {
  int64_t n = 0, j = 0;
  for (; j + 16 <= vocab; j += 16)
    for (uint32_t m = ge_mask(x + j, thr); m; m &= m - 1) {
      const int t = __builtin_ctz(m);
      cand[n++] = cand_of(x[j + t], j + t);
    }
  for (; j < vocab; ++j)
    if (x[j] >= thr) cand[n++] = cand_of(x[j], j);
  return n;
}

// Candidates among which the k largest are, in cand[0..n) (cand: vocab entries); returns n. The
// threshold is the value of rank 2k*ns/vocab + 2 in a strided sample of ns values of the row, so ~2k
// values pass; where fewer than k do, every number is taken (-inf included). The threshold sets only
// how many candidates there are, never which k are kept.
int64_t candidates(const float* x, int64_t vocab, int64_t k, Cand* cand, std::vector<float>& sample) {
  const int64_t stride = vocab >= 4 * 256 ? vocab / 256 : 1;
  const int64_t ns = (vocab + stride - 1) / stride;
  const int64_t rank = (2 * k * ns + vocab - 1) / vocab + 2;  // 1-based, from the top
  const float thr = rank < ns ? sample_rank(x, vocab, stride, rank, sample) : -INFINITY;
  const int64_t n = at_least(x, vocab, thr, cand);
  return n >= k || thr == -INFINITY ? n : at_least(x, vocab, -INFINITY, cand);
}

void row_probs(const float* x, int64_t vocab, float temperature, int64_t k, double top_p, float* out,
               Cand* cand, std::vector<float>& p) {
  const int64_t found = candidates(x, vocab, k, cand, p);
  const int64_t n = std::min<int64_t>(k, found);
  // the k first, then sorted: cheaper than a partial sort's heap of k
  if (n < found) std::nth_element(cand, cand + n, cand + found, first);
  std::sort(cand, cand + n, first);
  std::memset(out, 0, vocab * sizeof(float));
  if (n == 0) return;
  p.resize(n);
  const float m = value_of(cand[0]) / temperature;
  float sum = 0.f;
  for (int64_t t = 0; t < n; ++t) sum += p[t] = std::exp(value_of(cand[t]) / temperature - m);
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
  for (int64_t t = 0; t < keep; ++t) out[id_of(cand[t])] = p[t] / kept;
}

}  // namespace

// logits, out: [rows, vocab] fp32, contiguous. k >= 1. Returns 0, or 1 on bad arguments.
extern "C" int aspire_top_k_probs(const float* logits, int64_t rows, int64_t vocab, float temperature, int64_t k,
                                  double top_p, float* out, int num_threads) {
  if (rows < 0 || vocab < 1 || vocab > UINT32_MAX || k < 1 || !(temperature > 0.f) || num_threads < 1)
    return 1;  // (a candidate's sort key holds a token id in 32 bits)
  k = k < vocab ? k : vocab;
#pragma omp parallel num_threads(rows > 1 ? num_threads : 1)
  {
    std::unique_ptr<Cand[]> cand(new Cand[vocab]);  // (uninitialised: only the entries found are read)
    std::vector<float> p;
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r)
      row_probs(logits + r * vocab, vocab, temperature, k, top_p, out + r * vocab, cand.get(), p);
  }
  return 0;
}

// One draw by inverting the CDF of p (q null) or of max(0, p - q) (rejection sampling's residual,
// unnormalised), as decoders/sampler.py does with torch ops: running sums in double, each
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

// The sampling of a whole decoding step in one call (decoders/loop.py): the distributions of every
// logits row (as aspire_top_k_probs), then each of the step's rows drawn or verified as the loop's
// per-row path does it (decoders/sampler.py):
//   a row of len = d + 1 logits rows (d = 0: a decode or draft row) with drafts x_0..x_{d-1}, their
//   draft distributions q_0..q_{d-1} and uniforms u_0..u_d: x_j is accepted while u_j q_j(x_j) < p_j(x_j)
//   (in double, as Python compares); the first rejected j takes the residual max(0, p_j - q_j) drawn
//   with u_{j+1} (from p_j where it has no mass); with every draft accepted, p_d drawn with u_d.
// Why one call: right after a forward that streamed the KV through the caches, each call of the
// per-row path (a draw, a numpy view, a Python comparison) costs several times its warm cost.
// meta: lens[rows], then the verify rows' drafts (n_drafts, row after row), then the addresses of
// their q (vocab floats each); us: len uniforms per row, row after row; probs [sum(lens), vocab] out;
// picked [2 * rows] out: each row's token, then each row's accepted drafts. Returns 0, or 1 on bad
// arguments.
extern "C" int aspire_sample_step(const float* logits, int64_t rows, int64_t vocab, float temperature, int64_t k,
                                  double top_p, const int64_t* meta, int64_t n_drafts, const float* us,
                                  float* probs, int64_t* picked, int num_threads) {
  const int64_t *lens = meta, *drafts = meta + rows, *q_addr = meta + rows + n_drafts;
  int64_t total = 0;
  for (int64_t r = 0; r < rows; ++r) {
    if (lens[r] < 1) return 1;
    total += lens[r];
  }
  if (total != rows + n_drafts) return 1;
  if (int rc = aspire_top_k_probs(logits, total, vocab, temperature, k, top_p, probs, num_threads)) return rc;
  for (int64_t r = 0, o = 0, x0 = 0; r < rows; o += lens[r], x0 += lens[r] - 1, ++r) {
    const int64_t d = lens[r] - 1;
    const float* u = us + o;  // a row's uniforms start where its logits rows do
    int64_t j = 0, tok = -1;
    for (; j < d; ++j) {
      const int64_t x = drafts[x0 + j];
      if (x < 0 || x >= vocab) return 1;
      const float* p = probs + (o + j) * vocab;
      const float* q = reinterpret_cast<const float*>(q_addr[x0 + j]);
      if (static_cast<double>(u[j]) * static_cast<double>(q[x]) < static_cast<double>(p[x])) continue;
      tok = aspire_draw(p, q, vocab, u[j + 1]);
      if (tok < 0) tok = aspire_draw(p, nullptr, vocab, u[j + 1]);
      break;
    }
    if (j == d) tok = aspire_draw(probs + (o + d) * vocab, nullptr, vocab, u[d]);
    picked[r] = tok;
    picked[rows + r] = j;
  }
  return 0;
}
