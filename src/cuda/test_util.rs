//! Helpers of the device tests (every CUDA op against its CPU twin): the GPU, a seeded generator
//! whose seed is printed (TERN_TEST_SEED replays it), NaN-poisoned outputs, and the relative
//! error check that also rejects unwritten (NaN) or overflowed elements, and the size limit of
//! a case run on hostcuda (tools/hostcuda: the CUDA entry points executed on the CPU).

use std::sync::Arc;

use super::{CudaSlice, Gpu};
use crate::kernels::gated_delta::test_util::{rel_err, Lcg};

pub fn gpu() -> Arc<Gpu> {
    Gpu::new(0).unwrap_or_else(|e| panic!("device tests need a CUDA GPU: {e}"))
}

/// Whether `gpu` is hostcuda, which runs a kernel's threads one after another on the CPU: the
/// CI machines (no GPU) run these tests on it, at some 10⁴ times a GPU's time per element.
pub fn emulated(gpu: &Gpu) -> bool {
    gpu.name().starts_with("hostcuda")
}

/// The largest case hostcuda runs, in the units of [`left_to_the_gpu`]'s `work`: a count of
/// multiply-adds within a small factor (tokens × value heads × d_k × d_v for the delta rule,
/// queries × visible keys × heads × head size for attention), a few seconds of emulation.
pub const EMULATED_WORK: usize = 60_000_000;

/// Whether to skip a case of size `work` because the device is hostcuda and the case is larger
/// than [`EMULATED_WORK`]; said on stderr, so a log shows which cases only a GPU ran. On a GPU,
/// never.
pub fn left_to_the_gpu(gpu: &Gpu, what: &str, work: usize) -> bool {
    let skip = emulated(gpu) && work > EMULATED_WORK;
    if skip {
        eprintln!("{what}: left to the GPU (size {work} > {EMULATED_WORK}, hostcuda's limit)");
    }
    skip
}

pub fn rng(test: &str) -> Lcg {
    let seed = std::env::var("TERN_TEST_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64
    });
    eprintln!("{test}: seed {seed}");
    Lcg(seed)
}

/// A device buffer of `n` NaNs: an element a kernel fails to write then fails [`check`].
pub fn nan(gpu: &Gpu, n: usize) -> CudaSlice<f32> {
    gpu.upload(&vec![f32::NAN; n]).unwrap()
}

/// Asserts finite values and ‖got − want‖/‖want‖ ≤ bound; returns the error.
pub fn check(what: &str, got: &[f32], want: &[f32], bound: f64) -> f64 {
    assert!(got.iter().all(|v| v.is_finite()), "{what}: non-finite element (unwritten or overflow)");
    let e = rel_err(got, want);
    assert!(e <= bound, "{what}: ‖Δ‖/‖ref‖ = {e:e} > {bound:e}");
    e
}
