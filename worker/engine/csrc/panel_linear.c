/* y = x @ W^T (+ bias or residual) with W stored in 16-column panels, read once per row block.
 *
 * A decode or verify step multiplies a few rows by every weight matrix, so on a CPU its cost is
 * the time to stream the weights from DRAM; MKL re-reads a matrix every few rows, and oneDNN's
 * packed inner product falls off the bandwidth floor past ~4 rows on these cores. Here W^T is
 * stored as panels [N/16][K][16]: each panel is read from DRAM once per block of rows (2 MiB of
 * x, which stays in L3) and kept in L2 while 6-row tiles of x sweep it, so a step stays at the
 * bandwidth floor until it reaches the FLOP floor, as a GPU's step does.
 *
 * Plain C (GCC vector extensions, pthreads), no torch headers: built on first use by
 * worker/engine/kernels.py and called from worker/engine/linear.py.
 */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
#define NR 16          /* panel width: two 8-float vectors */
#define MR 6           /* rows per micro-tile: 12 accumulators + 2 weight vectors + 1 broadcast */
#define X_BLOCK_BYTES (2 << 20) /* rows per pass over the weights: x's block stays in L3 */
#define MAX_THREADS 64
#define PF_ROWS 4      /* row blocks this tall pull the next panel into L2 while they compute */
#define INLINE static inline __attribute__((always_inline))

typedef struct {
    const float *x, *wp, *bias, *add;
    float *y;
    int64_t M, K, N, p0, p1, mb;
} Args;

INLINE v8 bcast(float f) { return (v8){f, f, f, f, f, f, f, f}; }

/* rows [m, m + mr) x panel p, all of K; called with constant mr and u so that the loops unroll into
 * registers. A few rows alone would leave 2 * mr FMA chains, each waiting on its own latency, so
 * k is split into u interleaved chains (u * mr * 2 <= 12 accumulators). */
INLINE void tile(const Args *a, int64_t m, int64_t mr, int64_t u, int64_t p, int pf) {
    const int64_t K = a->K;
    const float *w = a->wp + p * K * NR;
    const float *x = a->x + m * K;
    v8 acc[4][MR][2] = {{{0}}};
    int64_t k = 0;
    for (; k + u <= K; k += u) {
        for (int64_t j = 0; j < u; j++) {
            if (pf) __builtin_prefetch(w + (k + j + K) * NR, 0, 1);  /* the next panel, into L2 */
            v8 w0, w1;
            memcpy(&w0, w + (k + j) * NR, 32);
            memcpy(&w1, w + (k + j) * NR + 8, 32);
            for (int64_t r = 0; r < mr; r++) {
                const v8 b = bcast(x[r * K + k + j]);
                acc[j][r][0] += b * w0;
                acc[j][r][1] += b * w1;
            }
        }
    }
    for (; k < K; k++) {
        v8 w0, w1;
        memcpy(&w0, w + k * NR, 32);
        memcpy(&w1, w + k * NR + 8, 32);
        for (int64_t r = 0; r < mr; r++) {
            const v8 b = bcast(x[r * K + k]);
            acc[0][r][0] += b * w0;
            acc[0][r][1] += b * w1;
        }
    }
    for (int64_t j = 1; j < u; j++)
        for (int64_t r = 0; r < mr; r++) {
            acc[0][r][0] += acc[j][r][0];
            acc[0][r][1] += acc[j][r][1];
        }
    const int64_t n0 = p * NR, nc = a->N - n0 < NR ? a->N - n0 : NR;
    for (int64_t r = 0; r < mr; r++) {
        float out[NR];
        memcpy(out, &acc[0][r][0], 32);
        memcpy(out + 8, &acc[0][r][1], 32);
        float *y = a->y + (m + r) * a->N + n0;
        if (a->bias)
            for (int64_t c = 0; c < nc; c++) out[c] += a->bias[n0 + c];
        if (a->add)
            for (int64_t c = 0; c < nc; c++) out[c] += a->add[(m + r) * a->N + n0 + c];
        memcpy(y, out, nc * sizeof(float));
    }
}

static void *run_range(void *p_) {
    const Args *a = p_;
    for (int64_t m0 = 0; m0 < a->M; m0 += a->mb) {
        const int64_t m1 = m0 + a->mb < a->M ? m0 + a->mb : a->M;
        for (int64_t p = a->p0; p < a->p1; p++) {
            /* Below ~4 rows a pass over the panel is as fast as DRAM streams it; above, the first
             * tile pulls the next panel into L2 so that streaming overlaps the arithmetic. */
            int pf = m1 - m0 >= PF_ROWS && p + 1 < a->p1;
            int64_t m = m0;
            for (; m + MR <= m1; m += MR, pf = 0) tile(a, m, MR, 1, p, pf);
            switch (m1 - m) {
                case 5: tile(a, m, 5, 1, p, pf); break;
                case 4: tile(a, m, 4, 1, p, pf); break;
                case 3: tile(a, m, 3, 2, p, pf); break;
                case 2: tile(a, m, 2, 3, p, pf); break;
                case 1: tile(a, m, 1, 4, p, pf); break;
                default: break;
            }
        }
    }
    return NULL;
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
    Args args[MAX_THREADS];
    for (int i = 0; i < threads; i++)
        args[i] = (Args){x, wp, bias, add, y, M, K, N, P * i / threads, P * (i + 1) / threads, mb};
    pthread_t tid[MAX_THREADS];
    int started = 0; /* threads 1..started run beside this one; any that failed to start run here */
    while (started + 1 < threads && pthread_create(&tid[started + 1], NULL, run_range, &args[started + 1]) == 0)
        started++;
    for (int i = started + 1; i < threads; i++) run_range(&args[i]);
    run_range(&args[0]);
    for (int i = 1; i <= started; i++) pthread_join(tid[i], NULL);
}
