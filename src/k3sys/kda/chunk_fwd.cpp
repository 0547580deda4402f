// The chunked KDA forward (chunk size 16, fp32), both phases fused in one pass per (sequence, value head).
//
// Per chunk of 16 tokens, with G the in-chunk cumsum of g and S the state entering it (chunk.py's legend):
//     A_kk, A_qk   decayed 16x16 products (factorised through the block's midpoint, or pairwise when its
//                  log-decay span is too wide for fp32: chunk.py's _decayed_products, same rules)
//     inv          (I + Diag(beta) A_kk)^-1 Diag(beta), by forward substitution
//     W = inv (k e^G), U = inv v, Qs = scale q e^G - A_qk W, Ou = A_qk U, Kd = k e^(G_last - G)
//     V' = U - W S,  O = Qs S + Ou,  S <- Diag(e^G_last) S + Kd^T V'
// The state stays in a column-blocked copy Sb [V/16][K][16] for the whole sequence: each 16-column
// block (K x 64 bytes, 8 KB at K = 128) is read by the three products from L1, where the row-major
// state's 512-byte stride would map a column block onto 8 cache sets and evict itself. The gathers
// (token-major rows into the chunk) and the scatter of O are plain row copies inside the loop, so no
// slot-major tensor is ever built. Compiled lazily by k3sys.kda.native (g++, called via ctypes).
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace {

constexpr int64_t C = 16;  // tokens per chunk = fp32 lanes per 64-byte vector
typedef float vec __attribute__((vector_size(64)));
typedef int32_t ivec __attribute__((vector_size(64)));
constexpr float RESET = -1.0e4f;  // chunk.py's RESET_LOG_DECAY: g = -inf as a step whose exp is 0

inline vec load(const float* p) { vec x; std::memcpy(&x, p, sizeof(vec)); return x; }
inline void store(float* p, vec x) { std::memcpy(p, &x, sizeof(vec)); }
inline vec splat(float x) { return vec{} + x; }
inline vec vmin(vec a, vec b) { return a < b ? a : b; }
inline vec vmax(vec a, vec b) { return a > b ? a : b; }

// The sum of a vector's lanes as a tree (depth 4, not a chain of 15 dependent adds).
inline float hsum(vec s) {
    float a[C];
    store(a, s);
    for (int64_t w = C / 2; w > 0; w /= 2)
        for (int64_t l = 0; l < w; ++l) a[l] += a[l + w];
    return a[0];
}

// e^x, 16 lanes (Cephes' expf polynomial, ~1 ulp): glibc's vector expf needs -ffast-math, which would
// also license reassociating every sum here. Below -87.3 the result is 0, as fp32's exp rounds it.
inline vec vexp(vec x) {
    const vec xc = vmax(vmin(x, splat(88.0f)), splat(-87.0f));
    const vec magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
    const vec t = xc * 1.44269504088896341f + magic;
    const vec n = t - magic;
    const vec r = xc - n * 0.693359375f + n * 2.12194440e-4f;
    vec p = splat(1.9875691500e-4f);
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const vec y = p * r * r + r + 1.0f;
    const ivec bits = (__builtin_convertvector(n, ivec) + 127) << 23;
    vec scale;
    std::memcpy(&scale, &bits, sizeof(vec));
    return x < splat(-87.0f) ? splat(0.0f) : y * scale;
}

// One head's chunk workspace; rows of Kp (K rounded up to 16) or Vp floats, transposes [Kp][16].
struct Work {
    int64_t K, V, Kp, Vp;
    float *q, *k, *v, *g, *G, *ku, *qu, *kn, *knT, *eG, *W, *U, *Qs, *Ou, *WT, *QsT, *KdT, *decay, *Sb;
    float Akk[C * C], Aqk[C * C], inv[C * C], beta[C];
};

// out[:width] = sum_{j < n} a[j] X[j][:width] (rows of `stride` floats), four vectors per pass for ILP.
inline void combine(float* out, const float* a, const float* X, int64_t n, int64_t width, int64_t stride) {
    int64_t c = 0;
    for (; c + 4 * C <= width; c += 4 * C) {
        vec s0{}, s1{}, s2{}, s3{};
        for (int64_t j = 0; j < n; ++j) {
            const float* x = X + j * stride + c;
            s0 += a[j] * load(x), s1 += a[j] * load(x + C), s2 += a[j] * load(x + 2 * C), s3 += a[j] * load(x + 3 * C);
        }
        store(out + c, s0), store(out + c + C, s1), store(out + c + 2 * C, s2), store(out + c + 3 * C, s3);
    }
    for (; c < width; c += C) {
        vec s{};
        for (int64_t j = 0; j < n; ++j) s += a[j] * load(X + j * stride + c);
        store(out + c, s);
    }
}

// A[16][16] rows of Xrow [16][Kp] against the columns of YT [Kp][16]; four rows per pass for ILP.
inline void products(float* A, const float* X, const float* YT, int64_t Kp) {
    for (int64_t i = 0; i < C; i += 4) {
        vec a0{}, a1{}, a2{}, a3{};
        const float* x = X + i * Kp;
        for (int64_t d = 0; d < Kp; ++d) {
            const vec y = load(YT + d * C);
            a0 += x[d] * y, a1 += x[Kp + d] * y, a2 += x[2 * Kp + d] * y, a3 += x[3 * Kp + d] * y;
        }
        store(A + i * C, a0), store(A + (i + 1) * C, a1), store(A + (i + 2) * C, a2), store(A + (i + 3) * C, a3);
    }
}

inline void transpose(float* dstT, const float* src, int64_t Kp) {  // src [16][Kp] -> dstT [Kp][16]
    for (int64_t i = 0; i < C; ++i)
        for (int64_t d = 0; d < Kp; ++d) dstT[d * C + i] = src[i * Kp + d];
}

// Phase 1 for one chunk of n <= 16 tokens (rows already loaded into w.q, w.k, w.v, w.g, w.beta).
void intra(Work& w, float scale) {
    const int64_t Kp = w.Kp, Vp = w.Vp;
    for (int64_t d = 0; d < Kp; d += C) {  // G: inclusive cumsum over the chunk
        vec s{};
        for (int64_t i = 0; i < C; ++i) s += load(w.g + i * Kp + d), store(w.G + i * Kp + d, s);
    }
    const float lim = (2.0f / 3.0f) * std::log(FLT_MAX);  // chunk.py's _max_half_span
    bool wide = false;
    for (int64_t d = 0; d < Kp; ++d) wide |= w.G[d] - w.G[(C - 1) * Kp + d] > 2 * lim;
    if (!wide) {  // exp(G_i - G_j) = exp(G_i - c) exp(c - G_j), c the midpoint of the block's range
        for (int64_t d = 0; d < Kp; d += C) {
            const vec mid = 0.5f * (load(w.G + d) + load(w.G + (C - 1) * Kp + d));
            for (int64_t i = 0; i < C; ++i) {
                const int64_t at = i * Kp + d;
                const vec e = vmax(vmin(load(w.G + at) - mid, splat(lim)), splat(-lim));
                const vec up = vexp(e), kk = load(w.k + at);
                store(w.ku + at, kk * up), store(w.qu + at, load(w.q + at) * up), store(w.kn + at, kk * vexp(-e));
            }
        }
        transpose(w.knT, w.kn, Kp);
        products(w.Akk, w.ku, w.knT, Kp);
        products(w.Aqk, w.qu, w.knT, Kp);
    } else {  // pairwise, exponents as segment sums g_{j+1} + ... + g_i (<= 0: nothing overflows)
        for (int64_t j = 0; j < C; ++j) {
            float* s = w.kn;  // scratch row
            std::memset(s, 0, Kp * sizeof(float));
            for (int64_t i = j; i < C; ++i) {
                vec akk{}, aqk{};
                for (int64_t d = 0; d < Kp; d += C) {
                    vec sd = load(s + d);
                    if (i > j) sd += load(w.g + i * Kp + d), store(s + d, sd);
                    const vec kd = load(w.k + j * Kp + d) * vexp(sd);
                    akk += load(w.k + i * Kp + d) * kd, aqk += load(w.q + i * Kp + d) * kd;
                }
                w.Akk[i * C + j] = hsum(akk), w.Aqk[i * C + j] = hsum(aqk);
            }
        }
    }
    for (int64_t i = 0; i < C; ++i)  // keep the strictly lower A_kk and the lower A_qk: select, never multiply
        for (int64_t j = 0; j < C; ++j) {
            w.Akk[i * C + j] = j < i ? w.beta[i] * w.Akk[i * C + j] : 0.0f;
            w.Aqk[i * C + j] = j <= i ? scale * w.Aqk[i * C + j] : 0.0f;
        }
    // inv = (I + L)^-1 by forward substitution on rows (L = Diag(beta) A_kk, unit lower), then * Diag(beta)
    for (int64_t i = 0; i < C; ++i) {
        vec row{};
        row[i] = 1.0f;
        for (int64_t m = 0; m < i; ++m) row -= w.Akk[i * C + m] * load(w.inv + m * C);
        store(w.inv + i * C, row);
    }
    const vec bv = load(w.beta);
    for (int64_t i = 0; i < C; ++i) store(w.inv + i * C, load(w.inv + i * C) * bv);
    for (int64_t at = 0; at < C * Kp; at += C) {  // eG = e^G; w.kn reused for k e^G, w.qu for scale q e^G
        const vec e = vexp(load(w.G + at));
        store(w.eG + at, e), store(w.kn + at, load(w.k + at) * e), store(w.qu + at, scale * load(w.q + at) * e);
    }
    for (int64_t i = 0; i < C; ++i) {
        combine(w.W + i * Kp, w.inv + i * C, w.kn, i + 1, Kp, Kp);
        combine(w.U + i * Vp, w.inv + i * C, w.v, i + 1, Vp, Vp);
    }
    for (int64_t i = 0; i < C; ++i) {
        combine(w.Qs + i * Kp, w.Aqk + i * C, w.W, i + 1, Kp, Kp);
        for (int64_t d = 0; d < Kp; d += C) store(w.Qs + i * Kp + d, load(w.qu + i * Kp + d) - load(w.Qs + i * Kp + d));
        combine(w.Ou + i * Vp, w.Aqk + i * C, w.U, i + 1, Vp, Vp);
    }
    transpose(w.WT, w.W, Kp);
    transpose(w.QsT, w.Qs, Kp);
    for (int64_t d = 0; d < Kp; d += C) {  // Kd = k e^(g_{i+1} + ... + g_15): suffix sums of same-signed steps
        vec s{};
        for (int64_t i = C - 1; i >= 0; --i) {
            const vec kd = load(w.k + i * Kp + d) * vexp(s);
            for (int l = 0; l < C; ++l) w.KdT[(d + l) * C + i] = kd[l];
            s += load(w.g + i * Kp + d);
        }
        store(w.decay + d, load(w.eG + (C - 1) * Kp + d));
    }
}

// Phase 2 for one chunk: O rows (n of them, `o_stride` apart) and the state update, per 16-column block.
void inter(Work& w, float* o, int64_t n, int64_t o_stride) {
    const int64_t Kp = w.Kp;
    for (int64_t cb = 0; cb < w.Vp; cb += C) {
        float* Sb = w.Sb + cb * Kp;
        vec vn[C], ov[C];
        for (int64_t r = 0; r < C; ++r) vn[r] = load(w.U + r * w.Vp + cb);
        for (int64_t i = 0; i < Kp; ++i) {
            const vec s = load(Sb + i * C);
            const float* a = w.WT + i * C;
            for (int64_t r = 0; r < C; ++r) vn[r] -= a[r] * s;
        }
        for (int64_t r = 0; r < C; ++r) ov[r] = load(w.Ou + r * w.Vp + cb);
        for (int64_t i = 0; i < Kp; ++i) {
            const vec s = load(Sb + i * C);
            const float* a = w.QsT + i * C;
            for (int64_t r = 0; r < C; ++r) ov[r] += a[r] * s;
        }
        const int64_t cols = w.V - cb < C ? w.V - cb : C;
        for (int64_t r = 0; r < n; ++r) std::memcpy(o + r * o_stride + cb, &ov[r], cols * sizeof(float));
        for (int64_t i = 0; i < Kp; i += 2) {  // two rows, two partial sums each: four FMA chains
            const float *a0 = w.KdT + i * C, *a1 = a0 + C;
            vec x0 = w.decay[i] * load(Sb + i * C), x1 = w.decay[i + 1] * load(Sb + (i + 1) * C), y0{}, y1{};
            for (int64_t r = 0; r < C; r += 2) {
                x0 += a0[r] * vn[r], y0 += a0[r + 1] * vn[r + 1];
                x1 += a1[r] * vn[r], y1 += a1[r + 1] * vn[r + 1];
            }
            store(Sb + i * C, x0 + y0), store(Sb + (i + 1) * C, x1 + y1);
        }
    }
}

// Copies n rows of `len` floats (`stride` apart) into rows of `width` (zero-padded, 16 rows in all).
inline void gather(float* dst, const float* src, int64_t n, int64_t len, int64_t stride, int64_t width) {
    std::memset(dst, 0, C * width * sizeof(float));
    for (int64_t r = 0; r < n; ++r) std::memcpy(dst + r * width, src + r * stride, len * sizeof(float));
}

// fla's in-op activations, applied to the gathered rows (kda/activations.py gives the formulas):
// l2 norms of q and k, the bounded gate lower_bound * sigmoid(exp(A_log) (f + dt_bias)), sigmoid(beta).
struct Activations {
    int l2norm;           // q, k <- x / sqrt(sum x^2 + eps)
    float eps;
    int gate;             // g is the raw gate input f
    const float* A_log;   // [HV] or null (a rate of 1)
    const float* dt_bias; // [HV * K] or null
    float lower_bound;
    float beta_scale;     // 0: beta as given; 1: sigmoid(beta); 2: 2 sigmoid(beta) (allow_neg_eigval)
};

inline void l2norm_rows(float* x, int64_t n, int64_t Kp, float eps) {
    for (int64_t r = 0; r < n; ++r) {
        vec s{};
        for (int64_t d = 0; d < Kp; d += C) s += load(x + r * Kp + d) * load(x + r * Kp + d);
        const float inv = 1.0f / std::sqrt(hsum(s) + eps);
        for (int64_t d = 0; d < Kp; d += C) store(x + r * Kp + d, load(x + r * Kp + d) * inv);
    }
}

// g rows (n real ones) from the gate input; dtb [Kp] the head's dt_bias (zero-padded), rate exp(A_log).
// Returns the number of g values that are NaN (the only way a bounded gate leaves its range).
inline int64_t gate_rows(float* g, int64_t n, int64_t K, int64_t Kp, const float* dtb, float rate, float lb) {
    ivec nan{};
    for (int64_t r = 0; r < n; ++r) {
        for (int64_t d = 0; d < Kp; d += C) {
            const vec z = rate * (load(g + r * Kp + d) + load(dtb + d));
            nan -= z != z;  // counted before vexp, whose clamps would drop a NaN
            store(g + r * Kp + d, lb / (1.0f + vexp(-z)));
        }
        for (int64_t d = K; d < Kp; ++d) g[r * Kp + d] = 0.0f;  // padding channels stay a zero step
    }
    int64_t bad = 0;
    for (int l = 0; l < C; ++l) bad += nan[l];
    return bad;
}

}  // namespace

