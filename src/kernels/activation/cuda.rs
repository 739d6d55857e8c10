//! Launcher of `activation.cu`, with the shape checks of the CPU twin in this folder.

use std::sync::Arc;

use crate::cuda::{driver_err, grid_for, int_arg, long_arg, CudaFunction, CudaSlice, Gpu, KernelSource, LaunchConfig, PushKernelArg};
use crate::error::Result;
use crate::kernels::backend::{check_view, View};
use crate::kernels::check_len;
use crate::kernels::norm::cuda::NormOut;

pub const SOURCE: KernelSource =
    KernelSource { name: "tern_activation", code: concat!(include_str!("../prelude.cuh"), "\n", include_str!("activation.cu")) };

pub struct ActivationCuda {
    gpu: Arc<Gpu>,
    gelu: CudaFunction,
}

impl ActivationCuda {
    pub fn new(gpu: Arc<Gpu>) -> Result<Self> {
        Ok(ActivationCuda { gelu: gpu.function(&SOURCE, "tern_gelu_tanh_mul")?, gpu })
    }

    /// out = gelu_tanh(g)·u over `rows × width` (out contiguous). CPU twin:
    /// [`super::gelu_tanh_mul`].
    pub fn gelu_tanh_mul(&self, g: View<CudaSlice<f32>>, u: View<CudaSlice<f32>>, rows: usize, width: usize, out: NormOut) -> Result<()> {
        check_view("gelu_tanh_mul gate", g.buf.len(), g.offset, g.stride, rows, width)?;
        check_view("gelu_tanh_mul up", u.buf.len(), u.offset, u.stride, rows, width)?;
        if let Some(o) = &out.f32 {
            check_len("gelu_tanh_mul output", o.len(), rows * width)?;
        }
        if let Some(o) = &out.bf16 {
            check_len("gelu_tanh_mul output", o.len(), rows * width)?;
        }
        if rows * width == 0 {
            return Ok(());
        }
        let gp = &self.gpu;
        let (r, w) = (int_arg("gelu rows", rows)?, int_arg("gelu width", width)?);
        let (g_off, g_ld, u_off, u_ld) = (long_arg(g.offset), long_arg(g.stride), long_arg(u.offset), long_arg(u.stride));
        let (g_p, u_p, o_p, o16_p) = (gp.ptr(g.buf), gp.ptr(u.buf), gp.ptr_opt(out.f32.as_deref()), gp.ptr_opt(out.bf16.as_deref()));
        let mut l = gp.stream().launch_builder(&self.gelu);
        l.arg(&g_p).arg(&g_off).arg(&g_ld).arg(&u_p).arg(&u_off).arg(&u_ld).arg(&r).arg(&w).arg(&o_p).arg(&o16_p);
        let blocks = grid_for(rows * width, 256)?.min(65_535);
        let cfg = LaunchConfig { grid_dim: (blocks, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        // SAFETY: argument types match; both views hold rows × width (checked), the grid-stride
        // loop covers every element once.
        unsafe { l.launch(cfg) }.map_err(driver_err("launching tern_gelu_tanh_mul"))?;
        Ok(())
    }
}
