//! Dense matrix products. `linear` is the projection of every model here: Y[t][o] = Σ_k X[t][k]·W[o][k]
//! with W stored [out][in] as in PyTorch's `nn.Linear`. The CPU form uses the `gemm` crate, and
//! register-tiled kernels that stream W for products of few rows (queries, decode steps). The two
//! sum over k in different orders, so a text embedded alone and inside a batch agree to f32
//! rounding, not bit for bit (the golden tests bound the difference).

mod bf16;
pub mod cuda;
mod q8_0;

use std::cell::RefCell;

use rayon::prelude::*;

use super::check_len;
use crate::error::{Error, Result};

/// A weight matrix [out][in] in the dtype it is stored in. bf16 weights stay bf16 in memory (a
/// decode step reads half the bytes) and are widened, exactly, inside the product.
///
/// Q8_0 weights (GGUF blocks of an f16 scale and 32 i8 quants, 34 bytes) stay quantized too:
/// each weight d·q is formed in f32, exactly as decoding at load would give it, inside the
/// product.
#[derive(Clone, Copy, Debug)]
pub enum Weights<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
    Q8_0(&'a [u8]),
}

impl Weights<'_> {
    /// Number of weights.
    pub fn len(&self) -> usize {
        match self {
            Weights::F32(w) => w.len(),
            Weights::Bf16(w) => w.len(),
            Weights::Q8_0(b) => b.len() / q8_0::BLOCK_BYTES * q8_0::BLOCK,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes a product reads from the weights.
    pub fn bytes(&self) -> usize {
        match self {
            Weights::F32(w) => 4 * w.len(),
            Weights::Bf16(w) => 2 * w.len(),
            Weights::Q8_0(b) => b.len(),
        }
    }

    /// Row `r` of a matrix of `cols` columns, as f32 (an embedding lookup).
    pub fn row_into(&self, r: usize, cols: usize, out: &mut [f32]) -> Result<()> {
        check_len("weight row output", out.len(), cols)?;
        if (r + 1) * cols > self.len() {
            return Err(Error::Shape(format!("row {r} of {cols} columns is outside {} weights", self.len())));
        }
        match self {
            Weights::F32(w) => out.copy_from_slice(&w[r * cols..(r + 1) * cols]),
            Weights::Bf16(w) => bf16::widen_into(&w[r * cols..(r + 1) * cols], out),
            Weights::Q8_0(b) => {
                if cols % q8_0::BLOCK != 0 {
                    return Err(Error::Shape(format!("Q8_0 rows of {cols} columns are not whole blocks of {}", q8_0::BLOCK)));
                }
                let per_row = cols / q8_0::BLOCK * q8_0::BLOCK_BYTES;
                q8_0::dequantize_into(&b[r * per_row..(r + 1) * per_row], out);
            }
        }
        Ok(())
    }
}

impl<'a> From<&'a crate::formats::Matrix> for Weights<'a> {
    fn from(m: &'a crate::formats::Matrix) -> Self {
        use crate::formats::Matrix;
        match m {
            Matrix::F32(t) => Weights::F32(t.data()),
            Matrix::Bf16(t) => Weights::Bf16(t.data()),
            Matrix::Q8_0(t) => Weights::Q8_0(t.data()),
        }
    }
}

impl Weights<'_> {
    /// Every weight decoded to f32 (`cols` per row): a backend that multiplies in another
    /// dtype converts from this.
    pub fn to_f32(&self, cols: usize) -> Result<Vec<f32>> {
        match self {
            Weights::F32(w) => Ok(w.to_vec()),
            _ => {
                let rows = if cols == 0 { 0 } else { self.len() / cols };
                let mut out = vec![0.0f32; rows * cols];
                for (r, row) in out.chunks_mut(cols.max(1)).enumerate() {
                    self.row_into(r, cols, row)?;
                }
                Ok(out)
            }
        }
    }
}

/// Q8_0 blocks of `w` (an f16 scale max|w|/127, then the rounded quants), as GGUF writes them:
/// test and benchmark weights in the stored type the decode kernels read. `w.len()` is a
/// multiple of 32 (a shorter tail is dropped).
pub fn quantize_q8_0(w: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(w.len() / 32 * 34);
    for b in w.chunks_exact(32) {
        let d = half::f16::from_f32(b.iter().fold(0.0f32, |m, v| m.max(v.abs())) / 127.0);
        out.extend_from_slice(&d.to_le_bytes());
        let inv = if d.to_f32() > 0.0 { 1.0 / d.to_f32() } else { 0.0 };
        out.extend(b.iter().map(|&v| (v * inv).round().clamp(-127.0, 127.0) as i8 as u8));
    }
    out
}

