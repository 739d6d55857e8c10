//! Launcher of `rope.cu`, with the shape checks of the CPU twin in this folder.

use std::sync::Arc;

use cudarc::driver::DeviceRepr;

use crate::cuda::{driver_err, grid_for, int_arg, long_arg, CudaFunction, CudaSlice, Gpu, KernelSource, LaunchConfig};
use crate::error::Result;
use crate::kernels::rope::{check_head_prep, HeadPrepView, RopeTable};

pub const SOURCE: KernelSource =
    KernelSource { name: "tern_rope", code: concat!(include_str!("../prelude.cuh"), "\n", include_str!("head.cuh"), "\n", include_str!("rope.cu")) };

/// A RoPE table on the device: the CPU table's cos/sin values, uploaded once.
pub struct GpuRope {
    pub rot: usize,
    pub positions: usize,
    pub(crate) cos: CudaSlice<f32>,
    pub(crate) sin: CudaSlice<f32>,
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
    /// `tern_head_prep_regs`: each head in registers (heads of at most [`PREP_REGS_MAX_HD`]),
    /// in steps of few rows, unless `regs` is off (TERN_NORM_REGS=0).
    prep_regs: CudaFunction,
    regs: bool,
}

/// Warps a block (TERN_PREP_WARPS in rope.cu: the register form's shared rows are per warp).
const WARPS: u32 = 4;
/// Channels a head may have for the register form (32 · TERN_PREP_SLOTS in rope.cu).
const PREP_REGS_MAX_HD: usize = 512;
/// Sections one launch prepares (TERN_HEAD_SECTIONS in rope.cu).
pub const HEAD_SECTIONS: usize = 3;

/// Mirrors `tern_head_sections` in rope.cu field for field (C layout), passed by value.
#[repr(C)]
#[derive(Clone, Copy, Default)]
struct HeadSections {
    off: [i64; HEAD_SECTIONS],
    w: [u64; HEAD_SECTIONS],
    cos: [u64; HEAD_SECTIONS],
    sin: [u64; HEAD_SECTIONS],
    heads: [i32; HEAD_SECTIONS],
    hd: [i32; HEAD_SECTIONS],
    norm: [i32; HEAD_SECTIONS],
    rot: [i32; HEAD_SECTIONS],
    eps: [f32; HEAD_SECTIONS],
    n: i32,
}
// SAFETY: plain integers and floats in the kernel's C layout.
unsafe impl DeviceRepr for HeadSections {}

impl RopeCuda {
    pub fn new(gpu: Arc<Gpu>) -> Result<Self> {
        Ok(RopeCuda {
            prep: gpu.function(&SOURCE, "tern_head_prep")?,
            prep_regs: gpu.function(&SOURCE, "tern_head_prep_regs")?,
            regs: crate::kernels::norm::cuda::regs_from_env(),
            gpu,
        })
    }

    /// This handle with the register form on or off, whatever TERN_NORM_REGS says: the device
    /// test runs both.
    #[cfg(test)]
    pub(crate) fn with_regs(mut self, on: bool) -> Self {
        self.regs = on;
        self
    }

    /// In place on `rows` rows of `x` (row stride `stride`): each section `(offset, prep)`
    /// holds `prep.heads` heads from column `offset` (the q, k and v of a fused projection),
    /// prepared by one launch per [`HEAD_SECTIONS`] sections. `positions[r]` is row r's
    /// position, `max_position` their maximum (the caller knows it from the segments). CPU
    /// twin: [`super::head_prep`] per section.
    pub fn head_prep(
        &self,
        x: &mut CudaSlice<f32>,
        stride: usize,
        rows: usize,
        positions: &CudaSlice<u32>,
        max_position: usize,
        sections: &[(usize, GpuHeadPrep)],
    ) -> Result<()> {
        for (offset, prep) in sections {
            check_head_prep(
                HeadPrepView { len: x.len(), offset: *offset, stride, rows, heads: prep.heads, hd: prep.hd },
                prep.norm.flatten().map(CudaSlice::len),
                prep.rope.map(|t| (t.rot, t.positions)),
                positions.len(),
                (rows > 0).then_some(max_position),
            )?;
        }
        let g = &self.gpu;
        for group in sections.chunks(HEAD_SECTIONS) {
            let mut s = HeadSections { n: group.len() as i32, ..Default::default() };
            let mut total = 0usize;
            for (i, (offset, prep)) in group.iter().enumerate() {
                s.off[i] = long_arg(*offset);
                s.w[i] = g.ptr_opt(prep.norm.flatten());
                s.norm[i] = prep.norm.is_some() as i32;
                s.eps[i] = prep.eps;
                s.heads[i] = int_arg("heads", prep.heads)?;
                s.hd[i] = int_arg("head size", prep.hd)?;
                if let Some(t) = prep.rope {
                    (s.cos[i], s.sin[i], s.rot[i]) = (g.ptr(&t.cos), g.ptr(&t.sin), t.rot as i32);
                }
                total += prep.heads;
            }
            if rows * total == 0 {
                continue;
            }
            let (r, heads, ld) = (int_arg("head_prep rows", rows)?, int_arg("heads", total)?, long_arg(stride));
            let (xp, pp) = (g.ptr(x), g.ptr(positions));
            let in_regs = self.regs && rows <= crate::kernels::norm::cuda::REGS_MAX_ROWS && group.iter().all(|(_, prep)| prep.hd <= PREP_REGS_MAX_HD);
            // Both kernels take the same arguments.
            let mut l = g.launch_builder(if in_regs { &self.prep_regs } else { &self.prep });
            l.arg(&xp).arg(&ld).arg(&r).arg(&heads).arg(&s).arg(&pp);
            let cfg = LaunchConfig { grid_dim: (grid_for(rows * total, WARPS)?, 1, 1), block_dim: (32 * WARPS, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: argument types match tern_head_prep(_regs); every section's view holds its
            // heads (checked) and positions index inside each table (checked against the
            // maximum); the register form's heads fit its slots and its blocks are WARPS warps.
            unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_head_prep"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The register form's limits are written in rope.cu as numbers: they must be the
    /// launcher's block and head bounds.
    #[test]
    fn register_form_constants_match_the_launcher() {
        let code = include_str!("rope.cu");
        assert!(code.contains(&format!("#define TERN_PREP_WARPS {WARPS}\n")));
        assert!(code.contains(&format!("#define TERN_PREP_SLOTS {}\n", PREP_REGS_MAX_HD / 32)));
        assert_eq!(PREP_REGS_MAX_HD, crate::kernels::attention::cuda::MAX_HEAD_DIM);
    }
}
