//! Launcher of `pool.cu`, with the shape checks of the CPU twin in this folder.

use std::sync::Arc;

use crate::cuda::{driver_err, grid_for, int_arg, CudaFunction, CudaSlice, Gpu, KernelSource, LaunchConfig};
use crate::error::{Error, Result};
use crate::kernels::attention::cuda::GpuAttentionBatch;
use crate::kernels::check_len;

pub const SOURCE: KernelSource =
    KernelSource { name: "tern_pool", code: concat!(include_str!("../prelude.cuh"), "\n", include_str!("pool.cu")) };

pub struct PoolCuda {
    gpu: Arc<Gpu>,
    mean: CudaFunction,
}

impl PoolCuda {
    pub fn new(gpu: Arc<Gpu>) -> Result<Self> {
        Ok(PoolCuda { mean: gpu.function(&SOURCE, "tern_mean_pool")?, gpu })
    }

    /// out[s] = mean of sequence s's rows of `h` ([rows][d]). CPU twin: [`super::mean_pool`].
    pub fn mean_pool(&self, h: &CudaSlice<f32>, d: usize, batch: &GpuAttentionBatch, out: &mut CudaSlice<f32>) -> Result<()> {
        check_len("mean_pool input", h.len(), batch.rows * d)?;
        check_len("mean_pool output", out.len(), batch.segments.len() * d)?;
        let n = batch.segments.len();
        if n == 0 || d == 0 {
            return Ok(());
        }
        let seqs = u32::try_from(n).ok().filter(|&n| n <= 65_535).ok_or_else(|| Error::Shape(format!("mean_pool: {n} sequences in one launch")))?;
        let g = &self.gpu;
        let dw = int_arg("mean_pool width", d)?;
        let (hp, sp, lp, op) = (g.ptr(h), g.ptr(&batch.seg_start), g.ptr(&batch.seg_len), g.ptr(out));
        let mut l = g.launch_builder(&self.mean);
        l.arg(&hp).arg(&dw).arg(&sp).arg(&lp).arg(&op);
        let cfg = LaunchConfig { grid_dim: (grid_for(d, 32)?, seqs, 1), block_dim: (32, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types match; segments lie inside h's rows (made by the batch).
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_mean_pool"))?;
        Ok(())
    }
}
