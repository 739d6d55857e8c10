// hostcuda's cuBLAS: the GEMM entry points tern calls (through cudarc), computed on the CPU on
// top of hostcuda's driver (driver.cpp), whose device pointers are host addresses.
//
// Semantics are cuBLAS's, column-major: C = alpha·op(A)·op(B) + beta·C with op(X) = X or Xᵀ,
// leading dimensions lda/ldb/ldc, beta == 0 meaning C is not read (it may hold NaN poison) and
// alpha == 0 meaning A and B are not read. Each element is summed in float, in k order, each
// product rounded before it is added (no fused multiply-add: the file is built with
// -ffp-contract=off), then scaled: alpha·sum, plus beta·C when beta is nonzero. A GPU's cuBLAS
// sums in another order (tiles, split-k) and may fuse, so results agree with it to rounding,
// not bit for bit.
//
// Operand types: A and B of one type, f32, bf16 or f16 (bf16 and f16 as raw 16-bit patterns),
// C f32 or of A's type (rounded to nearest even), compute type CUBLAS_COMPUTE_32F or its
// pedantic form. Anything else answers CUBLAS_STATUS_NOT_SUPPORTED, as cuBLAS does for a
// combination it lacks, rather than computing something the GPU would not.
//
// A product is queued on the handle's stream through the driver's hostcuda_stream_enqueue: it
// runs at once, or is recorded into the graph when the stream captures, like any kernel. With
// CUBLAS_POINTER_MODE_HOST, alpha and beta are read when the call is made; with
// CUBLAS_POINTER_MODE_DEVICE, when the product runs.
//
// Workspace: as cuBLAS 12.2 on does, a product on a capturing stream of a handle with no
// workspace of its own (cublasSetWorkspace) takes one with a stream-ordered allocation before
// it and frees it after it, so that the captured graph holds a memory node pair per product,
// as a GPU's does (a test that a recorded step's graph is free of memory nodes sees them).

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <mutex>
#include <set>
#include <vector>

typedef int cublasStatus_t;
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
struct CUstream_st;
typedef CUstream_st* cudaStream_t;

// The driver's (driver.cpp) services for libraries.
#pragma GCC visibility push(default)
extern "C" CUresult hostcuda_stream_enqueue(cudaStream_t s, const char* what, int (*run)(void*), void* data,
                                            void (*release)(void*));
extern "C" CUresult hostcuda_check_range(const char* what, const char* which, CUdeviceptr p, size_t n);
extern "C" CUresult cuStreamIsCapturing(cudaStream_t s, int* status);
extern "C" CUresult cuMemAllocAsync(CUdeviceptr* out, size_t bytes, cudaStream_t s);
extern "C" CUresult cuMemFreeAsync(CUdeviceptr p, cudaStream_t s);
#pragma GCC visibility pop

struct cublasContext {
    cudaStream_t stream;
    int pointer_mode;
    int math_mode;
    int atomics_mode;
    int sm_count_target;
    void* workspace;
    size_t workspace_bytes;
};
typedef cublasContext* cublasHandle_t;

namespace {

enum : int {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_ALLOC_FAILED = 3,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_ARCH_MISMATCH = 8,
    CUBLAS_STATUS_MAPPING_ERROR = 11,
    CUBLAS_STATUS_EXECUTION_FAILED = 13,
    CUBLAS_STATUS_INTERNAL_ERROR = 14,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
    CUBLAS_STATUS_LICENSE_ERROR = 16,
};

enum { OP_N = 0, OP_T = 1, OP_C = 2 };
enum { POINTER_MODE_HOST = 0, POINTER_MODE_DEVICE = 1 };
enum { R_32F = 0, R_16F = 2, R_16BF = 14 };
enum { COMPUTE_32F = 68, COMPUTE_32F_PEDANTIC = 69 };

std::mutex g_mu;
std::set<cublasHandle_t> g_handles;

bool valid(cublasHandle_t h) {
    std::lock_guard<std::mutex> l(g_mu);
    return g_handles.count(h) != 0;
}

size_t type_size(int t) { return t == R_32F ? 4 : 2; }

float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);  // NaN stays a (quiet) NaN
    u += 0x7fffu + ((u >> 16) & 1);                                               // round to nearest even
    return (uint16_t)(u >> 16);
}

