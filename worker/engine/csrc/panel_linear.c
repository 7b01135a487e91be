/* y = x @ W^T (+ bias or residual) with W stored in 16-column panels, read once per row block.
 *
 * A decode or verify step multiplies a few rows by every weight matrix, so on a CPU its cost is
 * the time to stream the weights from DRAM; MKL re-reads a matrix every few rows, and oneDNN's
 * packed inner product falls off the bandwidth floor past ~4 rows on these cores. Here W^T is
 * stored as panels [N/16][K][16]: each panel is read from DRAM once per block of rows (2 MiB of
 * x, which stays in L3) and kept in L2 while register tiles of x sweep it, so a step stays at the
 * bandwidth floor until it reaches the FLOP floor, as a GPU's step does.
 *
 * Plain C (GCC vector extensions, pthreads), no torch headers: built on first use by
 * worker/engine/kernels.py and called from worker/engine/linear.py.
 */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NR 16 /* panel width */
#if defined(__AVX512F__)
/* 32 registers of 16 floats: a panel row is one vector, and a tile of 12 rows x 2 panels holds 24
 * accumulators + 2 weight vectors, so each broadcast of x feeds two FMAs. */
typedef float vec __attribute__((vector_size(64)));
#define MR 12
#define NP 2
/* from 8 rows on, x is first copied into row tiles (pack_x): a full tile's broadcasts from 12 rows
 * K floats apart kept large steps off the FLOP floor (BENCHMARKS.md, "CPU linear path, third pass") */
#define PACK_ROWS 8
#else
/* 16 registers of 8 floats: a panel row is two vectors; a tile of 6 rows x 1 panel holds 12
 * accumulators + 2 weight vectors + 1 broadcast. */
typedef float vec __attribute__((vector_size(32)));
#define MR 6
#define NP 1
#define PACK_ROWS INT64_MAX /* 6 rows apart stream as fast as a copy (the same BENCHMARKS section) */
#endif
#define VW ((int)(sizeof(vec) / sizeof(float)))
/* the same vector at float alignment, for loads and stores that leave acc and the weights in
 * registers (GCC keeps an array filled by memcpy on the stack) */
typedef float uvec __attribute__((vector_size(sizeof(vec)), aligned(4)));
#define NV (NR / VW)   /* vectors per panel row */
#define ACC (MR * NV * NP) /* accumulators a full tile holds */
#define MAX_U 4        /* k chains of a short tile */
#define X_BLOCK_BYTES (2 << 20) /* rows per pass over the weights: x's block stays in L3 */
#define MAX_THREADS 64
#define PF_ROWS 4      /* row blocks this tall pull the next panel into L2 while they compute */
#define INLINE static inline __attribute__((always_inline))
#define UNROLL _Pragma("GCC unroll 16")

typedef struct {
    const float *x, *xp, *wp, *bias, *add; /* xp: x in row tiles (pack_x), or NULL */
    float *y;
    int64_t M, K, N, p0, p1, mb;
} Args;

/* row k of np panels, stride floats apart, into wv [np * NV] */
INLINE void load_w(vec *wv, const float *w, int64_t stride, int64_t k, int64_t np) {
    UNROLL for (int64_t i = 0; i < np; i++)
        UNROLL for (int v = 0; v < NV; v++) wv[i * NV + v] = *(const uvec *)(w + i * stride + k * NR + v * VW);
}

/* rows [m, m + mr) x panels [p, p + np), all of K; called with constant mr, u and np so that the
 * loops unroll into registers. A few rows alone would leave mr * NV * np FMA chains, each waiting
 * on its own latency, so k is split into u interleaved chains (u * mr * NV * np <= ACC). */
INLINE void tile(const Args *a, int64_t m, int64_t mr, int64_t u, int64_t p, int64_t np, int pf, int packed) {
    const int64_t K = a->K, stride = K * NR;  /* floats per panel */
    const float *w = a->wp + p * stride;
    /* x[r, k] is x[r * rs + k * ks]: row-major, or the tile's [K][MR] copy (m is a multiple of MR) */
    const float *x = (packed ? a->xp : a->x) + m * K;
    const int64_t rs = packed ? 1 : K, ks = packed ? MR : 1;
    /* every loop over j, r, i and v is unrolled, or GCC keeps acc on the stack for 8-float vectors */
    vec acc[MAX_U][MR][NP * NV];
    UNROLL for (int64_t j = 0; j < u; j++)
        UNROLL for (int64_t r = 0; r < mr; r++)
            UNROLL for (int v = 0; v < np * NV; v++) acc[j][r][v] = (vec){0};
    int64_t k = 0;
    for (; k + u <= K; k += u) {
        UNROLL for (int64_t j = 0; j < u; j++) {
            if (pf)  /* the next panels, into L2 */
                UNROLL for (int64_t i = 0; i < np; i++) __builtin_prefetch(w + (np + i) * stride + (k + j) * NR, 0, 1);
            vec wv[NP * NV];
            load_w(wv, w, stride, k + j, np);
            UNROLL for (int64_t r = 0; r < mr; r++)
                UNROLL for (int v = 0; v < np * NV; v++) acc[j][r][v] += x[r * rs + (k + j) * ks] * wv[v];
        }
    }
    for (; k < K; k++) {
        vec wv[NP * NV];
        load_w(wv, w, stride, k, np);
        UNROLL for (int64_t r = 0; r < mr; r++)
            UNROLL for (int v = 0; v < np * NV; v++) acc[0][r][v] += x[r * rs + k * ks] * wv[v];
    }
    float sum[MR][NP * NR];
    UNROLL for (int64_t r = 0; r < mr; r++)
        UNROLL for (int v = 0; v < np * NV; v++) {
            UNROLL for (int64_t j = 1; j < u; j++) acc[0][r][v] += acc[j][r][v];
            *(uvec *)(sum[r] + v * VW) = acc[0][r][v];
        }
    for (int64_t i = 0; i < np; i++) {
        const int64_t n0 = (p + i) * NR, nc = a->N - n0 < NR ? a->N - n0 : NR;
        for (int64_t r = 0; r < mr; r++) {
            float *out = sum[r] + i * NR;
            float *y = a->y + (m + r) * a->N + n0;
            if (a->bias)
                for (int64_t c = 0; c < nc; c++) out[c] += a->bias[n0 + c];
            if (a->add)
                for (int64_t c = 0; c < nc; c++) out[c] += a->add[(m + r) * a->N + n0 + c];
            memcpy(y, out, nc * sizeof(float));
        }
    }
}

