// One KDA decode step per (sequence, value head), fused: one read and one write of the state.
//
// Per head, with d = exp(g), the state S [K, V] (or S^T [V, K] with v_first) and q unscaled:
//     u     = beta (v - (d k)^T S)                  the delta rule's correction, from the old state
//     o     = (scale d q)^T S + scale (q . k) u     = scale q^T S_new, without reading S_new again
//     S_new = Diag(d) S + k u^T                     written to S_out (which may be S itself)
// Both reductions read the old state in one sweep over a block of columns; the update then re-reads the
// block from cache and writes it once. Compiled lazily by k3sys.kda.fused_step (g++, called via ctypes).
#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t MAX_K = 512;  // validate.MAX_HEAD_DIM

// Columns per sweep: 512 bytes of a row (128 fp32), 8 vectors per accumulator. Measured on a state in
// L2 (N = 1): 16 / 32 / 64 / 128 fp32 columns took 1.7 / 1.4 / 1.3 / 1.0 of the 128-column time; the
// scalar work per row (broadcasts, loop control) is paid once per block.
template <typename T>
constexpr int64_t BLOCK = 512 / sizeof(T);

// The per-head inputs of the update, gathered once: kd = d k, qd = scale d q (K each), and d, k.
template <typename T>
struct Head {
    const T *kd, *qd, *k, *d;
    T beta, sqk;  // sqk = scale (q . k)
    int64_t K, V;
};

// Columns [j0, j0 + n) of one head's S [K, V], any n <= BLOCK: the plain loops, for a last partial block.
template <typename T>
void partial_block_kv(const Head<T>& h, const T* v, const T* S, T* S_out, T* o, int64_t j0, int64_t n) {
    T w[BLOCK<T>] = {}, acc[BLOCK<T>] = {}, u[BLOCK<T>];
    for (int64_t i = 0; i < h.K; ++i)
        for (int64_t j = 0; j < n; ++j) {
            w[j] += h.kd[i] * S[i * h.V + j0 + j];
            acc[j] += h.qd[i] * S[i * h.V + j0 + j];
        }
    for (int64_t j = 0; j < n; ++j) {
        u[j] = h.beta * (v[j0 + j] - w[j]);
        o[j0 + j] = acc[j] + h.sqk * u[j];
    }
    for (int64_t i = 0; i < h.K; ++i)
        for (int64_t j = 0; j < n; ++j) S_out[i * h.V + j0 + j] = h.d[i] * S[i * h.V + j0 + j] + h.k[i] * u[j];
}

// The same for a full block, with explicit 64-byte vectors (GCC/Clang vector extensions: zmm with
// AVX-512, pairs of ymm with AVX2) so the accumulators stay in registers (auto-vectorised, GCC 12 kept
// them in memory: ~2x slower on a cache-resident state).
template <typename T>
void full_block_kv(const Head<T>& h, const T* v, const T* S, T* S_out, T* o, int64_t j0) {
    typedef T vec __attribute__((vector_size(64)));
    constexpr int64_t L = 64 / sizeof(T), NV = BLOCK<T> / L;
    auto load = [](const T* p) { vec x; __builtin_memcpy(&x, p, sizeof(vec)); return x; };
    auto store = [](T* p, vec x) { __builtin_memcpy(p, &x, sizeof(vec)); };
    vec w[NV] = {}, acc[NV] = {}, u[NV];
    for (int64_t i = 0; i < h.K; ++i)
        for (int64_t c = 0; c < NV; ++c) {
            const vec x = load(S + i * h.V + j0 + c * L);
            w[c] += h.kd[i] * x;
            acc[c] += h.qd[i] * x;
        }
    for (int64_t c = 0; c < NV; ++c) {
        u[c] = h.beta * (load(v + j0 + c * L) - w[c]);
        store(o + j0 + c * L, acc[c] + h.sqk * u[c]);
    }
    for (int64_t i = 0; i < h.K; ++i)
        for (int64_t c = 0; c < NV; ++c)
            store(S_out + i * h.V + j0 + c * L, h.d[i] * load(S + i * h.V + j0 + c * L) + h.k[i] * u[c]);
}

