/* capture: stream capture in plain CUDA under the hook (issue 14, "capture-safe").
 *
 * Before every capture, buffers written by a still-running kernel are freed, so the hook holds
 * parked frees while the capture runs (the case where a hook that reclaims with a context
 * synchronize invalidates the capture). Then:
 *   A  global-mode capture of a kernel sequence (memset, three kernels, a device copy), ended,
 *      instantiated, replayed three times; its output compared with an eager run, bit for bit;
 *   B  relaxed-mode capture with cudaMalloc inside it (64 MiB: a fresh chunk; 4 KiB: packed),
 *      the new buffers used by captured kernels; replayed and compared with an eager run;
 *   C  global-mode capture with cudaMalloc inside it (illegal natively): the codes of the
 *      cudaMalloc, of cudaStreamEndCapture and of cudaGetLastError, and the stream usable after;
 *   D  cudaFree during a relaxed and during a global capture of a buffer allocated before it:
 *      the codes, and the code of a second cudaFree after the capture;
 *   E  thread-local capture on this thread while another thread allocates and frees (legal
 *      natively, as far as the CUDA documentation says), and a global capture while another
 *      thread calls cudaMalloc (illegal).
 * Every call of the captured and eager sequences is checked where it is made (its first failing
 * code is an R line), so no error outlives its step to be reported by a later, unrelated check.
 * Compared part (R lines): every code and every comparison; natively and hooked they must match.
 * Usage: capture */
#include "gpu_common.h"

#include <thread>
#include <vector>

static const size_t N = 1 << 20; /* floats per array: 4 MiB */

__global__ static void k_square(float *t, const float *x, size_t n)
{
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n)
        t[i] = x[i] * x[i] + 0.5f;
}

__global__ static void k_axpy(float *y, const float *t, float a, size_t n)
{
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n)
        y[i] = y[i] * a + t[i];
}

__global__ static void k_mix(float *y, const float *z, size_t n, size_t zn)
{
    size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x;
    if (i < n)
        y[i] = y[i] - 0.25f * z[i % zn];
}

static unsigned grid(size_t n)
{
    return (unsigned)((n + 255) / 256);
}

/* Frees buffers that a slow kernel is still writing: the hook parks them (they cannot be reused
 * before the kernel ends) while the capture that follows runs. */
static void park_some_frees(cudaStream_t s)
{
    void *p[8];
    for (int i = 0; i < 8; i++) {
        size_t n = (i & 1) ? 8 * MiB : 256 * KiB;
        p[i] = NULL;
        if (CK(cudaMalloc(&p[i], n)) == 0)
            gt_slow_fill(p[i], n, 500 + i, 30ull * 1000 * 1000, s); /* 30 ms each */
    }
    for (int i = 0; i < 8; i++)
        if (p[i])
            CK(cudaFree(p[i]));
}

/* The first failing code of a sequence's calls (0 when every one succeeded): a launch's code is
 * cudaGetLastError()'s right after it, so no error of a sequence outlives it to surface in a
 * later, unrelated check. */
static int first_error(int first, int code)
{
    return first ? first : code;
}

/* A code's name for the FAIL lines (901 cudaErrorStreamCaptureInvalidated: something during the
 * capture, such as a synchronization, invalidated it). */
static const char *code_name(int code)
{
    return cudaGetErrorName((cudaError_t)code);
}

/* The sequence captured in A (and run eagerly for the reference): y = f(x), from scratch. */
static int seq_a(float *y, float *t, const float *x, cudaStream_t s)
{
    int e = (int)cudaMemsetAsync(y, 0, N * sizeof(float), s);
    k_square<<<grid(N), 256, 0, s>>>(t, x, N);
    e = first_error(e, (int)cudaGetLastError());
    k_axpy<<<grid(N), 256, 0, s>>>(y, t, 1.5f, N);
    e = first_error(e, (int)cudaGetLastError());
    k_axpy<<<grid(N), 256, 0, s>>>(y, x, -0.75f, N);
    e = first_error(e, (int)cudaGetLastError());
    e = first_error(e, (int)cudaMemcpyAsync(t, y, N * sizeof(float), cudaMemcpyDeviceToDevice, s));
    k_axpy<<<grid(N), 256, 0, s>>>(y, t, 0.5f, N);
    return first_error(e, (int)cudaGetLastError());
}

