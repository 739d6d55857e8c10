//! Launchers of `norm.cu`, with the shape checks of the CPU twins in this folder.

use std::sync::Arc;

use crate::cuda::{driver_err, grid_for, int_arg, CudaFunction, CudaSlice, Gpu, KernelSource, LaunchConfig};
use crate::error::{Error, Result};
use crate::kernels::check_len;

pub const SOURCE: KernelSource =
    KernelSource { name: "tern_norm", code: concat!(include_str!("../prelude.cuh"), "\n", include_str!("norm.cu")) };

/// Threads per row: enough to cover narrow rows, 256 for wide ones.
fn row_block(d: usize) -> u32 {
    (d.div_ceil(32) * 32).clamp(32, 256) as u32
}

fn rows_of(what: &str, len: usize, d: usize) -> Result<usize> {
    if d == 0 || len % d != 0 {
        return Err(Error::Shape(format!("{what}: {len} elements are not rows of {d}")));
    }
    Ok(len / d)
}

/// Where a normalised row goes: f32, bf16 (the fast mode's GEMM operand), or both.
pub struct NormOut<'a> {
    pub f32: Option<&'a mut CudaSlice<f32>>,
    pub bf16: Option<&'a mut CudaSlice<u16>>,
}

impl NormOut<'_> {
    fn check(&self, what: &str, len: usize) -> Result<()> {
        if self.f32.is_none() && self.bf16.is_none() {
            return Err(Error::Shape(format!("{what}: no output buffer")));
        }
        if let Some(y) = &self.f32 {
            check_len(what, y.len(), len)?;
        }
        if let Some(y) = &self.bf16 {
            check_len(what, y.len(), len)?;
        }
        Ok(())
    }
}

pub struct NormCuda {
    gpu: Arc<Gpu>,
    rms: CudaFunction,
    add: CudaFunction,
    /// `tern_add_norm_regs`: the row in registers, for rows of at most
    /// [`NORM_SLOTS`] · [`row_block`] values in steps of at most [`REGS_MAX_ROWS`] rows, unless
    /// `regs` is off (TERN_NORM_REGS=0).
    add_regs: CudaFunction,
    regs: bool,
    /// `tern_add_norm_rows_c{n}`: one warp per row of 128·n values (n = 1..=8), for steps of
    /// more than [`REGS_MAX_ROWS`] rows unless `warp_rows` is off (TERN_NORM_WARP_ROWS=0). On the
    /// H200 it took EmbeddingGemma 2's 64 documents of 512 tokens from 57.2 to 53.0 ms in bf16
    /// mode (BENCHMARKS.md, 2026-12-05).
    add_rows: Vec<CudaFunction>,
    warp_rows: bool,
    residual: CudaFunction,
}

/// Rows a block of `tern_add_norm_rows` (8 warps, one row each).
const WARP_ROWS_PER_BLOCK: usize = 8;
/// The widest row `tern_add_norm_rows` holds: 8 chunks of 128 values (4 a lane).
const WARP_ROWS_MAX_CHUNKS: usize = 8;

/// Values a thread holds in `tern_add_norm_regs` (TERN_NORM_SLOTS in norm.cu).
const NORM_SLOTS: usize = 4;

/// Whether the kernels that hold a row (a norm's, a head's) in registers, every operand loaded
/// before the first sum, serve short steps: yes unless TERN_NORM_REGS=0 (the forms that re-read
/// the row, for measuring the two on one run; both give the same bits).
pub(crate) fn regs_from_env() -> bool {
    std::env::var("TERN_NORM_REGS").map_or(true, |v| v != "0")
}

/// The steps, in rows, that take the register forms. H200, bf16 mode, both register forms and
/// the GEMV's loads ahead against neither: an 8-token query 1.155 -> 0.858 ms (EmbeddingGemma 2
/// shapes) and 0.893 -> 0.649 ms (300M); but 64 documents of 7 667 tokens took 6% longer with
/// the register forms (15.6 -> 16.5 ms), so long steps keep the re-reading forms.
pub(crate) const REGS_MAX_ROWS: usize = 64;