extern "C" {
// q, k [BT, H, K], g [BT, HV, K], v and o [BT, HV, V], beta [BT, HV] token-major and contiguous (value
// head h reads q/k head h / (HV / H)); activated where `act` says not to (then g <= 0 or -inf); state
// [N, HV, K, V], updated in place; cu [N + 1] token offsets of the sequences in BT. Returns 0, -1 when
// the workspace cannot be allocated (nothing written then), or the number of NaN gate values the in-op
// gate produced (o and state are garbage then: the caller raises).
int64_t kda_chunk_fwd_f32(const float* q, const float* k, const float* v, const float* g, const float* beta,
                          float* state, float* o, const int64_t* cu, int64_t N, int64_t H, int64_t HV, int64_t K,
                          int64_t V, double scale, int l2norm, double eps, int gate, const float* A_log,
                          const float* dt_bias, double lower_bound, double beta_scale) {
    const Activations act{l2norm, static_cast<float>(eps), gate, A_log, dt_bias, static_cast<float>(lower_bound),
                          static_cast<float>(beta_scale)};
    int64_t bad = 0;
    Work w{};
    w.K = K, w.V = V, w.Kp = (K + C - 1) / C * C, w.Vp = (V + C - 1) / C * C;
    const int64_t kr = C * w.Kp, vr = C * w.Vp;
    float* dtb;  // the head's dt_bias, zero-padded to Kp
    const int64_t sizes[] = {kr, kr, vr, kr, kr, kr, kr, kr, kr, kr, kr, vr, kr, vr, kr, kr, kr, w.Kp, w.Kp * w.Vp, w.Kp};
    float** slots[] = {&w.q, &w.k, &w.v, &w.g, &w.G, &w.ku, &w.qu, &w.kn, &w.knT, &w.eG, &w.W, &w.U,
                       &w.Qs, &w.Ou, &w.WT, &w.QsT, &w.KdT, &w.decay, &w.Sb, &dtb};
    int64_t total = 0;
    for (int64_t s : sizes) total += s;
    float* arena = static_cast<float*>(std::aligned_alloc(64, total * sizeof(float)));
    if (!arena) return -1;
    float* at = arena;
    for (int i = 0; i < 20; ++i) *slots[i] = at, at += sizes[i];  // every size is a multiple of 16 floats
    const float fscale = static_cast<float>(scale);
    for (int64_t n = 0; n < N; ++n)
        for (int64_t h = 0; h < HV; ++h) {
            float* S = state + (n * HV + h) * K * V;
            std::memset(dtb, 0, w.Kp * sizeof(float));
            if (act.dt_bias) std::memcpy(dtb, act.dt_bias + h * K, K * sizeof(float));
            const float rate = act.A_log ? std::exp(act.A_log[h]) : 1.0f;
            const int64_t qk_head = h / (HV / H);
            std::memset(w.Sb, 0, w.Kp * w.Vp * sizeof(float));
            for (int64_t i = 0; i < K; ++i)
                for (int64_t j = 0; j < V; ++j) w.Sb[(j / C) * w.Kp * C + i * C + j % C] = S[i * V + j];
            for (int64_t t0 = cu[n]; t0 < cu[n + 1]; t0 += C) {
                const int64_t rows = cu[n + 1] - t0 < C ? cu[n + 1] - t0 : C;
                const int64_t qt = (t0 * H + qk_head) * K, kt = (t0 * HV + h) * K, vt = (t0 * HV + h) * V;
                gather(w.q, q + qt, rows, K, H * K, w.Kp);
                gather(w.k, k + qt, rows, K, H * K, w.Kp);
                gather(w.v, v + vt, rows, V, HV * V, w.Vp);
                gather(w.g, g + kt, rows, K, HV * K, w.Kp);
                if (act.l2norm) l2norm_rows(w.q, rows, w.Kp, act.eps), l2norm_rows(w.k, rows, w.Kp, act.eps);
                if (act.gate) bad += gate_rows(w.g, rows, K, w.Kp, dtb, rate, act.lower_bound);
                for (int64_t r = 0; r < rows * w.Kp; ++r) w.g[r] = w.g[r] < RESET ? RESET : w.g[r];
                for (int64_t r = 0; r < C; ++r) w.beta[r] = r < rows ? beta[(t0 + r) * HV + h] : 0.0f;
                if (act.beta_scale != 0.0f) {  // sigmoid on all 16 lanes at once; padding rows keep beta = 0
                    const vec sig = act.beta_scale / (1.0f + vexp(-load(w.beta)));
                    for (int64_t r = 0; r < rows; ++r) w.beta[r] = sig[r];
                }
                intra(w, fscale);
                inter(w, o + vt, rows, HV * V);
            }
            for (int64_t i = 0; i < K; ++i)
                for (int64_t j = 0; j < V; ++j) S[i * V + j] = w.Sb[(j / C) * w.Kp * C + i * C + j % C];
        }
    std::free(arena);
    return bad;
}
}
