// Causal attention of a block of queries after cached keys, float32, on a CPU, in one pass (flash attention):
// per row, head and tile of TILE queries, the keys the tile can see in blocks of KEYS, each block's scores
// kept in the core's cache, their softmax taken online (a running maximum and sum) and the values summed at
// once. Compiled on the machine that runs it (harness/ops/cpu_flash.py: -march=native, HEAD_DIM fixed), so the
// vector type below is the widest the CPU has: 16 floats with AVX-512, else 8 (AVX2). Called through ctypes:
// plain C types only.
//
// Query i of a row sees key j iff j <= past + i (past = keys - queries); a key outside that is left out (its
// weight exactly 0), and inside the row's pad runs the additive mask's entry is added to the score (the 0/min
// mask additive_mask.py builds), so every query with a key to see weighs its keys as the masked softmax does.
#include <cfloat>
#include <cmath>
#include <cstring>
#if defined(__AVX__)
#include <immintrin.h>
#endif

#ifndef HEAD_DIM
#error "compile with -DHEAD_DIM=<the attention head's size, a multiple of 16>"
#endif
static_assert(HEAD_DIM % 16 == 0 && HEAD_DIM <= 256, "HEAD_DIM: a multiple of 16, at most 256");

#if defined(__AVX512F__)
constexpr int W = 16;  // floats a vector
constexpr int VALUES = 4;  // vectors of a value row a product step holds a query (AVX-512: 32 registers)
constexpr int SCORE_ROWS = 12;  // query rows a scores step holds: the tile's 12 x 2 key vectors, each key vector
                                // read once a tile (1.03-1.07x a prefill's blocks against 6, the same scores)
#else
constexpr int W = 8;
constexpr int VALUES = 2;  // AVX2's 16 registers: a prefill's blocks 1.15x faster than with 4
constexpr int SCORE_ROWS = 6;  // 12 spill AVX2's registers (0.86x)
#endif
constexpr int D = HEAD_DIM;
constexpr int TILE = 12;  // queries a work item (two groups of GROUP)
constexpr int GROUP = 6;  // query rows a values step holds in registers
static_assert(TILE % SCORE_ROWS == 0 && TILE % GROUP == 0, "a tile is whole groups of rows");
constexpr int KEYS = 768;  // keys a block (its scores, 36 KB, stay in the core's cache): the softmax's
// per-block work (maxima, rescaling) spread over more keys, 1.03-1.05x faster than 256 (head size 80: 1.04x)

typedef float vec __attribute__((vector_size(4 * W), aligned(4)));
typedef int ivec __attribute__((vector_size(4 * W)));

// Unaligned loads and stores as one instruction: GCC expands a memcpy of an AVX2 vector into 16-byte moves through
// the stack, and the 32-byte reload of two 16-byte stores stalls (the AVX2 build ran 20x slower for it).
static inline vec load(const float* p) {
#if defined(__AVX512F__)
  return (vec)_mm512_loadu_ps(p);
#elif defined(__AVX__)
  return (vec)_mm256_loadu_ps(p);
#else
  vec r;
  std::memcpy(&r, p, sizeof r);
  return r;
#endif
}
static inline void store(float* p, vec x) {
#if defined(__AVX512F__)
  _mm512_storeu_ps(p, (__m512)x);
#elif defined(__AVX__)
  _mm256_storeu_ps(p, (__m256)x);
#else
  std::memcpy(p, &x, sizeof x);
#endif
}
static inline vec splat(float x) { return vec{} + x; }
// A float in memory in every lane as one load (vbroadcastss): ``splat`` of it is compiled as 0 + x (the sum keeps
// -0's sign apart) and a broadcast from a register, two more instructions a row in the products' inner loops,
// where they took issue slots from the multiply-adds (a prefill's blocks 1.04-1.08x faster with this).
static inline vec broadcast(const float* p) {
#if defined(__AVX512F__)
  return (vec)_mm512_set1_ps(*p);
#elif defined(__AVX__)
  return (vec)_mm256_broadcast_ss(p);
#else
  return splat(*p);
#endif
}