/// [`linear`] over weights of any stored dtype.
pub fn linear_w(x: &[f32], rows: usize, w: Weights, out_features: usize, in_features: usize) -> Result<Vec<f32>> {
    let mut y = vec![0.0f32; rows * out_features];
    linear_w_into(x, rows, w, out_features, in_features, &mut y)?;
    Ok(y)
}

/// [`linear_into`] over weights of any stored dtype.
pub fn linear_w_into(
    x: &[f32],
    rows: usize,
    w: Weights,
    out_features: usize,
    in_features: usize,
    y: &mut [f32],
) -> Result<()> {
    match w {
        Weights::F32(w) => linear_into(x, rows, w, out_features, in_features, y),
        Weights::Bf16(w) => {
            check_len("linear input", x.len(), rows * in_features)?;
            check_len("linear weight", w.len(), out_features * in_features)?;
            check_len("linear output", y.len(), rows * out_features)?;
            if rows > 0 {
                bf16::linear_bf16_into(x, rows, w, out_features, in_features, y);
            }
            Ok(())
        }
        Weights::Q8_0(b) => {
            check_len("linear input", x.len(), rows * in_features)?;
            if in_features % q8_0::BLOCK != 0 {
                return Err(Error::Shape(format!("Q8_0 rows of {in_features} columns are not whole blocks of {}", q8_0::BLOCK)));
            }
            check_len("linear weight", b.len(), out_features * in_features / q8_0::BLOCK * q8_0::BLOCK_BYTES)?;
            check_len("linear output", y.len(), rows * out_features)?;
            if rows > 0 {
                q8_0::linear_q8_0_into(x, rows, b, out_features, in_features, y);
            }
            Ok(())
        }
    }
}

/// Up to this many rows of X, f32 products stream W once through 4×4 register tiles instead of
/// the GEMM: a short query reads every weight for a few rows, and the GEMM's packing of W costs
/// more than the product (EmbeddingGemma 300M, one 10-token query: about half the read bandwidth
/// through the GEMM).
const F32_TILED_MAX_ROWS: usize = 16;

/// Y = X·Wᵀ for a few rows: each block of four W rows against the X rows four at a time.
fn f32_tiled(x: &[f32], rows: usize, w: &[f32], out: usize, inp: usize, y: &mut [f32]) {
    let kernel = bf16::tile_kernel();
    over_row_blocks(out, 4 * inp, y, |o0, o1, put| {
        let mut o = o0;
        while o + 4 <= o1 {
            let wb = &w[o * inp..(o + 4) * inp];
            tile_x_rows(x, rows, inp, o, put, |xs| kernel(xs, wb, inp));
            o += 4;
        }
        for o in o..o1 {
            let wr = &w[o * inp..(o + 1) * inp];
            for t in 0..rows {
                put(t, o, x[t * inp..(t + 1) * inp].iter().zip(wr).map(|(&a, &b)| a * b).sum());
            }
        }
    });
}

/// Writes one element of Y: `put(t, o, v)` sets Y[t][o].
pub(super) type Put<'a> = &'a (dyn Fn(usize, usize, f32) + Sync);

/// Splits the W rows into tasks of about `TASK_BYTES` of weights (whole blocks of four rows)
/// and runs `body(o0, o1, put)` for each, on the rayon pool when there is more than one task.
/// Long contiguous runs keep the hardware prefetchers streaming, while enough tasks remain for
/// rayon to balance threads that another process slows down.
pub(super) fn over_row_blocks(out: usize, row_bytes: usize, y: &mut [f32], body: impl Fn(usize, usize, Put) + Sync + Send) {
    let rows_per_task = (bf16::TASK_BYTES / row_bytes.max(1)).next_multiple_of(4).max(4);
    let tasks = out.div_ceil(rows_per_task);
    let yp = super::SharedMut(y.as_mut_ptr());
    let len = y.len();
    for_each_task(tasks, |task| {
        let o0 = task * rows_per_task;
        let o1 = (o0 + rows_per_task).min(out);
        let put = |t: usize, o: usize, v: f32| {
            debug_assert!(t * out + o < len && (o0..o1).contains(&o));
            // SAFETY: a task writes only Y[t][o0..o1] for every t (the callers' bodies keep o in
            // their o0..o1): disjoint across tasks, and inside Y, whose length the products'
            // entry points check to be rows·out.
            unsafe { *yp.ptr().add(t * out + o) = v }
        };
        body(o0, o1, &put);
    });
}

