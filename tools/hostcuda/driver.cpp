// hostcuda's driver: the CUDA driver API entry points tern calls (through cudarc), executed on
// the CPU, so that tern's device tests check the kernels' logic (indexing, warp exchanges,
// shared memory, tensor-core fragment layouts) on machines without a GPU. It presents one
// device, an sm_90 part shaped like an H200 (132 multiprocessors, 227 KiB of opt-in shared
// memory a block, 139 GiB of memory), and runs the real kernel sources, which hostcuda's NVRTC
// (nvrtc.cpp) turns into host shared objects.
//
// What it models:
// - Device memory is host memory: a device pointer is a host address. Every allocation is its
//   own mapping with a PROT_NONE page on either side, the buffer's end flush (to 16 bytes)
//   against the page after it, so a kernel that reads or writes past the end of a buffer (or
//   before its start) faults at once and the fault handler names the kernel, the address and
//   the allocation. Freed memory stays mapped inaccessible for the next 4096 frees, so a use
//   after free faults and is named as one. New allocations are filled with 0xff bytes (NaN as
//   f32), so a read of memory nobody wrote shows (HOSTCUDA_POISON=0 leaves them zeroed).
// - Streams run each operation when it is queued, on the calling thread, in issue order, so
//   everything queued before an operation has finished when it starts; synchronizing waits for
//   nothing. Events record the wall-clock time of their record.
// - Stream capture records kernels, memsets, device copies, stream-ordered allocations and
//   frees, event records and host functions (cuBLAS products among them) into a graph instead
//   of running them, as the real driver does, and refuses what it refuses: a host<->device copy
//   or a synchronization of the capturing stream, or a "potentially unsafe" call (a synchronous
//   allocation, free, copy or context synchronization) under the capture-mode rules, fails and
//   invalidates the capture. A graph launch replays its list in order.
// - The device supports memory pools, so cudarc allocates and frees stream-ordered
//   (cuMemAllocAsync, cuMemFreeAsync), as on the H200; that is what lets a recorded step
//   allocate and free its temporaries: inside a capture they become the graph's memory nodes.
//   Memory a graph allocates keeps its address across replays and is inaccessible (PROT_NONE)
//   between its free node and the next launch's alloc node, so a use after free faults.
//   Pools of one's own (cuMemPoolCreate) keep their freed blocks mapped and hand them to later
//   allocations of the same size, as a GPU's pool with its release threshold at the maximum does (tern's
//   step pools; PoolOfOwn), so buffers freed and taken again alias as they do there.
// - A kernel launch is checked as the H200 checks it (block and grid limits; dynamic shared
//   memory above 48 KiB only after CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES was raised
//   to cover it, never above 227 KiB) and then run to completion by the module's
//   tern_host_launch, its blocks one after another; a cooperative launch (refused, as on the
//   H200, when its blocks could not all be resident) by tern_host_launch_cooperative, every
//   block's threads together, so that a grid barrier works. A launch the kernel side reports as failed
//   (a deadlock, a misaligned access, ...) returns CUDA_ERROR_LAUNCH_FAILED from that call; the
//   message goes to stderr and is what cuGetErrorString gives for that code afterwards. Unlike
//   on a GPU the context stays usable after such an error.
// Not modelled: time (kernels take no time that means anything), concurrency between streams
// or between blocks (races between blocks go unseen, since blocks run one after another),
// programmatic dependent launch (accepted: each kernel has finished before the next starts,
// which satisfies the dependency; a captured kernel's edge from the kernel before it is typed
// programmatic, as the driver records it, for cuGraphGetEdges_v2), and clusters (refused).
//
// The module image contract with nvrtc.cpp: 16 bytes of magic ("TERNHOSTCUDA" and 4 zero
// bytes), a little-endian u64 length N, then N bytes of an ELF shared object exporting
//   int tern_host_has_kernel(const char* name);
//   int tern_host_kernel_params(const char* name, unsigned* sizes, unsigned max);
//   int tern_host_launch(const char* name, const unsigned grid[3], const unsigned block[3],
//                        unsigned dynamic_smem, void** params, char* err, unsigned errlen);
//   int tern_host_launch_cooperative(...the same...);   (optional: without it, cooperative launches are refused)
// and optionally `const char* tern_host_fault_where(void)`, which, when a kernel faults on a
// guard page, says where (block and thread) for the fault report.
//
// No NVIDIA header is included: the types below follow cudarc's bindings (driver/sys/mod.rs,
// CUDA 13.0), field for field where a layout matters. Every CUresult returned is one of the
// codes those bindings list, since cudarc converts the value into a Rust enum.

#include <algorithm>
#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

struct CUctx_st;
struct CUstream_st;
struct CUevent_st;
struct CUmod_st;
struct CUfunc_st;
struct CUgraph_st;
struct CUgraphExec_st;
struct CUmemPoolHandle_st;
typedef CUctx_st* CUcontext;
typedef CUstream_st* CUstream;
typedef CUevent_st* CUevent;
typedef CUmod_st* CUmodule;
typedef CUfunc_st* CUfunction;
typedef CUgraph_st* CUgraph;
typedef CUgraphExec_st* CUgraphExec;
typedef CUmemPoolHandle_st* CUmemoryPool;
typedef void* CUgraphNode;
typedef void (*CUhostFn)(void* user_data);
typedef void (*CUstreamCallback)(CUstream stream, CUresult status, void* user_data);

// CUlaunchAttributeValue: a 64-byte union whose largest members hold pointers (8-byte aligned).
union CUlaunchAttributeValue {
    char pad[64];
    int i;
    unsigned u;
    struct {
        unsigned x, y, z;
    } dim;
    struct {
        CUevent event;
        int flags;
        int triggerAtBlockStart;
    } programmaticEvent;
    struct {
        CUevent event;
        int flags;
    } launchCompletionEvent;
    void* align_;
};
struct CUlaunchAttribute {
    int id;
    char pad[4];
    CUlaunchAttributeValue value;
};
struct CUlaunchConfig {
    unsigned gridDimX, gridDimY, gridDimZ;
    unsigned blockDimX, blockDimY, blockDimZ;
    unsigned sharedMemBytes;
    CUstream hStream;
    CUlaunchAttribute* attrs;
    unsigned numAttrs;
};
static_assert(sizeof(CUlaunchAttribute) == 72, "CUlaunchAttribute layout");
static_assert(sizeof(CUlaunchConfig) == 56, "CUlaunchConfig layout");

struct CUuuid {
    char bytes[16];
};
// CUmemLocation: { CUmemLocationType type; int id; }
struct CUmemLocation {
    int type;
    int id;
};