// exp(x) for x <= 0 (scores less their maximum): x = n ln2 + r, |r| <= ln2 / 2, Cephes' degree-6 polynomial for
// exp(r) (about 1 ulp), times 2^n; below -87.3 (where expf turns subnormal) exactly 0. With AVX-512 the rounding
// and the 2^n are one instruction each (vrndscaleps, vscalefps), six fewer a vector: the exponential is most of the
// softmax, a fifth of the kernel's time (1,600 queries after 774 keys: 7.7 ms against 8.0).
static inline vec exp_poly(vec r) {
  vec p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

static inline vec exp_nonpositive(vec x) {
  const vec low = splat(-87.3f);
#if defined(__AVX512F__)
  const __m512 n = _mm512_roundscale_ps((__m512)(x * 1.44269504088896341f),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  vec r = x - (vec)n * 0.693359375f;
  r = r - (vec)n * -2.12194440e-4f;
  const vec e = (vec)_mm512_scalef_ps((__m512)exp_poly(r), n);
  return x < low ? splat(0.f) : e;
#else
  vec clamped = x < low ? low : x;
  vec n = (clamped * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  vec r = clamped - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
  vec two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return x < low ? splat(0.f) : exp_poly(r) * two_n;
#endif
}

struct Tile {  // one thread's scratch
  alignas(64) float q[TILE][D];
  alignas(64) float s[TILE][KEYS];
  alignas(64) float o[TILE][D];
  float max[TILE], sum[TILE];
};

// scores[i][j0 + t] = q_i . k_{j0 + t} * scale for the tile's rows, keys transposed ([D][keys], stride kt_d),
// SCORE_ROWS rows by two vectors of keys a step (one at the block's end)
static void scores(Tile& w, const float* kt, long kt_d, int j0, int nk, float scale) {
  for (int g = 0; g < TILE; g += SCORE_ROWS) {
    for (int t = 0; t < nk; t += 2 * W) {
      vec a[SCORE_ROWS][2];
      for (int i = 0; i < SCORE_ROWS; ++i) a[i][0] = a[i][1] = splat(0.f);
      const float* k = kt + j0 + t;
      if (t + W < nk) {
#pragma GCC unroll 2
        for (int c = 0; c < D; ++c) {
          vec k0 = load(k + c * kt_d), k1 = load(k + c * kt_d + W);
#pragma GCC unroll 12
          for (int i = 0; i < SCORE_ROWS; ++i) {
            vec qi = broadcast(&w.q[g + i][c]);
            a[i][0] += qi * k0;
            a[i][1] += qi * k1;
          }
        }
      } else {
        for (int c = 0; c < D; ++c) {
          vec k0 = load(k + c * kt_d);
#pragma GCC unroll 12
          for (int i = 0; i < SCORE_ROWS; ++i) a[i][0] += broadcast(&w.q[g + i][c]) * k0;
        }
      }
      for (int i = 0; i < SCORE_ROWS; ++i) {
        store(&w.s[g + i][t], a[i][0] * scale);
        if (t + W < nk) store(&w.s[g + i][t + W], a[i][1] * scale);
      }
    }
  }
}

// o[i] += sum_t s[i][t] v_{j0 + t}, D/W vectors a row at a time in chunks of VALUES
template <int V>
static void values_chunk(Tile& w, const float* v, long v_n, int nk, int d0) {
  for (int g = 0; g < TILE; g += GROUP) {
    vec a[GROUP][V];
    for (int i = 0; i < GROUP; ++i)
      for (int u = 0; u < V; ++u) a[i][u] = load(&w.o[g + i][d0 + W * u]);
    for (int t = 0; t < nk; ++t) {
      vec x[V];
      for (int u = 0; u < V; ++u) x[u] = load(v + t * v_n + d0 + W * u);
#pragma GCC unroll 6
      for (int i = 0; i < GROUP; ++i) {
        vec p = broadcast(&w.s[g + i][t]);
        for (int u = 0; u < V; ++u) a[i][u] += p * x[u];
      }
    }
    for (int i = 0; i < GROUP; ++i)
      for (int u = 0; u < V; ++u) store(&w.o[g + i][d0 + W * u], a[i][u]);
  }
}

static void values(Tile& w, const float* v, long v_n, int nk) {
  int d0 = 0;
  for (; d0 + VALUES * W <= D; d0 += VALUES * W) values_chunk<VALUES>(w, v, v_n, nk, d0);
  const int rest = (D - d0) / W;  // fewer than VALUES vectors left
  if (rest == 3) values_chunk<3>(w, v, v_n, nk, d0);
  if (rest == 2) values_chunk<2>(w, v, v_n, nk, d0);
  if (rest == 1) values_chunk<1>(w, v, v_n, nk, d0);
}

// the tile's softmax over one key block, online: masked entries added, unseen keys out, maxima and sums carried
static void softmax_block(Tile& w, int rows, int past, int q0, int j0, int nk, const float* mask, long m_q,
                          const int* pads, int npads) {
  const int padded = (nk + W - 1) / W * W;
  for (int i = 0; i < rows; ++i) {
    float* s = w.s[i];
    int seen = past + q0 + i + 1 - j0;  // keys of this block the query sees
    seen = seen < 0 ? 0 : (seen > nk ? nk : seen);
    for (int p = 0; p < npads; ++p) {
      int lo = pads[2 * p] - j0, hi = pads[2 * p + 1] - j0;
      lo = lo < 0 ? 0 : lo;
      hi = hi > seen ? seen : hi;
      const float* m = mask + (long)(q0 + i) * m_q + j0;
      for (int t = lo; t < hi; ++t) s[t] += m[t];
    }
    for (int t = seen; t < padded; ++t) s[t] = -INFINITY;
    vec top = splat(-INFINITY);
    for (int t = 0; t < padded; t += W) {
      vec x = load(s + t);
      top = x > top ? x : top;
    }
    float m = w.max[i];
    for (int u = 0; u < W; ++u) m = top[u] > m ? top[u] : m;
    const float rescale = std::exp(w.max[i] - m);
    w.max[i] = m;
    vec total = splat(0.f), mv = splat(m);
    for (int t = 0; t < padded; t += W) {
      vec p = exp_nonpositive(load(s + t) - mv);
      store(s + t, p);
      total += p;
    }
    float sum = 0.f;
    for (int u = 0; u < W; ++u) sum += total[u];
    w.sum[i] = w.sum[i] * rescale + sum;
    if (rescale != 1.f)
      for (int d = 0; d < D; d += W) store(&w.o[i][d], load(&w.o[i][d]) * rescale);
  }
  for (int i = rows; i < TILE; ++i)  // rows past the block's last query: nothing to add
    for (int t = 0; t < padded; ++t) w.s[i][t] = 0.f;
}

// lane t of the result: the sum of v[t]'s lanes (rounds of pairwise sums, each halving the vectors)
static inline vec pair_sums(vec a, vec b, ivec even, ivec odd) {
  return __builtin_shuffle(a, b, even) + __builtin_shuffle(a, b, odd);
}
#if defined(__AVX512F__)
static inline vec lane_sums(const vec* v) {
  const ivec e1 = {0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30};
  const ivec o1 = {1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31};
  const ivec e2 = {0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29};
  const ivec o2 = {2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31};
  const ivec e3 = {0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27};
  const ivec o3 = {4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31};
  const ivec e4 = {0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23};
  const ivec o4 = {8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31};
  vec w[8], x[4], y[2];
  for (int k = 0; k < 8; ++k) w[k] = pair_sums(v[2 * k], v[2 * k + 1], e1, o1);
  for (int k = 0; k < 4; ++k) x[k] = pair_sums(w[2 * k], w[2 * k + 1], e2, o2);
  for (int k = 0; k < 2; ++k) y[k] = pair_sums(x[2 * k], x[2 * k + 1], e3, o3);
  return pair_sums(y[0], y[1], e4, o4);
}
#else
static inline vec lane_sums(const vec* v) {
  const ivec e1 = {0, 8, 2, 10, 4, 12, 6, 14}, o1 = {1, 9, 3, 11, 5, 13, 7, 15};
  const ivec e2 = {0, 1, 8, 9, 4, 5, 12, 13}, o2 = {2, 3, 10, 11, 6, 7, 14, 15};
  const ivec e3 = {0, 1, 2, 3, 8, 9, 10, 11}, o3 = {4, 5, 6, 7, 12, 13, 14, 15};
  vec w[4], x[2];
  for (int k = 0; k < 4; ++k) w[k] = pair_sums(v[2 * k], v[2 * k + 1], e1, o1);
  for (int k = 0; k < 2; ++k) x[k] = pair_sums(w[2 * k], w[2 * k + 1], e2, o2);
  return pair_sums(x[0], x[1], e3, o3);
}
#endif

struct Query {  // one query's state over the keys it has read
  vec q[D / W], o[D / W];
  const float* mask;  // its row of the additive mask, or null
  float max, sum;
};
// Blocks ahead (~48 KB of keys, and of values) whose first rows a decoding pass touches before it needs them: at
// head size 64 a block of keys or of values is one 4 KB page, the hardware's prefetchers stop at a page's end,
// and each block began with a miss to memory. A step of 24 merged rows after a front of 774: 1.02-1.10x (head size
// 128: 1.11x; the AVX2 build 1.07x), the same outputs to the bit.
constexpr int AHEAD = 49152 / (W * D * 4) > 1 ? 49152 / (W * D * 4) : 1;
constexpr int QUERIES = 32;  // queries a pass over keys takes at once (``cpu_flash.DECODE_QUERIES``)

// Whether every query's mask hides keys [j, j + n) (the dtype's minimum: weights that are exactly 0) and every
// query has seen a key already (so its sum stays > 0 without them): a merged row's pads, then not read at all (a
// step of 24 merged rows, ~150 pads a row after a front of 774, 2,500 keys, six layers: 10.9 ms against 12.0,
// the same outputs to the bit).
static bool hidden(const Query* qs, int count, int j, int n) {
  for (int qi = 0; qi < count; ++qi) {
    if (!qs[qi].mask || qs[qi].max == -FLT_MAX) return false;
    for (int t = 0; t < n; ++t)
      if (qs[qi].mask[j + t] != -FLT_MAX) return false;
  }
  return true;
}

// queries qs[0..count) over keys [j0, j1) (rows of k and v, strides k_n and v_n), W keys at a time: each block
// read once for all of them (it stays in the core's cache while they take it in turn)
static void decode_over(Query* qs, int count, const float* k, long k_n, const float* v, long v_n, int j0, int j1,
                        float scale) {
  for (int j = j0; j < j1; j += W) {
    const int n = j1 - j < W ? j1 - j : W;
    if (j + AHEAD * W < j1) {
      __builtin_prefetch(k + (long)(j + AHEAD * W) * k_n);
      __builtin_prefetch(v + (long)(j + AHEAD * W) * v_n);
    }
    if (hidden(qs, count, j, n)) continue;
    for (int qi = 0; qi < count; ++qi) {
      Query& a = qs[qi];
      vec part[W];
      for (int t = 0; t < W; ++t) {
        part[t] = splat(0.f);
        if (t < n) {
          const float* key = k + (long)(j + t) * k_n;
          for (int c = 0; c < D / W; ++c) part[t] += a.q[c] * load(key + W * c);
        }
      }
      vec s = lane_sums(part) * scale;
      for (int t = 0; t < W; ++t) s[t] = t < n ? (a.mask ? s[t] + a.mask[j + t] : s[t]) : -INFINITY;
      float top = a.max;
      for (int t = 0; t < n; ++t) top = s[t] > top ? s[t] : top;
      const float rescale = std::exp(a.max - top);
      a.max = top;
      const vec p = exp_nonpositive(s - top);
      float sum = 0.f;
      for (int t = 0; t < W; ++t) sum += p[t];
      a.sum = a.sum * rescale + sum;
      if (rescale != 1.f)
        for (int c = 0; c < D / W; ++c) a.o[c] *= rescale;
      for (int t = 0; t < n; ++t) {
        const float* value = v + (long)(j + t) * v_n;
        const vec weight = splat(p[t]);
        for (int c = 0; c < D / W; ++c) a.o[c] += weight * load(value + W * c);
      }
    }
  }
}

// The queries of rows [r0, r0 + n) for key head kh (per_row each, n * per_row <= QUERIES) over all their keys:
// the first ``shared`` read from row 0 and the next ones up to ``mid`` from row ``g``, once for all of them (every
// row holds the same there), then each row's own from ``mid`` on.
static void rows_together(const float* q, long q_b, long q_h, long q_n, const float* k, long k_b, long k_h, long k_n,
                          const float* v, long v_b, long v_h, long v_n, const float* mask, long m_b, long m_q,
                          float* out, long o_b, long o_n, long o_h, int group, int queries, int keys, int shared,
                          int g, int mid, int r0, int n, int kh, float scale) {
  const int per_row = group * queries;
  Query qs[QUERIES];
  for (int u = 0; u < n * per_row; ++u) {
    const int b = r0 + u / per_row, h = kh * group + (u % per_row) / queries, i = u % queries;
    for (int c = 0; c < D / W; ++c) {
      qs[u].q[c] = load(q + b * q_b + h * q_h + i * q_n + W * c);
      qs[u].o[c] = splat(0.f);
    }
    qs[u].mask = mask ? mask + b * m_b + i * m_q : nullptr;
    qs[u].max = -FLT_MAX;
    qs[u].sum = 0.f;
  }
  decode_over(qs, n * per_row, k + kh * k_h, k_n, v + kh * v_h, v_n, 0, shared, scale);
  decode_over(qs, n * per_row, k + g * k_b + kh * k_h, k_n, v + g * v_b + kh * v_h, v_n, shared, mid, scale);
  for (int r = 0; r < n; ++r) {
    const int b = r0 + r;
    Query* own = qs + r * per_row;
    decode_over(own, per_row, k + b * k_b + kh * k_h, k_n, v + b * v_b + kh * v_h, v_n, mid, keys, scale);
    for (int u = 0; u < per_row; ++u) {
      const int h = kh * group + u / queries, i = u % queries;
      float* o = out + b * o_b + i * o_n + h * o_h;
      for (int c = 0; c < D / W; ++c) store(o + W * c, own[u].o[c] * (1.f / own[u].sum));
    }
  }
}

extern "C" int icr_flash_head_dim() { return D; }

// A few queries a row (decoding steps) over all their keys under an additive mask: q [rows, heads, queries, D],
// k and v [rows, kv heads, keys, D], mask [rows, 1, queries, keys] (m_b, m_q; null: none), out [rows, queries,
// heads, D]. The first ``shared`` keys are every row's and are read from the first row (the rows a prefix tree
// merged share their front: read once into the cache, not once a row). Where ``owner`` is given (else null), rows
// b with owner[b] == g (g and the rows after it) also hold row g's keys from ``shared`` to middle_end[g] (prompts
// that share more than the front): read once for all of them, by one work item a key head. Otherwise one work
// item a row and key head. A row's queries a key head (grouped heads x queries) are QUERIES at most.
extern "C" void icr_decode_attention(const float* q, long q_b, long q_h, long q_n, const float* k, long k_b,
                                     long k_h, long k_n, const float* v, long v_b, long v_h, long v_n,
                                     const float* mask, long m_b, long m_q, float* out, long o_b, long o_n, long o_h,
                                     int rows, int heads, int kv_heads, int queries, int keys, int shared,
                                     const int* owner, const int* middle_end, float scale, int threads) {
  const int group = heads / kv_heads, per_row = group * queries;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
  for (long item = 0; item < (long)rows * kv_heads; ++item) {
    const int g = (int)(item / kv_heads), kh = (int)(item % kv_heads);
    if (owner && owner[g] != g) continue;  // its middle is row owner[g]'s: taken with that row's item
    int end = g + 1;  // rows g .. end - 1 share row g's middle
    while (owner && end < rows && owner[end] == g) ++end;
    const int mid = owner ? middle_end[g] : shared;
    for (int r0 = g; r0 < end; r0 += QUERIES / per_row) {  // per_row <= QUERIES (``cpu_flash.DECODE_QUERIES``)
      const int n = end - r0 < QUERIES / per_row ? end - r0 : QUERIES / per_row;
      rows_together(q, q_b, q_h, q_n, k, k_b, k_h, k_n, v, v_b, v_h, v_n, mask, m_b, m_q, out, o_b, o_n, o_h, group,
                    queries, keys, shared, g, mid, r0, n, kh, scale);
    }
  }
}

// q [rows, heads, queries, D] (strides q_b, q_h, q_n), kt [rows, kv heads, D, keys] (kt_b, kt_h, kt_d),
// v [rows, kv heads, keys, D] (v_b, v_h, v_n), out [rows, queries, heads, D] (o_b, o_n, o_h), mask [rows, 1,
// queries, keys] (m_b, m_q; any pointer where no row has pads), pads [rows][max_pads][2] key runs with npads[row]
// of them. The last dimension of each is contiguous.
extern "C" void icr_flash_attention(const float* q, long q_b, long q_h, long q_n, const float* kt, long kt_b,
                                    long kt_h, long kt_d, const float* v, long v_b, long v_h, long v_n,
                                    const float* mask, long m_b, long m_q, const int* pads, const int* npads,
                                    int max_pads, float* out, long o_b, long o_n, long o_h, int rows, int heads,
                                    int kv_heads, int queries, int keys, float scale, int threads) {
  const int tiles = (queries + TILE - 1) / TILE, group = heads / kv_heads, past = keys - queries;
  const long items = (long)rows * heads * tiles;
#pragma omp parallel num_threads(threads)
  {
    Tile w;
#pragma omp for schedule(dynamic, 1)
    for (long item = 0; item < items; ++item) {
      const int tile = tiles - 1 - (int)(item / ((long)rows * heads));  // the longest tiles first
      const int b = (int)(item % ((long)rows * heads)) / heads, h = (int)(item % heads);
      const int q0 = tile * TILE, n = queries - q0 < TILE ? queries - q0 : TILE;
      const float* qb = q + b * q_b + h * q_h + q0 * q_n;
      for (int i = 0; i < TILE; ++i)
        for (int d = 0; d < D; d += W) store(&w.q[i][d], i < n ? load(qb + i * q_n + d) : splat(0.f));
      for (int i = 0; i < TILE; ++i) {
        w.max[i] = -FLT_MAX;
        w.sum[i] = 0.f;
        for (int d = 0; d < D; d += W) store(&w.o[i][d], splat(0.f));
      }
      const float* ktb = kt + b * kt_b + (h / group) * kt_h;
      const float* vb = v + b * v_b + (h / group) * v_h;
      const int end = past + q0 + n;  // keys the tile's last query sees
      for (int j0 = 0; j0 < end; j0 += KEYS) {
        const int nk = end - j0 < KEYS ? end - j0 : KEYS;
        scores(w, ktb, kt_d, j0, nk, scale);
        softmax_block(w, n, past, q0, j0, nk, mask + b * m_b, m_q, pads + (long)b * max_pads * 2, npads[b]);
        values(w, vb + (long)j0 * v_n, v_n, nk);
      }
      for (int i = 0; i < n; ++i) {
        float* o = out + b * o_b + (long)(q0 + i) * o_n + h * o_h;
        const vec inverse = splat(1.f / w.sum[i]);
        for (int d = 0; d < D; d += W) store(o + d, load(&w.o[i][d]) * inverse);
      }
    }
  }
}
