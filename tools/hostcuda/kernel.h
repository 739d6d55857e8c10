// hostcuda's kernel side: the CUDA C++ dialect of tern's kernels, executed on the CPU.
//
// translate.py prepends this header to a kernel family's source (after rewriting its inline PTX
// and shared-memory declarations into calls of this file) and compiles the result with g++ into
// a shared object that hostcuda's driver (driver.cpp) loads as a module. What it models is the
// logic a GPU test checks: every thread of a block runs as its own fiber with its own stack
// (so a thread's locals are its registers), blocks run one after another (a cooperative
// launch's all together, so that they may wait for each other), and the points where
// CUDA threads meet — __syncthreads, named barriers, warp shuffles, votes, ldmatrix, mma and
// the warpgroup products (wgmma, four warps together) — are real rendezvous: a fiber that
// reaches one waits until every thread it names has arrived. Code that only works when a warp
// runs in lockstep (shared memory read by another lane without a __syncwarp) therefore fails
// here as it may on the GPU; a rendezvous that can never complete
// (a thread waits for a lane that has exited, or a barrier some threads skip) is reported as a
// deadlock instead of hanging. Shared memory is filled with 0xff bytes (NaN as floats) at each
// block's start, so a read of shared memory no thread wrote is visible. Threads run in thread
// order between meeting points, or highest first with TERN_HOSTCUDA_ORDER=reverse: a barrier
// missing between a write and another thread's read shows in one order or the other.
//
// Not modelled: time, the order of blocks, the memory model between blocks (blocks run in
// order, or a cooperative launch's in turns between meeting points, so a race between them can
// go unseen), and the last bits of the device's own
// rounding: expf and friends are glibc's, and the tensor-core product sums exactly before its
// one rounding (the hardware truncates partial sums). The source is compiled with
// -ffp-contract=off: a multiply-add is fused only where the kernel asks for fmaf. NVRTC fuses
// where it likes, so two kernels that agree bit for bit here may still differ on a GPU: for a
// bit-for-bit test between kernels, only the GPU's run settles it.
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <memory>
#include <new>
#include <type_traits>
#include <utility>