/* The sequence of B, around buffers z (zn floats) and w (wn floats) made during the capture.
 * Each copy moves at most N floats: z is larger than t (64 MiB, to need a fresh chunk), and a
 * copy past the end of t is an invalid argument natively (the 06:03 run's leftover error). */
static int seq_b(float *y, float *t, const float *x, float *z, size_t zn, float *w, size_t wn,
                 cudaStream_t s)
{
    const size_t zc = zn < N ? zn : N, wc = wn < N ? wn : N;
    int e = (int)cudaMemsetAsync(y, 0, N * sizeof(float), s);
    k_square<<<grid(N), 256, 0, s>>>(t, x, N);
    e = first_error(e, (int)cudaGetLastError());
    e = first_error(e, (int)cudaMemcpyAsync(z, t, zc * sizeof(float), cudaMemcpyDeviceToDevice, s));
    e = first_error(e, (int)cudaMemcpyAsync(w, x, wc * sizeof(float), cudaMemcpyDeviceToDevice, s));
    k_axpy<<<grid(N), 256, 0, s>>>(y, t, 2.0f, N);
    e = first_error(e, (int)cudaGetLastError());
    k_mix<<<grid(N), 256, 0, s>>>(y, z, N, zc);
    e = first_error(e, (int)cudaGetLastError());
    k_mix<<<grid(N), 256, 0, s>>>(y, w, N, wc);
    return first_error(e, (int)cudaGetLastError());
}

static bool same_bytes(const float *dev_a, const float *dev_b, cudaStream_t s)
{
    std::vector<float> a(N), b(N);
    CK(cudaMemcpyAsync(a.data(), dev_a, N * sizeof(float), cudaMemcpyDeviceToHost, s));
    CK(cudaMemcpyAsync(b.data(), dev_b, N * sizeof(float), cudaMemcpyDeviceToHost, s));
    CK(cudaStreamSynchronize(s));
    return memcmp(a.data(), b.data(), N * sizeof(float)) == 0;
}

/* Instantiates and replays graph g three times; 1 when every replay matches ref bit for bit. */
static int replay_matches(cudaGraph_t g, const float *y, const float *ref, cudaStream_t s,
                          const char *what)
{
    cudaGraphExec_t ge = NULL;
    int rc = CK(cudaGraphInstantiate(&ge, g, 0));
    R("%s: cudaGraphInstantiate -> %d", what, rc);
    if (rc)
        return 0;
    int ok = 1;
    for (int i = 0; i < 3; i++) {
        CK(cudaGraphLaunch(ge, s));
        CK(cudaStreamSynchronize(s));
        if (!same_bytes(y, ref, s))
            ok = 0;
    }
    CK(cudaGraphExecDestroy(ge));
    return ok;
}

static void part_a(cudaStream_t s, float *x, float *y, float *t, float *yref, float *tref)
{
    park_some_frees(s);
    cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    int rb = (int)cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    R("A global: cudaStreamBeginCapture -> %d", rb);
    int rq = seq_a(y, t, x, s);
    R("A global: the sequence's calls during capture -> %d", rq);
    CHECK(rq == 0, "A: a call of the captured sequence failed: %d %s", rq, code_name(rq));
    cudaStreamIsCapturing(s, &st);
    R("A global: capturing after the sequence = %d", (int)st);
    cudaGraph_t g = NULL;
    int re = (int)cudaStreamEndCapture(s, &g);
    R("A global: cudaStreamEndCapture -> %d, graph %s", re, g ? "made" : "none");
    CHECK(rb == 0 && re == 0 && g, "global-mode capture failed: begin %d, end %d %s", rb, re,
          code_name(re));
    cudaGetLastError();
    int rr = seq_a(yref, tref, x, s); /* eager reference */
    R("A global: the eager sequence's calls -> %d", rr);
    CHECK(rr == 0, "A: a call of the eager sequence failed: %d %s", rr, code_name(rr));
    CK(cudaStreamSynchronize(s));
    if (g) {
        int ok = replay_matches(g, y, yref, s, "A global");
        R("A global: 3 replays identical to the eager run = %d", ok);
        CHECK(ok, "A: the replayed graph differs from the eager run");
        CK(cudaGraphDestroy(g));
    }
}

