// Shared by the gated-delta conv kernel (conv.cu) and the GEMV that convolves the channels it
// writes (matmul/gemv.cu, TernConvTaps), each module including it once.
//
// A causal depthwise conv's sum at one position as the CPU twin forms it (gated_delta/conv.rs):
// the newest tap's product, then each history tap's product added, oldest first, every product
// and every sum rounded on its own. The rounding intrinsics keep the compiler from contracting
// any of them into a fused multiply-add (which it does differently in an unrolled loop and in
// one of run-time length), so every kernel that convolves — the conv kernel, and the GEMV that
// convolves the channels it writes — rounds alike, and as the CPU does.
__device__ __forceinline__ float tern_conv_newest(float x, float w) { return __fmul_rn(x, w); }
__device__ __forceinline__ float tern_conv_add_tap(float acc, float h, float w) { return __fadd_rn(acc, __fmul_rn(h, w)); }
