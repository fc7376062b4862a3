/* The node's quantized CPU kernels, int4 and int8 weights in groups of 32, in integer arithmetic.
 * Two builds of this file, loaded by nodeagent/engine/cpu_kernels.py: AVX-512 VNNI for calls of a
 * few rows and AMX int8 tiles for more (cpu_kernels_avx512.h), or AVX2 for every call
 * (cpu_kernels_avx2.h, built with SF_AVX2). This file holds what they share: the layouts, the
 * worker pool and the entry points.
 *
 * Every sum is an exact integer, so every path gives the same bits and a row's products never
 * depend on the rows beside it (decode and a prefill of the same tokens agree to the bit):
 * - each group of 32 activations a becomes q = round(a / step), step = max|a| / QMAX, split as
 *   q = 16 * high + low with both in int8 (12 bits in all);
 * - per group and output, the codes c give D = 16 * sum(high * c) + sum(low * c) = sum(q * c)
 *   exactly in int32 (int4 on the tiles: one product of [high, low] by [16 c, c]);
 * - the group then adds step * scale * D (int8: w = scale * c) or step * (scale * D + minimum *
 *   sum(q)) (int4: w = scale * c + minimum) to each output, one fixed order of fp32 operations;
 *   scales and minimums come in fp16, as GGUF keeps them.
 *
 * Codes come in the kernels' own layouts (`pack_int4`, `pack_int8` in cpu_kernels.py), 64 bytes
 * for each 16 outputs: int4 by 8 inputs, byte 4 i + j holding output i's code at input j (low
 * nibble) and j + 4 (high); int8 by 4 inputs, byte 4 i + j holding output i's code at input j.
 * Scales too (`pack_scales`): each 16 outputs' scales group after group, so that one row's
 * product reads its weight in two streams.
 */
#include <immintrin.h>
#include <limits.h>
#include <math.h>
#include <linux/futex.h>
#include <omp.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define GROUP 32               /* inputs per scale */
#define QUADS (GROUP / 4)      /* 4-input steps of a group: one VNNI lane, one tile row */
#define UNIT 64                /* bytes of codes for 16 outputs: 8 inputs of int4, 4 of int8 */
#define SPLIT_BITS 4           /* q = 2^SPLIT_BITS * high + low */
#define QMAX 2039.0f           /* |q| whose high byte still fits int8: 127 * 16 + 7 */
#define VECTOR_ROWS 4          /* rows the vector path holds in registers at once */
#define MAX_THREADS 64
#define CHUNKS_PER_THREAD 4    /* a call's share of work each thread may claim */

/* A weight: codes, fp16 scales and its code width. For each 16 outputs (a column tile) the scales
 * run group by group, 16 scales and for int4 then 16 minimums: a tile's scales are one stream. */
typedef struct {
    const uint8_t *codes;
    const uint16_t *scales;
    int bits;
} weight;

/* fp16 values a group holds for each 16 outputs: scale, and for int4 minimum. */
static inline int parts(const weight *w) {
    return w->bits == 4 ? 2 : 1;
}

static inline const uint16_t *group_scales(const weight *w, int t, int groups, int g) {
    return w->scales + ((size_t)t * groups + g) * parts(w) * 16;
}

/* The activations quantized per group: for each row and group 64 bytes, the 32 highs of q then
 * the 32 lows ([m][2 k]), and per [m][k / GROUP] the step and sum(q). */
typedef struct {
    int8_t *halves;
    float *step, *total;
} activations;

static size_t column_tile_bytes(int bits, int k_all) {
    return (size_t)k_all * 16 * bits / 8;
}

#ifdef SF_AVX2
#include "cpu_kernels_avx2.h"
#else
#include "cpu_kernels_avx512.h"
#endif

