// Two versions of the CPU attention kernel in one process, called back to back with nothing between
// the calls (bench/kernel_ab.py builds and runs it). Each version is the kernel's source compiled into
// its own namespace (-DSRC_A="a.cpp" -DSRC_B="b.cpp"); with -DPLAIN_READ_B, B only reads the lines A's
// kernel reads (what the access pattern alone costs).
//
//   kernel_ab N CONTEXT SPARSE COPIES PAIRS THREADS SEED
//
// 8 rows of N query tokens after CONTEXT keys, the bundled model's attention shape (4 query heads, 2 KV
// heads, head dim 32, fp32); SPARSE 1: each row keeps 7% of its prefix's 16-key pages (random, sorted)
// and its own tokens. Calls alternate A/B and B/A, each on the next of COPIES copies of the KV pool
// (huge pages where the system allows). Prints: median ms of A, of B, the median per-pair ratio B/A,
// its quartiles, and the largest difference between the two outputs.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>
#include <sys/mman.h>

#define aspire_attention attention_a
#define aspire_vector_width vector_width_a
#define aspire_reduce_scores reduce_scores_a
namespace version_a {
#include SRC_A
}
#undef aspire_attention
#undef aspire_vector_width
#undef aspire_reduce_scores
#ifdef PLAIN_READ_B
// B as the access pattern's own cost: every K and V line of each (row, KV head) the kernel reads,
// summed in the same OpenMP loop over items, no arithmetic to speak of.
namespace version_b {
typedef float lane8 __attribute__((vector_size(32)));
int attention_b(const float*, const float* k, const float* v, float* out, float*, float*, const int64_t* rows,
                int64_t num_rows, const int64_t* idx, int64_t, int64_t hkv, int64_t d, int64_t cap, float, int threads) {
  float total = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(+ : total)
  for (int64_t i = 0; i < num_rows * hkv; ++i) {
    const int64_t* row = rows + i / hkv * 8;
    const float *kh = k + i % hkv * cap * d, *vh = v + i % hkv * cap * d;
    const int64_t len = row[5] >= 0 ? row[5] : row[3] + row[1];
    lane8 acc = {}, x, y;
    for (int64_t j = 0; j < len; ++j) {
      const int64_t pos = row[5] >= 0 ? idx[row[4] + j] : row[2] + j;
      for (int64_t c = 0; c < d; c += 16) {  // one load per 64-byte line
        std::memcpy(&x, kh + pos * d + c, sizeof x);
        std::memcpy(&y, vh + pos * d + c, sizeof y);
        acc += x + y;
      }
    }
    total += acc[0];
  }
  out[0] = total;
  return 0;
}
}  // namespace version_b
#else
#define aspire_attention attention_b
#define aspire_vector_width vector_width_b
#define aspire_reduce_scores reduce_scores_b
namespace version_b {
#include SRC_B
}
#endif

namespace {

constexpr int64_t ROWS = 8, HQ = 4, HKV = 2, D = 32, PAGE = 16;

float* pool(size_t n, std::mt19937& gen) {
  void* p = mmap(nullptr, n * sizeof(float), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) std::exit(1);
  madvise(p, n * sizeof(float), MADV_HUGEPAGE);  // as the engine's pool (kv_cache.pool_tensor)
  std::normal_distribution<float> normal;
  float* f = static_cast<float*>(p);
  for (size_t i = 0; i < n; ++i) f[i] = normal(gen);
  return f;
}

double quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * (v.size() - 1) + 0.5)];
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 8) {
    std::fprintf(stderr, "usage: kernel_ab N CONTEXT SPARSE COPIES PAIRS THREADS SEED\n");
    return 2;
  }
  const int64_t n = std::atol(argv[1]), context = std::atol(argv[2]);
  const bool sparse = std::atoi(argv[3]) != 0;
  const int copies = std::atoi(argv[4]), pairs = std::atoi(argv[5]), threads = std::atoi(argv[6]);
  std::mt19937 gen(static_cast<unsigned>(std::atol(argv[7])));
  const int64_t size = (context + n + PAGE - 1) / PAGE * PAGE, cap = ROWS * size;
  std::vector<int64_t> rows(ROWS * 8), idx;
  for (int64_t r = 0; r < ROWS; ++r) {
    int64_t* row = &rows[r * 8];  // q_start, n, base, start, idx_off, idx_len, cap_mask, cap_base
    row[0] = r * n, row[1] = n, row[2] = r * size, row[3] = context, row[4] = 0, row[5] = -1, row[6] = 0, row[7] = 0;
    if (!sparse) continue;
    const int64_t pages = (context + PAGE - 1) / PAGE;
    std::vector<int64_t> order(pages);
    for (int64_t p = 0; p < pages; ++p) order[p] = p;
    std::shuffle(order.begin(), order.end(), gen);
    order.resize(std::max<int64_t>(1, static_cast<int64_t>(0.07 * pages)));
    std::sort(order.begin(), order.end());
    row[4] = static_cast<int64_t>(idx.size());
    for (int64_t p : order)
      for (int64_t t = p * PAGE; t < std::min(p * PAGE + PAGE, context); ++t) idx.push_back(row[2] + t);
    for (int64_t t = 0; t < n; ++t) idx.push_back(row[2] + context + t);
    row[5] = static_cast<int64_t>(idx.size()) - row[4];
  }
  std::vector<float*> k(copies), v(copies);
  for (int c = 0; c < copies; ++c) k[c] = pool(HKV * cap * D, gen), v[c] = pool(HKV * cap * D, gen);
  std::vector<float> q(ROWS * n * HQ * D), out_a(q.size()), out_b(q.size());
  std::normal_distribution<float> normal;
  for (float& x : q) x = normal(gen);
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  auto call = [&](int which, int c, float* out) {
    auto f = which == 0 ? version_a::attention_a : version_b::attention_b;
    return f(q.data(), k[c], v[c], out, nullptr, nullptr, rows.data(), ROWS, idx.data(), HQ, HKV, D, cap, scale, threads);
  };
  if (call(0, 0, out_a.data()) || call(1, 0, out_b.data())) {
    std::fprintf(stderr, "error: a kernel refused the call\n");
    return 1;
  }
  float diff = 0;
  for (size_t i = 0; i < q.size(); ++i) diff = std::max(diff, std::abs(out_a[i] - out_b[i]));
  std::vector<double> times[2], ratios;
  int c = 0;
  for (int i = 0; i < pairs; ++i) {
    for (int k = 0; k < 2; ++k) {
      const int which = (i + k) % 2;  // A first on even pairs, B first on odd
      const auto t0 = std::chrono::steady_clock::now();
      call(which, c, which == 0 ? out_a.data() : out_b.data());
      times[which].push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      c = (c + 1) % copies;
    }
    ratios.push_back(times[1].back() / times[0].back());
  }
  std::printf("%.6f %.6f %.4f %.4f %.4f %.3e\n", quantile(times[0], 0.5) * 1e3, quantile(times[1], 0.5) * 1e3,
              quantile(ratios, 0.5), quantile(ratios, 0.25), quantile(ratios, 0.75), diff);
  return 0;
}
