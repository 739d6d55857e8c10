//! Gated activations: `gelu_tanh(G)·U`, elementwise, in place on G.

use rayon::prelude::*;

use super::check_len;
use crate::error::Result;

/// GELU with the tanh approximation, in the reference's f32 operation order:
/// `0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))`.
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const BETA: f32 = 0.797_884_6; // √(2/π)
    const KAPPA: f32 = 0.044715;
    let inner = BETA * (x + KAPPA * (x * x * x));
    0.5 * x * (1.0 + inner.tanh())
}

/// G ← gelu_tanh(G)·U.
pub fn gelu_tanh_mul(g: &mut [f32], u: &[f32]) -> Result<()> {
    check_len("gelu_tanh_mul operand", u.len(), g.len())?;
    const CHUNK: usize = 4096;
    g.par_chunks_mut(CHUNK).zip(u.par_chunks(CHUNK)).for_each(|(g, u)| {
        for (gv, &uv) in g.iter_mut().zip(u) {
            *gv = gelu_tanh(*gv) * uv;
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn gelu_tanh_reference_points() {
        // Values of torch.nn.functional.gelu(x, approximate="tanh") in f32.
        for (x, want) in [(0.0f32, 0.0f32), (1.0, 0.841_192), (-1.0, -0.158_808), (3.0, 2.996_363)] {
            assert!((super::gelu_tanh(x) - want).abs() < 2e-6, "{x}");
        }
    }
}
