//! Helpers of the device tests (every CUDA op against its CPU twin): the GPU, a seeded generator
//! whose seed is printed (TERN_TEST_SEED replays it), NaN-poisoned outputs, and the relative
//! error check that also rejects unwritten (NaN) or overflowed elements.

use std::sync::Arc;

use super::{CudaSlice, Gpu};
use crate::kernels::gated_delta::test_util::{rel_err, Lcg};

pub fn gpu() -> Arc<Gpu> {
    Gpu::new(0).unwrap_or_else(|e| panic!("device tests need a CUDA GPU: {e}"))
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
