// A test of hostcuda's driver and cuBLAS (driver.cpp, cublas.cpp) that needs neither tern nor
// hostcuda's NVRTC: compiled with -DHOSTCUDA_SELFTEST_MODULE this file is a tiny hand-written
// module (plain loops implementing the module contract of driver.cpp), otherwise the program
// that wraps that module in the image format and drives it through the C entry points the way
// cudarc does. build.sh OUTDIR --selftest builds both and runs it; it exits nonzero on the
// first failed check.

#include <stdint.h>
#include <stdio.h>
#include <string.h>

#ifdef HOSTCUDA_SELFTEST_MODULE

// ---- the module ---------------------------------------------------------------------------------

namespace {
char g_where[128];
}

extern "C" {

int tern_host_has_kernel(const char* name) {
    return !strcmp(name, "add_one") || !strcmp(name, "fail") || !strcmp(name, "write_at") || !strcmp(name, "nothing");
}

int tern_host_kernel_params(const char* name, unsigned* sizes, unsigned max) {
    // add_one(int* p, int n); write_at(int* p, long long index, int value); fail(); nothing()
    static const unsigned add_one[] = {8, 4}, write_at[] = {8, 8, 4};
    const unsigned* s = nullptr;
    int n = 0;
    if (!strcmp(name, "add_one")) s = add_one, n = 2;
    if (!strcmp(name, "write_at")) s = write_at, n = 3;
    for (int i = 0; i < n && (unsigned)i < max; i++) sizes[i] = s[i];
    return n;
}

const char* tern_host_fault_where() { return g_where; }

int tern_host_launch(const char* name, const unsigned grid[3], const unsigned block[3], unsigned smem, void** params,
                     char* err, unsigned errlen) {
    (void)smem;
    if (!strcmp(name, "fail")) {
        snprintf(err, errlen, "fail block (0,0,0) thread (0,0,0): deliberate failure");
        return 1;
    }
    for (unsigned b = 0; b < grid[0] * grid[1] * grid[2]; b++)
        for (unsigned t = 0; t < block[0] * block[1] * block[2]; t++) {
            snprintf(g_where, sizeof g_where, "block (%u,0,0) thread (%u,0,0)", b, t);
            if (!strcmp(name, "add_one")) {
                int* p = *static_cast<int**>(params[0]);
                int n = *static_cast<int*>(params[1]);
                unsigned i = b * block[0] + t;
                if ((int)i < n) p[i] += 1;
            } else if (!strcmp(name, "write_at") && b == 0 && t == 0) {
                int* p = *static_cast<int**>(params[0]);
                long long i = *static_cast<long long*>(params[1]);
                p[i] = *static_cast<int*>(params[2]);
            }
        }
    return 0;
}

// A cooperative launch runs the kernel as a plain one does and, for add_one, also adds 100 to
// p[0], so that the test sees which entry point the driver took.
int tern_host_launch_cooperative(const char* name, const unsigned grid[3], const unsigned block[3], unsigned smem,
                                 void** params, char* err, unsigned errlen) {
    const int r = tern_host_launch(name, grid, block, smem, params, err, errlen);
    if (r == 0 && !strcmp(name, "add_one")) (*static_cast<int**>(params[0]))[0] += 100;
    return r;
}

}  // extern "C"

#else

// ---- the test -----------------------------------------------------------------------------------

#include <math.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include <string>
#include <vector>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st* CUcontext;
typedef struct CUstream_st* CUstream;
typedef struct CUevent_st* CUevent;
typedef struct CUmod_st* CUmodule;
typedef struct CUfunc_st* CUfunction;
typedef struct CUgraph_st* CUgraph;
typedef struct CUgraphExec_st* CUgraphExec;
typedef struct cublasContext* cublasHandle_t;

union LaunchAttrValue {
    char pad[64];
    int i;
    void* align_;
};
struct LaunchAttr {
    int id;
    char pad[4];
    LaunchAttrValue value;
};
struct LaunchConfig {
    unsigned gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
    CUstream hStream;
    LaunchAttr* attrs;
    unsigned numAttrs;
};

extern "C" {
CUresult cuInit(unsigned);
CUresult cuDriverGetVersion(int*);
CUresult cuDeviceGetCount(int*);
CUresult cuDeviceGet(CUdevice*, int);
CUresult cuDeviceGetName(char*, int, CUdevice);
CUresult cuDeviceGetAttribute(int*, int, CUdevice);
CUresult cuDeviceTotalMem_v2(size_t*, CUdevice);
CUresult cuDevicePrimaryCtxRetain(CUcontext*, CUdevice);
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice);
CUresult cuCtxSetCurrent(CUcontext);
CUresult cuCtxGetCurrent(CUcontext*);
CUresult cuCtxPushCurrent_v2(CUcontext);
CUresult cuCtxPopCurrent_v2(CUcontext*);
CUresult cuCtxGetDevice(CUdevice*);
CUresult cuCtxSynchronize();
CUresult cuGetErrorName(CUresult, const char**);
CUresult cuGetErrorString(CUresult, const char**);
CUresult cuGetProcAddress_v2(const char*, void**, int, unsigned long long, int*);
CUresult cuMemGetInfo_v2(size_t*, size_t*);
CUresult cuMemAlloc_v2(CUdeviceptr*, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
typedef struct CUmemPoolHandle_st* CUmemoryPool;
CUresult cuMemPoolCreate(CUmemoryPool*, const void*);
CUresult cuMemPoolDestroy(CUmemoryPool);
CUresult cuMemAllocFromPoolAsync(CUdeviceptr*, size_t, CUmemoryPool, CUstream);
CUresult cuMemAllocAsync(CUdeviceptr*, size_t, CUstream);
CUresult cuMemFreeAsync(CUdeviceptr, CUstream);
CUresult cuMemHostAlloc(void**, size_t, unsigned);
CUresult cuMemFreeHost(void*);
CUresult cuMemcpyHtoD_v2(CUdeviceptr, const void*, size_t);
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr, const void*, size_t, CUstream);
CUresult cuMemcpyDtoH_v2(void*, CUdeviceptr, size_t);
CUresult cuMemcpyDtoHAsync_v2(void*, CUdeviceptr, size_t, CUstream);
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr, CUdeviceptr, size_t, CUstream);
CUresult cuMemsetD8Async(CUdeviceptr, unsigned char, size_t, CUstream);
CUresult cuMemsetD16Async(CUdeviceptr, unsigned short, size_t, CUstream);
CUresult cuMemsetD32Async(CUdeviceptr, unsigned, size_t, CUstream);
CUresult cuMemsetD32_v2(CUdeviceptr, unsigned, size_t);
CUresult cuStreamCreate(CUstream*, unsigned);
CUresult cuStreamDestroy_v2(CUstream);
CUresult cuStreamSynchronize(CUstream);
CUresult cuStreamWaitEvent(CUstream, CUevent, unsigned);
CUresult cuStreamBeginCapture_v2(CUstream, int);
CUresult cuStreamEndCapture(CUstream, CUgraph*);
CUresult cuStreamIsCapturing(CUstream, int*);
CUresult cuGraphInstantiateWithFlags(CUgraphExec*, CUgraph, unsigned long long);
CUresult cuGraphLaunch(CUgraphExec, CUstream);
CUresult cuGraphUpload(CUgraphExec, CUstream);
CUresult cuGraphExecDestroy(CUgraphExec);
CUresult cuGraphDestroy(CUgraph);
CUresult cuEventCreate(CUevent*, unsigned);
CUresult cuEventRecord(CUevent, CUstream);
CUresult cuEventRecordWithFlags(CUevent, CUstream, unsigned);
CUresult cuEventSynchronize(CUevent);
CUresult cuEventQuery(CUevent);
CUresult cuEventElapsedTime_v2(float*, CUevent, CUevent);
CUresult cuEventDestroy_v2(CUevent);
CUresult cuModuleLoadData(CUmodule*, const void*);
CUresult cuModuleUnload(CUmodule);
CUresult cuModuleGetFunction(CUfunction*, CUmodule, const char*);
CUresult cuFuncSetAttribute(CUfunction, int, int);
CUresult cuFuncGetAttribute(int*, int, CUfunction);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                        void**, void**);
CUresult cuLaunchKernelEx(const LaunchConfig*, CUfunction, void**, void**);
CUresult cuLaunchCooperativeKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                                   void**);