float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp == 0) {
        if (man == 0) {
            u = sign;
        } else {  // subnormal: normalize
            int e = -1;
            do {
                e++;
                man <<= 1;
            } while (!(man & 0x400));
            u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ff) << 13);
        }
    } else {
        u = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &u, 4);
    return f;
}

uint16_t f32_to_f16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
    uint32_t a = u & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00;  // NaN
    if (a >= 0x477ff000u) return sign | 0x7c00;  // rounds to infinity
    if (a < 0x38800000u) {                       // subnormal or zero in f16
        // value = a as float; f16 subnormal unit is 2^-24
        float v;
        memcpy(&v, &a, 4);
        float scaled = v * 16777216.0f;  // exact (power of two)
        float r = nearbyintf(scaled);    // round to nearest even (default rounding mode)
        return sign | (uint16_t)r;
    }
    uint32_t e = (a >> 23) - 127 + 15, man = a & 0x7fffff;
    uint32_t h = (e << 10) | (man >> 13);
    uint32_t rest = man & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++;  // carries into the exponent correctly
    return sign | (uint16_t)h;
}

float load(const char* base, int type, size_t i) {
    if (type == R_32F) {
        float f;
        memcpy(&f, base + 4 * i, 4);
        return f;
    }
    uint16_t b;
    memcpy(&b, base + 2 * i, 2);
    return type == R_16BF ? bf16_to_f32(b) : f16_to_f32(b);
}

void store(char* base, int type, size_t i, float v) {
    if (type == R_32F) {
        memcpy(base + 4 * i, &v, 4);
        return;
    }
    uint16_t b = type == R_16BF ? f32_to_bf16(v) : f32_to_f16(v);
    memcpy(base + 2 * i, &b, 2);
}

// One queued product (a batch of them for the batched forms): everything it needs, copied at
// the call, since a recorded graph replays it long after.
struct Gemm {
    const char* what;
    int transa, transb;
    int m, n, k;
    int a_type, b_type, c_type;
    int lda, ldb, ldc;
    long long stride_a, stride_b, stride_c;  // elements; batched forms only
    int batch;
    const char* a;
    const char* b;
    char* c;
    // Pointer-array batched form: device arrays of batch pointers, read when the product runs.
    const void* const* a_array;
    const void* const* b_array;
    void* const* c_array;
    bool device_scalars;
    float alpha, beta;              // host pointer mode
    const float* alpha_ptr;         // device pointer mode
    const float* beta_ptr;
};

// Bytes from the first to past the last element a column-major rows×cols operand with leading
// dimension ld touches.
size_t extent(int rows, int cols, int ld, size_t elem) {
    if (rows <= 0 || cols <= 0) return 0;
    return ((size_t)(cols - 1) * (size_t)ld + (size_t)rows) * elem;
}

CUresult check(const char* what, const char* which, const void* p, size_t bytes) {
    return hostcuda_check_range(what, which, (CUdeviceptr)(uintptr_t)p, bytes);
}

