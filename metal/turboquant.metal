// TurboQuant kernels for mx.fast.metal_kernel (loaded by metal/kernels.py).
//
// Bit layout (services/core/kv/packing.py): the indices of one vector of P coordinates
// are one byte row made of planes whose widths divide 8, so no index straddles a byte:
//   1 bit: [1-bit plane, P/8 bytes]   2 bits: [2-bit plane, P/4 bytes]
//   3 bits: [2-bit plane (low bits), P/4 bytes][1-bit plane (high bit), P/8 bytes]
//   4 bits: [nibbles, P/2 bytes]
// Coordinate j of a plane of width w sits in byte j / (8/w), bits (j % (8/w)) * w.
// QJL signs are one more 1-bit plane: bit j set <=> (S r)_j >= 0.
//
// Sections are separated by lines "//// <name>"; "header" is shared by all kernels.

//// header
inline uint tq_index(const device uint8_t* row, uint j, int bits, uint P) {
    if (bits == 4) return (row[j >> 1] >> ((j & 1u) * 4u)) & 15u;
    if (bits == 2) return (row[j >> 2] >> ((j & 3u) * 2u)) & 3u;
    if (bits == 1) return (row[j >> 3] >> (j & 7u)) & 1u;
    uint low = (row[j >> 2] >> ((j & 3u) * 2u)) & 3u;
    uint high = (row[P / 4 + (j >> 3)] >> (j & 7u)) & 1u;
    return low | (high << 2);
}

// -inf marks a masked score (and an empty softmax row)
constant float TQ_NEG_INF = -INFINITY;

//// pack
// One threadgroup of P threads per vector. Inputs: x [N, D] float, rotation [P, P]
// (row-major, y = x_pad @ rotation), boundaries [2^BITS - 1], centroids [2^BITS],
// qjl_t [P, P] (S^T).
// Outputs: norm [N] half, codes [N, CODE_BYTES] uint8, residual_norm [N] half,
// signs [N, P/8] uint8. Template: P, D, BITS, QJL, CODE_BYTES.
uint n = threadgroup_position_in_grid.x;
uint j = thread_position_in_threadgroup.x;
threadgroup float unit[P];
threadgroup float residual[P];
threadgroup uint idx[P];
threadgroup float partial[P];

float xj = j < (uint)D ? float(x[n * D + j]) : 0.0f;
partial[j] = xj * xj;
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint stride = P / 2; stride > 0; stride >>= 1) {
    if (j < stride) partial[j] += partial[j + stride];
    threadgroup_barrier(mem_flags::mem_threadgroup);
}
float nrm = sqrt(partial[0]);
float inv = 1.0f / max(nrm, 1e-12f);
threadgroup_barrier(mem_flags::mem_threadgroup);
unit[j] = xj * inv;
threadgroup_barrier(mem_flags::mem_threadgroup);
float y = 0.0f;
for (uint i = 0; i < (uint)D; ++i) y += unit[i] * rotation[i * P + j];
uint k = 0;
for (uint b = 0; b < (1u << BITS) - 1; ++b) k += y > boundaries[b] ? 1u : 0u;
idx[j] = k;
residual[j] = y - centroids[k];
threadgroup_barrier(mem_flags::mem_threadgroup);
device uint8_t* row = codes + n * CODE_BYTES;
if (BITS == 4) {
    if (j < P / 2) row[j] = uint8_t(idx[2 * j] | (idx[2 * j + 1] << 4));
} else if (BITS == 1) {
    if (j < P / 8) { uint v = 0; for (uint t = 0; t < 8; ++t) v |= (idx[8 * j + t] & 1u) << t; row[j] = uint8_t(v); }
} else {
    if (j < P / 4) { uint v = 0; for (uint t = 0; t < 4; ++t) v |= (idx[4 * j + t] & 3u) << (2 * t); row[j] = uint8_t(v); }
    if (BITS == 3 && j < P / 8) {
        uint v = 0; for (uint t = 0; t < 8; ++t) v |= ((idx[8 * j + t] >> 2) & 1u) << t;
        row[P / 4 + j] = uint8_t(v);
    }
}
if (j == 0) norm[n] = half(nrm);
threadgroup_barrier(mem_flags::mem_threadgroup);  // idx is reused below
if (QJL) {
    partial[j] = residual[j] * residual[j];
    float s = 0.0f;
    for (uint i = 0; i < (uint)P; ++i) s += residual[i] * qjl_t[i * P + j];
    idx[j] = s >= 0.0f ? 1u : 0u;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint stride = P / 2; stride > 0; stride >>= 1) {
        if (j < stride) partial[j] += partial[j + stride];
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (j < P / 8) { uint v = 0; for (uint t = 0; t < 8; ++t) v |= idx[8 * j + t] << t; signs[n * (P / 8) + j] = uint8_t(v); }
    if (j == 0) residual_norm[n] = half(sqrt(partial[0]));
}

