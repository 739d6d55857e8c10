// Hopper's warpgroup products (wgmma.mma_async, sm_90a): four warps multiply a 64 x 16 tile of A
// by a 16 x N tile of B, both read by the tensor cores straight from shared memory, into f32
// accumulators spread over the warpgroup's registers. Where mma.sync makes every warp load its
// own fragments (ldmatrix: each operand byte crosses the shared-memory pipe once per warp that
// reads it), a warpgroup product reads each byte of its tiles once for the four warps. Operands
// are bf16, K-major (A stored [m][k], B stored [n][k], k contiguous) and unswizzled, in the
// canonical layout of 8 x 8 "core matrices": the eight 16-byte rows of a core matrix are
// contiguous (128 bytes, one row per bank group, so a core matrix is read without conflicts);
// the descriptor gives the byte distance between core matrices adjacent in k (`lbo`) and in m or
// n (`sbo`). Element (r, k) of a tile whose first core matrix starts at `base`:
//   base + (r / 8) * sbo + (k / 8) * lbo + (r % 8) * 16 + (k % 8) * 2.
// A may also be M-major (tern_wgmma_offset_mn, tern_wgmma_m64n32k16_mn_a).
// Accumulator d[4j + e] of thread t (warp w = t / 32 of the group, g = lane / 4, q = lane % 4)
// is element (16 w + g + 8 (e / 2), 8 j + 2 q + e % 2) of the 64 x N result: each warp holds 16
// rows as mma.sync's m16n8 C fragments, one n8 tile after another.
//
// The products run asynchronously: tern_wgmma_fence before the first product that reads
// accumulators or shared memory written since, tern_wgmma_commit after a batch of products, and
// tern_wgmma_wait<n> until at most n batches are still in flight; accumulators and the tiles
// must not be touched in between. Every thread of the warpgroup executes each of them
// (`.sync.aligned`). Tiles that threads stored with ordinary stores reach the products only
// through tern_wgmma_fence_stores (the tensor cores read shared memory through the async proxy),
// then a barrier. tools/hostcuda models these layouts, without swizzles, and the products as
// completed at once.
//
// The instructions exist only in sm_90a builds (Gpu compiles for sm_90a on an sm_90 device:
// nvrtc_arch). Elsewhere each helper traps, so a launch that should not have happened fails
// loudly; the launchers refuse other devices before launching.

// Bits 0-13: the tile's shared address / 16; 16-29: lbo / 16; 32-45: sbo / 16; 49-51 (base
// offset) and 62-63 (swizzle) zero: no swizzle. Addresses and offsets are multiples of 16.
__device__ __forceinline__ unsigned long long tern_wgmma_desc(const void* smem, unsigned lbo, unsigned sbo) {
    const unsigned addr = (unsigned)__cvta_generic_to_shared(smem);
    return (unsigned long long)((addr >> 4) & 0x3fffu) | (unsigned long long)((lbo >> 4) & 0x3fffu) << 16 |
           (unsigned long long)((sbo >> 4) & 0x3fffu) << 32;
}

// The byte offset of element (r, k) from the tile's first core matrix, as the descriptor above
// reads it: where a kernel stores an operand that a product will read.
__device__ __forceinline__ unsigned tern_wgmma_offset(int r, int k, unsigned lbo, unsigned sbo) {
    return (unsigned)(r >> 3) * sbo + (unsigned)(k >> 3) * lbo + (unsigned)(r & 7) * 16u + (unsigned)(k & 7) * 2u;
}

// The same for an A operand stored M-major (tern_wgmma_m64n32k16_mn_a): a core matrix is eight
// 16-byte rows of 8 consecutive m, one row per k, so element (r, k) of the 64 x 16 tile lies at
//   base + (r / 8) * sbo + (k / 8) * lbo + (k % 8) * 16 + (r % 8) * 2
// (sbo between core matrices adjacent in m, lbo adjacent in k: the PTX ISA's unswizzled
// MN-major canonical layout). A tile kept transposed for another product, [k][m] in 8 x 8
// blocks, is such an operand as it stands.
__device__ __forceinline__ unsigned tern_wgmma_offset_mn(int r, int k, unsigned lbo, unsigned sbo) {
    return (unsigned)(r >> 3) * sbo + (unsigned)(k >> 3) * lbo + (unsigned)(k & 7) * 16u + (unsigned)(r & 7) * 2u;
}