namespace {

// ---- codes ------------------------------------------------------------------------------------

enum : int {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_NOT_INITIALIZED = 3,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_FILE_NOT_FOUND = 301,
    CUDA_ERROR_OPERATING_SYSTEM = 304,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_ILLEGAL_STATE = 401,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_NOT_READY = 600,
    CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED = 712,
    CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED = 713,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE = 720,
    CUDA_ERROR_NOT_PERMITTED = 800,
    CUDA_ERROR_NOT_SUPPORTED = 801,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901,
    CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD = 908,
    CUDA_ERROR_CAPTURED_EVENT = 907,
};

enum {
    CAPTURE_MODE_GLOBAL = 0,
    CAPTURE_MODE_THREAD_LOCAL = 1,
    CAPTURE_MODE_RELAXED = 2,
};
enum {
    CAPTURE_STATUS_NONE = 0,
    CAPTURE_STATUS_ACTIVE = 1,
    CAPTURE_STATUS_INVALIDATED = 2,
};

constexpr unsigned EVENT_DISABLE_TIMING = 2;
constexpr unsigned EVENT_RECORD_EXTERNAL = 1;
constexpr unsigned long long INSTANTIATE_AUTO_FREE_ON_LAUNCH = 1;
constexpr unsigned long long INSTANTIATE_UPLOAD = 2;
constexpr unsigned long long INSTANTIATE_DEVICE_LAUNCH = 4;
constexpr unsigned long long INSTANTIATE_USE_NODE_PRIORITY = 8;

constexpr int FUNC_ATTR_MAX_THREADS_PER_BLOCK = 0;
constexpr int FUNC_ATTR_SHARED_SIZE_BYTES = 1;
constexpr int FUNC_ATTR_CONST_SIZE_BYTES = 2;
constexpr int FUNC_ATTR_LOCAL_SIZE_BYTES = 3;
constexpr int FUNC_ATTR_NUM_REGS = 4;
constexpr int FUNC_ATTR_PTX_VERSION = 5;
constexpr int FUNC_ATTR_BINARY_VERSION = 6;
constexpr int FUNC_ATTR_CACHE_MODE_CA = 7;
constexpr int FUNC_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8;
constexpr int FUNC_ATTR_PREFERRED_SHARED_MEMORY_CARVEOUT = 9;
constexpr int FUNC_ATTR_MAX = 16;

// The H200's limits.
constexpr unsigned kSharedDefault = 48 * 1024;  // dynamic shared memory without the opt-in
constexpr unsigned kSharedOptin = 232448;       // 227 KiB: the most a block may have
constexpr unsigned kSharedPerSm = 233472;       // 228 KiB
constexpr unsigned kMultiprocessors = 132;
constexpr unsigned long long kTotalMem = 139ull << 30;
constexpr int kDriverVersion = 13000;
const char kDeviceName[] = "hostcuda (CPU emulation of an sm_90 device)";

// ---- state ------------------------------------------------------------------------------------

// One lock for all driver state. It is held while an operation executes (a kernel, a copy), so
// the device runs one operation at a time, and the allocation table is never changed while
// a kernel runs: the fault handler reads it without the lock.
std::recursive_mutex g_mu;
using Lock = std::lock_guard<std::recursive_mutex>;

// Read without the lock by entry points that only check it.
std::atomic<bool> g_initialized{false};
bool g_poison = true;
size_t g_page = 4096;
unsigned long long g_next_id = 1;

double now_ms() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

// What runs now, for the fault handler: a kernel's name (kernel true) or a driver operation's.
volatile const char* g_op_name = nullptr;
volatile bool g_op_is_kernel = false;
const char* (*volatile g_op_where)() = nullptr;

struct OpScope {
    OpScope(const char* name, bool kernel, const char* (*where)() = nullptr) {
        g_op_name = name;
        g_op_is_kernel = kernel;
        g_op_where = where;
    }
    ~OpScope() {
        g_op_name = nullptr;
        g_op_is_kernel = false;
        g_op_where = nullptr;
    }
};

// Messages handed out by cuGetErrorString for CUDA_ERROR_LAUNCH_FAILED: kept for the life of
// the process, since a caller may hold the pointer.
const char* g_launch_failure = nullptr;

void report(const char* fmt, ...) __attribute__((format(printf, 1, 2)));
void report(const char* fmt, ...) {
    char buf[2048];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    fprintf(stderr, "hostcuda: %s\n", buf);
    fflush(stderr);
}

// ---- memory -----------------------------------------------------------------------------------

struct GraphBody;

// A device allocation: a mapping of [guard page][data pages][guard page], the buffer at the end
// of the data pages. `live` is false only for memory a graph owns while the graph holds it
// freed (between its free node and the next alloc node); its pages are PROT_NONE then.
struct PoolOfOwn;
struct Alloc {
    char* map;
    size_t map_len;
    char* ptr;
    size_t size;
    size_t data_len;  // bytes of data pages
    bool live;
    GraphBody* owner;  // the graph whose capture allocated it, or null
    // A block of a pool of one's own (cuMemPoolCreate), or null; while `pool_free` it is back
    // in its pool, still mapped (a graph recorded with it keeps writing it, as on a GPU).
    PoolOfOwn* pool = nullptr;
    bool pool_free = false;
};

// A memory pool of one's own: its blocks stay mapped when freed and serve later allocations
// of the same size (rounded to 16 bytes, so that the guard page stays flush with the buffer's
// end), so buffers freed and taken again alias as on the GPU, where such a pool keeps its
// memory (tern's step pools set the release threshold to its maximum). A free block is
// poisoned again when taken and at every graph launch, so a recorded step that reads one of
// its buffers before writing it reads poison at every replay, as a graph's own allocation
// does. A range check takes a block's padded size (alloc_holding): a graph recorded with an
// earlier buffer of the block still writes that buffer's length, so an overrun of a pool
// buffer by less than its padding passes unseen. Destroying it unmaps the free blocks; a block still allocated is unmapped when it is
// freed, as the driver defers the release until then.
struct PoolOfOwn {
    std::vector<Alloc*> free_blocks;
    bool destroyed = false;
};
std::vector<PoolOfOwn*> g_own_pools;

void poison_free_pool_blocks() {
    if (!g_poison) return;
    for (PoolOfOwn* pool : g_own_pools)
        for (Alloc* a : pool->free_blocks)
            if (a->size) memset(a->ptr, 0xff, a->size);
}

// By buffer start. Mappings are disjoint and each holds its buffer, so this order is also the
// mappings' order, which lets the fault handler find the mapping of an address.
std::map<uintptr_t, Alloc*> g_allocs;
size_t g_allocated = 0;

// Page-locked host memory and registered host ranges: device-accessible under unified
// addressing, so copies and memsets accept them as device ranges too.
std::map<uintptr_t, size_t> g_host_allocs;
std::map<uintptr_t, size_t> g_host_registered;

size_t round_up(size_t n, size_t to) { return (n + to - 1) / to * to; }

CUresult map_alloc(size_t size, GraphBody* owner, Alloc** out) {
    if (size > kTotalMem || g_allocated + size > kTotalMem) return CUDA_ERROR_OUT_OF_MEMORY;
    // 16-byte aligned start, end as close to the guard page as that alignment allows.
    const size_t padded = round_up(size, 16);
    const size_t data_len = round_up(padded, g_page);
    const size_t map_len = data_len + 2 * g_page;
    void* m = mmap(nullptr, map_len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    char* map = static_cast<char*>(m);
    if (data_len && mprotect(map + g_page, data_len, PROT_READ | PROT_WRITE) != 0) {
        munmap(map, map_len);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    Alloc* a = new Alloc{map, map_len, map + g_page + data_len - padded, size, data_len, true, owner};
    if (g_poison && size) memset(a->ptr, 0xff, size);
    g_allocs[reinterpret_cast<uintptr_t>(a->ptr)] = a;
    g_allocated += size;
    *out = a;
    return CUDA_SUCCESS;
}

// Freed allocations keep their addresses for a while, inaccessible (their pages returned to
// the system), so that a use after free faults and is reported as such instead of reaching
// whatever a later allocation placed there. The oldest are unmapped past kQuarantine.
struct Freed {
    char* map;
    size_t map_len;
    char* ptr;
    size_t size;
};
constexpr size_t kQuarantine = 4096;
Freed g_freed[kQuarantine];
size_t g_freed_count = 0;  // entries ever freed; the ring holds the last kQuarantine

void unmap_alloc(Alloc* a) {
    g_allocs.erase(reinterpret_cast<uintptr_t>(a->ptr));
    g_allocated -= a->size;
    Freed& slot = g_freed[g_freed_count % kQuarantine];
    if (g_freed_count >= kQuarantine) munmap(slot.map, slot.map_len);
    // A fresh PROT_NONE mapping over the old one drops its pages but keeps the range.
    if (mmap(a->map, a->map_len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_FIXED, -1, 0) ==
        MAP_FAILED) {
        munmap(a->map, a->map_len);
        slot = Freed{nullptr, 0, nullptr, 0};
    } else {
        slot = Freed{a->map, a->map_len, a->ptr, a->size};
    }
    g_freed_count++;
    delete a;
}

// The freed allocation (still quarantined) whose mapping holds address a, or null.
const Freed* freed_mapping_of(uintptr_t a) {
    size_t n = g_freed_count < kQuarantine ? g_freed_count : kQuarantine;
    // Newest first: an address can only be in one quarantined mapping, but say the latest.
    for (size_t i = 0; i < n; i++) {
        const Freed& f = g_freed[(g_freed_count - 1 - i) % kQuarantine];
        uintptr_t m = reinterpret_cast<uintptr_t>(f.map);
        if (f.map && a >= m && a < m + f.map_len) return &f;
    }
    return nullptr;
}

void set_live(Alloc* a, bool live) {
    if (a->data_len) mprotect(a->map + g_page, a->data_len, live ? PROT_READ | PROT_WRITE : PROT_NONE);
    a->live = live;
}

Alloc* alloc_at(CUdeviceptr p) {
    auto it = g_allocs.find(static_cast<uintptr_t>(p));
    return it == g_allocs.end() ? nullptr : it->second;
}

// The allocation whose buffer holds [p, p + n), live or not.
Alloc* alloc_holding(uintptr_t p, size_t n) {
    auto it = g_allocs.upper_bound(p);
    if (it == g_allocs.begin()) return nullptr;
    --it;
    Alloc* a = it->second;
    uintptr_t start = reinterpret_cast<uintptr_t>(a->ptr);
    // A pool block serves every buffer of its padded size (PoolOfOwn), and graphs recorded
    // with an earlier, longer buffer in it still reach its padded end, as on a GPU: its extent.
    const size_t extent = a->pool ? round_up(a->size, 16) : a->size;
    if (p - start > extent || n > extent - (p - start)) return nullptr;
    return a;
}

bool host_range_holds(const std::map<uintptr_t, size_t>& m, uintptr_t p, size_t n) {
    auto it = m.upper_bound(p);
    if (it == m.begin()) return false;
    --it;
    return p - it->first <= it->second && n <= it->second - (p - it->first);
}

// Checks that [p, p + n) is device-accessible memory: inside one live allocation or inside
// page-locked or registered host memory.
CUresult check_device_range(const char* op, const char* which, CUdeviceptr p, size_t n) {
    if (n == 0) return CUDA_SUCCESS;
    uintptr_t u = static_cast<uintptr_t>(p);
    if (Alloc* a = alloc_holding(u, n)) {
        if (a->live) return CUDA_SUCCESS;
        report("%s: %s range [0x%llx, +%zu) lies in an allocation of %zu bytes at %p that its graph has freed", op,
               which, p, n, a->size, (void*)a->ptr);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (host_range_holds(g_host_allocs, u, n) || host_range_holds(g_host_registered, u, n)) return CUDA_SUCCESS;
    if (const Freed* f = freed_mapping_of(u)) {
        report("%s: %s range [0x%llx, +%zu) lies in an allocation of %zu bytes at %p that was freed", op, which, p, n,
               f->size, (void*)f->ptr);
        return CUDA_ERROR_INVALID_VALUE;
    }
    // Say which allocation it overlaps, if any: the usual mistake is a length past the end.
    auto it = g_allocs.upper_bound(u);
    if (it != g_allocs.begin()) {
        Alloc* a = std::prev(it)->second;
        uintptr_t start = reinterpret_cast<uintptr_t>(a->ptr);
        if (u >= start && u - start <= a->size) {
            report("%s: %s range [0x%llx, +%zu) runs %zu bytes past the end of an allocation of %zu bytes at %p", op,
                   which, p, n, (size_t)(u + n - start - a->size), a->size, (void*)a->ptr);
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    report("%s: %s range [0x%llx, +%zu) is not device memory", op, which, p, n);
    return CUDA_ERROR_INVALID_VALUE;
}

// ---- fault handler ----------------------------------------------------------------------------

struct sigaction g_prev_segv, g_prev_bus;

// The allocation whose mapping (guard pages included) holds address a. Reads g_allocs without
// the lock: see g_mu.
Alloc* mapping_of(uintptr_t a) {
    auto it = g_allocs.upper_bound(a);
    if (it != g_allocs.end()) {
        Alloc* next = it->second;
        uintptr_t m = reinterpret_cast<uintptr_t>(next->map);
        if (a >= m && a < m + next->map_len) return next;
    }
    if (it != g_allocs.begin()) {
        Alloc* prev = std::prev(it)->second;
        uintptr_t m = reinterpret_cast<uintptr_t>(prev->map);
        if (a >= m && a < m + prev->map_len) return prev;
    }
    return nullptr;
}

void write_err(const char* s) {
    size_t n = strlen(s);
    while (n) {
        ssize_t w = write(2, s, n);
        if (w <= 0) break;
        s += w;
        n -= (size_t)w;
    }
}

void on_fault(int sig, siginfo_t* si, void* uctx) {
    (void)uctx;
    uintptr_t a = reinterpret_cast<uintptr_t>(si->si_addr);
    const char* name = const_cast<const char*>(g_op_name);
    const char* kind = g_op_is_kernel ? "kernel " : "";
    const char* (*where)() = g_op_where;
    const char* at = where ? where() : nullptr;
    char who[512];
    if (name)
        snprintf(who, sizeof who, "%s%s%s%s%s", kind, name, at ? " (" : "", at ? at : "", at ? ")" : "");
    else
        snprintf(who, sizeof who, "host code outside any operation");
    char msg[1024];
    if (si->si_code > 0) {
        if (Alloc* al = mapping_of(a)) {
            uintptr_t start = reinterpret_cast<uintptr_t>(al->ptr);
            if (a >= start + al->size)
                snprintf(msg, sizeof msg,
                         "hostcuda: %s touched %p, %zu bytes past the end of an allocation of %zu bytes at %p\n", who,
                         (void*)a, (size_t)(a - start - al->size), al->size, (void*)al->ptr);
            else if (a < start)
                snprintf(msg, sizeof msg,
                         "hostcuda: %s touched %p, %zu bytes before an allocation of %zu bytes at %p\n", who,
                         (void*)a, (size_t)(start - a), al->size, (void*)al->ptr);
            else
                snprintf(msg, sizeof msg,
                         "hostcuda: %s touched %p, %zu bytes into an allocation of %zu bytes at %p that its graph "
                         "has freed\n",
                         who, (void*)a, (size_t)(a - start), al->size, (void*)al->ptr);
            write_err(msg);
            _exit(101);
        }
        if (const Freed* f = freed_mapping_of(a)) {
            uintptr_t start = reinterpret_cast<uintptr_t>(f->ptr);
            if (a >= start + f->size)
                snprintf(msg, sizeof msg,
                         "hostcuda: %s touched %p, %zu bytes past the end of an allocation of %zu bytes at %p that "
                         "was freed\n",
                         who, (void*)a, (size_t)(a - start - f->size), f->size, (void*)f->ptr);
            else if (a < start)
                snprintf(msg, sizeof msg,
                         "hostcuda: %s touched %p, %zu bytes before an allocation of %zu bytes at %p that was freed\n",
                         who, (void*)a, (size_t)(start - a), f->size, (void*)f->ptr);
            else
                snprintf(msg, sizeof msg,
                         "hostcuda: %s touched %p, %zu bytes into an allocation of %zu bytes at %p that was freed (a "
                         "use after free)\n",
                         who, (void*)a, (size_t)(a - start), f->size, (void*)f->ptr);
            write_err(msg);
            _exit(101);
        }
        if (name) {
            snprintf(msg, sizeof msg, "hostcuda: %s faulted at %p (signal %d), in no device allocation\n", who,
                     (void*)a, sig);
            write_err(msg);
        }
    }
    // Not ours: hand the signal back to whoever handled it before (Rust's stack-overflow
    // handler, or the default action). Returning re-executes the faulting access under it; a
    // signal that did not come from an access is raised again.
    sigaction(sig, sig == SIGSEGV ? &g_prev_segv : &g_prev_bus, nullptr);
    if (si->si_code <= 0) raise(sig);
}

void install_fault_handler() {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &g_prev_segv);
    sigaction(SIGBUS, &sa, &g_prev_bus);
}

// The handler runs on an alternate stack, so that a fault that is a stack overflow (a kernel
// thread's fiber stack) can still be reported. Rust gives its threads one; others get ours.
void ensure_alt_stack() {
    static thread_local bool done = false;
    if (done) return;
    done = true;
    stack_t cur;
    if (sigaltstack(nullptr, &cur) == 0 && !(cur.ss_flags & SS_DISABLE) && cur.ss_sp) return;
    const size_t size = 64 * 1024;
    void* sp = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (sp == MAP_FAILED) return;
    stack_t st;
    st.ss_sp = sp;
    st.ss_size = size;
    st.ss_flags = 0;
    sigaltstack(&st, nullptr);
}

// ---- contexts, modules, functions, events -----------------------------------------------------

}  // namespace

struct CUctx_st {
    bool primary;
    unsigned flags;
    unsigned long long id;
};

namespace {

CUctx_st g_primary{true, 0, 0};
int g_primary_refs = 0;
std::set<CUctx_st*> g_contexts{&g_primary};
thread_local std::vector<CUctx_st*> tl_ctx;

CUctx_st* current_ctx() { return tl_ctx.empty() ? nullptr : tl_ctx.back(); }

}  // namespace

struct CUmod_st {
    void* dl;
    int (*has_kernel)(const char*);
    int (*kernel_params)(const char*, unsigned*, unsigned);
    int (*launch)(const char*, const unsigned*, const unsigned*, unsigned, void**, char*, unsigned);
    int (*launch_cooperative)(const char*, const unsigned*, const unsigned*, unsigned, void**, char*, unsigned);
    const char* (*fault_where)();
    std::map<std::string, CUfunc_st*> funcs;
    int refs;  // the handle's, plus one per graph node of its functions
    bool unloaded;
};

struct CUfunc_st {
    CUmod_st* mod;
    std::string name;
    std::vector<unsigned> param_sizes;
    int max_dynamic_smem;
    int carveout;
};

struct CUevent_st {
    unsigned flags;
    bool recorded;
    bool captured;  // last recorded in a capturing stream: not a point in time the host can wait for
    double ms;
    int refs;  // the handle's, plus one per graph node that records it
};

namespace {

std::set<CUmod_st*> g_modules;
std::set<CUfunc_st*> g_funcs;
std::set<CUevent_st*> g_events;

void module_unref(CUmod_st* m) {
    if (--m->refs > 0) return;
    for (auto& f : m->funcs) {
        g_funcs.erase(f.second);
        delete f.second;
    }
    dlclose(m->dl);
    g_modules.erase(m);
    delete m;
}

void event_unref(CUevent_st* e) {
    if (--e->refs == 0) delete e;
}

// ---- graphs -----------------------------------------------------------------------------------

enum NodeKind { N_KERNEL, N_MEMSET, N_MEMCPY, N_ALLOC, N_FREE, N_EVENT, N_HOST, N_CHILD };

struct Node {
    NodeKind kind;
    // kernel
    CUfunc_st* func = nullptr;
    unsigned grid[3] = {1, 1, 1}, block[3] = {1, 1, 1}, smem = 0;
    bool cooperative = false;
    // launched with programmatic stream serialization: captured as a programmatic edge from a
    // kernel just before it (cuGraphGetEdges_v2)
    bool programmatic = false;
    std::vector<char> args;  // the parameters' bytes, copied at capture
    std::vector<size_t> offsets;
    // memset / memcpy
    CUdeviceptr dst = 0, src = 0;
    size_t count = 0;  // memset: elements; memcpy: bytes
    unsigned value = 0, elem = 1;
    // alloc: the graph's own allocation; free: `dst` is the address freed, looked up when the
    // node runs, since the allocation may be an ordinary one that is gone by then
    Alloc* alloc = nullptr;
    // event record
    CUevent_st* event = nullptr;
    // host operation (returns a CUresult); release frees data when the graph goes
    int (*fn)(void*) = nullptr;
    void* data = nullptr;
    void (*release)(void*) = nullptr;
    const char* what = nullptr;
    // child graph
    std::shared_ptr<GraphBody> child;
};

// What a captured graph holds; shared by the graph and its executable (the executable keeps
// it even when the graph is destroyed first). Its memory nodes' allocations belong to it.
struct GraphBody {
    std::vector<Node> nodes;
    std::vector<Alloc*> owned;
    int execs = 0;
    ~GraphBody() {
        for (Node& n : nodes) {
            if (n.kind == N_KERNEL) module_unref(n.func->mod);
            if (n.kind == N_EVENT) event_unref(n.event);
            if (n.kind == N_HOST && n.release) n.release(n.data);
        }
        for (Alloc* a : owned) {
            // Memory the graph allocated and handed out (its last launch left it live) outlives
            // the graph, as graph memory does: it becomes an ordinary allocation.
            if (a->live && g_allocs.count(reinterpret_cast<uintptr_t>(a->ptr)))
                a->owner = nullptr;
            else
                unmap_alloc(a);
        }
    }
    bool has_memory_nodes() const {
        for (const Node& n : nodes)
            if (n.kind == N_ALLOC || n.kind == N_FREE) return true;
        return false;
    }
};

}  // namespace

struct CUgraph_st {
    std::shared_ptr<GraphBody> body;
};

struct CUgraphExec_st {
    std::shared_ptr<GraphBody> body;
    unsigned long long flags;
};

struct Capture {
    CUgraph_st* graph;
    int mode;
    pthread_t thread;
    bool invalidated;
    unsigned long long id;
};

struct CUstream_st {
    CUctx_st* ctx;
    unsigned flags;
    int priority;
    unsigned long long id;
    Capture* capture;
};

namespace {

std::set<CUgraph_st*> g_graphs;
std::set<CUgraphExec_st*> g_execs;
std::set<CUstream_st*> g_streams;
// The NULL stream, CU_STREAM_LEGACY and CU_STREAM_PER_THREAD: never captured here.
CUstream_st g_legacy{&g_primary, 0, 0, 0, nullptr};

thread_local int tl_capture_mode = CAPTURE_MODE_GLOBAL;

CUresult get_stream(CUstream h, CUstream_st** out) {
    uintptr_t v = reinterpret_cast<uintptr_t>(h);
    if (v == 0 || v == 1 || v == 2) {
        *out = &g_legacy;
        return CUDA_SUCCESS;
    }
    if (!g_streams.count(h)) return CUDA_ERROR_INVALID_HANDLE;
    *out = h;
    return CUDA_SUCCESS;
}

void invalidate(Capture* c, const char* why) {
    if (!c->invalidated) report("stream capture invalidated: %s", why);
    c->invalidated = true;
}

// A "potentially unsafe" call (one that synchronizes with the device or allocates or frees
// outside stream order) is refused while the calling thread takes part in a capture, under the
// capture-mode rules: the thread's own non-relaxed captures, and other threads' global ones
// unless this thread exchanged its mode. Refusing invalidates those captures, as on a GPU.
CUresult check_unsafe(const char* what) {
    if (tl_capture_mode == CAPTURE_MODE_RELAXED) return CUDA_SUCCESS;
    pthread_t self = pthread_self();
    CUresult r = CUDA_SUCCESS;
    for (CUstream_st* s : g_streams) {
        Capture* c = s->capture;
        if (!c) continue;
        bool mine = pthread_equal(c->thread, self);
        if ((mine && c->mode != CAPTURE_MODE_RELAXED) ||
            (!mine && c->mode == CAPTURE_MODE_GLOBAL && tl_capture_mode == CAPTURE_MODE_GLOBAL)) {
            char why[256];
            snprintf(why, sizeof why, "%s while a stream is capturing", what);
            invalidate(c, why);
            r = CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
        }
    }
    return r;
}

// ---- execution --------------------------------------------------------------------------------

CUresult run_kernel(CUfunc_st* f, const unsigned grid[3], const unsigned block[3], unsigned smem, void** params, bool cooperative) {
    ensure_alt_stack();
    char err[2048];
    err[0] = 0;
    int rc;
    {
        OpScope op(f->name.c_str(), true, f->mod->fault_where);
        rc = (cooperative ? f->mod->launch_cooperative : f->mod->launch)(f->name.c_str(), grid, block, smem, params, err, sizeof err);
    }
    if (rc == 0) return CUDA_SUCCESS;
    err[sizeof err - 1] = 0;
    std::string msg = err[0] ? std::string(err) : "kernel " + f->name + " failed (no message)";
    report("%s", msg.c_str());
    g_launch_failure = strdup(("unspecified launch failure: " + msg).c_str());
    return CUDA_ERROR_LAUNCH_FAILED;
}

CUresult run_memset(CUdeviceptr dst, unsigned value, unsigned elem, size_t count, const char* what) {
    CUresult r = check_device_range(what, "destination", dst, count * elem);
    if (r) return r;
    ensure_alt_stack();
    OpScope op(what, false);
    char* p = reinterpret_cast<char*>(static_cast<uintptr_t>(dst));
    if (elem == 1) {
        memset(p, (int)(value & 0xff), count);
    } else if (elem == 2) {
        uint16_t v = (uint16_t)value;
        for (size_t i = 0; i < count; i++) memcpy(p + 2 * i, &v, 2);
    } else {
        uint32_t v = value;
        for (size_t i = 0; i < count; i++) memcpy(p + 4 * i, &v, 4);
    }
    return CUDA_SUCCESS;
}

CUresult run_dtod(CUdeviceptr dst, CUdeviceptr src, size_t bytes, const char* what) {
    CUresult r = check_device_range(what, "source", src, bytes);
    if (!r) r = check_device_range(what, "destination", dst, bytes);
    if (r) return r;
    ensure_alt_stack();
    OpScope op(what, false);
    memmove(reinterpret_cast<void*>(static_cast<uintptr_t>(dst)), reinterpret_cast<void*>(static_cast<uintptr_t>(src)),
            bytes);
    return CUDA_SUCCESS;
}

void record_event(CUevent_st* e) {
    e->recorded = true;
    e->captured = false;
    e->ms = now_ms();
}

CUresult run_body(GraphBody& b, bool auto_free);

CUresult run_node(Node& n, bool auto_free) {
    switch (n.kind) {
        case N_KERNEL: {
            std::vector<void*> ptrs(n.offsets.size());
            for (size_t i = 0; i < n.offsets.size(); i++) ptrs[i] = n.args.data() + n.offsets[i];
            return run_kernel(n.func, n.grid, n.block, n.smem, ptrs.data(), n.cooperative);
        }
        case N_MEMSET:
            return run_memset(n.dst, n.value, n.elem, n.count, n.what);
        case N_MEMCPY:
            return run_dtod(n.dst, n.src, n.count, n.what);
        case N_ALLOC: {
            Alloc* a = n.alloc;
            if (a->live && !auto_free) {
                report("graph launch: the allocation of %zu bytes at %p that the graph's previous launch made has not "
                       "been freed (free it, or instantiate with CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH)",
                       a->size, (void*)a->ptr);
                return CUDA_ERROR_INVALID_VALUE;
            }
            if (!a->live) {
                set_live(a, true);
                if (g_poison && a->size) memset(a->ptr, 0xff, a->size);
            }
            return CUDA_SUCCESS;
        }
        case N_FREE: {
            Alloc* a = alloc_at(n.dst);
            if (!a || !a->live) {
                report("graph launch: a free node frees 0x%llx, which is not allocated now", n.dst);
                return CUDA_ERROR_INVALID_VALUE;
            }
            if (a->owner)
                set_live(a, false);
            else
                unmap_alloc(a);
            return CUDA_SUCCESS;
        }
        case N_EVENT:
            record_event(n.event);
            return CUDA_SUCCESS;
        case N_HOST: {
            ensure_alt_stack();
            OpScope op(n.what ? n.what : "host function", false);
            return n.fn(n.data);
        }
        case N_CHILD:
            return run_body(*n.child, auto_free);
    }
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult run_body(GraphBody& b, bool auto_free) {
    for (Node& n : b.nodes) {
        CUresult r = run_node(n, auto_free);
        if (r) return r;
    }
    return CUDA_SUCCESS;
}

// The capture a stream operation goes into, or null to run it now; *err says the stream cannot
// take it (its capture was invalidated).
Capture* capturing(CUstream_st* s, CUresult* err) {
    *err = CUDA_SUCCESS;
    Capture* c = s->capture;
    if (c && c->invalidated) *err = CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    return c;
}

// A host<->device copy on a capturing stream: the real driver refuses it (a graph cannot own
// pageable host memory) and the capture is lost.
CUresult refuse_in_capture(Capture* c, const char* what) {
    char why[128];
    snprintf(why, sizeof why, "%s on the capturing stream", what);
    invalidate(c, why);
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
}

#define INIT_CHECK()                                       \
    do {                                                   \
        if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED; \
    } while (0)

#define CTX_CHECK()                                        \
    do {                                                   \
        if (!g_initialized) return CUDA_ERROR_NOT_INITIALIZED; \
        if (!current_ctx()) return CUDA_ERROR_INVALID_CONTEXT; \
    } while (0)

// ---- launches ---------------------------------------------------------------------------------

CUresult check_launch(CUfunc_st* f, const unsigned grid[3], const unsigned block[3], unsigned smem) {
    const char* n = f->name.c_str();
    if (!grid[0] || !grid[1] || !grid[2] || !block[0] || !block[1] || !block[2]) {
        report("launch of %s: a zero dimension (grid %u,%u,%u, block %u,%u,%u)", n, grid[0], grid[1], grid[2],
               block[0], block[1], block[2]);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (grid[0] > 0x7fffffffu || grid[1] > 65535 || grid[2] > 65535) {
        report("launch of %s: grid %u,%u,%u exceeds the device's 2147483647,65535,65535", n, grid[0], grid[1],
               grid[2]);
        return CUDA_ERROR_INVALID_VALUE;
    }
    unsigned long long threads = (unsigned long long)block[0] * block[1] * block[2];
    if (block[0] > 1024 || block[1] > 1024 || block[2] > 64 || threads > 1024) {
        report("launch of %s: block %u,%u,%u exceeds the device's 1024 threads (1024,1024,64)", n, block[0],
               block[1], block[2]);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (smem > kSharedOptin) {
        report("launch of %s: %u bytes of dynamic shared memory exceed the device's %u a block", n, smem,
               kSharedOptin);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (smem > (unsigned)f->max_dynamic_smem) {
        report("launch of %s: %u bytes of dynamic shared memory exceed the function's limit of %d "
               "(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES)",
               n, smem, f->max_dynamic_smem);
        return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

// Blocks of `block_size` threads and `smem` bytes of dynamic shared memory a multiprocessor
// holds: plausible figures for the H200 (registers are not counted). cuOccupancy* report them,
// and a cooperative launch larger than they allow is refused, as on the device.
static int blocks_per_sm(int block_size, size_t smem) {
    if (block_size <= 0 || block_size > 1024) return 0;
    int warps = (block_size + 31) / 32;
    int by_threads = 64 / warps;
    int by_smem = (int)(kSharedPerSm / (smem + 1024));
    int n = by_threads < by_smem ? by_threads : by_smem;
    return n < 32 ? n : 32;
}

CUresult launch(CUfunction f, const unsigned grid[3], const unsigned block[3], unsigned smem, CUstream hs,
                void** params, void** extra, const CUlaunchAttribute* attrs, unsigned nattrs) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!g_funcs.count(f) || f->mod->unloaded) return CUDA_ERROR_INVALID_HANDLE;
    CUstream_st* s;
    if (CUresult r = get_stream(hs, &s)) return r;
    if (extra && !params) {
        report("launch of %s: parameters through `extra` are not supported; pass kernelParams", f->name.c_str());
        return CUDA_ERROR_NOT_SUPPORTED;
    }
    if (!params && !f->param_sizes.empty()) return CUDA_ERROR_INVALID_VALUE;
    std::vector<CUevent_st*> completion_events;
    bool cooperative = false, programmatic = false;
    for (unsigned i = 0; i < nattrs; i++) {
        const CUlaunchAttribute& a = attrs[i];
        switch (a.id) {
            case 0:   // ignore
            case 1:   // access policy window
            case 3:   // synchronization policy
            case 5:   // cluster scheduling policy
            case 8:   // priority
            case 9:   // mem sync domain map
            case 10:  // mem sync domain
            case 13:  // device-updatable kernel node
            case 14:  // preferred shared memory carveout
            case 16:  // NVLink-utilization-centric scheduling
                break;
            case 7:   // programmatic event: triggered when the kernel is done at the latest
            case 12:  // launch completion event
                if (a.value.programmaticEvent.event) {
                    if (!g_events.count(a.value.programmaticEvent.event)) return CUDA_ERROR_INVALID_HANDLE;
                    completion_events.push_back(a.value.programmaticEvent.event);
                }
                break;
            case 2:  // cooperative: every block resident at once (checked below)
                cooperative = a.value.i != 0;
                break;
            case 6:  // programmatic stream serialization: kernels run to completion in order
                     // anyway; recorded for the captured edge's type
                programmatic = a.value.i != 0;
                break;
            case 4:   // cluster dimension
            case 11:  // preferred cluster dimension
                if (a.value.dim.x * a.value.dim.y * a.value.dim.z > 1) {
                    report("launch of %s: thread block clusters are not supported", f->name.c_str());
                    return CUDA_ERROR_NOT_SUPPORTED;
                }
                break;
            default:
                return CUDA_ERROR_INVALID_VALUE;
        }
    }
    if (CUresult r = check_launch(f, grid, block, smem)) return r;
    if (cooperative) {
        // As the driver does: a grid whose blocks cannot all be resident together is refused
        // (its grid barrier would never be met), by the occupancy cuOccupancy* reports.
        const unsigned long long threads = (unsigned long long)block[0] * block[1] * block[2];
        const unsigned long long fit = (unsigned long long)blocks_per_sm((int)threads, smem) * kMultiprocessors;
        if ((unsigned long long)grid[0] * grid[1] * grid[2] > fit) {
            report("cooperative launch of %s: %u x %u x %u blocks, but only %llu fit on the device at once", f->name.c_str(),
                   grid[0], grid[1], grid[2], fit);
            return CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE;
        }
        if (!f->mod->launch_cooperative) {
            report("cooperative launch of %s: its module has no tern_host_launch_cooperative", f->name.c_str());
            return CUDA_ERROR_NOT_SUPPORTED;
        }
    }
    CUresult err;
    if (Capture* c = capturing(s, &err)) {
        if (err) return err;
        Node n;
        n.kind = N_KERNEL;
        n.func = f;
        memcpy(n.grid, grid, sizeof n.grid);
        memcpy(n.block, block, sizeof n.block);
        n.smem = smem;
        n.cooperative = cooperative;
        n.programmatic = programmatic;
        size_t total = 0;
        for (unsigned sz : f->param_sizes) {
            n.offsets.push_back(total);
            total += round_up(sz ? sz : 1, 16);  // 16-aligned, as a kernel may read a parameter as a vector
        }
        n.args.assign(total, 0);
        for (size_t i = 0; i < f->param_sizes.size(); i++) memcpy(n.args.data() + n.offsets[i], params[i], f->param_sizes[i]);
        f->mod->refs++;
        GraphBody& b = *c->graph->body;
        b.nodes.push_back(std::move(n));
        for (CUevent_st* e : completion_events) {
            Node en;
            en.kind = N_EVENT;
            en.event = e;
            e->refs++;
            b.nodes.push_back(std::move(en));
        }
        return CUDA_SUCCESS;
    }
    CUresult r = run_kernel(f, grid, block, smem, params, cooperative);
    if (!r)
        for (CUevent_st* e : completion_events) record_event(e);
    return r;
}

// ---- error strings ----------------------------------------------------------------------------

struct ErrorText {
    int code;
    const char* name;
    const char* text;
};

const ErrorText kErrors[] = {
    {0, "CUDA_SUCCESS", "no error"},
    {1, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {2, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {3, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {4, "CUDA_ERROR_DEINITIALIZED", "driver shutting down"},
    {5, "CUDA_ERROR_PROFILER_DISABLED", "profiler disabled while using external profiling tool"},
    {6, "CUDA_ERROR_PROFILER_NOT_INITIALIZED", "profiler not initialized: call cudaProfilerInitialize()"},
    {7, "CUDA_ERROR_PROFILER_ALREADY_STARTED", "profiler already started"},
    {8, "CUDA_ERROR_PROFILER_ALREADY_STOPPED", "profiler already stopped"},
    {34, "CUDA_ERROR_STUB_LIBRARY", "CUDA driver is a stub library"},
    {36, "CUDA_ERROR_CALL_REQUIRES_NEWER_DRIVER", "API call requires a newer CUDA driver"},
    {46, "CUDA_ERROR_DEVICE_UNAVAILABLE", "CUDA-capable device(s) is/are busy or unavailable"},
    {100, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {101, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {102, "CUDA_ERROR_DEVICE_NOT_LICENSED", "device doesn't have valid Grid license"},
    {200, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {201, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {202, "CUDA_ERROR_CONTEXT_ALREADY_CURRENT", "context already current"},
    {205, "CUDA_ERROR_MAP_FAILED", "mapping of buffer object failed"},
    {206, "CUDA_ERROR_UNMAP_FAILED", "unmapping of buffer object failed"},
    {207, "CUDA_ERROR_ARRAY_IS_MAPPED", "array is mapped"},
    {208, "CUDA_ERROR_ALREADY_MAPPED", "resource already mapped"},
    {209, "CUDA_ERROR_NO_BINARY_FOR_GPU", "no kernel image is available for execution on the device"},
    {210, "CUDA_ERROR_ALREADY_ACQUIRED", "resource already acquired"},
    {211, "CUDA_ERROR_NOT_MAPPED", "resource not mapped"},
    {212, "CUDA_ERROR_NOT_MAPPED_AS_ARRAY", "resource not mapped as array"},
    {213, "CUDA_ERROR_NOT_MAPPED_AS_POINTER", "resource not mapped as pointer"},
    {214, "CUDA_ERROR_ECC_UNCORRECTABLE", "uncorrectable ECC error encountered"},
    {215, "CUDA_ERROR_UNSUPPORTED_LIMIT", "limit is not supported on this architecture"},
    {216, "CUDA_ERROR_CONTEXT_ALREADY_IN_USE", "exclusive-thread device already in use by a different thread"},
    {217, "CUDA_ERROR_PEER_ACCESS_UNSUPPORTED", "peer access is not supported between these two devices"},
    {218, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {219, "CUDA_ERROR_INVALID_GRAPHICS_CONTEXT", "invalid OpenGL or DirectX context"},
    {220, "CUDA_ERROR_NVLINK_UNCORRECTABLE", "uncorrectable NVLink error detected during the execution"},
    {221, "CUDA_ERROR_JIT_COMPILER_NOT_FOUND", "PTX JIT compiler library not found"},
    {222, "CUDA_ERROR_UNSUPPORTED_PTX_VERSION", "the provided PTX was compiled with an unsupported toolchain."},
    {223, "CUDA_ERROR_JIT_COMPILATION_DISABLED", "PTX JIT compilation was disabled"},
    {224, "CUDA_ERROR_UNSUPPORTED_EXEC_AFFINITY", "the provided execution affinity is not supported"},
    {225, "CUDA_ERROR_UNSUPPORTED_DEVSIDE_SYNC", "the provided PTX contains unsupported call to cudaDeviceSynchronize"},
    {226, "CUDA_ERROR_CONTAINED", "a contained error occurred"},
    {300, "CUDA_ERROR_INVALID_SOURCE", "device kernel image is invalid"},
    {301, "CUDA_ERROR_FILE_NOT_FOUND", "file not found"},
    {302, "CUDA_ERROR_SHARED_OBJECT_SYMBOL_NOT_FOUND", "shared object symbol not found"},
    {303, "CUDA_ERROR_SHARED_OBJECT_INIT_FAILED", "shared object initialization failed"},
    {304, "CUDA_ERROR_OPERATING_SYSTEM", "OS call failed or operation not supported on this OS"},
    {400, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {401, "CUDA_ERROR_ILLEGAL_STATE", "the operation cannot be performed in the present state"},
    {402, "CUDA_ERROR_LOSSY_QUERY", "attempted introspection would be semantically lossy"},
    {500, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {600, "CUDA_ERROR_NOT_READY", "device not ready"},
    {700, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {701, "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "too many resources requested for launch"},
    {702, "CUDA_ERROR_LAUNCH_TIMEOUT", "the launch timed out and was terminated"},
    {703, "CUDA_ERROR_LAUNCH_INCOMPATIBLE_TEXTURING", "launch uses incompatible texturing mode"},
    {704, "CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED", "peer access is already enabled"},
    {705, "CUDA_ERROR_PEER_ACCESS_NOT_ENABLED", "peer access has not been enabled"},
    {708, "CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE", "cannot set while device is active in this process"},
    {709, "CUDA_ERROR_CONTEXT_IS_DESTROYED", "context is destroyed"},
    {710, "CUDA_ERROR_ASSERT", "device-side assert triggered"},
    {711, "CUDA_ERROR_TOO_MANY_PEERS", "peer mapping resources exhausted"},
    {712, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", "part or all of the requested memory range is already mapped"},
    {713, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", "pointer does not correspond to a registered memory region"},
    {714, "CUDA_ERROR_HARDWARE_STACK_ERROR", "hardware stack error"},
    {715, "CUDA_ERROR_ILLEGAL_INSTRUCTION", "an illegal instruction was encountered"},
    {716, "CUDA_ERROR_MISALIGNED_ADDRESS", "misaligned address"},
    {717, "CUDA_ERROR_INVALID_ADDRESS_SPACE", "operation not supported on global/shared address space"},
    {718, "CUDA_ERROR_INVALID_PC", "invalid program counter"},
    {719, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {720, "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE", "too many blocks in cooperative launch"},
    {721, "CUDA_ERROR_TENSOR_MEMORY_LEAK", "tensor memory not completely freed"},
    {800, "CUDA_ERROR_NOT_PERMITTED", "operation not permitted"},
    {801, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
    {802, "CUDA_ERROR_SYSTEM_NOT_READY", "system not yet initialized"},
    {803, "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH", "system has unsupported display driver / cuda driver combination"},
    {804, "CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE", "forward compatibility was attempted on non supported HW"},
    {805, "CUDA_ERROR_MPS_CONNECTION_FAILED", "MPS client failed to connect to the MPS control daemon or the MPS server"},
    {806, "CUDA_ERROR_MPS_RPC_FAILURE", "the remote procedural call between the MPS server and the MPS client failed"},
    {807, "CUDA_ERROR_MPS_SERVER_NOT_READY", "MPS server is not ready to accept new MPS client requests"},
    {808, "CUDA_ERROR_MPS_MAX_CLIENTS_REACHED", "the hardware resources required to create MPS client have been exhausted"},
    {809, "CUDA_ERROR_MPS_MAX_CONNECTIONS_REACHED", "the hardware resources required to support device connections have been exhausted"},
    {810, "CUDA_ERROR_MPS_CLIENT_TERMINATED", "the MPS client has been terminated by the server"},
    {811, "CUDA_ERROR_CDP_NOT_SUPPORTED", "the module is using CUDA Dynamic Parallelism, but the current configuration does not support it"},
    {812, "CUDA_ERROR_CDP_VERSION_MISMATCH", "CUDA Dynamic Parallelism versions of the module and the library do not match"},
    {900, "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "operation not permitted when stream is capturing"},
    {901, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", "operation failed due to a previous error during capture"},
    {902, "CUDA_ERROR_STREAM_CAPTURE_MERGE", "operation would result in a merge of separate capture sequences"},
    {903, "CUDA_ERROR_STREAM_CAPTURE_UNMATCHED", "capture was not ended in the same stream as it began"},
    {904, "CUDA_ERROR_STREAM_CAPTURE_UNJOINED", "capturing stream has unjoined work"},
    {905, "CUDA_ERROR_STREAM_CAPTURE_ISOLATION", "dependency created on uncaptured work in another stream"},
    {906, "CUDA_ERROR_STREAM_CAPTURE_IMPLICIT", "operation would make the legacy stream depend on a capturing blocking stream"},
    {907, "CUDA_ERROR_CAPTURED_EVENT", "operation not permitted on an event last recorded in a capturing stream"},
    {908, "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD", "attempt to terminate a thread-local capture sequence from another thread"},
    {909, "CUDA_ERROR_TIMEOUT", "wait operation timed out"},
    {910, "CUDA_ERROR_GRAPH_EXEC_UPDATE_FAILURE", "the graph update was not performed because it included changes which violated constraints specific to instantiated graph update"},
    {911, "CUDA_ERROR_EXTERNAL_DEVICE", "an async error has occurred in external entity outside of CUDA"},
    {912, "CUDA_ERROR_INVALID_CLUSTER_SIZE", "a kernel launch error has occurred due to cluster misconfiguration"},
    {913, "CUDA_ERROR_FUNCTION_NOT_LOADED", "the function handle is not loaded when calling an API that requires a loaded function"},
    {914, "CUDA_ERROR_INVALID_RESOURCE_TYPE", "one or more resources passed in are not valid resource types for the operation"},
    {915, "CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION", "one or more resources are insufficient or non-applicable for the operation"},
    {916, "CUDA_ERROR_KEY_ROTATION", "an error happened during the key rotation sequence"},
    {999, "CUDA_ERROR_UNKNOWN", "unknown error"},
};

const ErrorText* find_error(int code) {
    for (const ErrorText& e : kErrors)
        if (e.code == code) return &e;
    return nullptr;
}

// ---- device attributes ------------------------------------------------------------------------

// H200 (SXM) values; what hostcuda does not run (clusters, cooperative launches) is reported as
// absent so that code that asks takes another path.
bool device_attribute(int attr, int* v) {
    switch (attr) {
        case 1: *v = 1024; return true;            // max threads per block
        case 2: *v = 1024; return true;            // max block dim x
        case 3: *v = 1024; return true;            // y
        case 4: *v = 64; return true;              // z
        case 5: *v = 2147483647; return true;      // max grid dim x
        case 6: *v = 65535; return true;           // y
        case 7: *v = 65535; return true;           // z
        case 8: *v = (int)kSharedDefault; return true;  // shared memory per block
        case 9: *v = 65536; return true;           // constant memory
        case 10: *v = 32; return true;             // warp size
        case 11: *v = 2147483647; return true;     // max pitch
        case 12: *v = 65536; return true;          // registers per block
        case 13: *v = 1980000; return true;        // clock rate, kHz
        case 14: *v = 512; return true;            // texture alignment
        case 15: *v = 1; return true;              // gpu overlap
        case 16: *v = (int)kMultiprocessors; return true;
        case 17: *v = 0; return true;              // kernel exec timeout
        case 18: *v = 0; return true;              // integrated
        case 19: *v = 1; return true;              // can map host memory
        case 20: *v = 0; return true;              // compute mode default
        case 21: *v = 131072; return true;
        case 22: *v = 131072; return true;
        case 23: *v = 65536; return true;
        case 24: case 25: case 26: *v = 16384; return true;
        case 27: case 28: *v = 32768; return true;
        case 29: *v = 2048; return true;
        case 30: *v = 512; return true;            // surface alignment
        case 31: *v = 1; return true;              // concurrent kernels
        case 32: *v = 1; return true;              // ECC
        case 33: *v = 0x19; return true;           // PCI bus id
        case 34: *v = 0; return true;              // PCI device id
        case 35: *v = 0; return true;              // TCC driver
        case 36: *v = 3201000; return true;        // memory clock, kHz
        case 37: *v = 6144; return true;           // memory bus width, bits
        case 38: *v = 52428800; return true;       // L2 cache bytes
        case 39: *v = 2048; return true;           // max threads per multiprocessor
        case 40: *v = 4; return true;              // async engines
        case 41: *v = 1; return true;              // unified addressing
        case 42: *v = 32768; return true;
        case 43: *v = 2048; return true;
        case 44: *v = 1; return true;
        case 45: case 46: *v = 32768; return true;
        case 47: case 48: *v = 8192; return true;
        case 49: *v = 32768; return true;
        case 50: *v = 0; return true;              // PCI domain id
        case 51: *v = 32; return true;             // texture pitch alignment
        case 52: case 53: *v = 32768; return true;
        case 54: *v = 2046; return true;
        case 55: case 56: *v = 32768; return true;
        case 57: *v = 65536; return true;
        case 58: case 59: case 60: *v = 16384; return true;
        case 61: *v = 32768; return true;
        case 62: *v = 2048; return true;
        case 63: case 64: *v = 32768; return true;
        case 65: *v = 2048; return true;
        case 66: case 67: *v = 32768; return true;
        case 68: *v = 2046; return true;
        case 69: *v = 268435456; return true;
        case 70: case 71: *v = 131072; return true;
        case 72: *v = 2097120; return true;
        case 73: case 74: *v = 32768; return true;
        case 75: *v = 9; return true;              // compute capability major
        case 76: *v = 0; return true;              // minor
        case 77: *v = 32768; return true;
        case 78: *v = 1; return true;              // stream priorities
        case 79: case 80: *v = 1; return true;     // L1 caching
        case 81: *v = (int)kSharedPerSm; return true;
        case 82: *v = 65536; return true;          // registers per multiprocessor
        case 83: *v = 1; return true;              // managed memory
        case 84: *v = 0; return true;              // multi-GPU board
        case 85: *v = 0; return true;
        case 86: *v = 0; return true;              // host native atomics
        case 87: *v = 2; return true;              // single to double perf ratio
        case 88: *v = 0; return true;              // pageable memory access
        case 89: *v = 1; return true;              // concurrent managed access
        case 90: *v = 1; return true;              // compute preemption
        case 91: *v = 0; return true;
        case 92: case 93: case 94: *v = 0; return true;
        case 95: *v = 1; return true;              // cooperative launch
        case 96: *v = 0; return true;
        case 97: *v = (int)kSharedOptin; return true;  // shared memory per block, opt-in
        case 98: *v = 1; return true;
        case 99: *v = 1; return true;              // host register
        case 100: *v = 0; return true;
        case 101: *v = 0; return true;
        case 102: *v = 1; return true;             // virtual memory management
        case 103: *v = 1; return true;
        case 104: case 105: *v = 0; return true;
        case 106: *v = 32; return true;            // max blocks per multiprocessor
        case 107: *v = 1; return true;
        case 108: *v = 32505856; return true;      // max persisting L2
        case 109: *v = 134213632; return true;     // max access policy window
        case 110: *v = 1; return true;
        case 111: *v = 1024; return true;          // reserved shared memory per block
        case 112: *v = 1; return true;
        case 113: *v = 1; return true;
        case 114: *v = 1; return true;
        case 115: *v = 1; return true;             // memory pools: stream-ordered allocation
        case 116: *v = 1; return true;
        case 117: *v = 1; return true;
        case 118: *v = 100; return true;
        case 119: *v = 1; return true;             // mempool handle types: POSIX fd
        case 120: *v = 0; return true;             // cluster launch: refused here
        case 121: *v = 1; return true;
        case 122: case 123: *v = 1; return true;
        case 124: *v = 1; return true;
        case 125: *v = 1; return true;
        case 126: *v = 4; return true;             // mem sync domains
        case 127: *v = 1; return true;
        case 128: *v = 0; return true;
        case 129: *v = 0; return true;
        case 130: *v = 0; return true;             // NUMA config
        case 131: *v = -1; return true;            // NUMA id
        case 132: *v = 0; return true;             // multicast
        case 133: *v = 0; return true;             // MPS
        case 134: *v = 0; return true;             // host NUMA id
        case 135: case 138: *v = 0; return true;
        case 136: case 137: *v = 0; return true;
        case 139: *v = 0x233b10de; return true;    // GPU PCI device id (vendor 10de)
        case 140: *v = 0x18b010de; return true;
        case 141: case 142: case 143: *v = 0; return true;
        case 144: case 145: *v = 0; return true;
        case 146: *v = 0; return true;
        case 147: *v = 0; return true;
        default: return false;
    }
}

// ---- module images ----------------------------------------------------------------------------

const char kMagic[16] = {'T', 'E', 'R', 'N', 'H', 'O', 'S', 'T', 'C', 'U', 'D', 'A', 0, 0, 0, 0};

CUresult load_module(CUmodule* out, const void* image) {
    if (!out || !image) return CUDA_ERROR_INVALID_VALUE;
    const unsigned char* p = static_cast<const unsigned char*>(image);
    if (memcmp(p, kMagic, sizeof kMagic) != 0) {
        const char* kind = memcmp(p, "\x7f" "ELF", 4) == 0 ? "an ELF image (a real CUBIN?)" : "not a hostcuda module (PTX?)";
        report("cuModuleLoadData: the image is %s; hostcuda loads only what its own NVRTC (libnvrtc.so of "
               "tools/hostcuda, e.g. through TERN_NVRTC_LIB) produces",
               kind);
        return CUDA_ERROR_INVALID_IMAGE;
    }
    uint64_t n = 0;
    for (int i = 0; i < 8; i++) n |= (uint64_t)p[16 + i] << (8 * i);
    const unsigned char* so = p + 24;
    if (n < 4 || memcmp(so, "\x7f" "ELF", 4) != 0) {
        report("cuModuleLoadData: the hostcuda image does not hold a shared object");
        return CUDA_ERROR_INVALID_IMAGE;
    }
    const char* dir = getenv("TMPDIR");
    if (!dir || !*dir) dir = "/tmp";
    std::string path = std::string(dir) + "/hostcuda-module-XXXXXX";
    std::vector<char> tmpl(path.begin(), path.end());
    tmpl.push_back(0);
    int fd = mkstemp(tmpl.data());
    if (fd < 0) {
        report("cuModuleLoadData: cannot create a file in %s: %s", dir, strerror(errno));
        return CUDA_ERROR_OPERATING_SYSTEM;
    }
    size_t left = n;
    const unsigned char* q = so;
    while (left) {
        ssize_t w = write(fd, q, left);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            report("cuModuleLoadData: writing %s: %s", tmpl.data(), strerror(errno));
            close(fd);
            unlink(tmpl.data());
            return CUDA_ERROR_OPERATING_SYSTEM;
        }
        q += w;
        left -= (size_t)w;
    }
    close(fd);
    void* dl = dlopen(tmpl.data(), RTLD_NOW | RTLD_LOCAL);
    // TERN_HOSTCUDA_KEEP (as for hostcuda's NVRTC) keeps the file, for a debugger to read.
    if (getenv("TERN_HOSTCUDA_KEEP"))
        report("module kept at %s", tmpl.data());
    else
        unlink(tmpl.data());
    if (!dl) {
        report("cuModuleLoadData: dlopen: %s", dlerror());
        return CUDA_ERROR_INVALID_IMAGE;
    }
    CUmod_st* m = new CUmod_st();
    m->dl = dl;
    m->has_kernel = reinterpret_cast<int (*)(const char*)>(dlsym(dl, "tern_host_has_kernel"));
    m->kernel_params = reinterpret_cast<int (*)(const char*, unsigned*, unsigned)>(dlsym(dl, "tern_host_kernel_params"));
    m->launch = reinterpret_cast<int (*)(const char*, const unsigned*, const unsigned*, unsigned, void**, char*, unsigned)>(
        dlsym(dl, "tern_host_launch"));
    m->launch_cooperative = reinterpret_cast<int (*)(const char*, const unsigned*, const unsigned*, unsigned, void**, char*, unsigned)>(
        dlsym(dl, "tern_host_launch_cooperative"));
    m->fault_where = reinterpret_cast<const char* (*)()>(dlsym(dl, "tern_host_fault_where"));
    m->refs = 1;
    m->unloaded = false;
    if (!m->has_kernel || !m->kernel_params || !m->launch) {
        report("cuModuleLoadData: the module lacks tern_host_has_kernel, tern_host_kernel_params or tern_host_launch");
        dlclose(dl);
        delete m;
        return CUDA_ERROR_INVALID_IMAGE;
    }
    g_modules.insert(m);
    *out = m;
    return CUDA_SUCCESS;
}

// ---- stream operations ------------------------------------------------------------------------

CUresult memset_op(CUdeviceptr dst, unsigned value, unsigned elem, size_t count, CUstream hs, bool sync,
                   const char* what) {
    Lock l(g_mu);
    INIT_CHECK();
    CUstream_st* s;
    if (CUresult r = get_stream(hs, &s)) return r;
    if (sync) {
        if (CUresult r = check_unsafe(what)) return r;
    }
    if ((dst % elem) != 0) return CUDA_ERROR_INVALID_VALUE;
    CUresult err;
    if (Capture* c = capturing(s, &err)) {
        if (err) return err;
        Node n;
        n.kind = N_MEMSET;
        n.dst = dst;
        n.value = value;
        n.elem = elem;
        n.count = count;
        n.what = what;
        c->graph->body->nodes.push_back(std::move(n));
        return CUDA_SUCCESS;
    }
    return run_memset(dst, value, elem, count, what);
}

CUresult dtod_op(CUdeviceptr dst, CUdeviceptr src, size_t bytes, CUstream hs, bool sync, const char* what) {
    Lock l(g_mu);
    INIT_CHECK();
    CUstream_st* s;
    if (CUresult r = get_stream(hs, &s)) return r;
    if (sync) {
        if (CUresult r = check_unsafe(what)) return r;
    }
    CUresult err;
    if (Capture* c = capturing(s, &err)) {
        if (err) return err;
        Node n;
        n.kind = N_MEMCPY;
        n.dst = dst;
        n.src = src;
        n.count = bytes;
        n.what = what;
        c->graph->body->nodes.push_back(std::move(n));
        return CUDA_SUCCESS;
    }
    return run_dtod(dst, src, bytes, what);
}

CUresult htod_op(CUdeviceptr dst, const void* src, size_t bytes, CUstream hs, bool sync, const char* what) {
    Lock l(g_mu);
    INIT_CHECK();
    CUstream_st* s;
    if (CUresult r = get_stream(hs, &s)) return r;
    if (sync) {
        if (CUresult r = check_unsafe(what)) return r;
    }
    CUresult err;
    if (Capture* c = capturing(s, &err)) return err ? err : refuse_in_capture(c, what);
    if (bytes && !src) return CUDA_ERROR_INVALID_VALUE;
    if (CUresult r = check_device_range(what, "destination", dst, bytes)) return r;
    ensure_alt_stack();
    OpScope op(what, false);
    if (bytes) memmove(reinterpret_cast<void*>(static_cast<uintptr_t>(dst)), src, bytes);
    return CUDA_SUCCESS;
}

CUresult dtoh_op(void* dst, CUdeviceptr src, size_t bytes, CUstream hs, bool sync, const char* what) {
    Lock l(g_mu);
    INIT_CHECK();
    CUstream_st* s;
    if (CUresult r = get_stream(hs, &s)) return r;
    if (sync) {
        if (CUresult r = check_unsafe(what)) return r;
    }
    CUresult err;
    if (Capture* c = capturing(s, &err)) return err ? err : refuse_in_capture(c, what);
    if (bytes && !dst) return CUDA_ERROR_INVALID_VALUE;
    if (CUresult r = check_device_range(what, "source", src, bytes)) return r;
    ensure_alt_stack();
    OpScope op(what, false);
    if (bytes) memmove(dst, reinterpret_cast<void*>(static_cast<uintptr_t>(src)), bytes);
    return CUDA_SUCCESS;
}

// Stream-ordered allocation: inside a capture the allocation becomes the graph's (an alloc
// node), its address fixed for every replay, its pages inaccessible until a launch reaches the
// alloc node.
CUresult alloc_async(CUdeviceptr* out, size_t bytes, CUstream hs) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    CUstream_st* s;
    if (CUresult r = get_stream(hs, &s)) return r;
    CUresult err;
    Capture* c = capturing(s, &err);
    if (err) return err;
    Alloc* a;
    if (CUresult r = map_alloc(bytes, c ? c->graph->body.get() : nullptr, &a)) return r;
    if (c) {
        set_live(a, false);
        c->graph->body->owned.push_back(a);
        Node n;
        n.kind = N_ALLOC;
        n.alloc = a;
        c->graph->body->nodes.push_back(std::move(n));
    }
    *out = reinterpret_cast<uintptr_t>(a->ptr);
    return CUDA_SUCCESS;
}

CUresult free_now(Alloc* a) {
    if (PoolOfOwn* pool = a->pool) {
        if (a->pool_free) return CUDA_ERROR_INVALID_VALUE;
        if (pool->destroyed) {
            unmap_alloc(a);
        } else {
            a->pool_free = true;
            pool->free_blocks.push_back(a);
        }
        return CUDA_SUCCESS;
    }
    if (a->owner) {
        if (!a->live) return CUDA_ERROR_INVALID_VALUE;
        set_live(a, false);
    } else {
        unmap_alloc(a);
    }
    return CUDA_SUCCESS;
}

CUresult free_async(CUdeviceptr p, CUstream hs) {
    Lock l(g_mu);
    INIT_CHECK();
    CUstream_st* s;
    if (CUresult r = get_stream(hs, &s)) return r;
    Alloc* a = alloc_at(p);
    if (!a) {
        report("cuMemFreeAsync: 0x%llx is not the start of an allocation", p);
        return CUDA_ERROR_INVALID_VALUE;
    }
    CUresult err;
    if (Capture* c = capturing(s, &err)) {
        if (err) return err;
        // As the allocation side: a pool of one's own is modelled on uncaptured streams only.
        if (a->pool) {
            report("cuMemFreeAsync: 0x%llx, a block of a pool of one's own, on a capturing stream is not modelled", p);
            return CUDA_ERROR_NOT_SUPPORTED;
        }
        Node n;
        n.kind = N_FREE;
        n.dst = p;
        c->graph->body->nodes.push_back(std::move(n));
        return CUDA_SUCCESS;
    }
    if (a->owner && !a->live) {
        report("cuMemFreeAsync: 0x%llx was freed already", p);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (a->pool && a->pool_free) {
        report("cuMemFreeAsync: 0x%llx was freed to its pool already", p);
        return CUDA_ERROR_INVALID_VALUE;
    }
    return free_now(a);
}

CUresult host_fn_op(CUstream hs, int (*fn)(void*), void* data, void (*release)(void*), const char* what) {
    Lock l(g_mu);
    INIT_CHECK();
    CUstream_st* s;
    if (CUresult r = get_stream(hs, &s)) {
        if (release) release(data);
        return r;
    }
    CUresult err;
    if (Capture* c = capturing(s, &err)) {
        if (err) {
            if (release) release(data);
            return err;
        }
        Node n;
        n.kind = N_HOST;
        n.fn = fn;
        n.data = data;
        n.release = release;
        n.what = what;
        c->graph->body->nodes.push_back(std::move(n));
        return CUDA_SUCCESS;
    }
    ensure_alt_stack();
    CUresult r;
    {
        OpScope op(what, false);
        r = fn(data);
    }
    if (release) release(data);
    return r;
}

struct HostCall {
    CUhostFn host_fn;
    CUstreamCallback callback;
    CUstream stream;
    void* data;
};

int call_host(void* p) {
    HostCall* c = static_cast<HostCall*>(p);
    if (c->host_fn)
        c->host_fn(c->data);
    else
        c->callback(c->stream, CUDA_SUCCESS, c->data);
    return CUDA_SUCCESS;
}

void free_host_call(void* p) { delete static_cast<HostCall*>(p); }

void init_once() {
    long page = sysconf(_SC_PAGESIZE);
    if (page > 0) g_page = (size_t)page;
    const char* poison = getenv("HOSTCUDA_POISON");
    g_poison = !(poison && strcmp(poison, "0") == 0);
    install_fault_handler();
    ensure_alt_stack();
}

}  // namespace

// ================================================================================================
// Entry points: the only symbols the library exports (it is built with -fvisibility=hidden).
// ================================================================================================

#pragma GCC visibility push(default)
extern "C" {

// ---- initialization, version, errors ----------------------------------------------------------

CUresult cuInit(unsigned flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    Lock l(g_mu);
    if (!g_initialized) {
        init_once();
        g_initialized = true;
    }
    return CUDA_SUCCESS;
}

CUresult cuDriverGetVersion(int* v) {
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = kDriverVersion;
    return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult e, const char** s) {
    if (!s) return CUDA_ERROR_INVALID_VALUE;
    const ErrorText* t = find_error(e);
    if (!t) {
        *s = nullptr;
        return CUDA_ERROR_INVALID_VALUE;
    }
    *s = t->name;
    return CUDA_SUCCESS;
}

CUresult cuGetErrorString(CUresult e, const char** s) {
    if (!s) return CUDA_ERROR_INVALID_VALUE;
    const ErrorText* t = find_error(e);
    if (!t) {
        *s = nullptr;
        return CUDA_ERROR_INVALID_VALUE;
    }
    // The last kernel failure's own message, so that an error printed by cudarc (which shows
    // this string) says what went wrong.
    if (e == CUDA_ERROR_LAUNCH_FAILED) {
        Lock l(g_mu);
        if (g_launch_failure) {
            *s = g_launch_failure;
            return CUDA_SUCCESS;
        }
    }
    *s = t->text;
    return CUDA_SUCCESS;
}

CUresult cuProfilerStart() { return CUDA_SUCCESS; }
CUresult cuProfilerStop() { return CUDA_SUCCESS; }

// ---- devices ------------------------------------------------------------------------------------

CUresult cuDeviceGetCount(int* n) {
    INIT_CHECK();
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    *n = 1;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    INIT_CHECK();
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *d = 0;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
    INIT_CHECK();
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "%s", kDeviceName);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid_v2(CUuuid* u, CUdevice d) {
    INIT_CHECK();
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    if (!u) return CUDA_ERROR_INVALID_VALUE;
    memcpy(u->bytes, "hostcuda-sm90-00", 16);
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetUuid(CUuuid* u, CUdevice d) { return cuDeviceGetUuid_v2(u, d); }

CUresult cuDeviceGetPCIBusId(char* id, int len, CUdevice d) {
    INIT_CHECK();
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    if (!id || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(id, (size_t)len, "0000:19:00.0");
    return CUDA_SUCCESS;
}

CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice d) {
    INIT_CHECK();
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    *bytes = (size_t)kTotalMem;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int* v, int attr, CUdevice d) {
    INIT_CHECK();
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    if (!v || !device_attribute(attr, v)) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

CUresult cuDeviceComputeCapability(int* major, int* minor, CUdevice d) {
    INIT_CHECK();
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    if (!major || !minor) return CUDA_ERROR_INVALID_VALUE;
    *major = 9;
    *minor = 0;
    return CUDA_SUCCESS;
}

CUresult cuDeviceCanAccessPeer(int* can, CUdevice d, CUdevice peer) {
    INIT_CHECK();
    if (d != 0 || peer != 0) return CUDA_ERROR_INVALID_DEVICE;
    if (!can) return CUDA_ERROR_INVALID_VALUE;
    *can = 0;
    return CUDA_SUCCESS;
}

// ---- contexts -----------------------------------------------------------------------------------

CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice d) {
    Lock l(g_mu);
    INIT_CHECK();
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    if (!ctx) return CUDA_ERROR_INVALID_VALUE;
    g_primary_refs++;
    *ctx = &g_primary;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease_v2(CUdevice d) {
    Lock l(g_mu);
    INIT_CHECK();
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    if (g_primary_refs <= 0) return CUDA_ERROR_INVALID_CONTEXT;
    // The primary context's resources stay when the count reaches zero: nothing in a test run
    // depends on them going, and buffers still referenced by Rust objects must stay valid.
    g_primary_refs--;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxRelease(CUdevice d) { return cuDevicePrimaryCtxRelease_v2(d); }

CUresult cuDevicePrimaryCtxGetState(CUdevice d, unsigned* flags, int* active) {
    Lock l(g_mu);
    INIT_CHECK();
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    if (!flags || !active) return CUDA_ERROR_INVALID_VALUE;
    *flags = g_primary.flags;
    *active = g_primary_refs > 0;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxSetFlags_v2(CUdevice d, unsigned flags) {
    Lock l(g_mu);
    INIT_CHECK();
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    g_primary.flags = flags;
    return CUDA_SUCCESS;
}

CUresult cuDevicePrimaryCtxReset_v2(CUdevice d) {
    INIT_CHECK();
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    return CUDA_SUCCESS;
}

static CUresult create_ctx(CUcontext* out, unsigned flags, CUdevice d) {
    Lock l(g_mu);
    INIT_CHECK();
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    CUctx_st* c = new CUctx_st{false, flags, g_next_id++};
    g_contexts.insert(c);
    tl_ctx.push_back(c);  // a created context is made current, as cuCtxCreate does
    *out = c;
    return CUDA_SUCCESS;
}

CUresult cuCtxCreate_v2(CUcontext* out, unsigned flags, CUdevice d) { return create_ctx(out, flags, d); }
CUresult cuCtxCreate_v3(CUcontext* out, void* params, int n, unsigned flags, CUdevice d) {
    (void)params;
    (void)n;
    return create_ctx(out, flags, d);
}
CUresult cuCtxCreate_v4(CUcontext* out, void* params, unsigned flags, CUdevice d) {
    (void)params;
    return create_ctx(out, flags, d);
}

CUresult cuCtxDestroy_v2(CUcontext c) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!c || c == &g_primary || !g_contexts.count(c)) return CUDA_ERROR_INVALID_CONTEXT;
    g_contexts.erase(c);
    for (auto it = tl_ctx.begin(); it != tl_ctx.end();)
        it = *it == c ? tl_ctx.erase(it) : it + 1;
    delete c;
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCurrent(CUcontext c) {
    Lock l(g_mu);
    INIT_CHECK();
    if (c && !g_contexts.count(c)) return CUDA_ERROR_INVALID_CONTEXT;
    if (!c) {
        if (!tl_ctx.empty()) tl_ctx.pop_back();
    } else if (tl_ctx.empty()) {
        tl_ctx.push_back(c);
    } else {
        tl_ctx.back() = c;
    }
    return CUDA_SUCCESS;
}

CUresult cuCtxGetCurrent(CUcontext* c) {
    INIT_CHECK();
    if (!c) return CUDA_ERROR_INVALID_VALUE;
    *c = current_ctx();
    return CUDA_SUCCESS;
}

CUresult cuCtxPushCurrent_v2(CUcontext c) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!c || !g_contexts.count(c)) return CUDA_ERROR_INVALID_CONTEXT;
    tl_ctx.push_back(c);
    return CUDA_SUCCESS;
}

CUresult cuCtxPopCurrent_v2(CUcontext* c) {
    INIT_CHECK();
    if (tl_ctx.empty()) return CUDA_ERROR_INVALID_CONTEXT;
    if (c) *c = tl_ctx.back();
    tl_ctx.pop_back();
    return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice* d) {
    CTX_CHECK();
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    *d = 0;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetFlags(unsigned* flags) {
    CTX_CHECK();
    if (!flags) return CUDA_ERROR_INVALID_VALUE;
    *flags = current_ctx()->flags;
    return CUDA_SUCCESS;
}

CUresult cuCtxSetFlags(unsigned flags) {
    CTX_CHECK();
    current_ctx()->flags = flags;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetId(CUcontext c, unsigned long long* id) {
    INIT_CHECK();
    if (!c) c = current_ctx();
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    if (!id) return CUDA_ERROR_INVALID_VALUE;
    *id = c->id;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetApiVersion(CUcontext c, unsigned* v) {
    INIT_CHECK();
    (void)c;
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    *v = 3020;
    return CUDA_SUCCESS;
}

CUresult cuCtxSynchronize() {
    Lock l(g_mu);
    CTX_CHECK();
    // Every queued operation ran when it was queued: nothing to wait for.
    return check_unsafe("cuCtxSynchronize");
}

static size_t g_limits[7] = {1024, 1 << 20, 8 << 20, 2, 2048, 64, 0};

CUresult cuCtxGetLimit(size_t* v, int limit) {
    CTX_CHECK();
    if (!v || limit < 0 || limit >= 7) return CUDA_ERROR_INVALID_VALUE;
    *v = g_limits[limit];
    return CUDA_SUCCESS;
}

CUresult cuCtxSetLimit(int limit, size_t v) {
    CTX_CHECK();
    if (limit < 0 || limit >= 7) return CUDA_ERROR_INVALID_VALUE;
    g_limits[limit] = v;
    return CUDA_SUCCESS;
}

static int g_cache_config = 0;

CUresult cuCtxGetCacheConfig(int* c) {
    CTX_CHECK();
    if (!c) return CUDA_ERROR_INVALID_VALUE;
    *c = g_cache_config;
    return CUDA_SUCCESS;
}

CUresult cuCtxSetCacheConfig(int c) {
    CTX_CHECK();
    if (c < 0 || c > 3) return CUDA_ERROR_INVALID_VALUE;
    g_cache_config = c;
    return CUDA_SUCCESS;
}

CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
    CTX_CHECK();
    if (least) *least = 0;
    if (greatest) *greatest = -5;
    return CUDA_SUCCESS;
}

// ---- memory -------------------------------------------------------------------------------------

CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    Lock l(g_mu);
    CTX_CHECK();
    if (!free_bytes || !total) return CUDA_ERROR_INVALID_VALUE;
    *total = (size_t)kTotalMem;
    *free_bytes = g_allocated < kTotalMem ? (size_t)(kTotalMem - g_allocated) : 0;
    return CUDA_SUCCESS;
}

CUresult cuMemAlloc_v2(CUdeviceptr* out, size_t bytes) {
    Lock l(g_mu);
    CTX_CHECK();
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    if (CUresult r = check_unsafe("cuMemAlloc")) return r;
    Alloc* a;
    if (CUresult r = map_alloc(bytes, nullptr, &a)) return r;
    *out = reinterpret_cast<uintptr_t>(a->ptr);
    return CUDA_SUCCESS;
}

CUresult cuMemAllocManaged(CUdeviceptr* out, size_t bytes, unsigned flags) {
    (void)flags;
    return cuMemAlloc_v2(out, bytes);
}

CUresult cuMemFree_v2(CUdeviceptr p) {
    Lock l(g_mu);
    INIT_CHECK();
    if (p == 0) return CUDA_SUCCESS;
    Alloc* a = alloc_at(p);
    if (!a || (a->owner && !a->live) || a->pool_free) {
        report("cuMemFree: 0x%llx is not the start of a live allocation", p);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (CUresult r = check_unsafe("cuMemFree")) return r;
    return free_now(a);
}

CUresult cuMemAllocAsync(CUdeviceptr* out, size_t bytes, CUstream s) { return alloc_async(out, bytes, s); }

CUresult cuMemFreeAsync(CUdeviceptr p, CUstream s) { return free_async(p, s); }

CUresult cuMemGetAddressRange_v2(CUdeviceptr* base, size_t* size, CUdeviceptr p) {
    Lock l(g_mu);
    INIT_CHECK();
    Alloc* a = alloc_holding(static_cast<uintptr_t>(p), 0);
    if (!a) return CUDA_ERROR_NOT_FOUND;
    if (base) *base = reinterpret_cast<uintptr_t>(a->ptr);
    if (size) *size = a->size;
    return CUDA_SUCCESS;
}

// Stream-ordered pool calls: one default pool whose settings are accepted and ignored.
}  // extern "C"
struct CUmemPoolHandle_st {
    int unused;
    PoolOfOwn* own;  // null for the default pool
};
namespace {
CUmemPoolHandle_st g_pool{0, nullptr};
}
extern "C" {

CUresult cuDeviceGetDefaultMemPool(CUmemoryPool* pool, CUdevice d) {
    INIT_CHECK();
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    *pool = &g_pool;
    return CUDA_SUCCESS;
}

CUresult cuDeviceGetMemPool(CUmemoryPool* pool, CUdevice d) { return cuDeviceGetDefaultMemPool(pool, d); }

CUresult cuDeviceSetMemPool(CUdevice d, CUmemoryPool pool) {
    INIT_CHECK();
    if (d != 0) return CUDA_ERROR_INVALID_DEVICE;
    return pool == &g_pool ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

// Pools of one's own (PoolOfOwn): device memory whatever the properties say. The handle is
// never deleted (a destroyed pool's blocks may still be freed later), a few bytes a pool.
CUresult cuMemPoolCreate(CUmemoryPool* pool, const void* props) {
    Lock l(g_mu);
    INIT_CHECK();
    (void)props;
    if (!pool) return CUDA_ERROR_INVALID_VALUE;
    *pool = new CUmemPoolHandle_st{0, new PoolOfOwn};
    g_own_pools.push_back((*pool)->own);
    return CUDA_SUCCESS;
}

CUresult cuMemPoolDestroy(CUmemoryPool pool) {
    Lock l(g_mu);
    INIT_CHECK();
    if (pool == &g_pool) return CUDA_ERROR_INVALID_VALUE;
    if (!pool || !pool->own || pool->own->destroyed) return CUDA_ERROR_INVALID_HANDLE;
    PoolOfOwn* own = pool->own;
    own->destroyed = true;
    for (Alloc* a : own->free_blocks) unmap_alloc(a);
    own->free_blocks.clear();
    g_own_pools.erase(std::find(g_own_pools.begin(), g_own_pools.end(), own));
    return CUDA_SUCCESS;
}

CUresult alloc_from_own_pool(CUdeviceptr* out, size_t bytes, PoolOfOwn* pool, CUstream hs) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    if (pool->destroyed) return CUDA_ERROR_INVALID_HANDLE;
    CUstream_st* s;
    if (CUresult r = get_stream(hs, &s)) return r;
    CUresult err;
    // A captured allocation from such a pool would be a memory node of that pool: tern takes
    // its step pools' buffers on a stream that is not captured, and this models only that.
    if (capturing(s, &err) || err) {
        report("cuMemAllocFromPoolAsync: a pool of one's own on a capturing stream is not modelled");
        return err ? err : CUDA_ERROR_NOT_SUPPORTED;
    }
    auto same = std::find_if(pool->free_blocks.begin(), pool->free_blocks.end(),
                             [&](const Alloc* b) { return round_up(b->size, 16) == round_up(bytes, 16); });
    Alloc* a;
    if (same != pool->free_blocks.end()) {
        a = *same;
        pool->free_blocks.erase(same);
        a->pool_free = false;
        g_allocated += bytes;
        g_allocated -= a->size;
        a->size = bytes;
        // What the block held before is not this buffer's: poisoned as a fresh one is.
        if (g_poison && a->size) memset(a->ptr, 0xff, a->size);
    } else {
        if (CUresult r = map_alloc(bytes, nullptr, &a)) return r;
        a->pool = pool;
    }
    *out = reinterpret_cast<uintptr_t>(a->ptr);
    return CUDA_SUCCESS;
}

CUresult cuMemAllocFromPoolAsync(CUdeviceptr* out, size_t bytes, CUmemoryPool pool, CUstream s) {
    if (pool && pool->own) return alloc_from_own_pool(out, bytes, pool->own, s);
    return alloc_async(out, bytes, s);
}

CUresult cuMemPoolTrimTo(CUmemoryPool pool, size_t keep) {
    (void)pool;
    (void)keep;
    return CUDA_SUCCESS;
}

CUresult cuMemPoolSetAttribute(CUmemoryPool pool, int attr, void* value) {
    (void)pool;
    (void)attr;
    (void)value;
    return CUDA_SUCCESS;
}

CUresult cuMemPoolGetAttribute(CUmemoryPool pool, int attr, void* value) {
    (void)pool;
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    // Attributes 1-3 are ints (reuse policies), the rest 64-bit sizes.
    if (attr >= 1 && attr <= 3)
        *static_cast<int*>(value) = 1;
    else
        *static_cast<unsigned long long*>(value) = 0;
    return CUDA_SUCCESS;
}

CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned flags) {
    Lock l(g_mu);
    CTX_CHECK();
    (void)flags;
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    if (CUresult r = check_unsafe("cuMemHostAlloc")) return r;
    void* m = nullptr;
    if (posix_memalign(&m, g_page, bytes ? bytes : 1) != 0) return CUDA_ERROR_OUT_OF_MEMORY;
    g_host_allocs[reinterpret_cast<uintptr_t>(m)] = bytes;
    *p = m;
    return CUDA_SUCCESS;
}

CUresult cuMemAllocHost_v2(void** p, size_t bytes) { return cuMemHostAlloc(p, bytes, 0); }

CUresult cuMemFreeHost(void* p) {
    Lock l(g_mu);
    INIT_CHECK();
    auto it = g_host_allocs.find(reinterpret_cast<uintptr_t>(p));
    if (it == g_host_allocs.end()) return CUDA_ERROR_INVALID_VALUE;
    if (CUresult r = check_unsafe("cuMemFreeHost")) return r;
    g_host_allocs.erase(it);
    free(p);
    return CUDA_SUCCESS;
}

CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr* d, void* p, unsigned flags) {
    INIT_CHECK();
    (void)flags;
    if (!d) return CUDA_ERROR_INVALID_VALUE;
    *d = reinterpret_cast<uintptr_t>(p);
    return CUDA_SUCCESS;
}

CUresult cuMemHostGetFlags(unsigned* flags, void* p) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!flags) return CUDA_ERROR_INVALID_VALUE;
    if (!g_host_allocs.count(reinterpret_cast<uintptr_t>(p))) return CUDA_ERROR_INVALID_VALUE;
    *flags = 0;
    return CUDA_SUCCESS;
}

CUresult cuMemHostRegister_v2(void* p, size_t bytes, unsigned flags) {
    Lock l(g_mu);
    CTX_CHECK();
    (void)flags;
    if (!p || !bytes) return CUDA_ERROR_INVALID_VALUE;
    uintptr_t u = reinterpret_cast<uintptr_t>(p);
    if (g_host_registered.count(u)) return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    g_host_registered[u] = bytes;
    return CUDA_SUCCESS;
}

CUresult cuMemHostUnregister(void* p) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!g_host_registered.erase(reinterpret_cast<uintptr_t>(p))) return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    return CUDA_SUCCESS;
}

CUresult cuPointerGetAttribute(void* data, int attr, CUdeviceptr p) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!data) return CUDA_ERROR_INVALID_VALUE;
    uintptr_t u = static_cast<uintptr_t>(p);
    Alloc* a = alloc_holding(u, 0);
    bool host = host_range_holds(g_host_allocs, u, 0) || host_range_holds(g_host_registered, u, 0);
    if (!a && !host) return CUDA_ERROR_INVALID_VALUE;
    switch (attr) {
        case 1: *static_cast<CUcontext*>(data) = &g_primary; return CUDA_SUCCESS;
        case 2: *static_cast<unsigned*>(data) = a ? 2u : 1u; return CUDA_SUCCESS;  // CU_MEMORYTYPE_DEVICE / HOST
        case 3: *static_cast<CUdeviceptr*>(data) = p; return CUDA_SUCCESS;
        case 4: *static_cast<void**>(data) = a ? nullptr : reinterpret_cast<void*>(u); return CUDA_SUCCESS;
        case 8: *static_cast<int*>(data) = 0; return CUDA_SUCCESS;  // is managed
        case 9: *static_cast<int*>(data) = 0; return CUDA_SUCCESS;  // device ordinal
        case 11:
            if (!a) return CUDA_ERROR_INVALID_VALUE;
            *static_cast<CUdeviceptr*>(data) = reinterpret_cast<uintptr_t>(a->ptr);
            return CUDA_SUCCESS;
        case 12:
            if (!a) return CUDA_ERROR_INVALID_VALUE;
            *static_cast<size_t*>(data) = a->size;
            return CUDA_SUCCESS;
        case 13: *static_cast<int*>(data) = 1; return CUDA_SUCCESS;  // mapped
        default: return CUDA_ERROR_INVALID_VALUE;
    }
}

CUresult cuMemPrefetchAsync_v2(CUdeviceptr p, size_t n, CUmemLocation loc, unsigned flags, CUstream s) {
    (void)p;
    (void)n;
    (void)loc;
    (void)flags;
    (void)s;
    INIT_CHECK();
    return CUDA_SUCCESS;
}

CUresult cuMemAdvise_v2(CUdeviceptr p, size_t n, int advice, CUmemLocation loc) {
    (void)p;
    (void)n;
    (void)advice;
    (void)loc;
    INIT_CHECK();
    return CUDA_SUCCESS;
}

CUresult cuStreamAttachMemAsync(CUstream s, CUdeviceptr p, size_t n, unsigned flags) {
    (void)p;
    (void)n;
    (void)flags;
    Lock l(g_mu);
    INIT_CHECK();
    CUstream_st* st;
    return get_stream(s, &st);
}

// Copies and memsets. The synchronous forms run on the legacy stream and are "potentially
// unsafe" during a capture; the asynchronous ones follow their stream's capture state.
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) { return htod_op(dst, src, n, nullptr, true, "cuMemcpyHtoD"); }
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream s) {
    return htod_op(dst, src, n, s, false, "cuMemcpyHtoDAsync");
}
CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) { return dtoh_op(dst, src, n, nullptr, true, "cuMemcpyDtoH"); }
CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream s) {
    return dtoh_op(dst, src, n, s, false, "cuMemcpyDtoHAsync");
}
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) { return dtod_op(dst, src, n, nullptr, true, "cuMemcpyDtoD"); }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    return dtod_op(dst, src, n, s, false, "cuMemcpyDtoDAsync");
}
CUresult cuMemcpyPeer(CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n) {
    (void)dc;
    (void)sc;
    return dtod_op(dst, src, n, nullptr, true, "cuMemcpyPeer");
}
CUresult cuMemcpyPeerAsync(CUdeviceptr dst, CUcontext dc, CUdeviceptr src, CUcontext sc, size_t n, CUstream s) {
    (void)dc;
    (void)sc;
    return dtod_op(dst, src, n, s, false, "cuMemcpyPeerAsync");
}

// Unified-addressing copies: the direction follows from which side is device memory.
static CUresult unified_copy(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s, bool sync, const char* what) {
    bool dst_dev, src_dev;
    {
        Lock l(g_mu);
        dst_dev = alloc_holding(static_cast<uintptr_t>(dst), 0) != nullptr;
        src_dev = alloc_holding(static_cast<uintptr_t>(src), 0) != nullptr;
    }
    if (dst_dev && src_dev) return dtod_op(dst, src, n, s, sync, what);
    if (dst_dev) return htod_op(dst, reinterpret_cast<const void*>(static_cast<uintptr_t>(src)), n, s, sync, what);
    if (src_dev) return dtoh_op(reinterpret_cast<void*>(static_cast<uintptr_t>(dst)), src, n, s, sync, what);
    Lock l(g_mu);
    INIT_CHECK();
    CUstream_st* st;
    if (CUresult r = get_stream(s, &st)) return r;
    CUresult err;
    if (Capture* c = capturing(st, &err)) return err ? err : refuse_in_capture(c, what);
    if (n) memmove(reinterpret_cast<void*>(static_cast<uintptr_t>(dst)), reinterpret_cast<void*>(static_cast<uintptr_t>(src)), n);
    return CUDA_SUCCESS;
}
CUresult cuMemcpy(CUdeviceptr dst, CUdeviceptr src, size_t n) { return unified_copy(dst, src, n, nullptr, true, "cuMemcpy"); }
CUresult cuMemcpyAsync(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    return unified_copy(dst, src, n, s, false, "cuMemcpyAsync");
}

CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) { return memset_op(d, v, 1, n, nullptr, true, "cuMemsetD8"); }
CUresult cuMemsetD16_v2(CUdeviceptr d, unsigned short v, size_t n) { return memset_op(d, v, 2, n, nullptr, true, "cuMemsetD16"); }
CUresult cuMemsetD32_v2(CUdeviceptr d, unsigned v, size_t n) { return memset_op(d, v, 4, n, nullptr, true, "cuMemsetD32"); }
CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, CUstream s) {
    return memset_op(d, v, 1, n, s, false, "cuMemsetD8Async");
}
CUresult cuMemsetD16Async(CUdeviceptr d, unsigned short v, size_t n, CUstream s) {
    return memset_op(d, v, 2, n, s, false, "cuMemsetD16Async");
}
CUresult cuMemsetD32Async(CUdeviceptr d, unsigned v, size_t n, CUstream s) {
    return memset_op(d, v, 4, n, s, false, "cuMemsetD32Async");
}

// ---- streams ------------------------------------------------------------------------------------

static CUresult create_stream(CUstream* out, unsigned flags, int priority) {
    Lock l(g_mu);
    CTX_CHECK();
    if (!out || flags > 1) return CUDA_ERROR_INVALID_VALUE;
    CUstream_st* s = new CUstream_st{current_ctx(), flags, priority < -5 ? -5 : (priority > 0 ? 0 : priority), g_next_id++,
                                     nullptr};
    g_streams.insert(s);
    *out = s;
    return CUDA_SUCCESS;
}

CUresult cuStreamCreate(CUstream* out, unsigned flags) { return create_stream(out, flags, 0); }
CUresult cuStreamCreateWithPriority(CUstream* out, unsigned flags, int priority) { return create_stream(out, flags, priority); }

CUresult cuStreamDestroy_v2(CUstream hs) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!g_streams.count(hs)) return CUDA_ERROR_INVALID_HANDLE;
    if (Capture* c = hs->capture) {
        // A capture that never ended: its graph is dropped with the stream.
        g_graphs.erase(c->graph);
        delete c->graph;
        delete c;
    }
    g_streams.erase(hs);
    delete hs;
    return CUDA_SUCCESS;
}

CUresult cuStreamDestroy(CUstream hs) { return cuStreamDestroy_v2(hs); }

CUresult cuStreamSynchronize(CUstream hs) {
    Lock l(g_mu);
    INIT_CHECK();
    CUstream_st* s;
    if (CUresult r = get_stream(hs, &s)) return r;
    if (s->capture) {
        invalidate(s->capture, "cuStreamSynchronize of the capturing stream");
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    return check_unsafe("cuStreamSynchronize");
}

CUresult cuStreamQuery(CUstream hs) {
    Lock l(g_mu);
    INIT_CHECK();
    CUstream_st* s;
    if (CUresult r = get_stream(hs, &s)) return r;
    if (s->capture) {
        invalidate(s->capture, "cuStreamQuery of the capturing stream");
        return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    }
    return CUDA_SUCCESS;
}

CUresult cuStreamWaitEvent(CUstream hs, CUevent e, unsigned flags) {
    Lock l(g_mu);
    INIT_CHECK();
    (void)flags;
    CUstream_st* s;
    if (CUresult r = get_stream(hs, &s)) return r;
    if (!g_events.count(e)) return CUDA_ERROR_INVALID_HANDLE;
    // The event's work has run already; in a capture the wait adds no node, since the graph
    // runs its nodes in capture order.
    CUresult err;
    capturing(s, &err);
    return err;
}

CUresult cuStreamGetFlags(CUstream hs, unsigned* flags) {
    Lock l(g_mu);
    INIT_CHECK();
    CUstream_st* s;
    if (CUresult r = get_stream(hs, &s)) return r;
    if (!flags) return CUDA_ERROR_INVALID_VALUE;
    *flags = s->flags;
    return CUDA_SUCCESS;
}

CUresult cuStreamGetPriority(CUstream hs, int* p) {
    Lock l(g_mu);
    INIT_CHECK();
    CUstream_st* s;
    if (CUresult r = get_stream(hs, &s)) return r;
    if (!p) return CUDA_ERROR_INVALID_VALUE;
    *p = s->priority;
    return CUDA_SUCCESS;
}

CUresult cuStreamGetCtx(CUstream hs, CUcontext* c) {
    Lock l(g_mu);
    INIT_CHECK();
    CUstream_st* s;
    if (CUresult r = get_stream(hs, &s)) return r;
    if (!c) return CUDA_ERROR_INVALID_VALUE;
    *c = s == &g_legacy ? current_ctx() : s->ctx;
    return *c ? CUDA_SUCCESS : CUDA_ERROR_INVALID_CONTEXT;
}

CUresult cuStreamGetId(CUstream hs, unsigned long long* id) {
    Lock l(g_mu);
    INIT_CHECK();
    CUstream_st* s;
    if (CUresult r = get_stream(hs, &s)) return r;
    if (!id) return CUDA_ERROR_INVALID_VALUE;
    *id = s->id;
    return CUDA_SUCCESS;
}

CUresult cuLaunchHostFunc(CUstream s, CUhostFn fn, void* data) {
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    return host_fn_op(s, call_host, new HostCall{fn, nullptr, s, data}, free_host_call, "host function");
}

CUresult cuStreamAddCallback(CUstream s, CUstreamCallback fn, void* data, unsigned flags) {
    if (!fn || flags != 0) return CUDA_ERROR_INVALID_VALUE;
    {
        Lock l(g_mu);
        CUstream_st* st;
        if (CUresult r = get_stream(s, &st)) return r;
        // Stream callbacks cannot be captured.
        if (st->capture) {
            invalidate(st->capture, "cuStreamAddCallback on the capturing stream");
            return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
        }
    }
    return host_fn_op(s, call_host, new HostCall{nullptr, fn, s, data}, free_host_call, "stream callback");
}

// ---- stream capture -----------------------------------------------------------------------------

CUresult cuStreamBeginCapture_v2(CUstream hs, int mode) {
    Lock l(g_mu);
    INIT_CHECK();
    CUstream_st* s;
    if (CUresult r = get_stream(hs, &s)) return r;
    if (mode < CAPTURE_MODE_GLOBAL || mode > CAPTURE_MODE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
    if (s == &g_legacy) return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
    if (s->capture) return CUDA_ERROR_ILLEGAL_STATE;
    CUgraph_st* g = new CUgraph_st{std::make_shared<GraphBody>()};
    g_graphs.insert(g);
    s->capture = new Capture{g, mode, pthread_self(), false, g_next_id++};
    return CUDA_SUCCESS;
}

CUresult cuStreamBeginCapture(CUstream hs, int mode) { return cuStreamBeginCapture_v2(hs, mode); }

CUresult cuStreamEndCapture(CUstream hs, CUgraph* out) {
    Lock l(g_mu);
    INIT_CHECK();
    CUstream_st* s;
    if (CUresult r = get_stream(hs, &s)) return r;
    if (!out) return CUDA_ERROR_INVALID_VALUE;
    Capture* c = s->capture;
    if (!c) return CUDA_ERROR_ILLEGAL_STATE;
    if (c->mode != CAPTURE_MODE_RELAXED && !pthread_equal(c->thread, pthread_self()))
        return CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD;
    s->capture = nullptr;
    if (c->invalidated) {
        g_graphs.erase(c->graph);
        delete c->graph;
        delete c;
        *out = nullptr;
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    }
    *out = c->graph;
    delete c;
    return CUDA_SUCCESS;
}

CUresult cuStreamIsCapturing(CUstream hs, int* status) {
    Lock l(g_mu);
    INIT_CHECK();
    CUstream_st* s;
    if (CUresult r = get_stream(hs, &s)) return r;
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    *status = !s->capture ? CAPTURE_STATUS_NONE : s->capture->invalidated ? CAPTURE_STATUS_INVALIDATED : CAPTURE_STATUS_ACTIVE;
    return CUDA_SUCCESS;
}

CUresult cuStreamGetCaptureInfo_v3(CUstream hs, int* status, unsigned long long* id, CUgraph* graph,
                                   const CUgraphNode** deps, const void** edges, size_t* ndeps) {
    Lock l(g_mu);
    INIT_CHECK();
    CUstream_st* s;
    if (CUresult r = get_stream(hs, &s)) return r;
    if (!status) return CUDA_ERROR_INVALID_VALUE;
    Capture* c = s->capture;
    *status = !c ? CAPTURE_STATUS_NONE : c->invalidated ? CAPTURE_STATUS_INVALIDATED : CAPTURE_STATUS_ACTIVE;
    if (id) *id = c ? c->id : 0;
    if (graph) *graph = c ? c->graph : nullptr;
    // The graph is a sequence: dependency nodes are not exposed.
    if (deps) *deps = nullptr;
    if (edges) *edges = nullptr;
    if (ndeps) *ndeps = 0;
    return CUDA_SUCCESS;
}

CUresult cuStreamGetCaptureInfo_v2(CUstream hs, int* status, unsigned long long* id, CUgraph* graph,
                                   const CUgraphNode** deps, size_t* ndeps) {
    return cuStreamGetCaptureInfo_v3(hs, status, id, graph, deps, nullptr, ndeps);
}

CUresult cuThreadExchangeStreamCaptureMode(int* mode) {
    if (!mode || *mode < CAPTURE_MODE_GLOBAL || *mode > CAPTURE_MODE_RELAXED) return CUDA_ERROR_INVALID_VALUE;
    int old = tl_capture_mode;
    tl_capture_mode = *mode;
    *mode = old;
    return CUDA_SUCCESS;
}

// ---- graphs -------------------------------------------------------------------------------------

CUresult cuGraphCreate(CUgraph* out, unsigned flags) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!out || flags) return CUDA_ERROR_INVALID_VALUE;
    CUgraph_st* g = new CUgraph_st{std::make_shared<GraphBody>()};
    g_graphs.insert(g);
    *out = g;
    return CUDA_SUCCESS;
}

CUresult cuGraphDestroy(CUgraph g) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!g_graphs.count(g)) return CUDA_ERROR_INVALID_VALUE;
    for (CUstream_st* s : g_streams)
        if (s->capture && s->capture->graph == g) return CUDA_ERROR_ILLEGAL_STATE;
    g_graphs.erase(g);
    delete g;
    return CUDA_SUCCESS;
}

// A captured graph's nodes, as handles to its node list (stable once captured: a graph's list
// does not change afterwards), and its edges: capture on one stream makes a chain, node i to
// node i + 1, programmatic (type 1, from the kernel's programmatic port) where a kernel follows
// a kernel launched with programmatic stream serialization, as the driver records it.
CUresult cuGraphGetNodes(CUgraph g, CUgraphNode* nodes, size_t* n) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!g_graphs.count(g) || !n) return CUDA_ERROR_INVALID_VALUE;
    const size_t total = g->body->nodes.size();
    if (nodes)
        for (size_t i = 0; i < *n && i < total; i++) nodes[i] = &g->body->nodes[i];
    *n = total;
    return CUDA_SUCCESS;
}

CUresult cuGraphNodeGetType(CUgraphNode node, int* type) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!type) return CUDA_ERROR_INVALID_VALUE;
    for (CUgraph_st* g : g_graphs) {
        std::vector<Node>& nodes = g->body->nodes;
        if (nodes.empty() || node < (void*)nodes.data() || node >= (void*)(nodes.data() + nodes.size())) continue;
        // CUgraphNodeType's values.
        switch (static_cast<Node*>(node)->kind) {
            case N_KERNEL: *type = 0; break;
            case N_MEMCPY: *type = 1; break;
            case N_MEMSET: *type = 2; break;
            case N_HOST: *type = 3; break;
            case N_CHILD: *type = 4; break;
            case N_EVENT: *type = 7; break;
            case N_ALLOC: *type = 10; break;
            case N_FREE: *type = 11; break;
        }
        return CUDA_SUCCESS;
    }
    return CUDA_ERROR_INVALID_VALUE;
}

struct CUgraphEdgeData {
    unsigned char from_port, to_port, type, reserved[5];
};

CUresult cuGraphGetEdges_v2(CUgraph g, CUgraphNode* from, CUgraphNode* to, CUgraphEdgeData* data, size_t* n) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!g_graphs.count(g) || !n || (from == nullptr) != (to == nullptr)) return CUDA_ERROR_INVALID_VALUE;
    std::vector<Node>& nodes = g->body->nodes;
    const size_t total = nodes.empty() ? 0 : nodes.size() - 1;
    if (from) {
        for (size_t i = 0; i < *n && i < total; i++) {
            from[i] = &nodes[i];
            to[i] = &nodes[i + 1];
            if (data) {
                const bool programmatic = nodes[i].kind == N_KERNEL && nodes[i + 1].kind == N_KERNEL && nodes[i + 1].programmatic;
                data[i] = CUgraphEdgeData{static_cast<unsigned char>(programmatic), 0, static_cast<unsigned char>(programmatic), {0, 0, 0, 0, 0}};
            }
        }
    }
    *n = total;
    return CUDA_SUCCESS;
}

CUresult cuGraphClone(CUgraph* out, CUgraph g) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!out || !g_graphs.count(g)) return CUDA_ERROR_INVALID_VALUE;
    // Memory nodes cannot be cloned (as on a GPU); host nodes would share their data.
    for (const Node& n : g->body->nodes)
        if (n.kind == N_ALLOC || n.kind == N_FREE || n.kind == N_HOST) return CUDA_ERROR_NOT_SUPPORTED;
    auto body = std::make_shared<GraphBody>();
    body->nodes = g->body->nodes;
    for (Node& n : body->nodes) {
        if (n.kind == N_KERNEL) n.func->mod->refs++;
        if (n.kind == N_EVENT) n.event->refs++;
    }
    CUgraph_st* c = new CUgraph_st{body};
    g_graphs.insert(c);
    *out = c;
    return CUDA_SUCCESS;
}

CUresult cuGraphInstantiateWithFlags(CUgraphExec* out, CUgraph g, unsigned long long flags) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!out || !g_graphs.count(g)) return CUDA_ERROR_INVALID_VALUE;
    const unsigned long long known =
        INSTANTIATE_AUTO_FREE_ON_LAUNCH | INSTANTIATE_UPLOAD | INSTANTIATE_DEVICE_LAUNCH | INSTANTIATE_USE_NODE_PRIORITY;
    if (flags & ~known) return CUDA_ERROR_INVALID_VALUE;
    if ((flags & INSTANTIATE_AUTO_FREE_ON_LAUNCH) && (flags & INSTANTIATE_DEVICE_LAUNCH)) return CUDA_ERROR_INVALID_VALUE;
    // A graph with memory nodes has one executable at a time: its allocations' addresses are
    // the graph's.
    if (g->body->execs > 0 && g->body->has_memory_nodes()) return CUDA_ERROR_NOT_SUPPORTED;
    g->body->execs++;
    CUgraphExec_st* e = new CUgraphExec_st{g->body, flags};
    g_execs.insert(e);
    *out = e;
    return CUDA_SUCCESS;
}