namespace tern_host {

struct uint3_ {
    unsigned x, y, z;
};

// ---- fibers ---------------------------------------------------------------------------------

// Switches stacks: saves the callee-saved registers and the SSE/x87 control words on the
// current stack, stores its pointer in *save, and resumes the stack at load (System V x86-64).
extern "C" void tern_host_switch_stack(void** save, void* load);
asm(R"(
.text
.p2align 4
.hidden tern_host_switch_stack
.globl tern_host_switch_stack
.type tern_host_switch_stack,@function
tern_host_switch_stack:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size tern_host_switch_stack, .-tern_host_switch_stack
)");

constexpr int kMaxThreads = 1024;
constexpr size_t kStackBytes = 512 * 1024;
// Shared memory: the static declarations bump-allocate from the arena's start (at most 48 KiB,
// the static limit); the dynamic region ends flush against a PROT_NONE page, so an access past
// its end faults.
constexpr size_t kStaticShared = 48 * 1024;
constexpr size_t kMaxShared = 232448;  // per block, with the opt-in (H200)

enum class Wait : int { None, Barrier, WarpArrive, WarpRead, Sleep, GroupArrive, GroupRead, Done };

struct Thread {
    void* sp;
    uint3_ tid;
    int linear;
    Wait wait;
    int barrier_id;
    unsigned barrier_gen;
    unsigned warp_gen;
};

// A warp's rendezvous: lanes deposit a value (arrive), and once every lane of the mask has, each
// reads what it needs and leaves; the next rendezvous opens when all have left.
struct WarpSlot {
    unsigned mask = 0;
    unsigned arrived = 0;
    unsigned left = 0;
    unsigned gen = 0;
    bool reading = false;
    int kind = 0;
    uint64_t value[32];
    // Collectives that act for the whole warp at once (ldmatrix, mma) copy their operands into
    // `in` and, when the last lane arrives, compute every lane's result into `out`: a lane that
    // has read its result and moved on can then change nothing the others still read.
    uint32_t in[32][10];
    uint32_t out[32][4];
};

struct NamedBarrier {
    int expected = 0;
    int arrived = 0;
    unsigned gen = 0;
};

// A warpgroup's rendezvous for its products (wgmma): the four warps' 128 threads deposit their
// accumulators; the last to arrive computes every thread's result in their place; each takes its
// own and leaves; the next product opens when all have left.
struct WarpgroupSlot {
    int arrived = 0;
    int left = 0;
    unsigned gen = 0;
    bool reading = false;
    int n = 0, accumulate = 0, trans_a = 0;
    bool a_in_registers = false;
    uint64_t desc_a = 0, desc_b = 0;
    uint32_t a_regs[128][4];  // the register form's A fragments, by thread
    float acc[128][64];
};

struct Launch {
    void (*run)(void**) = nullptr;
    void** params = nullptr;
    const char* name = "";
    uint3_ grid{}, block{}, block_idx{};
    int nthreads = 0;
    int live = 0;
    Thread threads[kMaxThreads];
    WarpSlot warps[kMaxThreads / 32];
    NamedBarrier barriers[16];
    // Allocated at a block's first warpgroup product (a block of up to 8 warpgroups).
    std::unique_ptr<WarpgroupSlot[]> warpgroups;
    unsigned exited_mask[kMaxThreads / 32];
    Thread* current = nullptr;
    void* scheduler_sp = nullptr;
    unsigned long long epoch = 0;  // bumped by every state change; a pass without one is a deadlock
    char* shared_base = nullptr;    // shared address 0
    char* dynamic_shared = nullptr;
    size_t dynamic_bytes = 0;
    size_t static_used = 0;
    // Static __shared__ declarations met in this block: their offsets by declaration id.
    static constexpr int kMaxDecls = 256;
    const void* decl_key[kMaxDecls];
    size_t decl_offset[kMaxDecls];
    int decls = 0;
    char error[512];
    bool failed = false;
};

// The block whose threads run now. A plain launch runs its blocks one after another through
// one Launch; a cooperative launch runs every block's threads as fibers of one scheduler, each
// block its own Launch, and the scheduler points this at the block of the fiber it resumes.
inline Launch*& current_block() {
    static Launch first;
    static Launch* current = &first;
    return current;
}
inline Launch& L() { return *current_block(); }

[[noreturn]] inline void fail_thread();

// Records the first error of the launch and ends the calling thread; the scheduler then stops
// the launch.
inline void fault(const char* fmt, const char* a = "", long long b = 0, long long c = 0) {
    Launch& l = L();
    if (!l.failed) {
        char what[384];
        snprintf(what, sizeof what, fmt, a, b, c);
        const Thread* t = l.current;
        snprintf(l.error, sizeof l.error, "%s block (%u,%u,%u) thread (%u,%u,%u): %s", l.name, l.block_idx.x,
                 l.block_idx.y, l.block_idx.z, t ? t->tid.x : 0, t ? t->tid.y : 0, t ? t->tid.z : 0, what);
        l.failed = true;
    }
    fail_thread();
}

inline void yield() {
    Launch& l = L();
    tern_host_switch_stack(&l.current->sp, l.scheduler_sp);
    if (l.failed) fail_thread();
}

[[noreturn]] inline void fail_thread() {
    Launch& l = L();
    l.current->wait = Wait::Done;
    for (;;) tern_host_switch_stack(&l.current->sp, l.scheduler_sp);
}

inline int lane_id() { return L().current->linear & 31; }
inline int warp_id() { return L().current->linear >> 5; }

// Lanes of the calling thread's warp that exist in this block.
inline unsigned warp_lanes() {
    const Launch& l = L();
    const int first = warp_id() * 32;
    const int n = l.nthreads - first < 32 ? l.nthreads - first : 32;
    return n == 32 ? 0xffffffffu : ((1u << n) - 1);
}

// ---- barriers -------------------------------------------------------------------------------

inline void named_barrier(int id, int expected) {
    Launch& l = L();
    if (id < 0 || id > 15) fault("barrier id %s%lld out of range", "", id);
    NamedBarrier& b = l.barriers[id];
    if (b.arrived == 0) b.expected = expected;
    else if (b.expected != expected) fault("bar.sync %s%lld: thread counts disagree (%lld)", "", id, expected);
    const unsigned gen = b.gen;
    ++b.arrived;
    ++l.epoch;
    // Block barrier 0 counts the threads still running (an exited thread counts as arrived).
    const int need = expected < 0 ? l.live : expected;
    if (b.arrived >= need) {
        b.arrived = 0;
        ++b.gen;
        return;
    }
    Thread* t = l.current;
    t->wait = Wait::Barrier;
    t->barrier_id = id;
    t->barrier_gen = gen;
    while (b.gen == gen) yield();
    t->wait = Wait::None;
}

// Releases block barrier 0 when the threads still waiting at it are now all the running ones.
inline void recheck_block_barrier() {
    Launch& l = L();
    NamedBarrier& b = l.barriers[0];
    if (b.arrived > 0 && b.expected < 0 && b.arrived >= l.live) {
        b.arrived = 0;
        ++b.gen;
        ++l.epoch;
    }
}

// ---- warp rendezvous ------------------------------------------------------------------------

enum Kind { kShfl = 1, kVote, kMatch, kLdmatrix, kMma, kMmaTf32, kSync };

// Deposits this lane's value (and address) and waits until every lane of mask has; returns the
// slot, readable until leave().
inline WarpSlot& arrive(unsigned mask, int kind, uint64_t value, const uint32_t* in = nullptr, int n_in = 0,
                        void (*complete)(WarpSlot&) = nullptr) {
    Launch& l = L();
    const int lane = lane_id();
    WarpSlot& w = l.warps[warp_id()];
    if (!(mask >> lane & 1)) fault("warp collective with a mask (%s0x%llx) that leaves out the calling lane", "", mask);
    const unsigned exists = warp_lanes();
    if (mask & ~exists) fault("warp collective names lanes that do not exist in this block (mask %s0x%llx)", "", mask);
    Thread* t = l.current;
    t->wait = Wait::WarpArrive;
    while (w.reading) yield();
    if (w.arrived == 0) {
        w.mask = mask;
        w.kind = kind;
    } else if (w.mask != mask || w.kind != kind) {
        fault("lanes of a warp meet at different collectives (masks %s0x%llx and 0x%llx)", "", w.mask, mask);
    }
    if (mask & l.exited_mask[warp_id()]) fault("warp collective waits for a lane that has exited (mask %s0x%llx)", "", mask);
    w.value[lane] = value;
    for (int i = 0; i < n_in; ++i) w.in[lane][i] = in[i];
    w.arrived |= 1u << lane;
    ++l.epoch;
    const unsigned gen = w.gen;
    if (w.arrived == mask) {
        if (complete) complete(w);
        w.reading = true;
    }
    t->wait = Wait::WarpRead;
    t->warp_gen = gen;
    while (!(w.reading && w.gen == gen)) yield();
    t->wait = Wait::None;
    return w;
}

inline void leave(WarpSlot& w) {
    w.left |= 1u << lane_id();
    ++L().epoch;
    if (w.left == w.mask) {
        w.arrived = w.left = 0;
        w.reading = false;
        ++w.gen;
    }
}

template <class T>
inline uint64_t bits_of(T v) {
    static_assert(sizeof(T) <= 8, "warp exchanges move at most 8 bytes");
    uint64_t u = 0;
    memcpy(&u, &v, sizeof(T));
    return u;
}
template <class T>
inline T from_bits(uint64_t u) {
    T v;
    memcpy(&v, &u, sizeof(T));
    return v;
}

// Lane src's value, src computed by the caller per CUDA's rules; a lane outside the mask is an
// error (its value is undefined on the GPU).
template <class T>
inline T shuffle(unsigned mask, T v, int src) {
    WarpSlot& w = arrive(mask, kShfl, bits_of(v));
    if (!(w.mask >> src & 1)) fault("shuffle reads lane %s%lld, which is not in the mask", "", src);
    const T r = from_bits<T>(w.value[src]);
    leave(w);
    return r;
}

inline unsigned ballot(unsigned mask, bool p) {
    WarpSlot& w = arrive(mask, kVote, p);
    unsigned r = 0;
    for (int i = 0; i < 32; ++i)
        if ((w.mask >> i & 1) && w.value[i]) r |= 1u << i;
    leave(w);
    return r;
}

inline unsigned match_any(unsigned mask, uint64_t v) {
    WarpSlot& w = arrive(mask, kMatch, v);
    unsigned r = 0;
    for (int i = 0; i < 32; ++i)
        if ((w.mask >> i & 1) && w.value[i] == v) r |= 1u << i;
    leave(w);
    return r;
}

// ---- shared memory --------------------------------------------------------------------------

inline void* static_shared(const void* key, size_t bytes) {
    Launch& l = L();
    for (int i = 0; i < l.decls; ++i)
        if (l.decl_key[i] == key) return l.shared_base + l.decl_offset[i];
    if (l.decls == Launch::kMaxDecls) fault("too many __shared__ declarations%s");
    const size_t at = (l.static_used + 15) & ~size_t(15);
    if (at + bytes > kStaticShared) fault("static shared memory over 48 KiB (%s%lld bytes)", "", (long long)(at + bytes));
    if (at + bytes + l.dynamic_bytes > kMaxShared)
        fault("static (%s%lld) plus dynamic shared memory over the block's 227 KiB", "", (long long)(at + bytes));
    l.decl_key[l.decls] = key;
    l.decl_offset[l.decls++] = at;
    l.static_used = at + bytes;
    return l.shared_base + at;
}

inline void* dynamic_shared() { return L().dynamic_shared; }

inline unsigned shared_address(const void* p) {
    const Launch& l = L();
    const char* c = static_cast<const char*>(p);
    if (c < l.shared_base || c >= l.dynamic_shared + l.dynamic_bytes + 16)
        fault("a shared address taken of a pointer outside shared memory%s");
    return (unsigned)(c - l.shared_base);
}

inline char* shared_pointer(unsigned a, size_t bytes) {
    const Launch& l = L();
    char* p = l.shared_base + a;
    const bool in_static = a + bytes <= kStaticShared;
    const bool in_dynamic = p >= l.dynamic_shared && p + bytes <= l.dynamic_shared + l.dynamic_bytes;
    if (!in_static && !in_dynamic) fault("shared address %s0x%llx is outside the block's shared memory", "", a);
    return p;
}

// ---- numbers --------------------------------------------------------------------------------

inline float f32_of_bits(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}
inline uint32_t bits_of_f32(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}
// f32 -> bf16, round to nearest even; NaN stays a (quiet) NaN, as cvt.rn.bf16.f32 gives.
inline uint16_t bf16_rne(float f) {
    const uint32_t u = bits_of_f32(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fff;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1)) >> 16);
}
inline float f32_of_bf16(uint32_t b) { return f32_of_bits(b << 16); }
inline float f32_of_f16(uint16_t h) {
    const uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 31, man = h & 1023;
    if (exp == 31) return f32_of_bits(sign | 0x7f800000u | (man << 13));
    if (exp == 0) {
        const float m = ldexpf((float)man, -24);
        return sign ? -m : m;
    }
    return f32_of_bits(sign | ((exp + 112) << 23) | (man << 13));
}

}  // namespace tern_host

