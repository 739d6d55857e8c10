//! Dense matrix products. `linear` is the projection of every model here: Y[t][o] = Σ_k X[t][k]·W[o][k]
//! with W stored [out][in] as in PyTorch's `nn.Linear`. The CPU form uses the `gemm` crate, whose
//! per-element sum over k does not depend on how many rows are in the batch: that is what keeps
//! a batch member equal to the same text embedded alone.

use super::check_len;
use crate::error::Result;

pub fn linear(x: &[f32], rows: usize, w: &[f32], out_features: usize, in_features: usize) -> Result<Vec<f32>> {
    let mut y = vec![0.0f32; rows * out_features];
    linear_into(x, rows, w, out_features, in_features, &mut y)?;
    Ok(y)
}

pub fn linear_into(
    x: &[f32],
    rows: usize,
    w: &[f32],
    out_features: usize,
    in_features: usize,
    y: &mut [f32],
) -> Result<()> {
    check_len("linear input", x.len(), rows * in_features)?;
    check_len("linear weight", w.len(), out_features * in_features)?;
    check_len("linear output", y.len(), rows * out_features)?;
    if rows == 0 {
        return Ok(());
    }
    // SAFETY: the three buffers were checked against the dimensions just above; strides describe
    // row-major X [rows][in], Wᵀ as a view of W [out][in], and row-major Y [rows][out].
    unsafe {
        gemm_f32(
            rows, out_features, in_features,
            y.as_mut_ptr(), out_features as isize, 1,
            x.as_ptr(), in_features as isize, 1,
            w.as_ptr(), 1, in_features as isize,
            true,
        );
    }
    Ok(())
}

/// FLOP/s of [`linear_into`] for an [m × k] · [k × n] product on the current rayon pool: one
/// warm-up, then the mean of `reps` timed runs. The compute roofline benchmarks are read against.
pub fn measure_rate(m: usize, n: usize, k: usize, reps: usize) -> Result<f64> {
    let x: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.01).collect();
    let w: Vec<f32> = (0..n * k).map(|i| (i % 13) as f32 * 0.01).collect();
    let mut y = vec![0.0f32; m * n];
    linear_into(&x, m, &w, n, k, &mut y)?;
    let t = std::time::Instant::now();
    for _ in 0..reps.max(1) {
        linear_into(&x, m, &w, n, k, &mut y)?;
    }
    Ok(2.0 * (m * n * k) as f64 * reps.max(1) as f64 / t.elapsed().as_secs_f64())
}

/// `dst[m][n] = Σ_k lhs[m][k] · rhs[k][n]`, every operand addressed by (row stride, column
/// stride). `parallel` runs the product on the current rayon pool; kernels that already run one
/// task per thread pass false.
///
/// # Safety
/// Every index the strides reach for the given m, n, k must lie inside its buffer.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemm_f32(
    m: usize,
    n: usize,
    k: usize,
    dst: *mut f32,
    dst_rs: isize,
    dst_cs: isize,
    lhs: *const f32,
    lhs_rs: isize,
    lhs_cs: isize,
    rhs: *const f32,
    rhs_rs: isize,
    rhs_cs: isize,
    parallel: bool,
) {
    let par = if parallel && rayon::current_num_threads() > 1 {
        gemm::Parallelism::Rayon(rayon::current_num_threads())
    } else {
        gemm::Parallelism::None
    };
    gemm::gemm(
        m, n, k, dst, dst_cs, dst_rs, false, lhs, lhs_cs, lhs_rs, rhs, rhs_cs, rhs_rs, 0.0, 1.0, false, false,
        false, par,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn linear_matches_naive_sum() {
        let (rows, inf, outf) = (5, 7, 3);
        let x: Vec<f32> = (0..rows * inf).map(|i| ((i * 7 % 11) as f32 - 5.0) / 3.0).collect();
        let w: Vec<f32> = (0..outf * inf).map(|i| ((i * 5 % 13) as f32 - 6.0) / 4.0).collect();
        let y = linear(&x, rows, &w, outf, inf).unwrap();
        for t in 0..rows {
            for o in 0..outf {
                let want: f64 = (0..inf).map(|k| x[t * inf + k] as f64 * w[o * inf + k] as f64).sum();
                assert!((y[t * outf + o] as f64 - want).abs() < 1e-5, "({t},{o})");
            }
        }
        assert!(linear(&x, rows, &w, outf, inf + 1).is_err());
    }
}