static void vector_rows(const activations *a, const weight *w, int t, float *y, int m, int n, int k_all) {
    for (int r0 = 0; r0 < m; r0 += VECTOR_ROWS) {
        int rows = m - r0 < VECTOR_ROWS ? m - r0 : VECTOR_ROWS;
        if (w->bits == 4) {
            switch (rows) {
            case 1: vector_tile(a, &(weight){w->codes, w->scales, 4}, t, y, r0, 1, n, k_all); break;
            case 2: vector_tile(a, &(weight){w->codes, w->scales, 4}, t, y, r0, 2, n, k_all); break;
            case 3: vector_tile(a, &(weight){w->codes, w->scales, 4}, t, y, r0, 3, n, k_all); break;
            default: vector_tile(a, &(weight){w->codes, w->scales, 4}, t, y, r0, 4, n, k_all);
            }
        } else {
            switch (rows) {
            case 1: vector_tile(a, &(weight){w->codes, w->scales, 8}, t, y, r0, 1, n, k_all); break;
            case 2: vector_tile(a, &(weight){w->codes, w->scales, 8}, t, y, r0, 2, n, k_all); break;
            case 3: vector_tile(a, &(weight){w->codes, w->scales, 8}, t, y, r0, 3, n, k_all); break;
            default: vector_tile(a, &(weight){w->codes, w->scales, 8}, t, y, r0, 4, n, k_all);
            }
        }
    }
}

/* Vector-path calls run on a pool of their own rather than OpenMP's (called from the scheduler's
 * thread, libgomp counted more threads than CPUs on a small machine and made every call wait for
 * a wake-up). A call's column tiles come in chunks that the caller and the workers claim until
 * none is left: the caller starts at once and, where a worker wakes late or the node's other
 * threads hold a core, takes its share too. Workers sleep between calls rather than spin: on two
 * cores a spinning worker held the core that the connection loop and torch's threads needed. */
typedef struct {
    const activations *a;
    const weight *w;
    float *y;
    int m, n, k_all, chunks;
} call;

static struct {
    pthread_mutex_t lock;  /* one caller at a time */
    atomic_uint generation;  /* bumped for each call; sleeping workers wait on it */
    _Atomic uint64_t claims;  /* the call's generation, its chunk count and the next chunk to claim */
    atomic_int done, sleepers;  /* chunks finished in this call; workers asleep */
    const call *job;
    int workers;
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER};

static uint64_t claims_of(unsigned generation, int chunks, int next) {
    return (uint64_t)generation << 32 | (uint64_t)chunks << 16 | (uint64_t)next;
}

/* The next chunk of call `generation`, or -1 when none is left or that call is over. */
static int claim(unsigned generation) {
    uint64_t now = atomic_load(&pool.claims);
    while ((unsigned)(now >> 32) == generation && (now & 0xFFFF) < ((now >> 16) & 0xFFFF))
        if (atomic_compare_exchange_weak(&pool.claims, &now, now + 1))
            return (int)(now & 0xFFFF);
    return -1;
}

/* Runs chunks of call `generation` until none is left. A claimed chunk keeps the call open (its
 * caller waits for every chunk), so `pool.job` is that call's while the chunk runs. */
static void work(unsigned generation) {
    for (int chunk; (chunk = claim(generation)) >= 0; atomic_fetch_add(&pool.done, 1)) {
        const call *c = pool.job;
        int tiles = c->n / 16;
        for (int t = tiles * chunk / c->chunks; t < tiles * (chunk + 1) / c->chunks; t++)
            vector_rows(c->a, c->w, t, c->y, c->m, c->n, c->k_all);
    }
}

static void *pool_worker(void *arg) {
    unsigned seen = *(unsigned *)arg;
    free(arg);
    for (;;) {
        unsigned now;
        while ((now = atomic_load(&pool.generation)) == seen) {
            atomic_fetch_add(&pool.sleepers, 1);
            syscall(SYS_futex, &pool.generation, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
            atomic_fetch_sub(&pool.sleepers, 1);
        }
        seen = now;
        work(now);
    }
    return NULL;
}

/* A forked child has none of the parent's workers. */
static void forget_workers(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pool.workers = 0;
    atomic_store(&pool.sleepers, 0);
}

static void watch_forks(void) {
    pthread_atfork(NULL, NULL, forget_workers);
}

/* Starts workers up to `wanted` (with the caller, `wanted` + 1 threads); how many there are. */
static int hire(int wanted) {
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, watch_forks);
    while (pool.workers < wanted) {
        unsigned *seen = malloc(sizeof *seen);
        pthread_t thread;
        if (seen == NULL)
            break;
        *seen = atomic_load(&pool.generation);
        if (pthread_create(&thread, NULL, pool_worker, seen) != 0) {
            free(seen);
            break;
        }
        pthread_detach(thread);
        pool.workers++;
    }
    return pool.workers;
}