// C (m×n) = alpha·op(A)·op(B) + beta·C for one batch entry.
CUresult gemm_one(const Gemm& g, const char* a, const char* b, char* c, float alpha, float beta) {
    const int m = g.m, n = g.n, k = g.k;
    const size_t ea = type_size(g.a_type), eb = type_size(g.b_type), ec = type_size(g.c_type);
    const bool read_ab = alpha != 0.0f && k > 0;
    if (read_ab) {
        if (CUresult r = check(g.what, "A", a, g.transa == OP_N ? extent(m, k, g.lda, ea) : extent(k, m, g.lda, ea)))
            return r;
        if (CUresult r = check(g.what, "B", b, g.transb == OP_N ? extent(k, n, g.ldb, eb) : extent(n, k, g.ldb, eb)))
            return r;
    }
    if (CUresult r = check(g.what, "C", c, extent(m, n, g.ldc, ec))) return r;
    // op(B) as n rows of k floats, op(A) a block of rows at a time: dot products of contiguous
    // rows, the same order of additions as the definition.
    std::vector<float> bt, at;
    if (read_ab) {
        bt.resize((size_t)n * k);
        for (int j = 0; j < n; j++)
            for (int p = 0; p < k; p++)
                bt[(size_t)j * k + p] = g.transb == OP_N ? load(b, g.b_type, (size_t)j * g.ldb + p)
                                                         : load(b, g.b_type, (size_t)p * g.ldb + j);
    }
    const int kRows = 64;
    for (int i0 = 0; i0 < m; i0 += kRows) {
        const int rows = m - i0 < kRows ? m - i0 : kRows;
        if (read_ab) {
            at.resize((size_t)rows * k);
            for (int r = 0; r < rows; r++) {
                const int i = i0 + r;
                for (int p = 0; p < k; p++)
                    at[(size_t)r * k + p] = g.transa == OP_N ? load(a, g.a_type, (size_t)p * g.lda + i)
                                                             : load(a, g.a_type, (size_t)i * g.lda + p);
            }
        }
        for (int r = 0; r < rows; r++) {
            const int i = i0 + r;
            const float* ar = read_ab ? &at[(size_t)r * k] : nullptr;
            int j = 0;
            // Four columns at a time: four independent sums, each still in k order.
            for (; j < n; j += 4) {
                const int cols = n - j < 4 ? n - j : 4;
                float s[4] = {0, 0, 0, 0};
                if (read_ab) {
                    const float* b0 = &bt[(size_t)j * k];
                    if (cols == 4) {
                        const float *b1 = b0 + k, *b2 = b1 + k, *b3 = b2 + k;
                        for (int p = 0; p < k; p++) {
                            const float x = ar[p];
                            s[0] += x * b0[p];
                            s[1] += x * b1[p];
                            s[2] += x * b2[p];
                            s[3] += x * b3[p];
                        }
                    } else {
                        for (int q = 0; q < cols; q++) {
                            const float* bq = b0 + (size_t)q * k;
                            for (int p = 0; p < k; p++) s[q] += ar[p] * bq[p];
                        }
                    }
                }
                for (int q = 0; q < cols; q++) {
                    const size_t at_c = (size_t)(j + q) * g.ldc + i;
                    float v = alpha * s[q];
                    if (beta != 0.0f) v += beta * load(c, g.c_type, at_c);
                    store(c, g.c_type, at_c, v);
                }
            }
        }
    }
    return 0;
}

int run_gemm(void* p) {
    const Gemm& g = *static_cast<const Gemm*>(p);
    float alpha = g.alpha, beta = g.beta;
    if (g.device_scalars) {
        if (CUresult r = check(g.what, "alpha", g.alpha_ptr, 4)) return r;
        if (CUresult r = check(g.what, "beta", g.beta_ptr, 4)) return r;
        alpha = *g.alpha_ptr;
        beta = *g.beta_ptr;
    }
    for (int i = 0; i < g.batch; i++) {
        const char *a, *b;
        char* c;
        if (g.c_array) {
            if (CUresult r = check(g.what, "Aarray", g.a_array, sizeof(void*) * (size_t)g.batch)) return r;
            if (CUresult r = check(g.what, "Barray", g.b_array, sizeof(void*) * (size_t)g.batch)) return r;
            if (CUresult r = check(g.what, "Carray", g.c_array, sizeof(void*) * (size_t)g.batch)) return r;
            a = static_cast<const char*>(g.a_array[i]);
            b = static_cast<const char*>(g.b_array[i]);
            c = static_cast<char*>(g.c_array[i]);
        } else {
            a = g.a + (ptrdiff_t)i * g.stride_a * (ptrdiff_t)type_size(g.a_type);
            b = g.b + (ptrdiff_t)i * g.stride_b * (ptrdiff_t)type_size(g.b_type);
            c = g.c + (ptrdiff_t)i * g.stride_c * (ptrdiff_t)type_size(g.c_type);
        }
        if (CUresult r = gemm_one(g, a, b, c, alpha, beta)) return r;
    }
    return 0;
}

void free_gemm(void* p) { delete static_cast<Gemm*>(p); }

