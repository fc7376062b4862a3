/* int4 projections in integer arithmetic: AVX-512 VNNI for a few rows, AMX int8 tiles for many.
 * Built and loaded by nodeagent/engine/int4_cpu.py.
 *
 * Every sum is an exact integer, so both paths give the same bits and a row's products never
 * depend on the rows beside it (decode and a prefill of the same tokens agree to the bit):
 * - each group of 32 activations a becomes q = round(a / step), step = max|a| / QMAX, split as
 *   q = 256 * high + low with both in int8;
 * - per group and output, the codes c (0..15) give D = 256 * sum(high * c) + sum(low * c) =
 *   sum(q * c), below 2^24 so exact in fp32 too;
 * - with w = scale * c + minimum, the group adds step * (scale * D + minimum * sum(q)), one
 *   fixed order of fp32 operations in both paths.
 *
 * Codes come in this kernel's own layout (`Int4Kernel.pack`): for each 16 outputs and each 8 of
 * k, 64 bytes whose byte 4 n + j holds output n's code at k + j (low nibble) and k + 4 + j (high).
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define GROUP 32               /* codes per scale */
#define TILE_COLS 16           /* outputs of one vector, or of one tile's columns */
#define BLOCK 64               /* outputs the tile path takes at once: four column tiles */
#define OCTET_BYTES 64         /* 16 outputs by 8 of k */
#define GROUP_BYTES (GROUP / 8 * OCTET_BYTES)  /* one group of 16 outputs, packed or unpacked by half */
#define CHUNK 8                /* groups the tile path unpacks at a time */
#define QMAX 32639.0f          /* |q| whose high byte still fits int8 */
#define VECTOR_ROWS 4          /* rows the vector path holds in registers at once */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Linux hands out the tile state only to a process that asks for it. */
int sf_amx_enable(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

/* The activations quantized per group: the int8 halves [m][k] of q, and per [m][k / GROUP] the
 * step and sum(q). */
typedef struct {
    int8_t *high, *low;
    float *step, *total;
} activations;

static void quantize_row(const float *x, int k_all, int8_t *high, int8_t *low, float *step, float *total) {
    for (int g = 0; g < k_all / GROUP; g++) {
        __m512 a = _mm512_loadu_ps(x + g * GROUP), b = _mm512_loadu_ps(x + g * GROUP + 16);
        float peak = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        __m512 scale = _mm512_set1_ps(peak > 0 ? QMAX / peak : 0);
        __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, scale)), qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, scale));
        __m512i bias = _mm512_set1_epi32(128);
        __m512i ha = _mm512_srai_epi32(_mm512_add_epi32(qa, bias), 8), hb = _mm512_srai_epi32(_mm512_add_epi32(qb, bias), 8);
        __m512i la = _mm512_sub_epi32(qa, _mm512_slli_epi32(ha, 8)), lb = _mm512_sub_epi32(qb, _mm512_slli_epi32(hb, 8));
        _mm_storeu_si128((__m128i *)(high + g * GROUP), _mm512_cvtepi32_epi8(ha));
        _mm_storeu_si128((__m128i *)(high + g * GROUP + 16), _mm512_cvtepi32_epi8(hb));
        _mm_storeu_si128((__m128i *)(low + g * GROUP), _mm512_cvtepi32_epi8(la));
        _mm_storeu_si128((__m128i *)(low + g * GROUP + 16), _mm512_cvtepi32_epi8(lb));
        step[g] = peak / QMAX;
        total[g] = (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
    }
}

/* acc + step * (scale * D + minimum * sum(q)) for 16 outputs, D = 256 * high_sum + low_sum. */
static inline __m512 apply(__m512 acc, __m512i high_sum, __m512i low_sum, __m512 scale, __m512 minimum, float step,
                           float total) {
    __m512 d = _mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(high_sum, 8), low_sum));
    __m512 t = _mm512_fmadd_ps(minimum, _mm512_set1_ps(total), _mm512_mul_ps(scale, d));
    return _mm512_fmadd_ps(_mm512_set1_ps(step), t, acc);
}

/* The vector path: 16 outputs (their codes at `codes`, scale and minimum with stride n) for
 * `rows` rows from `r0`, written to y (stride n). */