// ---- the CUDA dialect -----------------------------------------------------------------------

#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __builtin_assume(x) ((void)0)

#define threadIdx (tern_host::L().current->tid)
#define blockIdx (tern_host::L().block_idx)
#define blockDim (tern_host::L().block)
#define gridDim (tern_host::L().grid)
constexpr int warpSize = 32;

struct alignas(8) float2 { float x, y; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(8) int2 { int x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(16) double2 { double x, y; };
inline float2 make_float2(float x, float y) { return {x, y}; }
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline int4 make_int4(int x, int y, int z, int w) { return {x, y, z, w}; }
inline int2 make_int2(int x, int y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
inline uint2 make_uint2(unsigned x, unsigned y) { return {x, y}; }

// CUDA's min and max overloads, by value in the arguments' usual arithmetic conversion (int and
// unsigned meet as unsigned, as umin does).
template <class A, class B>
inline std::common_type_t<A, B> min(A a, B b) {
    using T = std::common_type_t<A, B>;
    return (T)b < (T)a ? (T)b : (T)a;
}
template <class A, class B>
inline std::common_type_t<A, B> max(A a, B b) {
    using T = std::common_type_t<A, B>;
    return (T)a < (T)b ? (T)b : (T)a;
}
using std::isinf;
using std::isnan;
using std::isfinite;

inline void __syncthreads() { tern_host::named_barrier(0, -1); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    tern_host::WarpSlot& w = tern_host::arrive(mask, tern_host::kSync, 0);
    tern_host::leave(w);
}
// Every thread of a launch runs on one OS thread: a write is visible to whatever runs after it.
inline void __threadfence() {}
inline void __threadfence_block() {}

template <class T>
inline T __shfl_sync(unsigned mask, T v, int src, int width = 32) {
    const int lane = tern_host::lane_id();
    return tern_host::shuffle(mask, v, (lane & ~(width - 1)) + (src & (width - 1)));
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int m, int width = 32) {
    const int lane = tern_host::lane_id(), src = lane ^ m;
    return tern_host::shuffle(mask, v, src >= ((lane & ~(width - 1)) + width) ? lane : src);
}
template <class T>
inline T __shfl_up_sync(unsigned mask, T v, unsigned d, int width = 32) {
    const int lane = tern_host::lane_id(), src = lane - (int)d;
    return tern_host::shuffle(mask, v, src < (lane & ~(width - 1)) ? lane : src);
}
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned d, int width = 32) {
    const int lane = tern_host::lane_id(), src = lane + (int)d;
    return tern_host::shuffle(mask, v, src >= ((lane & ~(width - 1)) + width) ? lane : src);
}
inline unsigned __ballot_sync(unsigned mask, int p) { return tern_host::ballot(mask, p != 0); }
inline int __any_sync(unsigned mask, int p) { return tern_host::ballot(mask, p != 0) != 0; }
inline int __all_sync(unsigned mask, int p) { return tern_host::ballot(mask, p != 0) == (mask & tern_host::warp_lanes()); }
template <class T>
inline unsigned __match_any_sync(unsigned mask, T v) { return tern_host::match_any(mask, tern_host::bits_of(v)); }
inline unsigned __activemask() { return tern_host::warp_lanes(); }

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline unsigned __brev(unsigned x) {
    unsigned r = 0;
    for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
    return r;
}
// prmt.b32 in its default mode: byte i of the result is byte (s >> 4i) & 7 of {y, x}.
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const uint64_t xy = (uint64_t)y << 32 | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)((xy >> (8 * ((s >> (4 * i)) & 7))) & 0xff) << (8 * i);
    return r;
}
inline float __uint_as_float(unsigned u) { return tern_host::f32_of_bits(u); }
inline unsigned __float_as_uint(float f) { return tern_host::bits_of_f32(f); }
inline float __int_as_float(int i) { return tern_host::f32_of_bits((uint32_t)i); }
inline int __float_as_int(float f) { return (int)tern_host::bits_of_f32(f); }
inline long long __double_as_longlong(double d) {
    long long r;
    memcpy(&r, &d, 8);
    return r;
}
inline double __longlong_as_double(long long r) {
    double d;
    memcpy(&d, &r, 8);
    return d;
}
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __fsqrt_rn(float a) { return sqrtf(a); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline double rsqrt(double x) { return 1.0 / sqrt(x); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }

template <class T>
inline T __ldg(const T* p) { return *p; }
template <class T>
inline T __ldcg(const T* p) { return *p; }
template <class T>
inline T __ldca(const T* p) { return *p; }
template <class T>
inline T __ldcs(const T* p) { return *p; }
template <class T>
inline T __ldlu(const T* p) { return *p; }
template <class T>
inline void __stcs(T* p, T v) { *p = v; }
template <class T>
inline void __stcg(T* p, T v) { *p = v; }
template <class T>
inline void __stwt(T* p, T v) { *p = v; }

// Atomics: one OS thread runs every thread of the grid, and a fiber only yields at a
// rendezvous, so a read-modify-write is atomic as written. Each counts as progress for the
// deadlock check: another block's thread may be spinning on the word it changes.
namespace tern_host {
inline void progress() { ++L().epoch; }
}  // namespace tern_host
template <class T, class U>
inline T atomicAdd(T* p, U v) { tern_host::progress(); const T o = *p; *p = (T)(o + (T)v); return o; }
template <class T, class U>
inline T atomicSub(T* p, U v) { tern_host::progress(); const T o = *p; *p = (T)(o - (T)v); return o; }
template <class T, class U>
inline T atomicMax(T* p, U v) { tern_host::progress(); const T o = *p; if ((T)v > o) *p = (T)v; return o; }
template <class T, class U>
inline T atomicMin(T* p, U v) { tern_host::progress(); const T o = *p; if ((T)v < o) *p = (T)v; return o; }
template <class T, class U>
inline T atomicExch(T* p, U v) { tern_host::progress(); const T o = *p; *p = (T)v; return o; }
template <class T, class U>
inline T atomicOr(T* p, U v) { tern_host::progress(); const T o = *p; *p = o | (T)v; return o; }
template <class T, class U>
inline T atomicAnd(T* p, U v) { tern_host::progress(); const T o = *p; *p = o & (T)v; return o; }
template <class T, class U, class V>
inline T atomicCAS(T* p, U expected, V v) { tern_host::progress(); const T o = *p; if (o == (T)expected) *p = (T)v; return o; }
template <class T>
inline T atomicInc(T* p, T limit) { tern_host::progress(); const T o = *p; *p = o >= limit ? 0 : o + 1; return o; }

// A thread that waits for another block (a spin on memory, as a grid barrier does) must sleep in
// its loop: here the sleep hands the OS thread to the other fibers, which a spin without one
// would never do, and is no progress by itself, so a grid whose threads all sleep or wait at
// rendezvous is reported as a deadlock.
inline void __nanosleep(unsigned) {
    tern_host::Thread* t = tern_host::L().current;
    t->wait = tern_host::Wait::Sleep;
    tern_host::yield();
    t->wait = tern_host::Wait::None;
}

inline size_t __cvta_generic_to_shared(const void* p) { return tern_host::shared_address(p); }

// ---- the PTX instructions tern's kernels write inline (translate.py maps each asm statement
// to one of these, outputs by pointer in operand order, then inputs) --------------------------

namespace tern_host_ptx {
using namespace tern_host;

// ldmatrix .x4: lane i names row i % 8 of matrix i / 8 (eight b16 at its address); lane l
// receives, of each matrix m, row l / 4, columns 2(l % 4) and 2(l % 4) + 1 (lower column in the
// low half), or with .trans the same of the transposed matrix.
template <bool Trans>
inline void ldmatrix_all(WarpSlot& w) {
    for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        for (int m = 0; m < 4; ++m) {
            uint16_t e[2];
            for (int j = 0; j < 2; ++j) {
                const int row = Trans ? 2 * t + j : g, col = Trans ? g : 2 * t + j;
                const unsigned a = (unsigned)w.value[m * 8 + row];
                if (a % 16) fault("ldmatrix row address %s0x%llx is not 16-byte aligned", "", a);
                memcpy(&e[j], shared_pointer(a, 16) + 2 * col, 2);
            }
            w.out[lane][m] = (uint32_t)e[1] << 16 | e[0];
        }
    }
}

// ldmatrix .x4: lane i names row i % 8 of matrix i / 8 (eight b16 at its address); lane l
// receives, of each matrix m, row l / 4, columns 2(l % 4) and 2(l % 4) + 1 (lower column in the
// low half), or with .trans the same of the transposed matrix.
template <class O, class A>
inline void ldmatrix_x4(bool trans, O* r0, O* r1, O* r2, O* r3, A addr) {
    WarpSlot& w = arrive(0xffffffffu, kLdmatrix, (uint64_t)(unsigned)addr, nullptr, 0, trans ? ldmatrix_all<true> : ldmatrix_all<false>);
    const int lane = lane_id();
    *r0 = (O)w.out[lane][0];
    *r1 = (O)w.out[lane][1];
    *r2 = (O)w.out[lane][2];
    *r3 = (O)w.out[lane][3];
    leave(w);
}

// mma.sync m16n8k16 row.col f32 += bf16 · bf16, fragments as the PTX ISA lays them out (g = lane
// / 4, t = lane % 4): A a0 = (g, 2t..2t+1), a1 = (g + 8, 2t..), a2 = (g, 2t + 8..), a3 = (g + 8,
// 2t + 8..); B b0 = (k 2t..2t+1, n g), b1 = (k 2t + 8.., n g); C c0..1 = (g, 2t..2t+1), c2..3 =
// (g + 8, 2t..). Lane inputs: a0..a3, b0, b1, then the accumulators' bits. The 16
// products of an output are exact in double; their sum and c round once.
//
// Element (row, k) of a warp's 16 x 16 A fragment, from its lanes' registers a0..a3 (the first
// four of each lane's row of `lanes`); the warpgroup products' register form lays out each
// warp's 16 rows the same way (wgmma_register_operand).
template <size_t R>
inline float mma_a_element(const uint32_t (*lanes)[R], int row, int k) {
    const uint32_t reg = lanes[(row % 8) * 4 + (k % 8) / 2][(row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)];
    return f32_of_bf16(k % 2 ? reg >> 16 : reg & 0xffff);
}

// Each lane's four outputs of an m16n8 product (C's layout, c0..1 = (g, 2t..2t+1), c2..3 = (g +
// 8, 2t..), the same for both shapes) from the operands' elements A(row, k) and B(k, n), k < K,
// and the accumulators' bits after the six operand registers.
template <int K, class FA, class FB>
inline void mma_m16n8_outputs(WarpSlot& w, FA A, FB B) {
    for (int lane = 0; lane < 32; ++lane) {
        const int g = lane / 4, t = lane % 4;
        for (int i = 0; i < 4; ++i) {
            const int row = g + (i >= 2 ? 8 : 0), col = 2 * t + (i % 2);
            double s = 0.0;
            for (int k = 0; k < K; ++k) s += A(row, k) * B(k, col);
            const float c = f32_of_bits(w.in[lane][6 + i]);
            w.out[lane][i] = bits_of_f32((float)(s + (double)c));
        }
    }
}

inline void mma_all(WarpSlot& w) {
    auto A = [&](int row, int k) { return (double)mma_a_element(w.in, row, k); };
    auto B = [&](int k, int n) {
        const uint32_t reg = w.in[n * 4 + (k % 8) / 2][4 + (k >= 8 ? 1 : 0)];
        return (double)f32_of_bf16(k % 2 ? reg >> 16 : reg & 0xffff);
    };
    mma_m16n8_outputs<16>(w, A, B);
}

// mma.sync m16n8k8 row.col f32 += tf32 · tf32 (g = lane / 4, t = lane % 4): A a0 = (g, t), a1 =
// (g + 8, t), a2 = (g, t + 4), a3 = (g + 8, t + 4); B b0 = (k t, n g), b1 = (k t + 4, n g); C as
// m16n8k16's. An operand is read as tf32, its 13 low mantissa bits dropped (tern rounds
// operands with cvt.rna.tf32.f32 first, so none are there to drop); the 8 products are exact in
// double, their sum and c round once.
inline void mma_tf32_all(WarpSlot& w) {
    auto tf32 = [](uint32_t u) { return (double)f32_of_bits(u & 0xffffe000u); };
    auto A = [&](int row, int k) { return tf32(w.in[(row % 8) * 4 + k % 4][(row >= 8 ? 1 : 0) + (k >= 4 ? 2 : 0)]); };
    auto B = [&](int k, int n) { return tf32(w.in[n * 4 + k % 4][4 + (k >= 4 ? 1 : 0)]); };
    mma_m16n8_outputs<8>(w, A, B);
}

// One m16n8 product of the warp. Lane inputs: a0..a3, b0, b1, then the accumulators' bits.
template <class C, class I>
inline void mma_m16n8(int kind, void (*complete)(WarpSlot&), C* d0, C* d1, C* d2, C* d3, I a0, I a1, I a2, I a3, I b0, I b1) {
    const uint32_t in[10] = {(uint32_t)a0, (uint32_t)a1, (uint32_t)a2, (uint32_t)a3, (uint32_t)b0, (uint32_t)b1,
                             bits_of_f32(*d0), bits_of_f32(*d1), bits_of_f32(*d2), bits_of_f32(*d3)};
    const int lane = lane_id();
    WarpSlot& w = arrive(0xffffffffu, kind, 0, in, 10, complete);
    *d0 = f32_of_bits(w.out[lane][0]);
    *d1 = f32_of_bits(w.out[lane][1]);
    *d2 = f32_of_bits(w.out[lane][2]);
    *d3 = f32_of_bits(w.out[lane][3]);
    leave(w);
}

template <class C, class I>
inline void mma_m16n8k16_bf16(C* d0, C* d1, C* d2, C* d3, I a0, I a1, I a2, I a3, I b0, I b1) {
    mma_m16n8(kMma, mma_all, d0, d1, d2, d3, a0, a1, a2, a3, b0, b1);
}

template <class C, class I>
inline void mma_m16n8k8_tf32(C* d0, C* d1, C* d2, C* d3, I a0, I a1, I a2, I a3, I b0, I b1) {
    mma_m16n8(kMmaTf32, mma_tf32_all, d0, d1, d2, d3, a0, a1, a2, a3, b0, b1);
}

// f32 -> tf32 (10 mantissa bits) as f32 bits, to nearest with ties away from zero: half the
// dropped unit added to the magnitude, then the 13 low bits cleared. NaN stays NaN.
template <class O>
inline void cvt_rna_tf32_f32(O* d, float x) {
    const uint32_t u = bits_of_f32(x);
    *d = (O)((u & 0x7fffffffu) > 0x7f800000u ? u : (u + 0x1000u) & 0xffffe000u);
}

template <class O>
inline void cvt_rn_bf16x2_f32(O* d, float hi, float lo) { *d = (O)((uint32_t)bf16_rne(hi) << 16 | bf16_rne(lo)); }
template <class O>
inline void cvt_rn_bf16_f32(O* d, float x) { *d = (O)bf16_rne(x); }
template <class O, class H>
inline void cvt_f32_f16(O* d, H h) { *d = f32_of_f16((uint16_t)h); }
template <class O, class P>
inline void cvta_to_shared_u32(O* d, P p) { *d = (O)shared_address((const void*)p); }

// cp.async 16 bytes: done at once (a wait then has nothing to wait for). With a source size,
// the bytes past it are zeros and, at size 0, the source is not read.
template <class A, class P>
inline void cp_async_16(A dst, P src) { memcpy(shared_pointer((unsigned)dst, 16), (const void*)src, 16); }
template <class A, class P, class N>
inline void cp_async_16_n(A dst, P src, N n) {
    char* d = shared_pointer((unsigned)dst, 16);
    const unsigned bytes = (unsigned)n;
    if (bytes > 16) fault("cp.async source size %s%lld over 16", "", bytes);
    if (bytes) memcpy(d, (const void*)src, bytes);
    memset(d + bytes, 0, 16 - bytes);
}
inline void cp_async_commit_group() {}
template <class N>
inline void cp_async_wait_group(N) {}
inline void cp_async_wait_all() {}
template <class P>
inline void prefetch(P) {}
template <class I, class N>
inline void bar_sync(I id, N count) {
    if ((int)count % 32) fault("bar.sync thread count %s%lld is not a multiple of 32", "", (int)count);
    named_barrier((int)id, (int)count);
}
inline void griddepcontrol() {}

// ---- warpgroup products (wgmma; src/kernels/wgmma.cuh) ---------------------------------------
// Modelled: bf16 operands, unswizzled: B from shared memory K-major, A from shared memory K-major
// or M-major or from registers (translate.py refuses other forms); scales of 1, f32
// accumulators. A product completes when the last thread of the warpgroup arrives, so fences,
// commits and waits have nothing to order; the tiles are read at that moment. Each output sums its 16 products exactly and rounds once with the accumulator
// (as mma_all; the hardware's own partial sums differ in the last bits).
inline void wgmma_fence() {}
inline void wgmma_commit_group() {}
template <class N>
inline void wgmma_wait_group(N) {}
inline void fence_proxy_async() {}

// The shared address a descriptor's 14-bit start field (address / 16, modulo 256 KiB) names.
// On the GPU every shared address is below 228 KiB; here the dynamic region lies at the end of
// a larger arena (kernel.h's layout, for its guard page), so its addresses may pass 256 KiB:
// the one candidate inside the block's shared memory is the address.
inline unsigned wgmma_start(uint64_t desc) {
    const Launch& l = L();
    const size_t dyn = (size_t)(l.dynamic_shared - l.shared_base);
    unsigned found = 0;
    int n = 0;
    for (unsigned c = (unsigned)(desc & 0x3fff) << 4; c < dyn + l.dynamic_bytes + 0x40000; c += 0x40000)
        if (c < l.static_used || (c >= dyn && c < dyn + l.dynamic_bytes)) {
            found = c;
            ++n;
        }
    if (n != 1) fault("wgmma descriptor start (%s0x%llx) names %lld places in this block's shared memory", "", (long long)(desc & 0x3fff) << 4, n);
    return found;
}

// The `rows` x 16 operand tile without swizzle that a descriptor places, into out[r][k] (read
// once per product: the descriptor's fields decoded once). K-major: a core matrix's 16-byte rows
// run along k (one row per r); M-major (`mn`): along r (one row per k), as
// tern_wgmma_offset_mn in src/kernels/wgmma.cuh.
inline void wgmma_operand(uint64_t desc, int rows, float (*out)[16], bool mn = false) {
    if ((desc >> 62) != 0 || ((desc >> 49) & 7) != 0) fault("wgmma descriptor with a swizzle or base offset (%s0x%llx): not modelled", "", (long long)desc);
    const unsigned start = wgmma_start(desc), lbo = (unsigned)(desc >> 16 & 0x3fff) << 4, sbo = (unsigned)(desc >> 32 & 0x3fff) << 4;
    for (int r = 0; r < rows; ++r)
        for (int k = 0; k < 16; ++k) {
            const unsigned in_core = mn ? (unsigned)(k % 8) * 16 + (unsigned)(r % 8) * 2 : (unsigned)(r % 8) * 16 + (unsigned)(k % 8) * 2;
            const unsigned at = start + (unsigned)(r / 8) * sbo + (unsigned)(k / 8) * lbo + in_core;
            uint16_t b;
            memcpy(&b, shared_pointer(at, 2), 2);
            out[r][k] = f32_of_bf16(b);
        }
}

// The 64 x 16 A tile of the register form from its threads' fragments: warp w's rows 16 w ..
// 16 w + 15 as mma.sync's A fragment (mma_a_element).
inline void wgmma_register_operand(const uint32_t (&regs)[128][4], float (*out)[16]) {
    for (int w = 0; w < 4; ++w)
        for (int row = 0; row < 16; ++row)
            for (int k = 0; k < 16; ++k) out[16 * w + row][k] = mma_a_element(regs + 32 * w, row, k);
}

inline void wgmma_complete(WarpgroupSlot& s) {
    float a[64][16], b[128][16];
    if (s.a_in_registers) wgmma_register_operand(s.a_regs, a);
    else wgmma_operand(s.desc_a, 64, a, s.trans_a != 0);
    wgmma_operand(s.desc_b, s.n, b);
    for (int i = 0; i < 128; ++i) {
        const int w = i / 32, g = (i % 32) / 4, q = i % 4;
        for (int j = 0; j < s.n / 2; ++j) {
            const int row = 16 * w + g + 8 * ((j / 2) % 2), col = 8 * (j / 4) + 2 * q + j % 2;
            double sum = 0.0;
            for (int k = 0; k < 16; ++k) sum += (double)a[row][k] * (double)b[col][k];
            s.acc[i][j] = s.accumulate ? (float)(sum + (double)s.acc[i][j]) : (float)sum;
        }
    }
}

// d (+)= A B^T, A 64 x 16 (M-major where TRANS_A) and B N x 16: every thread of the warpgroup passes its N / 2
// accumulators (their addresses), the two descriptors and whether to accumulate.
// a_regs: the register form's four A registers of this thread, or null (A from desc_a).
template <int N, int TRANS_A>
inline void wgmma_product(float* const (&d)[N / 2], uint64_t desc_a, const uint32_t* a_regs, uint64_t desc_b, int accumulate) {
    static_assert(N % 8 == 0 && N >= 8 && N <= 128, "wgmma n: a multiple of 8 up to 128");
    Launch& l = L();
    if (l.nthreads % 128) fault("wgmma in a block of %s%lld threads: not whole warpgroups", "", l.nthreads);
    if (!l.warpgroups) l.warpgroups.reset(new WarpgroupSlot[kMaxThreads / 128]);
    Thread* t = l.current;
    const int group = t->linear / 128, i = t->linear % 128;
    if (l.exited_mask[4 * group] | l.exited_mask[4 * group + 1] | l.exited_mask[4 * group + 2] | l.exited_mask[4 * group + 3])
        fault("wgmma waits for threads of its warpgroup that have exited%s");
    WarpgroupSlot& s = l.warpgroups[group];
    t->wait = Wait::GroupArrive;
    while (s.reading) yield();
    const int acc = accumulate != 0;
    const bool in_registers = a_regs != nullptr;
    if (s.arrived == 0) {
        s.n = N;
        s.accumulate = acc;
        s.trans_a = TRANS_A;
        s.a_in_registers = in_registers;
        s.desc_a = desc_a;
        s.desc_b = desc_b;
    } else if (s.n != N || s.accumulate != acc || s.trans_a != TRANS_A || s.a_in_registers != in_registers || s.desc_a != desc_a || s.desc_b != desc_b) {
        fault("threads of a warpgroup meet at different wgmma products (descriptor %s0x%llx and 0x%llx)", "", (long long)s.desc_b, (long long)desc_b);
    }
    if (in_registers)
        for (int r = 0; r < 4; ++r) s.a_regs[i][r] = a_regs[r];
    for (int j = 0; j < N / 2; ++j) s.acc[i][j] = *d[j];
    ++s.arrived;
    ++l.epoch;
    const unsigned gen = s.gen;
    if (s.arrived == 128) {
        wgmma_complete(s);
        s.reading = true;
    }
    t->wait = Wait::GroupRead;
    while (!(s.reading && s.gen == gen)) yield();
    t->wait = Wait::None;
    for (int j = 0; j < N / 2; ++j) *d[j] = s.acc[i][j];
    ++l.epoch;
    if (++s.left == 128) {
        s.arrived = s.left = 0;
        s.reading = false;
        ++s.gen;
    }
}

template <int N, int TRANS_A, class DA, class DB, class S>
inline void wgmma_m64k16_bf16(float* const (&d)[N / 2], DA desc_a, DB desc_b, S accumulate) {
    wgmma_product<N, TRANS_A>(d, (uint64_t)desc_a, nullptr, (uint64_t)desc_b, (int)accumulate);
}

// The register form: A's fragments in four registers of each thread (wgmma_register_operand).
template <int N, class R, class DB, class S>
inline void wgmma_m64k16_bf16_rs(float* const (&d)[N / 2], R a0, R a1, R a2, R a3, DB desc_b, S accumulate) {
    const uint32_t regs[4] = {(uint32_t)a0, (uint32_t)a1, (uint32_t)a2, (uint32_t)a3};
    wgmma_product<N, 0>(d, 0, regs, (uint64_t)desc_b, (int)accumulate);
}
}  // namespace tern_host_ptx