CUresult cuGraphExecDestroy(CUgraphExec e) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!g_execs.count(e)) return CUDA_ERROR_INVALID_VALUE;
    g_execs.erase(e);
    e->body->execs--;
    delete e;
    return CUDA_SUCCESS;
}

CUresult cuGraphUpload(CUgraphExec e, CUstream hs) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!g_execs.count(e)) return CUDA_ERROR_INVALID_VALUE;
    CUstream_st* s;
    return get_stream(hs, &s);
}

CUresult cuGraphLaunch(CUgraphExec e, CUstream hs) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!g_execs.count(e)) return CUDA_ERROR_INVALID_VALUE;
    CUstream_st* s;
    if (CUresult r = get_stream(hs, &s)) return r;
    CUresult err;
    if (Capture* c = capturing(s, &err)) {
        if (err) return err;
        Node n;
        n.kind = N_CHILD;
        n.child = e->body;
        c->graph->body->nodes.push_back(std::move(n));
        return CUDA_SUCCESS;
    }
    poison_free_pool_blocks();
    return run_body(*e->body, (e->flags & INSTANTIATE_AUTO_FREE_ON_LAUNCH) != 0);
}

// ---- events -------------------------------------------------------------------------------------

CUresult cuEventCreate(CUevent* out, unsigned flags) {
    Lock l(g_mu);
    CTX_CHECK();
    if (!out || flags > 7) return CUDA_ERROR_INVALID_VALUE;
    CUevent_st* e = new CUevent_st{flags, false, false, 0, 1};
    g_events.insert(e);
    *out = e;
    return CUDA_SUCCESS;
}

