// Prepended to every CUDA program of tern (nvrtc.rs), before the family's own helpers.
//
// Kernels can be launched with programmatic dependent launch where the device has it (sm_90
// and later: a decode step's launches by default, every launch with TERN_DEPENDENT_LAUNCH=1;
// DependentLaunch, Gpu::launch_builder): the next kernel on the stream is
// scheduled while this one still runs, so that a chain of small kernels need not pay a full
// launch gap between each pair. The rule that makes this safe, kept by every kernel: its first statement
// is tern_await_prior_kernel() (in the one-row GEMVs and the gated-delta recurrence,
// tern_await_prior_kernel_unless below, which may let weight or state loads come first), which blocks until the kernel before it on the stream has
// finished and its writes are visible (griddepcontrol.wait), and only then lets the kernel
// after it be scheduled (griddepcontrol.launch_dependents). As every kernel waits before it
// can end, a kernel's end implies the end of all kernels before it, and at most two grids are
// in flight (more under tern_let_dependents_launch below). In a plain launch both instructions do nothing. A CPU test checks
// the rule (cuda::tests::every_kernel_awaits_the_prior_kernel).
__device__ __forceinline__ void tern_await_prior_kernel() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Lets the kernel after this one be scheduled now (griddepcontrol.launch_dependents; also part
// of tern_await_prior_kernel). Called first by a kernel whose reads before its wait are only of
// weights (the one-row GEMVs, Gpu::early_trigger), so that the next kernel's blocks can
// request their own operands while this one waits: more than two grids are then in flight.
// (Every kernel calling it first measured slower than the GEMVs alone: BENCHMARKS.md,
// twenty-third session.)
// The rule above still orders them: every kernel awaits its predecessor before it can end, so
// a kernel that passes its wait finds every kernel before it finished. Only reads made before
// the wait see more: a kernel may then start while every GEMV of the run before it and the
// kernel before that run still run, which matters only for the recurrence's early state reads
// (Gpu::state_reads_may_lead).
__device__ __forceinline__ void tern_let_dependents_launch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// The same rule for a kernel that first requests operands the kernel before it cannot have
// written: a matrix's weights (every weight buffer is filled by a copy from the host, and a
// copy on the stream is a full dependency), or recurrent states where the host knows that no
// kernel that may still run writes them (Gpu::state_reads_may_lead): those are the kernel
// before, and where that one ends a run of GEMVs that let their successor be scheduled first
// (tern_let_dependents_launch), the rest of the run and the kernel before it; every earlier
// kernel awaited its predecessor before letting the next be scheduled, so it has finished. With `later` set, the kernel issues those loads and
// then calls tern_await_prior_kernel() itself, before it touches anything else in device
// memory, so a decode step's next product (or recurrence) has its first bytes in flight while
// the kernel before it still runs. Without dependent launch (`later` or not) the order changes
// nothing.
__device__ __forceinline__ void tern_await_prior_kernel_unless(bool later) {
    if (!later) tern_await_prior_kernel();
}