//// scores
// scores[g, l, t] = norm[g,t] * (sum_j q[g,l,j] c[idx_j] + qjl_scale * rnorm[g,t] * sum_j sq[g,l,j] sgn_j)
// q: rotated queries [G, L, P]; sq: q @ S^T [G, L, P] (unused without QJL); codes
// [G, T, CODE_BYTES]; norm, residual_norm [G, T] half; signs [G, T, P/8].
// Grid (T, ceil(L / ROWS), G): one thread per token and tile of ROWS query rows, so a
// token's code bytes are decoded once per tile, not once per query row.
// Template: P, L, ROWS, BITS, QJL, CODE_BYTES.
uint t = thread_position_in_grid.x;
uint l0 = thread_position_in_grid.y * ROWS;
uint g = thread_position_in_grid.z;
uint T = norm_shape[1];
if (t >= T) return;
const device uint8_t* row = codes + (ulong(g) * T + t) * CODE_BYTES;
const device float* qrows = queries + (ulong(g) * L + l0) * P;
float acc[ROWS];
float qjl[ROWS];
for (int r = 0; r < ROWS; ++r) acc[r] = qjl[r] = 0.0f;
for (uint j = 0; j < (uint)P; ++j) {
    float c = centroids[tq_index(row, j, BITS, P)];
    for (int r = 0; r < ROWS; ++r) if (l0 + r < (uint)L) acc[r] += qrows[r * P + j] * c;
}
float nrm = float(norm[ulong(g) * T + t]);
float rn = 0.0f;
if (QJL) {
    const device uint8_t* srow = signs + (ulong(g) * T + t) * (P / 8);
    const device float* sq = projected + (ulong(g) * L + l0) * P;
    for (uint j = 0; j < (uint)P; ++j) {
        bool up = (srow[j >> 3] >> (j & 7u)) & 1u;
        for (int r = 0; r < ROWS; ++r) if (l0 + r < (uint)L) qjl[r] += up ? sq[r * P + j] : -sq[r * P + j];
    }
    rn = qjl_scale[0] * float(residual_norm[ulong(g) * T + t]);
}
for (int r = 0; r < ROWS; ++r) {
    if (l0 + r < (uint)L) scores[(ulong(g) * L + l0 + r) * T + t] = (acc[r] + rn * qjl[r]) * nrm;
}

//// values
// partial[g, c, l, j] = sum over the tokens t of chunk c of w[g, l, t] * norm[g, t] * c[idx(t, j)],
// still rotated (the caller sums the chunks). weights [G, L, T] float; codes [G, T, CODE_BYTES];
// norm [G, T] half. Grid (P * chunks, ceil(L / ROWS), G), threadgroup P: a threadgroup walks
// CHUNK tokens, so T is split over many threadgroups instead of one thread walking all of it.
// Template: P, L, ROWS, CHUNK, BITS, CODE_BYTES.
uint j = thread_position_in_threadgroup.x;
uint chunk = threadgroup_position_in_grid.x;
uint l0 = threadgroup_position_in_grid.y * ROWS;
uint g = threadgroup_position_in_grid.z;
uint T = norm_shape[1];
uint chunks = threadgroups_per_grid.x;
uint begin = chunk * CHUNK;
uint end = min(T, begin + (uint)CHUNK);
float acc[ROWS];
for (int r = 0; r < ROWS; ++r) acc[r] = 0.0f;
const device float* w = weights + (ulong(g) * L + l0) * T;
for (uint t = begin; t < end; ++t) {
    const device uint8_t* row = codes + (ulong(g) * T + t) * CODE_BYTES;
    float v = float(norm[ulong(g) * T + t]) * centroids[tq_index(row, j, BITS, P)];
    for (int r = 0; r < ROWS; ++r) if (l0 + r < (uint)L) acc[r] += w[ulong(r) * T + t] * v;
}
for (int r = 0; r < ROWS; ++r) {
    if (l0 + r < (uint)L) out[((ulong(g) * chunks + chunk) * L + l0 + r) * P + j] = acc[r];
}