CUresult cuEventDestroy_v2(CUevent e) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!g_events.erase(e)) return CUDA_ERROR_INVALID_HANDLE;
    event_unref(e);
    return CUDA_SUCCESS;
}

CUresult cuEventDestroy(CUevent e) { return cuEventDestroy_v2(e); }

CUresult cuEventRecordWithFlags(CUevent e, CUstream hs, unsigned flags) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!g_events.count(e)) return CUDA_ERROR_INVALID_HANDLE;
    if (flags > EVENT_RECORD_EXTERNAL) return CUDA_ERROR_INVALID_VALUE;
    CUstream_st* s;
    if (CUresult r = get_stream(hs, &s)) return r;
    CUresult err;
    if (Capture* c = capturing(s, &err)) {
        if (err) return err;
        if (flags & EVENT_RECORD_EXTERNAL) {
            // An event record node: the event is recorded each time the graph runs.
            Node n;
            n.kind = N_EVENT;
            n.event = e;
            e->refs++;
            c->graph->body->nodes.push_back(std::move(n));
        } else {
            // A plain record inside a capture only marks a point for other captured streams to
            // wait on: the host cannot wait for it.
            e->captured = true;
        }
        return CUDA_SUCCESS;
    }
    record_event(e);
    return CUDA_SUCCESS;
}