int cublasCreate_v2(cublasHandle_t*);
int cublasDestroy_v2(cublasHandle_t);
int cublasSetStream_v2(cublasHandle_t, CUstream);
int cublasSetPointerMode_v2(cublasHandle_t, int);
int cublasSetWorkspace_v2(cublasHandle_t, void*, size_t);
CUresult cuGraphGetNodes(CUgraph, void**, size_t*);
CUresult cuGraphNodeGetType(void*, int*);
int cublasGemmEx(cublasHandle_t, int, int, int, int, int, const void*, const void*, int, int, const void*, int, int,
                 const void*, void*, int, int, int, int);
int cublasGemmStridedBatchedEx(cublasHandle_t, int, int, int, int, int, const void*, const void*, int, int, long long,
                               const void*, int, int, long long, const void*, void*, int, int, long long, int, int,
                               int);
int cublasSgemm_v2(cublasHandle_t, int, int, int, int, int, const float*, const float*, int, const float*, int,
                   const float*, float*, int);
}

static int g_checks = 0;

#define CHECK(cond)                                                                  \
    do {                                                                             \
        g_checks++;                                                                  \
        if (!(cond)) {                                                               \
            fprintf(stderr, "selftest: FAILED at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
            exit(1);                                                                 \
        }                                                                            \
    } while (0)

#define OK(call) CHECK((call) == 0)

static std::vector<char> read_file(const char* path) {
    FILE* f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "selftest: cannot open %s\n", path);
        exit(1);
    }
    std::vector<char> v;
    char buf[65536];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0) v.insert(v.end(), buf, buf + n);
    fclose(f);
    return v;
}

// The image cuModuleLoadData takes: magic, little-endian u64 length, the shared object.
static std::vector<char> wrap(const std::vector<char>& so) {
    std::vector<char> img(16 + 8);
    memcpy(img.data(), "TERNHOSTCUDA\0\0\0\0", 16);
    uint64_t n = so.size();
    for (int i = 0; i < 8; i++) img[16 + i] = (char)(n >> (8 * i));
    img.insert(img.end(), so.begin(), so.end());
    return img;
}

// Runs f in a child process; returns its exit status and what it wrote to stderr.
template <class F>
static int in_child(F f, std::string* err) {
    int fds[2];
    CHECK(pipe(fds) == 0);
    fflush(stdout);
    fflush(stderr);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        close(fds[0]);
        dup2(fds[1], 2);
        f();
        _exit(0);
    }
    close(fds[1]);
    err->clear();
    char buf[4096];
    ssize_t n;
    while ((n = read(fds[0], buf, sizeof buf)) > 0) err->append(buf, (size_t)n);
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    return status;
}

static bool contains(const std::string& s, const char* what) { return s.find(what) != std::string::npos; }

static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

static float from_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

// cuBLAS's definition, column-major, summed in float in k order.
static void ref_gemm(int ta, int tb, int m, int n, int k, float alpha, const std::vector<float>& a, int lda,
                     const std::vector<float>& b, int ldb, float beta, std::vector<float>& c, int ldc) {
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            float s = 0;
            for (int p = 0; p < k; p++) {
                float x = ta ? a[(size_t)i * lda + p] : a[(size_t)p * lda + i];
                float y = tb ? b[(size_t)p * ldb + j] : b[(size_t)j * ldb + p];
                s += x * y;
            }
            float v = alpha * s;
            if (beta != 0) v += beta * c[(size_t)j * ldc + i];
            c[(size_t)j * ldc + i] = v;
        }
}

static CUdeviceptr upload(const void* data, size_t bytes) {
    CUdeviceptr p;
    OK(cuMemAlloc_v2(&p, bytes));
    OK(cuMemcpyHtoD_v2(p, data, bytes));
    return p;
}

template <class T>
static std::vector<T> download(CUdeviceptr p, size_t n) {
    std::vector<T> v(n);
    OK(cuMemcpyDtoH_v2(v.data(), p, n * sizeof(T)));
    return v;
}