static void part_b(cudaStream_t s, float *x, float *y, float *t, float *yref, float *tref)
{
    park_some_frees(s);
    const size_t zn = 16 * MiB, wn = 1024; /* 64 MiB and 4 KiB of floats */
    float *z = NULL, *w = NULL;
    int rb = (int)cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed);
    R("B relaxed: cudaStreamBeginCapture -> %d", rb);
    k_square<<<grid(N), 256, 0, s>>>(t, x, N); /* something captured before the mallocs */
    int rz = (int)cudaMalloc(&z, zn * sizeof(float));
    int rw = (int)cudaMalloc(&w, wn * sizeof(float));
    R("B relaxed: cudaMalloc(64 MiB) during capture -> %d, cudaMalloc(4 KiB) -> %d", rz, rw);
    CHECK(rz == 0 && rw == 0, "cudaMalloc in a relaxed-mode capture failed: %d %s, %d %s", rz,
          code_name(rz), rw, code_name(rw));
    if (rz == 0 && rw == 0) {
        int rq = seq_b(y, t, x, z, zn, w, wn, s);
        R("B relaxed: the sequence's calls during capture -> %d", rq);
        CHECK(rq == 0, "B: a call of the captured sequence failed: %d %s", rq, code_name(rq));
    }
    cudaGraph_t g = NULL;
    int re = (int)cudaStreamEndCapture(s, &g);
    R("B relaxed: cudaStreamEndCapture -> %d, graph %s", re, g ? "made" : "none");
    CHECK(re == 0 && g, "relaxed-mode capture with cudaMalloc failed at its end: %d %s", re,
          code_name(re));
    cudaGetLastError();
    if (rz == 0 && rw == 0 && g) {
        float *zr = NULL, *wr = NULL;
        CK(cudaMalloc(&zr, zn * sizeof(float)));
        CK(cudaMalloc(&wr, wn * sizeof(float)));
        int rr = seq_b(yref, tref, x, zr, zn, wr, wn, s);
        R("B relaxed: the eager sequence's calls -> %d", rr);
        CHECK(rr == 0, "B: a call of the eager sequence failed: %d %s", rr, code_name(rr));
        CK(cudaStreamSynchronize(s));
        int ok = replay_matches(g, y, yref, s, "B relaxed");
        R("B relaxed: 3 replays identical to the eager run = %d", ok);
        CHECK(ok, "B: the replayed graph differs from the eager run");
        CK(cudaFree(zr));
        CK(cudaFree(wr));
    }
    if (g)
        CK(cudaGraphDestroy(g));
    if (z)
        CK(cudaFree(z));
    if (w)
        CK(cudaFree(w));
}

static void part_c(cudaStream_t s, float *x, float *y, float *t, float *yref, float *tref)
{
    park_some_frees(s);
    void *p = NULL, *p2 = NULL;
    int rb = (int)cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    k_square<<<grid(N), 256, 0, s>>>(t, x, N);
    int rm = (int)cudaMalloc(&p, 1 * MiB);
    int rm2 = (int)cudaMalloc(&p2, 64 * MiB);
    cudaGraph_t g = NULL;
    int re = (int)cudaStreamEndCapture(s, &g);
    int rl = (int)cudaGetLastError();
    R("C global: begin -> %d; cudaMalloc(1 MiB) during capture -> %d, cudaMalloc(64 MiB) -> %d; "
      "cudaStreamEndCapture -> %d, graph %s; cudaGetLastError -> %d",
      rb, rm, rm2, re, g ? "made" : "none", rl);
    if (g)
        cudaGraphDestroy(g);
    if (rm == 0 && p) /* only where a cudaMalloc succeeded (natively neither does) */
        cudaFree(p);
    if (rm2 == 0 && p2)
        cudaFree(p2);
    cudaGetLastError();
    /* The stream and the device still work. */
    int r1 = seq_a(y, t, x, s);
    int r2 = seq_a(yref, tref, x, s);
    CHECK(r1 == 0 && r2 == 0, "C: the eager sequences after the capture failed: %d, %d", r1, r2);
    int rs = (int)cudaStreamSynchronize(s);
    R("C global: afterwards stream sync -> %d, two eager runs identical = %d", rs,
      same_bytes(y, yref, s) ? 1 : 0);
}