__device__ __forceinline__ void tern_wgmma_fence() {
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#else
    __trap();
#endif
}
__device__ __forceinline__ void tern_wgmma_commit() {
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#else
    __trap();
#endif
}
template <int N>
__device__ __forceinline__ void tern_wgmma_wait() {
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#else
    __trap();
#endif
}
// This thread's ordinary stores to shared memory, made visible to the products' reads.
__device__ __forceinline__ void tern_wgmma_fence_stores() {
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#else
    __trap();
#endif
}

// d (+)= A B^T for one k-step of 16: A 64 x 16 at desc_a, B (stored [n][k]) 32 x 16 at desc_b.
// With accumulate 0 the product replaces d (whose values are then not read).
__device__ __forceinline__ void tern_wgmma_m64n32k16(float (&d)[16], unsigned long long desc_a, unsigned long long desc_b, int accumulate) {
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %18, 0;"
        " wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16"
        " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 0, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate)
        : "memory");
#else
    __trap();
#endif
}

// The same for N = 64: B (stored [n][k]) 64 x 16 at desc_b, 32 accumulators a thread.
__device__ __forceinline__ void tern_wgmma_m64n64k16(float (&d)[32], unsigned long long desc_a, unsigned long long desc_b, int accumulate) {
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %34, 0;"
        " wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, %32, %33, p, 1, 1, 0, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate)
        : "memory");
#else
    __trap();
#endif
}

// One k-step of 16 by the accumulators' count: N = 32 or 64 (code written once for both widths).
__device__ __forceinline__ void tern_wgmma_m64k16(float (&d)[16], unsigned long long desc_a, unsigned long long desc_b, int accumulate) {
    tern_wgmma_m64n32k16(d, desc_a, desc_b, accumulate);
}
__device__ __forceinline__ void tern_wgmma_m64k16(float (&d)[32], unsigned long long desc_a, unsigned long long desc_b, int accumulate) {
    tern_wgmma_m64n64k16(d, desc_a, desc_b, accumulate);
}

// The same with A stored M-major (tern_wgmma_offset_mn; the instruction's transpose-A flag).
// Written out rather than made one template with the flag as an operand: the flag is an
// immediate, and tools/hostcuda reads each form from its asm template as written.
__device__ __forceinline__ void tern_wgmma_m64n32k16_mn_a(float (&d)[16], unsigned long long desc_a, unsigned long long desc_b, int accumulate) {
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %18, 0;"
        " wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16"
        " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, p, 1, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(desc_a), "l"(desc_b), "r"(accumulate)
        : "memory");
#else
    __trap();
#endif
}

// d (+)= A B^T for one k-step of 16, N = 64, A's fragments in registers (the register form:
// a[0..3] as mma.sync's A fragment of this warp's 16 rows, the lower column in each low half;
// an accumulator tile of an earlier product repacks into it without exchanges), B (stored
// [n][k]) at desc_b. The registers must keep their values until the product completes.
__device__ __forceinline__ void tern_wgmma_m64n64k16_rs(float (&d)[32], const unsigned (&a)[4], unsigned long long desc_b, int accumulate) {
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %37, 0;"
        " wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
        "}, {%32, %33, %34, %35}, %36, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate)
        : "memory");
#else
    __trap();
#endif
}

// d (+)= A B^T for one k-step of 16, N = 128, A's fragments in registers (the register form:
// a[0..3] as mma.sync's A fragment of this warp's 16 rows, the lower column in each low half;
// an accumulator tile of an earlier product repacks into it without exchanges), B (stored
// [n][k]) at desc_b. The registers must keep their values until the product completes.
__device__ __forceinline__ void tern_wgmma_m64n128k16_rs(float (&d)[64], const unsigned (&a)[4], unsigned long long desc_b, int accumulate) {
#if !defined(__CUDA_ARCH__) || defined(__CUDA_ARCH_FEAT_SM90_ALL)
    asm volatile(
        "{ .reg .pred p; setp.ne.b32 p, %69, 0;"
        " wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15,"
        " %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31,"
        " %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47,"
        " %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, p, 1, 1, 0; }"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
          "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
          "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
          "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
          "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b), "r"(accumulate)
        : "memory");
#else
    __trap();
#endif
}