bool supported(int a_type, int b_type, int c_type, int compute) {
    if (compute != COMPUTE_32F && compute != COMPUTE_32F_PEDANTIC) return false;
    if (a_type != b_type) return false;
    if (a_type != R_32F && a_type != R_16BF && a_type != R_16F) return false;
    return c_type == R_32F || c_type == a_type;
}

// The stream-ordered workspace a product of a handle without one takes while capturing.
constexpr size_t CAPTURED_WORKSPACE_BYTES = 1 << 20;

cublasStatus_t submit(cublasHandle_t h, Gemm* g, const void* alpha, const void* beta) {
    if (!valid(h)) {
        delete g;
        return CUBLAS_STATUS_NOT_INITIALIZED;
    }
    auto dim_ok = [&]() {
        if (g->m < 0 || g->n < 0 || g->k < 0 || g->batch < 0) return false;
        if (g->transa < OP_N || g->transa > OP_C || g->transb < OP_N || g->transb > OP_C) return false;
        const int rows_a = g->transa == OP_N ? g->m : g->k, rows_b = g->transb == OP_N ? g->k : g->n;
        return g->lda >= (rows_a > 1 ? rows_a : 1) && g->ldb >= (rows_b > 1 ? rows_b : 1) && g->ldc >= (g->m > 1 ? g->m : 1);
    };
    if (!dim_ok() || !alpha || !beta) {
        delete g;
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (g->m == 0 || g->n == 0 || g->batch == 0) {
        delete g;
        return CUBLAS_STATUS_SUCCESS;
    }
    g->device_scalars = h->pointer_mode == POINTER_MODE_DEVICE;
    if (g->device_scalars) {
        g->alpha_ptr = static_cast<const float*>(alpha);
        g->beta_ptr = static_cast<const float*>(beta);
    } else {
        g->alpha = *static_cast<const float*>(alpha);
        g->beta = *static_cast<const float*>(beta);
    }
    const char* what = g->what;
    // The workspace cuBLAS takes on a capturing stream when the handle has none (see the top).
    int capturing = 0;
    CUdeviceptr own_workspace = 0;
    if (!h->workspace && cuStreamIsCapturing(h->stream, &capturing) == 0 && capturing == 1 &&
        cuMemAllocAsync(&own_workspace, CAPTURED_WORKSPACE_BYTES, h->stream) != 0) {
        delete g;
        return CUBLAS_STATUS_ALLOC_FAILED;
    }
    CUresult r = hostcuda_stream_enqueue(h->stream, what, run_gemm, g, free_gemm);
    if (own_workspace && cuMemFreeAsync(own_workspace, h->stream) != 0 && r == 0) r = 1;
    if (r != 0) {
        fprintf(stderr, "hostcuda: %s failed (CUresult %d)\n", what, r);
        return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    return CUBLAS_STATUS_SUCCESS;
}

Gemm* new_gemm(const char* what, int transa, int transb, int m, int n, int k, const void* a, int a_type, int lda,
               const void* b, int b_type, int ldb, void* c, int c_type, int ldc) {
    Gemm* g = new Gemm();
    g->what = what;
    g->transa = transa;
    g->transb = transb;
    g->m = m;
    g->n = n;
    g->k = k;
    g->a = static_cast<const char*>(a);
    g->a_type = a_type;
    g->lda = lda;
    g->b = static_cast<const char*>(b);
    g->b_type = b_type;
    g->ldb = ldb;
    g->c = static_cast<char*>(c);
    g->c_type = c_type;
    g->ldc = ldc;
    g->batch = 1;
    return g;
}

struct StatusText {
    int code;
    const char* name;
    const char* text;
};

const StatusText kStatus[] = {
    {0, "CUBLAS_STATUS_SUCCESS", "success"},
    {1, "CUBLAS_STATUS_NOT_INITIALIZED", "the library was not initialized"},
    {3, "CUBLAS_STATUS_ALLOC_FAILED", "the resource allocation failed"},
    {7, "CUBLAS_STATUS_INVALID_VALUE", "an invalid numeric value was used as an argument"},
    {8, "CUBLAS_STATUS_ARCH_MISMATCH", "an absent device architectural feature is required"},
    {11, "CUBLAS_STATUS_MAPPING_ERROR", "an access to GPU memory space failed"},
    {13, "CUBLAS_STATUS_EXECUTION_FAILED", "the GPU program failed to execute"},
    {14, "CUBLAS_STATUS_INTERNAL_ERROR", "an internal operation failed"},
    {15, "CUBLAS_STATUS_NOT_SUPPORTED", "the functionality requested is not supported"},
    {16, "CUBLAS_STATUS_LICENSE_ERROR", "error detected trying to check the license"},
};

}  // namespace

// The entry points: the only symbols the library exports (it is built with -fvisibility=hidden).
#pragma GCC visibility push(default)
extern "C" {

cublasStatus_t cublasCreate_v2(cublasHandle_t* out) {
    if (!out) return CUBLAS_STATUS_INVALID_VALUE;
    cublasContext* h = new cublasContext{nullptr, POINTER_MODE_HOST, 0, 0, 0, nullptr, 0};
    std::lock_guard<std::mutex> l(g_mu);
    g_handles.insert(h);
    *out = h;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy_v2(cublasHandle_t h) {
    std::lock_guard<std::mutex> l(g_mu);
    if (!g_handles.erase(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream_v2(cublasHandle_t h, cudaStream_t s) {
    if (!valid(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    h->stream = s;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream_v2(cublasHandle_t h, cudaStream_t* s) {
    if (!valid(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!s) return CUBLAS_STATUS_INVALID_VALUE;
    *s = h->stream;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace_v2(cublasHandle_t h, void* ws, size_t bytes) {
    if (!valid(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (bytes && !ws) return CUBLAS_STATUS_INVALID_VALUE;
    h->workspace = ws;
    h->workspace_bytes = bytes;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t h, int mode) {
    if (!valid(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if ((mode & ~16) < 0 || (mode & ~16) > 3) return CUBLAS_STATUS_INVALID_VALUE;
    h->math_mode = mode;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetMathMode(cublasHandle_t h, int* mode) {
    if (!valid(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!mode) return CUBLAS_STATUS_INVALID_VALUE;
    *mode = h->math_mode;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetPointerMode_v2(cublasHandle_t h, int mode) {
    if (!valid(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (mode != POINTER_MODE_HOST && mode != POINTER_MODE_DEVICE) return CUBLAS_STATUS_INVALID_VALUE;
    h->pointer_mode = mode;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetPointerMode_v2(cublasHandle_t h, int* mode) {
    if (!valid(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!mode) return CUBLAS_STATUS_INVALID_VALUE;
    *mode = h->pointer_mode;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetAtomicsMode(cublasHandle_t h, int mode) {
    if (!valid(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (mode != 0 && mode != 1) return CUBLAS_STATUS_INVALID_VALUE;
    h->atomics_mode = mode;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetAtomicsMode(cublasHandle_t h, int* mode) {
    if (!valid(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!mode) return CUBLAS_STATUS_INVALID_VALUE;
    *mode = h->atomics_mode;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetSmCountTarget(cublasHandle_t h, int n) {
    if (!valid(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (n < 0) return CUBLAS_STATUS_INVALID_VALUE;
    h->sm_count_target = n;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetSmCountTarget(cublasHandle_t h, int* n) {
    if (!valid(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!n) return CUBLAS_STATUS_INVALID_VALUE;
    *n = h->sm_count_target;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetVersion_v2(cublasHandle_t h, int* v) {
    (void)h;
    if (!v) return CUBLAS_STATUS_INVALID_VALUE;
    *v = 130000;  // 13.0.0
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetProperty(int type, int* v) {
    if (!v) return CUBLAS_STATUS_INVALID_VALUE;
    switch (type) {
        case 0: *v = 13; return CUBLAS_STATUS_SUCCESS;  // MAJOR_VERSION
        case 1: *v = 0; return CUBLAS_STATUS_SUCCESS;   // MINOR_VERSION
        case 2: *v = 0; return CUBLAS_STATUS_SUCCESS;   // PATCH_LEVEL
        default: return CUBLAS_STATUS_INVALID_VALUE;
    }
}

size_t cublasGetCudartVersion() { return 13000; }

const char* cublasGetStatusName(cublasStatus_t s) {
    for (const StatusText& t : kStatus)
        if (t.code == s) return t.name;
    return "CUBLAS_STATUS_UNKNOWN";
}

const char* cublasGetStatusString(cublasStatus_t s) {
    for (const StatusText& t : kStatus)
        if (t.code == s) return t.text;
    return "unknown error";
}

cublasStatus_t cublasGemmEx(cublasHandle_t h, int transa, int transb, int m, int n, int k, const void* alpha,
                            const void* a, int a_type, int lda, const void* b, int b_type, int ldb, const void* beta,
                            void* c, int c_type, int ldc, int compute, int algo) {
    (void)algo;
    if (!valid(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!supported(a_type, b_type, c_type, compute)) return CUBLAS_STATUS_NOT_SUPPORTED;
    Gemm* g = new_gemm("cublasGemmEx", transa, transb, m, n, k, a, a_type, lda, b, b_type, ldb, c, c_type, ldc);
    return submit(h, g, alpha, beta);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, int transa, int transb, int m, int n, int k,
                                          const void* alpha, const void* a, int a_type, int lda, long long stride_a,
                                          const void* b, int b_type, int ldb, long long stride_b, const void* beta,
                                          void* c, int c_type, int ldc, long long stride_c, int batch, int compute,
                                          int algo) {
    (void)algo;
    if (!valid(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!supported(a_type, b_type, c_type, compute)) return CUBLAS_STATUS_NOT_SUPPORTED;
    Gemm* g = new_gemm("cublasGemmStridedBatchedEx", transa, transb, m, n, k, a, a_type, lda, b, b_type, ldb, c, c_type,
                       ldc);
    g->stride_a = stride_a;
    g->stride_b = stride_b;
    g->stride_c = stride_c;
    g->batch = batch;
    return submit(h, g, alpha, beta);
}

cublasStatus_t cublasGemmBatchedEx(cublasHandle_t h, int transa, int transb, int m, int n, int k, const void* alpha,
                                   const void* const* a, int a_type, int lda, const void* const* b, int b_type, int ldb,
                                   const void* beta, void* const* c, int c_type, int ldc, int batch, int compute,
                                   int algo) {
    (void)algo;
    if (!valid(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (!supported(a_type, b_type, c_type, compute)) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (batch > 0 && (!a || !b || !c)) return CUBLAS_STATUS_INVALID_VALUE;
    Gemm* g = new_gemm("cublasGemmBatchedEx", transa, transb, m, n, k, nullptr, a_type, lda, nullptr, b_type, ldb,
                       nullptr, c_type, ldc);
    g->a_array = a;
    g->b_array = b;
    g->c_array = c;
    g->batch = batch;
    return submit(h, g, alpha, beta);
}

cublasStatus_t cublasSgemm_v2(cublasHandle_t h, int transa, int transb, int m, int n, int k, const float* alpha,
                              const float* a, int lda, const float* b, int ldb, const float* beta, float* c, int ldc) {
    if (!valid(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    Gemm* g = new_gemm("cublasSgemm", transa, transb, m, n, k, a, R_32F, lda, b, R_32F, ldb, c, R_32F, ldc);
    return submit(h, g, alpha, beta);
}

cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, int transa, int transb, int m, int n, int k,
                                         const float* alpha, const float* a, int lda, long long stride_a,
                                         const float* b, int ldb, long long stride_b, const float* beta, float* c,
                                         int ldc, long long stride_c, int batch) {
    if (!valid(h)) return CUBLAS_STATUS_NOT_INITIALIZED;
    Gemm* g = new_gemm("cublasSgemmStridedBatched", transa, transb, m, n, k, a, R_32F, lda, b, R_32F, ldb, c, R_32F,
                       ldc);
    g->stride_a = stride_a;
    g->stride_b = stride_b;
    g->stride_c = stride_c;
    g->batch = batch;
    return submit(h, g, alpha, beta);
}

}  // extern "C"
#pragma GCC visibility pop