static inline __attribute__((always_inline)) void vector_tile(const activations *a, const uint8_t *codes,
        const float *scale, const float *minimum, float *y, int r0, int rows, int n, int k_all) {
    const __m512i nibble = _mm512_set1_epi8(15);
    int groups = k_all / GROUP;
    __m512 acc[VECTOR_ROWS];
    for (int r = 0; r < rows; r++)
        acc[r] = _mm512_setzero_ps();
    for (int g = 0; g < groups; g++) {
        __m512i hs[VECTOR_ROWS], ls[VECTOR_ROWS];
        for (int r = 0; r < rows; r++)
            hs[r] = ls[r] = _mm512_setzero_si512();
        for (int o = 0; o < GROUP / 8; o++) {
            __m512i v = _mm512_loadu_si512(codes + (size_t)(g * GROUP / 8 + o) * OCTET_BYTES);
            __m512i first = _mm512_and_si512(v, nibble), second = _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
            for (int r = 0; r < rows; r++) {
                size_t at = (size_t)(r0 + r) * k_all + g * GROUP + 8 * o;
                const int32_t *h = (const int32_t *)(a->high + at), *l = (const int32_t *)(a->low + at);
                hs[r] = _mm512_dpbusd_epi32(hs[r], first, _mm512_set1_epi32(h[0]));
                hs[r] = _mm512_dpbusd_epi32(hs[r], second, _mm512_set1_epi32(h[1]));
                ls[r] = _mm512_dpbusd_epi32(ls[r], first, _mm512_set1_epi32(l[0]));
                ls[r] = _mm512_dpbusd_epi32(ls[r], second, _mm512_set1_epi32(l[1]));
            }
        }
        __m512 s = _mm512_loadu_ps(scale + (size_t)g * n), z = _mm512_loadu_ps(minimum + (size_t)g * n);
        for (int r = 0; r < rows; r++) {
            size_t at = (size_t)(r0 + r) * groups + g;
            acc[r] = apply(acc[r], hs[r], ls[r], s, z, a->step[at], a->total[at]);
        }
    }
    for (int r = 0; r < rows; r++)
        _mm512_storeu_ps(y + (size_t)(r0 + r) * n, acc[r]);
}

static void vector_rows(const activations *a, const uint8_t *codes, const float *scale, const float *minimum,
                        float *y, int m, int n, int k_all) {
    for (int r0 = 0; r0 < m; r0 += VECTOR_ROWS) {
        switch (m - r0) {
        case 1: vector_tile(a, codes, scale, minimum, y, r0, 1, n, k_all); break;
        case 2: vector_tile(a, codes, scale, minimum, y, r0, 2, n, k_all); break;
        case 3: vector_tile(a, codes, scale, minimum, y, r0, 3, n, k_all); break;
        default: vector_tile(a, codes, scale, minimum, y, r0, 4, n, k_all);
        }
    }
}

/* Tiles 0-3 sum a group's high and low products for two column tiles of `rows` rows, 4 and 5
 * hold the activations' halves (32 of k), 6 and 7 the codes (8 rows of 4 k by 16 columns). */
static void configure(int rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = t == 4 || t == 5 ? GROUP : 64;
        cfg.rows[t] = t < 6 ? rows : GROUP / 4;
    }
    _tile_loadconfig(&cfg);
}

/* `groups` groups of a block's four column tiles as bytes [group][column tile][k quad][16][4]. */
static void unpack_tiles(const uint8_t *codes, size_t tile_stride, int g0, int groups, uint8_t *tiles) {
    const __m512i nibble = _mm512_set1_epi8(15);
    for (int g = 0; g < groups; g++)
        for (int t = 0; t < 4; t++)
            for (int o = 0; o < GROUP / 8; o++) {
                __m512i v = _mm512_loadu_si512(codes + t * tile_stride + (size_t)((g0 + g) * GROUP / 8 + o) * OCTET_BYTES);
                uint8_t *out = tiles + ((size_t)g * 4 + t) * 2 * GROUP_BYTES + 2 * o * 64;
                _mm512_store_si512(out, _mm512_and_si512(v, nibble));
                _mm512_store_si512(out + 64, _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble));
            }
}

/* One group's sums for column tiles t0 and t0 + 1 into `sums` [rows][4][16] int32: high and
 * low of the first, high and low of the second. */
static void tile_sums(const uint8_t *b, int t0, int32_t *sums) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(6, b + t0 * 2 * GROUP_BYTES, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 5, 6);
    _tile_loadd(7, b + (t0 + 1) * 2 * GROUP_BYTES, 64);
    _tile_dpbssd(2, 4, 7);
    _tile_dpbssd(3, 5, 7);
    _tile_stored(0, sums, 256);
    _tile_stored(1, sums + 16, 256);
    _tile_stored(2, sums + 32, 256);
    _tile_stored(3, sums + 48, 256);
}