//// decode_partial
// Fused decode attention, pass 1 of 2 (split-K / flash decoding), the twin of the CUDA
// section of the same name (metal/turboquant.cu, where the contract is spelled out): every
// threadgroup scores one chunk of TB tokens against all R = rep * L query rows of one KV
// head and keeps a partial softmax (row max, sum of exp, exp-weighted value sum) of that
// chunk. Threadgroups [0, NBE) walk the exact tokens (sinks, then the recent window),
// [NBE, NB) the compressed run from its codes, in the rotated domain. Inputs are whole
// buffers read through their strides. Outputs: part_m, part_l [G, NB, R], part_acc
// [G, NB, R, P]. Grid (NB * TB, G), threadgroup TB.
// Template: P, D, R, L, TB, KBITS, VBITS, QJL, QT, KT.
constexpr int NS = TB / P;  // value pass: NS slices of P threads, each summing every NS-th token
threadgroup float q_s[R * P];
threadgroup float qp_s[QJL ? R * P : 1];
threadgroup float p_s[R * TB];
threadgroup float red_s[R * TB];

uint tid = thread_position_in_threadgroup.x;
uint block = threadgroup_position_in_grid.x;
uint g = threadgroup_position_in_grid.y;
uint n_blocks = threadgroups_per_grid.x;
uint H = k_norm_shape[1];
uint b = g / H, h = g % H;
uint rep = R / L;
int sinks = lengths[0], compressed = lengths[1], recent = lengths[2], start = lengths[3];
int offset = sinks + compressed + recent;
int nbe = (sinks + recent + TB - 1) / TB;
bool exact = (int)block < nbe;
int first = exact ? (int)block * TB : ((int)block - nbe) * TB;
int count = exact ? sinks + recent : compressed;
float scale = params[0];

