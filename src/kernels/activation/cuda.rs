//! Launcher of `activation.cu`, with the shape checks of the CPU twin in this folder.

use std::sync::Arc;

use crate::cuda::{driver_err, grid_for, int_arg, long_arg, CudaFunction, CudaSlice, Gpu, KernelSource, LaunchConfig};
use crate::error::Result;
use crate::kernels::backend::{check_view, GatedActivation, View};
use crate::kernels::check_len;
use crate::kernels::norm::cuda::NormOut;

pub const SOURCE: KernelSource =
    KernelSource { name: "tern_activation", code: concat!(include_str!("../prelude.cuh"), "\n", include_str!("activation.cu")) };

/// A gated activation's two kernels: the general form, and the quad form for aligned views.
struct Gated {
    general: CudaFunction,
    quads: CudaFunction,
}

impl Gated {
    fn new(gpu: &Gpu, name: &str) -> Result<Self> {
        Ok(Gated { general: gpu.function(&SOURCE, name)?, quads: gpu.function(&SOURCE, &format!("{name}_quads"))? })
    }
}

pub struct ActivationCuda {
    gpu: Arc<Gpu>,
    gelu: Gated,
    silu: Gated,
}

impl ActivationCuda {
    pub fn new(gpu: Arc<Gpu>) -> Result<Self> {
        Ok(ActivationCuda { gelu: Gated::new(&gpu, "tern_gelu_tanh_mul")?, silu: Gated::new(&gpu, "tern_silu_mul")?, gpu })
    }

    /// out = gelu_tanh(g)·u over `rows × width` (out contiguous). CPU twin:
    /// [`super::gelu_tanh_mul_views`].
    pub fn gelu_tanh_mul(&self, g: View<CudaSlice<f32>>, u: View<CudaSlice<f32>>, rows: usize, width: usize, out: NormOut) -> Result<()> {
        self.gated("gelu_tanh_mul", &self.gelu, g, u, rows, width, out)
    }

    /// `act(g)·u` over `rows × width` (out contiguous): [`Self::gelu_tanh_mul`] or
    /// [`Self::silu_mul`] as `act` says.
    pub fn gated_mul(&self, act: GatedActivation, g: View<CudaSlice<f32>>, u: View<CudaSlice<f32>>, rows: usize, width: usize, out: NormOut) -> Result<()> {
        match act {
            GatedActivation::GeluTanh => self.gelu_tanh_mul(g, u, rows, width, out),
            GatedActivation::Silu => self.silu_mul(g, u, rows, width, out),
        }
    }

    /// out = silu(g)·u over `rows × width` (out contiguous). CPU twin: [`super::silu_mul_views`].
    pub fn silu_mul(&self, g: View<CudaSlice<f32>>, u: View<CudaSlice<f32>>, rows: usize, width: usize, out: NormOut) -> Result<()> {
        self.gated("silu_mul", &self.silu, g, u, rows, width, out)
    }

    #[allow(clippy::too_many_arguments)]
    fn gated(&self, what: &str, f: &Gated, g: View<CudaSlice<f32>>, u: View<CudaSlice<f32>>, rows: usize, width: usize, out: NormOut) -> Result<()> {
        check_view(&format!("{what} gate"), g.buf.len(), g.offset, g.stride, rows, width)?;
        check_view(&format!("{what} up"), u.buf.len(), u.offset, u.stride, rows, width)?;
        if let Some(o) = &out.f32 {
            check_len(&format!("{what} output"), o.len(), rows * width)?;
        }
        if let Some(o) = &out.bf16 {
            check_len(&format!("{what} output"), o.len(), rows * width)?;
        }
        if rows * width == 0 {
            return Ok(());
        }
        let gp = &self.gpu;
        let (r, w) = (int_arg("activation rows", rows)?, int_arg("activation width", width)?);
        let (g_off, g_ld, u_off, u_ld) = (long_arg(g.offset), long_arg(g.stride), long_arg(u.offset), long_arg(u.stride));
        let (g_p, u_p, o_p, o16_p) = (gp.ptr(g.buf), gp.ptr(u.buf), gp.ptr_opt(out.f32.as_deref()), gp.ptr_opt(out.bf16.as_deref()));
        // The quad form where every access is aligned (buffers start aligned) and its 32-bit
        // quad index cannot overflow.
        let quads = [width, g.offset, g.stride, u.offset, u.stride].iter().all(|v| v % 4 == 0) && rows * width / 4 <= i32::MAX as usize;
        let mut l = gp.launch_builder(if quads { &f.quads } else { &f.general });
        l.arg(&g_p).arg(&g_off).arg(&g_ld).arg(&u_p).arg(&u_off).arg(&u_ld).arg(&r).arg(&w).arg(&o_p).arg(&o16_p);
        let blocks = grid_for(if quads { rows * width / 4 } else { rows * width }, 256)?.min(65_535);
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types match (both forms take the same); both views hold rows × width
        // (checked), the grid-stride loop covers every element (quad) once, and the quad form
        // only gets views whose every 4-element access is 16-byte aligned (the test above).
        unsafe { l.launch(cfg) }.map_err(driver_err("launching a gated activation"))?;
        Ok(())
    }
}