CUresult cuEventRecord(CUevent e, CUstream hs) { return cuEventRecordWithFlags(e, hs, 0); }

CUresult cuEventQuery(CUevent e) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!g_events.count(e)) return CUDA_ERROR_INVALID_HANDLE;
    return e->captured ? CUDA_ERROR_CAPTURED_EVENT : CUDA_SUCCESS;
}

CUresult cuEventSynchronize(CUevent e) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!g_events.count(e)) return CUDA_ERROR_INVALID_HANDLE;
    return e->captured ? CUDA_ERROR_CAPTURED_EVENT : CUDA_SUCCESS;
}

CUresult cuEventElapsedTime_v2(float* ms, CUevent start, CUevent end) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!ms) return CUDA_ERROR_INVALID_VALUE;
    if (!g_events.count(start) || !g_events.count(end)) return CUDA_ERROR_INVALID_HANDLE;
    if ((start->flags | end->flags) & EVENT_DISABLE_TIMING) return CUDA_ERROR_INVALID_HANDLE;
    if (start->captured || end->captured) return CUDA_ERROR_CAPTURED_EVENT;
    if (!start->recorded || !end->recorded) return CUDA_ERROR_INVALID_HANDLE;
    *ms = (float)(end->ms - start->ms);
    return CUDA_SUCCESS;
}