static void tile_chunk(const activations *a, const uint8_t *tiles, const float *scale, const float *minimum,
                       float *acc, int m, int n, int k_all, int g0, int groups, int *configured) {
    int32_t sums[2][16 * 64] __attribute__((aligned(64)));
    int all_groups = k_all / GROUP;
    for (int m0 = 0; m0 < m; m0 += 16) {
        int rows = m - m0 < 16 ? m - m0 : 16;
        if (rows != *configured) {
            configure(rows);
            *configured = rows;
        }
        for (int g = g0; g < g0 + groups; g++) {
            const uint8_t *b = tiles + (size_t)(g - g0) * 4 * 2 * GROUP_BYTES;
            _tile_loadd(4, a->high + (size_t)m0 * k_all + g * GROUP, k_all);
            _tile_loadd(5, a->low + (size_t)m0 * k_all + g * GROUP, k_all);
            tile_sums(b, 0, sums[0]);
            tile_sums(b, 2, sums[1]);
            __m512 sc[4], mn[4];
            for (int t = 0; t < 4; t++) {
                sc[t] = _mm512_loadu_ps(scale + (size_t)g * n + 16 * t);
                mn[t] = _mm512_loadu_ps(minimum + (size_t)g * n + 16 * t);
            }
            for (int r = 0; r < rows; r++) {
                size_t at = (size_t)(m0 + r) * all_groups + g;
                float step = a->step[at], total = a->total[at];
                float *out = acc + (size_t)(m0 + r) * BLOCK;
                for (int t = 0; t < 4; t++) {
                    const int32_t *part = sums[t / 2] + r * 64 + (t % 2) * 32;
                    __m512 prior = g == 0 ? _mm512_setzero_ps() : _mm512_load_ps(out + 16 * t);
                    _mm512_store_ps(out + 16 * t, apply(prior, _mm512_load_si512(part), _mm512_load_si512(part + 16),
                                                        sc[t], mn[t], step, total));
                }
            }
        }
    }
}

static _Thread_local uint8_t *held;
static _Thread_local size_t held_bytes;

/* A thread's buffers, kept between calls so that no call maps fresh pages. */
static uint8_t *scratch(size_t bytes) {
    if (bytes > held_bytes) {
        free(held);
        held = aligned_alloc(64, bytes);
        held_bytes = held == NULL ? 0 : bytes;
    }
    return held;
}

static int tile_block(const activations *a, const uint8_t *codes, const float *scale, const float *minimum,
                      float *y, int m, int n, int k_all, int *configured) {
    size_t unpacked = (size_t)CHUNK * 4 * 2 * GROUP_BYTES;
    uint8_t *tiles = scratch(unpacked + (size_t)m * BLOCK * 4);
    if (tiles == NULL)
        return -1;
    float *acc = (float *)(tiles + unpacked);
    int groups = k_all / GROUP;
    for (int g0 = 0; g0 < groups; g0 += CHUNK) {
        int count = groups - g0 < CHUNK ? groups - g0 : CHUNK;
        unpack_tiles(codes, (size_t)k_all / 8 * OCTET_BYTES, g0, count, tiles);
        tile_chunk(a, tiles, scale, minimum, acc, m, n, k_all, g0, count, configured);
    }
    for (int r = 0; r < m; r++)
        memcpy(y + (size_t)r * n, acc + (size_t)r * BLOCK, BLOCK * 4);
    return 0;
}

/* y[m, n] = x[m, k_all] @ W.T in fp32, w = scale * code + minimum with scale and minimum
 * [k_all / 32, n]. Calls of `tile_rows` rows or more take the tile path (pass more rows than any
 * call has where the process has no tiles). Returns -1 where memory ran out. */
int sf_int4_mm(const float *x, const uint8_t *codes, const float *scale, const float *minimum, float *y,
               int m, int n, int k_all, int tile_rows) {
    int groups = k_all / GROUP, failed = 0;
    size_t tile_stride = (size_t)k_all / 8 * OCTET_BYTES;
    activations a = {malloc((size_t)m * k_all), malloc((size_t)m * k_all), malloc((size_t)m * groups * 4),
                     malloc((size_t)m * groups * 4)};
    if (a.high == NULL || a.low == NULL || a.step == NULL || a.total == NULL) {
        free(a.high), free(a.low), free(a.step), free(a.total);
        return -1;
    }
#pragma omp parallel reduction(|| : failed)
    {
#pragma omp for schedule(static)
        for (int r = 0; r < m; r++)
            quantize_row(x + (size_t)r * k_all, k_all, a.high + (size_t)r * k_all, a.low + (size_t)r * k_all,
                         a.step + (size_t)r * groups, a.total + (size_t)r * groups);
        if (m < tile_rows) {
#pragma omp for schedule(static)
            for (int t = 0; t < n / TILE_COLS; t++)
                vector_rows(&a, codes + t * tile_stride, scale + t * TILE_COLS, minimum + t * TILE_COLS,
                            y + t * TILE_COLS, m, n, k_all);
        } else {
            int configured = -1;
#pragma omp for schedule(static)
            for (int nb = 0; nb < n / BLOCK; nb++)
                if (!failed)
                    failed = tile_block(&a, codes + nb * 4 * tile_stride, scale + nb * BLOCK, minimum + nb * BLOCK,
                                        y + nb * BLOCK, m, n, k_all, &configured) != 0;
        }
    }
    free(a.high), free(a.low), free(a.step), free(a.total);
    return failed ? -1 : 0;
}
