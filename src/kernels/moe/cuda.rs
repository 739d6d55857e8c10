//! Launchers of `moe.cu`, with the checks of the CPU twins in this folder. Rows are routed on
//! the device ([`MoeCuda::route`]; on the host, [`super::route`], past its limits), then:
//! - many rows (a prompt): the ids come back to the host, which sorts the (row, choice) slots
//!   by expert; while the experts get few rows each, GEMVs run over tiles of up to 8 of an
//!   expert's rows, one launch a product ([`crate::kernels::matmul::cuda::Blas::tiles`]), else
//!   each expert's products run once over its slice of the gathered rows
//!   ([`crate::kernels::matmul::cuda::Blas::grouped_linear`]); [`MoeCuda::combine`] reads
//!   each slot's output back by its sorted position;
//! - a few rows (a decode step): the products read each slot's expert from the ids on the
//!   device ([`crate::kernels::matmul::cuda::Blas::routed`]) and [`MoeCuda::combine`] adds them
//!   up (for one row, the down products, their sum, the residual step and the norm are one
//!   launch: [`crate::kernels::matmul::cuda::Blas::routed_residual_norm`]): nothing goes back
//!   to the host, so the step can be recorded as a graph. A shared
//!   expert of the routed experts' shape is one more slot of each row there (its gate's
//!   sigmoid as the weight, added last), so its products cost no launches of their own;
//!   elsewhere it runs as a dense MLP and [`MoeCuda::add_sigmoid_gated`] adds it.

use std::sync::Arc;

use crate::cuda::{driver_err, grid_for, int_arg, CudaFunction, CudaSlice, Gpu, KernelSource, LaunchConfig};
use crate::error::{Error, Result};
use crate::kernels::check_len;

pub const SOURCE: KernelSource =
    KernelSource { name: "tern_moe", code: concat!(include_str!("../prelude.cuh"), "\n", include_str!("moe.cu")) };

pub struct MoeCuda {
    gpu: Arc<Gpu>,
    gated: CudaFunction,
    route: CudaFunction,
    combine: CudaFunction,
}

/// Choices per row the device routing takes (each is held by one lane of the row's warp,
/// which would allow 32); past it the host routes.
pub const MAX_DEVICE_TOP_K: usize = 16;
/// Experts whose probabilities fit the routing block's shared memory at the default limit.
pub const MAX_DEVICE_EXPERTS: usize = 12 * 1024;

fn grid(n: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig { grid_dim: (grid_for(n, 256)?.min(65_535), 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 })
}

impl MoeCuda {
    pub fn new(gpu: Arc<Gpu>) -> Result<Self> {
        Ok(MoeCuda {
            gated: gpu.function(&SOURCE, "tern_add_sigmoid_gated")?,
            route: gpu.function(&SOURCE, "tern_moe_route")?,
            combine: gpu.function(&SOURCE, "tern_moe_combine")?,
            gpu,
        })
    }

    /// Routes the rows of router logits ([rows][stride], the experts' logits first) on the
    /// device: each row's top-k experts (ascending) in `ids` and their renormalised weights in
    /// `weights`, [rows][k]; with `shared`, column `ne` is the shared expert's gate logit and
    /// each row gets one more slot, [rows][k + 1]: id `ne`, weight sigmoid(gate). CPU twin:
    /// [`super::route`] (and the CPU backend's sigmoid gate of the shared expert).
    #[allow(clippy::too_many_arguments)]
    pub fn route(&self, logits: &CudaSlice<f32>, ne: usize, stride: usize, k: usize, shared: bool, ids: &mut CudaSlice<i32>, weights: &mut CudaSlice<f32>) -> Result<()> {
        if ne == 0 || k == 0 || k > ne || k > MAX_DEVICE_TOP_K || ne > MAX_DEVICE_EXPERTS || stride < ne + shared as usize || logits.len() % stride != 0 {
            return Err(Error::Shape(format!(
                "moe routing on the device: top-{k} of {ne} experts over {} logits in rows of {stride} (at most top-{MAX_DEVICE_TOP_K} of {MAX_DEVICE_EXPERTS})",
                logits.len()
            )));
        }
        let rows = logits.len() / stride;
        let slots = rows * (k + shared as usize);
        check_len("moe route ids", ids.len(), slots)?;
        check_len("moe route weights", weights.len(), slots)?;
        if rows == 0 {
            return Ok(());
        }
        let g = &self.gpu;
        let (nei, si, ki, shi) = (int_arg("experts", ne)?, int_arg("logit stride", stride)?, int_arg("top-k", k)?, shared as i32);
        let (lp, ip, wp) = (g.ptr(logits), g.ptr(ids), g.ptr(weights));
        let mut l = g.launch_builder(&self.route);
        l.arg(&lp).arg(&nei).arg(&si).arg(&ki).arg(&shi).arg(&ip).arg(&wp);
        let cfg = LaunchConfig { grid_dim: (grid_for(rows, 1)?, 1, 1), block_dim: (32, 1, 1), shared_mem_bytes: (4 * ne) as u32 };
        // SAFETY: argument types match tern_moe_route; one warp per row reads its ne (+ 1)
        // logits and writes k (+ 1) ids (each at most ne) and weights; ne floats of shared
        // memory (<= 48 KB).
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_moe_route"))?;
        Ok(())
    }