impl NormCuda {
    pub fn new(gpu: Arc<Gpu>) -> Result<Self> {
        Ok(NormCuda {
            rms: gpu.function(&SOURCE, "tern_rms_norm")?,
            add: gpu.function(&SOURCE, "tern_add_norm")?,
            add_regs: gpu.function(&SOURCE, "tern_add_norm_regs")?,
            regs: regs_from_env(),
            add_rows: (1..=WARP_ROWS_MAX_CHUNKS).map(|n| gpu.function(&SOURCE, &format!("tern_add_norm_rows_c{n}"))).collect::<Result<_>>()?,
            warp_rows: std::env::var("TERN_NORM_WARP_ROWS").map_or(true, |v| v != "0"),
            residual: gpu.function(&SOURCE, "tern_residual_norm")?,
            gpu,
        })
    }

    /// This handle with the register forms on or off, whatever TERN_NORM_REGS says: the device
    /// test runs both.
    #[cfg(test)]
    pub(crate) fn with_regs(mut self, on: bool) -> Self {
        self.regs = on;
        self
    }

    /// This handle with long steps' sandwich-norm step on one warp per row (`true`) or one
    /// block per row, whatever TERN_NORM_WARP_ROWS says: the device test runs both.
    #[cfg(test)]
    pub(crate) fn with_warp_rows(mut self, on: bool) -> Self {
        self.warp_rows = on;
        self
    }

