//! Launcher of `embedding.cu`, with the checks of the CPU twin in this folder.

use std::sync::Arc;

use crate::cuda::{driver_err, grid_for, int_arg, CudaFunction, CudaSlice, Gpu, KernelSource, LaunchConfig};
use crate::error::Result;
use crate::kernels::check_len;

pub const SOURCE: KernelSource =
    KernelSource { name: "tern_embedding", code: concat!(include_str!("../prelude.cuh"), "\n", include_str!("embedding.cu")) };

/// Token ids on the device, with their maximum taken on the host at upload, so the lookup can
/// check them against a table without reading them back.
pub struct GpuIds {
    pub ids: CudaSlice<u32>,
    pub len: usize,
    pub max: u32,
}

impl GpuIds {
    pub fn new(gpu: &Gpu, ids: &[u32]) -> Result<Self> {
        Ok(GpuIds { ids: gpu.upload(ids)?, len: ids.len(), max: ids.iter().copied().max().unwrap_or(0) })
    }

    /// Replaces the ids with as many new ones (a replayed graph reads this buffer).
    pub fn write(&mut self, gpu: &Gpu, ids: &[u32]) -> Result<()> {
        gpu.write(ids, &mut self.ids)?;
        self.max = ids.iter().copied().max().unwrap_or(0);
        Ok(())
    }
}

pub struct EmbeddingCuda {
    gpu: Arc<Gpu>,
    lookup: CudaFunction,
}

impl EmbeddingCuda {
    pub fn new(gpu: Arc<Gpu>) -> Result<Self> {
        Ok(EmbeddingCuda { lookup: gpu.function(&SOURCE, "tern_embed_lookup")?, gpu })
    }

    /// out[r] = table[ids[r]]·scale for a table of `table_rows × width`. CPU twin:
    /// [`super::embed_lookup`].
    pub fn embed_lookup(&self, table: &CudaSlice<f32>, width: usize, ids: &GpuIds, scale: f32, out: &mut CudaSlice<f32>) -> Result<()> {
        if width == 0 || table.len() % width != 0 {
            return Err(crate::Error::Shape(format!("embedding table: {} elements are not rows of {width}", table.len())));
        }
        if ids.len > 0 && ids.max as usize >= table.len() / width {
            return Err(crate::Error::Input(format!("token id {} is outside the vocabulary of {}", ids.max, table.len() / width)));
        }
        check_len("embedding output", out.len(), ids.len * width)?;
        if ids.len == 0 {
            return Ok(());
        }
        let g = &self.gpu;
        let (rows, w) = (int_arg("embedding rows", ids.len)?, int_arg("embedding width", width)?);
        let (tp, ip, op) = (g.ptr(table), g.ptr(&ids.ids), g.ptr(out));
        let mut l = g.launch_builder(&self.lookup);
        l.arg(&tp).arg(&ip).arg(&rows).arg(&w).arg(&scale).arg(&op);
        let blocks = grid_for(ids.len * width, 256)?.min(65_535);
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types match; every id indexes the table (their maximum is checked),
        // out holds ids × width.
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_embed_lookup"))?;
        Ok(())
    }
}