static void part_d(cudaStream_t s, float *x, float *t)
{
    park_some_frees(s);
    const cudaStreamCaptureMode modes[2] = {cudaStreamCaptureModeRelaxed,
                                            cudaStreamCaptureModeGlobal};
    const char *names[2] = {"relaxed", "global"};
    for (int m = 0; m < 2; m++) {
        void *p = NULL, *q = NULL;
        CK(cudaMalloc(&p, 2 * MiB));
        CK(cudaMalloc(&q, 4 * KiB));
        CK(cudaDeviceSynchronize());
        int rb = (int)cudaStreamBeginCapture(s, modes[m]);
        k_square<<<grid(N), 256, 0, s>>>(t, x, N);
        int rf = (int)cudaFree(p);
        int rq = (int)cudaFree(q);
        cudaGraph_t g = NULL;
        int re = (int)cudaStreamEndCapture(s, &g);
        int rl = (int)cudaGetLastError();
        if (g)
            cudaGraphDestroy(g);
        /* A second free: natively it tells whether the first one freed the buffer. */
        int rf2 = (int)cudaFree(p);
        int rq2 = (int)cudaFree(q);
        cudaGetLastError();
        R("D %s: begin -> %d; cudaFree(2 MiB) during capture -> %d, cudaFree(4 KiB) -> %d; "
          "end -> %d, graph %s; last error -> %d; the same frees after the capture -> %d, %d",
          names[m], rb, rf, rq, re, g ? "made" : "none", rl, rf2, rq2);
        CK(cudaDeviceSynchronize());
        cudaGetLastError();
    }
}

static void part_e(cudaStream_t s, float *x, float *t)
{
    park_some_frees(s);
    const cudaStreamCaptureMode modes[2] = {cudaStreamCaptureModeThreadLocal,
                                            cudaStreamCaptureModeGlobal};
    const char *names[2] = {"thread-local", "global"};
    for (int m = 0; m < 2; m++) {
        int rb = (int)cudaStreamBeginCapture(s, modes[m]);
        k_square<<<grid(N), 256, 0, s>>>(t, x, N);
        int rm = -1, rf = -1;
        std::thread other([&] {
            cudaSetDevice(0);
            void *p = NULL;
            rm = (int)cudaMalloc(&p, 3 * MiB);
            rf = rm == 0 ? (int)cudaFree(p) : -2;
            cudaGetLastError();
        });
        other.join();
        k_square<<<grid(N), 256, 0, s>>>(t, x, N);
        cudaGraph_t g = NULL;
        int re = (int)cudaStreamEndCapture(s, &g);
        int rl = (int)cudaGetLastError();
        R("E %s capture here, another thread: cudaMalloc(3 MiB) -> %d, cudaFree -> %d; begin -> "
          "%d, end -> %d, graph %s, last error -> %d",
          names[m], rm, rf, rb, re, g ? "made" : "none", rl);
        /* Not judged here: the codes are compared with the native run's (what native answers,
         * the hook must answer). */
        if (g)
            cudaGraphDestroy(g);
        CK(cudaDeviceSynchronize());
        cudaGetLastError();
    }
}

int main()
{
    gt_init("capture");
    cudaStream_t s = NULL;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    float *x = NULL, *y = NULL, *t = NULL, *yref = NULL, *tref = NULL;
    CK(cudaMalloc(&x, N * sizeof(float)));
    CK(cudaMalloc(&y, N * sizeof(float)));
    CK(cudaMalloc(&t, N * sizeof(float)));
    CK(cudaMalloc(&yref, N * sizeof(float)));
    CK(cudaMalloc(&tref, N * sizeof(float)));
    if (g_failed)
        return gt_finish();
    /* x: a pattern of small finite floats (from the 32-bit hash, scaled). */
    {
        std::vector<float> h(N);
        for (size_t i = 0; i < N; i++)
            h[i] = (float)(gt_hash(7, i) % 2001) / 1000.0f - 1.0f;
        CK(cudaMemcpy(x, h.data(), N * sizeof(float), cudaMemcpyHostToDevice));
    }
    part_a(s, x, y, t, yref, tref);
    part_b(s, x, y, t, yref, tref);
    part_c(s, x, y, t, yref, tref);
    part_d(s, x, t);
    part_e(s, x, t);

    CK(cudaDeviceSynchronize());
    cudaGetLastError();
    float *arrs[5] = {x, y, t, yref, tref};
    for (float *a : arrs)
        CK(cudaFree(a));
    CK(cudaStreamDestroy(s));
    gt_trim();
    return gt_finish();
}