template <typename T>
void head_kv(const Head<T>& h, const T* v, const T* S, T* S_out, T* o) {
    int64_t j0 = 0;
    for (; j0 + BLOCK<T> <= h.V; j0 += BLOCK<T>) full_block_kv(h, v, S, S_out, o, j0);
    if (j0 < h.V) partial_block_kv(h, v, S, S_out, o, j0, h.V - j0);
}

// S^T [V, K]: row j is column j of S, contiguous over K, so each row is a dot product and an axpy.
template <typename T>
void head_vk(const Head<T>& h, const T* v, const T* S, T* S_out, T* o) {
    const T *__restrict kd = h.kd, *__restrict qd = h.qd, *__restrict d = h.d, *__restrict k = h.k;
    const int64_t K = h.K;
    for (int64_t j = 0; j < h.V; ++j) {
        const T* row = S + j * K;
        T w = 0, acc = 0;
#pragma omp simd reduction(+ : w, acc)
        for (int64_t i = 0; i < K; ++i) {
            w += kd[i] * row[i];
            acc += qd[i] * row[i];
        }
        const T u = h.beta * (v[j] - w);
        o[j] = acc + h.sqk * u;
        T* out = S_out + j * K;
#pragma omp simd
        for (int64_t i = 0; i < K; ++i) out[i] = d[i] * row[i] + k[i] * u;
    }
}

// Returns the number of gate values that are not <= 0 (positive or NaN); when it is not 0, nothing
// was written (so a caller's in-place state survives a bad gate).
template <typename T>
int64_t step(const T* q, const T* k, const T* v, const T* g, const T* beta, const T* S, T* S_out, T* o,
             int64_t N, int64_t H, int64_t HV, int64_t K, int64_t V, double scale, int v_first) {
    int64_t bad = 0;
    for (int64_t x = 0; x < N * HV * K; ++x) bad += !(g[x] <= 0);
    if (bad) return bad;
    const int64_t group = HV / H;  // value head j reads q/k head j / group (grouped value attention)
    T d[MAX_K], kd[MAX_K], qd[MAX_K];
    for (int64_t b = 0; b < N * HV; ++b) {
        const int64_t qk_head = (b / HV) * H + (b % HV) / group;
        const T *qh = q + qk_head * K, *kh = k + qk_head * K;
        T qk = 0;
        for (int64_t i = 0; i < K; ++i) {
            d[i] = std::exp(g[b * K + i]);
            kd[i] = kh[i] * d[i];
            qd[i] = static_cast<T>(scale) * qh[i] * d[i];
            qk += qh[i] * kh[i];
        }
        const Head<T> h{kd, qd, kh, d, beta[b], static_cast<T>(scale) * qk, K, V};
        const int64_t off = b * K * V;
        (v_first ? head_vk<T> : head_kv<T>)(h, v + b * V, S + off, S_out + off, o + b * V);
    }
    return 0;
}

}  // namespace

extern "C" {
int64_t kda_step_f32(const float* q, const float* k, const float* v, const float* g, const float* beta,
                     const float* S, float* S_out, float* o, int64_t N, int64_t H, int64_t HV, int64_t K,
                     int64_t V, double scale, int v_first) {
    return step<float>(q, k, v, g, beta, S, S_out, o, N, H, HV, K, V, scale, v_first);
}
int64_t kda_step_f64(const double* q, const double* k, const double* v, const double* g, const double* beta,
                     const double* S, double* S_out, double* o, int64_t N, int64_t H, int64_t HV, int64_t K,
                     int64_t V, double scale, int v_first) {
    return step<double>(q, k, v, g, beta, S, S_out, o, N, H, HV, K, V, scale, v_first);
}
}