    /// out[r] = Σ_j y[s]·weights[r·k + j], rows of `d`, the choices added in order from zero;
    /// s is the slot r·k + j, or with `pos` the row pos[r·k + j] of y that holds that slot's
    /// output (rows of a prompt's experts sorted by expert; uploaded here). CPU twin: the
    /// accumulation in [`super::moe_experts`].
    pub fn combine(&self, y: &CudaSlice<f32>, pos: Option<&[u32]>, weights: &CudaSlice<f32>, k: usize, d: usize, out: &mut CudaSlice<f32>) -> Result<()> {
        if d == 0 || k == 0 || out.len() % d != 0 {
            return Err(Error::Shape(format!("moe combine: {} outputs as rows of {d}, {k} choices", out.len())));
        }
        let rows = out.len() / d;
        check_len("moe combine weights", weights.len(), rows * k)?;
        check_len("moe combine input", y.len(), rows * k * d)?;
        if let Some(p) = pos {
            check_len("moe combine positions", p.len(), rows * k)?;
            if let Some(&bad) = p.iter().find(|&&s| s as usize >= rows * k) {
                return Err(Error::Shape(format!("moe combine: position {bad} of {} outputs", rows * k)));
            }
        }
        if rows == 0 {
            return Ok(());
        }
        let g = &self.gpu;
        let pos = pos.map(|p| g.upload(p)).transpose()?;
        let (ri, ki, di) = (int_arg("rows", rows)?, int_arg("top-k", k)?, int_arg("width", d)?);
        let (yp, wp, pp, op) = (g.ptr(y), g.ptr(weights), g.ptr_opt(pos.as_ref()), g.ptr(out));
        let mut l = g.launch_builder(&self.combine);
        l.arg(&yp).arg(&wp).arg(&pp).arg(&ri).arg(&ki).arg(&di).arg(&op);
        // SAFETY: argument types match tern_moe_combine; y holds rows × k × d, weights (and
        // pos, each value below rows × k) rows × k and out rows × d (checked).
        unsafe { l.launch(grid(rows * d)?) }.map_err(driver_err("launching tern_moe_combine"))?;
        Ok(())
    }

    /// out[r] += sigmoid(gate[r·stride + at])·y[r], rows of `d` (the shared expert's gate: a
    /// column of the router's output). CPU twin: the CPU backend's shared expert in its moe.
    pub fn add_sigmoid_gated(&self, out: &mut CudaSlice<f32>, y: &CudaSlice<f32>, gate: &CudaSlice<f32>, at: usize, stride: usize, d: usize) -> Result<()> {
        check_len("add_sigmoid_gated input", y.len(), out.len())?;
        if d == 0 || out.len() % d != 0 || at >= stride || gate.len() != out.len() / d * stride {
            return Err(Error::Shape(format!("add_sigmoid_gated: {} outputs in rows of {d}, gates at {at} of rows of {stride} in {}", out.len(), gate.len())));
        }
        if out.is_empty() {
            return Ok(());
        }
        let g = &self.gpu;
        let (n, dw, gs) = (int_arg("gated rows", out.len() / d)?, int_arg("gated width", d)?, int_arg("gate stride", stride)?);
        let (op, yp, gp) = (g.ptr(out), g.ptr(y), g.ptr(gate) + 4 * at as u64);
        let mut l = g.launch_builder(&self.gated);
        l.arg(&op).arg(&yp).arg(&gp).arg(&gs).arg(&n).arg(&dw);
        // SAFETY: argument types match; out and y hold n × d, gate n rows of `stride` with
        // column `at` inside them (checked).
        unsafe { l.launch(grid(out.len())?) }.map_err(driver_err("launching tern_add_sigmoid_gated"))?;
        Ok(())
    }
}