int main(int argc, char** argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s selftest_module.so\n", argv[0]);
        return 2;
    }
    const long page = sysconf(_SC_PAGESIZE);

    // ---- device and context
    CUdeviceptr p0;
    CHECK(cuMemAlloc_v2(&p0, 16) == 3);  // before cuInit: CUDA_ERROR_NOT_INITIALIZED
    OK(cuInit(0));
    int v;
    OK(cuDriverGetVersion(&v));
    CHECK(v == 13000);
    OK(cuDeviceGetCount(&v));
    CHECK(v == 1);
    CUdevice dev;
    CHECK(cuDeviceGet(&dev, 1) == 101);
    OK(cuDeviceGet(&dev, 0));
    char name[128];
    OK(cuDeviceGetName(name, sizeof name, dev));
    CHECK(!strcmp(name, "hostcuda (CPU emulation of an sm_90 device)"));
    const int attrs[][2] = {{75, 9}, {76, 0}, {16, 132}, {10, 32}, {1, 1024}, {8, 49152}, {97, 232448}, {81, 233472}, {115, 1}, {95, 1}};
    for (auto& a : attrs) {
        OK(cuDeviceGetAttribute(&v, a[0], dev));
        CHECK(v == a[1]);
    }
    CHECK(cuDeviceGetAttribute(&v, 9999, dev) == 1);
    size_t total, free_bytes;
    OK(cuDeviceTotalMem_v2(&total, dev));
    CHECK(total == (139ull << 30));
    CHECK(cuMemAlloc_v2(&p0, 16) == 201);  // no current context
    CUcontext ctx, cur;
    OK(cuDevicePrimaryCtxRetain(&ctx, dev));
    OK(cuCtxGetCurrent(&cur));
    CHECK(cur == nullptr);
    OK(cuCtxSetCurrent(ctx));
    OK(cuCtxGetCurrent(&cur));
    CHECK(cur == ctx);
    OK(cuCtxPushCurrent_v2(ctx));
    OK(cuCtxPopCurrent_v2(&cur));
    CHECK(cur == ctx);
    OK(cuCtxGetDevice(&dev));
    CHECK(dev == 0);
    const char* s;
    OK(cuGetErrorName(200, &s));
    CHECK(!strcmp(s, "CUDA_ERROR_INVALID_IMAGE"));
    OK(cuGetErrorString(1, &s));
    CHECK(!strcmp(s, "invalid argument"));
    CHECK(cuGetErrorString(12345, &s) == 1);
    void* fp = nullptr;
    OK(cuGetProcAddress_v2("cuMemAlloc", &fp, 13000, 0, nullptr));
    CHECK(fp == (void*)&cuMemAlloc_v2);

    // ---- memory: placement against the guard page, poison, accounting, frees
    size_t free0;
    OK(cuMemGetInfo_v2(&free0, &total));
    CHECK(total == (139ull << 30) && free0 <= total);
    for (size_t n : {0, 1, 15, 16, 4095, 4096, 4097, 100000}) {
        CUdeviceptr p;
        OK(cuMemAlloc_v2(&p, n));
        CHECK(p != 0 && p % 16 == 0);
        CHECK((p + (n + 15) / 16 * 16) % (unsigned long long)page == 0);  // the end is flush with a page
        OK(cuMemGetInfo_v2(&free_bytes, &total));
        CHECK(free_bytes == free0 - n);
        if (n) {
            std::vector<unsigned char> h = download<unsigned char>(p, n);
            for (unsigned char c : h) CHECK(c == 0xff);  // poisoned
        }
        OK(cuMemFree_v2(p));
    }
    OK(cuMemGetInfo_v2(&free_bytes, &total));
    CHECK(free_bytes == free0);
    {
        CUdeviceptr p;
        OK(cuMemAlloc_v2(&p, 64));
        CHECK(cuMemFree_v2(p + 16) == 1);  // not an allocation's start
        OK(cuMemFree_v2(p));
        CHECK(cuMemFree_v2(p) == 1);  // twice
        int h[4];
        OK(cuMemAlloc_v2(&p, 16));
        CHECK(cuMemcpyDtoH_v2(h, p, 32) == 1);  // past the end: refused, not performed
        CHECK(cuMemcpyHtoD_v2(p + 8, h, 16) == 1);
        OK(cuMemFree_v2(p));
        void* pinned;
        OK(cuMemHostAlloc(&pinned, 1000, 0));
        CHECK((uintptr_t)pinned % (uintptr_t)page == 0);
        OK(cuMemFreeHost(pinned));
        CHECK(cuMemFreeHost(pinned) == 1);
    }

    CUstream st;
    OK(cuStreamCreate(&st, 1));
    CHECK(cuStreamSynchronize((CUstream)(uintptr_t)0xdead0) == 400);

    // ---- stream-ordered allocation of nothing: a valid, unique, untouchable address
    {
        CUdeviceptr a, b;
        OK(cuMemAllocAsync(&a, 0, st));
        OK(cuMemAllocAsync(&b, 0, st));
        CHECK(a && b && a != b);
        OK(cuMemFreeAsync(a, st));
        OK(cuMemFreeAsync(b, st));
    }

    // ---- a pool of one's own: its freed blocks stay mapped and serve later buffers that fit
    {
        CUmemoryPool pool;
        OK(cuMemPoolCreate(&pool, nullptr));
        CUdeviceptr a, b, c, gone;
        OK(cuMemAllocFromPoolAsync(&a, 100, pool, st));
        OK(cuMemsetD8Async(a, 7, 100, st));
        OK(cuMemFreeAsync(a, st));
        CHECK(cuMemFreeAsync(a, st) == 1);  // twice
        OK(cuMemsetD8Async(a, 9, 100, st));  // still mapped, as a graph recorded with it needs
        OK(cuMemAllocFromPoolAsync(&b, 97, pool, st));
        CHECK(b == a);  // the freed block of the same size (in 16 bytes), taken again
        for (unsigned char x : download<unsigned char>(b, 97)) CHECK(x == 0xff);  // poisoned again
        // The block's padded extent (112 bytes), not its buffer's length: a graph recorded with
        // the block's first buffer still writes that one's 100 bytes, as on a GPU.
        OK(cuMemsetD8Async(b, 0, 112, st));
        CHECK(cuMemsetD8Async(b, 0, 113, st) == 1);  // past the block
        OK(cuMemAllocFromPoolAsync(&c, 64, pool, st));
        CHECK(c != a);  // a block of another size is not taken
        OK(cuMemFreeAsync(c, st));
        OK(cuMemPoolDestroy(pool));
        CHECK(cuMemPoolDestroy(pool) == 400);
        CHECK(cuMemAllocFromPoolAsync(&gone, 16, pool, st) == 400);
        CHECK(cuMemsetD8Async(c, 0, 16, st) == 1);  // a free block: released with the pool
        OK(cuMemsetD8Async(b, 0, 97, st));  // still allocated: kept
        OK(cuMemFreeAsync(b, st));
        CHECK(cuMemsetD8Async(b, 0, 97, st) == 1);  // the pool's last block, released now
    }

    // ---- modules
    std::vector<char> so = read_file(argv[1]);
    std::vector<char> img = wrap(so);
    CUmodule mod;
    CHECK(cuModuleLoadData(&mod, "// PTX\n.version 8.0\n") == 200);
    std::vector<char> elf(so.begin(), so.begin() + 64);  // an ELF image, as a real CUBIN is
    CHECK(cuModuleLoadData(&mod, elf.data()) == 200);
    OK(cuModuleLoadData(&mod, img.data()));
    CUfunction add_one, add_one2, fail, write_at, nothing;
    CHECK(cuModuleGetFunction(&add_one, mod, "missing") == 500);
    OK(cuModuleGetFunction(&add_one, mod, "add_one"));
    OK(cuModuleGetFunction(&add_one2, mod, "add_one"));
    CHECK(add_one == add_one2);
    OK(cuModuleGetFunction(&fail, mod, "fail"));
    OK(cuModuleGetFunction(&write_at, mod, "write_at"));
    OK(cuModuleGetFunction(&nothing, mod, "nothing"));

    // ---- launches
    const int N = 1000;
    std::vector<int> host(N);
    for (int i = 0; i < N; i++) host[i] = i;
    CUdeviceptr d;
    OK(cuMemAllocAsync(&d, N * sizeof(int), st));
    OK(cuMemcpyHtoDAsync_v2(d, host.data(), N * sizeof(int), st));
    int n = N;
    void* args[] = {&d, &n};
    OK(cuLaunchKernel(add_one, 4, 1, 1, 256, 1, 1, 0, st, args, nullptr));
    LaunchAttr attr;
    memset(&attr, 0, sizeof attr);
    attr.id = 6;  // programmatic stream serialization
    attr.value.i = 1;
    LaunchConfig cfg = {4, 1, 1, 256, 1, 1, 0, st, &attr, 1};
    OK(cuLaunchKernelEx(&cfg, add_one, args, nullptr));
    OK(cuMemcpyDtoHAsync_v2(host.data(), d, N * sizeof(int), st));
    OK(cuStreamSynchronize(st));
    for (int i = 0; i < N; i++) CHECK(host[i] == i + 2);
    attr.id = 4;  // a cluster of 2: refused
    attr.value.i = 0;
    unsigned dims[3] = {2, 1, 1};
    memcpy(attr.value.pad, dims, sizeof dims);
    CHECK(cuLaunchKernelEx(&cfg, add_one, args, nullptr) == 801);
    // Cooperative: through the module's cooperative entry point (+100 on p[0]), by either call;
    // a grid that cannot be resident at once is refused (720) and runs nothing.
    memset(&attr, 0, sizeof attr);
    attr.id = 2;
    attr.value.i = 1;
    OK(cuLaunchKernelEx(&cfg, add_one, args, nullptr));
    OK(cuLaunchCooperativeKernel(add_one, 4, 1, 1, 256, 1, 1, 0, st, args));
    LaunchConfig huge = {1u << 16, 1, 1, 1024, 1, 1, 0, st, &attr, 1};
    CHECK(cuLaunchKernelEx(&huge, add_one, args, nullptr) == 720);
    CHECK(cuLaunchCooperativeKernel(add_one, 1u << 16, 1, 1, 1024, 1, 1, 0, st, args) == 720);
    OK(cuMemcpyDtoHAsync_v2(host.data(), d, N * sizeof(int), st));
    OK(cuStreamSynchronize(st));
    for (int i = 0; i < N; i++) CHECK(host[i] == i + 4 + (i == 0 ? 200 : 0));

    CHECK(cuLaunchKernel(fail, 1, 1, 1, 1, 1, 1, 0, st, nullptr, nullptr) == 719);
    OK(cuGetErrorString(719, &s));
    CHECK(contains(s, "deliberate failure"));
    OK(cuGetErrorName(719, &s));
    CHECK(!strcmp(s, "CUDA_ERROR_LAUNCH_FAILED"));
    OK(cuLaunchKernel(nothing, 1, 1, 1, 1, 1, 1, 0, st, nullptr, nullptr));  // the context survives

    // Shared memory and shape limits, as the H200 has them.
    OK(cuFuncGetAttribute(&v, 8, nothing));
    CHECK(v == 49152);
    OK(cuLaunchKernel(nothing, 1, 1, 1, 32, 1, 1, 49152, st, nullptr, nullptr));
    CHECK(cuLaunchKernel(nothing, 1, 1, 1, 32, 1, 1, 49153, st, nullptr, nullptr) == 1);
    OK(cuFuncSetAttribute(nothing, 8, 65536));
    OK(cuLaunchKernel(nothing, 1, 1, 1, 32, 1, 1, 65536, st, nullptr, nullptr));
    CHECK(cuLaunchKernel(nothing, 1, 1, 1, 32, 1, 1, 65537, st, nullptr, nullptr) == 1);
    CHECK(cuFuncSetAttribute(nothing, 8, 232449) == 1);
    OK(cuFuncSetAttribute(nothing, 8, 232448));
    OK(cuLaunchKernel(nothing, 1, 1, 1, 32, 1, 1, 232448, st, nullptr, nullptr));
    CHECK(cuLaunchKernel(nothing, 1, 1, 1, 32, 1, 1, 232449, st, nullptr, nullptr) == 1);
    CHECK(cuLaunchKernel(nothing, 1, 1, 1, 1025, 1, 1, 0, st, nullptr, nullptr) == 1);
    CHECK(cuLaunchKernel(nothing, 1, 1, 1, 1, 1, 65, 0, st, nullptr, nullptr) == 1);
    CHECK(cuLaunchKernel(nothing, 1, 65536, 1, 1, 1, 1, 0, st, nullptr, nullptr) == 1);
    CHECK(cuLaunchKernel(nothing, 0, 1, 1, 1, 1, 1, 0, st, nullptr, nullptr) == 1);
    CHECK(cuLaunchKernel(add_one, 1, 1, 1, 1, 1, 1, 0, st, nullptr, nullptr) == 1);  // parameters missing

    // ---- memsets and copies
    {
        CUdeviceptr a, b;
        OK(cuMemAllocAsync(&a, 64, st));
        OK(cuMemAllocAsync(&b, 64, st));
        OK(cuMemsetD8Async(a, 0xab, 64, st));
        OK(cuMemsetD16Async(a + 16, 0x1234, 8, st));
        OK(cuMemsetD32Async(a + 32, 0xdeadbeef, 8, st));
        OK(cuMemcpyDtoDAsync_v2(b, a, 64, st));
        std::vector<unsigned char> h = download<unsigned char>(b, 64);
        for (int i = 0; i < 16; i++) CHECK(h[i] == 0xab);
        uint16_t h16[8];
        memcpy(h16, &h[16], 16);
        for (uint16_t x : h16) CHECK(x == 0x1234);
        uint32_t h32[8];
        memcpy(h32, &h[32], 32);
        for (uint32_t x : h32) CHECK(x == 0xdeadbeef);
        CHECK(cuMemsetD32Async(a, 0, 17, st) == 1);     // past the end
        CHECK(cuMemsetD32Async(a + 2, 0, 1, st) == 1);  // misaligned
        OK(cuMemsetD32_v2(a, 7, 16));
        CHECK(download<int>(a, 16)[15] == 7);
        OK(cuMemFreeAsync(a, st));
        OK(cuMemFreeAsync(b, st));
        CHECK(cuMemFreeAsync(a, st) == 1);
    }

    // ---- events
    {
        CUevent e0, e1, e2;
        OK(cuEventCreate(&e0, 0));
        OK(cuEventCreate(&e1, 0));
        OK(cuEventCreate(&e2, 2));  // timing disabled
        float ms;
        CHECK(cuEventElapsedTime_v2(&ms, e0, e1) == 400);  // not recorded
        OK(cuEventRecord(e0, st));
        OK(cuLaunchKernel(add_one, 4, 1, 1, 256, 1, 1, 0, st, args, nullptr));
        OK(cuEventRecord(e1, st));
        OK(cuEventRecord(e2, st));
        OK(cuEventSynchronize(e1));
        OK(cuEventQuery(e1));
        OK(cuStreamWaitEvent(st, e1, 0));
        OK(cuEventElapsedTime_v2(&ms, e0, e1));
        CHECK(ms >= 0);
        CHECK(cuEventElapsedTime_v2(&ms, e0, e2) == 400);
        OK(cuEventDestroy_v2(e0));
        OK(cuEventDestroy_v2(e1));
        OK(cuEventDestroy_v2(e2));
        CHECK(cuEventDestroy_v2(e2) == 400);
    }

    // ---- stream capture: recorded, not run; replayed in order
    {
        CUdeviceptr other;
        OK(cuMemAllocAsync(&other, 64, st));
        OK(cuMemsetD32Async(d, 0, N, st));
        OK(cuMemsetD32Async(other, 0, 16, st));
        CUevent ev;
        OK(cuEventCreate(&ev, 0));
        int status;
        OK(cuStreamIsCapturing(st, &status));
        CHECK(status == 0);
        OK(cuStreamBeginCapture_v2(st, 1));
        OK(cuStreamIsCapturing(st, &status));
        CHECK(status == 1);
        int n_local = N;
        void* cargs[] = {&d, &n_local};
        OK(cuLaunchKernel(add_one, 4, 1, 1, 256, 1, 1, 0, st, cargs, nullptr));
        n_local = 0;  // the launch copied its parameters
        OK(cuLaunchKernelEx(&(cfg = LaunchConfig{4, 1, 1, 256, 1, 1, 0, st, nullptr, 0}), add_one, args, nullptr));
        OK(cuMemsetD32Async(other, 5, 8, st));
        OK(cuMemcpyDtoDAsync_v2(other + 32, d, 32, st));
        OK(cuEventRecordWithFlags(ev, st, 1));
        CUgraph g;
        OK(cuStreamEndCapture(st, &g));
        CHECK(g != nullptr);
        CHECK(download<int>(d, N)[0] == 0);  // nothing ran yet
        CUgraphExec ge;
        OK(cuGraphInstantiateWithFlags(&ge, g, 0));
        OK(cuGraphUpload(ge, st));
        OK(cuGraphLaunch(ge, st));
        OK(cuGraphLaunch(ge, st));
        std::vector<int> hd = download<int>(d, N), ho = download<int>(other, 16);
        for (int i = 0; i < N; i++) CHECK(hd[i] == 4);
        for (int i = 0; i < 8; i++) CHECK(ho[i] == 5);
        for (int i = 8; i < 16; i++) CHECK(ho[i] == 4);  // each launch copies after its two kernels
        OK(cuEventQuery(ev));
        OK(cuGraphExecDestroy(ge));
        OK(cuGraphDestroy(g));
        CHECK(cuGraphDestroy(g) == 1);
        OK(cuEventDestroy_v2(ev));
        OK(cuMemFreeAsync(other, st));
    }
    {
        // A cooperative launch recorded into a graph stays cooperative when replayed.
        OK(cuMemsetD32Async(d, 0, N, st));
        OK(cuStreamBeginCapture_v2(st, 1));
        OK(cuLaunchCooperativeKernel(add_one, 4, 1, 1, 256, 1, 1, 0, st, args));
        CUgraph g;
        OK(cuStreamEndCapture(st, &g));
        CUgraphExec ge;
        OK(cuGraphInstantiateWithFlags(&ge, g, 0));
        OK(cuGraphLaunch(ge, st));
        OK(cuGraphLaunch(ge, st));
        std::vector<int> hd = download<int>(d, N);
        for (int i = 0; i < N; i++) CHECK(hd[i] == 2 + (i == 0 ? 200 : 0));
        OK(cuGraphExecDestroy(ge));
        OK(cuGraphDestroy(g));
    }

    // ---- what invalidates a capture
    {
        int status;
        CUgraph g = (CUgraph)1;
        OK(cuStreamBeginCapture_v2(st, 1));
        CHECK(cuStreamBeginCapture_v2(st, 1) == 401);
        CHECK(cuMemcpyHtoDAsync_v2(d, host.data(), 16, st) == 900);
        OK(cuStreamIsCapturing(st, &status));
        CHECK(status == 2);
        CHECK(cuLaunchKernel(add_one, 4, 1, 1, 256, 1, 1, 0, st, args, nullptr) == 901);
        CHECK(cuStreamEndCapture(st, &g) == 901);
        CHECK(g == nullptr);
        OK(cuMemcpyHtoDAsync_v2(d, host.data(), 16, st));  // the stream works again

        OK(cuStreamBeginCapture_v2(st, 1));
        CHECK(cuStreamSynchronize(st) == 900);
        CHECK(cuStreamEndCapture(st, &g) == 901);

        OK(cuStreamBeginCapture_v2(st, 1));
        CUdeviceptr p;
        CHECK(cuMemAlloc_v2(&p, 16) == 900);  // not stream-ordered: unsafe while this thread captures
        CHECK(cuCtxSynchronize() == 900);
        CHECK(cuStreamEndCapture(st, &g) == 901);

        OK(cuStreamBeginCapture_v2(st, 2));  // relaxed: the same calls are allowed
        OK(cuMemAlloc_v2(&p, 16));
        OK(cuMemFree_v2(p));
        OK(cuStreamEndCapture(st, &g));
        OK(cuGraphDestroy(g));

        CHECK(cuStreamBeginCapture_v2(nullptr, 1) == 900);  // the legacy stream cannot capture
        CHECK(cuStreamEndCapture(st, &g) == 401);
    }

    // ---- graph memory: stream-ordered allocation inside a capture
    {
        OK(cuMemGetInfo_v2(&free0, &total));
        CUdeviceptr out;
        OK(cuMemAllocAsync(&out, N * sizeof(int), st));
        OK(cuStreamBeginCapture_v2(st, 1));
        CUdeviceptr tmp;
        OK(cuMemAllocAsync(&tmp, N * sizeof(int), st));
        OK(cuMemsetD32Async(tmp, 10, N, st));
        void* targs[] = {&tmp, &n};
        OK(cuLaunchKernel(add_one, 4, 1, 1, 256, 1, 1, 0, st, targs, nullptr));
        OK(cuMemcpyDtoDAsync_v2(out, tmp, N * sizeof(int), st));
        OK(cuMemFreeAsync(tmp, st));
        CUgraph g;
        OK(cuStreamEndCapture(st, &g));
        int h;
        CHECK(cuMemcpyDtoH_v2(&h, tmp, 4) == 1);  // not allocated until a launch reaches its alloc node
        CUgraphExec ge, ge2;
        OK(cuGraphInstantiateWithFlags(&ge, g, 0));
        CHECK(cuGraphInstantiateWithFlags(&ge2, g, 0) == 801);  // memory nodes: one executable at a time
        for (int rep = 0; rep < 3; rep++) {
            OK(cuGraphLaunch(ge, st));
            std::vector<int> ho = download<int>(out, N);
            for (int i = 0; i < N; i++) CHECK(ho[i] == 11);
            CHECK(cuMemcpyDtoH_v2(&h, tmp, 4) == 1);  // freed by the graph again
        }
        OK(cuGraphExecDestroy(ge));
        OK(cuGraphDestroy(g));
        OK(cuMemFreeAsync(out, st));
        OK(cuMemGetInfo_v2(&free_bytes, &total));
        CHECK(free_bytes == free0);

        // An allocation the graph hands out (no free node) must be freed before the next launch.
        OK(cuStreamBeginCapture_v2(st, 1));
        OK(cuMemAllocAsync(&tmp, 64, st));
        OK(cuMemsetD32Async(tmp, 3, 16, st));
        OK(cuStreamEndCapture(st, &g));
        OK(cuGraphInstantiateWithFlags(&ge, g, 0));
        OK(cuGraphLaunch(ge, st));
        CHECK(download<int>(tmp, 16)[15] == 3);
        CHECK(cuGraphLaunch(ge, st) == 1);
        OK(cuMemFreeAsync(tmp, st));
        CHECK(cuMemFreeAsync(tmp, st) == 1);
        OK(cuGraphLaunch(ge, st));
        OK(cuGraphExecDestroy(ge));
        OK(cuGraphDestroy(g));  // the live allocation outlives its graph
        CHECK(download<int>(tmp, 16)[0] == 3);
        OK(cuMemFreeAsync(tmp, st));
        OK(cuMemGetInfo_v2(&free_bytes, &total));
        CHECK(free_bytes == free0);

        // A recorded free of memory allocated outside the recording frees it when the graph
        // runs; a second launch finds nothing to free.
        CUdeviceptr outside;
        OK(cuMemAllocAsync(&outside, 64, st));
        OK(cuStreamBeginCapture_v2(st, 1));
        OK(cuMemFreeAsync(outside, st));
        OK(cuStreamEndCapture(st, &g));
        CHECK(download<int>(outside, 1)[0] == -1);  // still allocated (and poisoned)
        OK(cuGraphInstantiateWithFlags(&ge, g, 0));
        OK(cuGraphLaunch(ge, st));
        CHECK(cuMemcpyDtoH_v2(&h, outside, 4) == 1);
        CHECK(cuGraphLaunch(ge, st) == 1);
        OK(cuGraphExecDestroy(ge));
        OK(cuGraphDestroy(g));
        OK(cuMemGetInfo_v2(&free_bytes, &total));
        CHECK(free_bytes == free0);

        CHECK(cuGraphInstantiateWithFlags(&ge, g, 0) == 1);  // destroyed
        OK(cuStreamBeginCapture_v2(st, 1));
        OK(cuStreamEndCapture(st, &g));
        CHECK(cuGraphInstantiateWithFlags(&ge, g, 1 | 4) == 1);  // auto-free with device launch
        OK(cuGraphDestroy(g));
    }

    // ---- faults: a kernel past the end of a buffer, before its start, in freed graph memory,
    // and outside any allocation
    {
        std::string err;
        int status = in_child(
            [&] {
                long long i = N;  // 4000 bytes: the end is the guard page
                int val = 1;
                void* a[] = {&d, &i, &val};
                cuLaunchKernel(write_at, 1, 1, 1, 1, 1, 1, 0, st, a, nullptr);
            },
            &err);
        if (getenv("SELFTEST_VERBOSE")) fprintf(stderr, "child status %d: %s", status, err.c_str());
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 101);
        CHECK(contains(err, "hostcuda: kernel write_at (block (0,0,0) thread (0,0,0)) touched "));
        CHECK(contains(err, ", 0 bytes past the end of an allocation of 4000 bytes at "));
        // The buffer sits at the end of its pages: an access before its start faults once it
        // leaves them, 4 bytes before the first page here.
        const long long offset = (long long)(d % (unsigned long long)page);
        status = in_child(
            [&] {
                long long i = -offset / 4 - 1;
                int val = 1;
                void* a[] = {&d, &i, &val};
                cuLaunchKernel(write_at, 1, 1, 1, 1, 1, 1, 0, st, a, nullptr);
            },
            &err);
        if (getenv("SELFTEST_VERBOSE")) fprintf(stderr, "child status %d: %s", status, err.c_str());
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 101);
        CHECK(contains(err, (", " + std::to_string(offset + 4) + " bytes before an allocation of 4000 bytes at ").c_str()));
        status = in_child(
            [&] {
                OK(cuStreamBeginCapture_v2(st, 1));
                CUdeviceptr tmp;
                OK(cuMemAllocAsync(&tmp, 64, st));
                OK(cuMemFreeAsync(tmp, st));
                CUgraph g;
                OK(cuStreamEndCapture(st, &g));
                long long i = 0;
                int val = 1;
                void* a[] = {&tmp, &i, &val};
                cuLaunchKernel(write_at, 1, 1, 1, 1, 1, 1, 0, st, a, nullptr);
            },
            &err);
        if (getenv("SELFTEST_VERBOSE")) fprintf(stderr, "child status %d: %s", status, err.c_str());
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 101);
        CHECK(contains(err, "that its graph has freed"));
        status = in_child(
            [&] {
                CUdeviceptr gone;
                OK(cuMemAlloc_v2(&gone, 256));
                OK(cuMemFree_v2(gone));
                int h;
                CHECK(cuMemcpyDtoH_v2(&h, gone + 8, 4) == 1);
                long long i = 3;
                int val = 1;
                void* a[] = {&gone, &i, &val};
                cuLaunchKernel(write_at, 1, 1, 1, 1, 1, 1, 0, st, a, nullptr);
            },
            &err);
        if (getenv("SELFTEST_VERBOSE")) fprintf(stderr, "child status %d: %s", status, err.c_str());
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 101);
        CHECK(contains(err, "lies in an allocation of 256 bytes at "));
        CHECK(contains(err, ", 12 bytes into an allocation of 256 bytes at "));
        CHECK(contains(err, " that was freed (a use after free)"));
        status = in_child(
            [&] {
                CUdeviceptr bad = 64;
                long long i = 0;
                int val = 1;
                void* a[] = {&bad, &i, &val};
                cuLaunchKernel(write_at, 1, 1, 1, 1, 1, 1, 0, st, a, nullptr);
            },
            &err);
        if (getenv("SELFTEST_VERBOSE")) fprintf(stderr, "child status %d: %s", status, err.c_str());
        CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGSEGV);
        CHECK(contains(err, "hostcuda: kernel write_at (block (0,0,0) thread (0,0,0)) faulted at 0x40"));
    }

    // ---- modules outlive their unload while a graph launches their kernels
    {
        OK(cuMemsetD32Async(d, 0, N, st));
        OK(cuStreamBeginCapture_v2(st, 1));
        OK(cuLaunchKernel(add_one, 4, 1, 1, 256, 1, 1, 0, st, args, nullptr));
        CUgraph g;
        OK(cuStreamEndCapture(st, &g));
        CUgraphExec ge;
        OK(cuGraphInstantiateWithFlags(&ge, g, 0));
        OK(cuModuleUnload(mod));
        CHECK(cuLaunchKernel(add_one, 4, 1, 1, 256, 1, 1, 0, st, args, nullptr) == 400);
        CHECK(cuModuleUnload(mod) == 400);
        OK(cuGraphLaunch(ge, st));
        CHECK(download<int>(d, N)[N - 1] == 1);
        OK(cuGraphExecDestroy(ge));
        OK(cuGraphDestroy(g));
    }

    // ---- cuBLAS
    {
        cublasHandle_t h;
        OK(cublasCreate_v2(&h));
        OK(cublasSetStream_v2(h, st));
        unsigned seed = 12345;
        auto rnd = [&] {
            seed = seed * 1103515245u + 12345u;
            return ((seed >> 8) & 0xffff) / 32768.0f - 1.0f;
        };
        // tern's call: Y[rows][out] = X·Wᵀ as C (m = out, n = rows) = Wᵀ(T)·X(N), k = in;
        // here with leading dimensions larger than the shapes.
        for (int type : {0, 14}) {
            const int m = 37, nn = 13, k = 70, lda = k + 3, ldb = k + 1, ldc = m + 2;
            std::vector<float> a((size_t)lda * m), b((size_t)ldb * nn), c((size_t)ldc * nn, NAN), want = c;
            for (float& x : a) x = type == 14 ? from_bf16(to_bf16(rnd())) : rnd();
            for (float& x : b) x = type == 14 ? from_bf16(to_bf16(rnd())) : rnd();
            CUdeviceptr da, db, dc;
            if (type == 14) {
                std::vector<uint16_t> a16(a.size()), b16(b.size());
                for (size_t i = 0; i < a.size(); i++) a16[i] = to_bf16(a[i]);
                for (size_t i = 0; i < b.size(); i++) b16[i] = to_bf16(b[i]);
                da = upload(a16.data(), a16.size() * 2);
                db = upload(b16.data(), b16.size() * 2);
            } else {
                da = upload(a.data(), a.size() * 4);
                db = upload(b.data(), b.size() * 4);
            }
            dc = upload(c.data(), c.size() * 4);  // NaN: beta == 0 must not read it
            float alpha = 1, beta = 0;
            OK(cublasGemmEx(h, 1, 0, m, nn, k, &alpha, (void*)da, type, lda, (void*)db, type, ldb, &beta, (void*)dc, 0, ldc,
                            68, -1));
            ref_gemm(1, 0, m, nn, k, 1, a, lda, b, ldb, 0, want, ldc);
            std::vector<float> got = download<float>(dc, c.size());
            for (int j = 0; j < nn; j++)
                for (int i = 0; i < m; i++) CHECK(got[(size_t)j * ldc + i] == want[(size_t)j * ldc + i]);
            for (int j = 0; j < nn; j++)
                for (int i = m; i < ldc; i++) CHECK(isnan(got[(size_t)j * ldc + i]));  // padding untouched
            CHECK(cublasGemmEx(h, 1, 0, m, nn, k, &alpha, (void*)da, type, lda, (void*)db, type == 0 ? 14 : 0, ldb, &beta,
                               (void*)dc, 0, ldc, 68, -1) == 15);  // mixed operand types
            CHECK(cublasGemmEx(h, 1, 0, m, nn, k, &alpha, (void*)da, type, lda, (void*)db, type, ldb, &beta, (void*)dc, 0,
                               ldc, 70, -1) == 15);  // 64-bit compute
            CHECK(cublasGemmEx(h, 1, 0, m, nn, k, &alpha, (void*)da, type, k - 1, (void*)db, type, ldb, &beta, (void*)dc, 0,
                               ldc, 68, -1) == 7);  // lda < k
            OK(cuMemFree_v2(da));
            OK(cuMemFree_v2(db));
            OK(cuMemFree_v2(dc));
        }
        // Every transpose, alpha and beta.
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++) {
                const int m = 9, nn = 6, k = 11, lda = (ta ? k : m) + 1, ldb = (tb ? nn : k) + 2, ldc = m;
                std::vector<float> a((size_t)lda * (ta ? m : k)), b((size_t)ldb * (tb ? k : nn)), c((size_t)ldc * nn);
                for (float& x : a) x = rnd();
                for (float& x : b) x = rnd();
                for (float& x : c) x = rnd();
                std::vector<float> want = c;
                CUdeviceptr da = upload(a.data(), a.size() * 4), db = upload(b.data(), b.size() * 4),
                            dc = upload(c.data(), c.size() * 4);
                float alpha = 2, beta = 0.5f;
                OK(cublasSgemm_v2(h, ta, tb, m, nn, k, &alpha, (float*)da, lda, (float*)db, ldb, &beta, (float*)dc, ldc));
                ref_gemm(ta, tb, m, nn, k, 2, a, lda, b, ldb, 0.5f, want, ldc);
                std::vector<float> got = download<float>(dc, c.size());
                for (size_t i = 0; i < got.size(); i++) CHECK(got[i] == want[i]);
                OK(cuMemFree_v2(da));
                OK(cuMemFree_v2(db));
                OK(cuMemFree_v2(dc));
            }
        // Strided batches, device-pointer scalars, and a product recorded into a graph.
        {
            const int m = 5, nn = 4, k = 3, batch = 3;
            std::vector<float> a(m * k * batch), b(k * nn * batch), c(m * nn * batch, NAN), want(c.size(), 0);
            for (float& x : a) x = rnd();
            for (float& x : b) x = rnd();
            CUdeviceptr da = upload(a.data(), a.size() * 4), db = upload(b.data(), b.size() * 4),
                        dc = upload(c.data(), c.size() * 4);
            float scalars[2] = {1, 0};
            CUdeviceptr ds = upload(scalars, 8);
            OK(cublasSetPointerMode_v2(h, 1));
            OK(cuStreamBeginCapture_v2(st, 1));
            OK(cublasGemmStridedBatchedEx(h, 0, 0, m, nn, k, (void*)ds, (void*)da, 0, m, m * k, (void*)db, 0, k, k * nn,
                                          (void*)(ds + 4), (void*)dc, 0, m, m * nn, batch, 68, -1));
            CUgraph g;
            OK(cuStreamEndCapture(st, &g));
            OK(cublasSetPointerMode_v2(h, 0));
            CHECK(isnan(download<float>(dc, 1)[0]));  // recorded, not run
            CUgraphExec ge;
            OK(cuGraphInstantiateWithFlags(&ge, g, 0));
            OK(cuGraphLaunch(ge, st));
            for (int i = 0; i < batch; i++) {
                std::vector<float> ai(a.begin() + i * m * k, a.begin() + (i + 1) * m * k),
                    bi(b.begin() + i * k * nn, b.begin() + (i + 1) * k * nn), ci(m * nn);
                ref_gemm(0, 0, m, nn, k, 1, ai, m, bi, k, 0, ci, m);
                std::copy(ci.begin(), ci.end(), want.begin() + i * m * nn);
            }
            std::vector<float> got = download<float>(dc, c.size());
            for (size_t i = 0; i < got.size(); i++) CHECK(got[i] == want[i]);
            OK(cuGraphExecDestroy(ge));
            // The handle has no workspace: the captured product took one, an allocation
            // before it and a free after it (CUgraphNodeType 10, host function 3, 11).
            auto node_types = [](CUgraph graph) {
                size_t n = 0;
                OK(cuGraphGetNodes(graph, nullptr, &n));
                std::vector<void*> nodes(n);
                OK(cuGraphGetNodes(graph, nodes.data(), &n));
                std::vector<int> types(n);
                for (size_t i = 0; i < n; i++) OK(cuGraphNodeGetType(nodes[i], &types[i]));
                return types;
            };
            CHECK((node_types(g) == std::vector<int>{10, 3, 11}));
            OK(cuGraphDestroy(g));
            // With a workspace of its own, the captured product is its one node.
            CUdeviceptr ws = upload(c.data(), 64);
            OK(cublasSetWorkspace_v2(h, (void*)ws, 64));
            OK(cuStreamBeginCapture_v2(st, 1));
            float one = 1, zero = 0;
            OK(cublasGemmEx(h, 0, 0, m, nn, k, &one, (void*)da, 0, m, (void*)db, 0, k, &zero, (void*)dc, 0, m, 68, -1));
            OK(cuStreamEndCapture(st, &g));
            CHECK((node_types(g) == std::vector<int>{3}));
            OK(cuGraphDestroy(g));
            OK(cublasSetWorkspace_v2(h, nullptr, 0));
            OK(cuMemFree_v2(ws));
            // An operand past its buffer: the product fails, naming it, instead of reading on.
            float alpha = 1, beta = 0;
            CHECK(cublasGemmEx(h, 0, 0, m, nn, k + 1, &alpha, (void*)da, 0, m, (void*)db, 0, k + 1, &beta,
                               (void*)dc, 0, m, 68, -1) == 0);
            CHECK(cublasGemmEx(h, 0, 0, m, nn * batch, k, &alpha, (void*)da, 0, m, (void*)db, 0, k + 10, &beta,
                               (void*)dc, 0, m, 68, -1) == 13);
            OK(cuMemFree_v2(da));
            OK(cuMemFree_v2(db));
            OK(cuMemFree_v2(dc));
            OK(cuMemFree_v2(ds));
        }
        OK(cublasDestroy_v2(h));
        CHECK(cublasDestroy_v2(h) == 1);
    }

    OK(cuMemFreeAsync(d, st));
    OK(cuStreamDestroy_v2(st));
    OK(cuDevicePrimaryCtxRelease_v2(0));
    printf("driver_selftest: %d checks passed\n", g_checks);
    return 0;
}

#endif