// query rows r = rr * L + l of head h * rep + rr, position start + l
for (uint i = tid; i < (uint)(R * D); i += TB) {
    uint r = i / D, d = i % D;
    long at = b * queries_strides[0] + (h * rep + r / L) * queries_strides[1] + (r % L) * queries_strides[2]
        + d * queries_strides[3];
    red_s[i] = float(queries[at]) * scale;  // staging (red_s is free until the value pass)
}
threadgroup_barrier(mem_flags::mem_threadgroup);
if (exact) {
    for (uint i = tid; i < (uint)(R * D); i += TB) q_s[(i / D) * P + i % D] = red_s[i];
} else {
    for (uint i = tid; i < (uint)(R * P); i += TB) {
        uint r = i / P, j = i % P;
        float y = 0.0f;
        for (uint d = 0; d < (uint)D; ++d)
            y += red_s[r * D + d] * k_rotation[d * k_rotation_strides[0] + j * k_rotation_strides[1]];
        q_s[i] = y;
    }
    if (QJL) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (uint i = tid; i < (uint)(R * P); i += TB) {
            uint r = i / P, j = i % P;
            float y = 0.0f;
            for (uint k = 0; k < (uint)P; ++k) y += q_s[r * P + k] * qjl_t[k * qjl_t_strides[0] + j * qjl_t_strides[1]];
            qp_s[i] = y;
        }
    }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// scores: one thread per token of the chunk
{
    int t = first + (int)tid;
    float acc[R];
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    int position = 0;
    bool valid = t < count;
    if (valid && exact) {
        bool is_sink = t < sinks;
        int slot = is_sink ? t : t - sinks;
        position = is_sink ? t : sinks + compressed + slot;
        const device KT* key = is_sink
            ? sink_k + b * sink_k_strides[0] + h * sink_k_strides[1] + slot * sink_k_strides[2]
            : recent_k + b * recent_k_strides[0] + h * recent_k_strides[1] + slot * recent_k_strides[2];
        long ks = is_sink ? sink_k_strides[3] : recent_k_strides[3];
        for (int d = 0; d < D; ++d) {
            float k = float(key[d * ks]);
            for (int r = 0; r < R; ++r) acc[r] += q_s[r * P + d] * k;
        }
    } else if (valid) {
        position = sinks + t;
        const device uint8_t* row = k_codes + b * k_codes_strides[0] + h * k_codes_strides[1] + t * k_codes_strides[2];
        for (uint j = 0; j < (uint)P; ++j) {
            float c = k_centroids[tq_index(row, j, KBITS, P)];
            for (int r = 0; r < R; ++r) acc[r] += q_s[r * P + j] * c;
        }
        if (QJL) {
            const device uint8_t* srow = k_signs + b * k_signs_strides[0] + h * k_signs_strides[1] + t * k_signs_strides[2];
            float qjl[R];
            for (int r = 0; r < R; ++r) qjl[r] = 0.0f;
            for (uint j = 0; j < (uint)P; ++j) {
                bool up = (srow[j >> 3] >> (j & 7u)) & 1u;
                for (int r = 0; r < R; ++r) qjl[r] += up ? qp_s[r * P + j] : -qp_s[r * P + j];
            }
            float rn = params[1] * float(k_rnorm[b * k_rnorm_strides[0] + h * k_rnorm_strides[1] + t * k_rnorm_strides[2]]);
            for (int r = 0; r < R; ++r) acc[r] += rn * qjl[r];
        }
        float nrm = float(k_norm[b * k_norm_strides[0] + h * k_norm_strides[1] + t * k_norm_strides[2]]);
        for (int r = 0; r < R; ++r) acc[r] *= nrm;
    }
    for (int r = 0; r < R; ++r) {
        int query = start + r % L;
        bool visible = valid && (position <= query || query >= offset);
        p_s[r * TB + tid] = visible ? acc[r] : TQ_NEG_INF;
    }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// partial softmax of each row over this chunk: one SIMD group (32 threads) per row
{
    uint warp = tid / 32, lane = tid % 32;
    for (uint r = warp; r < (uint)R; r += TB / 32) {
        float m = TQ_NEG_INF;
        for (uint i = lane; i < (uint)TB; i += 32) m = max(m, p_s[r * TB + i]);
        m = simd_max(m);
        float s = 0.0f;
        for (uint i = lane; i < (uint)TB; i += 32) {
            float v = p_s[r * TB + i];
            float e = v == TQ_NEG_INF ? 0.0f : metal::exp(v - m);
            p_s[r * TB + i] = e;
            s += e;
        }
        s = simd_sum(s);
        if (lane == 0) {
            part_m[(ulong(g) * n_blocks + block) * R + r] = m;
            part_l[(ulong(g) * n_blocks + block) * R + r] = s;
        }
    }
}
threadgroup_barrier(mem_flags::mem_threadgroup);

// exp-weighted value sum: slice s of NS sums tokens s, s + NS, ... for coordinate j
{
    uint j = tid % P, slice = tid / P;
    float acc[R];
    for (int r = 0; r < R; ++r) acc[r] = 0.0f;
    int stop = min(TB, count - first);
    if (exact) {
        if (j < (uint)D) {
            for (int i = slice; i < stop; i += NS) {
                int t = first + i;
                bool is_sink = t < sinks;
                int slot = is_sink ? t : t - sinks;
                float v = is_sink
                    ? float(sink_v[b * sink_v_strides[0] + h * sink_v_strides[1] + slot * sink_v_strides[2]
                        + j * sink_v_strides[3]])
                    : float(recent_v[b * recent_v_strides[0] + h * recent_v_strides[1] + slot * recent_v_strides[2]
                        + j * recent_v_strides[3]]);
                for (int r = 0; r < R; ++r) acc[r] += p_s[r * TB + i] * v;
            }
        }
    } else {
        for (int i = slice; i < stop; i += NS) {
            int t = first + i;
            const device uint8_t* row = v_codes + b * v_codes_strides[0] + h * v_codes_strides[1] + t * v_codes_strides[2];
            float v = float(v_norm[b * v_norm_strides[0] + h * v_norm_strides[1] + t * v_norm_strides[2]])
                * v_centroids[tq_index(row, j, VBITS, P)];
            for (int r = 0; r < R; ++r) acc[r] += p_s[r * TB + i] * v;
        }
    }
    for (int r = 0; r < R; ++r) red_s[(slice * R + r) * P + j] = acc[r];
}
threadgroup_barrier(mem_flags::mem_threadgroup);
for (uint i = tid; i < (uint)(R * P); i += TB) {
    float s = 0.0f;
    for (int slice = 0; slice < NS; ++slice) s += red_s[slice * R * P + i];
    part_acc[(ulong(g) * n_blocks + block) * R * P + i] = s;
}

//// decode_combine
// Fused decode attention, pass 2 of 2: merges the partial softmaxes of all threadgroups of
// one (KV head, query row) and rotates the compressed run's value sum back once:
//   out = (sum_exact e^(m_b - M) acc_b + F_v^T sum_compressed e^(m_b - M) acc_b) / sum_b e^(m_b - M) l_b
// Inputs: part_m, part_l [G, NB, R], part_acc [G, NB, R, P], lengths int [4], v_rotation
// [P, P] (the value codec's F_v). Output: out [G, R, D] (OT). Grid (P, R, G), threadgroup P.
// Template: P, D, R, TB, OT.
threadgroup float rotated_s[P];
uint j = thread_position_in_threadgroup.x;
uint r = threadgroup_position_in_grid.y;
uint g = threadgroup_position_in_grid.z;
uint NB = part_m_shape[1];
int nbe = (lengths[0] + lengths[2] + TB - 1) / TB;
const device float* m = part_m + ulong(g) * NB * R;
const device float* l = part_l + ulong(g) * NB * R;
float top = TQ_NEG_INF;
for (uint k = 0; k < NB; ++k) top = max(top, m[k * R + r]);
float total = 0.0f, exact_sum = 0.0f, rotated_sum = 0.0f;
for (uint k = 0; k < NB; ++k) {
    float mk = m[k * R + r];
    float e = mk == TQ_NEG_INF ? 0.0f : metal::exp(mk - top);
    total += e * l[k * R + r];
    float a = part_acc[((ulong(g) * NB + k) * R + r) * P + j];
    if ((int)k < nbe) {
        if (j < (uint)D) exact_sum += e * a;
    } else {
        rotated_sum += e * a;
    }
}
rotated_s[j] = rotated_sum;
threadgroup_barrier(mem_flags::mem_threadgroup);
if (j < (uint)D) {
    float y = exact_sum;
    for (uint k = 0; k < (uint)P; ++k) y += rotated_s[k] * v_rotation[j * P + k];
    out[(ulong(g) * R + r) * D + j] = static_cast<OT>(y / total);
}

//// decode_run
// A compressed run decoded into the rotated domain for one prefill call (the twin:
// codec.estimated_keys / decode_rotated), one thread per coordinate:
//   keys[g, t, j]   = |k| c_k[idx_j]                      (the MSE part of the key)
//   k_sign[g, t, j] = |k| qjl_scale |r| (+1 | -1)          (QJL: the caller adds k_sign @ S)
//   values[g, t, j] = |v| c_v[idx_j]
// Inputs: k_norm, k_rnorm, v_norm [G, T] half; k_codes [G, T, KCODE_BYTES], k_signs
// [G, T, P/8], v_codes [G, T, VCODE_BYTES] uint8; k_centroids, v_centroids float;
// qjl_scale [1] float. Outputs [G, T, P] of OT. Grid (T * P, G, 1), threadgroup 256.
// Template: P, KBITS, VBITS, QJL, KCODE_BYTES, VCODE_BYTES, OT.
ulong tid = thread_position_in_grid.x;
uint g = thread_position_in_grid.y;
ulong T = k_norm_shape[1];
if (tid >= T * P) return;
ulong t = tid / P;
uint j = uint(tid % P);
ulong row = ulong(g) * T + t;
ulong at = row * P + j;
float kn = float(k_norm[row]);
keys[at] = static_cast<OT>(kn * k_centroids[tq_index(k_codes + row * KCODE_BYTES, j, KBITS, P)]);
if (QJL) {
    bool up = (k_signs[row * (P / 8) + (j >> 3)] >> (j & 7u)) & 1u;
    float a = kn * float(k_rnorm[row]) * qjl_scale[0];
    k_sign[at] = static_cast<OT>(up ? a : -a);
}
values[at] = static_cast<OT>(float(v_norm[row]) * v_centroids[tq_index(v_codes + row * VCODE_BYTES, j, VBITS, P)]);