CUresult cuEventElapsedTime(float* ms, CUevent start, CUevent end) { return cuEventElapsedTime_v2(ms, start, end); }

// ---- modules and functions ----------------------------------------------------------------------

CUresult cuModuleLoadData(CUmodule* out, const void* image) {
    Lock l(g_mu);
    CTX_CHECK();
    return load_module(out, image);
}

CUresult cuModuleLoadDataEx(CUmodule* out, const void* image, unsigned n, void* opts, void** vals) {
    (void)n;
    (void)opts;
    (void)vals;
    return cuModuleLoadData(out, image);
}

CUresult cuModuleLoadFatBinary(CUmodule* out, const void* image) { return cuModuleLoadData(out, image); }

CUresult cuModuleLoad(CUmodule* out, const char* path) {
    if (!path) return CUDA_ERROR_INVALID_VALUE;
    FILE* f = fopen(path, "rb");
    if (!f) return CUDA_ERROR_FILE_NOT_FOUND;
    std::vector<char> data;
    char buf[65536];
    size_t got;
    while ((got = fread(buf, 1, sizeof buf, f)) > 0) data.insert(data.end(), buf, buf + got);
    fclose(f);
    if (data.size() < 24) return CUDA_ERROR_INVALID_IMAGE;
    return cuModuleLoadData(out, data.data());
}

