/* int4 projections on AMX: the weights of torch's AVX-512 int4 packing, unpacked a block of 64
 * output rows at a time into bf16 tiles, multiplied with the bf16 activations by the tile unit.
 *
 * Built and loaded by nodeagent/engine/amx.py. A row's products depend only on that row: the
 * tiles sum over the columns in the same order whatever rows run beside it.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
#define COLS 64      /* output rows of one packed block (the C tiles' columns) */
#define KTILE 32     /* bf16 values of one AMX A-tile row */

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* Linux hands out the tile state only to a process that asks for it. */
int sf_amx_enable(void) {
    return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
}

static void configure(int rows) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < 8; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = t < 5 ? rows : 16;
    }
    _tile_loadconfig(&cfg);
}

static void bf16_pairs_to_fp32(__m512i pairs, __m512 *scale, __m512 *zero) {
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(pairs)), 16));
    __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(pairs, 1)), 16));
    *scale = _mm512_permutex2var_ps(lo, even, hi);
    *zero = _mm512_permutex2var_ps(lo, odd, hi);
}

/* One k of a block: its 64 weights as four vectors of 16 in fp32. */
static void dequant_k(const uint8_t *codes, const __m512 *scale, const __m512 *zero, __m512 *w) {
    const __m512 lut = _mm512_set_ps(7, 6, 5, 4, 3, 2, 1, 0, -1, -2, -3, -4, -5, -6, -7, -8);
    __m256i bytes = _mm256_loadu_si256((const __m256i *)codes);
    __m512i first = _mm512_cvtepu8_epi32(_mm256_castsi256_si128(bytes));
    __m512i second = _mm512_cvtepu8_epi32(_mm256_extracti128_si256(bytes, 1));
    w[0] = _mm512_fmadd_ps(_mm512_permutexvar_ps(first, lut), scale[0], zero[0]);
    w[1] = _mm512_fmadd_ps(_mm512_permutexvar_ps(second, lut), scale[1], zero[1]);
    w[2] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(first, 4), lut), scale[2], zero[2]);
    w[3] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(second, 4), lut), scale[3], zero[3]);
}

/* A block's weights as bf16 B-tiles: [K/32][4 column tiles][16 k pairs][16 columns][2]. */
static void unpack_block(const uint8_t *codes, const uint16_t *pairs, int n, int k_all, int group, uint16_t *tiles) {
    const __m512i interleave = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    __m512 scale[4], zero[4], w0[4], w1[4];
    for (int k = 0; k < k_all; k += 2) {
        if (k % group == 0)
            for (int i = 0; i < 4; i++)
                bf16_pairs_to_fp32(_mm512_loadu_si512(pairs + (size_t)(k / group) * n * 2 + 32 * i), &scale[i], &zero[i]);
        dequant_k(codes + (size_t)k * 32, scale, zero, w0);
        dequant_k(codes + (size_t)(k + 1) * 32, scale, zero, w1);
        uint16_t *row = tiles + ((size_t)(k / KTILE) * 4 * 16 + (k % KTILE) / 2) * 32;
        for (int t = 0; t < 4; t++) {
            __m512i both = (__m512i)_mm512_cvtne2ps_pbh(w1[t], w0[t]);
            _mm512_storeu_si512(row + t * 16 * 32, _mm512_permutexvar_epi16(interleave, both));
        }
    }
}

static void store_rows(const float *acc, uint16_t *out, int rows, int n) {
    for (int r = 0; r < rows; r++)
        for (int t = 0; t < 4; t++) {
            __m256bh v = _mm512_cvtneps_pbh(_mm512_loadu_ps(acc + r * COLS + t * 16));
            _mm256_storeu_si256((__m256i *)(out + (size_t)r * n + t * 16), (__m256i)v);
        }
}

static void block_product(const uint16_t *a, const uint16_t *tiles, uint16_t *c, int m, int n, int k_all) {
    float acc[16 * COLS] __attribute__((aligned(64)));
    int configured = -1;
    for (int m0 = 0; m0 < m; m0 += 16) {
        int rows = m - m0 < 16 ? m - m0 : 16;
        if (rows != configured) {
            configure(rows);
            configured = rows;
        }
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int kt = 0; kt < k_all / KTILE; kt++) {
            const uint16_t *b = tiles + (size_t)kt * 4 * 512;
            _tile_loadd(4, a + (size_t)m0 * k_all + kt * KTILE, k_all * 2);
            _tile_loadd(5, b, 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, b + 512, 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(7, b + 1024, 64);
            _tile_dpbf16ps(2, 4, 7);
            _tile_loadd(5, b + 1536, 64);
            _tile_dpbf16ps(3, 4, 5);
        }
        _tile_stored(0, acc, COLS * 4);
        _tile_stored(1, acc + 16, COLS * 4);
        _tile_stored(2, acc + 32, COLS * 4);
        _tile_stored(3, acc + 48, COLS * 4);
        store_rows(acc, c + (size_t)m0 * n, rows, n);
    }
}

static _Thread_local uint16_t *held;
static _Thread_local size_t held_bytes;

/* A thread's unpack buffer, kept between calls so that no call maps fresh pages. */
static uint16_t *scratch(size_t bytes) {
    if (bytes > held_bytes) {
        free(held);
        held = aligned_alloc(64, bytes);
        held_bytes = held == NULL ? 0 : bytes;
    }
    return held;
}

/* c[m, n] = a[m, k_all] @ W.T in bf16, W from `codes` and `pairs` (scale, zero + 8 * scale) as torch's
 * `_weight_int4pack_mm_for_cpu` reads them: w = (code - 8) * scale + zero, rounded to bf16. */
int sf_int4_mm(const uint16_t *a, const uint8_t *codes, const uint16_t *pairs, uint16_t *c,
               int m, int n, int k_all, int group) {
    int failed = 0;
#pragma omp parallel reduction(|| : failed)
    {
        uint16_t *tiles = scratch((size_t)k_all * COLS * 2);
        failed = tiles == NULL;
#pragma omp for schedule(static)
        for (int nb = 0; nb < n / COLS; nb++) {
            if (tiles == NULL)
                continue;
            unpack_block(codes + (size_t)nb * k_all * 32, pairs + nb * COLS * 2, n, k_all, group, tiles);
            block_product(a, tiles, c + nb * COLS, m, n, k_all);
        }
    }
    return failed ? -1 : 0;
}