// ---- launching (translate.py appends the table of the source's kernels) ----------------------

namespace tern_host {

struct Kernel {
    const char* name;
    void (*run)(void**);
    unsigned nparams;
    const unsigned* sizes;
};

template <class... A, size_t... I>
inline void call_with(void (*f)(A...), void** p, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<std::remove_reference_t<A>>*>(p[I])...);
}
template <class... A>
inline void call(void (*f)(A...), void** p) { call_with(f, p, std::index_sequence_for<A...>{}); }
template <class... A>
struct ParamSizes {
    static constexpr unsigned n = sizeof...(A);
    static constexpr unsigned sizes[sizeof...(A) + 1] = {(unsigned)sizeof(std::remove_cv_t<A>)..., 0};
};
template <class... A>
constexpr ParamSizes<A...> param_sizes(void (*)(A...)) { return {}; }

// ---- the scheduler ----------------------------------------------------------------------------

// Where a new fiber starts: runs the kernel, then leaves for good.
extern "C" inline void tern_host_fiber_start() {
    Launch& l = L();
    l.run(l.params);
    Thread* t = l.current;
    t->wait = Wait::Done;
    --l.live;
    l.exited_mask[t->linear >> 5] |= 1u << (t->linear & 31);
    ++l.epoch;
    recheck_block_barrier();
    for (;;) tern_host_switch_stack(&t->sp, l.scheduler_sp);
}

