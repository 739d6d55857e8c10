//! Launchers of `moe.cu`, with the checks of the CPU twins in this folder. The routing itself
//! runs on the host ([`super::route`]) over the router's logits read back from the device: the
//! rows each expert gets decide which products run, and for the batches here (a decode step, a
//! prompt) one read-back per layer costs less than the products it saves.

use std::sync::Arc;

use crate::cuda::{driver_err, grid_for, int_arg, CudaFunction, CudaSlice, Gpu, KernelSource, LaunchConfig, PushKernelArg};
use crate::error::{Error, Result};
use crate::kernels::check_len;

pub const SOURCE: KernelSource =
    KernelSource { name: "tern_moe", code: concat!(include_str!("../prelude.cuh"), "\n", include_str!("moe.cu")) };

pub struct MoeCuda {
    gpu: Arc<Gpu>,
    scatter: CudaFunction,
    gated: CudaFunction,
}

fn grid(n: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig { grid_dim: (grid_for(n, 256)?.min(65_535), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 })
}

impl MoeCuda {
    pub fn new(gpu: Arc<Gpu>) -> Result<Self> {
        Ok(MoeCuda { scatter: gpu.function(&SOURCE, "tern_scatter_add_rows")?, gated: gpu.function(&SOURCE, "tern_add_sigmoid_gated")?, gpu })
    }

    /// out[rows[r]] += y[r]·weights[r] (rows of `d`; `rows` distinct, each below `out`'s row count).
    pub fn scatter_add_rows(&self, out: &mut CudaSlice<f32>, y: &CudaSlice<f32>, rows: &[u32], weights: &[f32], d: usize) -> Result<()> {
        check_len("scatter_add weights", weights.len(), rows.len())?;
        check_len("scatter_add input", y.len(), rows.len() * d)?;
        if d == 0 || out.len() % d != 0 {
            return Err(Error::Shape(format!("scatter_add: {} elements are not rows of {d}", out.len())));
        }
        if let Some(&r) = rows.iter().find(|&&r| r as usize >= out.len() / d) {
            return Err(Error::Shape(format!("scatter_add: row {r} of {}", out.len() / d)));
        }
        if rows.is_empty() {
            return Ok(());
        }
        let g = &self.gpu;
        let (rows_d, weights_d) = (g.upload(rows)?, g.upload(weights)?);
        let (n, dw) = (int_arg("scatter rows", rows.len())?, int_arg("scatter width", d)?);
        let (op, yp, rp, wp) = (g.ptr(out), g.ptr(y), g.ptr(&rows_d), g.ptr(&weights_d));
        let mut l = g.stream().launch_builder(&self.scatter);
        l.arg(&op).arg(&yp).arg(&rp).arg(&wp).arg(&n).arg(&dw);
        // SAFETY: argument types match; every row index is inside `out` (checked), y holds n × d.
        unsafe { l.launch(grid(rows.len() * d)?) }.map_err(driver_err("launching tern_scatter_add_rows"))?;
        Ok(())
    }

    /// out[r] += sigmoid(gate[r])·y[r], rows of `d`. CPU twin: the CPU backend's add_sigmoid_gated.
    pub fn add_sigmoid_gated(&self, out: &mut CudaSlice<f32>, y: &CudaSlice<f32>, gate: &CudaSlice<f32>, d: usize) -> Result<()> {
        check_len("add_sigmoid_gated input", y.len(), out.len())?;
        check_len("add_sigmoid_gated gate", gate.len() * d, out.len())?;
        if out.is_empty() {
            return Ok(());
        }
        let g = &self.gpu;
        let (n, dw) = (int_arg("gated rows", gate.len())?, int_arg("gated width", d)?);
        let (op, yp, gp) = (g.ptr(out), g.ptr(y), g.ptr(gate));
        let mut l = g.stream().launch_builder(&self.gated);
        l.arg(&op).arg(&yp).arg(&gp).arg(&n).arg(&dw);
        // SAFETY: argument types match; out and y hold n × d, gate n (checked).
        unsafe { l.launch(grid(out.len())?) }.map_err(driver_err("launching tern_add_sigmoid_gated"))?;
        Ok(())
    }
}