CUresult cuModuleUnload(CUmodule m) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!g_modules.count(m) || m->unloaded) return CUDA_ERROR_INVALID_HANDLE;
    // Graphs that launch its kernels keep it loaded until they go; its handles die now.
    m->unloaded = true;
    module_unref(m);
    return CUDA_SUCCESS;
}

CUresult cuModuleGetFunction(CUfunction* out, CUmodule m, const char* name) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!out || !name) return CUDA_ERROR_INVALID_VALUE;
    if (!g_modules.count(m) || m->unloaded) return CUDA_ERROR_INVALID_HANDLE;
    auto it = m->funcs.find(name);
    if (it != m->funcs.end()) {
        *out = it->second;
        return CUDA_SUCCESS;
    }
    if (!m->has_kernel(name)) return CUDA_ERROR_NOT_FOUND;
    std::vector<unsigned> sizes(64);
    int n = m->kernel_params(name, sizes.data(), (unsigned)sizes.size());
    if (n > (int)sizes.size()) {
        sizes.resize((size_t)n);
        n = m->kernel_params(name, sizes.data(), (unsigned)sizes.size());
    }
    if (n < 0) {
        report("cuModuleGetFunction: the module cannot give the parameters of %s", name);
        return CUDA_ERROR_INVALID_IMAGE;
    }
    sizes.resize((size_t)n);
    CUfunc_st* f = new CUfunc_st{m, name, sizes, (int)kSharedDefault, -1};
    m->funcs[name] = f;
    g_funcs.insert(f);
    *out = f;
    return CUDA_SUCCESS;
}