#include <sys/mman.h>
#include <unistd.h>

// The threads' stacks and the shared-memory arena of this module, mapped at its first launch
// and unmapped when the driver unloads it. The stacks are one mapping without guard pages
// between them: a process holds a few hundred modules over a test run, and 1024 guard pages a
// module would split it into more mappings than Linux allows a process (vm.max_map_count).
struct Memory {
    char* stacks = nullptr;     // kMaxThreads stacks of kStackBytes
    size_t stack_stride = 0;
    char* shared = nullptr;     // the arena, then a PROT_NONE page
    size_t shared_bytes = 0;
    size_t page = 0;
    ~Memory() {
        if (stacks) munmap(stacks, stack_stride * kMaxThreads);
        if (shared) munmap(shared, shared_bytes + page);
    }
};

inline const char* memory(Memory*& out) {
    static Memory m;
    if (!m.stacks) {
        m.page = (size_t)sysconf(_SC_PAGESIZE);
        m.stack_stride = kStackBytes;
        void* s = mmap(nullptr, m.stack_stride * kMaxThreads, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (s == MAP_FAILED) return "cannot map the threads' stacks";
        m.shared_bytes = (kStaticShared + kMaxShared + m.page - 1) / m.page * m.page;
        void* a = mmap(nullptr, m.shared_bytes + m.page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (a == MAP_FAILED) {
            munmap(s, m.stack_stride * kMaxThreads);
            return "cannot map shared memory";
        }
        mprotect((char*)a + m.shared_bytes, m.page, PROT_NONE);
        m.stacks = (char*)s;
        m.shared = (char*)a;
        if (getenv("TERN_HOSTCUDA_DEBUG"))
            fprintf(stderr, "hostcuda: stacks %p..%p, shared memory %p..%p (guard page after)\n", (void*)m.stacks,
                    (void*)(m.stacks + m.stack_stride * kMaxThreads), (void*)m.shared, (void*)(m.shared + m.shared_bytes));
    }
    out = &m;
    return nullptr;
}

// A fresh stack whose first switch "returns" into tern_host_fiber_start with the control words
// the scheduler runs with.
inline void* fresh_stack(char* top) {
    uint64_t* sp = reinterpret_cast<uint64_t*>((uintptr_t)top & ~uintptr_t(15));
    *--sp = 0;                                               // the start function's return slot
    *--sp = (uint64_t)(uintptr_t)&tern_host_fiber_start;     // popped by ret; 16-aligned slot
    for (int i = 0; i < 6; ++i) *--sp = 0;                   // rbp rbx r12..r15
    uint32_t control[2];
    asm volatile("stmxcsr %0" : "=m"(control[0]));
    asm volatile("fnstcw %0" : "=m"(control[1]));
    *--sp = (uint64_t)control[1] << 32 | control[0];
    return sp;
}

inline const char* wait_name(const Thread& t) {
    switch (t.wait) {
        case Wait::Barrier: return "a barrier";
        case Wait::WarpArrive: return "a warp collective (before arriving)";
        case Wait::WarpRead: return "a warp collective (for other lanes)";
        case Wait::Sleep: return "a sleep (a spin-wait on memory)";
        case Wait::GroupArrive: return "a warpgroup product (before arriving)";
        case Wait::GroupRead: return "a warpgroup product (for other threads of the group)";
        default: return "nothing";
    }
}

// A launch's checks, and its fields that every block of it shares (shared memory apart).
inline int begin_launch(Launch& l, const Kernel& k, const unsigned grid[3], const unsigned block[3], unsigned dynamic_smem,
                        void** params, char* err, unsigned errlen) {
    const unsigned long long n = (unsigned long long)block[0] * block[1] * block[2];
    auto refuse = [&](const char* what) {
        snprintf(err, errlen, "%s: %s", k.name, what);
        return 1;
    };
    if (n == 0 || n > (unsigned)kMaxThreads) return refuse("block of 0 or more than 1024 threads");
    if (block[2] > 64) return refuse("blockDim.z over 64");
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0 || grid[1] > 65535 || grid[2] > 65535)
        return refuse("grid dimension 0, or y or z over 65535");
    if (dynamic_smem > kMaxShared) return refuse("dynamic shared memory over 227 KiB");
    l.run = k.run;
    l.params = params;
    l.name = k.name;
    l.grid = {grid[0], grid[1], grid[2]};
    l.block = {block[0], block[1], block[2]};
    l.nthreads = (int)n;
    l.failed = false;
    l.error[0] = 0;
    l.dynamic_bytes = dynamic_smem;
    return 0;
}

// Shared memory of a block from an arena of `arena_bytes` that a PROT_NONE page follows: the
// static declarations from its start, the dynamic region flush against its end.
inline void place_shared(Launch& l, char* arena, size_t arena_bytes) {
    l.shared_base = arena;
    l.dynamic_shared = arena + arena_bytes - ((l.dynamic_bytes + 15) & ~size_t(15));
}

// Block `idx` of the launch, ready to run: its threads at their start on fresh stacks (thread i's
// ending at stacks + (i + 1) * stride), its shared memory poisoned, its rendezvous empty.
inline void start_block(Launch& l, uint3_ idx, char* stacks, size_t stride) {
    l.block_idx = idx;
    l.live = l.nthreads;
    l.decls = 0;
    l.static_used = 0;
    for (auto& w : l.warps) w = WarpSlot{};
    for (auto& b : l.barriers) b = NamedBarrier{};
    if (l.warpgroups)
        for (int g = 0; g < kMaxThreads / 128; ++g) l.warpgroups[g] = WarpgroupSlot{};
    for (auto& e : l.exited_mask) e = 0;
    memset(l.shared_base, 0xff, kStaticShared);
    memset(l.dynamic_shared, 0xff, l.dynamic_bytes);
    for (int i = 0; i < l.nthreads; ++i) {
        Thread& t = l.threads[i];
        t.linear = i;
        t.tid = {(unsigned)i % l.block.x, (unsigned)i / l.block.x % l.block.y, (unsigned)i / (l.block.x * l.block.y)};
        t.wait = Wait::None;
        t.sp = fresh_stack(stacks + (size_t)(i + 1) * stride);
    }
}

// Threads run up to their next meeting point in thread order, so a thread that reads what a
// lower-numbered one wrote without a barrier between them gets it anyway; with
// TERN_HOSTCUDA_ORDER=reverse they run highest first (and a cooperative launch's blocks last
// first), and such a missing barrier shows.
inline bool reverse_order() {
    static const bool reverse = [] {
        const char* o = getenv("TERN_HOSTCUDA_ORDER");
        return o && strcmp(o, "reverse") == 0;
    }();
    return reverse;
}

// Resumes every unfinished thread of the current block once, up to its next meeting point.
// False when none was left to run.
inline bool run_pass(Launch& l) {
    const bool reverse = reverse_order();
    bool running = false;
    for (int j = 0; j < l.nthreads; ++j) {
        Thread& t = l.threads[reverse ? l.nthreads - 1 - j : j];
        if (t.wait == Wait::Done) continue;
        running = true;
        l.current = &t;
        tern_host_switch_stack(&l.scheduler_sp, t.sp);
        if (l.failed) break;
    }
    l.current = nullptr;
    return running;
}

// The deadlock report of a block: up to four of its waiting threads and what they wait at,
// those spinning on memory first (in a grid that waits for itself, they are the ones waiting).
inline void report_deadlock(const Launch& l, char* err, unsigned errlen) {
    int at = snprintf(err, errlen, "%s block (%u,%u,%u): deadlock;", l.name, l.block_idx.x, l.block_idx.y, l.block_idx.z);
    int shown = 0;
    for (int sleeping = 1; sleeping >= 0; --sleeping)
        for (int i = 0; i < l.nthreads && shown < 4; ++i) {
            const Thread& t = l.threads[i];
            if (t.wait == Wait::Done || (t.wait == Wait::Sleep) != (sleeping == 1) || at < 0 || (unsigned)at >= errlen) continue;
            at += snprintf(err + at, errlen - at, " thread %d waits at %s;", i, wait_name(t));
            ++shown;
        }
    if (at > 0 && (unsigned)at < errlen) snprintf(err + at, errlen - at, " %d thread(s) have exited", l.nthreads - l.live);
}

inline int run_grid(const Kernel& k, const unsigned grid[3], const unsigned block[3], unsigned dynamic_smem,
                    void** params, char* err, unsigned errlen) {
    Launch& l = L();
    if (int r = begin_launch(l, k, grid, block, dynamic_smem, params, err, errlen)) return r;
    Memory* m;
    if (const char* e = memory(m)) {
        snprintf(err, errlen, "%s: %s", k.name, e);
        return 1;
    }
    place_shared(l, m->shared, m->shared_bytes);
    if (getenv("TERN_HOSTCUDA_DEBUG"))
        fprintf(stderr, "hostcuda: %s grid (%u,%u,%u) block (%u,%u,%u), %u bytes of dynamic shared memory at %p\n", k.name, grid[0],
                grid[1], grid[2], block[0], block[1], block[2], dynamic_smem, (void*)l.dynamic_shared);
    for (unsigned bz = 0; bz < grid[2]; ++bz)
        for (unsigned by = 0; by < grid[1]; ++by)
            for (unsigned bx = 0; bx < grid[0]; ++bx) {
                start_block(l, {bx, by, bz}, m->stacks, m->stack_stride);
                for (;;) {
                    const unsigned long long before = l.epoch;
                    const bool running = run_pass(l);
                    if (l.failed) {
                        snprintf(err, errlen, "%s", l.error);
                        return 2;
                    }
                    if (!running) break;
                    if (l.epoch == before) {
                        report_deadlock(l, err, errlen);
                        return 2;
                    }
                }
            }
    return 0;
}

// A cooperative launch: every block resident at once, as the driver guarantees by refusing a
// grid that does not fit the device, so blocks may wait for one another (a grid barrier). Each
// block gets its own Launch, stacks and shared memory, and one scheduler resumes the threads of
// every block in turn; a pass in which no thread of any block made progress is a deadlock.
// The memory is mapped for the launch and unmapped after it.
inline int run_grid_cooperative(const Kernel& k, const unsigned grid[3], const unsigned block[3], unsigned dynamic_smem,
                                void** params, char* err, unsigned errlen) {
    const unsigned long long nblocks = (unsigned long long)grid[0] * grid[1] * grid[2];
    const unsigned long long nthreads = (unsigned long long)block[0] * block[1] * block[2];
    if (nblocks == 0 || nblocks * nthreads > 1u << 20) {
        snprintf(err, errlen, "%s: a cooperative grid of 0 blocks or of more than 2^20 threads", k.name);
        return 1;
    }
    const size_t page = (size_t)sysconf(_SC_PAGESIZE);
    const size_t arena = (kStaticShared + kMaxShared + page - 1) / page * page;
    const size_t stacks_bytes = (size_t)(nblocks * nthreads) * kStackBytes, shared_bytes = (size_t)nblocks * (arena + page);
    void* stacks = mmap(nullptr, stacks_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    void* shared = mmap(nullptr, shared_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    std::unique_ptr<Launch[]> blocks(stacks == MAP_FAILED || shared == MAP_FAILED ? nullptr : new (std::nothrow) Launch[nblocks]);
    Launch*& current = current_block();
    Launch* const outside = current;
    int rc = 0;
    if (!blocks) {
        snprintf(err, errlen, "%s: cannot map the memory of a cooperative grid of %llu blocks", k.name, nblocks);
        rc = 1;
    }
    for (unsigned long long b = 0; b < nblocks && !rc; ++b) {
        Launch& l = blocks[b];
        char* own = (char*)shared + b * (arena + page);
        mprotect(own + arena, page, PROT_NONE);
        if ((rc = begin_launch(l, k, grid, block, dynamic_smem, params, err, errlen))) break;
        place_shared(l, own, arena);
        current = &l;
        start_block(l, {(unsigned)(b % grid[0]), (unsigned)(b / grid[0] % grid[1]), (unsigned)(b / ((unsigned long long)grid[0] * grid[1]))},
                    (char*)stacks + b * nthreads * kStackBytes, kStackBytes);
    }
    while (!rc) {
        unsigned long long before = 0;
        for (unsigned long long b = 0; b < nblocks; ++b) before += blocks[b].epoch;
        bool running = false;
        for (unsigned long long j = 0; j < nblocks && !rc; ++j) {
            Launch& l = blocks[reverse_order() ? nblocks - 1 - j : j];
            current = &l;
            running |= run_pass(l);
            if (l.failed) {
                snprintf(err, errlen, "%s", l.error);
                rc = 2;
            }
        }
        if (rc || !running) break;
        unsigned long long after = 0;
        for (unsigned long long b = 0; b < nblocks; ++b) after += blocks[b].epoch;
        if (after == before) {
            for (unsigned long long b = 0; b < nblocks; ++b)
                if (blocks[b].live > 0) {
                    report_deadlock(blocks[b], err, errlen);
                    break;
                }
            rc = 2;
        }
    }
    current = outside;
    blocks.reset();
    if (stacks != MAP_FAILED) munmap(stacks, stacks_bytes);
    if (shared != MAP_FAILED) munmap(shared, shared_bytes);
    return rc;
}

}  // namespace tern_host

// The module's entry points for hostcuda's driver; the table is the translation unit's last
// lines (translate.py).
extern "C" const tern_host::Kernel tern_host_kernels[];
extern "C" const int tern_host_kernel_count;

inline const tern_host::Kernel* tern_host_find(const char* name) {
    for (int i = 0; i < tern_host_kernel_count; ++i)
        if (strcmp(tern_host_kernels[i].name, name) == 0) return &tern_host_kernels[i];
    return nullptr;
}
extern "C" __attribute__((visibility("default"))) int tern_host_has_kernel(const char* name) { return tern_host_find(name) != nullptr; }
extern "C" __attribute__((visibility("default"))) int tern_host_kernel_params(const char* name, unsigned* sizes, unsigned max) {
    const tern_host::Kernel* k = tern_host_find(name);
    if (!k) return -1;
    for (unsigned i = 0; i < k->nparams && i < max; ++i) sizes[i] = k->sizes[i];
    return (int)k->nparams;
}
// Where the launch running now is (block and thread), for the driver's report of a fault on a
// guard page; empty between launches.
extern "C" __attribute__((visibility("default"))) const char* tern_host_fault_where(void) {
    static char where[160];
    const tern_host::Launch& l = tern_host::L();
    const tern_host::Thread* t = l.current;
    if (!t) return "";
    snprintf(where, sizeof where, "block (%u,%u,%u) thread (%u,%u,%u)", l.block_idx.x, l.block_idx.y, l.block_idx.z, t->tid.x,
             t->tid.y, t->tid.z);
    return where;
}
extern "C" __attribute__((visibility("default"))) int tern_host_launch(const char* name, const unsigned grid[3], const unsigned block[3],
                                                                       unsigned dynamic_smem, void** params, char* err, unsigned errlen) {
    const tern_host::Kernel* k = tern_host_find(name);
    if (!k) {
        snprintf(err, errlen, "no kernel %s in this module", name);
        return 1;
    }
    return tern_host::run_grid(*k, grid, block, dynamic_smem, params, err, errlen);
}
// The same for a cooperative launch (every block resident at once); the driver has checked that
// the grid fits the device.
extern "C" __attribute__((visibility("default"))) int tern_host_launch_cooperative(const char* name, const unsigned grid[3],
                                                                                   const unsigned block[3], unsigned dynamic_smem,
                                                                                   void** params, char* err, unsigned errlen) {
    const tern_host::Kernel* k = tern_host_find(name);
    if (!k) {
        snprintf(err, errlen, "no kernel %s in this module", name);
        return 1;
    }
    return tern_host::run_grid_cooperative(*k, grid, block, dynamic_smem, params, err, errlen);
}