    /// y = rms(pre·x)·w per row of `d`. CPU twin: [`super::rms_norm`].
    pub fn rms_norm(&self, x: &CudaSlice<f32>, d: usize, w: Option<&CudaSlice<f32>>, pre: f32, eps: f32, y: NormOut) -> Result<()> {
        let rows = rows_of("rms_norm", x.len(), d)?;
        y.check("rms_norm output", x.len())?;
        if let Some(w) = w {
            check_len("rms_norm weight", w.len(), d)?;
        }
        if rows == 0 {
            return Ok(());
        }
        let g = &self.gpu;
        let (dw, rows32) = (int_arg("rms_norm width", d)?, grid_for(rows, 1)?);
        let (xp, wp, yp, y16p) = (g.ptr(x), g.ptr_opt(w), g.ptr_opt(y.f32.as_deref()), g.ptr_opt(y.bf16.as_deref()));
        let mut l = g.launch_builder(&self.rms);
        l.arg(&xp).arg(&wp).arg(&pre).arg(&eps).arg(&dw).arg(&yp).arg(&y16p);
        let cfg = LaunchConfig { grid_dim: (rows32, 1, 1), block_dim: (row_block(d), 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types match tern_rms_norm; every buffer holds rows × d (checked),
        // and a null weight or output is tested by the kernel.
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_rms_norm"))?;
        Ok(())
    }

    /// h = (h + rms(y)·w)·post, then with `next = (w2, out)` out = rms(h)·w2. CPU twin:
    /// [`super::add_norm`]. One block per row.
    #[allow(clippy::too_many_arguments)]
    pub fn add_norm(
        &self,
        h: &mut CudaSlice<f32>,
        y: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        post: f32,
        d: usize,
        eps: f32,
        next: Option<(&CudaSlice<f32>, NormOut)>,
    ) -> Result<()> {
        let rows = rows_of("add_norm", h.len(), d)?;
        check_len("add_norm input", y.len(), h.len())?;
        check_len("add_norm weight", w.len(), d)?;
        if let Some((w2, out)) = &next {
            check_len("add_norm next weight", w2.len(), d)?;
            out.check("add_norm next output", h.len())?;
        }
        if rows == 0 {
            return Ok(());
        }
        let g = &self.gpu;
        let (dw, rows32) = (int_arg("add_norm width", d)?, grid_for(rows, 1)?);
        let (w2p, ap, a16p) = match &next {
            Some((w2, out)) => (g.ptr(*w2), g.ptr_opt(out.f32.as_deref()), g.ptr_opt(out.bf16.as_deref())),
            None => (0, 0, 0),
        };
        let (hp, yp, wp) = (g.ptr(h), g.ptr(y), g.ptr(w));
        let chunks = d / 128;
        if self.warp_rows && rows > REGS_MAX_ROWS && d % 128 == 0 && (1..=WARP_ROWS_MAX_CHUNKS).contains(&chunks) {
            let rows_arg = int_arg("add_norm rows", rows)?;
            let mut l = g.launch_builder(&self.add_rows[chunks - 1]);
            l.arg(&hp).arg(&yp).arg(&wp).arg(&post).arg(&eps).arg(&dw).arg(&w2p).arg(&ap).arg(&a16p).arg(&rows_arg);
            let blocks = grid_for(rows, WARP_ROWS_PER_BLOCK as u32)?;
            let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (32 * WARP_ROWS_PER_BLOCK as u32, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: argument types match tern_add_norm_rows_c{chunks}; all buffers hold rows ×
            // d (checked) with d = 128·chunks, so every lane's 16-byte chunk of a row is inside
            // it and aligned (rows start at multiples of 128 values); warps past `rows` return.
            unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_add_norm_rows"))?;
            return Ok(());
        }
        let in_regs = self.regs && rows <= REGS_MAX_ROWS && d <= NORM_SLOTS * row_block(d) as usize;
        // Both kernels take the same arguments.
        let mut l = g.launch_builder(if in_regs { &self.add_regs } else { &self.add });
        l.arg(&hp).arg(&yp).arg(&wp).arg(&post).arg(&eps).arg(&dw).arg(&w2p).arg(&ap).arg(&a16p);
        let cfg = LaunchConfig { grid_dim: (rows32, 1, 1), block_dim: (row_block(d), 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types match tern_add_norm(_regs); all buffers hold rows × d
        // (checked); the regs form covers the row (d <= NORM_SLOTS · block).
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_add_norm"))?;
        Ok(())
    }

    /// x += y, then a = rms(x)·w per row of `d`. CPU twin: [`super::residual_norm`].
    pub fn residual_norm(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>, w: &CudaSlice<f32>, d: usize, eps: f32, a: NormOut) -> Result<()> {
        let rows = rows_of("residual_norm", x.len(), d)?;
        check_len("residual_norm input", y.len(), x.len())?;
        check_len("residual_norm weight", w.len(), d)?;
        a.check("residual_norm output", x.len())?;
        if rows == 0 {
            return Ok(());
        }
        let g = &self.gpu;
        let (dw, rows32) = (int_arg("residual_norm width", d)?, grid_for(rows, 1)?);
        let (xp, yp, wp, ap, a16p) = (g.ptr(x), g.ptr(y), g.ptr(w), g.ptr_opt(a.f32.as_deref()), g.ptr_opt(a.bf16.as_deref()));
        let mut l = g.launch_builder(&self.residual);
        l.arg(&xp).arg(&yp).arg(&wp).arg(&eps).arg(&dw).arg(&ap).arg(&a16p);
        let cfg = LaunchConfig { grid_dim: (rows32, 1, 1), block_dim: (row_block(d), 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types match tern_residual_norm; all buffers hold rows × d (checked).
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_residual_norm"))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The register form's slots are written in norm.cu as a number; rows up to 1024 (the
    /// encoders' widths) fit it.
    #[test]
    fn register_form_slots_match_the_launcher() {
        assert!(include_str!("norm.cu").contains(&format!("#define TERN_NORM_SLOTS {NORM_SLOTS}\n")));
        for d in [32usize, 100, 512, 768, 1024] {
            assert!(d <= NORM_SLOTS * row_block(d) as usize, "{d}");
        }
    }
}