/// The X rows four at a time against one block of four W rows starting at row `o`: `tile(xs)`
/// gives `[W row][X row]`. Past the last X row the last one stands in; those results are dropped.
pub(super) fn tile_x_rows(x: &[f32], rows: usize, inp: usize, o: usize, put: Put, mut tile: impl FnMut([&[f32]; 4]) -> [[f32; 4]; 4]) {
    let mut t = 0;
    while t < rows {
        let ts: [usize; 4] = std::array::from_fn(|i| (t + i).min(rows - 1));
        let d = tile(ts.map(|r| &x[r * inp..(r + 1) * inp]));
        for (i, &tr) in ts.iter().enumerate() {
            if tr == t + i {
                for (r, dr) in d.iter().enumerate() {
                    put(tr, o + r, dr[i]);
                }
            }
        }
        t += 4;
    }
}

/// Widened panel size in f32 values (16 MiB): bounds the scratch buffer when a large matrix
/// (the 248k-row LM head) meets a batch.
const PANEL_VALUES: usize = 4 << 20;

thread_local! {
    /// The widened panel, kept between calls so a prefill does not fault in fresh pages for
    /// every projection.
    static PANEL: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Y = X·Wᵀ for weights stored in another dtype: `fill(o0, p, panel)` writes W rows o0..o0+p as
/// f32 into `panel` ([p][inp]), and the f32 GEMM runs on each panel in turn.
pub(super) fn panel_gemm(
    x: &[f32],
    rows: usize,
    out: usize,
    inp: usize,
    y: &mut [f32],
    fill: impl Fn(usize, usize, &mut [f32]),
) {
    let panel_rows = (PANEL_VALUES / inp.max(1)).clamp(1, out.max(1));
    PANEL.with(|cell| {
        let mut panel = cell.borrow_mut();
        let mut o0 = 0;
        while o0 < out {
            let p = panel_rows.min(out - o0);
            // Grow only: shrinking and growing again between projections would zero-fill the
            // buffer each time.
            if panel.len() < p * inp {
                panel.resize(p * inp, 0.0);
            }
            fill(o0, p, &mut panel[..p * inp]);
            // SAFETY: X is [rows][inp], the panel [p][inp] (read as its transpose), and the
            // destination the columns o0..o0+p of Y [rows][out], all inside the checked buffers.
            unsafe {
                gemm_f32(
                    rows, p, inp,
                    y.as_mut_ptr().add(o0), out as isize, 1,
                    x.as_ptr(), inp as isize, 1,
                    panel.as_ptr(), 1, inp as isize,
                    true,
                );
            }
            o0 += p;
        }
    });
}

/// Runs `task(i)` for i in 0..tasks on the rayon pool when there is more than one of each.
pub(super) fn for_each_task(tasks: usize, task: impl Fn(usize) + Sync + Send) {
    if tasks > 1 && rayon::current_num_threads() > 1 {
        (0..tasks).into_par_iter().for_each(task);
    } else {
        (0..tasks).for_each(task);
    }
}

pub fn linear(x: &[f32], rows: usize, w: &[f32], out_features: usize, in_features: usize) -> Result<Vec<f32>> {
    let mut y = vec![0.0f32; rows * out_features];
    linear_into(x, rows, w, out_features, in_features, &mut y)?;
    Ok(y)
}

/// y[r] += bias for every row of width `bias.len()`.
pub fn add_bias(y: &mut [f32], bias: &[f32]) -> Result<()> {
    if bias.is_empty() || y.len() % bias.len() != 0 {
        return Err(crate::Error::Shape(format!("add_bias: {} elements are not rows of {}", y.len(), bias.len())));
    }
    for row in y.chunks_mut(bias.len()) {
        row.iter_mut().zip(bias).for_each(|(v, &b)| *v += b);
    }
    Ok(())
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
    if rows <= F32_TILED_MAX_ROWS {
        f32_tiled(x, rows, w, out_features, in_features, y);
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

/// [`linear_into`] writing columns `col .. col + out_features` of a wider output whose rows are
/// `stride` long: the parts of a stacked projection write side by side without a copy.
#[allow(clippy::too_many_arguments)]
pub fn linear_into_columns(
    x: &[f32],
    rows: usize,
    w: &[f32],
    out_features: usize,
    in_features: usize,
    y: &mut [f32],
    col: usize,
    stride: usize,
) -> Result<()> {
    check_len("linear input", x.len(), rows * in_features)?;
    check_len("linear weight", w.len(), out_features * in_features)?;
    check_len("linear output", y.len(), rows * stride)?;
    if col + out_features > stride {
        return Err(crate::Error::Shape(format!("linear: columns {col}..{} of rows of {stride}", col + out_features)));
    }
    if rows == 0 || out_features == 0 {
        return Ok(());
    }
    if rows <= F32_TILED_MAX_ROWS {
        // The register tiles write contiguous rows: a few rows, so a copy is cheap.
        let mut part = vec![0.0f32; rows * out_features];
        f32_tiled(x, rows, w, out_features, in_features, &mut part);
        for (dst, src) in y.chunks_mut(stride).zip(part.chunks(out_features)) {
            dst[col..col + out_features].copy_from_slice(src);
        }
        return Ok(());
    }
    // SAFETY: as in linear_into, with Y's rows `stride` apart and this part's columns starting
    // at `col`: row r's last element, r·stride + col + out − 1, lies inside y (checked above).
    unsafe {
        gemm_f32(
            rows, out_features, in_features,
            y.as_mut_ptr().add(col), stride as isize, 1,
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

/// Bytes/s of reading a buffer of `bytes` bytes (sized past the last-level cache) on the current
/// rayon pool, split in one contiguous part per thread: one warm-up, then the best of `reps`
/// timed passes. The memory roofline of a decode step, which reads every weight once.
pub fn measure_read_bandwidth(bytes: usize, reps: usize) -> f64 {
    use rayon::prelude::*;
    let buf: Vec<f32> = (0..bytes / 4).map(|i| (i % 7) as f32).collect();
    let parts = rayon::current_num_threads().max(1);
    let chunk = buf.len().div_ceil(parts).max(16);
    let pass = || -> f32 {
        buf.par_chunks(chunk)
            .map(|c| {
                // Sixteen independent lanes: the sum vectorises and keeps enough loads in flight.
                let mut acc = [0.0f32; 16];
                let mut it = c.chunks_exact(16);
                for v in &mut it {
                    for (a, &x) in acc.iter_mut().zip(v) {
                        *a += x;
                    }
                }
                acc.iter().sum::<f32>() + it.remainder().iter().sum::<f32>()
            })
            .sum()
    };
    std::hint::black_box(pass());
    let mut best = f64::INFINITY;
    for _ in 0..reps.max(1) {
        let t = std::time::Instant::now();
        std::hint::black_box(pass());
        best = best.min(t.elapsed().as_secs_f64());
    }
    (buf.len() * 4) as f64 / best
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

    /// Both forms (the tiled one up to F32_TILED_MAX_ROWS rows, the GEMM beyond) against an f64
    /// sum, with widths that leave partial vector blocks and partial four-row tiles.
    #[test]
    fn tiled_and_gemm_forms_match_the_f64_sum() {
        for &(rows, inf, outf) in &[(1usize, 37usize, 9usize), (3, 64, 6), (5, 300, 13), (16, 128, 8), (17, 96, 10), (40, 33, 7)] {
            let x: Vec<f32> = (0..rows * inf).map(|i| ((i * 13 % 29) as f32 - 14.0) / 9.0).collect();
            let w: Vec<f32> = (0..outf * inf).map(|i| ((i * 7 % 23) as f32 - 11.0) / 8.0).collect();
            let mut y = vec![f32::NAN; rows * outf];
            linear_into(&x, rows, &w, outf, inf, &mut y).unwrap();
            for t in 0..rows {
                for o in 0..outf {
                    let want: f64 = (0..inf).map(|k| x[t * inf + k] as f64 * w[o * inf + k] as f64).sum();
                    let got = y[t * outf + o] as f64;
                    assert!((got - want).abs() <= 1e-5 * (1.0 + want.abs()), "rows {rows} in {inf} out {outf} ({t},{o}): {got} vs {want}");
                }
            }
        }
    }
}