CUresult cuModuleGetGlobal_v2(CUdeviceptr* p, size_t* bytes, CUmodule m, const char* name) {
    (void)p;
    (void)bytes;
    Lock l(g_mu);
    INIT_CHECK();
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    if (!g_modules.count(m) || m->unloaded) return CUDA_ERROR_INVALID_HANDLE;
    // __device__ variables are not part of the module contract.
    return CUDA_ERROR_NOT_FOUND;
}

CUresult cuFuncGetName(const char** name, CUfunction f) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!name) return CUDA_ERROR_INVALID_VALUE;
    if (!g_funcs.count(f)) return CUDA_ERROR_INVALID_HANDLE;
    *name = f->name.c_str();
    return CUDA_SUCCESS;
}

CUresult cuFuncGetAttribute(int* v, int attr, CUfunction f) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!v) return CUDA_ERROR_INVALID_VALUE;
    if (!g_funcs.count(f)) return CUDA_ERROR_INVALID_HANDLE;
    switch (attr) {
        case FUNC_ATTR_MAX_THREADS_PER_BLOCK: *v = 1024; return CUDA_SUCCESS;
        case FUNC_ATTR_SHARED_SIZE_BYTES: *v = 0; return CUDA_SUCCESS;  // static shared memory is the module's business
        case FUNC_ATTR_CONST_SIZE_BYTES: *v = 0; return CUDA_SUCCESS;
        case FUNC_ATTR_LOCAL_SIZE_BYTES: *v = 0; return CUDA_SUCCESS;
        case FUNC_ATTR_NUM_REGS: *v = 32; return CUDA_SUCCESS;
        case FUNC_ATTR_PTX_VERSION: *v = 90; return CUDA_SUCCESS;
        case FUNC_ATTR_BINARY_VERSION: *v = 90; return CUDA_SUCCESS;
        case FUNC_ATTR_CACHE_MODE_CA: *v = 0; return CUDA_SUCCESS;
        case FUNC_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES: *v = f->max_dynamic_smem; return CUDA_SUCCESS;
        case FUNC_ATTR_PREFERRED_SHARED_MEMORY_CARVEOUT: *v = f->carveout; return CUDA_SUCCESS;
        default:
            if (attr > FUNC_ATTR_PREFERRED_SHARED_MEMORY_CARVEOUT && attr < FUNC_ATTR_MAX) {
                *v = 0;
                return CUDA_SUCCESS;
            }
            return CUDA_ERROR_INVALID_VALUE;
    }
}

CUresult cuFuncSetAttribute(CUfunction f, int attr, int v) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!g_funcs.count(f)) return CUDA_ERROR_INVALID_HANDLE;
    switch (attr) {
        case FUNC_ATTR_MAX_DYNAMIC_SHARED_SIZE_BYTES:
            if (v < 0 || v > (int)kSharedOptin) {
                report("cuFuncSetAttribute: %s: %d bytes of dynamic shared memory exceed the device's %u", f->name.c_str(),
                       v, kSharedOptin);
                return CUDA_ERROR_INVALID_VALUE;
            }
            f->max_dynamic_smem = v;
            return CUDA_SUCCESS;
        case FUNC_ATTR_PREFERRED_SHARED_MEMORY_CARVEOUT:
            if (v < -1 || v > 100) return CUDA_ERROR_INVALID_VALUE;
            f->carveout = v;
            return CUDA_SUCCESS;
        default:
            if (attr > FUNC_ATTR_PREFERRED_SHARED_MEMORY_CARVEOUT && attr < FUNC_ATTR_MAX) return CUDA_SUCCESS;
            return CUDA_ERROR_INVALID_VALUE;
    }
}

CUresult cuFuncSetCacheConfig(CUfunction f, int config) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!g_funcs.count(f)) return CUDA_ERROR_INVALID_HANDLE;
    if (config < 0 || config > 3) return CUDA_ERROR_INVALID_VALUE;
    return CUDA_SUCCESS;
}

// ---- launches -----------------------------------------------------------------------------------

CUresult cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                        unsigned smem, CUstream s, void** params, void** extra) {
    const unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    return launch(f, grid, block, smem, s, params, extra, nullptr, 0);
}

CUresult cuLaunchKernelEx(const CUlaunchConfig* cfg, CUfunction f, void** params, void** extra) {
    if (!cfg || (cfg->numAttrs && !cfg->attrs)) return CUDA_ERROR_INVALID_VALUE;
    const unsigned grid[3] = {cfg->gridDimX, cfg->gridDimY, cfg->gridDimZ};
    const unsigned block[3] = {cfg->blockDimX, cfg->blockDimY, cfg->blockDimZ};
    return launch(f, grid, block, cfg->sharedMemBytes, cfg->hStream, params, extra, cfg->attrs, cfg->numAttrs);
}

CUresult cuLaunchCooperativeKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                   unsigned bz, unsigned smem, CUstream s, void** params) {
    const unsigned grid[3] = {gx, gy, gz}, block[3] = {bx, by, bz};
    CUlaunchAttribute cooperative{};
    cooperative.id = 2;
    cooperative.value.i = 1;
    return launch(f, grid, block, smem, s, params, nullptr, &cooperative, 1);
}

// ---- occupancy (the figures of blocks_per_sm) ---------------------------------------------------

CUresult cuOccupancyMaxActiveBlocksPerMultiprocessor(int* n, CUfunction f, int block_size, size_t smem) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!n) return CUDA_ERROR_INVALID_VALUE;
    if (!g_funcs.count(f)) return CUDA_ERROR_INVALID_HANDLE;
    *n = blocks_per_sm(block_size, smem);
    return CUDA_SUCCESS;
}

CUresult cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* n, CUfunction f, int block_size, size_t smem,
                                                              unsigned flags) {
    (void)flags;
    return cuOccupancyMaxActiveBlocksPerMultiprocessor(n, f, block_size, smem);
}

CUresult cuOccupancyAvailableDynamicSMemPerBlock(size_t* smem, CUfunction f, int nblocks, int block_size) {
    Lock l(g_mu);
    INIT_CHECK();
    if (!smem || nblocks <= 0 || block_size <= 0) return CUDA_ERROR_INVALID_VALUE;
    if (!g_funcs.count(f)) return CUDA_ERROR_INVALID_HANDLE;
    size_t per = kSharedPerSm / (size_t)nblocks;
    per = per > 1024 ? per - 1024 : 0;
    *smem = per < kSharedOptin ? per : kSharedOptin;
    return CUDA_SUCCESS;
}

CUresult cuOccupancyMaxPotentialBlockSizeWithFlags(int* min_grid, int* block, CUfunction f, size_t (*b2smem)(int),
                                                   size_t smem, int limit, unsigned flags) {
    (void)flags;
    Lock l(g_mu);
    INIT_CHECK();
    if (!min_grid || !block) return CUDA_ERROR_INVALID_VALUE;
    if (!g_funcs.count(f)) return CUDA_ERROR_INVALID_HANDLE;
    int best = 32, best_threads = 0;
    for (int b = 32; b <= 1024 && (limit <= 0 || b <= limit); b += 32) {
        size_t s = b2smem ? b2smem(b) : smem;
        int threads = blocks_per_sm(b, s) * b;
        if (threads >= best_threads) {
            best_threads = threads;
            best = b;
        }
    }
    *block = best;
    *min_grid = blocks_per_sm(best, b2smem ? b2smem(best) : smem) * (int)kMultiprocessors;
    return CUDA_SUCCESS;
}

CUresult cuOccupancyMaxPotentialBlockSize(int* min_grid, int* block, CUfunction f, size_t (*b2smem)(int), size_t smem,
                                          int limit) {
    return cuOccupancyMaxPotentialBlockSizeWithFlags(min_grid, block, f, b2smem, smem, limit, 0);
}

// ---- entry point lookup -------------------------------------------------------------------------

CUresult cuGetProcAddress_v2(const char* symbol, void** pfn, int version, unsigned long long flags, int* status) {
    (void)version;
    (void)flags;
    if (!symbol || !pfn) return CUDA_ERROR_INVALID_VALUE;
    Dl_info info;
    void* self = nullptr;
    if (dladdr(reinterpret_cast<void*>(&cuInit), &info) && info.dli_fname)
        self = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
    void* f = nullptr;
    if (self) {
        // The versioned entry point where one exists: the name a CUDA 12/13 header maps to.
        std::string v2 = std::string(symbol) + "_v2";
        f = dlsym(self, v2.c_str());
        if (!f) f = dlsym(self, symbol);
        dlclose(self);
    }
    *pfn = f;
    if (status) *status = f ? 0 : 1;  // CU_GET_PROC_ADDRESS_SUCCESS / SYMBOL_NOT_FOUND
    return f ? CUDA_SUCCESS : CUDA_ERROR_NOT_FOUND;
}

CUresult cuGetProcAddress(const char* symbol, void** pfn, int version, unsigned long long flags) {
    return cuGetProcAddress_v2(symbol, pfn, version, flags, nullptr);
}

// NVIDIA's private interfaces between its libraries and the driver: none here. NVRTC asks for
// one when it finds a libcuda; an error answer makes it carry on without.
CUresult cuGetExportTable(const void** table, const CUuuid* id) {
    (void)id;
    if (table) *table = nullptr;
    return CUDA_ERROR_NOT_SUPPORTED;
}

// ---- for hostcuda's cuBLAS ----------------------------------------------------------------------

// Queues `run(data)` on a stream as a library operation named `what`: it runs now, or, when the
// stream captures, becomes a node of the graph. `run` returns a CUresult, which fails the call
// (or the graph launch) that ran it. `release(data)` is called once the operation can never
// run again (after it ran, or when the graph goes). Returns a CUresult.
CUresult hostcuda_stream_enqueue(CUstream s, const char* what, int (*run)(void*), void* data, void (*release)(void*)) {
    if (!run) {
        if (release) release(data);
        return CUDA_ERROR_INVALID_VALUE;
    }
    return host_fn_op(s, run, data, release, what);
}

// Checks that [p, p + n) is device-accessible memory, saying on stderr what is wrong if not, for
// a library operation that reads or writes it. Returns a CUresult.
CUresult hostcuda_check_range(const char* what, const char* which, CUdeviceptr p, size_t n) {
    Lock l(g_mu);
    return check_device_range(what, which, p, n);
}

}  // extern "C"
#pragma GCC visibility pop