/* k chains for a tail of r rows x np panels: as many as the accumulators allow, 1 to MAX_U */
INLINE int64_t chains(int64_t r, int64_t np) {
    const int64_t u = ACC / (r * NV * np);
    return u > MAX_U ? MAX_U : u < 1 ? 1 : u;
}
#define TAIL(r, np) case r: tile(a, m, r, chains(r, np), p, np, pf, packed); break;

/* rows [m0, m1) x panels [p, p + np) */
INLINE void sweep(const Args *a, int64_t m0, int64_t m1, int64_t p, int64_t np, int pf, int packed) {
    int64_t m = m0;
    for (; m + MR <= m1; m += MR, pf = 0) tile(a, m, MR, 1, p, np, pf, packed);
    switch (m1 - m) {
        TAIL(1, np) TAIL(2, np) TAIL(3, np) TAIL(4, np) TAIL(5, np)
#if MR > 6
        TAIL(6, np) TAIL(7, np) TAIL(8, np) TAIL(9, np) TAIL(10, np) TAIL(11, np)
#endif
        default: break;
    }
}

/* rows [m0, m1) x the NP panels from p, or the odd last panel */
INLINE void sweep_pair(const Args *a, int64_t m0, int64_t m1, int64_t p, int pf, int packed) {
    if (p + NP <= a->p1) sweep(a, m0, m1, p, NP, pf, packed);
    else sweep(a, m0, m1, p, 1, 0, packed);
}

static void *run_range(void *p_) {
    const Args *a = p_;
    for (int64_t m0 = 0; m0 < a->M; m0 += a->mb) {
        const int64_t m1 = m0 + a->mb < a->M ? m0 + a->mb : a->M;
        for (int64_t p = a->p0; p < a->p1; p += NP) {
            /* Below ~4 rows a pass over the panels is as fast as DRAM streams them; above, the first
             * tile pulls the next panels into L2 so that streaming overlaps the arithmetic. */
            const int pf = m1 - m0 >= PF_ROWS && p + NP < a->p1;
            if (a->xp) sweep_pair(a, m0, m1, p, pf, 1); /* packed a constant at each call, for the unrolled loads */
            else sweep_pair(a, m0, m1, p, pf, 0);
        }
    }
    return NULL;
}

/* x [M, K] -> xp [ceil(M/MR)][K][MR]: a tile's broadcasts then read one sequential stream instead
 * of MR rows K floats apart (the rows past M in the last tile are left unset and never read) */
static float *pack_x(const float *x, int64_t M, int64_t K) {
    const int64_t tiles = (M + MR - 1) / MR;
    float *xp = aligned_alloc(64, (size_t)((tiles * MR * K * (int64_t)sizeof(float) + 63) / 64 * 64));
    if (!xp) return NULL;
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t rows = M - t * MR < MR ? M - t * MR : MR;
        float *dst = xp + t * MR * K;
        for (int64_t r = 0; r < rows; r++) {
            const float *src = x + (t * MR + r) * K;
            for (int64_t k = 0; k < K; k++) dst[k * MR + r] = src[k];
        }
    }
    return xp;
}

/* x [M, K] contiguous, wp [ceil(N/16), K, 16] (columns past N zero), bias [N] or NULL,
 * add [M, N] or NULL (may alias y), y [M, N]. Panels are split across threads. */
void panel_linear(const float *x, int64_t M, int64_t K, const float *wp, int64_t N, const float *bias,
                  const float *add, float *y, int threads) {
    const int64_t P = (N + NR - 1) / NR;
    int64_t mb = X_BLOCK_BYTES / (K * (int64_t)sizeof(float)) / MR * MR;
    if (mb < MR) mb = MR;
    if (threads > P) threads = (int)P;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads < 1) threads = 1;
    float *xp = M >= PACK_ROWS ? pack_x(x, M, K) : NULL; /* (unpacked if the allocation fails) */
    Args args[MAX_THREADS];
    for (int i = 0; i < threads; i++)
        args[i] = (Args){x, xp, wp, bias, add, y, M, K, N, P * i / threads, P * (i + 1) / threads, mb};
    pthread_t tid[MAX_THREADS];
    int started = 0; /* threads 1..started run beside this one; any that failed to start run here */
    while (started + 1 < threads && pthread_create(&tid[started + 1], NULL, run_range, &args[started + 1]) == 0)
        started++;
    for (int i = started + 1; i < threads; i++) run_range(&args[i]);
    run_range(&args[0]);
    for (int i = 1; i <= started; i++) pthread_join(tid[i], NULL);
    free(xp);
}