static void pooled(call *c) {
    pthread_mutex_lock(&pool.lock);
    int threads = omp_get_max_threads();
    int workers = hire((threads < MAX_THREADS ? threads : MAX_THREADS) - 1);
    int tiles = c->n / 16, most = CHUNKS_PER_THREAD * (workers + 1);
    c->chunks = tiles < most ? tiles : most;
    pool.job = c;
    atomic_store(&pool.done, 0);
    unsigned generation = atomic_load(&pool.generation) + 1;
    atomic_store(&pool.claims, claims_of(generation, c->chunks, 0));
    atomic_store(&pool.generation, generation);
    if (atomic_load(&pool.sleepers) > 0)
        syscall(SYS_futex, &pool.generation, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
    work(generation);
    while (atomic_load(&pool.done) < c->chunks)
        _mm_pause();
    pthread_mutex_unlock(&pool.lock);
}

/* The vector path: the rows quantized here, the column tiles shared out on the pool. */
static void vectored(const float *x, const activations *a, const weight *w, float *y, int m, int n, int k_all) {
    for (int r = 0; r < m; r++)
        quantize_row(x, a, r, k_all);
    pooled(&(call){a, w, y, m, n, k_all, 0});
}

#define SQUARE_LANES 8  /* partial sums of an RMSNorm's squares, added in a fixed order */

/* Each row of x scaled to a root mean square of one and times `norm` (RMSNorm), into `out`. The
 * squares add up in double, in one fixed order, so the scale is near exact and every build gives
 * the same bits. */
static void rms_normed(const float *x, const float *norm, float eps, float *out, int m, int k_all) {
    for (int r = 0; r < m; r++) {
        const float *row = x + (size_t)r * k_all;
        double lanes[SQUARE_LANES] = {0}, squares = 0;
        for (int i = 0; i < k_all; i += SQUARE_LANES)
            for (int l = 0; l < SQUARE_LANES; l++)
                lanes[l] += (double)row[i + l] * row[i + l];
        for (int l = 0; l < SQUARE_LANES; l++)
            squares += lanes[l];
        float scale = (float)(1.0 / sqrt(squares / k_all + eps));
        for (int i = 0; i < k_all; i++)
            out[(size_t)r * k_all + i] = row[i] * scale * norm[i];
    }
}

static int product(const float *x, const weight *w, float *y, int m, int n, int k_all, int tile_rows,
                   const float *norm, float eps) {
    int groups = k_all / GROUP, status = 0;
    activations a = {malloc((size_t)m * k_all * 2), malloc((size_t)m * groups * 4), malloc((size_t)m * groups * 4)};
    float *normed = norm == NULL ? NULL : malloc((size_t)m * k_all * 4);
    if (a.halves == NULL || a.step == NULL || a.total == NULL || (norm != NULL && normed == NULL)) {
        free(a.halves), free(a.step), free(a.total), free(normed);
        return -1;
    }
    if (norm != NULL) {
        rms_normed(x, norm, eps, normed, m, k_all);
        x = normed;
    }
#ifdef HAS_TILES
    if (m >= tile_rows)
        status = tiled(x, &a, w, y, m, n, k_all);
    else
#endif
        vectored(x, &a, w, y, m, n, k_all);
    free(a.halves), free(a.step), free(a.total), free(normed);
    return status;
}

/* y[m, n] = x[m, k_all] @ W.T in fp32, w = scale * code + minimum with codes 0..15, the scales laid
 * out as `weight` says. Where `norm` is not NULL, x's rows are RMSNormed with it (and `eps`) first.
 * Calls of `tile_rows` rows or more take the tile path (pass more rows than any call has where the
 * process has no tiles). Returns -1 where memory ran out. */
int sf_int4_mm(const float *x, const uint8_t *codes, const uint16_t *scales, float *y, int m, int n, int k_all,
               int tile_rows, const float *norm, float eps) {
    weight w = {codes, scales, 4};
    return product(x, &w, y, m, n, k_all, tile_rows, norm, eps);
}

/* The same for int8: w = scale * code, codes -128..127. */
int sf_int8_mm(const float *x, const int8_t *codes, const uint16_t *scales, float *y, int m, int n, int k_all,
               int tile_rows, const float *norm, float eps) {
    weight w = {(const uint8_t *)codes, scales, 8};
    return product(x, &w, y, m, n, k_all, tile_rows, norm, eps);
}
