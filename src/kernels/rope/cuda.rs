//! Launcher of `rope.cu`, with the shape checks of the CPU twin in this folder.

use std::sync::Arc;

use crate::cuda::{driver_err, grid_for, int_arg, long_arg, CudaFunction, CudaSlice, Gpu, KernelSource, LaunchConfig};
use crate::error::{Error, Result};
use crate::kernels::backend::check_view;
use crate::kernels::check_len;
use crate::kernels::rope::RopeTable;

pub const SOURCE: KernelSource =
    KernelSource { name: "tern_rope", code: concat!(include_str!("../prelude.cuh"), "\n", include_str!("rope.cu")) };

/// A RoPE table on the device: the CPU table's cos/sin values, uploaded once.
pub struct GpuRope {
    pub rot: usize,
    pub positions: usize,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
}

impl GpuRope {
    pub fn new(gpu: &Gpu, t: &RopeTable) -> Result<Self> {
        Ok(GpuRope { rot: t.rot, positions: t.positions(), cos: gpu.upload(t.cos())?, sin: gpu.upload(t.sin())? })
    }
}

/// What to do to each head (see [`crate::kernels::rope::HeadPrep`]).
pub struct GpuHeadPrep<'a> {
    pub heads: usize,
    pub hd: usize,
    pub norm: Option<Option<&'a CudaSlice<f32>>>,
    pub eps: f32,
    pub rope: Option<&'a GpuRope>,
}

pub struct RopeCuda {
    gpu: Arc<Gpu>,
    prep: CudaFunction,
}

const WARPS: u32 = 4;

impl RopeCuda {
    pub fn new(gpu: Arc<Gpu>) -> Result<Self> {
        Ok(RopeCuda { prep: gpu.function(&SOURCE, "tern_head_prep")?, gpu })
    }

    /// In place on `rows` rows of `x` from `offset` (row stride `stride`); `positions[r]` is
    /// row r's position, `max_position` their maximum (the caller knows it from the segments).
    /// CPU twin: [`super::head_prep`].
    #[allow(clippy::too_many_arguments)]
    pub fn head_prep(
        &self,
        x: &mut CudaSlice<f32>,
        offset: usize,
        stride: usize,
        rows: usize,
        positions: &CudaSlice<u32>,
        max_position: usize,
        prep: &GpuHeadPrep,
    ) -> Result<()> {
        check_view("head_prep input", x.len(), offset, stride, rows, prep.heads * prep.hd)?;
        if let Some(Some(w)) = prep.norm {
            check_len("head_prep norm weight", w.len(), prep.hd)?;
        }
        if let Some(t) = prep.rope {
            check_len("head_prep positions", positions.len(), rows)?;
            if t.rot > prep.hd || t.rot % 2 != 0 {
                return Err(Error::Shape(format!("rope over {} channels of a {}-channel head", t.rot, prep.hd)));
            }
            if rows > 0 && max_position >= t.positions {
                return Err(Error::Shape(format!("rope table positions: {} elements, at least {} needed", t.positions, max_position + 1)));
            }
        }
        if rows * prep.heads == 0 {
            return Ok(());
        }
        let g = &self.gpu;
        let (r, heads, hd) = (int_arg("head_prep rows", rows)?, int_arg("heads", prep.heads)?, int_arg("head size", prep.hd)?);
        let (off, ld) = (long_arg(offset), long_arg(stride));
        let norm = prep.norm.is_some() as i32;
        let wp = g.ptr_opt(prep.norm.flatten());
        let (cp, sp, rot) = match prep.rope {
            Some(t) => (g.ptr(&t.cos), g.ptr(&t.sin), t.rot as i32),
            None => (0, 0, 0),
        };
        let (xp, pp) = (g.ptr(x), g.ptr(positions));
        let mut l = g.launch_builder(&self.prep);
        l.arg(&xp).arg(&off).arg(&ld).arg(&r).arg(&heads).arg(&hd).arg(&norm).arg(&wp).arg(&prep.eps).arg(&cp).arg(&sp).arg(&rot).arg(&pp);
        let cfg = LaunchConfig { grid_dim: (grid_for(rows * prep.heads, WARPS)?, 1, 1), block_dim: (32 * WARPS, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types match tern_head_prep; the view holds every head (checked) and
        // positions index inside the table (checked against the maximum).
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_head_prep"))?;
        Ok(())
    }
}
